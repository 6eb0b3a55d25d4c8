"""KV transfer bounds grow with the KV's bytes: a pull's timeout, the prefill's lease, and the
server's send. With fixed seconds a 32k-token prompt's pull (hundreds of MiB) either needs a
timeout that lets a dead peer hold a short prompt for minutes, or fails where a short one would
not. Real WorkerSides over the real tcp transport (tests/unit/kv_transfer/test_kv_connector_worker.py)."""

from __future__ import annotations

import logging
import time

import pytest

import kv_transfer.connector_worker as connector_worker
from kv_transfer.connector_scheduler import SchedulerSide
from kv_transfer.params import prefill_request_params
from kv_transfer.settings import ConnectorSettings
from dataclasses import replace

from tests.unit.kv_grant_fakes import SECRET, signed
from tests.unit.kv_transfer.test_kv_connector_scheduler import prefill_request
from tests.unit.kv_transfer.test_kv_connector_worker import LAYERS, PAGE_BYTES, collect, grant, make_side, params_for, pull  # noqa: F401
from tests.unit.kv_transfer.test_kv_connector_worker import HOST

MIB = 1 << 20
BLOCK_BYTES = LAYERS * PAGE_BYTES  # one block of every layer of the test caches


def leased(prefill, request_id: str, block_ids, lease_s: float):
    """The prefill's lease of `block_ids` for `lease_s`, and the params it signs for it."""
    grant(prefill, request_id, tuple(block_ids), lease_s=lease_s)
    return signed(replace(params_for(prefill, request_id, block_ids), lease_deadline_unix_s=time.time() + lease_s))


def test_the_pull_budget_and_the_lease_grow_by_the_bytes_at_the_slowest_rate():
    settings = ConnectorSettings(lease_s=30.0, transfer_timeout_s=5.0, min_transfer_bytes_per_s=64 * MIB)
    assert settings.transfer_budget_s(0) == 5.0 and settings.lease_for_s(0) == 30.0
    # 290 MiB: the tiny DeepSeek's float32 latents for a 32k-token prompt.
    assert settings.transfer_budget_s(290 * MIB) == pytest.approx(5.0 + 290 / 64)
    assert settings.lease_for_s(290 * MIB) == pytest.approx(30.0 + 290 / 64)
    # What decode may spend queued before its pull starts is the same for long and short prompts.
    assert settings.lease_for_s(290 * MIB) - settings.transfer_budget_s(290 * MIB) == 25.0
    with pytest.raises(ValueError, match="min_transfer_bytes_per_s"):
        ConnectorSettings.from_extra_config({"min_transfer_bytes_per_s": 0})


def test_prefill_leases_a_long_prompts_blocks_for_longer():
    side = SchedulerSide(ConnectorSettings(host=HOST, port=1, engine_id="p", lease_s=8.0, grant_secret=SECRET,
                                           lends_kv=True, min_transfer_bytes_per_s=1 * MIB), 16,
                         block_bytes=256 * 1024)
    _, short = side.finished(prefill_request("p-1", params=prefill_request_params()), [3, 4], normally=True)
    _, long = side.finished(prefill_request("p-2", params=prefill_request_params()), list(range(40)), normally=True)
    assert short["lease_remaining_s"] == pytest.approx(8.0 + 0.5)  # 2 blocks of 256 KiB at 1 MiB/s
    assert long["lease_remaining_s"] == pytest.approx(8.0 + 10.0)
    assert long["lease_deadline_unix_s"] == pytest.approx(time.time() + 18.0, abs=1.0)  # what the grant signs
    plan = side.take_plan()
    assert [g.lease_s for g in plan.grants] == [pytest.approx(8.5), pytest.approx(18.0)]  # the worker holds as long


def test_decode_starts_a_pull_only_if_its_bytes_fit_before_the_lease_ends(make_side, caplog):
    """A 1-second lease, a 0.2 s fixed allowance and 40 KiB/s: one block (6 KiB, 0.35 s) is
    pulled; eight (48 KiB, 1.4 s) are refused by decode itself, before any read is sent."""
    rate = {"min_transfer_bytes_per_s": 40 * 1024, "transfer_timeout_s": 0.2}
    prefill, decode = make_side("prefill-0", seed=5, **rate), make_side("decode-0", **rate)
    short, long = leased(prefill, "p-1", (1,), 1.0), leased(prefill, "p-2", range(8), 1.0)
    pull(decode, "d-1", short, (9,))
    assert collect(decode, lambda r: "d-1" in r.recving).failed == set()
    assert decode.pages.block(9) == prefill.pages.block(1)
    with caplog.at_level(logging.WARNING, logger=connector_worker.__name__):
        pull(decode, "d-2", long, tuple(range(8, 16)))
        assert collect(decode, lambda r: "d-2" in r.recving).failed == {"d-2"}
    assert "LeaseExpired" in caplog.text


def test_a_long_pull_gets_its_bytes_time_on_both_ends(make_side, monkeypatch):
    """16 blocks of 6 KiB at 8 KiB/s: decode's fetch is given 0.2 s + 12 s, and the prefill's
    server its 30 s + 12 s to send them, where fixed bounds would fail them on a slow link."""
    import kv_transfer.transport.tcp_server as tcp_server

    rate = {"min_transfer_bytes_per_s": 8 * 1024, "transfer_timeout_s": 0.2}
    prefill, decode = make_side("prefill-0", seed=9, **rate), make_side("decode-0", **rate)
    fetch_bounds: list[float] = []
    send_bounds: list[float] = []
    real_fetch, real_send = decode.worker._client.fetch, tcp_server.send_buffers

    def recording_fetch(host, port, request_id, block_ids, dest, timeout_s, grant=b""):
        fetch_bounds.append(timeout_s)
        return real_fetch(host, port, request_id, block_ids, dest, timeout_s, grant)

    def recording_send(conn, buffers, deadline):
        if len(buffers) > 1:  # a data reply: its prefix, then the pages
            send_bounds.append(deadline.timeout_s)
        return real_send(conn, buffers, deadline)

    decode.worker._client.fetch = recording_fetch
    monkeypatch.setattr(tcp_server, "send_buffers", recording_send)
    pull(decode, "d-1", leased(prefill, "p-1", range(16), 60.0), tuple(range(16)))
    assert collect(decode, lambda r: "d-1" in r.recving).failed == set()
    wire_s = 16 * BLOCK_BYTES / (8 * 1024)
    assert fetch_bounds == [pytest.approx(0.2 + wire_s)]
    assert send_bounds == [pytest.approx(tcp_server.TcpTransferServer.io_timeout_s + wire_s)]
