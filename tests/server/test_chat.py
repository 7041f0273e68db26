"""Chat and text completions through the official OpenAI SDK: non-streaming and streaming,
usage, stop sequences across token boundaries, logprobs, seeds."""
import json

import pytest

MSG = [{"role": "user", "content": "Write one sentence about the sea."}]


def chat(client, **kw):
    kw.setdefault("model", "default_model")
    kw.setdefault("messages", MSG)
    # Short enough that greedy decoding reaches it before EOS with f32 and with 8-bit CPU
    # activations alike (the default decode; its answer ends after 21 tokens).
    kw.setdefault("max_tokens", 16)
    return client.chat.completions.create(**kw)


def stream_chat(client, **kw):
    chunks = list(chat(client, stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return chunks, text


def test_chat_non_streaming(client):
    r = chat(client)
    assert r.object == "chat.completion"
    assert r.id.startswith("chatcmpl-")
    assert r.model == "SmolLM2-135M-Instruct.Q4_1"
    c = r.choices[0]
    assert c.index == 0
    assert c.message.role == "assistant"
    assert c.message.content.startswith("The sea is")
    assert c.finish_reason == "length"
    u = r.usage
    assert u.prompt_tokens == 37
    assert u.completion_tokens == 16
    assert u.total_tokens == 53
    # The prompt cache may serve part of the prompt (earlier tests asked alike).
    assert 0 <= u.prompt_tokens_details.cached_tokens < u.prompt_tokens


def test_chat_stops_at_eos(client):
    r = chat(client, max_tokens=200)
    assert r.choices[0].finish_reason == "stop"
    # The EOS token is counted (as mlx-lm counts it) but never shown.
    assert "<|im_end|>" not in r.choices[0].message.content
    assert r.usage.completion_tokens < 200


def test_streaming_matches_non_streaming(client):
    whole = chat(client).choices[0].message.content
    chunks, text = stream_chat(client)
    assert text == whole
    first = chunks[0].choices[0]
    assert first.delta.role == "assistant" and first.delta.content == ""
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    last = chunks[-1]
    assert last.choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    # Without include_usage the final chunk carries the usage.
    assert last.usage.completion_tokens == 16


def test_stream_include_usage_sends_a_usage_chunk(client):
    chunks, _ = stream_chat(client, stream_options={"include_usage": True})
    assert chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == 37
    assert chunks[-1].usage.completion_tokens == 16
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-2].usage is None


def test_sse_framing(http):
    body = {"messages": MSG, "max_tokens": 5, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == "text/event-stream"
        assert r.headers["cache-control"] == "no-cache"
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e[6:]) for e in events[:-1]]
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


def test_text_completions(client):
    kw = dict(model="m", prompt="The capital of France is", max_tokens=12)
    r = client.completions.create(**kw)
    assert r.object == "text_completion"
    assert r.id.startswith("cmpl-")
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12
    text = r.choices[0].text
    assert " Paris" in text
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completions_accept_token_ids(client, http):
    r = http.post("/v1/completions", json={"prompt": [504, 3575, 282, 4649, 314], "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 5


def token_texts(client, **kw):
    """The generated tokens' texts, from the logprobs entries' bytes."""
    r = chat(client, logprobs=True, **kw)
    entries = r.choices[0].logprobs.content
    return r.choices[0].message.content, [bytes(e.bytes).decode("utf-8", "replace") for e in entries]


def spanning_stop(pieces):
    """A stop string made of the end of one token and the start of the next."""
    for i in range(3, len(pieces) - 1):
        a, b = pieces[i], pieces[i + 1]
        if len(a.strip()) >= 2 and len(b.strip()) >= 2:
            return a[-2:] + b[:2]
    raise AssertionError(f"no two adjacent multi-character tokens in {pieces}")


def test_stop_sequence_spanning_tokens(client):
    # 16 tokens: the answer must not reach EOS (whose bytes are in logprobs but not in the text).
    whole, pieces = token_texts(client, max_tokens=16)
    assert "".join(pieces) == whole
    stop = spanning_stop(pieces)
    expected = whole[:whole.index(stop)]
    r = chat(client, max_tokens=16, stop=[stop, "never-appears"])
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 16
    chunks, text = stream_chat(client, max_tokens=16, stop=stop)
    assert text == expected
    assert stop not in "".join(json.dumps(c.model_dump()) for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stop_on_completions(client):
    r = client.completions.create(model="m", prompt="1, 2, 3, 4,", max_tokens=20, stop=" 7")
    assert r.choices[0].finish_reason == "stop"
    assert " 7" not in r.choices[0].text
    assert r.choices[0].text.startswith(" 5, 6,")


def test_logprobs(client):
    r = chat(client, logprobs=True, top_logprobs=3, max_tokens=8)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens == 8
    for e in entries:
        assert len(e.top_logprobs) == 3
        lps = [t.logprob for t in e.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        assert all(lp <= 0 for lp in lps)
        # Greedy: the sampled token is the most likely one.
        assert e.token == e.top_logprobs[0].token
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob)
    extra = entries[0].model_extra
    assert isinstance(extra["id"], int)
    r = chat(client, logprobs=True, max_tokens=4)
    assert all(e.top_logprobs == [] for e in r.choices[0].logprobs.content)
    r = chat(client, max_tokens=4)
    assert r.choices[0].logprobs is None


def test_completions_logprobs_use_mlx_lm_block(http):
    r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "top_logprobs": 2})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    assert {"id", "token", "logprob", "top_logprobs"} <= set(content[0])


def test_seed_makes_sampling_reproducible(client):
    kw = dict(temperature=1.0, max_tokens=30)
    a = chat(client, seed=42, **kw).choices[0].message.content
    b = chat(client, seed=42, **kw).choices[0].message.content
    c = chat(client, seed=43, **kw).choices[0].message.content
    assert a == b
    assert a != c


def test_max_completion_tokens_wins(client):
    r = chat(client, max_tokens=20, max_completion_tokens=5)
    assert r.usage.completion_tokens == 5


def test_system_and_multi_turn(client):
    r = chat(client, messages=[
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "developer", "content": "Answer in English."},
        {"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "color."}]},
    ], max_tokens=8)
    assert r.choices[0].message.content


def test_chat_completions_alias(http):
    r = http.post("/chat/completions", json={"messages": MSG, "max_tokens": 2})
    assert r.status_code == 200


def test_streaming_holds_back_partial_utf8(client):
    # Byte-level BPE splits these characters over several tokens.
    kw = dict(model="m", prompt="日本語: こんにちは、世界。日本語:", max_tokens=20)
    whole = client.completions.create(**kw).choices[0].text
    r = client.completions.create(logprobs=True, **kw)
    # The completions SDK types logprobs the legacy way: mlx-lm's block comes through as dicts.
    pieces = [bytes(e["bytes"]) for e in r.choices[0].logprobs.content]
    assert any(not _is_utf8(p) for p in pieces), "no token ends inside a character"
    texts = [c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices]
    assert "".join(texts) == whole
    assert not any("\ufffd" in t for t in texts)


def _is_utf8(b):
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False
