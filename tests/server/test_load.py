"""Concurrency and load: concurrent clients decoded together (continuous batching), each
getting exactly its answer alone; a client that disconnects mid-stream; queue overflow (429
with Retry-After); /health while a long prefill runs."""
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from conftest import Server

MSG = [{"role": "user", "content": "Write one sentence about the sea."}]
# Banning the EOS token (<|im_end|>, id 2) makes a generation run to its max_tokens.
NO_EOS = {"2": -100}


def test_eight_concurrent_clients(server, client):
    solo = client.chat.completions.create(model="m", messages=MSG, max_tokens=16)
    want = solo.choices[0].message.content

    def one(i):
        c = server.client(max_retries=0, timeout=300)
        if i % 2:
            chunks = list(c.chat.completions.create(model="m", messages=MSG, max_tokens=16, stream=True))
            return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        return c.chat.completions.create(model="m", messages=MSG, max_tokens=16).choices[0].message.content

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    # Decoded together, every client gets exactly what it gets alone.
    assert results == [want] * 8


TOPICS = ["the sea", "a mountain", "bread", "a violin", "winter", "a robot", "tea", "a bridge",
          "the moon", "a library", "rain", "a garden", "coffee", "a train", "the desert", "a cat"]


def test_sixteen_streams_batched_equal_their_solo_answers(server, client):
    def ask(i, stream):
        kw = dict(model="m", messages=[{"role": "user", "content": f"Tell me about {TOPICS[i]}."}],
                  max_tokens=8 + 3 * i, seed=i, temperature=0.7 if i % 2 else 0)
        c = server.client(max_retries=0, timeout=300)
        if not stream:
            return c.chat.completions.create(**kw).choices[0].message.content
        chunks = list(c.chat.completions.create(**kw, stream=True))
        return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)

    solo = [ask(i, False) for i in range(16)]
    before = server.metrics()
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda i: ask(i, True), range(16)))
    after = server.metrics()
    assert together == solo
    # They did run together: some steps forwarded more than 4 sequences.
    wide = (after["ferrolm_batch_size_count"] - after['ferrolm_batch_size_bucket{le="4"}']) - (
        before["ferrolm_batch_size_count"] - before['ferrolm_batch_size_bucket{le="4"}'])
    assert wide > 0


def wait_for(cond, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_disconnect_cancels_the_generation(server, client):
    before = server.metrics()
    body = {"messages": MSG, "max_tokens": 4000, "stream": True, "logit_bias": NO_EOS}
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data: ") and '"content"' in line:
                    got += 1
                    if got == 5:
                        break
        # Leaving the block closes the connection.
    assert wait_for(lambda: server.metrics()["ferrolm_requests_running"] == 0, 5.0)
    after = server.metrics()
    assert after["ferrolm_requests_cancelled_total"] == before["ferrolm_requests_cancelled_total"] + 1
    generated = after["ferrolm_generation_tokens_total"] - before["ferrolm_generation_tokens_total"]
    # Stopped within a decode step or two of the disconnect, far from the 4000 asked for.
    assert generated < 60, generated
    time.sleep(0.3)
    assert server.metrics()["ferrolm_generation_tokens_total"] == after["ferrolm_generation_tokens_total"]
    # The next request is served normally.
    r = client.chat.completions.create(model="m", messages=MSG, max_tokens=5)
    assert r.usage.completion_tokens == 5


def test_non_streaming_client_that_gives_up_cancels_too(server, client):
    before = server.metrics()
    body = {"messages": MSG, "max_tokens": 4000, "logit_bias": NO_EOS}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=1.5)
    assert wait_for(lambda: server.metrics()["ferrolm_requests_running"] == 0, 5.0)
    after = server.metrics()
    assert after["ferrolm_requests_cancelled_total"] == before["ferrolm_requests_cancelled_total"] + 1
    generated = after["ferrolm_generation_tokens_total"] - before["ferrolm_generation_tokens_total"]
    assert generated < 1000, generated
    assert client.chat.completions.create(model="m", messages=MSG, max_tokens=3).usage.completion_tokens == 3


def test_queue_overflow_is_429():
    s = Server("--queue-size", "1", "--max-seqs", "1")
    try:
        long = {"messages": MSG, "max_tokens": 400, "logit_bias": NO_EOS, "stream": True}
        streams = []
        h = httpx.Client(timeout=120)
        # One request runs (one seat), one waits for its seat, one waits in the queue of one.
        for i in range(3):
            cm = h.stream("POST", s.url + "/v1/chat/completions", json=long)
            streams.append((cm, cm.__enter__()))
            assert streams[-1][1].status_code == 200
            # The engine takes a request off the queue as soon as it has room for it.
            assert wait_for(lambda: s.metrics()["ferrolm_queue_depth"] == (1 if i == 2 else 0), 10)
        assert s.metrics()["ferrolm_requests_running"] == 1
        c = s.client(max_retries=0)
        with pytest.raises(openai.RateLimitError) as ei:
            c.chat.completions.create(model="m", messages=MSG, max_tokens=2)
        assert ei.value.status_code == 429
        assert ei.value.body["code"] == "queue_full"
        assert ei.value.response.headers["retry-after"] == "1"
        for cm, _ in streams:
            cm.__exit__(None, None, None)
        h.close()
        assert wait_for(lambda: s.metrics()["ferrolm_requests_running"] == 0, 10)
        assert c.chat.completions.create(model="m", messages=MSG, max_tokens=2).usage.completion_tokens == 2
    finally:
        s.stop()


def test_health_stays_responsive_during_a_long_prefill(server, client):
    prompt = "The quick brown fox jumps over the lazy dog. " * 200  # about 2,000 tokens
    done = threading.Event()

    def long_request():
        try:
            client.completions.create(model="m", prompt=prompt, max_tokens=1)
        finally:
            done.set()

    t = threading.Thread(target=long_request)
    t.start()
    assert wait_for(lambda: server.metrics()["ferrolm_requests_running"] == 1, 10)
    latencies = []
    with httpx.Client(base_url=server.url) as h:
        while not done.is_set():
            t0 = time.perf_counter()
            assert h.get("/health").status_code == 200
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.05)
    t.join()
    assert len(latencies) >= 3
    assert max(latencies) < 0.5, max(latencies)
