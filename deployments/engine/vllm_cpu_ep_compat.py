"""What vLLM 0.32's CPU build lacks for expert parallelism, patched in only where missing.

Two gaps (docs/expert_parallel_cpu.md, sections 2 and 3):

1. ``CpuCommunicator`` inherits the ``NotImplementedError`` stubs of ``all_gatherv`` /
   ``reduce_scatterv``; the allgather-reducescatter all2all manager calls both once DP > 1.
   Rule: gather = pad every rank's chunk to ``max(sizes)`` rows, plain all-gather, slice the
   real rows back out; reduce-scatter = all-reduce, keep rows
   ``sum(sizes[:r]) : sum(sizes[:r]) + sizes[r]``.
2. ``CPUUnquantizedExperts.apply`` ignores ``expert_map``, so global expert ids index the
   rank-local weight tensor (segfault). Rule: map ids through ``expert_map`` (global -> local,
   -1 = other rank), zero the weights of non-local slots and point them at local expert 0.

Importing this module applies the patches, so naming ``CpuExpertParallelCompat`` as vLLM's
``worker_extension_cls`` installs them in every worker before its model is built. vLLM takes one
extension class, so this one also carries the platform-neutral observation methods
(``expert_observation.ExpertObservation``: held experts, routed-token counts, weight bytes)."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from deployments.engine.expert_observation import ExpertObservation
from deployments.engine.vllm_interface import require_params, vllm_symbol

logger = logging.getLogger(__name__)

_BASE_MODULE = "vllm.distributed.device_communicators.base_device_communicator"
_CPU_COMM_MODULE = "vllm.distributed.device_communicators.cpu_communicator"
_CPU_MOE_MODULE = "vllm.model_executor.layers.fused_moe.experts.cpu_moe"
_OWNER = "deployments/engine/vllm_cpu_ep_compat.py"
# Parameter names each patch reads or passes on; a rename in vLLM must fail apply_patches().
ALL_GATHERV_PARAMS = ("self", "input_", "dim", "sizes")
REDUCE_SCATTERV_PARAMS = ("self", "input_", "dim", "sizes")
EXPERTS_APPLY_PARAMS = ("self", "hidden_states", "topk_weights", "topk_ids", "expert_map",
                        "apply_router_weight_on_input")
_PATCH_MARK = "__moe_serve_ep_compat__"


# ---------------------------------------------------------------- pure tensor functions

def all_gatherv_padded(
    tensor: torch.Tensor | Sequence[torch.Tensor],
    sizes: Sequence[int],
    dim: int,
    all_gather: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor | list[torch.Tensor]:
    """Gather chunks of ``sizes[r]`` rows (along ``dim``) from every rank, in rank order.

    ``all_gather(padded)`` must concatenate every rank's equally shaped tensor along ``dim``.
    A list input gathers each tensor and returns a list, as vLLM's ``all_gatherv`` does.
    """
    if not isinstance(tensor, torch.Tensor):
        return [all_gatherv_padded(t, sizes, dim, all_gather) for t in tensor]
    dim = dim % tensor.dim()
    max_rows = max(sizes)
    if max_rows == 0:  # every rank is empty, so every rank skips the collective
        return tensor.clone()
    pad_shape = list(tensor.shape)
    pad_shape[dim] = max_rows - tensor.shape[dim]
    if pad_shape[dim] < 0:
        raise ValueError(f"chunk has {tensor.shape[dim]} rows along dim {dim}, max(sizes)={max_rows}")
    padded = torch.cat([tensor, tensor.new_zeros(pad_shape)], dim=dim)  # [.., max_rows, ..]
    gathered = all_gather(padded)  # [.., world * max_rows, ..]
    if gathered.shape[dim] != len(sizes) * max_rows:
        raise ValueError(
            f"all_gather returned {gathered.shape[dim]} rows along dim {dim}, "
            f"expected {len(sizes)} ranks x {max_rows}"
        )
    chunks = [gathered.narrow(dim, r * max_rows, n) for r, n in enumerate(sizes)]
    return torch.cat(chunks, dim=dim)  # [.., sum(sizes), ..]


def reduce_scatterv_via_allreduce(
    tensor: torch.Tensor,
    sizes: Sequence[int],
    dim: int,
    rank: int,
    all_reduce: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Sum ``tensor`` over ranks and return this rank's ``sizes[rank]`` rows along ``dim``.

    ``all_reduce`` may work in place (it gets a private copy). Moves world_size x the data of a
    real reduce-scatter: fine for tiny CPU models.
    """
    dim = dim % tensor.dim()
    rows = tensor.movedim(dim, 0).contiguous().clone()  # [sum(sizes), ...]
    if rows.shape[0] != sum(sizes):
        raise ValueError(f"tensor has {rows.shape[0]} rows along dim {dim}, sum(sizes)={sum(sizes)}")
    summed = all_reduce(rows)  # [sum(sizes), ...]
    start = sum(sizes[:rank])
    return summed[start : start + sizes[rank]].movedim(0, dim).contiguous()  # [.., sizes[rank], ..]


def localize_topk(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, expert_map: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global top-k ids -> this rank's local ids; slots routed elsewhere get weight 0, id 0."""
    local_ids = expert_map[topk_ids.long()]  # [M, k], -1 where the expert is on another rank
    remote = local_ids < 0  # [M, k]
    weights = topk_weights.masked_fill(remote, 0).contiguous()  # [M, k]
    ids = local_ids.clamp_min(0).to(topk_ids.dtype).contiguous()  # [M, k]
    return ids, weights


# ---------------------------------------------------------------- patches

def _symbol(module_name: str, name: str) -> Any:
    return vllm_symbol(module_name, name, _OWNER)


def _require_params(fn: Callable, qualname: str, names: Sequence[str]) -> inspect.Signature:
    return require_params(fn, qualname, names, _OWNER)


def _cpu_all_gatherv(self, input_, dim: int = 0, sizes: list[int] | None = None):
    if dim != 0:  # same restriction as CudaCommunicator.all_gatherv
        raise NotImplementedError("only dim 0 all-gatherv is supported")
    tensors = [input_] if isinstance(input_, torch.Tensor) else list(input_)
    if sizes is None:
        sizes = [tensors[0].shape[0]] * self.world_size
    if len(sizes) != self.world_size:
        raise ValueError(f"all_gatherv got {len(sizes)} sizes for {self.world_size} ranks")
    for t in tensors:
        if t.shape[0] != sizes[self.rank_in_group]:
            raise ValueError(f"{t.shape[0]} rows != sizes[{self.rank_in_group}]={sizes[self.rank_in_group]}")
    return all_gatherv_padded(input_, sizes, 0, lambda padded: self.all_gather(padded, 0))


def _cpu_reduce_scatterv(self, input_, dim: int = -1, sizes: list[int] | None = None):
    if sizes is None:
        total = input_.shape[dim]
        if total % self.world_size:
            raise ValueError(f"{total} rows do not split evenly over {self.world_size} ranks")
        sizes = [total // self.world_size] * self.world_size
    return reduce_scatterv_via_allreduce(input_, sizes, dim, self.rank_in_group, self.all_reduce)


def _patch_communicator() -> None:
    base = _symbol(_BASE_MODULE, "DeviceCommunicatorBase")
    comm = _symbol(_CPU_COMM_MODULE, "CpuCommunicator")
    for name in ("all_gather", "all_reduce"):  # the collectives both patches are built on
        if not callable(getattr(comm, name, None)):
            raise RuntimeError(f"moe-serve EP compat needs CpuCommunicator.{name}, which is missing")
    patches = (
        ("all_gatherv", _cpu_all_gatherv, ALL_GATHERV_PARAMS),
        ("reduce_scatterv", _cpu_reduce_scatterv, REDUCE_SCATTERV_PARAMS),
    )
    for name, impl, params in patches:
        stub = getattr(base, name, None)
        if stub is None:
            raise RuntimeError(f"moe-serve EP compat needs DeviceCommunicatorBase.{name}, which is missing")
        _require_params(stub, f"DeviceCommunicatorBase.{name}", params)
        current = getattr(comm, name)
        if getattr(current, _PATCH_MARK, False):
            continue
        if current is not stub:
            logger.info("CpuCommunicator.%s is implemented by vLLM; not patching it", name)
            continue
        setattr(impl, _PATCH_MARK, True)
        setattr(comm, name, impl)
        logger.info(
            "Patched CpuCommunicator.%s: vLLM's CPU build inherits the NotImplementedError stub "
            "and the allgather-reducescatter all2all manager needs it for DP+EP", name,
        )


def _patch_cpu_experts() -> None:
    experts = _symbol(_CPU_MOE_MODULE, "CPUUnquantizedExperts")
    original = experts.__dict__.get("apply")
    if original is None:
        raise RuntimeError("moe-serve EP compat needs CPUUnquantizedExperts.apply defined on the class")
    if getattr(original, _PATCH_MARK, False):
        return
    signature = _require_params(original, "CPUUnquantizedExperts.apply", EXPERTS_APPLY_PARAMS)

    @functools.wraps(original)
    def apply(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        arguments = bound.arguments
        expert_map = arguments.get("expert_map")
        if expert_map is not None:
            ids, weights = localize_topk(arguments["topk_ids"], arguments["topk_weights"], expert_map)
            if arguments.get("apply_router_weight_on_input"):
                # top-1 with the weight already in hidden_states: the kernel ignores weights,
                # so zero the rows routed elsewhere instead (exact only without biases).
                if self.w1_bias is not None or self.w2_bias is not None:
                    raise NotImplementedError(
                        "expert_map with apply_router_weight_on_input and MoE biases is not supported"
                    )
                remote = expert_map[arguments["topk_ids"].long()] < 0  # [M, 1]
                arguments["hidden_states"] = arguments["hidden_states"].masked_fill(remote[:, :1], 0)
            arguments["topk_ids"], arguments["topk_weights"] = ids, weights
        return original(*bound.args, **bound.kwargs)

    setattr(apply, _PATCH_MARK, True)
    experts.apply = apply
    logger.info(
        "Patched CPUUnquantizedExperts.apply: vLLM's CPU kernel ignores expert_map, so global "
        "expert ids are localized (non-local slots get weight 0) before the original runs"
    )


def apply_patches() -> None:
    """Install the missing CPU pieces; idempotent. Raises RuntimeError if vLLM's interface moved."""
    _patch_communicator()
    _patch_cpu_experts()


# Import-time side effect on purpose: vLLM imports worker_extension_cls in every worker
# before distributed init and model build (v1/worker/worker_base.py, init_worker).
apply_patches()


class CpuExpertParallelCompat(ExpertObservation):
    """``worker_extension_cls="deployments.engine.vllm_cpu_ep_compat.CpuExpertParallelCompat"``.

    Nothing of its own: importing this module installed the CPU patches; the methods are
    ExpertObservation's (their names must not exist on vLLM's CPUWorker, vLLM asserts it).
    """
