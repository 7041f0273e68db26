"""Tool calling with the real model. SmolLM2's chat template ignores tools, so the server
describes them in the system message (Qwen2.5 / Hermes style) and renders earlier calls as
`<tool_call>` blocks; two earlier calls in the history make the 135M model call the tool
again, deterministically under greedy decoding."""
import json

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def call(city, i):
    return {"role": "assistant", "content": None, "tool_calls": [{
        "id": f"call_{i}", "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]}


HISTORY = [{"role": "user", "content": "What is the weather in London?"}, call("London", 1),
           {"role": "user", "content": "What is the weather in Madrid?"}, call("Madrid", 2)]
ASK = HISTORY + [{"role": "user", "content": "What is the weather in Paris?"}]


def create(client, **kw):
    kw.setdefault("model", "m")
    kw.setdefault("messages", ASK)
    kw.setdefault("tools", TOOLS)
    kw.setdefault("max_tokens", 60)
    return client.chat.completions.create(**kw)


def test_tool_call_non_streaming(client):
    r = create(client)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert c.message.content is None
    (tc,) = c.message.tool_calls
    assert tc.type == "function"
    assert tc.id.startswith("call_")
    assert tc.function.name == "get_weather"
    assert isinstance(tc.function.arguments, str)
    assert json.loads(tc.function.arguments) == {"city": "Paris"}
    # mlx_lm.server writes arguments with Python's json.dumps.
    assert tc.function.arguments == '{"city": "Paris"}'


def test_tool_call_streaming(client):
    chunks = list(create(client, stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1
    assert calls[0].index == 0
    assert calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # The markup itself never streams as content.
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "<tool_call>" not in text


def test_truncated_tool_call_comes_back_as_content(client):
    r = create(client, max_tokens=12)
    c = r.choices[0]
    assert c.finish_reason == "length"
    assert not c.message.tool_calls
    assert c.message.content.startswith('<tool_call>\n{"name": "get_')


def test_tool_choice_none_disables_parsing(client):
    r = create(client, tool_choice="none")
    c = r.choices[0]
    assert not c.message.tool_calls
    assert c.finish_reason in ("stop", "length")


def test_named_tool_choice_must_exist(http):
    r = http.post("/v1/chat/completions", json={
        "messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "tool_choice"


def test_round_trip_with_a_tool_result(client):
    first = create(client).choices[0].message
    tc = first.tool_calls[0]
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [tc.model_dump()]},
        {"role": "tool", "tool_call_id": tc.id, "content": json.dumps({"temperature": 21, "sky": "clear"})},
    ]
    r = create(client, messages=messages)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > create(client).usage.prompt_tokens


GREETING = HISTORY + [{"role": "user", "content": "Say hello to me."}]


def test_required_tool_choice_forces_a_call(client):
    # Constrained to the template's call format: the answer is a call of an offered tool.
    r = create(client, messages=GREETING, tool_choice="required")
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c.message
    (tc,) = c.message.tool_calls
    assert tc.function.name == "get_weather"
    assert isinstance(json.loads(tc.function.arguments), dict)
    chunks = list(create(client, messages=GREETING, tool_choice="required", stream=True))
    calls = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert [x.function.name for x in calls] == ["get_weather"]
    assert "<tool_call>" not in "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)


def test_named_tool_choice_forces_that_call(client):
    tools = TOOLS + [{"type": "function", "function": {"name": "say_hello", "parameters": {
        "type": "object", "properties": {"name": {"type": "string"}}}}}]
    r = create(client, messages=GREETING, tools=tools,
               tool_choice={"type": "function", "function": {"name": "say_hello"}})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c.message
    assert [tc.function.name for tc in c.message.tool_calls] == ["say_hello"]


def test_forced_call_in_a_template_with_another_format():
    """A template that reads tools but does not write <tool_call> blocks: the forced call is
    Llama 3.x's bare JSON object, which the parser reads as a call."""
    from conftest import Server
    import httpx
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if tools %}[TOOLS]{% endif %}<|im_start|>assistant\n")
    s = Server("--chat-template", template)
    try:
        r = httpx.post(s.url + "/v1/chat/completions", timeout=60, json={
            "messages": GREETING, "tools": TOOLS, "tool_choice": "required", "max_tokens": 40})
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        assert c["finish_reason"] == "tool_calls", c
        assert [tc["function"]["name"] for tc in c["message"]["tool_calls"]] == ["get_weather"]
        assert "city" in json.loads(c["message"]["tool_calls"][0]["function"]["arguments"])
    finally:
        s.stop()


def test_forced_call_after_a_prefill_is_refused(http):
    r = http.post("/v1/messages", json={
        "model": "m", "max_tokens": 20, "tools": [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}],
        "tool_choice": {"type": "any"},
        "messages": [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "Sure:"}]})
    assert r.status_code == 400, r.text
    assert "prefilled" in r.json()["error"]["message"]
