"""Parser names in the manifest are checked at load against cluster/vllm_parsers.py, whose lists
must equal the installed vLLM's registries (this test fails when a vLLM upgrade changes them)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from cluster.errors import ManifestError
from cluster.manifest import parse_manifest
from cluster.vllm_parsers import REASONING_PARSERS, TOOL_PARSERS

LOCAL = yaml.safe_load((Path(__file__).resolve().parents[3] / "manifests" / "local.yaml").read_text())


def test_the_lists_are_the_installed_vllms_registries():
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    assert TOOL_PARSERS == set(ToolParserManager.list_registered())
    assert REASONING_PARSERS == set(ReasoningParserManager.list_registered())


@pytest.mark.parametrize("field, name", [("tool_parser", "hermes"), ("tool_parser", "granite-20b-fc"),
                                         ("reasoning_parser", "deepseek_r1"), ("reasoning_parser", "qwen3")])
def test_known_parsers_load(field, name):
    data = copy.deepcopy(LOCAL)
    data["model"][field] = name
    assert getattr(parse_manifest(data).model, field) == name


@pytest.mark.parametrize("field, name", [("tool_parser", "hermes2"), ("reasoning_parser", "deepseek_v31")])
def test_an_unknown_parser_is_refused_at_load_with_the_known_names(field, name):
    data = copy.deepcopy(LOCAL)
    data["model"][field] = name
    with pytest.raises(ManifestError) as caught:
        parse_manifest(data, "broken.yaml")
    (issue,) = caught.value.issues
    assert issue.field == f"model.{field}" and f"no {field.split('_')[0]} parser named {name!r}" in issue.problem
    assert "hermes" in issue.problem if field == "tool_parser" else "qwen3" in issue.problem
