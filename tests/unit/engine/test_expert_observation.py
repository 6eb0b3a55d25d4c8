"""Expert observation on every platform: the route counters (tensor code, on CPU tensors), the
hook inside vLLM's real modular kernel, the worker-extension methods, and the vLLM interface
they rely on (fails when vLLM moves it)."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import logging
from pathlib import Path
from types import SimpleNamespace

import torch

from deployments.engine import expert_observation as observation
from deployments.engine.expert_observation import (ExpertObservation, count_dispatched_routes, expert_layer_record,
                                                   logical_experts_of)
from deployments.engine.expert_route_counts import RouteCounters, held_route_targets, local_expert_owners
from vllm.model_executor.layers.fused_moe import modular_kernel as mk
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

# 8 experts, this rank holds 2 and 3 (local slots 0 and 1), the others are elsewhere.
EXPERT_MAP = torch.tensor([-1, -1, 0, 1, -1, -1, -1, -1], dtype=torch.int32)


def test_held_route_targets_send_routes_elsewhere_and_empty_slots_to_the_discard_entry():
    topk_ids = torch.tensor([[0, 2], [3, 2], [-1, 7]], dtype=torch.int32)
    assert held_route_targets(topk_ids, EXPERT_MAP, 8).tolist() == [8, 2, 3, 2, 8, 8]
    assert held_route_targets(topk_ids, None, 8).tolist() == [0, 2, 3, 2, 8, 7]  # holds every expert


def test_counts_accumulate_in_place_over_layers_and_report_held_experts_only():
    counters = RouteCounters()
    counters.add_routes(torch.tensor([[0, 2], [3, 2]]), EXPERT_MAP, 8)  # layer 0
    (counts,) = counters._counts.values()
    address = counts.data_ptr()
    counters.add_routes(torch.tensor([[2, 5]]), EXPERT_MAP, 8)  # layer 1
    # The same memory every time: a CUDA graph captured with it adds there at each replay.
    assert counters._counts[("cpu", 8)].data_ptr() == address
    assert counters.snapshot() == {2: 3, 3: 1}


def test_no_counter_is_created_inside_a_graph_capture_but_an_existing_one_keeps_counting():
    capturing = {"now": True}
    counters = RouteCounters(is_capturing=lambda device: capturing["now"])
    assert counters.add_routes(torch.tensor([[2, 3]]), EXPERT_MAP, 8) is False  # zero-fill would be captured
    assert counters.snapshot() == {}
    capturing["now"] = False
    assert counters.add_routes(torch.tensor([[2, 3]]), EXPERT_MAP, 8)  # vLLM's eager profile run
    capturing["now"] = True
    assert counters.add_routes(torch.tensor([[3, 3]]), EXPERT_MAP, 8)
    assert counters.snapshot() == {2: 1, 3: 3}


def test_local_expert_owners_invert_the_expert_map():
    round_robin = torch.tensor([0, -1, 1, -1, 2, -1], dtype=torch.int32)  # this rank: experts 0, 2, 4
    assert local_expert_owners(round_robin, 3, torch.device("cpu")).tolist() == [0, 2, 4]
    assert local_expert_owners(None, 3, torch.device("cpu")).tolist() == [0, 1, 2]


def test_batched_dispatchers_are_counted_from_their_per_expert_token_counts():
    counters = RouteCounters()
    arguments = dict(topk_ids=torch.tensor([[0, 1]]), global_num_experts=8, local_num_experts=2,
                     expert_map=EXPERT_MAP,
                     expert_tokens_meta=mk.ExpertTokensMetadata(torch.tensor([5, 0], dtype=torch.int32), None))
    count_dispatched_routes(arguments, counters)
    assert counters.snapshot() == {2: 5}  # the ids (this rank's own tokens, pre-dispatch) are ignored
    arguments["expert_tokens_meta"] = None
    arguments["topk_ids"] = torch.tensor([[3, 0]])
    count_dispatched_routes(arguments, counters)
    assert counters.snapshot() == {2: 5, 3: 1}


def test_a_counting_failure_is_logged_once_and_never_raises(caplog, monkeypatch):
    monkeypatch.setattr(observation, "_warned", set())
    # An expert map shorter than the ids' range: indexing it fails inside the counting.
    broken = dict(topk_ids=torch.tensor([[5]]), global_num_experts=8, local_num_experts=2,
                  expert_map=torch.tensor([0]), expert_tokens_meta=None)
    with caplog.at_level(logging.WARNING, logger=observation.__name__):
        for _ in range(3):  # three layers of one forward: the forward itself goes on
            count_dispatched_routes(broken, RouteCounters())
    assert len([r for r in caplog.records if "not counted" in r.getMessage()]) == 1


# ---------------------------------------------------------------- the hook in vLLM's kernel


class _GatheringPrepare:
    """A dispatcher that hands the experts every rank's tokens (as the all-gather one does)."""

    def __init__(self, gathered_ids):
        self.gathered_ids = gathered_ids

    def supports_async(self):
        return False

    def prepare(self, a1, topk_weights, topk_ids, *args, **kwargs):
        rows = self.gathered_ids.shape[0]
        return (a1.new_zeros(rows, a1.shape[1]), None, None, self.gathered_ids,
                topk_weights.new_ones(rows, topk_weights.shape[1]))


class _RecordingExperts:
    expects_unquantized_inputs = False
    quant_config = None
    a2_scale = None

    def __init__(self):
        self.seen_ids = None

    def moe_problem_size(self, a1, w1, w2, topk_ids):
        return w1.shape[0], a1.shape[0], w1.shape[1], a1.shape[1], topk_ids.shape[1]

    def apply(self, *, topk_ids, **kwargs):
        self.seen_ids = topk_ids


def test_vllms_modular_kernel_counts_the_dispatched_tokens_not_the_ranks_own(monkeypatch):
    """vLLM's real FusedMoEKernelModularImpl.apply -> _prepare -> (our wrapped) _fused_experts,
    with a fake dispatcher and fake experts: what is counted is what the experts compute."""
    observation.install_route_counting()
    own_ids = torch.tensor([[2, 0]])  # this rank's one token
    gathered = torch.tensor([[2, 0], [3, 2], [3, 6]])  # after the all-gather: every rank's tokens
    kernel = object.__new__(mk.FusedMoEKernelModularImpl)
    kernel.prepare_finalize, kernel.fused_experts = _GatheringPrepare(gathered), _RecordingExperts()
    kernel._allocate_buffers = lambda *args: (None, None, torch.zeros(3, 4), False)
    kernel._finalize = lambda output, *args, **kwargs: output
    counters = RouteCounters()
    monkeypatch.setattr(observation, "ROUTE_COUNTERS", counters)

    kernel.apply(torch.ones(1, 4), torch.zeros(2, 6, 4), torch.zeros(2, 4, 3), own_ids, torch.ones(1, 2),
                 global_num_experts=8, expert_map=EXPERT_MAP)

    assert torch.equal(kernel.fused_experts.seen_ids, gathered)  # the original still ran, unchanged
    assert counters.snapshot() == {2: 2, 3: 2}  # expert 0 and 6 are held elsewhere


def test_install_route_counting_wraps_once():
    observation.install_route_counting()
    first = mk.FusedMoEKernelModularImpl._fused_experts
    observation.install_route_counting()
    assert mk.FusedMoEKernelModularImpl._fused_experts is first
    assert not hasattr(first.__wrapped__, "__wrapped__")


# ---------------------------------------------------------------- worker-extension methods


def _routed_experts(layer_name, ep_rank, held, global_num_experts=8):
    experts = object.__new__(RoutedExperts)
    torch.nn.Module.__init__(experts)
    experts.layer_name, experts.global_num_experts, experts.local_num_experts = layer_name, global_num_experts, len(held)
    experts.expert_map_manager = SimpleNamespace(ep_rank=ep_rank, ep_size=2, get_local_expert_ids=lambda: list(held))
    experts.w13_weight = torch.nn.Parameter(torch.zeros(len(held), 4, 2, dtype=torch.float16), requires_grad=False)
    return experts


def _runner(experts, eplb_state=None):
    runner = object.__new__(MoERunner)
    torch.nn.Module.__init__(runner)
    runner.routed_experts = experts
    runner.router = SimpleNamespace(eplb_state=eplb_state)
    return runner


class _Worker(ExpertObservation):
    def __init__(self, model):
        self.model = model

    def get_model(self):
        return self.model


def test_extension_methods_report_held_experts_weights_and_counts(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2, bias=False), _runner(_routed_experts("layers.0.mlp", 1, [4, 5])))
    worker = _Worker(model)
    assert worker.local_experts() == [dict(layer_name="layers.0.mlp", ep_rank=1, ep_size=2, global_num_experts=8,
                                           local_num_experts=2, local_expert_ids=[4, 5])]
    assert worker.parameter_bytes() == {"total": 4 * 4 + 16 * 2, "routed_experts": 16 * 2}
    counters = RouteCounters()
    counters.add_routes(torch.tensor([[4, 1]]), torch.tensor([-1, -1, -1, -1, 0, 1, -1, -1]), 8)
    monkeypatch.setattr(observation, "ROUTE_COUNTERS", counters)
    assert worker.routed_tokens_per_expert() == {4: 1}


def test_with_eplb_each_held_physical_slot_names_the_logical_expert_it_serves():
    # 4 logical experts over 6 physical slots; this rank holds slots 3, 4, 5.
    logical_to_physical = torch.tensor([[0, 4, -1], [1, -1, -1], [2, 5, -1], [3, -1, -1]])
    record = expert_layer_record(_routed_experts("l", 1, [3, 4, 5], 6),
                                 SimpleNamespace(logical_to_physical_map=logical_to_physical))
    assert record["local_expert_ids"] == [3, 4, 5] and record["logical_expert_ids"] == [3, 0, 2]
    assert "logical_expert_ids" not in expert_layer_record(_routed_experts("l", 1, [3]))
    assert logical_experts_of([[0], [1]], [1, 7]) == [1, -1]


# ---------------------------------------------------------------- vLLM interface (must fail when it moves)


def test_vllm_interface_the_observation_relies_on():
    from vllm.distributed.eplb.eplb_state import EplbLayerState
    from vllm.model_executor.layers.fused_moe.expert_map_manager import ExpertMapManager
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    from deployments.engine.vllm_cpu_ep_compat import CpuExpertParallelCompat

    fused_experts = mk.FusedMoEKernelModularImpl._fused_experts
    assert set(observation.FUSED_EXPERTS_PARAMS) <= set(inspect.signature(fused_experts).parameters)
    # The ids _fused_experts receives are the dispatcher's (post all-gather / all-to-all) ones.
    prepare_src = inspect.getsource(mk.FusedMoEKernelModularImpl._prepare)
    assert "topk_ids = topk_ids if _expert_topk_ids is None else _expert_topk_ids" in prepare_src
    apply_src = inspect.getsource(mk.FusedMoEKernelModularImpl.apply)
    assert "= self._prepare(" in apply_src and "self._fused_experts(" in apply_src
    assert "expert_num_tokens" in {f.name for f in dataclasses.fields(mk.ExpertTokensMetadata)}
    # DeepEP's dispatchers report exact per-local-expert counts (read as source: deep_ep is GPU-only).
    deepep = Path(importlib.util.find_spec("vllm.model_executor.layers.fused_moe.prepare_finalize").origin).parent
    high_throughput, low_latency = (deepep / "deepep_ht.py").read_text(), (deepep / "deepep_ll.py").read_text()
    assert "expert_alignment=1," in high_throughput and "ExpertTokensMetadata.make_from_list(" in high_throughput
    assert "mk.ExpertTokensMetadata(\n            expert_num_tokens=expert_num_tokens" in low_latency
    # What the records read.
    for attr in ("ep_rank", "ep_size", "get_local_expert_ids"):
        assert hasattr(ExpertMapManager, attr), attr
    init_src = inspect.getsource(RoutedExperts.__init__)
    for attr in ("self.layer_name", "self.expert_map_manager", "self.global_num_experts", "self.local_num_experts"):
        assert attr in init_src, attr
    runner_src = inspect.getsource(MoERunner.__init__)
    assert "self.router = router" in runner_src and "self.routed_experts = routed_experts" in runner_src
    assert "logical_to_physical_map" in EplbLayerState.__dataclass_fields__
    # vLLM takes one extension class: the CPU shim's must carry the observation methods.
    assert issubclass(CpuExpertParallelCompat, ExpertObservation)
    # vLLM refuses an extension whose attribute names its worker already has (worker_base.init_worker).
    for extension in (ExpertObservation, CpuExpertParallelCompat):
        for worker in (Worker, CPUWorker):
            clashes = [a for a in dir(extension) if not a.startswith("__") and hasattr(worker, a)]
            assert clashes == [], (extension, worker, clashes)


def test_a_real_vllm_moe_layer_on_cpu_counts_exactly_the_routers_choice():
    """vLLM's own fused-MoE layer (router, modular kernel, CPU experts), one forward in a fresh
    process: the hook sits on the path the CPU platform really takes."""
    import json
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "moe_layer_routes.py"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["counted"] == report["router"] and sum(report["counted"].values()) == 5 * 2
