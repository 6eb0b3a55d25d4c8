"""Where moe-serve keeps files outside the checkout: the builtin tiny checkpoints and the local
cluster's state, each overridable by an environment variable (MOE_SERVE_CHECKPOINTS,
MOE_SERVE_STATE_DIR). Other variables are read where they are used: RAY_ADDRESS by
`serve_control`, the node settings by `local_cluster`, and the API keys' variable a manifest
names by the ingress's `api_keys`."""

from __future__ import annotations

import os
from pathlib import Path


def checkpoint_root() -> Path:
    """Where builtin tiny checkpoints are built (outside the checkout, so `ray job submit
    --working-dir .` does not upload them and every local node finds them at the same path)."""
    default = Path.home() / ".cache" / "moe-serve" / "checkpoints"
    return Path(os.environ.get("MOE_SERVE_CHECKPOINTS", default)).expanduser()


def state_dir() -> Path:
    """Where `moe-serve up` keeps the local cluster's state (addresses, pids, logs)."""
    default = Path.home() / ".cache" / "moe-serve" / "state"
    return Path(os.environ.get("MOE_SERVE_STATE_DIR", default)).expanduser()
