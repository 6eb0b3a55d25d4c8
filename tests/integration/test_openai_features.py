"""The OpenAI features vLLM's server has, through our default layout (P/D with an
expert-parallel decode group), compared with vLLM's own OpenAI server on the same checkpoint
and request, with the official `openai` client (requests and comparisons:
openai_features.py; the colocated path: test_routing_stack.py)."""

from __future__ import annotations

import pytest

from tests.integration.openai_features import FEATURES, ask, assert_same_answer

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("feature", list(FEATURES))
def test_the_pd_ep_path_answers_as_vllms_server_does(stack, vllm_feature_answers, feature):
    assert_same_answer(feature, ask(stack.base_url, stack.model, feature), vllm_feature_answers[feature])
