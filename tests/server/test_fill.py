"""Fill (docs/fill.md): the tool-call scaffold, tool names and punctuation a request determines
are appended as spans and verified, so a tool-call turn's answer is the same with fill on and
off; `usage.fill` says what was appended and wasted; `"fill": false` opts out; a wrong type is a
400. Recorded tool-call turns (tests/fixtures/fill/tool_turns.json) on Qwen2.5-Coder-0.5B, and
SmolLM2 (a template without tools: the server's own <tool_call> description)."""
import json

import httpx
import pytest

from conftest import MODELS, ROOT, Server
from test_tools import ASK, TOOLS

QWEN = MODELS / "qwen2.5-coder-0.5b-instruct-Q4_K_M.gguf"
FIXTURE = json.loads((ROOT / "tests/fixtures/fill/tool_turns.json").read_text())
TURNS = {t["name"]: t["messages"] for t in FIXTURE["turns"]}


@pytest.fixture(scope="module")
def qwen():
    if not QWEN.exists():
        pytest.skip(f"{QWEN} not present (scripts/get_model.py qwen2.5-coder-0.5b)")
    s = Server("--max-tokens", "64", model=QWEN)
    yield s
    s.stop()


def ask(server, messages, tools, **extra):
    body = {"model": "m", "messages": messages, "max_tokens": 48, "temperature": 0, **extra}
    if tools:
        body["tools"] = tools
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def answer(r):
    m = r["choices"][0]["message"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or []]
    return m.get("content"), calls, r["choices"][0]["finish_reason"], r["usage"]["completion_tokens"]


def test_recorded_turns_are_the_same_with_fill_on_and_off(qwen):
    injected = wasted = 0
    for turn in ["weather", "time", "after_result"]:
        on = ask(qwen, TURNS[turn], FIXTURE["tools"])
        off = ask(qwen, TURNS[turn], FIXTURE["tools"], fill=False)
        assert answer(on) == answer(off), turn
        assert "fill" not in off["usage"]
        fill = on["usage"].get("fill", {"assert": {"injected": 0, "wasted": 0}})
        assert fill.get("verify", {}).get("spans", 0) == 0, fill
        injected += fill["assert"]["injected"]
        wasted += fill["assert"]["wasted"]
    # The model writes some calls in the template's compact layout (after_result repeats its
    # call), whose scaffold, name, punctuation and sole key are appended; which turns it writes
    # that way can change with the kernels' rounding, the sum hardly.
    assert injected >= 10 and wasted <= injected, (injected, wasted)
    m = qwen.metrics()
    assert m["ferrolm_fill_injected_tokens_total"] >= injected
    assert m["ferrolm_fill_wasted_tokens_total"] >= wasted


def test_seeded_sampling_is_the_same_with_fill(qwen):
    extra = {"temperature": 0.8, "seed": 11}
    on = ask(qwen, TURNS["weather"], FIXTURE["tools"], **extra)
    off = ask(qwen, TURNS["weather"], FIXTURE["tools"], fill=False, **extra)
    assert answer(on) == answer(off)


def test_a_template_without_tools(server):
    on = ask(server, ASK, TOOLS, max_tokens=60)
    off = ask(server, ASK, TOOLS, max_tokens=60, fill=False)
    assert answer(on) == answer(off)
    assert answer(on)[1] == [("get_weather", '{"city": "Paris"}')]
    assert on["usage"]["fill"]["assert"]["injected"] > 0, on["usage"]


def test_no_tools_nothing_to_fill(server):
    r = ask(server, [{"role": "user", "content": "Hi"}], None, max_tokens=8)
    assert "fill" not in r["usage"]


def test_a_wrong_type_is_a_400(server):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "fill": "yes"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "fill"


@pytest.fixture(scope="module")
def no_fill_server():
    s = Server("--no-fill")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def copies_server():
    s = Server("--fill-copies")
    yield s
    s.stop()


def test_the_server_flag_turns_fill_off_and_a_request_back_on(server, no_fill_server):
    off = ask(no_fill_server, ASK, TOOLS, max_tokens=60)
    on = ask(no_fill_server, ASK, TOOLS, max_tokens=60, fill=True)
    assert "fill" not in off["usage"]
    assert on["usage"]["fill"]["assert"]["injected"] > 0
    assert answer(on) == answer(off) == answer(ask(server, ASK, TOOLS, max_tokens=60))


def test_copies_are_verify_spans(server, copies_server):
    # The history holds two earlier calls: their arguments' layout is there to copy.
    r = ask(copies_server, ASK, TOOLS, max_tokens=60)
    assert answer(r) == answer(ask(server, ASK, TOOLS, max_tokens=60, fill=False))
    verify = r["usage"]["fill"]["verify"]
    assert verify["spans"] > 0 and verify["injected"] + verify["wasted"] > 0, r["usage"]
    # Speculation's drafts are the copies when it runs: fill adds none.
    spec = Server("--fill-copies", "--draft-kind", "ngram")
    try:
        r = ask(spec, ASK, TOOLS, max_tokens=60)
        assert r["usage"].get("fill", {}).get("verify", {}).get("spans", 0) == 0, r["usage"]
        assert answer(r) == answer(ask(server, ASK, TOOLS, max_tokens=60))
    finally:
        spec.stop()
