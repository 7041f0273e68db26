"""The requests compat.py sends to both servers. Greedy decoding and short outputs: mlx-lm on CPU
is slow. A case named `err:*`, `tools:*`, `ctx:*` matches the KNOWN table in compat.py."""
import json

SEA = [{"role": "user", "content": "Write one sentence about the sea."}]
HI = [{"role": "user", "content": "Say hi."}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "London"})}}]}
TOOL_ASK = [{"role": "user", "content": "What is the weather in London?"}, CALL,
            {"role": "user", "content": "What is the weather in Paris?"}]


def chat(name, stream=False, **body):
    body.setdefault("messages", SEA)
    body.setdefault("max_tokens", 12)
    if stream:
        body["stream"] = True
    return {"name": name, "method": "POST", "path": "/v1/chat/completions", "body": body, "stream": stream}


def text(name, stream=False, **body):
    body.setdefault("prompt", "The capital of France is")
    body.setdefault("max_tokens", 10)
    if stream:
        body["stream"] = True
    return {"name": name, "method": "POST", "path": "/v1/completions", "body": body, "stream": stream}


def err(name, body, path="/v1/chat/completions", method="POST", **kw):
    return {"name": "err:" + name, "method": method, "path": path, "body": body, **kw}


CASES = [
    {"name": "health", "method": "GET", "path": "/health"},
    {"name": "models", "method": "GET", "path": "/v1/models"},
    chat("chat"),
    chat("chat-eos", messages=HI, max_tokens=40),
    chat("chat-stream", stream=True),
    chat("chat-stream-usage", stream=True, stream_options={"include_usage": True}),
    chat("chat-max-completion-tokens", max_completion_tokens=5),
    chat("chat-system-multiturn", messages=[
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "color."}]}]),
    chat("chat-stop", stop=["ysterious"], max_tokens=20),
    chat("chat-stop-stream", stream=True, stop="ysterious", max_tokens=20),
    chat("chat-logprobs", logprobs=True, max_tokens=5),
    chat("chat-top-logprobs", logprobs=True, top_logprobs=3, max_tokens=5),
    chat("chat-template-kwargs", chat_template_kwargs={"enable_thinking": False}),
    chat("chat-unknown-fields", n=1, user="u", frequency_penalty=0.0, response_format={"type": "text"}),
    chat("seeded", temperature=1.0, seed=7),
    chat("chat-logit-bias", logit_bias={"504": 5}),
    text("completion"),
    text("completion-stream", stream=True),
    text("completion-stop", stop=" France"),
    text("completion-top-logprobs", top_logprobs=2, max_tokens=3),
    chat("tools:call", messages=TOOL_ASK, tools=TOOLS, max_tokens=40),
    chat("tools:stream", stream=True, messages=TOOL_ASK, tools=TOOLS, max_tokens=40),
    err("malformed-json", b'{"messages": [', ),
    err("not-a-dict", b"[1, 2]"),
    err("temperature-type", {"messages": SEA, "temperature": "hot"}),
    err("temperature-range", {"messages": SEA, "temperature": -1}),
    err("top-p-range", {"messages": SEA, "top_p": 1.5}),
    err("top-k-type", {"messages": SEA, "top_k": 2.5}),
    err("max-tokens-zero", {"messages": SEA, "max_tokens": 0}),
    err("stream-type", {"messages": SEA, "stream": "yes"}),
    err("logprobs-type", {"messages": SEA, "logprobs": 3}),
    err("top-logprobs-range", {"messages": SEA, "top_logprobs": 12}),
    err("xtc-int", {"messages": SEA, "xtc_probability": 0}),
    err("logit-bias", {"messages": SEA, "logit_bias": {"a": 1}}),
    err("seed-type", {"messages": SEA, "seed": "x"}),
    err("model-type", {"messages": SEA, "model": 5}),
    err("missing-messages", {"max_tokens": 2}),
    err("missing-prompt", {"max_tokens": 2}, path="/v1/completions"),
    err("image-part", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]}),
    err("unknown-path", {}, path="/v1/nothing"),
    err("get-post-endpoint", None, method="GET"),
    {"name": "ctx:max-tokens", "method": "POST", "path": "/v1/chat/completions", "ferrolm_only": True,
     "body": {"messages": SEA, "max_tokens": 9000}},
]
