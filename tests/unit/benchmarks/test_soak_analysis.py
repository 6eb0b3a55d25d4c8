"""benchmarks/soak_analysis.py: memory growth per process and the cost of a fault, on made-up data."""

from __future__ import annotations

import pytest

from benchmarks.soak_analysis import MIB, Outcome, Sample, fault_report, memory_growth, rss_outside_arenas


def test_growth_is_median_to_median_after_warm_up_and_ignores_restarted_processes():
    samples = [Sample(t, {1: ("ray::ServeReplica:moe-local:decode", (100 + t) * MIB),
                          2: ("raylet", 50 * MIB if t != 40 else 500 * MIB)})  # one spike: not growth
               for t in range(0, 100, 10)]
    samples[-1] = Sample(90, {**samples[-1].rss, 3: ("VLLM::EngineCore", 10 * MIB)})  # started late
    growth = memory_growth(samples, warm_until_s=30)
    assert [(g.pid, g.label) for g in growth] == [(1, "ray::ServeReplica:moe-local:decode"), (2, "raylet")]
    # first three after warm-up: 130, 140, 150 -> 140; last three: 170, 180, 190 -> 180
    assert growth[0].start_mib == 140 and growth[0].end_mib == 180 and growth[0].growth_mib == 40
    assert growth[1].growth_mib == 0


def test_too_few_samples_after_warm_up_is_an_error_that_says_what_to_do():
    with pytest.raises(ValueError, match="run longer or sample more often"):
        memory_growth([Sample(t, {}) for t in range(5)], warm_until_s=0)


def test_a_fault_counts_requests_overlapping_it_and_only_unretriable_ones_as_lost():
    outcomes = [
        Outcome(0, 5, 200),                     # ended before the fault: not counted
        Outcome(8, 12, 503, "retry"),           # in flight at the fault: affected, retriable
        Outcome(9, 11, "error-event", "retry"),  # a stream cut with a retry event: affected
        Outcome(10.5, 40, "no-answer"),         # no answer at all: lost
        Outcome(11, 13, 504, "first_token_timeout"),  # a timeout is not "retry": lost
        Outcome(12, 14, 200),                   # first success started after the fault: 4 s
        Outcome(50, 51, 503, "retry"),          # after recovery: not this fault's
    ]
    report = fault_report("prefill replica killed", "SIGKILL", outcomes, fault_at_s=10, recovered_at_s=30)
    assert (report.affected, report.lost, report.first_success_s, report.full_capacity_s) == (4, 2, 4, 20)
    assert report.slowest_s == 29.5  # the request without an answer, 10.5 s -> 40 s
    never = fault_report("node removed", "remove_node", outcomes, fault_at_s=10, recovered_at_s=None)
    assert never.full_capacity_s is None and never.affected == 5


SMAPS = """\
55d0c0000000-55d0c0021000 r--p 00000000 fd:01 123 /usr/bin/python3.11
Size:                132 kB
Rss:                 132 kB
55d0c1000000-55d0c9000000 rw-p 00000000 00:00 0 [heap]
Size:             131072 kB
Rss:               40000 kB
7f0000000000-7f0040000000 rw-p 00000000 00:00 0
Size:            1048576 kB
Rss:              300000 kB
7f0040000000-7f0044000000 rw-p 00000000 00:00 0
Size:              65536 kB
Rss:               20000 kB
VmFlags: rd wr mr mw me ac sd
7f0050000000-7f005f000000 rw-s 00000000 00:1b 952                        /dev/shm/psm_83300fef
Size:             245760 kB
Rss:              100000 kB
7f0060000000-7f0070000000 r-xp 00000000 fe:00 2271274                    /venv/lib/libtorch_cpu.so
Size:             333716 kB
Rss:               59000 kB
"""


def test_rss_outside_arenas_leaves_out_only_large_anonymous_or_shared_memory_mappings():
    outside, inside = rss_outside_arenas(SMAPS)
    # the 1 GiB anonymous mapping and the 240 MiB shared-memory ring are arenas; the binary,
    # [heap], the 64 MiB malloc arena and a large library are not
    assert inside == (300000 + 100000) * 1024
    assert outside == (132 + 40000 + 20000 + 59000) * 1024


def test_rss_by_kind_says_where_a_process_is_resident():
    from benchmarks.soak_analysis import rss_by_kind

    kinds = rss_by_kind(SMAPS)
    assert kinds == {"file": (132 + 59000) * 1024, "heap": 40000 * 1024, "arena": (300000 + 100000) * 1024,
                     "anon": 20000 * 1024}
    outside, inside = rss_outside_arenas(SMAPS)
    assert sum(kinds.values()) == outside + inside and kinds["arena"] == inside


def test_the_soak_reports_which_kind_of_mapping_grew():
    from benchmarks.soak_analysis import growth_by_kind

    mib = 1 << 20
    samples = [(t, {7: ("VLLM::Worker", {"heap": 100 * mib + t * 10 * mib, "anon": 50 * mib, "file": 80 * mib})})
               for t in range(10)]
    # warm-up ends at t=2: median of t=2,3,4 against t=7,8,9
    assert growth_by_kind(samples, 2, [7]) == {7: {"anon": 0.0, "file": 0.0, "heap": 50.0}}
