"""Speculative decoding by prompt lookup (`--draft-kind ngram`): the same answers as plain
decoding, drafts reported in `usage.speculation` and /metrics, `"speculative": false` opts out,
a wrong type is a 400."""
import httpx
import pytest

from conftest import Server

TEXT = ("def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
        "def factorial(n):\n    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result\n")
MSG = [{"role": "user", "content": "Copy this code exactly:\n\n" + TEXT}]


@pytest.fixture(scope="module")
def spec_server():
    s = Server("--draft-kind", "ngram", "--num-draft-tokens", "6")
    yield s
    s.stop()


def ask(server, **extra):
    body = {"model": "m", "messages": MSG, "max_tokens": 60, "temperature": 0, **extra}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_same_answer_with_and_without_speculation(server, spec_server):
    plain = ask(server)
    fast = ask(spec_server)
    assert fast["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    spec = fast["usage"]["speculation"]
    assert spec["drafted"] > 0 and 0 < spec["accepted"] <= spec["drafted"], spec
    assert "speculation" not in plain["usage"]
    m = spec_server.metrics()
    assert m["ferrolm_spec_accepted_tokens_total"] >= spec["accepted"]


def test_a_request_can_opt_out(spec_server):
    r = ask(spec_server, speculative=False)
    assert "speculation" not in r["usage"]


def test_a_wrong_type_is_a_400(spec_server):
    r = httpx.post(spec_server.url + "/v1/chat/completions", json={"messages": MSG, "speculative": "yes"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "speculative"
