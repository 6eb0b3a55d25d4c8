"""Every environment variable moe-serve reads, in one place."""

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
