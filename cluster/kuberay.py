"""A manifest as a KubeRay RayService: what `moe-serve build --kuberay` writes.

The RayService embeds the Serve config of cluster/serve_config.py (manifest inline) as
`spec.serveConfigV2` and describes the Ray cluster that config needs: a head group (Serve
controller, HTTP proxy, ingress replicas, the KV pool master) and one worker group per pool,
named after it, whose pods carry the pool's node labels as Ray node labels and hold the GPUs its
ranks reserve (cluster/kuberay_shape.py has the pod arithmetic). The manifest's `kubernetes`
section supplies the image, namespace, secrets and sizes, and its `rdma` part the engine pods'
RDMA devices, capability, network and NCCL settings (cluster/kuberay_rdma.py). Ray's token
authentication is on (`authOptions`), the API keys come from a Secret, and `render_rayservice`
adds the PodMonitor, PrometheusRule and NetworkPolicy of cluster/kuberay_extras.py. Every generated document is checked against
KubeRay's CRD schema (cluster/kuberay_validate.py) before it is returned.

`python -m cluster.kuberay` rewrites manifests/kuberay/<name>.yaml for the GPU manifests.
"""

from __future__ import annotations

import argparse
import posixpath
from pathlib import Path
from typing import Any

import yaml

from cluster.errors import ManifestError, ManifestIssue
from cluster.kuberay_extras import (APP_LABEL, CLIENT_PORT, DASHBOARD_PORT, GCS_PORT, METRICS_PORT, POOL_LABEL,
                                    network_policy, pod_monitor, prometheus_rule)
from cluster.kuberay_rdma import rdma_env, rdma_header_lines, rdma_layout_issues, with_rdma
from cluster.kuberay_shape import PodShape, pod_shapes
from cluster.kuberay_validate import validate_rayservice
from cluster.manifest import Manifest, parse_manifest
from cluster.manifest_http import serve_environment
from cluster.ray_node_env import NODE_ENVIRONMENT
from cluster.serve_config import APP_BUILDER_IMPORT_PATH

RAY_VERSION = "2.60.0"  # the ray[serve] pin in pyproject.toml (a unit test keeps them equal)
REPO = Path(__file__).resolve().parent.parent
GPU_MANIFESTS = "manifests/deepseek-v3-*.yaml"  # the examples with committed RayServices
COMMITTED_DIR = "manifests/kuberay"

__all__ = ["rayservice_for_manifest", "render_rayservice", "validate_rayservice", "kuberay_yaml"]


def rayservice_for_manifest(manifest: Manifest, serve_config: dict[str, Any]) -> dict[str, Any]:
    """The RayService (ray.io/v1) serving `serve_config` on a cluster laid out for `manifest`.
    ManifestError names the field and the fix when the manifest cannot be laid out as pods
    (no kubernetes.image, a proxy bound to localhost, ...) or the result would not validate."""
    _check_layout(manifest)
    shapes = pod_shapes(manifest)
    rdma_issues = rdma_layout_issues(manifest, shapes)
    if rdma_issues:
        raise ManifestError(f"{manifest.name} (kubernetes.rdma)", rdma_issues)
    k8s = manifest.kubernetes
    doc = {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": manifest.name, "namespace": k8s.namespace, "labels": {APP_LABEL: manifest.name}},
        "spec": {
            "upgradeStrategy": {"type": k8s.upgrade_strategy},
            "serveConfigV2": yaml.safe_dump(serve_config, sort_keys=False),
            "rayClusterConfig": {
                "rayVersion": RAY_VERSION,
                "enableInTreeAutoscaling": manifest.autoscaled,
                "authOptions": {"mode": "token"},  # Ray's token authentication; the operator keeps the token
                "headGroupSpec": _head_group(manifest),
                "workerGroupSpecs": [_worker_group(manifest, shape) for shape in shapes],
            },
        },
    }
    problems = validate_rayservice(doc)
    if problems:
        raise RayServiceError(manifest.name, problems)
    return doc


class RayServiceError(ManifestError):
    """The RayService made from a manifest would not validate; each problem is a JSON path in
    the document and what is wrong there (also as `issues`, for callers that list them)."""

    FIX = "check the manifest's kubernetes section and pools; if they are right, this is a moe-serve bug"

    def __init__(self, manifest_name: str, problems: list[str]):
        super().__init__(f"{manifest_name} (RayService)", [
            ManifestIssue(problem.partition(": ")[0], None, problem.partition(": ")[2], self.FIX)
            for problem in problems])
        self.problems = problems
        self.args = (f"the RayService for manifest {manifest_name} would not validate:\n"
                     + "".join(f"  - {problem}\n" for problem in problems) + f"Fix: {self.FIX}",)


def render_rayservice(doc: dict[str, Any], source: str) -> str:
    """YAML text: a header saying how it was made and how to apply it, the RayService, and (for
    a moe-serve application) its PodMonitor, PrometheusRule and NetworkPolicy, as `---`-separated
    documents."""
    problems = validate_rayservice(doc)
    if problems:
        raise ValueError("the RayService does not validate against KubeRay's schema:\n" +
                         "\n".join(f"  - {problem}" for problem in problems))
    manifest = embedded_manifest(doc)
    documents = [doc]
    if manifest is not None:
        documents += [pod_monitor(manifest), prometheus_rule(manifest)]
        if manifest.kubernetes.network_policy:
            documents.append(network_policy(manifest))
    return _header(doc, manifest, source) + "".join("---\n" + _dump(item) for item in documents)


def embedded_manifest(doc: dict[str, Any]) -> Manifest | None:
    """The manifest a moe-serve RayService carries in its serveConfigV2 (None for other apps)."""
    config = yaml.safe_load(doc["spec"]["serveConfigV2"])
    for app in config.get("applications", []):
        if app.get("import_path") == APP_BUILDER_IMPORT_PATH and "manifest" in (app.get("args") or {}):
            return parse_manifest(app["args"]["manifest"], "spec.serveConfigV2")
    return None


def kuberay_yaml(manifest_path: str | Path, source: str | None = None) -> str:
    """What `moe-serve build --kuberay SOURCE` writes for the manifest at `manifest_path`
    (`source`: the path as the command names it; default: `manifest_path`)."""
    from cluster.manifest import load_manifest
    from cluster.serve_config import serve_config, validate_serve_config

    manifest = load_manifest(manifest_path)
    config = serve_config(manifest, yaml.safe_load(Path(manifest_path).read_text()))
    validate_serve_config(config)
    return render_rayservice(rayservice_for_manifest(manifest, config), source or str(manifest_path))


def committed_files(repo: Path = REPO) -> dict[str, str]:
    """manifests/kuberay/<stem>.yaml -> its content now, for every GPU manifest (repo-relative)."""
    files = {}
    for path in sorted(repo.glob(GPU_MANIFESTS)):
        files[f"{COMMITTED_DIR}/{path.stem}.yaml"] = kuberay_yaml(path, path.relative_to(repo).as_posix())
    return files


# --- checks and pieces ------------------------------------------------------------------------

def _check_layout(manifest: Manifest) -> None:
    k8s, issues = manifest.kubernetes, []
    if not k8s.image:
        issues.append(ManifestIssue(
            "kubernetes.image", None, "required to generate a RayService: every Ray pod runs this image, "
            "and it must hold moe-serve (gpu extra) and vLLM",
            "build manifests/kuberay/Dockerfile (docker build -f manifests/kuberay/Dockerfile -t "
            "REGISTRY/moe-serve:0.1.0-vllm0.32 .), push it, and set kubernetes.image to it"))
    if manifest.http.host not in ("0.0.0.0", "::"):
        issues.append(ManifestIssue(
            "http.host", manifest.http.host, "the Serve proxy in a pod must listen on every interface, "
            "or neither the Service nor other pods reach it", "set http.host: 0.0.0.0"))
    if manifest.autoscaled and not manifest.autoscaling.prometheus_url:
        issues.append(ManifestIssue(
            "autoscaling.prometheus_url", None, "the autoscaler reads Prometheus, and a RayService has no local one",
            "set it to the in-cluster Prometheus that scrapes the PodMonitor (e.g. "
            "http://prometheus-operated.monitoring:9090)"))
    volume, path = k8s.model_volume, manifest.model.path
    if not path.startswith("builtin://"):
        if volume is None:
            issues.append(ManifestIssue(
                "kubernetes.model_volume", None, f"model.path {path} is a directory that no pod would have",
                "mount the checkpoint: model_volume: {claim_name: CLAIM, mount_path: /models} (or host_path)"))
        elif not posixpath.normpath(path).startswith(volume.mount_path.rstrip("/") + "/"):
            issues.append(ManifestIssue(
                "kubernetes.model_volume.mount_path", volume.mount_path, f"model.path {path} is not inside it",
                "mount the volume at a parent directory of model.path"))
    if issues:
        raise ManifestError(f"{manifest.name} (kubernetes)", issues)


def _head_group(manifest: Manifest) -> dict:
    k8s = manifest.kubernetes
    ports = [("gcs-server", GCS_PORT), ("dashboard", DASHBOARD_PORT), ("client", CLIENT_PORT),
             ("serve", manifest.http.port), ("metrics", METRICS_PORT)]
    container = _container(manifest, "ray-head", ports, k8s.head_num_cpus, k8s.head_memory_gib, 0)
    return {
        "rayStartParams": {"dashboard-host": "0.0.0.0", "metrics-export-port": str(METRICS_PORT)},
        "template": _pod_template(manifest, "head", container, worker=False),
    }


def _worker_group(manifest: Manifest, shape: PodShape) -> dict:
    pool = manifest.pool(shape.pool)
    ports = [("metrics", METRICS_PORT)]
    if manifest.http.proxy_location == "EveryNode":
        ports.insert(0, ("serve", manifest.http.port))
    container = _container(manifest, "ray-worker", ports, shape.num_cpus, shape.memory_gib, shape.num_gpus,
                           rdma_env(manifest))
    group = {
        "groupName": pool.name,
        "replicas": shape.replicas,
        "minReplicas": shape.min_replicas,
        "maxReplicas": shape.max_replicas,
        "labels": dict(pool.placement.node_labels),  # Ray node labels: the pool's placement selects them
        "rayStartParams": {"metrics-export-port": str(METRICS_PORT)},
        "template": with_rdma(_pod_template(manifest, pool.name, container, worker=True),
                              manifest.kubernetes.rdma, shape.num_gpus),
    }
    if pool.placement.resources:  # custom Ray resources, per pod = per rank x ranks in the pod
        group["resources"] = {name: f"{amount * shape.ranks_per_pod:g}"
                              for name, amount in sorted(pool.placement.resources.items())}
    return group


def _container(manifest: Manifest, name: str, ports: list[tuple[str, int]], cpus: float,
               memory_gib: float, gpus: int, extra_env: dict[str, str] | None = None) -> dict:
    k8s = manifest.kubernetes
    amounts = {"cpu": _cpu_quantity(cpus), "memory": _memory_quantity(memory_gib)}
    if gpus:
        amounts[k8s.gpu_resource] = str(gpus)
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]  # vLLM's and NCCL's shared memory, Ray's object store
    if k8s.model_volume is not None:
        mounts.append({"name": "model", "mountPath": k8s.model_volume.mount_path, "readOnly": True})
    keys_file = manifest.http.auth.api_keys_file
    if keys_file:
        mounts.append({"name": "api-keys", "mountPath": posixpath.dirname(keys_file), "readOnly": True})
    return {
        "name": name,
        "image": k8s.image,
        "imagePullPolicy": k8s.image_pull_policy,
        "env": _env(manifest, extra_env or {}),
        "ports": [{"name": port_name, "containerPort": port, "protocol": "TCP"} for port_name, port in ports],
        "resources": {"requests": dict(amounts), "limits": dict(amounts)},
        "volumeMounts": mounts,
    }


def _env(manifest: Manifest, extra: dict[str, str]) -> list[dict]:
    """Every pod gets the same variables: Serve may place an ingress replica on any node with a
    free CPU, and each reads the API keys where it runs. Engine pods add `extra` (NCCL's)."""
    k8s = manifest.kubernetes
    plain = {**NODE_ENVIRONMENT, **serve_environment(manifest.http), **k8s.env, **extra}
    env: list[dict] = [{"name": name, "value": value} for name, value in sorted(plain.items())]
    secrets = dict(sorted(k8s.secret_env.items()))
    if manifest.http.auth.api_keys_env:
        secrets[manifest.http.auth.api_keys_env] = k8s.api_keys_secret
    env += [{"name": name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}
            for name, ref in secrets.items()]
    return env


def _pod_template(manifest: Manifest, pool_label: str, container: dict, worker: bool) -> dict:
    k8s = manifest.kubernetes
    volumes: list[dict] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    if k8s.model_volume is not None:
        source = ({"persistentVolumeClaim": {"claimName": k8s.model_volume.claim_name, "readOnly": True}}
                  if k8s.model_volume.claim_name else {"hostPath": {"path": k8s.model_volume.host_path,
                                                                     "type": "Directory"}})
        volumes.append({"name": "model", **source})
    keys_file = manifest.http.auth.api_keys_file
    if keys_file:
        volumes.append({"name": "api-keys", "secret": {
            "secretName": k8s.api_keys_secret.name,
            "items": [{"key": k8s.api_keys_secret.key, "path": posixpath.basename(keys_file)}]}})
    spec: dict[str, Any] = {"containers": [container], "volumes": volumes}
    if k8s.service_account:
        spec["serviceAccountName"] = k8s.service_account
    if worker and k8s.node_selector:
        spec["nodeSelector"] = dict(k8s.node_selector)
    if worker and k8s.tolerations:
        spec["tolerations"] = [item.model_dump(exclude_none=True) for item in k8s.tolerations]
    return {"metadata": {"labels": {APP_LABEL: manifest.name, POOL_LABEL: pool_label}}, "spec": spec}


def _cpu_quantity(cpus: float) -> str:
    return f"{int(cpus)}" if cpus == int(cpus) else f"{round(cpus * 1000)}m"


def _memory_quantity(gib: float) -> str:
    return f"{int(gib)}Gi" if gib == int(gib) else f"{round(gib * 1024)}Mi"


def _header(doc: dict, manifest: Manifest | None, source: str) -> str:
    namespace = doc["metadata"].get("namespace", "default")
    lines = [f"KubeRay RayService generated by `moe-serve build --kuberay {source}`; regenerate rather than",
             "edit (the Serve config and the manifest travel inline in spec.serveConfigV2).",
             "Needs a KubeRay operator v1.5 or later (group `labels`, `authOptions`); guide: manifests/kuberay/README.md."]
    if manifest is not None:
        k8s = manifest.kubernetes
        lines += ["Before applying:",
                  f"  kubectl create namespace {namespace}"]
        if manifest.http.auth.enabled:
            lines.append(f"  kubectl -n {namespace} create secret generic {k8s.api_keys_secret.name} "
                         f"--from-literal={k8s.api_keys_secret.key}=KEY1,KEY2   # the API keys, 16+ characters each")
        lines += [f"  kubectl -n {namespace} create secret generic {ref.name} --from-literal={ref.key}=...   # {name}"
                  for name, ref in sorted(k8s.secret_env.items())]
        lines += rdma_header_lines(manifest)
        lines.append("(The KV transfer grant secret needs nothing: moe-serve makes one per application build.)")
    lines += ["Apply:  kubectl apply -f THIS_FILE",
              "Documents: the RayService" + (", a PodMonitor (Prometheus Operator) scraping Ray's metrics port 8080 "
                                             "on every pod, a PrometheusRule with the alerts" if manifest else "") +
              (", a NetworkPolicy for the pods" if manifest and manifest.kubernetes.network_policy else "") + "."]
    return "".join(f"# {line}\n" if line else "#\n" for line in lines)


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str):
    style = "|" if "\n" in value else None  # serveConfigV2 stays readable YAML inside the YAML
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def _dump(document: dict) -> str:
    return yaml.dump(document, Dumper=_Dumper, sort_keys=False, width=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Rewrite manifests/kuberay/<name>.yaml for the GPU manifests.")
    parser.parse_args(argv)
    for relative, text in committed_files().items():
        (REPO / relative).write_text(text)
        print(f"wrote {relative}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
