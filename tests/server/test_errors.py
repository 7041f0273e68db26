"""Errors in OpenAI's shape with the status and field named; mlx_lm.server's validation texts;
one failing request never affects the next."""
import openai
import pytest

MSG = [{"role": "user", "content": "Hi"}]


def error_of(r):
    body = r.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def post(http, body, path="/v1/chat/completions", **kw):
    return http.post(path, json=body, **kw)


def test_malformed_json(http):
    r = http.post("/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert error_of(r)["message"].startswith("Invalid JSON in request body: ")
    r = http.post("/v1/chat/completions", content=b"[1, 2]")
    assert r.status_code == 400
    assert error_of(r)["message"] == "Request should be a JSON dictionary"


@pytest.mark.parametrize("field,value,message", [
    ("temperature", "hot", "temperature must be of type ('float', 'int')"),
    ("temperature", -1, "temperature must be at least 0"),
    ("top_p", 1.5, "top_p must be at most 1"),
    ("top_k", 2.5, "top_k must be of type int"),
    ("min_p", -0.1, "min_p must be at least 0"),
    ("max_tokens", 0, "max_tokens must be at least 1"),
    ("max_tokens", "10", "max_tokens must be of type int"),
    ("stream", "yes", "stream must be of type bool"),
    ("logprobs", 3, "logprobs must be of type bool"),
    ("top_logprobs", 12, "top_logprobs must be at most 11"),
    ("repetition_penalty", -1, "repetition_penalty must be at least 0"),
    ("xtc_probability", 0, "xtc_probability must be of type float"),
    ("seed", "x", "seed must be of type int"),
    ("logit_bias", {"a": 1}, "logit_bias must be a dict of int to float"),
    ("stop", 5, "stop must be of type str or list of str"),
    ("messages", "hi", "messages must be of type list"),
    ("tools", {"x": 1}, "tools must be of type list"),
])
def test_invalid_fields_are_400_naming_the_field(http, field, value, message):
    body = {"messages": MSG, "max_tokens": 2, field: value}
    r = post(http, body)
    assert r.status_code == 400, r.text
    e = error_of(r)
    assert e["message"] == message
    assert e["type"] == "invalid_request_error"
    assert e["param"] == field


def test_sdk_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model="m", messages=MSG, temperature=-2)
    assert "temperature must be at least 0" in str(ei.value)


def test_missing_messages_and_prompt(http):
    r = post(http, {"max_tokens": 2})
    assert r.status_code == 400
    assert error_of(r)["message"] == "Request did not contain messages"
    r = post(http, {"max_tokens": 2}, path="/v1/completions")
    assert r.status_code == 400
    assert error_of(r)["message"] == "Request did not contain a prompt"
    r = post(http, {"prompt": {"a": 1}}, path="/v1/completions")
    assert error_of(r)["param"] == "prompt"


def test_top_k_beyond_the_vocabulary(http):
    r = post(http, {"messages": MSG, "temperature": 1.0, "top_k": 100000})
    assert r.status_code == 400
    assert error_of(r)["message"] == "`top_k` has to be an integer in the (0, 49152) interval, but is 100000."


def test_prompt_plus_max_tokens_beyond_the_context_is_400(http):
    r = post(http, {"messages": MSG, "max_tokens": 9000})
    assert r.status_code == 400
    e = error_of(r)
    assert e["code"] == "context_length_exceeded"
    assert "maximum context length is 8192 tokens" in e["message"]
    long = "hello " * 9000
    r = post(http, {"prompt": long}, path="/v1/completions")
    assert r.status_code == 400
    assert error_of(r)["code"] == "context_length_exceeded"


def test_template_errors_are_400(http):
    r = post(http, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert r.status_code == 400
    assert error_of(r)["message"] == "Only 'text' content type is supported."


def test_internal_failure_is_500_for_that_request_only(client, http):
    # The engine is given an empty prompt and fails; the handler panics.
    for fault in ("engine", "panic"):
        r = post(http, {"messages": MSG, "max_tokens": 2, "x_ferrolm_fault": fault})
        assert r.status_code == 500, r.text
        assert error_of(r)["type"] == "server_error"
    r = post(http, {"messages": MSG, "max_tokens": 2, "x_ferrolm_fault": "engine", "stream": True})
    assert r.status_code == 200
    assert '"error"' in r.text and "[DONE]" not in r.text
    ok = client.chat.completions.create(model="m", messages=MSG, max_tokens=3)
    assert ok.usage.completion_tokens == 3
