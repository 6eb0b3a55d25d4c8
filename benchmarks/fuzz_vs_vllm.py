"""Differential fuzz: the same request bodies to our OpenAI endpoint and to vLLM's own OpenAI
server on the same checkpoint; where the two answer in different status classes, we must have
said why (DELIBERATE) or it is a failure, and any 5xx of ours is a failure.

    .venv/bin/python -m benchmarks.fuzz_vs_vllm                       # start both, 2,000 bodies
    .venv/bin/python -m benchmarks.fuzz_vs_vllm --bodies 300 --seed 7
    .venv/bin/python -m benchmarks.fuzz_vs_vllm --ours URL --vllm URL # servers already running
    .venv/bin/python -m benchmarks.fuzz_vs_vllm --ours URL --vllm URL --replay benchmarks/results/fuzz_vs_vllm.json

Bodies come from benchmarks/fuzz_bodies.py (seeded). Without URLs it starts vLLM's server
(`python -m vllm.entrypoints.openai.api_server`, the manifest's engine settings and tool parser)
and the manifest (default manifests/local-colocated.yaml) on a LocalCluster, and stops both.
Prints a table and writes benchmarks/results/fuzz_vs_vllm.json, whose `failures` carry each
failing body's exact bytes (base64) for --replay.

Status classes: 2xx, 4xx, 5xx, or no-answer (connection error, timeout). A streamed 200 whose
events carry an error object counts in the error's class (vLLM reports some validation errors
that way once a stream has started), and is counted in `stream_errors`.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import re
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from benchmarks.fuzz_bodies import (COMPLETIONS, DETOKENIZE, GENERATION_ROUTES, TOKENIZE, FuzzBody, generate,
                                    known_fields, lax_int)

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
REQUEST_TIMEOUT_S = 60.0
MAX_SEQUENCES_PER_REQUEST = 128  # deployments/frontend/render.py's fan-out bound
INTERNAL_FIELDS = ("kv_transfer_params", "vllm_xargs")


@dataclass(frozen=True)
class Answer:
    status: int | None  # None: no HTTP answer
    outcome: str  # 2xx | 4xx | 5xx | no-answer (a stream's error event counts in its class)
    reason: str  # the error message, shortened; "" for a success
    stream_error: bool = False


@dataclass(frozen=True)
class Checkpoint:
    """What some listed differences depend on: the model's vocabulary (embedding rows, which the
    generation routes check token ids against) and the tokenizer's size (which /detokenize does)."""

    vocab_size: int = 1024
    tokenizer_size: int = 1024


@dataclass(frozen=True)
class Deliberate:
    """A difference we chose: where `applies(body, checkpoint)`, our answer in `ours` is not a failure."""

    name: str
    reason: str
    applies: Callable[[FuzzBody, Checkpoint], bool]
    ours: frozenset = frozenset({"4xx"})


def _generation_dict(body: FuzzBody) -> dict | None:
    decoded = body.decoded
    return decoded if body.path in GENERATION_ROUTES and isinstance(decoded, dict) else None


def _has_unknown_field(body: FuzzBody, checkpoint: Checkpoint) -> bool:
    fields = _generation_dict(body)
    return fields is not None and bool(set(fields) - known_fields(body.path))


def _sets_internal_field(body: FuzzBody, checkpoint: Checkpoint) -> bool:
    fields = _generation_dict(body)
    return fields is not None and any(fields.get(name) is not None for name in INTERNAL_FIELDS)


def _asks_beam_search(body: FuzzBody, checkpoint: Checkpoint) -> bool:
    fields = _generation_dict(body)
    return fields is not None and fields.get("use_beam_search") not in (None, False)


def _asks_prompt_echo(body: FuzzBody, checkpoint: Checkpoint) -> bool:
    fields = _generation_dict(body)
    return fields is not None and (fields.get("echo") not in (None, False) or fields.get("prompt_logprobs") is not None)


def _fans_out_too_far(body: FuzzBody, checkpoint: Checkpoint) -> bool:
    fields = _generation_dict(body)
    if fields is None:
        return False
    n = lax_int(fields.get("n", 1)) or 1
    prompt = fields.get("prompt")
    prompts = len(prompt) if body.path == COMPLETIONS and isinstance(prompt, list) and prompt and \
        not all(isinstance(t, int) for t in prompt) else 1
    return n * prompts > MAX_SEQUENCES_PER_REQUEST


def _outside_our_info_models(body: FuzzBody, checkpoint: Checkpoint) -> bool:
    """Our /tokenize and /detokenize validate with strict models (deployments/frontend/
    info_routes.py): no fields beyond prompt/messages/add_special_tokens/add_generation_prompt/
    tokens, JSON types as declared (no "true" for true), text-only messages in five roles."""
    if body.path not in (TOKENIZE, DETOKENIZE) or not isinstance(body.decoded, dict):
        return False
    from pydantic import ValidationError

    from deployments.frontend import info_routes

    model = info_routes.Detokenize if body.path == DETOKENIZE else \
        info_routes.TokenizeChat if "messages" in body.decoded else info_routes.TokenizeCompletion
    try:
        model.model_validate(body.decoded)
    except ValidationError:
        return True
    return False


def _detokenizes_beyond_the_tokenizer(body: FuzzBody, checkpoint: Checkpoint) -> bool:
    tokens = body.decoded.get("tokens") if body.path == DETOKENIZE and isinstance(body.decoded, dict) else None
    return isinstance(tokens, list) and any(isinstance(t, int) and t >= checkpoint.tokenizer_size for t in tokens)


def _retrieves_a_model(body: FuzzBody, checkpoint: Checkpoint) -> bool:
    return body.method == "GET" and body.path.startswith("/v1/models/") and body.path != "/v1/models/"


DELIBERATE: tuple[Deliberate, ...] = (
    Deliberate("unknown_field", "unknown top-level fields are a 400 naming them (a misspelt `max_token` must not "
               "be silently ignored); vLLM logs and ignores them", _has_unknown_field),
    Deliberate("internal_field", "`kv_transfer_params` / `vllm_xargs` in a client's body are refused (null is "
               "accepted as not set): they steer the KV connector and engine extensions, which only our servers "
               "may set", _sets_internal_field),
    Deliberate("beam_search", "`use_beam_search` is refused by vLLM's render layer, which our ingress runs: "
               "beam search needs the whole beam in one engine, and each sequence is its own engine request "
               "here", _asks_beam_search),
    Deliberate("prompt_echo", "`echo` and `prompt_logprobs` may be refused: the engines return output tokens "
               "only, not the prompt's logprobs", _asks_prompt_echo),
    Deliberate("fan_out", f"n x prompts > {MAX_SEQUENCES_PER_REQUEST} is refused: each sequence is its own engine "
               "request here", _fans_out_too_far),
    Deliberate("strict_info_route", "/tokenize and /detokenize are our own strict subset of vLLM's "
               "(deployments/frontend/info_routes.py)", _outside_our_info_models),
    Deliberate("detokenize_unknown_id", "/detokenize refuses ids the tokenizer does not have (vLLM decodes them "
               "as empty text)", _detokenizes_beyond_the_tokenizer),
    Deliberate("retrieve_model", "GET /v1/models/{id} is OpenAI's retrieve-model route; vLLM's server has none (404)",
               _retrieves_a_model, frozenset({"2xx", "4xx"})),
)


def verdict(body: FuzzBody, ours: Answer, theirs: Answer,
            checkpoint: Checkpoint = Checkpoint()) -> tuple[str, str | None]:
    """("agree" | "deliberate" | "vllm_error" | "failure", the deliberate difference's name).
    Every 5xx or missing answer of ours is a failure, whatever vLLM answered; where vLLM's server
    fails (5xx, no answer) and we refuse the body as a client error, the fault is vLLM's."""
    if ours.outcome in ("5xx", "no-answer"):
        return "failure", None
    if ours.outcome == theirs.outcome:
        return "agree", None
    listed = next((d for d in DELIBERATE if ours.outcome in d.ours and d.applies(body, checkpoint)), None)
    if listed is not None:
        return "deliberate", listed.name
    if ours.outcome == "4xx" and theirs.outcome in ("5xx", "no-answer"):
        return "vllm_error", None
    return "failure", None


# -- sending -----------------------------------------------------------------------------------


def _class_of(status: int) -> str:
    return f"{status // 100}xx"


def _error_of(payload: object) -> dict | None:
    if not isinstance(payload, dict):
        return None
    if isinstance(payload.get("error"), dict):
        return payload["error"]
    return payload if payload.get("object") == "error" else None


def _stream_error(text: str) -> dict | None:
    for line in text.splitlines():
        if line.startswith("data:") and line[5:].strip().startswith("{"):
            try:
                error = _error_of(json.loads(line[5:]))
            except ValueError:
                continue
            if error is not None:
                return error
    return None


def answer_of(status: int, content_type: str, text: str) -> Answer:
    """The status class (a stream's error event in the class its code or type names) and reason."""
    if status == 200 and content_type.startswith("text/event-stream"):
        error = _stream_error(text)
        if error is None:
            return Answer(status, "2xx", "")
        code = error.get("code")
        outcome = _class_of(code) if isinstance(code, int) and 400 <= code < 600 else \
            "4xx" if "invalid_request" in str(error.get("type")) else "5xx"
        return Answer(status, outcome, str(error.get("message"))[:200], stream_error=True)
    if status < 400:
        return Answer(status, _class_of(status), "")
    try:
        error = _error_of(json.loads(text)) or {}
    except ValueError:
        error = {}
    return Answer(status, _class_of(status), str(error.get("message") or text)[:200])


async def ask(client, base_url: str, body: FuzzBody) -> Answer:
    """Send the body's exact bytes (never re-encoded: lone surrogates stay escapes). A pooled
    connection the server closed as idle just as it was reused fails before the server saw the
    request: that one is sent again, once."""
    import httpx

    headers = {"content-type": "application/json"} if body.method == "POST" else {}
    for attempt in range(2):
        try:
            response = await client.request(body.method, base_url + body.path, content=body.raw or None,
                                            headers=headers)
            return answer_of(response.status_code, response.headers.get("content-type", ""), response.text)
        except (httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError) as exc:
            failure = exc
        except httpx.HTTPError as exc:
            return Answer(None, "no-answer", f"{type(exc).__name__}: {exc}"[:200])
    return Answer(None, "no-answer", f"{type(failure).__name__}: {failure}"[:200])


@dataclass(frozen=True)
class Record:
    body: FuzzBody
    ours: Answer
    vllm: Answer
    verdict: str
    deliberate: str | None


async def ask_all(bodies: list[FuzzBody], base_url: str, concurrency: int = 4) -> list[Answer]:
    """Each body to one server, `concurrency` in flight: to record one side's answers now and
    compare them with the other side's later (`compare`)."""
    import httpx

    limit = asyncio.Semaphore(concurrency)

    async def one(client, body: FuzzBody) -> Answer:
        async with limit:
            return await ask(client, base_url, body)

    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, follow_redirects=True) as client:
        return list(await asyncio.gather(*(one(client, b) for b in bodies)))


def compare(bodies: list[FuzzBody], ours: list[Answer], theirs: list[Answer],
            checkpoint: Checkpoint) -> list[Record]:
    return [Record(body, o, t, *verdict(body, o, t, checkpoint)) for body, o, t in zip(bodies, ours, theirs)]


async def run_bodies(bodies: list[FuzzBody], ours_url: str, vllm_url: str, checkpoint: Checkpoint,
                     concurrency: int = 4, progress: Callable[[str], None] = lambda message: None) -> list[Record]:
    """Each body to both servers at once; `concurrency` bodies in flight."""
    import httpx

    limit = asyncio.Semaphore(concurrency)
    done = 0

    async def one(client, body: FuzzBody) -> Record:
        nonlocal done
        async with limit:
            ours, theirs = await asyncio.gather(ask(client, ours_url, body), ask(client, vllm_url, body))
        done += 1
        if done % 100 == 0:
            progress(f"{done}/{len(bodies)} bodies")
        return Record(body, ours, theirs, *verdict(body, ours, theirs, checkpoint))

    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, follow_redirects=True) as client:
        return list(await asyncio.gather(*(one(client, b) for b in bodies)))


# -- results -----------------------------------------------------------------------------------


def signature(record: Record) -> str:
    """Failures of one kind share this: route, both classes, our reason with numbers erased."""
    reason = re.sub(r"\d+", "N", record.ours.reason or record.vllm.reason)[:70]
    return f"{record.body.path} ours {record.ours.outcome} / vLLM {record.vllm.outcome}: {reason}"


def record_dict(record: Record) -> dict:
    body = record.body
    return {"index": body.index, "method": body.method, "path": body.path, "source": body.source,
            "label": body.label, "raw_b64": base64.b64encode(body.raw).decode(),
            "preview": body.raw[:300].decode("utf-8", "backslashreplace"), "ours": asdict(record.ours),
            "vllm": asdict(record.vllm), "verdict": record.verdict, "deliberate": record.deliberate}


def route_of(body: FuzzBody) -> str:
    return "/v1/models/{id}" if body.path.startswith("/v1/models/") and body.path != "/v1/models/" else body.path


def summarize(records: list[Record]) -> dict:
    failures = [r for r in records if r.verdict == "failure"]
    kinds: dict[str, list[Record]] = {}
    for record in failures:
        kinds.setdefault(signature(record), []).append(record)
    routes = Counter(route_of(r.body) for r in records)
    return {
        "bodies": len(records),
        "agree": sum(r.verdict == "agree" for r in records),
        "agreement_pct": round(100 * sum(r.verdict == "agree" for r in records) / max(1, len(records)), 2),
        "deliberate": dict(Counter(r.deliberate for r in records if r.deliberate).most_common()),
        "deliberate_examples": {name: record_dict(next(r for r in records if r.deliberate == name))
                                for name in {r.deliberate for r in records if r.deliberate}},
        "vllm_errors": sum(r.verdict == "vllm_error" for r in records),
        "vllm_error_examples": [record_dict(r) for r in records if r.verdict == "vllm_error"][:5],
        "failures": len(failures),
        "ours_5xx": sum(r.ours.outcome == "5xx" for r in records),
        "vllm_5xx": sum(r.vllm.outcome == "5xx" for r in records),
        "no_answer": {"ours": sum(r.ours.outcome == "no-answer" for r in records),
                      "vllm": sum(r.vllm.outcome == "no-answer" for r in records)},
        "stream_errors": {"ours": sum(r.ours.stream_error for r in records),
                          "vllm": sum(r.vllm.stream_error for r in records)},
        "differences": dict(Counter(f"ours {r.ours.outcome} / vLLM {r.vllm.outcome}" for r in records
                                    if r.verdict != "agree").most_common()),
        "both_2xx": sum(r.ours.outcome == r.vllm.outcome == "2xx" for r in records),
        "by_route": {route: {"bodies": count, "agree": sum(r.verdict == "agree" for r in records
                                                           if route_of(r.body) == route)}
                     for route, count in routes.most_common()},
        "sources": dict(Counter(r.body.source for r in records)),
        "failure_kinds": [{"kind": kind, "count": len(group), "example": record_dict(group[0])}
                          for kind, group in sorted(kinds.items(), key=lambda item: -len(item[1]))],
    }


def format_table(summary: dict) -> str:
    rows = [("bodies", summary["bodies"]), ("status-class agreement", f"{summary['agreement_pct']:.1f} %"),
            ("answered 2xx by both (generated, tokenized, listed)", summary["both_2xx"]),
            ("deliberate differences", sum(summary["deliberate"].values())),
            ("vLLM 5xx or no answer where we answer 4xx", summary["vllm_errors"]),
            ("unlisted differences and 5xx (failures)", summary["failures"]),
            ("5xx ours / vLLM", f"{summary['ours_5xx']} / {summary['vllm_5xx']}"),
            ("no answer ours / vLLM", f"{summary['no_answer']['ours']} / {summary['no_answer']['vllm']}"),
            ("stream error events ours / vLLM", f"{summary['stream_errors']['ours']} / {summary['stream_errors']['vllm']}")]
    lines = ["| measure | value |", "|---|---:|"] + [f"| {k} | {v} |" for k, v in rows]
    lines += ["", "| route | bodies | same class |", "|---|---:|---:|"]
    lines += [f"| {k} | {v['bodies']} | {v['agree']} |" for k, v in summary["by_route"].items()]
    lines += ["", "| difference (status classes) | bodies |", "|---|---:|"]
    lines += [f"| {k} | {v} |" for k, v in summary["differences"].items()]
    lines += ["", "| deliberate difference | bodies |", "|---|---:|"]
    lines += [f"| {k} | {v} |" for k, v in summary["deliberate"].items()]
    lines += ["", "| failure kind | bodies | example body |", "|---|---:|---|"]
    lines += [f"| {f['kind']} | {f['count']} | `{f['example']['preview'][:160]}` |" for f in summary["failure_kinds"]]
    return "\n".join(lines)


def replay_bodies(path: Path) -> list[FuzzBody]:
    """The failing bodies of an earlier run, byte for byte."""
    data = json.loads(path.read_text())
    return [FuzzBody(f["index"], f["method"], f["path"], base64.b64decode(f["raw_b64"]), f["source"], f["label"])
            for f in data["failure_records"]]


# -- servers and the command line --------------------------------------------------------------


def _log(message: str) -> None:
    print(f"[fuzz_vs_vllm {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def checkpoint_of(model_path: str) -> Checkpoint:
    from transformers import AutoTokenizer

    vocab_size = int(json.loads((Path(model_path) / "config.json").read_text())["vocab_size"])
    return Checkpoint(vocab_size, len(AutoTokenizer.from_pretrained(model_path)))


def start_plain_vllm(manifest, model_path: str, timeout_s: float):
    """vLLM's OpenAI server with the manifest's engine settings and tool parser (our ingress
    parses tools with it too); returns (process, url)."""
    import subprocess
    import tempfile

    from benchmarks.serving_baselines import _free_port, _wait_http_ready, plain_server_command
    from benchmarks.serving_client import _offline_env

    port = _free_port()
    command, env = plain_server_command(manifest, model_path, port)
    if manifest.model.tool_parser:
        command += ["--tool-call-parser", manifest.model.tool_parser, "--enable-auto-tool-choice"]
    log_path = Path(tempfile.mkstemp(prefix="fuzz-vs-vllm-server-", suffix=".log")[1])
    _log(f"starting vLLM's server: {' '.join(command)} (log {log_path})")
    with log_path.open("w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=_offline_env(env), cwd=REPO,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_http_ready(url, proc, timeout_s, log_path)
    except BaseException:
        stop_plain_vllm(proc)
        raise
    return proc, url


def stop_plain_vllm(proc) -> None:
    from benchmarks.serving_baselines import _stop_group

    _stop_group(proc)


def start_our_stack(manifest):
    """The manifest on a LocalCluster, deployed as `moe-serve deploy` does; returns (cluster, url)."""
    from cluster.local_cluster import LocalCluster
    from cluster.serve_control import connect, deploy

    cluster = LocalCluster.for_manifest(manifest).start(progress=_log)
    try:
        connect(cluster.address)
        return cluster, deploy(manifest, progress=_log).url
    except BaseException:
        from benchmarks.serving_client import stop_local_cluster

        stop_local_cluster(cluster, "moe-serve")
        raise


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bodies", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=4, help="bodies in flight (each goes to both servers)")
    parser.add_argument("--manifest", default=str(REPO / "manifests" / "local-colocated.yaml"))
    parser.add_argument("--ours", default=None, help="our endpoint's URL (else the manifest is started)")
    parser.add_argument("--vllm", default=None, help="vLLM's server's URL (else it is started)")
    parser.add_argument("--replay", default=None, help="send the failing bodies of this results file instead")
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--out", default=str(RESULTS / "fuzz_vs_vllm.json"))
    return parser.parse_args()


def main() -> int:
    args = _parse_args()
    from benchmarks.serving_client import _manifest
    from cluster.checkpoints import resolve_model_path

    manifest = _manifest(Path(args.manifest))
    model_path = str(resolve_model_path(manifest.model.path))
    checkpoint = checkpoint_of(model_path)
    bodies = replay_bodies(Path(args.replay)) if args.replay else \
        generate(args.bodies, args.seed, manifest.model.name, checkpoint.vocab_size, checkpoint.tokenizer_size)
    server = cluster = None
    started = time.monotonic()
    try:
        vllm_url = args.vllm
        if vllm_url is None:
            server, vllm_url = start_plain_vllm(manifest, model_path, args.start_timeout)
        ours_url = args.ours
        if ours_url is None:
            cluster, ours_url = start_our_stack(manifest)
        _log(f"servers up in {time.monotonic() - started:.0f}s; {len(bodies)} bodies to {ours_url} and {vllm_url}")
        sent = time.monotonic()
        records = asyncio.run(run_bodies(bodies, ours_url, vllm_url, checkpoint, args.concurrency, _log))
        seconds = time.monotonic() - sent
    finally:
        if server is not None:
            stop_plain_vllm(server)
        if cluster is not None:
            from benchmarks.serving_client import stop_local_cluster

            stop_local_cluster(cluster, "moe-serve")
    summary = summarize(records)
    print(f"\n{len(records)} bodies (seed {args.seed}) to {manifest.name} and vLLM's server in {seconds:.0f}s\n")
    print(format_table(summary))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "command": " ".join([".venv/bin/python", "-m", "benchmarks.fuzz_vs_vllm", *sys.argv[1:]]),
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "manifest": args.manifest, "seed": args.seed,
        "seconds_sending": round(seconds, 1), "summary": summary,
        "deliberate_differences": {d.name: d.reason for d in DELIBERATE},
        "failure_records": [record_dict(r) for r in records if r.verdict == "failure"],
    }, indent=1))
    print(f"\nwrote {out}")
    return 0 if summary["failures"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
