"""A dead prefill node costs at most one timeout per peer, not one per pull (kv_transfer/peer_health.py).

A blackholed node answers nothing: every connect or request to it waits its whole timeout. Pulls
and lease releases used to share the pull threads, each job paying a fetch timeout and then a
release timeout, so pulls from healthy prefills queued behind them. The dead node here is a
socket that listens and never answers (the kernel completes the handshake, nothing replies):
what a node that died with connections open looks like, and deterministic where TEST-NET
addresses (192.0.2.1) are refused at once by the sandbox instead of blackholed."""

import socket
import time

import pytest

from kv_transfer.connector_scheduler import PullJob, StepPlan
from kv_transfer.errors import TransferFailed, TransferTimeout
from tests.unit.kv_transfer.test_kv_connector_worker import make_side  # noqa: F401 - the fixture
from tests.unit.kv_transfer.test_kv_connector_worker import BLOCKS, HOST, WAIT_S, collect, free_port, grant, params_for, pull


def timeout_s(side) -> float:
    """The side's transfer timeout (make_side's): what one dead peer may cost."""
    return side.worker._settings.transfer_timeout_s


@pytest.fixture
def dead_port():
    """A peer that accepts connections and never answers."""
    listener = socket.socket()
    listener.bind((HOST, 0))
    listener.listen(128)  # never accepted: the kernel still completes up to 128 handshakes
    yield listener.getsockname()[1]
    listener.close()


def pulls_to(dead_port: int, prefill, count: int) -> list[PullJob]:
    jobs = []
    for i in range(count):
        params = params_for(prefill, f"dead-{i}", (1,), port=dead_port)
        jobs.append(PullJob(f"d-dead-{i}", params, (i % 8,), params.remote_block_ids))
    return jobs


# -- the worker ----------------------------------------------------------------------------------


def test_pulls_from_a_healthy_prefill_wait_at_most_one_timeout_behind_a_dead_one(make_side, dead_port):
    prefill = make_side("prefill-0", seed=3)
    decode = make_side("decode-0", max_concurrent_pulls=4)
    grant(prefill, "p-ok", (2, 3))
    started = time.monotonic()
    # 12 pulls to the dead node first: without back-off 3 rounds of 4 threads, each pull then
    # its release timing out (6 timeouts); with it, the first round's timeout marks it down.
    decode.worker.apply(StepPlan(pulls=pulls_to(dead_port, prefill, 12)))
    pull(decode, "d-ok", params_for(prefill, "p-ok", (2, 3)), (10, 11))
    got = collect(decode, lambda r: "d-ok" in r.recving, timeout_s=10)
    healthy_s = time.monotonic() - started
    assert healthy_s < timeout_s(decode) + 0.8, healthy_s
    assert "d-ok" not in got.failed

    more = collect(decode, lambda r: len(got.recving | r.recving) == 13, timeout_s=5)
    assert got.failed | more.failed == {f"d-dead-{i}" for i in range(12)}
    stats = decode.worker.stats()
    assert stats["pulls_failed_total"] == 12 and stats["peer_down_skips_total"] >= 8  # 4 waited, the rest did not
    # The 4 pulls in flight when it went down are one outage: the window did not grow with them.
    assert decode.worker._peers.admit((HOST, dead_port), time.monotonic()) <= 5.0

    # A later job to the dead peer fails at once, touching no socket.
    again = time.monotonic()
    decode.worker.apply(StepPlan(pulls=pulls_to(dead_port, prefill, 1)))
    collect(decode, lambda r: "d-dead-0" in r.failed, timeout_s=5)
    assert time.monotonic() - again < 0.2


def test_releases_to_a_dead_prefill_never_hold_up_pulls(make_side, dead_port):
    prefill = make_side("prefill-0", seed=3)
    decode = make_side("decode-0", max_concurrent_pulls=4)
    grant(prefill, "p-ok", (2,))
    releases = [params_for(prefill, f"dead-{i}", (1,), port=dead_port) for i in range(8)]
    started = time.monotonic()
    decode.worker.apply(StepPlan(releases=releases))
    pull(decode, "d-ok", params_for(prefill, "p-ok", (2,)), (5,))
    got = collect(decode, lambda r: "d-ok" in r.recving, timeout_s=10)
    assert "d-ok" not in got.failed
    assert time.monotonic() - started < 0.5  # not even one timeout: releases have threads of their own

    # The releases: the first ones wait out one timeout, the rest fail at once behind them.
    deadline = time.monotonic() + WAIT_S
    while decode.worker.stats()["releases_failed_total"] < 8:
        assert time.monotonic() < deadline, decode.worker.stats()
        time.sleep(0.01)
    assert time.monotonic() - started < timeout_s(decode) + 0.8
    assert decode.worker.stats()["peer_down_skips_total"] >= 6


def test_a_peer_that_answers_again_is_used_again(make_side, dead_port):
    """After the back-off window one pull probes the peer; its success clears the record."""
    prefill = make_side("prefill-0", seed=3)
    decode = make_side("decode-0")
    peers = decode.worker._peers
    peers.failed((HOST, prefill.port), time.monotonic() - 100)  # a window that has passed
    grant(prefill, "p-1", (4,))
    pull(decode, "d-1", params_for(prefill, "p-1", (4,)), (6,))
    assert "d-1" not in collect(decode, lambda r: "d-1" in r.recving).failed
    assert peers.peers_down(time.monotonic()) == 0 and peers.admit((HOST, prefill.port), time.monotonic()) == 0.0


# -- the client's failure kinds --------------------------------------------------------------------


def test_the_client_says_which_failures_mean_nothing_answered(make_side, dead_port):
    from kv_transfer.peer_health import PeerUnreachable
    from kv_transfer.transport.tcp_client import TcpTransferClient

    client = TcpTransferClient()
    pages = [memoryview(bytearray(2048)) for _ in range(3)]
    try:
        started = time.monotonic()
        with pytest.raises(TransferTimeout) as silent:
            client.fetch(HOST, dead_port, "r", [1], pages, 0.3)
        assert isinstance(silent.value, PeerUnreachable) and time.monotonic() - started < 1.0
        with pytest.raises(TransferFailed) as refused:
            client.release(HOST, free_port(), "r", 0.3)  # nothing listens there
        assert isinstance(refused.value, PeerUnreachable)
        prefill = make_side("prefill-0", seed=3)
        grant(prefill, "r", (1,))  # a lease it knows, so that it refuses at once (ungranted / not leased)
        with pytest.raises(TransferFailed) as answered:  # an ERROR reply: the peer is alive
            client.fetch(HOST, prefill.port, "r", [BLOCKS + 3], pages, 0.3)  # a block it does not hold
        assert answered.value.remote and not isinstance(answered.value, PeerUnreachable)
    finally:
        client.close()


# -- the back-off record ---------------------------------------------------------------------------


def test_back_off_grows_from_base_to_max_and_one_success_clears_it():
    from kv_transfer.peer_health import PeerHealth

    health = PeerHealth(base_s=5.0, max_s=30.0, probe_s=1.0)
    peer = ("10.0.0.9", 7000)
    assert health.admit(peer, 0.0) == 0.0
    assert health.failed(peer, 0.0) == 5.0
    assert health.failed(peer, 0.5) == 4.5  # in flight when it went down: the same outage, same window
    # Each probe that fails (once the window has passed) doubles the window, up to max_s.
    now_s, windows = 5.0, []
    for _ in range(4):
        assert health.admit(peer, now_s) == 0.0
        windows.append(health.failed(peer, now_s))
        now_s += windows[-1]
    assert windows == [10.0, 20.0, 30.0, 30.0]
    assert health.admit(peer, now_s - 1.0) == pytest.approx(1.0)
    assert health.admit(("10.0.0.9", 7001), now_s - 1.0) == 0.0  # per peer: another engine on that node
    health.succeeded(peer)
    assert health.admit(peer, now_s) == 0.0 and health.failed(peer, now_s) == 5.0  # starts over


def test_when_the_window_ends_one_call_probes_and_the_rest_still_fail_at_once():
    from kv_transfer.peer_health import PeerHealth

    health = PeerHealth(base_s=5.0, max_s=30.0, probe_s=1.0)
    peer = ("10.0.0.9", 7000)
    health.failed(peer, 0.0)
    assert health.peers_down(4.0) == 1
    assert health.admit(peer, 5.0) == 0.0  # the probe
    assert health.admit(peer, 5.1) == pytest.approx(0.9)  # others wait for its outcome
    assert health.failed(peer, 5.5) == 10.0  # the probe failed: a longer window
    assert health.admit(peer, 15.5) == 0.0
    assert health.admit(peer, 16.6) == 0.0  # a probe whose caller never reported expires


def test_guarded_fails_at_once_while_down_and_records_outcomes():
    from kv_transfer.peer_health import PeerDown, PeerHealth, PeerUnreachable, guarded

    class Unreachable(TransferTimeout, PeerUnreachable):
        pass

    clock = [0.0]
    health = PeerHealth(base_s=5.0, probe_s=1.0)
    with pytest.raises(Unreachable):
        with guarded(health, "h", 1, clock=lambda: clock[0]):
            raise Unreachable("no reply", 1.0)
    calls = []
    with pytest.raises(PeerDown, match="not tried again for 5.0 s"):
        with guarded(health, "h", 1, clock=lambda: clock[0]):
            calls.append("network")
    assert calls == []
    clock[0] = 6.0
    with pytest.raises(TransferFailed):  # the probe got an ERROR reply: the peer is there
        with guarded(health, "h", 1, clock=lambda: clock[0]):
            raise TransferFailed("server error: no such lease", remote=True)
    assert health.admit(("h", 1), 6.0) == 0.0 and health.peers_down(6.0) == 0
