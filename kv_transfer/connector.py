"""MoeServeConnector: our vLLM v1 KV connector for prefill/decode disaggregation (pull-based).

Loaded by module path (`KVTransferConfig(kv_connector="MoeServeConnector",
kv_connector_module_path="kv_transfer.connector", kv_role="kv_both")`). vLLM builds one
instance per role: SCHEDULER in the engine-core process (SchedulerSide decides what to keep,
pull, load from the KV pool, store and release) and WORKER in the worker process (WorkerSide
moves the bytes). The scheduler's StepPlan reaches the worker as this step's connector
metadata.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)

from kv_transfer.connector_scheduler import SchedulerSide, StepPlan
from kv_transfer.pool import engine_wiring
from kv_transfer.params import LoadTiming
from kv_transfer.pool.store import PoolSettings
from kv_transfer.settings import ConnectorSettings

if TYPE_CHECKING:
    import torch

    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class MoeServeConnectorMetadata(KVConnectorMetadata):
    def __init__(self, plan: StepPlan):
        self.plan = plan


class MoeServeWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, each step: how long the loads that finished took."""

    def __init__(self, load_times: dict[str, LoadTiming]):
        self.load_times = load_times

    def aggregate(self, other: "MoeServeWorkerMetadata") -> "MoeServeWorkerMetadata":
        merged = dict(self.load_times)
        for request_id, timing in other.load_times.items():
            merged[request_id] = timing if request_id not in merged else merged[request_id].slower(timing)
        return MoeServeWorkerMetadata(merged)


def tensor_parallel_rank(vllm_config: "VllmConfig") -> int:
    """This worker's tensor-parallel rank: its shard of the KV heads, its KV port (first + rank)
    and its pool keys. vLLM sets up the model-parallel groups before it builds the worker's
    connector; with TP > 1 a missing group is an error, not rank 0 (every rank would bind the
    first port)."""
    if vllm_config.parallel_config.tensor_parallel_size == 1:
        return 0
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def kv_block_bytes(kv_cache_config: "KVCacheConfig | None") -> int:
    """Bytes of one block of every layer of this engine's KV cache (this worker's shard)."""
    if kv_cache_config is None:
        return 0
    return sum(len(group.layer_names) * group.kv_cache_spec.page_size_bytes
               for group in kv_cache_config.kv_cache_groups)


class MoeServeConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._settings = ConnectorSettings.from_extra_config(vllm_config.kv_transfer_config.kv_connector_extra_config)
        engine_tp = vllm_config.parallel_config.tensor_parallel_size
        if self._settings.tp_size != engine_tp:  # the ports reserved would not match the workers
            raise ValueError(f"kv connector settings are for {self._settings.tp_size} tensor-parallel ranks, "
                             f"the engine runs {engine_tp} (set tp_size from engine.tensor_parallel_size)")
        self._scheduler: SchedulerSide | None = None
        self._worker = None
        self._releaser = None
        pool_settings = PoolSettings.from_dict(self._settings.pool)
        if role == KVConnectorRole.SCHEDULER:
            from kv_transfer.releaser import BackgroundReleaser

            pool = pool_settings and engine_wiring.scheduler_tier(pool_settings, vllm_config, kv_cache_config)
            if pool:
                pool.warm_up(engine_wiring.WARM_UP_S)
            self._releaser = BackgroundReleaser(self._settings.transfer_timeout_s)
            self._scheduler = SchedulerSide(self._settings, vllm_config.cache_config.block_size,
                                            release_now=self._releaser.submit, pool=pool,
                                            block_bytes=kv_block_bytes(kv_cache_config))
        else:
            from kv_transfer.connector_worker import WorkerSide

            tp_rank = tensor_parallel_rank(vllm_config)
            pool = pool_settings and engine_wiring.worker_tier(pool_settings, vllm_config, kv_cache_config, tp_rank)
            self._worker = WorkerSide(self._settings, pool=pool, tp_rank=tp_rank)

    # -- scheduler side -----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        local = blocks.get_unhashed_block_ids() if num_external_tokens > 0 else []
        self._scheduler.after_alloc(request, local, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return MoeServeConnectorMetadata(self._scheduler.take_plan())

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, MoeServeWorkerMetadata):
            self._scheduler.record_load_times(meta.load_times)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        normally = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        return self._scheduler.finished(request, list(block_ids), normally)

    # -- worker side ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]):
        from kv_transfer.kv_pages import KVPages

        # The block count tells the page map which dimension holds blocks (backends differ).
        self._worker.register(KVPages(kv_caches, num_blocks=self._kv_cache_config.num_blocks))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        if isinstance(metadata, MoeServeConnectorMetadata):
            self._worker.apply(metadata.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # pulls complete before the request is scheduled (asynchronous load)

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata: Any, **kwargs: Any) -> None:
        return  # pull-based: prefill keeps its blocks in place; nothing is pushed

    def wait_for_save(self) -> None:
        return

    def build_connector_worker_meta(self) -> MoeServeWorkerMetadata | None:
        times = self._worker.take_load_times()
        return MoeServeWorkerMetadata(times) if times else None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._worker.results()
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._releaser is not None:
            self._releaser.shutdown()
