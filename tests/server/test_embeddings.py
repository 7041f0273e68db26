"""`/v1/embeddings` with the official openai SDK against `ferrolm serve` on all-MiniLM-L6-v2 (a
BERT embedding model; `python3 scripts/get_model.py all-minilm-l6-v2`): the vectors equal
sentence-transformers' (tests/fixtures/embeddings, from scripts/fixtures/embedding_fixtures.py)
as floats and as base64, for every input shape; bad requests get a 400 in OpenAI's shape; the
generation endpoints refuse an embedding model, and /v1/embeddings refuses a generative one."""
import base64
import json
import math
import struct

import httpx
import openai
import pytest

from conftest import MODELS, ROOT, Server

MINILM = MODELS / "all-MiniLM-L6-v2"
FIXTURE = json.loads((ROOT / "tests/fixtures/embeddings/all-MiniLM-L6-v2.json").read_text())
CASES = FIXTURE["cases"]
# 1 - cosine allowed against the oracle (issue 30 asks 1e-4; the engine test holds 1e-8 on the
# same vectors, and the JSON floats are exact f32 values).
COS_TOL = 1e-6


@pytest.fixture(scope="module")
def emb_server():
    if not (MINILM / "model.safetensors").exists():
        pytest.skip(f"{MINILM} not present (python3 scripts/get_model.py all-minilm-l6-v2)")
    s = Server(model=MINILM)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def emb(emb_server):
    return emb_server.client(max_retries=0, timeout=60)


def one_minus_cos(a, b):
    dot = sum(x * y for x, y in zip(a, b))
    return 1 - dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def assert_close(got, case):
    assert len(got) == FIXTURE["dimension"]
    d = one_minus_cos(got, case["embedding"])
    assert d <= COS_TOL, f"{case['text'][:40]!r}: 1-cos {d:.2e}"


def test_float_list_input_equals_sentence_transformers(emb):
    texts = [c["text"] for c in CASES]
    r = emb.embeddings.create(model="all-MiniLM-L6-v2", input=texts, encoding_format="float")
    assert r.object == "list" and r.model == "all-MiniLM-L6-v2"
    assert [d.index for d in r.data] == list(range(len(CASES)))
    for d, case in zip(r.data, CASES):
        assert d.object == "embedding"
        assert_close(d.embedding, case)
    tokens = sum(len(c["ids"]) for c in CASES)
    assert r.usage.prompt_tokens == tokens and r.usage.total_tokens == tokens


def test_base64_is_what_the_sdk_asks_by_default(emb_server, emb):
    case = CASES[0]
    # The SDK sends encoding_format "base64" when none is given, and decodes it itself.
    r = emb.embeddings.create(model="m", input=case["text"])
    assert_close(r.data[0].embedding, case)
    raw = httpx.post(emb_server.url + "/v1/embeddings",
                     json={"input": case["text"], "encoding_format": "base64"}).json()
    b = base64.b64decode(raw["data"][0]["embedding"])
    assert len(b) == 4 * FIXTURE["dimension"]
    floats = emb.embeddings.create(model="m", input=case["text"], encoding_format="float").data[0].embedding
    # The JSON floats are the shortest decimal of each f32: the same f32 bits as the base64.
    n = FIXTURE["dimension"]
    assert struct.unpack(f"<{n}f", b) == struct.unpack(f"<{n}f", struct.pack(f"<{n}f", *floats))


def test_token_id_inputs_equal_their_text(emb):
    a, b = CASES[0], CASES[3]
    r = emb.embeddings.create(model="m", input=[a["ids"], b["ids"]], encoding_format="float")
    assert_close(r.data[0].embedding, a)
    assert_close(r.data[1].embedding, b)
    one = emb.embeddings.create(model="m", input=a["ids"], encoding_format="float")
    assert len(one.data) == 1 and one.usage.prompt_tokens == len(a["ids"])
    assert_close(one.data[0].embedding, a)


def test_dimensions_equal_to_the_model_width_is_accepted(emb):
    r = emb.embeddings.create(model="m", input="hello", dimensions=384, encoding_format="float")
    assert len(r.data[0].embedding) == 384


@pytest.mark.parametrize("body,param,needle", [
    ({"input": ""}, "input", "empty string"),
    ({"input": []}, "input", "must not be empty"),
    ({}, "input", "required"),
    ({"input": [0, 30522]}, "input", "from 0 to 30521"),
    ({"input": [{"text": "x"}]}, "input", "must be a string"),
    ({"input": "x", "dimensions": 128}, "dimensions", "384"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format", "'float' or 'base64'"),
])
def test_bad_requests_are_400s_naming_the_field(emb_server, body, param, needle):
    r = httpx.post(emb_server.url + "/v1/embeddings", json={"model": "m", **body})
    assert r.status_code == 400, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"}
    assert e["type"] == "invalid_request_error" and e["param"] == param
    assert needle in e["message"], e["message"]


def test_an_input_beyond_the_model_length_is_refused_not_truncated(emb):
    with pytest.raises(openai.BadRequestError) as ei:
        emb.embeddings.create(model="m", input=["short", "word " * 300])
    e = ei.value.body
    assert e["code"] == "context_length_exceeded" and "'input[1]' is 302 tokens" in e["message"], e
    assert "at most 256 tokens" in e["message"]


def test_the_generation_endpoints_refuse_an_embedding_model(emb_server, emb):
    with pytest.raises(openai.BadRequestError) as ei:
        emb.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert "cannot generate" in str(ei.value)
    with pytest.raises(openai.BadRequestError):
        emb.completions.create(model="m", prompt="hi")
    r = httpx.post(emb_server.url + "/v1/messages",
                   json={"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400
    assert r.json()["type"] == "error" and "cannot generate" in r.json()["error"]["message"]
    models = emb.models.list().data
    assert models[0].id == "all-MiniLM-L6-v2" and models[0].context_window == 256
    # The server keeps serving after the refusals.
    assert len(emb.embeddings.create(model="m", input="ok").data) == 1


def test_a_generative_model_refuses_embeddings(client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.embeddings.create(model="m", input="hello")
    assert "cannot compute embeddings" in str(ei.value)
    assert ei.value.body["param"] == "model"
