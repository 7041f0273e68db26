"""OpenAI's `n` (several choices of one prompt) and what SDKs send to /v1/completions: a batch
of prompts, integer `logprobs` (the legacy block), logprob tokens as text. Each choice is
checked against the same request with one choice: choice i of a seeded request equals the
one-choice request with seed + i."""
import json

import pytest

from test_tools import ASK, TOOLS

MSG = [{"role": "user", "content": "Name a color and say why you like it."}]
HOT = dict(temperature=1.0, max_tokens=24)


def chat(client, **kw):
    kw.setdefault("model", "m")
    kw.setdefault("messages", MSG)
    return client.chat.completions.create(**kw)


def solo(client, seed, **kw):
    c = chat(client, seed=seed, logprobs=True, **kw).choices[0]
    return c.message.content, c.finish_reason, [e.logprob for e in c.logprobs.content]


def test_n_choices_equal_one_choice_requests_with_seed_plus_i(client):
    r = chat(client, n=3, seed=7, logprobs=True, **HOT)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for i, c in enumerate(r.choices):
        got = (c.message.content, c.finish_reason, [e.logprob for e in c.logprobs.content])
        assert got == solo(client, 7 + i, **HOT), f"choice {i}"
    assert len({c.message.content for c in r.choices}) > 1
    one = chat(client, seed=7, **HOT)
    # The prompt is counted once, the completions of every choice summed.
    assert r.usage.prompt_tokens == one.usage.prompt_tokens
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_n_choices_stream_interleaved_by_index(client):
    chunks = list(chat(client, n=3, seed=7, stream=True, stream_options={"include_usage": True}, **HOT))
    texts, finish, roles = ["", "", ""], [None] * 3, [0, 0, 0]
    for ch in chunks[:-1]:
        (c,) = ch.choices
        roles[c.index] += c.delta.role == "assistant"
        texts[c.index] += c.delta.content or ""
        if c.finish_reason:
            assert finish[c.index] is None
            finish[c.index] = c.finish_reason
        assert ch.usage is None
    assert roles == [1, 1, 1]
    whole = chat(client, n=3, seed=7, **HOT)
    assert texts == [c.message.content for c in whole.choices]
    assert finish == [c.finish_reason for c in whole.choices]
    # One usage chunk at the end, with empty choices: the whole response's.
    assert chunks[-1].choices == []
    # (cached_tokens is left out: the prompt cache may serve one request and not the other.)
    got, want = chunks[-1].usage, whole.usage
    assert (got.prompt_tokens, got.completion_tokens) == (want.prompt_tokens, want.completion_tokens)


def test_n_stream_without_include_usage_puts_it_on_the_last_final_chunk(client):
    chunks = list(chat(client, n=2, seed=3, stream=True, **HOT))
    with_usage = [ch for ch in chunks if ch.usage is not None]
    assert with_usage == [chunks[-1]]
    assert chunks[-1].choices[0].finish_reason is not None
    assert chunks[-1].usage.completion_tokens == chat(client, n=2, seed=3, **HOT).usage.completion_tokens


def test_greedy_choices_are_identical(client):
    r = chat(client, n=2, max_tokens=16, logprobs=True, top_logprobs=2)
    a, b = r.choices
    assert a.message.content == b.message.content
    assert a.logprobs == b.logprobs
    assert a.message.content == chat(client, max_tokens=16).choices[0].message.content


def test_each_choice_parses_its_own_tool_calls(client):
    r = chat(client, n=2, messages=ASK, tools=TOOLS, max_tokens=60)
    for c in r.choices:
        assert c.finish_reason == "tool_calls"
        (tc,) = c.message.tool_calls
        assert json.loads(tc.function.arguments) == {"city": "Paris"}
    chunks = list(chat(client, n=2, messages=ASK, tools=TOOLS, max_tokens=60, stream=True))
    calls = [(c.index, tc.index) for ch in chunks for c in ch.choices for tc in (c.delta.tool_calls or [])]
    # Tool calls are numbered within their choice.
    assert sorted(calls) == [(0, 0), (1, 0)]


def test_each_choice_stops_at_its_own_stop_string(client):
    r = chat(client, n=3, seed=11, stop=["e"], **HOT)
    for i, c in enumerate(r.choices):
        assert "e" not in c.message.content
        assert c.message.content == chat(client, seed=11 + i, stop=["e"], **HOT).choices[0].message.content


@pytest.mark.parametrize("n", [0, -1, 1.5, "2", True, 17])
def test_invalid_n_is_a_400_naming_n(http, n):
    for path, body in [("/v1/chat/completions", {"messages": MSG}), ("/v1/completions", {"prompt": "Hi"})]:
        r = http.post(path, json={**body, "n": n, "max_tokens": 2})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "n"
        assert r.json()["error"]["message"].startswith("n must be")


def text(client, **kw):
    kw.setdefault("model", "m")
    return client.completions.create(**kw)


def test_completions_n_with_seeds(client):
    kw = dict(prompt="Once upon a time", **HOT)
    r = text(client, n=2, seed=5, **kw)
    assert [c.text for c in r.choices] == [text(client, seed=5 + i, **kw).choices[0].text for i in range(2)]
    assert r.usage.prompt_tokens == text(client, seed=5, **kw).usage.prompt_tokens


def test_completions_prompt_batch(client):
    prompts = ["The capital of France is", "def add(a, b):", "Roses are red,"]
    r = text(client, prompt=prompts, max_tokens=8)
    singles = [text(client, prompt=p, max_tokens=8) for p in prompts]
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [s.choices[0].text for s in singles]
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert r.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    # With n, choice p * n + j is the j-th of prompt p.
    r = text(client, prompt=prompts[:2], n=2, seed=1, **HOT)
    for p in range(2):
        for j in range(2):
            assert r.choices[p * 2 + j].text == text(client, prompt=prompts[p], seed=1 + j, **HOT).choices[0].text
    # Streamed: the same choices, interleaved.
    got = ["", "", ""]
    for ch in text(client, prompt=prompts, max_tokens=8, stream=True):
        for c in ch.choices:
            got[c.index] += c.text
    assert got == [s.choices[0].text for s in singles]


def test_completions_prompt_batch_of_token_ids(client, http):
    ids = [[504, 3575, 282, 4649, 314], [504, 3575]]
    r = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 3}).json()
    for i, one in enumerate(ids):
        single = http.post("/v1/completions", json={"prompt": one, "max_tokens": 3}).json()
        assert r["choices"][i]["text"] == single["choices"][0]["text"]
    assert r["usage"]["prompt_tokens"] == 7


@pytest.mark.parametrize("prompt", [[], ["a", 1], [[]], [[1, "x"]], [-1], {"a": 1}, ["x"] * 65])
def test_bad_prompts_are_400s(http, prompt):
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt"


def test_legacy_completions_logprobs(client):
    prompt = "The capital of France is"
    r = text(client, prompt=prompt, max_tokens=8, logprobs=2)
    c = r.choices[0]
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    # Tokens are text: together they are the completion.
    assert "".join(lp.tokens) == c.text
    assert not any("Ġ" in t for t in lp.tokens)
    # Offsets count from the start of the prompt.
    offsets = [len(prompt)]
    for t in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp.text_offset == offsets
    for tok, l, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        # The sampled token and the top 2 (greedy: the sampled one is the top one).
        assert len(top) == 2 and top[tok] == pytest.approx(l)
        assert max(top.values()) == pytest.approx(l)
    # logprobs: 0 gives the sampled token only; the same logprobs as the chat-style block.
    r0 = text(client, prompt=prompt, max_tokens=8, logprobs=0).choices[0].logprobs
    assert [list(t) for t in r0.top_logprobs] == [[t] for t in lp.tokens]
    assert r0.token_logprobs == lp.token_logprobs
    # Streamed: the same lists, chunk by chunk, offsets continuing.
    parts = [ch.choices[0].logprobs for ch in text(client, prompt=prompt, max_tokens=8, logprobs=2, stream=True)
             if ch.choices and ch.choices[0].logprobs]
    assert sum((p.tokens for p in parts), []) == lp.tokens
    assert sum((p.text_offset for p in parts), []) == lp.text_offset


def test_legacy_logprobs_name_partial_characters_by_bytes(client):
    r = text(client, prompt="日本語: こんにちは、世界。日本語:", max_tokens=20, logprobs=0)
    toks = r.choices[0].logprobs.tokens
    assert any(t.startswith("bytes:\\x") for t in toks)


@pytest.mark.parametrize("field", [{"logprobs": 12}, {"logprobs": -1}, {"echo": True}, {"suffix": "x"},
                                   {"best_of": 2}])
def test_unsupported_completions_fields_are_400s(http, field):
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, **field})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == next(iter(field))


def test_chat_logprob_tokens_are_text(client):
    # This answer runs past 16 tokens (no EOS among them), so the tokens are exactly the text.
    sea = [{"role": "user", "content": "Write one sentence about the sea."}]
    c = chat(client, messages=sea, max_tokens=16, logprobs=True, top_logprobs=2).choices[0]
    entries = c.logprobs.content
    for e in entries:
        assert e.token == bytes(e.bytes).decode("utf-8")
        for t in e.top_logprobs:
            assert t.token == bytes(t.bytes).decode("utf-8")
    joined = "".join(e.token for e in entries)
    # The answer's first space is dropped, as mlx-lm does.
    assert (joined[1:] if joined.startswith(" ") else joined) == c.message.content
    assert any(e.token.startswith(" ") for e in entries)
