"""Worker side of the KV connector: two WorkerSides (prefill and decode) in one process, talking
over the real "tcp" transport on 127.0.0.1, each over the real KVPages of small CPU caches in a
GPU-shaped (K/V split) layout.

The prefill side gets LeaseGrants and the decode side PullJobs exactly as the scheduler side
ships them (StepPlan); results() is polled the way vLLM polls get_finished each step. Both sides
hold the application's grant secret and only the prefill side lends KV; transfer parameters are
signed as that prefill's scheduler side signs them (kv_grant_fakes.signed).
"""

import os
import socket
import threading
import time
from dataclasses import dataclass, field

import pytest
import torch

import kv_transfer.connector_worker as connector_worker
from kv_transfer.connector_scheduler import LeaseGrant, PullJob, StepPlan
from kv_transfer.kv_pages import KVPages
from kv_transfer.leases import LeaseTable
from kv_transfer.params import TransferParams
from kv_transfer.settings import ConnectorSettings
from kv_transfer.transport import get_backend
from tests.unit.kv_grant_fakes import SECRET, grant_for, signed

LAYERS, BLOCKS, PAGE_BYTES = 3, 16, 2048
# The same tests with the caches on a GPU (scripts/gpu_selfcheck.sh): MOE_SERVE_KV_TEST_DEVICE=cuda.
KV_TEST_DEVICE = os.environ.get("MOE_SERVE_KV_TEST_DEVICE", "cpu")
HOST = "127.0.0.1"
WAIT_S = 5.0  # upper bound on any background step here; they take milliseconds


class BytePages(KVPages):
    """The connector's real KVPages over LAYERS caches of BLOCKS blocks in a GPU-shaped layout
    (K and V split before the block dimension, as vLLM's K/V-split backends lay it out), on CPU:
    the staged gather/scatter path a CUDA engine runs, with PAGE_BYTES per (layer, block)."""

    def __init__(self, seed: int | None = None):
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        shape = (2, BLOCKS, PAGE_BYTES // 8, 4)  # [K|V, blocks, ..., ...] of bytes
        self.caches = {
            f"model.layers.{layer}.self_attn.attn":
                (torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator) if seed is not None
                 else torch.zeros(shape, dtype=torch.uint8)).to(KV_TEST_DEVICE)
            for layer in range(LAYERS)}
        super().__init__(self.caches, num_blocks=BLOCKS)

    def block(self, block_id: int) -> list[bytes]:
        """Every layer's bytes of one block, read from the caches themselves."""
        return [bytes(self.gather([block_id])[layer, 0].numpy()) for layer in range(LAYERS)]


def free_port() -> int:
    # WorkerSide binds settings.port as given and does not expose an ephemeral port, while
    # TransferParams must name the port; so pick one that is free now.
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


@dataclass
class Side:
    worker: connector_worker.WorkerSide
    pages: BytePages
    port: int
    engine_id: str


@dataclass
class Results:
    sending: set = field(default_factory=set)
    recving: set = field(default_factory=set)
    failed: set = field(default_factory=set)

    def add(self, out) -> None:
        self.sending |= out[0]
        self.recving |= out[1]
        self.failed |= out[2]


def collect(side: Side, until, timeout_s: float = WAIT_S) -> Results:
    """Poll results() (as vLLM does every step) until `until(results)` holds; fail after timeout_s."""
    got = Results()
    deadline = time.monotonic() + timeout_s
    while True:
        got.add(side.worker.results())
        if until(got):
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up after {timeout_s}s waiting; results so far {got}")
        time.sleep(0.005)


@pytest.fixture
def make_side():
    sides: list[Side] = []

    def make(engine_id: str, *, seed: int | None = None, **settings) -> Side:
        """Engines of one P/D application: all hold its grant secret, "prefill-*" ones lend KV."""
        port = free_port()
        settings = {"grant_secret": SECRET, "lends_kv": engine_id.startswith("prefill-"), "transfer_timeout_s": 2.0,
                    **settings}
        worker = connector_worker.WorkerSide(ConnectorSettings(host=HOST, port=port, engine_id=engine_id, **settings))
        side = Side(worker, BytePages(seed), port, engine_id)
        sides.append(side)
        worker.register(side.pages)
        return side

    yield make
    for side in sides:
        side.worker.shutdown()


@pytest.fixture
def prefill(make_side) -> Side:
    return make_side("prefill-0", seed=3)


@pytest.fixture
def decode(make_side) -> Side:
    return make_side("decode-0")


@pytest.fixture
def client():
    client = get_backend("tcp").client()
    yield client
    client.close()


def params_for(prefill: Side, request_id: str, block_ids, port: int | None = None) -> TransferParams:
    """What `prefill`'s scheduler side hands decode for its lease of `block_ids`, signed."""
    return signed(TransferParams(
        remote_host=HOST, remote_port=prefill.port if port is None else port, remote_engine_id=prefill.engine_id,
        remote_request_id=request_id, remote_block_ids=tuple(block_ids), remote_num_tokens=16 * len(block_ids),
        block_size_tokens=16, lease_deadline_unix_s=time.time() + 10))


def grant(side: Side, request_id: str, block_ids, lease_s: float = 10.0) -> None:
    side.worker.apply(StepPlan(grants=[LeaseGrant(request_id, tuple(block_ids), lease_s)]))


def pull(decode: Side, request_id: str, params: TransferParams, local_block_ids, remote_block_ids=None) -> None:
    remote = params.remote_block_ids if remote_block_ids is None else tuple(remote_block_ids)
    decode.worker.apply(StepPlan(pulls=[PullJob(request_id, params, tuple(local_block_ids), remote)]))


def release(client, prefill: Side, request_id: str, lease_block_ids, timeout_s: float = 2.0) -> None:
    """A decode's RELEASE of `request_id`'s lease of `lease_block_ids` on `prefill`, with its grant."""
    grant = grant_for(request_id, lease_block_ids, host=HOST, port=prefill.port, engine_id=prefill.engine_id)
    client.release(HOST, prefill.port, request_id, timeout_s, tuple(lease_block_ids), grant)


ZERO_PAGE = bytes(PAGE_BYTES)


def untouched(side: Side, block_ids) -> bool:
    return all(side.pages.block(b) == [ZERO_PAGE] * LAYERS for b in block_ids)


# -- the normal path --------------------------------------------------------------------------


def test_pull_copies_the_leased_pages_then_releases_the_lease(prefill, decode, client):
    remote, local = (2, 9, 5), (0, 1, 2)
    grant(prefill, "p-1", remote)
    assert prefill.worker.stats()["leases_outstanding"] == 1
    assert prefill.worker.stats()["leased_blocks"] == 3
    # The transport serves the worker's stats (what the engine server exports).
    assert client.stats(HOST, prefill.port, 2.0)["leases_outstanding"] == 1

    pull(decode, "d-1", params_for(prefill, "p-1", remote), local)
    received = collect(decode, lambda r: "d-1" in r.recving)
    assert received == Results(sending=set(), recving={"d-1"}, failed=set())
    for local_block, remote_block in zip(local, remote):
        assert decode.pages.block(local_block) == prefill.pages.block(remote_block)  # every layer, in place
    assert untouched(decode, range(3, BLOCKS))

    sent = collect(prefill, lambda r: "p-1" in r.sending)  # decode's RELEASE arrived
    assert sent == Results(sending={"p-1"})
    assert prefill.worker.results() == (set(), set(), set())  # reported once
    stats = prefill.worker.stats()
    assert (stats["leases_outstanding"], stats["leased_blocks"]) == (0, 0)
    assert (stats["leases_granted_total"], stats["leases_released_total"], stats["leases_expired_total"]) == (1, 1, 0)

    stats = decode.worker.stats()
    assert (stats["pulls_started_total"], stats["pulls_succeeded_total"], stats["pulls_failed_total"]) == (1, 1, 0)
    assert stats["pulls_in_flight"] == 0
    assert (stats["blocks_requested_total"], stats["blocks_loaded_total"]) == (3, 3)
    assert stats["bytes_loaded_total"] == 3 * LAYERS * PAGE_BYTES


def test_decode_release_of_a_never_pulled_request_frees_the_lease(prefill, decode):
    grant(prefill, "p-1", (4, 5))
    decode.worker.apply(StepPlan(releases=[params_for(prefill, "p-1", (4, 5))]))
    assert collect(prefill, lambda r: "p-1" in r.sending).sending == {"p-1"}
    assert prefill.worker.stats()["leases_outstanding"] == 0
    assert decode.worker.stats()["releases_failed_total"] == 0


# -- failures ---------------------------------------------------------------------------------


@pytest.mark.parametrize("policy, fallbacks", [("recompute", 1), ("fail", 0)])
def test_injected_failure_is_reported_and_still_releases_the_lease(make_side, prefill, policy, fallbacks):
    decode = make_side("decode-0", failure_policy=policy)
    grant(prefill, "p-1", (2, 3))
    pull(decode, "d-1", params_for(prefill, "p-1", (2, 3)).with_failure_injected(), (7, 8))

    received = collect(decode, lambda r: "d-1" in r.recving)
    assert (received.recving, received.failed) == ({"d-1"}, {"d-1"})
    assert untouched(decode, range(BLOCKS))
    stats = decode.worker.stats()
    assert (stats["pulls_started_total"], stats["pulls_succeeded_total"], stats["pulls_failed_total"]) == (1, 0, 1)
    assert stats["fallbacks_total"] == fallbacks
    assert (stats["pulls_in_flight"], stats["blocks_loaded_total"]) == (0, 0)

    assert collect(prefill, lambda r: "p-1" in r.sending).sending == {"p-1"}  # not held until expiry
    stats = prefill.worker.stats()
    assert (stats["leases_outstanding"], stats["leases_released_total"], stats["leases_expired_total"]) == (0, 1, 0)


def test_remote_error_fails_the_pull_and_releases(prefill, decode):
    grant(prefill, "p-1", (2,))
    pull(decode, "d-1", params_for(prefill, "p-1", (2,)), (1,), remote_block_ids=(BLOCKS + 3,))  # not in the lease
    received = collect(decode, lambda r: "d-1" in r.recving)
    assert received.failed == {"d-1"}
    assert untouched(decode, range(BLOCKS))
    assert decode.worker.stats()["fallbacks_total"] == 1
    # The finished request says its pull failed (the P/D client then releases the lease too).
    assert decode.worker.take_load_times()["d-1"].pull_failed
    assert collect(prefill, lambda r: "p-1" in r.sending).sending == {"p-1"}


def test_unreachable_prefill_fails_the_pull_and_counts_the_failed_release(prefill, decode):
    dead_port = free_port()  # nothing listens there
    pull(decode, "d-1", params_for(prefill, "p-1", (2,), port=dead_port), (1,))
    assert collect(decode, lambda r: "d-1" in r.recving).failed == {"d-1"}

    deadline = time.monotonic() + WAIT_S  # the release follows the failed pull on the same thread
    while decode.worker.stats()["releases_failed_total"] < 1:
        assert time.monotonic() < deadline, decode.worker.stats()
        time.sleep(0.005)
    assert decode.worker.stats()["pulls_failed_total"] == 1


# -- leases -----------------------------------------------------------------------------------


def test_unreleased_lease_expires_and_is_reported_as_sent(prefill):
    grant(prefill, "p-1", (1, 2), lease_s=0.3)
    assert prefill.worker.results() == (set(), set(), set())  # still within its lease
    started = time.monotonic()
    sent = collect(prefill, lambda r: "p-1" in r.sending)
    assert sent == Results(sending={"p-1"})
    assert time.monotonic() - started < WAIT_S
    stats = prefill.worker.stats()
    assert (stats["leases_outstanding"], stats["leased_blocks"]) == (0, 0)
    assert (stats["leases_expired_total"], stats["leases_released_total"]) == (1, 0)


def test_a_lease_ending_while_its_pages_are_sent_keeps_them_until_the_send_is_done(prefill):
    guard = prefill.worker._server.leases  # what the transport server consults (and pins through)
    grant(prefill, "p-1", (1, 2), lease_s=0.2)
    with guard.sending("p-1"):
        time.sleep(0.4)  # the lease expires mid-send
        assert "p-1" not in prefill.worker.results()[0]  # finished_sending: the blocks may not be freed yet
        assert prefill.worker.stats()["leases_expired_total"] == 1
    assert collect(prefill, lambda r: "p-1" in r.sending) == Results(sending={"p-1"})


def test_release_before_the_grant_frees_the_blocks_when_the_grant_arrives(prefill, client):
    # Decode can pull and release before the prefill engine's next step delivers the grant.
    release(client, prefill, "p-1", (6, 7))  # returns once the worker handled it
    assert prefill.worker.results() == (set(), set(), set())  # nothing was held yet
    assert prefill.worker.stats()["leases_outstanding"] == 0

    grant(prefill, "p-1", (6, 7))
    assert prefill.worker.results()[0] == {"p-1"}  # at once, not after lease_s
    assert prefill.worker.results() == (set(), set(), set())
    stats = prefill.worker.stats()
    assert (stats["leases_outstanding"], stats["leased_blocks"]) == (0, 0)
    assert (stats["leases_granted_total"], stats["leases_released_total"]) == (1, 1)

    # Only that request was released early: another grant is held as usual.
    grant(prefill, "p-2", (8,))
    assert prefill.worker.results() == (set(), set(), set())
    assert prefill.worker.stats()["leases_outstanding"] == 1


@pytest.mark.parametrize("ended_by", ["release", "expiry"])
def test_duplicate_release_after_the_lease_ended_leaves_no_state(make_side, client, ended_by):
    prefill = make_side("prefill-0", seed=3, lease_s=0.5)
    if ended_by == "release":
        grant(prefill, "p-1", (1, 2))
        release(client, prefill, "p-1", (1, 2))
    else:
        grant(prefill, "p-1", (1, 2), lease_s=0.05)
    assert collect(prefill, lambda r: "p-1" in r.sending).sending == {"p-1"}

    release(client, prefill, "p-1", (1, 2))  # late or repeated RELEASE: answered OK, ignored
    assert prefill.worker._released_early == {}  # nothing remembered that a later grant would consume
    assert prefill.worker.results() == (set(), set(), set())
    assert prefill.worker.stats()["leases_released_total"] == (1 if ended_by == "release" else 0)


def test_release_racing_the_grant_is_not_lost(monkeypatch, make_side, client):
    # Regression: the RELEASE lands while the engine thread is inside _grant, between its
    # early-release check and LeaseTable.grant. It used to be recorded as early *and* the
    # lease granted anyway, so the blocks stayed pinned until lease_s ran out.
    released = threading.Event()

    class ReleaseDuringGrant(LeaseTable):
        def grant(self, request_id, block_ids, now_s, lease_s):
            def release_now():
                release(client, side, request_id, block_ids, WAIT_S)
                released.set()
            threading.Thread(target=release_now, daemon=True).start()
            released.wait(0.5)  # give the release every chance to slip in before the grant
            return super().grant(request_id, block_ids, now_s, lease_s)

    monkeypatch.setattr(connector_worker, "LeaseTable", ReleaseDuringGrant)
    side = make_side("prefill-0", seed=3, lease_s=30.0)
    grant(side, "p-1", (1, 2), lease_s=30.0)
    assert collect(side, lambda r: "p-1" in r.sending).sending == {"p-1"}
    assert released.wait(WAIT_S)
    stats = side.worker.stats()
    assert (stats["leases_outstanding"], stats["leases_released_total"], stats["leases_expired_total"]) == (0, 1, 0)
    assert side.worker._released_early == {}


def test_pull_after_the_lease_expired_is_refused(make_side, decode):
    prefill = make_side("prefill-0", seed=3)
    grant(prefill, "p-1", (2, 3), lease_s=0.05)
    assert collect(prefill, lambda r: "p-1" in r.sending).sending == {"p-1"}  # vLLM frees the blocks now
    pull(decode, "d-1", params_for(prefill, "p-1", (2, 3)), (7, 8))
    assert collect(decode, lambda r: "d-1" in r.recving).failed == {"d-1"}


def test_pull_is_not_attempted_after_the_lease_deadline(make_side, decode):
    """Decode refuses on its own too: past the deadline the prefill may have reused the blocks."""
    from dataclasses import replace

    prefill = make_side("prefill-0", seed=5)
    grant(prefill, "p-9", (1,))
    late = replace(params_for(prefill, "p-9", (1,)), lease_deadline_unix_s=time.time() - 1)
    pull(decode, "d-9", late, (4,))
    assert collect(decode, lambda r: "d-9" in r.recving).failed == {"d-9"}
    assert decode.worker.stats()["pulls_failed_total"] == 1
