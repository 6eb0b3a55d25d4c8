"""What a client reads when an engine fails: vLLM's validation errors are a 400 with vLLM's
own text (as its server answers them), every other failure a 503 or 500 whose body names no
exception, host, port or replica."""

import asyncio

import pytest

from deployments.engine.llm_server import LLMServer, invalid_request
from deployments.errors import engine_error
from deployments.records import EngineFailure, EngineRequest, SamplingSpec
from deployments.stream_deadlines import wait_expired


def test_an_engine_side_validation_error_is_a_400_with_vllms_message():
    error = engine_error(EngineFailure("Requested sample logprobs of 100, which is greater than max allowed: 20",
                                       invalid_request=True, param="logprobs"))
    assert error.status == 400
    assert error.body()["error"] == {"message": "Requested sample logprobs of 100, which is greater than max "
                                                "allowed: 20", "type": "invalid_request_error", "param": "logprobs",
                                     "code": "invalid_value"}


@pytest.mark.parametrize("retriable, status", [(True, 503), (False, 500)])
def test_other_engine_failures_name_nothing_internal(retriable, status):
    internal = "engine replica failed: ActorDiedError: actor 7f3a on 10.1.2.3:41234 (LLMServer decode) died"
    error = engine_error(EngineFailure(internal, retriable=retriable))
    assert error.status == status
    text = str(error.body())
    for leaked in ("ActorDiedError", "10.1.2.3", "41234", "7f3a", "LLMServer"):
        assert leaked not in text
    assert (error.body()["error"]["code"] == "retry") is retriable


def test_an_expired_wait_is_still_a_504_naming_the_wait():
    error = engine_error(wait_expired("first_token", 30.0))
    assert error.status == 504 and error.body()["error"]["code"] == "first_token_timeout"


def test_vllm_client_errors_become_invalid_request_failures_and_others_do_not():
    from vllm.exceptions import VLLMValidationError

    exc = VLLMValidationError("logit_bias has an id outside the vocabulary", parameter="logit_bias")
    assert invalid_request(exc) == EngineFailure(str(exc), retriable=False, invalid_request=True, param="logit_bias")
    assert invalid_request(RuntimeError("engine core died")) is None
    assert invalid_request(ValueError("a bug of ours")) is None


class _RefusingEngine:
    """VLLMEngine's interface; its generate raises as AsyncLLM does for a request it refuses."""

    scheduler = None

    async def generate(self, request):
        from vllm.exceptions import VLLMValidationError

        raise VLLMValidationError("Requested sample logprobs of 100, which is greater than max allowed: 20",
                                  parameter="logprobs")
        yield  # an async generator, as the real one

    async def abort(self, request_id):
        return None

    def unfinished_requests(self):
        return 0


def test_the_engine_server_yields_a_refusal_not_a_retriable_failure():
    server = LLMServer({"name": "m"}, {"stream_interval_ms": 0}, "/unused",
                       engine_factory=lambda *a, **k: _RefusingEngine(), metrics=False)

    async def run():
        return [item async for item in server.generate(EngineRequest("r-1", [1, 2], SamplingSpec(max_tokens=2)))]

    (item,) = asyncio.run(run())
    assert isinstance(item, EngineFailure) and item.invalid_request and not item.retriable
    assert item.param == "logprobs"


def test_the_engine_server_owns_extra_args_whatever_the_params_arrive_with():
    """vLLM's Request takes its kv_transfer_params from extra_args: only ours may be there."""
    from vllm import SamplingParams

    from deployments.engine.vllm_engine import to_sampling_params

    client_set = SamplingParams(max_tokens=2, extra_args={"kv_transfer_params": {"do_remote_decode": True,
                                                                                  "lease_s": float("nan")},
                                                          "other": 1})
    assert to_sampling_params(client_set).extra_args is None
    ours = {"do_remote_decode": True}
    assert to_sampling_params(client_set, ours).extra_args == {"kv_transfer_params": ours}
    assert client_set.extra_args["kv_transfer_params"]["do_remote_decode"] is True  # the caller's copy untouched


class _EndsInError(_RefusingEngine):
    """The engine ends the request itself with finish_reason "error" (as when the grammar
    backend rejects every token the request allows)."""

    async def generate(self, request):
        from deployments.records import TokenDelta

        yield TokenDelta("", [], "error", 2, 0)


@pytest.mark.parametrize("kv_transfer, pull, retriable", [
    (None, False, False),  # colocated, no connector: the same request fails the same way again
    ({"failure_policy": "fail"}, False, True),  # a pool load may have failed under policy fail
    (None, True, True),  # decode's pull from a prefill failed: another prefill may serve
], ids=["no-kv-load", "pool-with-fail-policy", "decode-pull"])
def test_an_engine_ending_a_request_in_error_is_retriable_only_when_a_kv_load_could_be_why(kv_transfer, pull,
                                                                                            retriable):
    from kv_transfer.params import TransferParams

    server = LLMServer({"name": "m"}, {"stream_interval_ms": 0}, "/unused",
                       engine_factory=lambda *a, **k: _EndsInError(), metrics=False)
    server._kv = kv_transfer
    params = TransferParams("127.0.0.1", 1, "p", "p-1", (0,), 2, 16, 4e9) if pull else None

    async def run():
        request = EngineRequest("r-1", [1, 2], SamplingSpec(max_tokens=2), pull=params)
        return [item async for item in server.generate(request)]

    (item,) = asyncio.run(run())
    assert isinstance(item, EngineFailure) and item.retriable is retriable
    assert engine_error(item).status == (503 if retriable else 500)
