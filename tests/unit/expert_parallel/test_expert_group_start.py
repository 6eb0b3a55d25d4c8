"""An expert-parallel group whose other rank fails to start must fail its own start at once
(CI: rank 1's KV port was taken, rank 0's engine waited for its DP coordinator for good and the
replica stayed STARTING for seven minutes). deployments/expert_parallel/expert_group.py."""

import threading
import time

import pytest

from deployments.expert_parallel.group_start import ray_start_failure, start_local_rank


def test_rank0_start_fails_as_soon_as_another_rank_failed():
    never = threading.Event()
    failures = iter([None, None, "rank 1 failed to start: OSError: [Errno 98] Address already in use"])
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="Address already in use"):
        start_local_rank(lambda: never.wait(60), lambda: next(failures), poll_s=0.01)
    assert time.monotonic() - started < 5  # not rank 0's own (unbounded) wait
    never.set()


def test_rank0_is_returned_once_built_and_its_own_error_is_raised():
    assert start_local_rank(lambda: "server", lambda: None, poll_s=0.01) == "server"

    def broken():
        raise ValueError("bad engine args")

    with pytest.raises(ValueError, match="bad engine args"):
        start_local_rank(broken, lambda: None, poll_s=0.01)


def test_fakes_that_are_not_ray_actors_are_not_watched():
    assert ray_start_failure([object(), object()])() is None
    assert ray_start_failure([])() is None
