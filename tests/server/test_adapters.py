"""LoRA adapters through the server (docs/server.md, "LoRA adapters"), on the tiny random-weight
Qwen3 fixture and its PEFT adapters (scripts/fixtures/lora_fixture.py): `--adapter NAME=DIR` at
start, `POST/GET/DELETE /v1/adapters`, `"adapter"` per request (a name, "a+b", "none") on the
OpenAI, Anthropic and Responses endpoints; unknown names and bad folders are 400s in each API's
error shape. That the numbers equal transformers+peft is crates/engine/tests/lora.rs's job; here
the base answer stays byte-identical whatever ran before or beside it."""
import concurrent.futures
import json
import subprocess

import httpx
import pytest

from conftest import ROOT, Server, binary

TINY = ROOT / "tests" / "fixtures" / "tiny"
QWEN3 = TINY / "qwen3"
LORA = TINY / "lora"


@pytest.fixture(scope="module")
def srv():
    s = Server("--adapter", f"one={LORA / 'qwen3' / 'one'}", "--device", "cpu", model=QWEN3)
    yield s
    s.stop()


@pytest.fixture
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        yield c


def complete(http, adapter=..., prompt="abc def ghi", **kw):
    body = {"prompt": prompt, "max_tokens": 10, "temperature": 0, "logprobs": 2, **kw}
    if adapter is not ...:
        body["adapter"] = adapter
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return c["text"], c["logprobs"]


def openai_error(r, status, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] and err["message"]
    if param:
        assert err["param"] == param, err
    return err["message"]


def names(http):
    r = http.get("/v1/adapters")
    assert r.status_code == 200
    return [a["id"] for a in r.json()["data"]]


def test_mounted_at_start_and_listed(http):
    data = http.get("/v1/adapters").json()["data"]
    one = next(a for a in data if a["id"] == "one")
    assert one["object"] == "adapter" and one["rank"] == 4 and one["scale"] == 2.0
    assert one["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_mount_use_and_unmount(http):
    base = complete(http)
    r = http.post("/v1/adapters", json={"name": "two", "path": str(LORA / "qwen3" / "two")})
    assert r.status_code == 201, r.text
    assert r.json()["id"] == "two" and r.json()["target_modules"] == ["q_proj", "v_proj"]
    assert "two" in names(http)
    one, two, both = complete(http, "one"), complete(http, "two"), complete(http, "one+two")
    assert len({str(base), str(one), str(two), str(both)}) == 4, "each adapter changes the answer"
    # The base answer is byte-identical after the adapters ran, and for "none" / null.
    assert complete(http) == base and complete(http, "none") == base and complete(http, None) == base
    assert complete(http, "one") == one
    # Mounting the same name again is a conflict; unmount, then it is unknown.
    r = http.post("/v1/adapters", json={"name": "two", "path": str(LORA / "qwen3" / "two")})
    openai_error(r, 409)
    assert http.delete("/v1/adapters/two").json() == {"id": "two", "object": "adapter", "deleted": True}
    assert "two" not in names(http)
    openai_error(http.delete("/v1/adapters/two"), 404)
    msg = openai_error(http.post("/v1/completions", json={"prompt": "x", "adapter": "one+two"}), 400, "adapter")
    assert 'unknown adapter "two"' in msg and "mounted: one" in msg


def test_rows_with_different_adapters_served_together_equal_alone(http):
    alone = {a: complete(http, a, max_tokens=24) for a in ["one", "none"]}
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        jobs = [(a, pool.submit(complete, http, a, max_tokens=24)) for a in ["one", "none"] * 3]
        for a, f in jobs:
            assert f.result() == alone[a], a


@pytest.mark.parametrize("body,param,words", [
    ({"name": "bad", "path": str(LORA / "llama3" / "one")}, "path", ["does not fit this qwen3 model", "q_proj"]),
    ({"name": "nofolder", "path": str(LORA / "nowhere")}, "path", ["adapter_config.json"]),
    ({"name": "a+b", "path": str(LORA / "qwen3" / "two")}, "name", ["not valid"]),
    ({"name": "none", "path": str(LORA / "qwen3" / "two")}, "name", ["not valid"]),
    ({"path": str(LORA / "qwen3" / "two")}, "name", ["name"]),
    ({"name": "x"}, "path", ["path"]),
])
def test_bad_mounts_are_400_naming_the_field(http, body, param, words):
    msg = openai_error(http.post("/v1/adapters", json=body), 400, param)
    for w in words:
        assert w in msg, msg


def test_unknown_adapter_is_400_in_each_api_shape(http):
    openai_error(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "adapter": "zzz"}), 400, "adapter")
    openai_error(http.post("/v1/completions", json={"prompt": "hi", "adapter": 7}), 400, "adapter")
    openai_error(http.post("/v1/responses", json={"input": "hi", "adapter": "zzz"}), 400)
    r = http.post("/v1/messages", json={"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "adapter": "zzz"})
    assert r.status_code == 400 and r.json()["type"] == "error" and "unknown adapter" in r.json()["error"]["message"]


def test_adapter_on_chat_anthropic_and_responses(http):
    msgs = [{"role": "user", "content": "hello"}]
    chat = lambda a: http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 8, "temperature": 0, "adapter": a}).json()["choices"][0]["message"]["content"]
    anth = lambda a: http.post("/v1/messages", json={"messages": msgs, "max_tokens": 8, "temperature": 0, "adapter": a}).json()["content"]
    resp = lambda a: http.post("/v1/responses", json={"input": msgs, "max_output_tokens": 8, "temperature": 0, "adapter": a}).json()["output"]
    for f in [chat, anth, resp]:
        assert f("one") != f("none")
        assert f("none") == f("none")


def test_generate_runs_with_adapters():
    def tokens(*flags):
        r = subprocess.run([binary(), "generate", "--model", str(QWEN3), "--raw", "--prompt", "abc def ghi", "--max-tokens", "10",
                            "--device", "cpu", "--json", *flags], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["tokens"]
    one, two = f"one={LORA / 'qwen3' / 'one'}", f"two={LORA / 'qwen3' / 'two'}"
    base, with_one = tokens(), tokens("--adapter", one)
    assert with_one != base and tokens("--adapter", one) == with_one
    assert tokens("--adapter", one, "--adapter", two) not in (base, with_one)


def test_a_bad_adapter_flag_stops_the_server():
    r = subprocess.run([binary(), "serve", "--port", "0", "--model", str(QWEN3), "--adapter", f"x={LORA / 'llama3' / 'one'}"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--adapter x=" in r.stderr and "does not fit" in r.stderr
    r = subprocess.run([binary(), "serve", "--port", "0", "--model", str(QWEN3), "--adapter", "nodir"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "NAME=DIR" in r.stderr
