"""Decode's decision to pull a prefill's lease does not depend on the two nodes' clocks agreeing.

The prefill sends the lease time left (a duration) with its deadline; decode's engine server turns
it into a deadline on its own monotonic clock on receipt. The decode worker here runs with a wall
clock an hour ahead of or behind the prefill's (the prefill keeps the real one, and checks its
own deadline as before); the pulls go over the real tcp transport between two WorkerSides.
"""

from __future__ import annotations

import logging
import time
import types

import pytest

import kv_transfer.connector_worker as connector_worker
from kv_transfer.connector_scheduler import SchedulerSide
from kv_transfer.params import (CONSUME_KEY, TRANSIT_ALLOWANCE_S, TransferParams, handed_over, prefill_request_params,
                                received)
from kv_transfer.settings import ConnectorSettings
from tests.unit.kv_grant_fakes import SECRET
from tests.unit.kv_transfer.test_kv_connector_scheduler import prefill_request
from tests.unit.kv_transfer.test_kv_connector_worker import collect, grant, make_side, pull  # noqa: F401 (fixture)
from tests.unit.kv_transfer.test_kv_connector_worker import HOST, params_for

HOUR_S = 3600.0


def decode_clock_off_by(monkeypatch, offset_s: float) -> None:
    """The decode node's wall clock reads `offset_s` off the prefill's (monotonic is per node anyway)."""
    skewed = types.SimpleNamespace(time=lambda: time.time() + offset_s, monotonic=time.monotonic, sleep=time.sleep)
    monkeypatch.setattr(connector_worker, "time", skewed)


def issued_and_received(params: TransferParams, remaining_s: float) -> TransferParams:
    """What decode's worker gets: the params as prefill issues them, handed over by the prefill
    replica (its clock), then received by decode's engine server (its monotonic clock)."""
    wire = {**params.to_engine(), "lease_remaining_s": remaining_s}
    wire = handed_over(wire, now_unix_s=time.time())
    return TransferParams.from_engine(received(wire, now_s=time.monotonic()))


@pytest.mark.parametrize("offset_s", [HOUR_S, -HOUR_S])
def test_a_live_lease_is_pulled_whatever_decodes_wall_clock_says(make_side, monkeypatch, offset_s):
    prefill, decode = make_side("prefill-0", seed=7), make_side("decode-0")
    grant(prefill, "p-1", (1, 2), lease_s=10.0)
    params = issued_and_received(params_for(prefill, "p-1", (1, 2)), remaining_s=10.0)
    decode_clock_off_by(monkeypatch, offset_s)
    pull(decode, "d-1", params, (5, 6))
    got = collect(decode, lambda r: "d-1" in r.recving)
    assert got.failed == set()  # an hour ahead, the wall-clock check refused every pull
    assert decode.pages.block(5) == prefill.pages.block(1) and decode.pages.block(6) == prefill.pages.block(2)


def test_an_expired_lease_is_refused_by_decode_itself_even_with_its_clock_an_hour_behind(
        make_side, monkeypatch, caplog):
    prefill, decode = make_side("prefill-0", seed=7), make_side("decode-0")
    grant(prefill, "p-1", (1, 2), lease_s=0.2)
    params = issued_and_received(params_for(prefill, "p-1", (1, 2)), remaining_s=0.2)
    time.sleep(0.3)  # the lease is over on both nodes
    decode_clock_off_by(monkeypatch, -HOUR_S)  # by decode's wall clock the deadline is an hour away
    with caplog.at_level(logging.WARNING, logger=connector_worker.__name__):
        pull(decode, "d-1", params, (5, 6))
        assert collect(decode, lambda r: "d-1" in r.recving).failed == {"d-1"}
    assert "LeaseExpired" in caplog.text  # decode's own refusal, before any read reached the prefill
    assert decode.worker.stats()["pulls_failed_total"] == 1


def test_remaining_time_is_read_on_the_prefill_clock_and_converted_on_decodes_receipt():
    wire = {**params_for_fields(), CONSUME_KEY: True, "lease_deadline_unix_s": 1_000.0, "lease_remaining_s": 30.0}
    handed = handed_over(wire, now_unix_s=990.0)  # 10 s later on the prefill node
    assert handed["lease_remaining_s"] == 10.0 and handed["lease_deadline_unix_s"] == 1_000.0  # grant unchanged
    local = received(handed, now_s=5.0)  # decode's monotonic clock
    assert local["lease_deadline_local_s"] == 15.0 - TRANSIT_ALLOWANCE_S
    params = TransferParams.from_engine(local)
    assert params.ends_within(3.0, now_s=12.0, now_unix_s=0.0)  # wall clock ignored once received
    assert not params.ends_within(3.0, now_s=11.0, now_unix_s=5_000.0)
    assert TransferParams.from_engine(params.to_engine()) == params  # both fields survive the wire


def test_params_of_a_prefill_that_sends_no_remaining_time_keep_the_wall_clock_check():
    wire = {**params_for_fields(), CONSUME_KEY: True, "lease_deadline_unix_s": 1_000.0}
    assert received(wire, now_s=5.0) == wire
    params = TransferParams.from_engine(wire)
    assert params.ends_within(5.0, now_s=0.0, now_unix_s=996.0)
    assert not params.ends_within(5.0, now_s=0.0, now_unix_s=994.0)


def test_prefill_issues_the_lease_time_left_with_its_deadline():
    side = SchedulerSide(ConnectorSettings(host=HOST, port=1, engine_id="p", lease_s=8.0, grant_secret=SECRET,
                                           lends_kv=True), 16)
    _, engine_params = side.finished(prefill_request("p-1", params=prefill_request_params()), [3, 4], normally=True)
    assert engine_params["lease_remaining_s"] == 8.0
    assert engine_params["lease_deadline_unix_s"] == pytest.approx(time.time() + 8.0, abs=1.0)


def test_decodes_engine_server_converts_the_lease_time_on_receipt():
    import asyncio

    from deployments.records import EngineRequest, SamplingSpec

    from tests.unit.engine_fakes import recording_server

    server, engine = recording_server()
    wire = {**params_for_fields(), CONSUME_KEY: True, "lease_deadline_unix_s": 0.0, "lease_remaining_s": 20.0}
    before = time.monotonic()

    async def run():
        return [d async for d in server.generate(EngineRequest("d-1", [1, 2, 3], SamplingSpec(max_tokens=1),
                                                               TransferParams.from_engine(wire)))]

    asyncio.run(run())
    deadline = engine.requests[0].pull.lease_deadline_local_s
    assert before + 20.0 - TRANSIT_ALLOWANCE_S <= deadline <= time.monotonic() + 20.0 - TRANSIT_ALLOWANCE_S


def params_for_fields() -> dict:
    return {"remote_host": HOST, "remote_port": 1, "remote_engine_id": "p", "remote_request_id": "p-1",
            "remote_block_ids": [1], "remote_num_tokens": 16, "block_size_tokens": 16}
