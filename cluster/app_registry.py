"""Which Serve applications moe-serve deployed, kept in the cluster's GCS (Ray's internal
key-value store), so that `moe-serve down` removes those and leaves every other Serve
application on a shared cluster alone.

Written by both deploy paths: `moe-serve deploy` (imperative) and the config-file builder that
`serve deploy` / KubeRay run (deployments/config_app.py). Needs a connected Ray driver.
"""

from __future__ import annotations

_NAMESPACE = "moe_serve"
_PREFIX = b"app/"


def record_app(name: str) -> None:
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put(_PREFIX + name.encode(), b"1", overwrite=True, namespace=_NAMESPACE)


def forget_app(name: str) -> None:
    from ray.experimental.internal_kv import _internal_kv_del

    _internal_kv_del(_PREFIX + name.encode(), namespace=_NAMESPACE)


def recorded_apps() -> set[str]:
    from ray.experimental.internal_kv import _internal_kv_list

    return {key[len(_PREFIX):].decode() for key in _internal_kv_list(_PREFIX, namespace=_NAMESPACE)}
