"""API keys on every route but /health, and the info routes (/tokenize, /detokenize,
/v1/models/{id}, /version), on the real ingress with fakes for the engine and tokenizer."""

import logging

import pytest

from cluster.errors import ManifestError
from cluster.manifest import parse_manifest
from deployments.frontend.api_keys import ApiKeyCheck, ApiKeyConfigError, load_api_keys
from tests.unit.ingress_fakes import HELLO, HTTP, MAX_MODEL_LEN, FakeEngine, make_client, tokenizer
from tests.unit.ingress_fakes import client, engine  # noqa: F401 (fixtures)

KEY = "k-0123456789abcdef0123"
OTHER_KEY = "k-fedcba9876543210fedc"
PROTECTED = [("GET", "/v1/models", None), ("GET", "/v1/models/m", None), ("GET", "/version", None),
             ("POST", "/v1/completions", {"model": "m", "prompt": "hi"}),
             ("POST", "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
             ("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [104]})]


@pytest.fixture
def keyed(tmp_path):
    secrets = tmp_path / "keys"
    secrets.write_text(f"# two keys\n{KEY}\n\n{OTHER_KEY}\n")
    fake = FakeEngine(script=list(HELLO))
    http_client, _ = make_client(fake, http=dict(HTTP, auth={"api_keys_file": str(secrets)}))
    with http_client:
        yield http_client, fake


def _call(http_client, method, path, body, headers=None):
    return http_client.request(method, path, json=body, headers=headers or {})


@pytest.mark.parametrize("method,path,body", PROTECTED)
def test_every_route_but_health_needs_a_key(keyed, method, path, body):
    http_client, fake = keyed
    for headers in ({}, {"Authorization": "Bearer wrong-key-0123456789"}, {"Authorization": f"Basic {KEY}"},
                    {"Authorization": "Bearer "}):
        response = _call(http_client, method, path, body, headers)
        assert response.status_code == 401, (path, headers, response.text)
        error = response.json()["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
        assert response.headers["WWW-Authenticate"] == "Bearer"
        assert "wrong-key" not in response.text
    assert fake.streams == []  # nothing reached the engine


@pytest.mark.parametrize("key", [KEY, OTHER_KEY])
@pytest.mark.parametrize("method,path,body", PROTECTED)
def test_a_configured_key_is_accepted(keyed, method, path, body, key):
    http_client, _ = keyed
    response = _call(http_client, method, path, body, {"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text


def test_health_stays_open(keyed):
    http_client, _ = keyed
    assert http_client.get("/health").status_code == 200


def test_an_open_endpoint_says_so_when_it_starts(caplog):
    with caplog.at_level(logging.WARNING, logger="deployments.frontend.openai_ingress"):
        make_client(FakeEngine(script=[]))
    assert any("no API keys configured" in r.message for r in caplog.records)


def test_keys_never_reach_the_logs(tmp_path, caplog):
    secrets = tmp_path / "keys"
    secrets.write_text(KEY + "\n")
    with caplog.at_level(logging.DEBUG):
        load_api_keys(None, str(secrets))
        with pytest.raises(ApiKeyConfigError) as short:
            load_api_keys("SHORT", None, environ={"SHORT": "abc"})
    assert KEY not in caplog.text and "abc" not in str(short.value)


def test_key_sources_fail_with_the_fix(tmp_path):
    with pytest.raises(ApiKeyConfigError, match=r"\$MISSING.*unset or empty"):
        load_api_keys("MISSING", None, environ={})
    with pytest.raises(ApiKeyConfigError, match="cannot be read"):
        load_api_keys(None, str(tmp_path / "absent"))
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n\n")
    with pytest.raises(ApiKeyConfigError, match="holds no key"):
        load_api_keys(None, str(empty))
    assert load_api_keys("K", None, environ={"K": f" {KEY} , {OTHER_KEY} "}) == [KEY, OTHER_KEY]


def test_the_check_is_exact():
    check = ApiKeyCheck.of([KEY])
    assert check.allows(f"Bearer {KEY}") and check.allows(f"bearer  {KEY} ")
    assert not check.allows(f"Bearer {KEY}x") and not check.allows(f"Bearer {KEY[:-1]}")
    assert not check.allows(KEY) and not check.allows(None) and not check.allows("")


def test_manifest_requiring_keys_must_name_a_source():
    with pytest.raises(ManifestError, match="api_keys_env"):
        parse_manifest({"model": {"name": "m", "path": "builtin://tiny-qwen3-moe"},
                        "pools": [{"name": "p", "role": "colocated"}], "http": {"auth": {"required": True}}}, "t")


# -- info routes ------------------------------------------------------------------------------


def test_tokenize_and_detokenize_use_the_ingress_tokenizer(client):
    plain = client.post("/tokenize", json={"model": "m", "prompt": "hey you", "add_special_tokens": False}).json()
    expected = tokenizer().encode_prompt("hey you", add_special_tokens=False)
    assert plain == {"count": len(expected), "max_model_len": MAX_MODEL_LEN, "tokens": expected, "token_strs": None}
    messages = [{"role": "user", "content": "hi"}]
    chat = client.post("/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == tokenizer().encode_chat(messages)
    back = client.post("/detokenize", json={"tokens": plain["tokens"]}).json()
    assert back == {"prompt": "hey you"}


@pytest.mark.parametrize("path,body,status,needle", [
    ("/tokenize", {"prompt": "x", "bogus": 1}, 400, "unknown field 'bogus'"),
    ("/tokenize", {"model": "other", "prompt": "x"}, 404, "does not exist"),
    ("/detokenize", {"tokens": [10 ** 9]}, 400, "outside the vocabulary"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
])
def test_info_routes_reject_bad_input_clearly(client, path, body, status, needle):
    response = client.post(path, json=body)
    assert response.status_code == status and needle in response.json()["error"]["message"]


def test_model_by_id_and_version(client):
    card = client.get("/v1/models/m").json()
    assert (card["id"], card["object"], card["max_model_len"]) == ("m", "model", MAX_MODEL_LEN)
    missing = client.get("/v1/models/gpt-4")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    version = client.get("/version").json()
    assert version["version"] and version["moe_serve"]
