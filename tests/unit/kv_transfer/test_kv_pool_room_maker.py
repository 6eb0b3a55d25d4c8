"""When a store with a disk tier drops its oldest objects (kv_transfer.pool.disk_tier.RoomMaker):
pure logic, times given."""

from kv_transfer.pool.disk_tier import RoomMaker


def test_the_oldest_quarter_goes_only_after_puts_were_refused_for_stuck_s():
    room = RoomMaker(stuck_s=30.0)
    keys = [f"k{i}" for i in range(40)]
    assert room.after_put(keys, [True] * 40, refused=False, now_s=0.0) == []
    assert room.after_put(["n1"], [False], refused=True, now_s=1.0) == []  # refusals begin
    assert room.after_put(["n1"], [False], refused=True, now_s=30.0) == []  # 29 s: a slow demotion
    assert room.after_put(["n1"], [False], refused=True, now_s=31.5) == keys[:10]  # a quarter, oldest first
    assert room.after_put(["n1"], [False], refused=True, now_s=32.0) == []  # the clock starts again


def test_a_put_taken_resets_the_clock_and_a_stored_key_moves_to_the_back():
    room = RoomMaker(stuck_s=10.0)
    room.after_put(["a", "b", "c", "d"], [True] * 4, refused=False, now_s=0.0)
    room.after_put(["x"], [False], refused=True, now_s=1.0)
    room.after_put(["a"], [True], refused=False, now_s=5.0)  # taken: not stuck; "a" is now the newest
    assert room.after_put(["x"], [False], refused=True, now_s=12.0) == []
    assert room.after_put(["x", "y"], [False, False], refused=True, now_s=22.5) == ["b", "c"]  # at least the batch


def test_what_it_remembers_is_bounded():
    room = RoomMaker(stuck_s=0.0, remembered=3)
    room.after_put(["a", "b", "c", "d", "e"], [True] * 5, refused=False, now_s=0.0)
    room.after_put(["z"], [False], refused=True, now_s=0.0)
    assert room.after_put(["z"], [False], refused=True, now_s=0.0) == ["c"]  # a and b were forgotten
