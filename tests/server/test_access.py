"""Access control: API keys (401 in the API's shape), CORS off by default and per --cors-origin,
foreign Origins refused, the Host check when bound to loopback (the DNS-rebinding guard), the
warning for a non-loopback address without a key."""
import time

import anthropic
import httpx
import openai
import pytest

from conftest import Server

MSG = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def keyed():
    s = Server("--api-key", "sk-first", "--api-key", "sk-second", "--cors-origin", "http://app.example",
               "--allowed-host", "box.lan")
    yield s
    s.stop()


def openai_error(r, code):
    body = r.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == code, body
    return body["error"]


def test_no_key_is_401_in_each_api_shape(keyed):
    r = httpx.post(keyed.url + "/v1/chat/completions", json=MSG)
    assert r.status_code == 401
    assert r.headers["www-authenticate"] == "Bearer"
    assert "Missing API key" in openai_error(r, "invalid_api_key")["message"]
    r = httpx.post(keyed.url + "/v1/messages", json={**MSG, "model": "m"})
    assert r.status_code == 401
    assert r.json() == {"type": "error", "error": {"type": "authentication_error", "message": r.json()["error"]["message"]}}
    for path in ["/v1/models", "/metrics", "/", "/v1/nothing"]:
        assert httpx.get(keyed.url + path).status_code == 401, path


def test_wrong_key_is_401_and_health_stays_open(keyed):
    r = httpx.post(keyed.url + "/v1/chat/completions", json=MSG, headers={"Authorization": "Bearer sk-firs"})
    assert r.status_code == 401
    assert openai_error(r, "invalid_api_key")["message"] == "Incorrect API key provided"
    assert httpx.get(keyed.url + "/health").status_code == 200


def test_keys_as_bearer_or_x_api_key_with_the_sdks(keyed):
    client = openai.OpenAI(base_url=keyed.url + "/v1", api_key="sk-second", max_retries=0)
    r = client.chat.completions.create(model="m", max_tokens=2, messages=MSG["messages"])
    assert r.usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.url + "/v1", api_key="nope", max_retries=0).models.list()
    claude = anthropic.Anthropic(base_url=keyed.url, api_key="sk-first", max_retries=0)
    m = claude.messages.create(model="m", max_tokens=2, messages=MSG["messages"])
    assert m.usage.output_tokens == 2
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=keyed.url, api_key="nope", max_retries=0).messages.create(
            model="m", max_tokens=2, messages=MSG["messages"])


def test_key_from_the_environment():
    s = Server(env={"FERROLM_API_KEY": "sk-env1,sk-env2"})
    try:
        assert httpx.get(s.url + "/v1/models").status_code == 401
        assert httpx.get(s.url + "/v1/models", headers={"x-api-key": "sk-env2"}).status_code == 200
    finally:
        s.stop()


def test_cors_for_the_allowed_origin_only(keyed):
    pre = httpx.options(keyed.url + "/v1/chat/completions", headers={
        "Origin": "http://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert pre.status_code == 200, pre.text
    assert pre.headers["access-control-allow-origin"] == "http://app.example"
    assert "authorization" in pre.headers["access-control-allow-headers"].lower()
    r = httpx.post(keyed.url + "/v1/chat/completions", json=MSG,
                   headers={"Origin": "http://app.example", "Authorization": "Bearer sk-first"})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "http://app.example"
    # A refusal still carries CORS headers, so the page can read why.
    r = httpx.post(keyed.url + "/v1/chat/completions", json=MSG, headers={"Origin": "http://app.example"})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "http://app.example"
    # A wrong Origin gets no CORS headers, and its request is refused.
    for method in ["options", "post"]:
        r = httpx.request(method.upper(), keyed.url + "/v1/chat/completions", json=MSG, headers={
            "Origin": "http://evil.example", "Access-Control-Request-Method": "POST",
            "Authorization": "Bearer sk-first"})
        assert r.status_code == 403
        assert not any(h.startswith("access-control-") for h in r.headers)
        openai_error(r, "origin_not_allowed")


def test_same_origin_pages_are_not_cross_origin(server):
    r = httpx.post(server.url + "/v1/chat/completions", json=MSG, headers={"Origin": server.url})
    assert r.status_code == 200


def test_foreign_host_is_refused_on_loopback(keyed):
    key = {"Authorization": "Bearer sk-first"}
    for host in ["attacker.example", "attacker.example:8080", "10.1.2.3"]:
        r = httpx.get(keyed.url + "/v1/models", headers={**key, "Host": host})
        assert r.status_code == 403, host
        openai_error(r, "host_not_allowed")
    r = httpx.post(keyed.url + "/v1/messages", json=MSG, headers={**key, "Host": "attacker.example"})
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    port = keyed.url.rsplit(":", 1)[1]
    for host in ["localhost", f"localhost:{port}", f"127.0.0.1:{port}", "box.lan", f"[::1]:{port}"]:
        assert httpx.get(keyed.url + "/v1/models", headers={**key, "Host": host}).status_code == 200, host


def test_non_loopback_without_a_key_warns():
    s = Server("--host", "0.0.0.0")
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any("without an API key" in l for l in s.stderr):
            time.sleep(0.05)
        assert any("without an API key" in l for l in s.stderr), s.stderr
        # Bound to every address, Host is not checked.
        port = s.url.rsplit(":", 1)[1]
        r = httpx.get(f"http://127.0.0.1:{port}/v1/models", headers={"Host": "box.example"})
        assert r.status_code == 200
    finally:
        s.stop()
