"""The KV pool's disk tier (Mooncake Store's offload) against a real mooncake_master with
offload on and real clients with a disk folder each: what overflows a DRAM segment is demoted to
disk and read back byte for byte; when the tiers stop making room the oldest objects are dropped
and none is ever served wrong; objects on disk outlive a master restart; a client's folder goes
with it."""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np
import pytest

pytest.importorskip("mooncake.store")

from cluster.kv_pool_service import master_binary  # noqa: E402
from kv_transfer.pool.mooncake_store import MooncakePoolStore  # noqa: E402
from tests.unit.kv_transfer.test_kv_pool_mooncake_store import Master  # noqa: E402

OBJ = 256 << 10
SEGMENT = 16 << 20  # Mooncake's smallest segment: 64 objects
BATCH = 16


class OffloadMaster(Master):
    def __init__(self, tmp_path):
        super().__init__(tmp_path)
        self.config = dataclasses.replace(self.config, offload=True)


@pytest.fixture
def master(tmp_path):
    m = OffloadMaster(tmp_path)
    m.start()
    yield m
    m.kill()


def _objects(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, count * OBJ, dtype=np.uint8)


def _store(master, tmp_path, disk_mib: int, **options) -> MooncakePoolStore:
    settings = master.settings(segment_bytes=SEGMENT, disk_dir=str(tmp_path / "disk" / "engine-0"),
                               disk_bytes=disk_mib << 20)
    store = MooncakePoolStore(settings, transfer_timeout_s=10.0, **options)
    assert store.connect(20.0)
    return store


def _put_all(store: MooncakePoolStore, keys: list[str], data: np.ndarray, deadline_s: float = 60.0) -> None:
    """Puts in batches; a full segment refuses (-200) until the next heartbeat has demoted what
    the master evicted, so a refused batch is offered again, as the engines' next stores are."""
    store.register_buffer(data.ctypes.data, data.nbytes)
    end = time.monotonic() + deadline_s
    for start in range(0, len(keys), BATCH):
        batch = keys[start:start + BATCH]
        while not all(store.put_from(batch, [data.ctypes.data + (start + i) * OBJ for i in range(len(batch))],
                                     [OBJ] * len(batch))):
            assert time.monotonic() < end, f"puts still refused after {deadline_s} s at object {start}"
            time.sleep(0.3)


def _read_all(store: MooncakePoolStore, keys: list[str], data: np.ndarray) -> tuple[int, int]:
    """(objects read back identical, objects missing); anything read must be identical."""
    out = np.zeros_like(data)
    store.register_buffer(out.ctypes.data, out.nbytes)
    same = missing = 0
    for start in range(0, len(keys), BATCH):
        batch = keys[start:start + BATCH]
        codes = store.get_into(batch, [out.ctypes.data + (start + i) * OBJ for i in range(len(batch))],
                               [OBJ] * len(batch))
        for i, code in enumerate(codes):
            index = start + i
            if code == OBJ:
                assert np.array_equal(out[index * OBJ:(index + 1) * OBJ], data[index * OBJ:(index + 1) * OBJ]), \
                    f"object {index} read back wrong"
                same += 1
            else:
                missing += 1
    return same, missing


def _until(predicate, timeout_s: float = 30.0):
    end = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > end:
            return value
        time.sleep(0.5)


def test_what_overflows_dram_is_demoted_to_disk_read_back_identical_and_outlives_a_master_restart(
        master, tmp_path):
    store = _store(master, tmp_path, disk_mib=256)
    keys = [f"disk-test/{i}" for i in range(160)]  # 40 MiB into a 16 MiB segment
    data = _objects(len(keys), seed=1)
    try:
        _put_all(store, keys, data)
        tiers = _until(lambda: (lambda t: t if t.count("disk") >= 64 else None)(store.tiers_of(keys)))
        assert tiers is not None, store.tiers_of(keys)
        assert tiers.count("memory") <= SEGMENT // OBJ and tiers.count("missing") <= BATCH, tiers
        folder = store._client.disk_dir
        assert folder.startswith(str(tmp_path / "disk" / "engine-0")) and os.listdir(folder)
        same, missing = _read_all(store, keys, data)
        assert same >= len(keys) - tiers.count("missing") and same >= 140, (same, missing)

        master.kill()
        master.start()  # same ports: the client reconnects and re-announces its files
        back = _until(lambda: sum(store.exists(keys)) >= 64 if _healthy(store) else False, timeout_s=60.0)
        assert back, "no object on disk came back after the master restarted"
        same, _ = _read_all(store, keys, data)
        assert same >= 64  # what was in DRAM is gone with the master; what was on disk is not
    finally:
        store.close()
    assert not os.path.exists(folder), "a closed client's disk folder stays behind"


def test_a_full_disk_tier_drops_the_oldest_and_never_serves_a_wrong_one(master, tmp_path):
    """8 MiB of disk under a 16 MiB segment, 40 MiB offered. Mooncake 0.3.13 demotes nothing into
    a nearly full tier ("[Evict] triggered", no bucket freed), so puts stay refused; after
    `stuck_s` of refusals (2 s here, 30 by default) the store drops the oldest objects it put,
    and new ones fit again. Every object read back is exact; the newest are there."""
    store = _store(master, tmp_path, disk_mib=8, stuck_s=2.0)
    keys = [f"full-test/{i}" for i in range(160)]
    data = _objects(len(keys), seed=2)
    try:
        _put_all(store, keys, data, deadline_s=120.0)  # every batch is taken in the end
        assert store.stats()["dropped_for_room_total"] > 0
        same, missing = _read_all(store, keys, data)  # asserts that every object read is identical
        assert missing > 0 and same >= BATCH
        newest = keys[-BATCH:]
        assert store.exists(newest) == [True] * BATCH
    finally:
        store.close()


def _healthy(store: MooncakePoolStore) -> bool:
    try:
        store.exists(["probe"])
        return True
    except Exception:  # noqa: BLE001 - reconnecting
        return False


@pytest.fixture
def pinning_master(tmp_path):
    m = OffloadMaster(tmp_path)
    m.config = dataclasses.replace(m.config, keep_pinned=True)  # kv_pool.sessions
    assert "--allow_evict_soft_pinned_objects=false" in m.config.command(master_binary())
    m.start()
    yield m
    m.kill()


def test_a_live_sessions_pinned_objects_stay_in_dram_while_expired_and_unpinned_ones_move_to_disk(
        pinning_master, tmp_path):
    """Session retention (kv_transfer/pool/session_pins.py) on a real master: 24 objects of a
    session are put with a short pin, which expires; 12 of them are renewed by an upsert (what a
    turn's write-back does), then 120 unpinned objects overflow the 64-object segment. The renewed
    stay in DRAM; the expired and the unpinned are what the master demotes to disk."""
    store = _store(pinning_master, tmp_path, disk_mib=256)
    session = [f"session/{i}" for i in range(24)]
    others = [f"other/{i}" for i in range(120)]
    data = _objects(len(session) + len(others), seed=5)
    base = data.ctypes.data
    try:
        store.register_buffer(base, data.nbytes)
        assert all(store.put_from(session, [base + i * OBJ for i in range(24)], [OBJ] * 24, pin_s=2.0))
        time.sleep(2.5)
        assert all(store.put_from(session[:12], [base + i * OBJ for i in range(12)], [OBJ] * 12,
                                  pin_s=120.0, replace=True))
        end = time.monotonic() + 60
        for start in range(0, len(others), BATCH):
            batch = others[start:start + BATCH]
            addresses = [base + (24 + start + i) * OBJ for i in range(len(batch))]
            while not all(store.put_from(batch, addresses, [OBJ] * len(batch))):
                assert time.monotonic() < end, "puts still refused after 60 s"
                time.sleep(0.3)
        tiers = _until(lambda: (lambda t: t if t[12:].count("disk") >= 8 else None)(store.tiers_of(session)))
        assert tiers is not None, store.tiers_of(session)
        assert tiers[:12] == ["memory"] * 12, tiers
        assert store.tiers_of(others).count("disk") >= 48
        same, missing = _read_all(store, session, data[:24 * OBJ])
        assert same == 24 and missing == 0
    finally:
        store.close()
