"""OpenAI's Responses API through the official `openai` SDK: create and stream (the event chain,
sequence numbers), function calls and their outputs, previous_response_id and the store,
retrieve / delete, what Codex CLI sends, refused fields.

The oracle for the mapping is the chat completions endpoint: a Responses request and its chat
equivalent must render the same prompt (same token count) and, greedy, give the same text."""
import json

import httpx
import openai
import pytest

from conftest import Server
from test_tools import HISTORY as CHAT_HISTORY, TOOLS as CHAT_TOOLS

ASK = "Write one sentence about the sea."
TOOLS = [{"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


def call(city, i):
    return {"type": "function_call", "call_id": f"call_{i}", "name": "get_weather",
            "arguments": json.dumps({"city": city})}


# test_tools' history as items: two earlier calls make the 135M model call again.
WEATHER = [{"role": "user", "content": "What is the weather in London?"}, call("London", 1),
           {"role": "user", "content": "What is the weather in Madrid?"}, call("Madrid", 2),
           {"role": "user", "content": "What is the weather in Paris?"}]


def create(client, **kw):
    kw.setdefault("model", "m")
    kw.setdefault("input", ASK)
    kw.setdefault("max_output_tokens", 16)
    kw.setdefault("temperature", 0)
    return client.responses.create(**kw)


def test_create_shape(client):
    r = create(client)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.model == "SmolLM2-135M-Instruct.Q4_1"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert item.content[0].type == "output_text"
    assert r.output_text.startswith("The sea is")
    assert r.usage.input_tokens == 37 and r.usage.output_tokens == 16 and r.usage.total_tokens == 53


def test_same_prompt_and_answer_as_chat_completions(client):
    r = create(client, instructions="You are terse.", max_output_tokens=24, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
        {"role": "user", "content": "Name a colour."}])
    chat = client.chat.completions.create(
        model="m", max_tokens=24, temperature=0,
        messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Name a colour."}])
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.output_text == chat.choices[0].message.content
    assert r.status == {"stop": "completed", "length": "incomplete"}[chat.choices[0].finish_reason]


def test_stream_event_chain(client):
    events = list(create(client, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    deltas = types.count("response.output_text.delta")
    assert deltas >= 2
    assert types == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"] + ["response.output_text.delta"] * deltas
                     + ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                        "response.incomplete"])
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-4].text == create(client).output_text
    final = events[-1].response
    assert final.id == events[0].response.id
    assert final.output[0].content[0].text == text
    assert final.usage.output_tokens == 16


def test_sdk_stream_helper(client):
    # Long enough to end by itself: the SDK's helper only finalizes a `response.completed`.
    with client.responses.stream(model="m", input=ASK, max_output_tokens=60, temperature=0) as s:
        streamed = "".join(e.delta for e in s if e.type == "response.output_text.delta")
        final = s.get_final_response()
    assert final.status == "completed"
    assert streamed == final.output_text == create(client, max_output_tokens=60).output_text


def test_function_call(client):
    r = create(client, input=WEATHER, tools=TOOLS, max_output_tokens=60)
    assert r.status == "completed"
    (fc,) = r.output
    assert fc.type == "function_call" and fc.name == "get_weather"
    assert json.loads(fc.arguments) == {"city": "Paris"}
    assert fc.call_id.startswith("call_") and fc.id.startswith("fc_")


def test_function_call_streams_arguments(client):
    events = list(create(client, input=WEATHER, tools=TOOLS, max_output_tokens=60, stream=True))
    types = [e.type for e in events]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    assert json.loads(events[3].delta) == {"city": "Paris"}
    assert events[5].item.call_id == events[-1].response.output[0].call_id


def test_function_call_output_via_previous_response_id(client):
    first = create(client, input=WEATHER, tools=TOOLS, max_output_tokens=60)
    fc = first.output[0]
    result = {"type": "function_call_output", "call_id": fc.call_id, "output": "Sunny, 24 C"}
    chained = create(client, previous_response_id=first.id, input=[result], tools=TOOLS, max_output_tokens=30)
    assert chained.previous_response_id == first.id
    # The same conversation sent whole, and as chat completions: the same prompt and answer.
    whole = create(client, input=WEATHER + [fc.model_dump(), result], tools=TOOLS, max_output_tokens=30)
    assert chained.usage.input_tokens == whole.usage.input_tokens
    assert chained.output_text == whole.output_text
    tc = {"id": "call_x", "type": "function", "function": {"name": "get_weather", "arguments": fc.arguments}}
    chat = client.chat.completions.create(
        model="m", tools=CHAT_TOOLS, max_tokens=30, temperature=0,
        messages=CHAT_HISTORY + [{"role": "user", "content": "What is the weather in Paris?"},
                                 {"role": "assistant", "content": None, "tool_calls": [tc]},
                                 {"role": "tool", "tool_call_id": "call_x", "content": "Sunny, 24 C"}])
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.output_text == (chat.choices[0].message.content or "")


def test_previous_response_id_continues_the_conversation(client):
    first = create(client, instructions="Be brief.", input="My name is Ann.", max_output_tokens=12)
    second = create(client, previous_response_id=first.id, input="What is my name?", max_output_tokens=12)
    # Instructions are not carried over (OpenAI's rule): the stateless equivalent has none.
    stateless = create(client, max_output_tokens=12, input=[
        {"role": "user", "content": "My name is Ann."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}])
    assert second.usage.input_tokens == stateless.usage.input_tokens
    assert second.output_text == stateless.output_text


def test_retrieve_delete_and_store_false(client):
    r = create(client, max_output_tokens=4)
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    unstored = create(client, max_output_tokens=4, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as ei:
        create(client, previous_response_id=unstored.id)
    e = ei.value.body
    assert e["code"] == "previous_response_not_found" and e["param"] == "previous_response_id"
    assert e["message"] == f"Previous response with id '{unstored.id}' not found."


def test_store_keeps_the_most_recent():
    s = Server("--responses-store-size", "2")
    try:
        c = s.client(max_retries=0, timeout=120)
        ids = [create(c, max_output_tokens=1).id for _ in range(3)]
        c.responses.retrieve(ids[1])
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(ids[0])
    finally:
        s.stop()


def test_codex_request_shape(server):
    """What Codex CLI sends: instructions, developer/user message items, function and
    non-function tools, reasoning, store false, stream, include, parallel_tool_calls."""
    body = {
        "model": "gpt-5-codex", "instructions": "You are Codex, a coding agent.", "store": False, "stream": True,
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "<permissions/>"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "<environment_context/>"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say hi."}]}],
        "tools": [{"type": "function", "name": "shell", "description": "Runs a shell command", "strict": False,
                   "parameters": {"type": "object", "properties": {"command": {"type": "array",
                                  "items": {"type": "string"}}}, "required": ["command"]}},
                  {"type": "local_shell"}, {"type": "web_search"},
                  {"type": "custom", "name": "apply_patch", "description": "patch",
                   "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}],
        "tool_choice": "auto", "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"}, "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0199-abc", "text": {"verbosity": "low"}, "max_output_tokens": 8,
    }
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        names = [line[len("event: "):] for line in r.iter_lines() if line.startswith("event: ")]
    assert names[0] == "response.created" and names[-1] in ("response.completed", "response.incomplete")


@pytest.mark.parametrize("extra,param", [
    ({"background": True}, "background"),
    ({"text": {"format": {"type": "grammar", "grammar": "x"}}}, "text.format"),
    ({"truncation": "auto"}, "truncation"),
    ({"tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
    ({"previous_response_id": "resp_nope"}, "previous_response_id"),
    ({"temperature": "hot"}, "temperature"),
])
def test_refused_and_invalid_fields_are_400(http, extra, param):
    body = {"model": "m", "input": "hi", "max_output_tokens": 2, **extra}
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    e = r.json()["error"]
    assert e["type"] == "invalid_request_error" and e["param"] == param, e


def test_missing_input_and_unknown_response(http):
    r = http.post("/v1/responses", json={"model": "m"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "Missing required parameter: 'input'."
    r = http.get("/v1/responses/resp_unknown")
    assert r.status_code == 404 and r.json()["error"]["message"] == "Response with id 'resp_unknown' not found."
