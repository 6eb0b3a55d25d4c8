"""Validate a RayService document before anyone applies it: KubeRay's CRD schema, then our checks.

1. The schema: the RayService CRD's openAPIV3Schema, vendored with its license under
   cluster/kuberay_schema/, read with Kubernetes' semantics: unknown fields are errors (as with
   `kubectl apply`'s strict field validation; the API server would otherwise drop them without a
   word), `x-kubernetes-int-or-string` takes an integer or a string (quantities such as "500m"
   are strings), `nullable` admits null, int32/int64 formats are range-checked.
2. What the schema cannot see, each a mistake that would apply cleanly and then fail: a missing
   serveConfigV2, resource names that no device plugin serves (`nvidia.com/gpus`) or that pods
   cannot take, the operator's own group rules (labels only in the group's `labels` field),
   and, for a moe-serve application embedded in serveConfigV2, the manifest itself: every pool
   needs a worker group whose Ray labels match the pool's node labels and whose pods hold the
   GPUs the pool's ranks reserve.

Every problem is one line: the JSON path and what is wrong.
"""

from __future__ import annotations

import copy
import difflib
import functools
import json
import re
from pathlib import Path
from typing import Any

SCHEMA_FILE = Path(__file__).resolve().parent / "kuberay_schema" / "rayservice.openAPIV3Schema.json"
ACCELERATOR_RESOURCES = ("nvidia.com/gpu", "amd.com/gpu", "google.com/tpu", "gpu.intel.com/i915",
                         "gpu.intel.com/xe", "habana.ai/gaudi", "aws.amazon.com/neuron",
                         "aws.amazon.com/neuroncore", "aws.amazon.com/neurondevice")
_CONTAINER_RESOURCES = ("cpu", "memory", "ephemeral-storage")
_QUALIFIED_NAME = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                             r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
MAX_RAYSERVICE_NAME = 47  # KubeRay appends 6 characters for the RayCluster's name (53 at most)
_INT_RANGES = {"int32": (-2**31, 2**31 - 1), "int64": (-2**63, 2**63 - 1)}


def validate_rayservice(doc: dict) -> list[str]:
    """Every problem of `doc` as a RayService, one line each ("$.spec...: what is wrong"); empty
    when it would apply and the operator would build the cluster it describes."""
    if not isinstance(doc, dict):
        return [f"$: a RayService is a mapping, got {type(doc).__name__}"]
    problems = [line for error in sorted(_validator().iter_errors(doc), key=_error_key)
                for line in _schema_messages(error)]
    problems += _document_problems(doc)
    spec = doc.get("spec") if isinstance(doc.get("spec"), dict) else {}
    cluster = spec.get("rayClusterConfig") if isinstance(spec.get("rayClusterConfig"), dict) else {}
    for path, group in _groups(cluster):
        problems += _group_problems(path, group)
    config = _serve_config(spec, problems)
    if config is not None:
        problems += _embedded_manifest_problems(config, cluster)
    return problems


# --- 1. the CRD schema ------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _validator():
    from jsonschema import Draft7Validator, FormatChecker

    checker = FormatChecker(formats=())
    for name, (low, high) in _INT_RANGES.items():
        checker.checks(name)(lambda value, low=low, high=high:
                             not isinstance(value, int) or isinstance(value, bool) or low <= value <= high)
    return Draft7Validator(kubernetes_semantics(json.loads(SCHEMA_FILE.read_text())), format_checker=checker)


def kubernetes_semantics(schema: dict) -> dict:
    """A copy of a structural schema that a JSON Schema validator reads as Kubernetes does."""
    schema = copy.deepcopy(schema)

    def adapt(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                adapt(item)
            return
        if not isinstance(node, dict):
            return
        if node.get("x-kubernetes-int-or-string") and "anyOf" not in node and "type" not in node:
            node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        if node.get("nullable") and isinstance(node.get("type"), str):
            node["type"] = [node["type"], "null"]
        if ("properties" in node and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")):
            node["additionalProperties"] = False  # the API server prunes these; kubectl --validate=strict refuses them
        for key, value in node.items():
            if key == "properties":
                for child in value.values():
                    adapt(child)
            elif key not in ("description", "default", "enum", "required"):
                adapt(value)

    adapt(schema)
    return schema


def _error_key(error) -> tuple:
    return tuple(str(part) for part in error.absolute_path), error.message


def _schema_messages(error) -> list[str]:
    path, schema, instance = error.json_path, error.schema, error.instance
    if error.validator == "additionalProperties" and isinstance(instance, dict):
        known = sorted(schema.get("properties", {}))
        lines = []
        for name in sorted(set(instance) - set(known)):
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"known fields: {', '.join(known[:20])}"
            lines.append(f"{path}: unknown field '{name}' ({hint})")
        return lines
    if schema.get("x-kubernetes-int-or-string"):
        if error.validator == "pattern":
            return [f"{path}: {instance!r} is not a Kubernetes quantity (e.g. 8, \"500m\", \"64Gi\")"]
        if error.validator == "anyOf":
            return [f"{path}: {instance!r} must be an integer or a string (write quantities as strings: "
                    "\"0.5\", \"500m\")"]
    return [f"{path}: {error.message}"]


# --- 2. what the schema cannot see ------------------------------------------------------------

def _document_problems(doc: dict) -> list[str]:
    problems = []
    if doc.get("apiVersion") != "ray.io/v1":
        problems.append(f"$.apiVersion: must be ray.io/v1, got {doc.get('apiVersion')!r}")
    if doc.get("kind") != "RayService":
        problems.append(f"$.kind: must be RayService, got {doc.get('kind')!r}")
    name = (doc.get("metadata") or {}).get("name") if isinstance(doc.get("metadata"), dict) else None
    if not isinstance(name, str) or not _DNS_1035.match(name) or len(name) > MAX_RAYSERVICE_NAME:
        problems.append(f"$.metadata.name: {name!r} must be a DNS-1035 label of at most {MAX_RAYSERVICE_NAME} "
                        "characters (lower case letters, digits, dashes; starting with a letter)")
    return problems


def _groups(cluster: dict) -> list[tuple[str, dict]]:
    base = "$.spec.rayClusterConfig"
    found = []
    if isinstance(cluster.get("headGroupSpec"), dict):
        found.append((f"{base}.headGroupSpec", cluster["headGroupSpec"]))
    for index, group in enumerate(cluster.get("workerGroupSpecs") or []):
        if isinstance(group, dict):
            found.append((f"{base}.workerGroupSpecs[{index}]", group))
    return found


def _group_problems(path: str, group: dict) -> list[str]:
    """KubeRay's own group rules (utils/validation.go) and the pod's resource names. Parts of the
    wrong type are skipped here: the schema has reported them."""
    problems = []
    params = _mapping(group.get("rayStartParams"))
    if "labels" in params:
        problems.append(f"{path}.rayStartParams.labels: the operator refuses Ray labels here; "
                        "put them in the group's `labels` mapping")
    if group.get("resources") and any(params.get(key) for key in ("num-cpus", "num-gpus", "memory", "resources")):
        problems.append(f"{path}.resources: Ray resources set both here and in rayStartParams; use one of them")
    for key, value in _mapping(group.get("labels")).items():
        if not _QUALIFIED_NAME.match(str(key)) or len(str(key).rpartition("/")[2]) > 63:
            problems.append(f"{path}.labels: {key!r} is not a valid label key (optional DNS prefix/, then "
                            "at most 63 letters, digits, '-', '_' or '.')")
        if not isinstance(value, str) or not _LABEL_VALUE.match(value):
            problems.append(f"{path}.labels.{key}: {value!r} is not a valid label value (at most 63 letters, "
                            "digits, '-', '_' or '.', starting and ending alphanumeric)")
    pod = _mapping(_mapping(group.get("template")).get("spec"))
    pod_resources = _mapping(pod.get("resources"))
    for key in [*_mapping(pod_resources.get("limits")), *_mapping(pod_resources.get("requests"))]:
        if key not in ("cpu", "memory") and not str(key).startswith("hugepages-"):
            problems.append(f"{path}.template.spec.resources: pod-level resources take cpu and memory only, "
                            f"not {key!r}; put it in the container's resources.limits")
    containers = pod.get("containers") if isinstance(pod.get("containers"), list) else []
    for index, container in enumerate(containers):
        if isinstance(container, dict) and isinstance(container.get("resources"), dict):
            problems += _container_resource_problems(f"{path}.template.spec.containers[{index}].resources",
                                                     container["resources"])
    return problems


def _mapping(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def _container_resource_problems(path: str, resources: dict) -> list[str]:
    problems = []
    limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
    if not isinstance(limits, dict) or not isinstance(requests, dict):
        return problems  # the schema reported it
    for part, values in (("limits", limits), ("requests", requests)):
        for key in values:
            problem = _resource_name_problem(str(key))
            if problem:
                problems.append(f"{path}.{part}: {problem}")
    for key, value in requests.items():
        if "/" in str(key) and not str(key).startswith("kubernetes.io/") and str(limits.get(key)) != str(value):
            problems.append(f"{path}.limits: extended resource {key!r} must be in limits, equal to its request "
                            f"({value!r}); Kubernetes does not overcommit devices")
    return problems


def _resource_name_problem(key: str) -> str | None:
    if key in _CONTAINER_RESOURCES or key.startswith("hugepages-") or key in ACCELERATOR_RESOURCES:
        return None
    if "/" not in key:
        devices = {name.rpartition("/")[2]: name for name in reversed(ACCELERATOR_RESOURCES)}  # gpu -> nvidia.com/gpu
        close = ([devices[key.lower()]] if key.lower() in devices
                 else difflib.get_close_matches(key, _CONTAINER_RESOURCES, n=1, cutoff=0.6))
        hint = f"; did you mean '{close[0]}'?" if close else ""
        return f"{key!r} is not a Kubernetes resource (cpu, memory, ephemeral-storage, hugepages-*, or a device " \
               f"plugin's domain/name such as nvidia.com/gpu){hint}"
    if key.startswith("nvidia.com/mig-"):
        return None  # MIG slices: nvidia.com/mig-<profile>
    close = difflib.get_close_matches(key.lower(), ACCELERATOR_RESOURCES, n=1, cutoff=0.8)
    if close:  # a near miss of a device plugin's name: no node offers it, the pod would stay Pending
        return f"unknown resource {key!r}: no device plugin serves it, so the pod would never be scheduled; " \
               f"did you mean '{close[0]}'?"
    return None


def _serve_config(spec: dict, problems: list[str]) -> dict | None:
    import yaml

    text = spec.get("serveConfigV2")
    if text is None:
        problems.append("$.spec.serveConfigV2: missing; without it the RayService starts a cluster that serves "
                        "nothing (put the `moe-serve build` Serve config here, as YAML text)")
        return None
    if not isinstance(text, str):
        return None  # the schema reported the type
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        problems.append(f"$.spec.serveConfigV2: not valid YAML: {exc}")
        return None
    if not isinstance(config, dict) or not config.get("applications"):
        problems.append("$.spec.serveConfigV2: must be a Serve config with at least one application "
                        "(`applications:`), as `moe-serve build` writes it")
        return None
    from cluster.serve_config import validate_serve_config

    try:
        validate_serve_config(config)
    except ValueError as exc:
        problems.append(f"$.spec.serveConfigV2: {exc}")
        return None
    return config


def _embedded_manifest_problems(config: dict, cluster: dict) -> list[str]:
    from cluster.errors import ManifestError
    from cluster.manifest import parse_manifest
    from cluster.serve_config import APP_BUILDER_IMPORT_PATH

    problems = []
    for index, app in enumerate(config["applications"]):
        data = (app.get("args") or {}).get("manifest")
        if app.get("import_path") != APP_BUILDER_IMPORT_PATH or data is None:
            continue  # not a moe-serve application: nothing more to compare
        where = f"$.spec.serveConfigV2.applications[{index}].args.manifest"
        try:
            problems += _pool_group_problems(parse_manifest(data, where), cluster)
        except ManifestError as exc:
            problems += [f"{where}.{issue.field}: {issue.problem} (got {issue.value!r}); {issue.fix}"
                         for issue in exc.issues]
    return problems


def _pool_group_problems(manifest, cluster: dict) -> list[str]:
    from cluster.kuberay_shape import pod_shapes

    base = "$.spec.rayClusterConfig.workerGroupSpecs"
    groups = {group.get("groupName"): (f"{base}[{index}]", group)
              for index, group in enumerate(cluster.get("workerGroupSpecs") or []) if isinstance(group, dict)}
    problems = []
    gpu_key = manifest.kubernetes.gpu_resource
    for shape, pool in zip(pod_shapes(manifest), manifest.pools):
        if pool.name not in groups:
            problems.append(f"{base}: no worker group for pool '{pool.name}'; every pool of the manifest needs a "
                            f"group named after it (known groups: {sorted(str(name) for name in groups)})")
            continue
        path, group = groups[pool.name]
        labels = group.get("labels") or {}
        missing = {key: value for key, value in pool.placement.node_labels.items() if labels.get(key) != value}
        if missing:
            problems.append(f"{path}.labels: lacks the pool's node labels {missing}; Ray would place none of "
                            f"pool '{pool.name}''s replicas on these pods")
        found = _container_gpus(group, gpu_key)
        if found != shape.num_gpus:
            problems.append(f"{path}.template.spec.containers[0].resources.limits: pool '{pool.name}' needs "
                            f"{shape.num_gpus} {gpu_key} per pod ({shape.ranks_per_pod} rank(s) x "
                            f"{pool.placement.num_gpus:g}), found {found}")
        if isinstance(group.get("replicas"), int) and group["replicas"] < shape.replicas:
            problems.append(f"{path}.replicas: {group['replicas']} pods, but pool '{pool.name}' starts with "
                            f"{pool.replicas} replica(s) of {shape.pods_per_replica} pod(s): {shape.replicas}")
    keys_env = manifest.http.auth.api_keys_env
    head = cluster.get("headGroupSpec") or {}
    if keys_env and keys_env not in _container_env(head):
        problems.append(f"$.spec.rayClusterConfig.headGroupSpec.template.spec.containers[0].env: lacks {keys_env}, "
                        "the manifest's http.auth.api_keys_env; the ingress on the head would find no API keys")
    return problems


def _container_env(group: dict) -> set[str]:
    try:
        return {item.get("name") for item in group["template"]["spec"]["containers"][0].get("env") or []}
    except (KeyError, IndexError, TypeError, AttributeError):
        return set()


def _container_gpus(group: dict, key: str) -> int | None:
    try:
        value = group["template"]["spec"]["containers"][0]["resources"]["limits"].get(key, 0)
        return int(str(value))
    except (KeyError, IndexError, TypeError, AttributeError, ValueError):
        return 0
