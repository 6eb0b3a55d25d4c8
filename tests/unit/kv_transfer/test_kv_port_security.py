"""The KV transfer port against peers that hold no grant, or the wrong one: real loopback
sockets, the real WorkerSide and TcpTransferServer (and, for forged transfer parameters, the
real SchedulerSide in front of them).

The port serves raw KV pages, every user's prompt included. What must hold:

- an engine that lends no KV (colocated, decode) answers no READ or RELEASE, only STATS;
- no lease, no read: an id the engine never leased is refused once the bounded wait for its
  lease ends, whatever blocks it names; a read racing its lease's grant is served when it lands;
- a grant opens one lease on one engine: not another engine's lease of the same id and blocks,
  not blocks outside its lease, and not if a block was added to or taken from its list;
- idle sockets, however many, do not lock out pulls, releases or stats (idle ones are evicted);
- a message naming more blocks than the engine has is refused from its header alone;
- decode refuses transfer parameters that no engine of its application signed before it
  connects anywhere: forged parameters never open a connection.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import replace

import pytest

from kv_transfer import wire
from kv_transfer.connector_scheduler import SchedulerSide
from kv_transfer.connector_worker import LEASE_WAIT_S, WorkerSide
from kv_transfer.errors import TransferFailed
from kv_transfer.grants import PAYLOAD_BYTES
from kv_transfer.params import TransferParams
from kv_transfer.releaser import BackgroundReleaser
from kv_transfer.settings import ConnectorSettings
from kv_transfer.transport import get_backend
from tests.unit.kv_grant_fakes import SECRET, grant_for, signed
from tests.unit.kv_transfer.test_kv_connector_scheduler import FakeRequest
from tests.unit.kv_transfer.test_kv_connector_worker import (BLOCKS, HOST, WAIT_S, BytePages, Side, collect, free_port,
                                                 grant, make_side, params_for, pull)  # noqa: F401 (fixture)

OTHER_SECRET = "cd" * 32


@pytest.fixture
def client():
    client = get_backend("tcp").client()
    yield client
    client.close()


def grant_of(side: Side, request_id: str, lease_block_ids, **kwargs) -> bytes:
    """The grant `side`'s scheduler would sign for its lease of `lease_block_ids` to `request_id`."""
    scope = {"host": HOST, "port": side.port, "engine_id": side.engine_id, **kwargs}
    return grant_for(request_id, lease_block_ids, **scope)


def read(client, side: Side, request_id: str, block_ids, grant: bytes, timeout_s: float = 2.0) -> BytePages:
    """READ `block_ids` of `request_id` from `side`, into blocks of the same ids of a fresh sink."""
    sink = BytePages()
    with sink.receiving(list(block_ids)) as dest:
        client.fetch(HOST, side.port, request_id, list(block_ids), dest, timeout_s, grant)
    return sink


def same_blocks(side: Side, sink: BytePages, block_ids) -> bool:
    return all(sink.block(b) == side.pages.block(b) for b in block_ids)


def outstanding(side: Side) -> int:
    return side.worker.stats()["leases_outstanding"]


# -- 1. an engine that lends no KV --------------------------------------------------------------


@pytest.mark.parametrize("settings", [{"grant_secret": ""}, {"lends_kv": False}],
                         ids=["no-grant-secret", "does-not-lend"])
def test_an_engine_that_lends_no_kv_refuses_reads_and_releases_and_answers_stats(make_side, client, settings):
    # Named like a prefill, and holding a lease, so that only its role can be the reason.
    side = make_side("prefill-0", seed=3, **settings)
    grant(side, "p-1", (1, 2))
    for request_id in ("p-1", "never-leased", "x" * 200):
        started = time.monotonic()
        with pytest.raises(TransferFailed, match="lends no KV"):
            read(client, side, request_id, (1, 2), grant_of(side, request_id, (1, 2)))
        with pytest.raises(TransferFailed, match="lends no KV"):
            client.release(HOST, side.port, request_id, 2.0, (1, 2), grant_of(side, request_id, (1, 2)))
        assert time.monotonic() - started < 1.0  # refused at once, no wait for a lease
    assert outstanding(side) == 1 and side.worker.results() == (set(), set(), set())  # nothing released
    stats = client.stats(HOST, side.port, 2.0)
    assert stats["leases_outstanding"] == 1
    assert stats["server_refused_requests_total"] == 6


# -- 2. no lease, no read -----------------------------------------------------------------------


def test_a_read_for_a_request_never_leased_is_refused_after_a_bounded_wait(make_side, client):
    prefill = make_side("prefill-0", seed=3)
    grant(prefill, "p-1", (1, 2))  # another request's lease: the engine lends, just not to "ghost"
    every_block = range(BLOCKS)
    started = time.monotonic()
    with pytest.raises(TransferFailed, match="'ghost' holds no KV lease"):
        # A grant that verifies (as if signed with the secret), over every block the engine has.
        read(client, prefill, "ghost", every_block, grant_of(prefill, "ghost", every_block),
             timeout_s=LEASE_WAIT_S + 5)
    assert time.monotonic() - started < LEASE_WAIT_S + 1.0
    assert prefill.worker._server.refused_requests == 1
    sink = read(client, prefill, "p-1", (1, 2), grant_of(prefill, "p-1", (1, 2)))  # still serving leases
    assert same_blocks(prefill, sink, (1, 2))


def test_a_read_that_arrives_before_its_lease_is_served_once_the_grant_lands(make_side, client):
    prefill = make_side("prefill-0", seed=3)
    lease = (4, 5, 6)
    granter = threading.Timer(0.2, grant, args=(prefill, "p-1", lease))
    started = time.monotonic()
    granter.start()
    try:
        sink = read(client, prefill, "p-1", (4, 6), grant_of(prefill, "p-1", lease), timeout_s=LEASE_WAIT_S + 5)
    finally:
        granter.join()
    elapsed_s = time.monotonic() - started
    assert same_blocks(prefill, sink, (4, 6))
    assert 0.15 < elapsed_s < LEASE_WAIT_S  # it waited for the grant, not for the wait to end
    assert prefill.worker._server.refused_requests == 0


# -- 3. a grant opens one lease on one engine ---------------------------------------------------


def test_a_grant_for_one_engine_opens_nothing_on_another(make_side, client):
    a, b = make_side("prefill-0", seed=3), make_side("prefill-1", seed=4)
    lease = (2, 3, 4)
    grant(a, "p-1", lease)
    grant(b, "p-1", lease)  # the same id and blocks leased on both (same secret too)
    for_a = grant_of(a, "p-1", lease)
    a_at_b_address = grant_of(b, "p-1", lease, engine_id=a.engine_id)  # only the engine id differs
    for presented in (for_a, a_at_b_address):
        with pytest.raises(TransferFailed, match="does not verify"):
            read(client, b, "p-1", lease, presented)
        with pytest.raises(TransferFailed, match="does not verify"):
            client.release(HOST, b.port, "p-1", 2.0, lease, presented)
    assert outstanding(b) == 1 and b.worker.results() == (set(), set(), set())
    assert same_blocks(a, read(client, a, "p-1", lease, for_a), lease)  # the grant works where it was made
    assert same_blocks(b, read(client, b, "p-1", lease, grant_of(b, "p-1", lease)), lease)


def test_a_grant_opens_only_the_blocks_of_its_lease(make_side, client):
    prefill = make_side("prefill-0", seed=3)
    lease = (2, 3, 4)
    grant(prefill, "p-1", lease)
    valid = grant_of(prefill, "p-1", lease)
    for outside in [(2, 9), (9,), (0, 1, 5, 6, 7)]:
        with pytest.raises(TransferFailed, match="not all leased"):
            read(client, prefill, "p-1", outside, valid)
    for lease_list in [(2, 3, 4, 9), (2, 3), (2, 3, 5)]:  # a block added, removed, swapped
        with pytest.raises(TransferFailed, match="does not verify"):
            read(client, prefill, "p-1", (2,), grant_of(prefill, "p-1", lease_list))
    assert prefill.worker._server.refused_requests == 6
    assert same_blocks(prefill, read(client, prefill, "p-1", (3, 2), valid), (3, 2))


# -- 4. idle sockets do not lock out real traffic -----------------------------------------------


def test_idle_sockets_at_the_connection_cap_do_not_lock_out_pulls_releases_or_stats(make_side, client):
    prefill = make_side("prefill-0", seed=3, max_connections=64)
    decode = make_side("decode-0")
    grant(prefill, "p-1", (1, 2, 3))
    idle = []
    try:
        for _ in range(300):
            idle.append(socket.create_connection((HOST, prefill.port), timeout=10))
        time.sleep(0.5)  # every one accepted (or refused) by now

        pull(decode, "d-1", params_for(prefill, "p-1", (1, 2, 3)), (7, 8, 9))
        assert collect(decode, lambda r: "d-1" in r.recving).failed == set()
        assert all(decode.pages.block(local) == prefill.pages.block(remote)
                   for local, remote in zip((7, 8, 9), (1, 2, 3)))
        assert collect(prefill, lambda r: "p-1" in r.sending).sending == {"p-1"}  # decode's RELEASE got in
        assert decode.worker.stats()["releases_failed_total"] == 0

        stats = client.stats(HOST, prefill.port, 2.0)
        assert stats["server_evicted_connections_total"] > 0
        assert stats["leases_outstanding"] == 0
    finally:
        for sock in idle:
            sock.close()


@pytest.mark.parametrize("forged_grant", [b"", b"\x00" * PAYLOAD_BYTES, "plausible"],
                         ids=["no-grant", "expired-garbage", "right-length-future-deadline"])
def test_reads_for_ids_nobody_leased_cannot_hold_every_connection(make_side, client, forged_grant):
    """Reads waiting for a lease are busy connections, which the cap cannot evict: clients
    with no valid grant looping such reads must not fill the server. A read without even a
    plausible grant is refused before any wait; plausible-looking ones wait, but only a few
    at once."""
    prefill = make_side("prefill-0", seed=3, max_connections=16)
    grant(prefill, "p-1", (1, 2, 3))
    stop = threading.Event()

    def flood(i: int) -> None:
        flooder = get_backend("tcp").client()
        n = 0
        try:
            while not stop.is_set():
                n += 1
                request_id = f"ghost-{i}-{n}"
                payload = grant_for(request_id, (0,), engine_id="nobody", secret=OTHER_SECRET) \
                    if forged_grant == "plausible" else forged_grant
                try:
                    read(flooder, prefill, request_id, (0,), payload, timeout_s=LEASE_WAIT_S + 2)
                except TransferFailed:
                    pass
        finally:
            flooder.close()

    threads = [threading.Thread(target=flood, args=(i,), daemon=True) for i in range(32)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(1.0)  # the flood is at its height
        for _ in range(5):
            assert client.stats(HOST, prefill.port, 2.0)["leases_outstanding"] == 1
        sink = read(client, prefill, "p-1", (1, 2, 3), grant_of(prefill, "p-1", (1, 2, 3)), timeout_s=5.0)
        assert same_blocks(prefill, sink, (1, 2, 3))
    finally:
        stop.set()
        for thread in threads:
            thread.join(LEASE_WAIT_S + 5)


# -- 5. block counts are bounded before the ids are read ----------------------------------------


@pytest.mark.parametrize("msg_type", [wire.MessageType.READ_BLOCKS, wire.MessageType.RELEASE])
def test_a_message_naming_more_blocks_than_the_engine_has_is_refused_from_its_header(make_side, client, msg_type):
    prefill = make_side("prefill-0", seed=3)
    count = 2 ** 20  # the wire's own limit; this engine has BLOCKS
    prefix = wire.encode_prefix(msg_type, "p-1", range(count), PAYLOAD_BYTES)
    header_and_id = prefix[:wire.HEADER_SIZE + len(b"p-1")]  # the 4 MiB of ids are never sent
    with socket.create_connection((HOST, prefill.port), timeout=5) as sock:
        sock.settimeout(3.0)
        started = time.monotonic()
        sock.sendall(header_and_id)
        reply = sock.recv(65536)
        header = wire.decode_header(reply[:wire.HEADER_SIZE], wire.MAX_ERROR_BYTES)
        assert header.type == wire.MessageType.ERROR
        assert f"names {count} blocks; this engine has {BLOCKS}".encode() in reply
        try:
            while reply:  # then closed: the stream is out of step
                reply = sock.recv(65536)
        except ConnectionResetError:  # closed with the request id unread: also closed
            pass
        assert time.monotonic() - started < 2.0  # (had it waited for the ids: io_timeout_s, 30 s)
    grant(prefill, "p-1", (1,))
    assert same_blocks(prefill, read(client, prefill, "p-1", (1,), grant_of(prefill, "p-1", (1,))), (1,))


# -- 6. forged transfer parameters open no connection ------------------------------------------


class Trap:
    """A plain listening socket that counts the connections made to it."""

    def __init__(self):
        self.listener = socket.create_server((HOST, 0))
        self.listener.settimeout(0.1)
        self.port = self.listener.getsockname()[1]
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            self.accepted += 1
            conn.close()

    def close(self):
        self._stop.set()
        self._thread.join()
        self.listener.close()


@pytest.fixture
def trap():
    trap = Trap()
    yield trap
    trap.close()


def at_trap(trap: Trap, **changes) -> TransferParams:
    return TransferParams(remote_host=HOST, remote_port=trap.port, remote_engine_id="prefill-0",
                          remote_request_id="p-1", remote_block_ids=(1, 2, 3), remote_num_tokens=48,
                          block_size_tokens=16, lease_deadline_unix_s=time.time() + 10, **changes)


def genuine_elsewhere_retargeted(trap: Trap) -> dict:
    """A real prefill's signed parameters with the address changed to the trap's."""
    genuine = signed(replace(at_trap(trap), remote_port=free_port()))
    return replace(genuine, remote_port=trap.port).to_engine()


def deadline_extended(trap: Trap) -> dict:
    """Signed parameters whose grant's deadline was pushed an hour on (the MAC left as it was)."""
    params = signed(at_trap(trap))
    later_ms = int((params.lease_deadline_unix_s + 3600) * 1000)
    grant = params.grant_bytes()[:-8] + later_ms.to_bytes(8, "big")
    return {**params.to_engine(), "grant": grant.hex(), "lease_deadline_unix_s": later_ms / 1000}


# Each points at the trap. The last ones tamper with parameters a prefill engine signed for the
# trap's address (as if it were one): a changed field breaks the grant.
FORGERIES = {
    "unsigned": lambda trap: at_trap(trap).to_engine(),
    "signed-with-another-secret": lambda trap: signed(at_trap(trap), secret=OTHER_SECRET).to_engine(),
    "a-real-grant-retargeted": genuine_elsewhere_retargeted,
    "malformed-port": lambda trap: {**at_trap(trap).to_engine(), "remote_port": str(trap.port)},
    "malformed-block-ids": lambda trap: {**signed(at_trap(trap)).to_engine(), "remote_block_ids": ["1", 2, 3]},
    "grant-deadline-extended": deadline_extended,
    "blocks-added": lambda trap: {**signed(at_trap(trap)).to_engine(), "remote_block_ids": [1, 2, 3, 4]},
    "another-request": lambda trap: {**signed(at_trap(trap)).to_engine(), "remote_request_id": "p-2"},
    "another-engine": lambda trap: {**signed(at_trap(trap)).to_engine(), "remote_engine_id": "prefill-1"},
}


def decode_engine(**settings) -> tuple[SchedulerSide, WorkerSide, BackgroundReleaser]:
    """A decode engine's scheduler and worker sides, wired as kv_transfer/connector.py wires them."""
    settings = ConnectorSettings(**{"host": HOST, "port": free_port(), "engine_id": "decode-0",
                                    "grant_secret": SECRET, "transfer_timeout_s": 2.0, **settings})
    releaser = BackgroundReleaser(settings.transfer_timeout_s)
    worker = WorkerSide(settings)
    worker.register(BytePages())
    return SchedulerSide(settings, 16, release_now=releaser.submit), worker, releaser


def drive(scheduler: SchedulerSide, worker: WorkerSide, request_id: str, kv_transfer_params: dict, *,
          aborted: bool) -> None:
    """What vLLM does with a decode request carrying these parameters: admit, allocate, run the
    step's plan on the worker, and finish it (or abort it before its blocks were allocated)."""
    request = FakeRequest(request_id, kv_transfer_params, list(range(48)), num_computed_tokens=0)
    if aborted:
        scheduler.finished(request, [], normally=False)
    else:
        assert scheduler.num_new_matched_tokens(request, 0) == (0, False)  # computed here instead
        scheduler.after_alloc(request, [7, 8, 9], 0)
        worker.apply(scheduler.take_plan())
        scheduler.finished(request, [7, 8, 9], normally=True)
    worker.apply(scheduler.take_plan())


@pytest.mark.parametrize("forgery", list(FORGERIES))
def test_forged_transfer_params_make_no_connection(trap, forgery):
    scheduler, worker, releaser = decode_engine()
    try:
        drive(scheduler, worker, "d-1", FORGERIES[forgery](trap), aborted=False)  # would pull, then release
        drive(scheduler, worker, "d-2", FORGERIES[forgery](trap), aborted=True)  # would release at once
        time.sleep(1.0)
        assert trap.accepted == 0
        assert scheduler.refused_params_total == 2
        stats = worker.stats()
        assert (stats["pulls_started_total"], stats["releases_failed_total"]) == (0, 0)
    finally:
        worker.shutdown()
        releaser.shutdown()


def test_a_decode_engine_without_the_secret_pulls_nothing_even_for_valid_params(trap):
    scheduler, worker, releaser = decode_engine(grant_secret="")
    try:
        drive(scheduler, worker, "d-1", signed(at_trap(trap)).to_engine(), aborted=False)
        time.sleep(1.0)
        assert trap.accepted == 0 and scheduler.refused_params_total == 1
    finally:
        worker.shutdown()
        releaser.shutdown()


def test_the_trap_does_count_connections_from_a_pull_that_is_allowed(trap):
    """The control for the two tests above: validly signed parameters do reach the trap."""
    scheduler, worker, releaser = decode_engine()
    try:
        request = FakeRequest("d-1", signed(at_trap(trap)).to_engine(), list(range(48)), num_computed_tokens=0)
        assert scheduler.num_new_matched_tokens(request, 0) == (48, True)
        scheduler.after_alloc(request, [7, 8, 9], 48)
        worker.apply(scheduler.take_plan())
        deadline = time.monotonic() + WAIT_S
        while trap.accepted == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert trap.accepted >= 1 and scheduler.refused_params_total == 0
    finally:
        worker.shutdown()
        releaser.shutdown()
