import asyncio
import time

import pytest

from deployments.engine.stream_coalescer import coalesce


async def _paced(items, gap_s):
    for item in items:
        await asyncio.sleep(gap_s)
        yield item


def _run(source, interval_s, final=lambda x: x == "end"):
    async def collect():
        out = []
        started = time.monotonic()
        async for chunk in coalesce(source, interval_s, lambda a, b: a + b, lambda x: x.endswith("end")):
            out.append((chunk, time.monotonic() - started))
        return out
    return asyncio.run(collect())


def test_disabled_passes_every_item_through():
    out = _run(_paced(["a", "b", "c"], 0.001), 0)
    assert [c for c, _ in out] == ["a", "b", "c"]


def test_first_item_is_not_delayed_and_fast_items_merge():
    out = _run(_paced(["a"] + ["b"] * 20 + ["end"], 0.005), 0.05)
    chunks = [c for c, _ in out]
    assert chunks[0] == "a"
    assert out[0][1] < 0.04  # sent as soon as it arrived, not after the interval
    assert "".join(chunks) == "a" + "b" * 20 + "end"  # nothing lost, order kept
    assert len(chunks) < 8  # 21 deltas over ~0.11 s in 0.05 s windows


def test_slow_items_are_not_held_back():
    out = _run(_paced(["a", "b", "c"], 0.06), 0.02)
    assert [c for c, _ in out] == ["a", "b", "c"]


def test_final_item_flushes_immediately():
    out = _run(_paced(["a", "xend"], 0.001), 10.0)
    assert "".join(c for c, _ in out) == "axend"
    assert out[-1][1] < 1.0


def test_source_error_reaches_consumer_after_pending_items():
    async def failing():
        yield "a"
        await asyncio.sleep(0.001)
        raise RuntimeError("engine died")

    with pytest.raises(RuntimeError, match="engine died"):
        _run(failing(), 0.05)


def test_consumer_close_cancels_the_source():
    closed = asyncio.Event()

    async def endless():
        try:
            while True:
                await asyncio.sleep(0.001)
                yield "x"
        finally:
            closed.set()

    async def consume_two():
        stream = coalesce(endless(), 0.01, lambda a, b: a + b, lambda x: False)
        got = [await anext(stream), await anext(stream)]
        await stream.aclose()
        await asyncio.wait_for(closed.wait(), 1.0)
        return got

    assert len(asyncio.run(consume_two())) == 2
