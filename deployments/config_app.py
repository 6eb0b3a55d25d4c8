"""The Ray Serve application builder behind config-file deploys.

`moe-serve build MANIFEST` writes a Serve config whose `import_path` is
`deployments.config_app:build_from_args` and whose `args` hold the manifest (cluster/serve_config.py).
`serve deploy`, `serve run` and KubeRay's RayService then run this builder in Serve's build task,
on a node of the cluster, and get the application `moe-serve deploy` builds: same manifest
validation and fit check, same checkpoint resolution, the KV pool master on the head node,
the same `build_app`.

Autoscaled pools keep the coordinated policy as each deployment's `policy_function` (all pools
of an application share one decision loop, autoscaler/serve_policy.py). Ray 2.60's
application-level `autoscaling_policy` config field is documented as under development and not
yet supported, so both deploy paths use the same deployment-level wiring.
"""

from __future__ import annotations

import logging
from typing import Any

from ray.serve import Application

logger = logging.getLogger("ray.serve")


def build_from_args(args: dict[str, Any]) -> Application:
    """`args`: {"manifest": the manifest as a mapping} (what `moe-serve build` writes)."""
    from cluster.app_registry import record_app
    from cluster.checkpoints import resolve_model_path
    from cluster.errors import ManifestError, ManifestIssue
    from cluster.fit_check import check_fit
    from cluster.manifest import parse_manifest
    from cluster.serve_control import start_kv_pool
    from deployments.builder import build_app

    unknown = sorted(set(args) - {"manifest"})
    if "manifest" not in args or unknown:
        raise ManifestError("serve config args", [ManifestIssue(
            "applications[].args", ", ".join(unknown) or "{}", "expects exactly one key, `manifest`",
            "regenerate the file with `moe-serve build MANIFEST`")])
    manifest = parse_manifest(args["manifest"], "serve config args.manifest")
    check_fit(manifest)
    model_path = str(resolve_model_path(manifest.model.path))
    pool_address = start_kv_pool(manifest, progress=logger.info) if manifest.kv_pool.enabled else None
    record_app(manifest.name)
    return build_app(manifest, model_path, pool_address)
