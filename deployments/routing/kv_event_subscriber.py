"""The vLLM KV-events adapter: subscribes to one engine's ZMQ event stream and keeps an
`EngineCacheMirror` of its prefix cache, for the replica's routing report.

Started by the engine's own replica (same node: loopback). A subscriber that joins after the
engine stored blocks would miss them (routers that are cache-blind after a restart), so once the
engine's publisher has connected it asks the engine's replay socket for every buffered batch,
then applies live batches it has not seen (by sequence number); a gap in the sequence (a batch
dropped) is filled from the replay too. A dropped batch shows as a gap only when the next one
arrives, so after QUIET_CATCH_UP_S without live batches the subscriber also asks the replay for
anything past the last one it saw (a quiet engine's last batches would otherwise stay missing:
ZMQ drops what a publisher sends before the subscription reaches it). Runs on a daemon thread;
`stop()` ends it.
"""

from __future__ import annotations

import logging
import threading
import time

from deployments.routing.engine_cache_mirror import EngineCacheMirror
from deployments.ports import reserve_port

logger = logging.getLogger(__name__)

_END_SEQ = (-1).to_bytes(8, "big", signed=True)
_POLL_MS = 200
QUIET_CATCH_UP_S = 1.0


def free_port() -> int:
    """A loopback port for the engine's event sockets, bound later by vLLM (deployments/ports.py)."""
    return reserve_port("127.0.0.1")


def events_config(publish_port: int, replay_port: int, data_parallel_rank: int = 0) -> dict:
    """vLLM's `kv_events_config` for an engine whose events this module will read on these ports.

    vLLM's publisher adds the engine's data-parallel rank to both ports (so that the ranks of a
    group on one host do not collide); an expert-parallel rank is such an engine, so its
    configured ports are lowered by its rank to land on the ports the subscriber reserved."""
    return {"enable_kv_cache_events": True, "publisher": "zmq",
            "endpoint": f"tcp://127.0.0.1:{publish_port - data_parallel_rank}",
            "replay_endpoint": f"tcp://127.0.0.1:{replay_port - data_parallel_rank}"}


class KVEventSubscriber:
    def __init__(self, publish_port: int, replay_port: int, mirror: EngineCacheMirror | None = None):
        self.mirror = mirror or EngineCacheMirror()
        self._publish = f"tcp://127.0.0.1:{publish_port}"
        self._replay = f"tcp://127.0.0.1:{replay_port}"
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._last_seq = -1
        self.batches = 0
        self._thread = threading.Thread(target=self._run, name="kv-event-subscriber", daemon=True)

    def start(self) -> "KVEventSubscriber":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()

    def snapshot(self, limit: int) -> tuple[int | None, list[int]]:
        """(block size, the most recent resident blocks); (None, []) once the subscriber has
        stopped: a mirror that no longer follows the engine must not be reported as its cache
        (the router then falls back to its own estimate)."""
        if not self._thread.is_alive() and self._thread.ident is not None:
            return None, []
        with self._lock:
            return self.mirror.block_size, self.mirror.snapshot(limit)

    # -- the thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        context = zmq.Context.instance()
        live = context.socket(zmq.SUB)
        live.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = live.get_monitor_socket(zmq.EVENT_ACCEPTED)
        try:
            # vLLM's publisher connects to a specific address (it binds only wildcard ones): we bind.
            live.bind(self._publish)
            # Replay only once the publisher is connected: whatever it sends from then on
            # arrives live, everything before comes from the replay (seen twice: skipped).
            if not monitor.poll(10_000):
                logger.warning("kv events: the engine's publisher has not connected to %s yet", self._publish)
            self._replay_from(context, decoder, 0)
            heard_s = time.monotonic()  # the last live batch, or the last catch-up
            while not self._stopping.is_set():
                if live.poll(_POLL_MS):
                    _topic, seq, payload = live.recv_multipart()
                    seq = int.from_bytes(seq, "big")
                    if seq > self._last_seq + 1:  # dropped (slow join, high-water mark): fill the gap
                        self._replay_from(context, decoder, self._last_seq + 1)
                    try:
                        batch = decoder.decode(payload)
                    except (msgspec.DecodeError, ValueError) as exc:  # one bad batch, not the subscriber
                        logger.warning("kv events: skipping a batch that does not decode (seq %d): %s", seq, exc)
                        self._last_seq = max(self._last_seq, seq)
                        continue
                    self._apply(seq, batch)
                    heard_s = time.monotonic()
                elif time.monotonic() - heard_s >= QUIET_CATCH_UP_S:
                    self._replay_from(context, decoder, self._last_seq + 1)  # usually: nothing new
                    heard_s = time.monotonic()
        except Exception:  # never take the replica down: routing falls back to its estimate
            # (snapshot() reports nothing from here on, so the router stops trusting the mirror)
            logger.exception("kv events: subscriber stopped")
        finally:
            live.disable_monitor()
            monitor.close(linger=0)
            live.close(linger=0)

    def _replay_from(self, context, decoder, start_seq: int) -> None:
        import zmq

        replay = context.socket(zmq.DEALER)
        replay.connect(self._replay)
        try:
            replay.send_multipart((b"", start_seq.to_bytes(8, "big")))
            while not self._stopping.is_set():
                if not replay.poll(5000):
                    logger.warning("kv events: no replay from %s; going on with live events", self._replay)
                    return
                _empty, _topic, seq, payload = replay.recv_multipart()
                if seq == _END_SEQ:
                    return
                self._apply(int.from_bytes(seq, "big"), decoder.decode(payload))
        finally:
            replay.close(linger=0)

    def _apply(self, seq: int, batch) -> None:
        if seq <= self._last_seq:
            return  # seen in the replay
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        with self._lock:
            self._last_seq = seq
            self.batches += 1
            for event in batch.events:
                if isinstance(event, BlockStored):
                    self.mirror.stored(event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size)
                elif isinstance(event, BlockRemoved):
                    self.mirror.removed(event.block_hashes)
                elif isinstance(event, AllBlocksCleared):
                    self.mirror.cleared()
