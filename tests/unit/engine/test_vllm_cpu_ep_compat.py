"""CPU expert-parallel compat: pure collectives/top-k math, vLLM interface guard, patches.

No engines, no process groups: collectives are emulated in-process.
"""

import inspect
from types import SimpleNamespace

import pytest
import torch

from deployments.engine import vllm_cpu_ep_compat as compat
from vllm.distributed.device_communicators import all2all as all2all_mod
from vllm.distributed.device_communicators import cpu_communicator as cpu_comm_mod
from vllm.distributed.device_communicators.base_device_communicator import (
    DeviceCommunicatorBase,
)
from vllm.model_executor.layers.fused_moe import modular_kernel as mk_mod
from vllm.model_executor.layers.fused_moe.experts import cpu_moe as cpu_moe_mod

SIZES = [3, 1, 2]


def _chunks(sizes, dim, cols=4):
    # rank r's chunk holds values 100*r + i so rows are traceable; [n_r, cols] or [cols, n_r]
    out = []
    for r, n in enumerate(sizes):
        chunk = (100 * r + torch.arange(n * cols, dtype=torch.float32)).reshape(n, cols)
        out.append(chunk if dim == 0 else chunk.t().contiguous())
    return out


def _gather_over_ranks(chunks, sizes, dim):
    """Each rank pads; all_gather concatenates every rank's padded tensor along dim."""
    max_rows = max(sizes)
    padded_by_rank = {}

    def make_all_gather(rank):
        def all_gather(padded):
            padded_by_rank[rank] = padded
            assert padded.shape[dim] == max_rows
            others = []
            for r, c in enumerate(chunks):  # what every other rank would have padded
                pad = list(c.shape)
                pad[dim] = max_rows - c.shape[dim]
                others.append(padded if r == rank else torch.cat([c, c.new_full(pad, -1.0)], dim))
            return torch.cat(others, dim=dim)
        return all_gather

    return [compat.all_gatherv_padded(chunks[r], sizes, dim, make_all_gather(r))
            for r in range(len(sizes))]


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("sizes", [SIZES, [2, 0, 3]])
def test_all_gatherv_padded_returns_real_rows_in_rank_order(dim, sizes):
    chunks = _chunks(sizes, dim)
    expected = torch.cat(chunks, dim=dim)
    for result in _gather_over_ranks(chunks, sizes, dim):
        assert torch.equal(result, expected)  # padding (-1 on peers, 0 here) never leaks


def test_all_gatherv_padded_list_input_returns_list():
    hidden, ids = _chunks(SIZES, 0), [torch.full((n, 2), r, dtype=torch.int32) for r, n in enumerate(SIZES)]
    calls = []

    def all_gather(padded):  # rank 1 view; other ranks' padded copies are built here
        calls.append(padded.dtype)
        src = hidden if padded.dtype == torch.float32 else ids
        parts = [torch.cat([c, c.new_zeros((3 - c.shape[0],) + tuple(c.shape[1:]))]) for c in src]
        return torch.cat(parts)

    out = compat.all_gatherv_padded([hidden[1], ids[1]], SIZES, 0, all_gather)
    assert isinstance(out, list) and calls == [torch.float32, torch.int32]
    assert torch.equal(out[0], torch.cat(hidden)) and torch.equal(out[1], torch.cat(ids))


def test_all_gatherv_padded_all_empty_skips_collective():
    def all_gather(_):
        raise AssertionError("no collective when every chunk is empty")

    out = compat.all_gatherv_padded(torch.zeros(0, 4), [0, 0], 0, all_gather)
    assert out.shape == (0, 4)


@pytest.mark.parametrize("dim", [0, 1])
def test_reduce_scatterv_via_allreduce_gives_each_rank_its_slice(dim):
    per_rank = [torch.randn(6, 5) if dim == 0 else torch.randn(5, 6) for _ in SIZES]
    total = sum(per_rank)
    inputs_before = [t.clone() for t in per_rank]

    def all_reduce(x):  # in place, like CpuCommunicator.all_reduce
        x.copy_(sum(t.movedim(dim, 0) for t in per_rank))
        return x

    start = 0
    for rank, n in enumerate(SIZES):
        got = compat.reduce_scatterv_via_allreduce(per_rank[rank], SIZES, dim, rank, all_reduce)
        assert torch.allclose(got, total.narrow(dim, start, n))
        start += n
    assert all(torch.equal(a, b) for a, b in zip(per_rank, inputs_before))


def test_localize_topk_maps_ids_zeroes_remote_weights_without_mutating():
    expert_map = torch.tensor([-1, 0, -1, 1], dtype=torch.int32)
    topk_ids = torch.tensor([[1, 3], [0, 1], [2, 0]], dtype=torch.int32)
    topk_weights = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]])
    ids_before, weights_before = topk_ids.clone(), topk_weights.clone()

    ids, weights = compat.localize_topk(topk_ids, topk_weights, expert_map)

    assert torch.equal(ids, torch.tensor([[0, 1], [0, 0], [0, 0]], dtype=torch.int32))
    assert torch.equal(weights, torch.tensor([[0.6, 0.4], [0.0, 0.3], [0.0, 0.0]]))
    assert torch.equal(topk_ids, ids_before) and torch.equal(topk_weights, weights_before)


# ---------------------------------------------------------------- interface guard (must fail)


def _original_apply():
    apply = cpu_moe_mod.CPUUnquantizedExperts.__dict__["apply"]
    return getattr(apply, "__wrapped__", apply)


def test_vllm_interface_the_patches_rely_on():
    comm = cpu_comm_mod.CpuCommunicator
    assert issubclass(comm, DeviceCommunicatorBase)
    for name in ("all_gatherv", "reduce_scatterv"):
        params = compat.ALL_GATHERV_PARAMS if name == "all_gatherv" else compat.REDUCE_SCATTERV_PARAMS
        assert tuple(inspect.signature(getattr(DeviceCommunicatorBase, name)).parameters) == params
        # The gap still exists: vLLM's CPU communicator defines neither (else drop our patch).
        assert vars(comm).get(name) in (None, getattr(compat, f"_cpu_{name}")), name
    with pytest.raises(NotImplementedError):
        DeviceCommunicatorBase.all_gatherv(object(), torch.zeros(1), 0, [1])
    with pytest.raises(NotImplementedError):
        DeviceCommunicatorBase.reduce_scatterv(object(), torch.zeros(1), 0, [1])
    assert "self.reduce_scatterv(" in inspect.getsource(DeviceCommunicatorBase.reduce_scatterv_into_output)
    # What our patches call on the communicator.
    assert list(inspect.signature(comm.all_gather).parameters) == ["self", "input_", "dim"]
    assert list(inspect.signature(comm.all_reduce).parameters) == ["self", "input_"]
    assert "all_gather_into_tensor" in inspect.getsource(comm.all_gather)
    assert "AgRsAll2AllManager" in inspect.getsource(comm.__init__)
    # The all2all manager's call sites.
    manager = all2all_mod.AgRsAll2AllManager
    for method in ("dispatch_router_logits", "dispatch"):
        assert ".all_gatherv(" in inspect.getsource(getattr(manager, method)), method
    assert ".reduce_scatterv(" in inspect.getsource(manager.combine)
    assert ".reduce_scatterv_into_output(" in inspect.getsource(manager.combine_into_output)


def test_vllm_cpu_moe_interface_the_patches_rely_on():
    experts = cpu_moe_mod.CPUUnquantizedExperts
    params = inspect.signature(_original_apply()).parameters
    assert set(compat.EXPERTS_APPLY_PARAMS) <= set(params)
    assert "expert_map" not in inspect.getsource(_original_apply()).split(") -> None:", 1)[1], (
        "CPUUnquantizedExperts.apply now reads expert_map: the localizing wrapper may be obsolete"
    )
    for sub in (cpu_moe_mod.X86CPUUnquantizedExperts, cpu_moe_mod.ArmCPUUnquantizedExperts,
                cpu_moe_mod.PowerCPUUnquantizedExperts):
        assert issubclass(sub, experts) and "apply" not in vars(sub), sub
    kernel_src = inspect.getsource(mk_mod)
    assert "self.fused_experts.apply(" in kernel_src and "expert_map=expert_map," in kernel_src


# ---------------------------------------------------------------- patches


def test_apply_patches_is_idempotent():
    compat.apply_patches()
    first = cpu_moe_mod.CPUUnquantizedExperts.apply
    compat.apply_patches()
    assert cpu_moe_mod.CPUUnquantizedExperts.apply is first
    assert not hasattr(first.__wrapped__, "__wrapped__")  # wrapped exactly once
    assert cpu_comm_mod.CpuCommunicator.all_gatherv is compat._cpu_all_gatherv
    assert cpu_comm_mod.CpuCommunicator.reduce_scatterv is compat._cpu_reduce_scatterv


class _FakeDist:
    """torch.distributed stand-in for rank `rank`: other ranks contribute `peers` per call."""

    def __init__(self, rank, peers):
        self.rank, self.peers = rank, list(peers)

    def all_gather_into_tensor(self, output, input_, group=None):
        chunks = self.peers.pop(0)
        parts = [input_ if r == self.rank else torch.cat(
            [c, c.new_zeros((input_.shape[0] - c.shape[0],) + tuple(c.shape[1:]))])
            for r, c in enumerate(chunks)]
        output.copy_(torch.cat(parts))

    def all_reduce(self, input_, group=None):
        input_.add_(self.peers.pop(0))


def _fake_communicator(rank, world_size, peers):
    comm = object.__new__(cpu_comm_mod.CpuCommunicator)
    comm.world_size, comm.rank_in_group, comm.device_group = world_size, rank, None
    comm.dist_module = _FakeDist(rank, peers)
    return comm


def test_patched_communicator_all_gatherv_uses_padded_gather(monkeypatch):
    compat.apply_patches()
    hidden, ids = _chunks(SIZES, 0), [torch.full((n, 2), r, dtype=torch.int32) for r, n in enumerate(SIZES)]
    comm = _fake_communicator(2, 3, [hidden, ids])
    seen = []
    real = compat.all_gatherv_padded
    monkeypatch.setattr(compat, "all_gatherv_padded", lambda *a: seen.append(a[1]) or real(*a))

    out = comm.all_gatherv([hidden[2], ids[2]], dim=0, sizes=SIZES)

    assert seen and seen[0] == SIZES  # list input recurses per tensor
    assert torch.equal(out[0], torch.cat(hidden)) and torch.equal(out[1], torch.cat(ids))
    with pytest.raises(NotImplementedError):
        comm.all_gatherv(hidden[2], dim=1, sizes=SIZES)
    with pytest.raises(ValueError):
        comm.all_gatherv(hidden[0], dim=0, sizes=SIZES)  # 3 rows, but rank 2 owns 2


def test_patched_communicator_reduce_scatterv_uses_allreduce(monkeypatch):
    compat.apply_patches()
    mine, theirs = torch.randn(6, 4), torch.randn(6, 4)
    comm = _fake_communicator(1, 3, [theirs])
    seen = []
    real = compat.reduce_scatterv_via_allreduce
    monkeypatch.setattr(compat, "reduce_scatterv_via_allreduce",
                        lambda *a: seen.append(a[1:4]) or real(*a))

    out = comm.reduce_scatterv(mine, dim=0, sizes=SIZES)
    assert seen == [(SIZES, 0, 1)]
    assert torch.allclose(out, (mine + theirs)[3:4])
    into = torch.empty(1, 4)
    comm.dist_module.peers.append(theirs)
    comm.reduce_scatterv_into_output(mine, into, dim=0, sizes=SIZES)  # base delegates to ours
    assert torch.allclose(into, (mine + theirs)[3:4])


def _experts_and_spy(monkeypatch):
    experts = object.__new__(cpu_moe_mod.CPUUnquantizedExperts)
    experts._use_zentorch = False
    experts.quant_config = SimpleNamespace(w1_bias=None, w2_bias=None)
    calls = []
    monkeypatch.setattr(cpu_moe_mod, "cpu_fused_moe", lambda *args: calls.append(args))
    return experts, calls


def _apply_kwargs(expert_map, on_input=False):
    return dict(
        output=torch.zeros(3, 8), hidden_states=torch.ones(3, 8), w1=None, w2=None,
        topk_weights=torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]]),
        topk_ids=torch.tensor([[1, 3], [0, 1], [2, 0]], dtype=torch.int32),
        activation=SimpleNamespace(value="silu"), global_num_experts=4, expert_map=expert_map,
        a1q_scale=None, a2_scale=None, workspace13=None, workspace2=None,
        expert_tokens_meta=None, apply_router_weight_on_input=on_input,
    )


def test_wrapped_cpu_experts_apply_localizes_before_the_kernel(monkeypatch):
    compat.apply_patches()
    experts, calls = _experts_and_spy(monkeypatch)
    kwargs = _apply_kwargs(torch.tensor([-1, 0, -1, 1], dtype=torch.int32))

    experts.apply(**kwargs)  # keyword-only, as modular_kernel calls it

    # cpu_fused_moe(out, x, w13, w2, b13, b2, topk_weights, topk_ids, act, isa, skip_weighted)
    args = calls[0]
    assert torch.equal(args[7], torch.tensor([[0, 1], [0, 0], [0, 0]], dtype=torch.int32))
    assert torch.equal(args[6], torch.tensor([[0.6, 0.4], [0.0, 0.3], [0.0, 0.0]]))
    assert torch.equal(kwargs["topk_ids"], torch.tensor([[1, 3], [0, 1], [2, 0]], dtype=torch.int32))


def test_wrapped_cpu_experts_apply_passes_through_without_expert_map(monkeypatch):
    compat.apply_patches()
    experts, calls = _experts_and_spy(monkeypatch)
    kwargs = _apply_kwargs(None)
    experts.apply(**kwargs)
    assert calls[0][6] is kwargs["topk_weights"] and calls[0][7] is kwargs["topk_ids"]


def test_wrapped_cpu_experts_apply_zeroes_remote_rows_when_weight_is_on_input(monkeypatch):
    compat.apply_patches()
    experts, calls = _experts_and_spy(monkeypatch)
    kwargs = _apply_kwargs(torch.tensor([-1, 0, -1, 1], dtype=torch.int32), on_input=True)
    kwargs["topk_ids"], kwargs["topk_weights"] = kwargs["topk_ids"][:, :1], kwargs["topk_weights"][:, :1]
    experts.apply(**kwargs)
    assert torch.equal(calls[0][1][:, 0], torch.tensor([1.0, 0.0, 0.0]))  # ids 1, 0, 2
    assert torch.equal(kwargs["hidden_states"], torch.ones(3, 8))


def test_missing_vllm_symbol_raises_runtime_error_naming_it(monkeypatch):
    monkeypatch.setattr(compat, "_CPU_MOE_MODULE", "vllm.model_executor.layers.fused_moe.nope")
    with pytest.raises(RuntimeError, match="fused_moe.nope.CPUUnquantizedExperts"):
        compat.apply_patches()


def test_changed_signature_raises_runtime_error(monkeypatch):
    def renamed(self, input_, dim=0, split_sizes=None):
        raise NotImplementedError

    monkeypatch.setattr(DeviceCommunicatorBase, "all_gatherv", renamed)
    with pytest.raises(RuntimeError, match="DeviceCommunicatorBase.all_gatherv"):
        compat.apply_patches()


def test_grouped_topk_with_correction_bias_is_localized_and_counted_exactly_over_ranks():
    """DeepSeek-V3/GLM-4.5 routing (sigmoid scores, groups, correction bias) happens in vLLM's
    router before the experts run, so the shim sees its ids: across both ranks, the localized
    routes and the per-expert counts (expert_observation's) must add up to exactly the router's
    global choice."""
    from vllm.model_executor.layers.fused_moe.router.grouped_topk_router import grouped_topk

    from deployments.engine.expert_route_counts import RouteCounters
    from deployments.engine.vllm_cpu_ep_compat import localize_topk

    generator = torch.Generator().manual_seed(3)
    tokens, experts = 64, 8
    hidden = torch.randn(tokens, 16, generator=generator)
    logits = torch.randn(tokens, experts, generator=generator)
    bias = torch.randn(experts, generator=generator) * 0.5
    kwargs = dict(topk=2, renormalize=True, num_expert_group=4, topk_group=2, scoring_func="sigmoid",
                  routed_scaling_factor=2.5)
    weights, ids = grouped_topk(hidden, logits, e_score_correction_bias=bias, **kwargs)
    _, ids_without_bias = grouped_topk(hidden, logits, e_score_correction_bias=None, **kwargs)
    assert not torch.equal(ids, ids_without_bias)  # the bias changes which experts are picked
    groups = ids.long() // 2  # 8 experts in 4 groups of 2
    assert all(len(set(row.tolist())) <= 2 for row in groups)  # at most topk_group groups per token
    maps = [torch.tensor([0, 1, 2, 3, -1, -1, -1, -1]), torch.tensor([-1, -1, -1, -1, 0, 1, 2, 3])]
    counts: dict[int, int] = {}
    for expert_map in maps:  # one worker per rank
        rank_counters = RouteCounters()
        rank_counters.add_routes(ids, expert_map, experts)
        for expert, n in rank_counters.snapshot().items():
            assert expert_map[expert] >= 0  # a rank reports only the experts it holds
            counts[expert] = counts.get(expert, 0) + n
    global_choice = torch.bincount(ids.long().flatten(), minlength=experts).tolist()
    assert counts == {e: n for e, n in enumerate(global_choice) if n}
    kept = sum(localize_topk(ids, weights, m)[1] for m in maps)
    assert torch.allclose(kept, weights)  # every slot's weight is kept on exactly one rank
