"""The GPU manifests' expert-parallel pools ask vLLM for DeepEP's all2all, and the setting reaches
the engine: engine.extra_args passes through rank_engine_spec and engine_args_dict to
AsyncEngineArgs, and the installed vLLM (0.32) takes the value and uses it for these groups.

vLLM's default (allgather_reducescatter) gathers every rank's tokens for every MoE layer, an
estimated ~13 GB per decode step per rank at EP32: far beyond the examples' itl_ms of 50."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from cluster.manifest import PoolRole, load_manifest
from deployments.engine.vllm_engine import engine_args_dict
from deployments.expert_parallel.expert_ranks import rank_engine_spec

REPO = Path(__file__).resolve().parents[3]
PD_EP = REPO / "manifests" / "deepseek-v3-h200-disagg-ep.yaml"
COLOCATED = REPO / "manifests" / "deepseek-v3-h200.yaml"
EXPECTED = {PoolRole.prefill: "deepep_high_throughput", PoolRole.decode: "deepep_low_latency"}


def _rank_args(manifest, pool, rank: int) -> dict:
    ep = pool.expert_parallel
    spec = rank_engine_spec(pool.engine.model_dump(), size=ep.size, rank=rank, address="10.0.0.1", rpc_port=13345,
                            accelerator=manifest.accelerator.value, enable_eplb=ep.enable_eplb,
                            num_redundant_experts=ep.num_redundant_experts)
    return engine_args_dict(manifest.model.model_dump(), spec, manifest.model.path)


@pytest.mark.parametrize("role", [PoolRole.prefill, PoolRole.decode])
def test_each_ep_pool_of_the_gpu_example_gets_its_deepep_kernels_on_every_rank(role):
    from vllm.config import ParallelConfig
    from vllm.config.parallel import All2AllBackend
    from vllm.engine.arg_utils import AsyncEngineArgs

    manifest = load_manifest(PD_EP)
    pool = manifest.pool_with_role(role)
    for rank in (0, pool.expert_parallel.size - 1):
        args = _rank_args(manifest, pool, rank)
        assert args["all2all_backend"] == EXPECTED[role]
        assert AsyncEngineArgs(**args).all2all_backend == EXPECTED[role]
    assert EXPECTED[role] in typing.get_args(All2AllBackend)
    assert "all2all_backend" in {field.name for field in dataclasses.fields(AsyncEngineArgs)}
    # vLLM uses an all2all for these groups (data-parallel attention over the group's ranks), and
    # its config would refuse a misspelt backend rather than fall back.
    config = ParallelConfig(all2all_backend=EXPECTED[role], data_parallel_size=pool.expert_parallel.size,
                            enable_expert_parallel=True)
    assert config.use_all2all and config.all2all_backend == EXPECTED[role]
    with pytest.raises(ValueError, match="all2all_backend"):
        ParallelConfig(all2all_backend=EXPECTED[role].replace("_", "", 1))


def test_the_colocated_example_needs_no_all2all():
    """One TP-8 engine per node, data_parallel_size 1: vLLM runs no all2all, so DeepEP is moot."""
    from vllm.config import ParallelConfig

    (pool,) = load_manifest(COLOCATED).pools
    assert "all2all_backend" not in pool.engine.extra_args
    config = ParallelConfig(tensor_parallel_size=pool.engine.tensor_parallel_size,
                            enable_expert_parallel=pool.engine.extra_args["enable_expert_parallel"])
    assert not config.use_all2all


def test_the_image_guide_says_deepep_is_not_installed_yet():
    for text in ((REPO / "manifests" / "kuberay" / "README.md").read_text(),
                 (REPO / "manifests" / "kuberay" / "Dockerfile").read_text()):
        assert "DeepEP" in text and "deepep_low_latency" in text
