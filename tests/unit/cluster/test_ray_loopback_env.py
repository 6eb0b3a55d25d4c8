"""Our local clusters listen on loopback only; a driver must not rewrite 127.0.0.1 to the
machine's interface IP, even when Ray was imported before our environment was applied (CI
once failed every stack test this way: unit tests imported Ray first)."""

import subprocess
import sys

SCRIPT = """
import os
os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
import ray._private.services as services
from cluster.local_cluster import apply_ray_environment
apply_ray_environment(override=False)
print(services.canonicalize_bootstrap_address("127.0.0.1:6391"))
"""


def test_loopback_addresses_stay_loopback_when_ray_was_imported_first():
    # A fresh interpreter: Ray's constant is read once per process, at import.
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "127.0.0.1:6391"
