"""Ports picked by one process and bound later by another come from outside the kernel's
ephemeral range (deployments/ports.py): CI once lost an EP rank to EADDRINUSE when a port found
free with bind(0) was handed to another socket before vLLM's worker bound it."""

import random
import socket

from deployments.ports import LOWEST_PORT, ephemeral_range, reserve_port


def test_a_reserved_port_is_free_and_outside_the_ephemeral_range():
    low, high = ephemeral_range()
    for _ in range(20):
        port = reserve_port("127.0.0.1")
        assert not low <= port <= high and port >= LOWEST_PORT
        with socket.socket() as listener:  # and it can be bound now
            listener.bind(("127.0.0.1", port))


def test_a_taken_port_is_never_returned():
    # Only two ports lie outside this "ephemeral" range; with both taken, the kernel picks.
    ephemeral = (LOWEST_PORT + 2, 65535)
    with socket.socket() as a, socket.socket() as b:
        bound = []
        for sock, port in ((a, LOWEST_PORT), (b, LOWEST_PORT + 1)):
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:  # something on this machine holds it already: taken all the same
                pass
            bound.append(port)
        for seed in range(5):
            assert reserve_port("127.0.0.1", rng=random.Random(seed), ephemeral=ephemeral) not in bound
    picked = {reserve_port("127.0.0.1", rng=random.Random(seed), ephemeral=(32768, 60999)) for seed in range(10)}
    assert all(LOWEST_PORT <= p < 32768 or p > 60999 for p in picked)


def test_the_kernel_picks_when_nothing_lies_outside_the_ephemeral_range():
    port = reserve_port("127.0.0.1", ephemeral=(1024, 65535))
    assert 0 < port <= 65535


def test_an_unreadable_range_file_means_linux_defaults(tmp_path):
    assert ephemeral_range(tmp_path / "missing") == (32768, 60999)
    (tmp_path / "range").write_text("40000\t50000\n")
    assert ephemeral_range(tmp_path / "range") == (40000, 50000)


def test_a_run_of_ports_for_a_tensor_parallel_engine_is_free_and_outside_the_ephemeral_range():
    low, high = ephemeral_range()
    for seed in range(10):
        first = reserve_port("127.0.0.1", rng=random.Random(seed), count=4)
        assert all(not low <= p <= high and p >= LOWEST_PORT for p in range(first, first + 4))
        listeners = [socket.socket() for _ in range(4)]
        try:
            for offset, listener in enumerate(listeners):  # every rank's port can be bound now
                listener.bind(("127.0.0.1", first + offset))
        finally:
            for listener in listeners:
                listener.close()
