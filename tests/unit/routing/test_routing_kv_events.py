"""The KV-events subscriber against vLLM's own ZMQ publisher (real sockets, no engine):
events published before it joined arrive through the replay, later ones live, none twice."""

import time

import pytest

from deployments.routing.block_hashes import prompt_block_hashes
from deployments.routing.kv_event_subscriber import KVEventSubscriber, events_config, free_port

kv_events = pytest.importorskip("vllm.distributed.kv_events")

BS = 4
PROMPT = list(range(200, 216))  # 4 full blocks


def stored(hashes, parent, tokens):
    return kv_events.BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS,
                                 lora_id=None, medium="GPU", lora_name=None)


def batch(*events):
    return kv_events.KVEventBatch(ts=time.time(), events=list(events))


def wait_for(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("timed out")


def test_a_late_subscriber_catches_up_through_the_replay_then_follows_live_events():
    publish_port, replay_port = free_port(), free_port()
    config = events_config(publish_port, replay_port)
    publisher = kv_events.ZmqEventPublisher(0, endpoint=config["endpoint"], replay_endpoint=config["replay_endpoint"])
    subscriber = None
    try:
        publisher.publish(batch(stored([b"a", b"b"], None, PROMPT[:8])))  # before anyone listens
        time.sleep(0.3)
        subscriber = KVEventSubscriber(publish_port, replay_port).start()
        wait_for(lambda: len(subscriber.mirror) == 2)
        publisher.publish(batch(stored([b"c", b"d"], b"b", PROMPT[8:16])))
        wait_for(lambda: len(subscriber.mirror) == 4)
        block_size, resident = subscriber.snapshot(100)
        assert block_size == BS and resident == list(prompt_block_hashes(PROMPT, BS))
        publisher.publish(batch(kv_events.BlockRemoved(block_hashes=[b"d"], medium="GPU")))
        wait_for(lambda: len(subscriber.mirror) == 3)
        publisher.publish(batch(kv_events.AllBlocksCleared()))
        wait_for(lambda: len(subscriber.mirror) == 0)
        assert subscriber.mirror.orphans == 0
    finally:
        if subscriber is not None:
            subscriber.stop()
        publisher.shutdown()


def test_an_expert_parallel_rank_publishes_on_the_ports_its_subscriber_reserved():
    """vLLM's publisher adds the engine's data-parallel rank to both configured ports; the
    config lowers them by the rank, so rank 1's events reach the subscriber of rank 1's server
    (they went to ports nobody read before: EP groups were cache-blind beyond rank 0)."""
    publish_port, replay_port = free_port(), free_port()
    config = events_config(publish_port, replay_port, data_parallel_rank=1)
    publisher = kv_events.ZmqEventPublisher(1, endpoint=config["endpoint"], replay_endpoint=config["replay_endpoint"])
    subscriber = KVEventSubscriber(publish_port, replay_port).start()
    try:
        time.sleep(0.3)
        publisher.publish(batch(stored([b"a", b"b"], None, PROMPT[:8])))
        wait_for(lambda: len(subscriber.mirror) == 2)
    finally:
        subscriber.stop()
        publisher.shutdown()


def test_a_batch_that_does_not_decode_is_skipped_and_a_dead_subscriber_reports_nothing():
    """A malformed message costs one batch, not the subscriber; and once the subscriber has
    stopped (here: its port was taken), its frozen mirror is no longer reported as the cache."""
    import zmq

    publish_port, replay_port = free_port(), free_port()
    subscriber = KVEventSubscriber(publish_port, replay_port).start()
    context = zmq.Context.instance()
    raw = context.socket(zmq.PUB)
    raw.connect(f"tcp://127.0.0.1:{publish_port}")
    try:
        time.sleep(0.5)  # the subscription reaches the publisher
        raw.send_multipart([b"", (0).to_bytes(8, "big"), b"\xc1 not msgpack"])
        time.sleep(0.5)
        assert subscriber._thread.is_alive()
    finally:
        raw.close(linger=0)
        subscriber.stop()

    # A subscriber whose bind fails stops at once: its snapshot says nothing.
    blocker = context.socket(zmq.PUB)
    taken = free_port()
    blocker.bind(f"tcp://127.0.0.1:{taken}")
    try:
        dead = KVEventSubscriber(taken, free_port()).start()
        wait_for(lambda: not dead._thread.is_alive())
        assert dead.snapshot(100) == (None, [])
    finally:
        blocker.close(linger=0)
