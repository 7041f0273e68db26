"""Anthropic's Messages API through the official `anthropic` SDK: create and stream, the exact
event order, stop reasons, stop sequences, tools (tool_use → tool_result → answer), count_tokens,
Claude Code's request shape, errors in Anthropic's shape.

The oracle for the mapping is the chat completions endpoint: a Messages request and its chat
equivalent must render the same prompt (same token count) and, greedy, give the same text."""
import json

import anthropic
import httpx
import pytest

from test_tools import HISTORY as CHAT_HISTORY, TOOLS as CHAT_TOOLS

ASK = [{"role": "user", "content": "Write one sentence about the sea."}]
TOOLS = [{"name": "get_weather", "description": "Get the current weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]

def total_input(usage):
    """Prompt tokens of a Messages response: those read from the prompt cache count apart
    (`cache_read_input_tokens`), as Anthropic reports them."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)



def tool_use(city, i):
    return {"role": "assistant", "content": [
        {"type": "tool_use", "id": f"toolu_{i}", "name": "get_weather", "input": {"city": city}}]}


# The Anthropic form of test_tools' history: two earlier calls make the 135M model call again.
HISTORY = [{"role": "user", "content": "What is the weather in London?"}, tool_use("London", 1),
           {"role": "user", "content": "What is the weather in Madrid?"}, tool_use("Madrid", 2)]
WEATHER_ASK = HISTORY + [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="not-needed", max_retries=0, timeout=120)


def create(claude, **kw):
    """Greedy: the server's default for a GGUF model (no generation_config). Anthropic's current
    SDK has no sampling arguments; older clients send `temperature`, tested raw below."""
    kw.setdefault("model", "local-model")
    kw.setdefault("messages", ASK)
    kw.setdefault("max_tokens", 16)
    return claude.messages.create(**kw)


def text_of(message):
    return "".join(b.text for b in message.content if b.type == "text")


def test_create_shape(claude):
    r = create(claude)
    assert r.type == "message" and r.role == "assistant"
    assert r.id.startswith("msg_01") and len(r.id) == 28
    assert r.model == "SmolLM2-135M-Instruct.Q4_1"
    assert [b.type for b in r.content] == ["text"]
    assert r.content[0].text.startswith("The sea is")
    assert r.stop_reason == "max_tokens" and r.stop_sequence is None
    assert r.usage.output_tokens == 16
    assert total_input(r.usage) == 37


def test_same_prompt_and_answer_as_chat_completions(claude, client):
    system = [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}]
    turns = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]},
             {"role": "assistant", "content": "Hello."},
             {"role": "user", "content": "Name a colour."}]
    r = create(claude, system=system, messages=turns, max_tokens=24)
    chat = client.chat.completions.create(
        model="m", max_tokens=24, temperature=0,
        messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Name a colour."}])
    assert total_input(r.usage) == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert text_of(r) == chat.choices[0].message.content
    expected = {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]
    assert r.stop_reason == expected


def test_stop_sequence_is_reported_and_not_sent(claude):
    full = text_of(create(claude, max_tokens=16))
    word = full.split()[3]
    r = create(claude, max_tokens=16, stop_sequences=["zzz", word])
    assert r.stop_reason == "stop_sequence"
    assert r.stop_sequence == word
    assert text_of(r) == full[:full.index(word)]


def test_count_tokens_equals_the_prompt_that_runs(claude):
    kw = dict(model="m", system="Be brief.", messages=WEATHER_ASK, tools=TOOLS)
    n = claude.messages.count_tokens(**kw).input_tokens
    r = create(claude, max_tokens=1, **kw)
    assert n == total_input(r.usage) > 0


def stream_events(server, body, path="/v1/messages"):
    """(event name, data) pairs of a raw SSE response."""
    events = []
    with httpx.stream("POST", server.url + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == name
                events.append((name, data))
    return events


def test_sampling_fields_of_older_clients(http, claude):
    body = {"model": "m", "messages": ASK, "max_tokens": 16, "temperature": 0, "top_p": 1, "top_k": 0}
    r = http.post("/v1/messages", json=body)
    assert r.status_code == 200
    assert r.json()["content"][0]["text"] == text_of(create(claude))
    hot = http.post("/v1/messages", json={**body, "temperature": 1.5, "top_k": 5, "max_tokens": 4})
    assert hot.status_code == 200 and hot.json()["usage"]["output_tokens"] == 4


def test_zero_max_tokens_generates_nothing(claude, server):
    r = create(claude, max_tokens=0)
    assert r.content == [] and r.stop_reason == "max_tokens"
    assert r.usage.output_tokens == 0 and total_input(r.usage) == 37
    names = [n for n, _ in stream_events(server, {"messages": ASK, "max_tokens": 0, "stream": True})]
    assert names == ["message_start", "message_delta", "message_stop"]


def test_consecutive_turns_are_combined(claude):
    split = create(claude, max_tokens=1, messages=[{"role": "user", "content": "Write one sentence"},
                                                   {"role": "user", "content": "about the sea."}])
    joined = create(claude, max_tokens=1, messages=[{"role": "user", "content": "Write one sentence\nabout the sea."}])
    assert total_input(split.usage) == total_input(joined.usage)


def test_prefill_continues_the_answer(claude):
    full = text_of(create(claude, max_tokens=16))
    head = " ".join(full.split()[:3])
    r = create(claude, max_tokens=13, messages=ASK + [{"role": "assistant", "content": head}])
    # The answer goes on from the prefilled words (the next word is the unprefilled answer's);
    # after that a near-tie may go either way, since the prefilled words come from the prompt's
    # forward, not from decode steps (SmolLM2: "a vast expanse" / "a vast, mysterious").
    assert (head + text_of(r)).split()[:4] == full.split()[:4]


def test_stream_event_order(server, claude):
    body = {"model": "m", "messages": ASK, "max_tokens": 16, "temperature": 0, "stream": True}
    events = stream_events(server, body)
    names = [n for n, _ in events]
    deltas = names.count("content_block_delta")
    assert deltas >= 2
    assert names == (["message_start", "content_block_start", "ping"] + ["content_block_delta"] * deltas
                     + ["content_block_stop", "message_delta", "message_stop"])
    start = events[0][1]["message"]
    assert start["id"].startswith("msg_01") and start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] + start["usage"].get("cache_read_input_tokens", 0) == 37
    assert events[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert text == text_of(create(claude))
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 16


def test_sdk_stream_helper_matches_create(claude):
    with claude.messages.stream(model="m", messages=ASK, max_tokens=16) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == text_of(final) == text_of(create(claude))
    assert final.stop_reason == "max_tokens"


def test_tool_use_then_tool_result(claude, client):
    r = create(claude, messages=WEATHER_ASK, tools=TOOLS, max_tokens=60)
    assert r.stop_reason == "tool_use"
    (block,) = [b for b in r.content if b.type == "tool_use"]
    assert block.name == "get_weather" and block.input == {"city": "Paris"}
    assert block.id.startswith("toolu_01")
    # The result goes back; the model answers in text. Its prompt is the chat equivalent's.
    follow = WEATHER_ASK + [{"role": "assistant", "content": r.content},
                            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id,
                                                          "content": [{"type": "text", "text": "Sunny, 24 C"}]}]}]
    answer = create(claude, messages=follow, tools=TOOLS, max_tokens=30)
    assert answer.stop_reason in ("end_turn", "max_tokens")
    call = {"id": "call_x", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}
    chat = client.chat.completions.create(
        model="m", tools=CHAT_TOOLS, max_tokens=30, temperature=0,
        messages=CHAT_HISTORY + [{"role": "user", "content": "What is the weather in Paris?"},
                                 {"role": "assistant", "content": None, "tool_calls": [call]},
                                 {"role": "tool", "tool_call_id": "call_x", "content": "Sunny, 24 C"}])
    assert total_input(answer.usage) == chat.usage.prompt_tokens
    assert text_of(answer) == (chat.choices[0].message.content or "")


def test_tool_use_streams_input_json(claude):
    with claude.messages.stream(model="m", messages=WEATHER_ASK, tools=TOOLS, max_tokens=60) as s:
        events = list(s)
        final = s.get_final_message()
    assert final.stop_reason == "tool_use"
    (block,) = [b for b in final.content if b.type == "tool_use"]
    assert block.input == {"city": "Paris"}
    kinds = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert "input_json_delta" in kinds
    # The markup never streams as text.
    assert "<tool_call>" not in text_of(final)


def test_tool_choice_none_offers_no_tools(claude):
    r = create(claude, messages=WEATHER_ASK, tools=TOOLS, tool_choice={"type": "none"}, max_tokens=20)
    n = claude.messages.count_tokens(model="m", messages=WEATHER_ASK).input_tokens
    assert total_input(r.usage) == n


def test_claude_code_request_shape(server):
    """?beta=true, its headers, system as blocks with cache_control, metadata, tools with
    cache_control, a thinking setting, a stream."""
    body = {
        "model": "claude-sonnet-4-5-20250929", "max_tokens": 12, "stream": True, "temperature": 1,
        "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
            {"type": "text", "text": "hello", "cache_control": {"type": "ephemeral"}}]}],
        "tools": [dict(TOOLS[0], cache_control={"type": "ephemeral"})],
        "metadata": {"user_id": "user_abc"}, "thinking": {"type": "disabled"},
        "context_management": {"edits": []},
    }
    headers = {"x-api-key": "sk-ant-local", "anthropic-version": "2023-06-01",
               "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"}
    with httpx.stream("POST", server.url + "/v1/messages?beta=true", json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("event: ")]
    assert lines[0] == "event: message_start" and lines[-1] == "event: message_stop"


def test_sdk_beta_client(claude):
    r = claude.beta.messages.create(model="m", messages=ASK, max_tokens=4, betas=["interleaved-thinking-2025-05-14"])
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 4


def anthropic_error(r, status, kind="invalid_request_error"):
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind
    return body["error"]["message"]


@pytest.mark.parametrize("body,message", [
    ({"messages": ASK}, "max_tokens: Field required"),
    ({"max_tokens": 5}, "messages: Field required"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages.0.content.0: content blocks of type 'image' are not supported by this server"),
    ({"max_tokens": 5, "messages": ASK, "temperature": "hot"}, "temperature must be of type ('float', 'int')"),
    ({"max_tokens": -1, "messages": ASK}, "max_tokens must be at least 1"),
    ({"max_tokens": 5, "messages": ASK, "stop_sequences": "x"}, "stop_sequences: Input should be a valid list of strings"),
    ({"max_tokens": 5, "messages": ASK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "tools.0: tools of type 'web_search_20250305' run on Anthropic's servers and are not supported here"),
])
def test_bad_requests_are_400_in_anthropic_shape(http, body, message):
    assert anthropic_error(http.post("/v1/messages", json=body), 400) == message


def test_malformed_json_and_context_overflow(http):
    r = http.post("/v1/messages", content=b'{"messages": [')
    assert anthropic_error(r, 400).startswith("Invalid JSON in request body: ")
    # max_tokens is a cap, lowered to what fits (Claude Code asks for 32,000 of any model);
    # only a prompt beyond the context is refused.
    r = http.post("/v1/messages", json={"messages": ASK, "max_tokens": 10 ** 7})
    assert r.status_code == 200 and r.json()["stop_reason"] == "end_turn"
    long = [{"role": "user", "content": "word " * 9000}]
    r = http.post("/v1/messages", json={"messages": long, "max_tokens": 10})
    assert "maximum context length is 8192 tokens" in anthropic_error(r, 400)
    r = http.post("/v1/messages/count_tokens", json={"messages": "x"})
    assert anthropic_error(r, 400) == "messages: Input should be a valid list"


def test_sdk_raises_and_a_panic_is_a_500_in_shape(claude, http):
    with pytest.raises(anthropic.BadRequestError) as ei:
        claude.messages.create(model="m", messages=[], max_tokens=5)
    assert ei.value.body["error"]["type"] == "invalid_request_error"
    r = http.post("/v1/messages", json={"messages": ASK, "max_tokens": 5, "x_ferrolm_fault": "panic"})
    assert "injected fault" in anthropic_error(r, 500, "api_error")
    # The server keeps serving.
    assert create(claude, max_tokens=2).usage.output_tokens == 2


def test_engine_failure_mid_stream_is_an_error_event(server):
    body = {"messages": ASK, "max_tokens": 5, "stream": True, "x_ferrolm_fault": "engine"}
    events = stream_events(server, body)
    assert events[0][0] == "message_start"
    assert events[-1][0] == "error" and events[-1][1]["error"]["type"] == "api_error"
