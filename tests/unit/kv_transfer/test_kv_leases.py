import threading

import pytest

from kv_transfer.errors import LeaseExistsError
from kv_transfer.leases import Lease, LeaseTable


def test_grant_records_blocks_and_deadline():
    table = LeaseTable()
    lease = table.grant("a", [4, 5, 6], now_s=100.0, lease_s=10.0)
    assert lease == Lease("a", (4, 5, 6), granted_at_s=100.0, deadline_s=110.0)
    assert table.get("a") == lease
    assert (table.outstanding(), table.outstanding_blocks()) == (1, 3)


def test_release_is_idempotent():
    table = LeaseTable()
    lease = table.grant("a", [1, 2], now_s=0.0, lease_s=5.0)
    assert table.release("a") == lease
    assert table.release("a") is None
    assert table.release("never-granted") is None
    assert (table.outstanding(), table.outstanding_blocks()) == (0, 0)
    assert table.get("a") is None


def test_expire_returns_only_past_deadlines_earliest_first():
    table = LeaseTable()
    table.grant("late", [1], now_s=0.0, lease_s=9.0)
    table.grant("early", [2, 3], now_s=0.0, lease_s=5.0)
    table.grant("alive", [4], now_s=0.0, lease_s=20.0)
    assert table.expire(now_s=4.999) == []
    expired = table.expire(now_s=9.0)  # a deadline equal to now has passed
    assert [lease.request_id for lease in expired] == ["early", "late"]
    assert (table.outstanding(), table.outstanding_blocks()) == (1, 1)
    assert table.expire(now_s=9.0) == []  # removed, so not returned twice
    assert table.release("early") is None  # a late release after expiry is a no-op


def test_extend_moves_the_deadline_but_never_earlier():
    table = LeaseTable()
    table.grant("a", [1], now_s=0.0, lease_s=10.0)
    assert table.extend("a", now_s=8.0, lease_s=10.0).deadline_s == 18.0
    assert table.extend("a", now_s=9.0, lease_s=1.0).deadline_s == 18.0
    assert table.get("a").granted_at_s == 0.0
    assert table.expire(now_s=17.0) == []
    assert [lease.request_id for lease in table.expire(now_s=18.0)] == ["a"]
    assert table.extend("a", now_s=20.0, lease_s=10.0) is None


def test_second_grant_for_a_held_request_raises():
    table = LeaseTable()
    table.grant("a", [1], now_s=0.0, lease_s=1.0)
    with pytest.raises(LeaseExistsError, match="'a' already holds a lease"):
        table.grant("a", [2], now_s=0.0, lease_s=1.0)
    assert table.get("a").block_ids == (1,)
    table.release("a")
    table.grant("a", [2], now_s=0.0, lease_s=1.0)  # after release the id is free again


@pytest.mark.parametrize("lease_s", [0.0, -1.0])
def test_lease_duration_must_be_positive(lease_s):
    with pytest.raises(ValueError, match="lease_s"):
        LeaseTable().grant("a", [1], now_s=0.0, lease_s=lease_s)


def test_covers():
    lease = Lease("a", (1, 2, 3), 0.0, 1.0)
    assert lease.covers([3, 1]) and lease.covers([])
    assert not lease.covers([1, 4])


def test_concurrent_grant_and_release_keep_counts_consistent():
    table = LeaseTable()

    def worker(prefix: str):
        for i in range(500):
            table.grant(f"{prefix}-{i}", [i, i + 1], now_s=0.0, lease_s=1.0)
            if i % 2:
                table.release(f"{prefix}-{i}")

    threads = [threading.Thread(target=worker, args=(str(t),)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert table.outstanding() == 4 * 250
    assert table.outstanding_blocks() == 4 * 250 * 2
    assert len(table.expire(now_s=1.0)) == 1000 and table.outstanding_blocks() == 0
