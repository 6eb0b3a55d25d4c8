"""BackgroundReleaser retries a release whose connection broke, and only that kind of failure."""

from __future__ import annotations

import threading
import time

from kv_transfer.errors import TransferFailed
from kv_transfer.releaser import RETRY_AFTER_S, BackgroundReleaser
from kv_transfer.params import TransferParams

PARAMS = TransferParams("127.0.0.1", 9, "engine-p", "p-1", (0, 1), 20, 16, 4e9)


class ScriptedClient:
    """release() raises the scripted errors in turn, then succeeds."""

    def __init__(self, *errors: Exception):
        self.errors = list(errors)
        self.calls = 0
        self.done = threading.Event()

    def release(self, host, port, request_id, timeout_s, block_ids=(), grant=b""):
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        self.done.set()


def _run(client: ScriptedClient, wait_s: float) -> list[Exception]:
    failures: list[Exception] = []
    releaser = BackgroundReleaser(1.0, client=client, on_failure=failures.append)
    releaser.submit(PARAMS)
    client.done.wait(wait_s)
    time.sleep(0.05)
    releaser.shutdown()
    return failures


def test_a_release_whose_connection_broke_is_sent_again():
    client = ScriptedClient(TransferFailed("127.0.0.1:9: connection closed before the reply"))
    assert _run(client, wait_s=5.0) == []
    assert client.calls == 2 and client.done.is_set()


def test_it_gives_up_after_its_retries_and_counts_one_failure():
    broken = [TransferFailed("closed") for _ in range(len(RETRY_AFTER_S) + 1)]
    client = ScriptedClient(*broken, TransferFailed("never reached"))
    failures = _run(client, wait_s=sum(RETRY_AFTER_S) + 1.0)
    assert client.calls == len(RETRY_AFTER_S) + 1 and len(failures) == 1


def test_a_refusal_is_not_retried():
    client = ScriptedClient(TransferFailed("server error: release refused", remote=True))
    failures = _run(client, wait_s=0.5)
    assert client.calls == 1 and len(failures) == 1
