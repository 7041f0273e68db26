#!/usr/bin/env python3
"""Load test over HTTP with the official openai SDK against a real `ferrolm serve`:

1. 64 concurrent streaming chat clients for a minute, each asking greedy questions from a set
   of 16 in turn: every stream must complete and equal that question's answer asked alone
   (greedy + bit-exact batching), with no error; the server's RSS after the run must be within
   a few percent of its RSS after the warm-up (nothing grows per request).
2. Overload: with every seat busy and the queue full, 200 more requests get 429 (with
   Retry-After), not a hang.
3. A client that disconnects mid-stream frees its seat within a step or two.

    python bench/load_test.py [--seconds 60] [--clients 64] [--out bench/results]

Needs the openai SDK and httpx (the test venv, ~/.cache/ferrolm/test-venv, has both).
"""
import argparse
import json
import os
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parents[1]
MODELS = Path(os.environ.get("FERROLM_MODELS") or Path.home() / ".cache/ferrolm/models")
GGUF = MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf"
BIN = os.environ.get("FERROLM_BIN") or str(ROOT / "target/release/ferrolm")
QUESTIONS = [f"In two sentences, what is {t}?" for t in [
    "the sea", "a mountain", "bread", "a violin", "winter", "a robot", "tea", "a bridge", "the moon",
    "a library", "rain", "a garden", "coffee", "a train", "the desert", "a cat"]]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *flags):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([BIN, "serve", "--model", str(GGUF), "--port", str(self.port), *flags],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(600):
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError("server did not start")

    def client(self, **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, **kw)

    def rss_mb(self):
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024

    def metric(self, name):
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])

    def stop(self):
        self.proc.terminate()
        self.proc.wait(30)


def ask(client, q, max_tokens, stream=True):
    kw = dict(model="m", messages=[{"role": "user", "content": q}], max_tokens=max_tokens, temperature=0)
    if not stream:
        return client.chat.completions.create(**kw).choices[0].message.content
    text, finish = "", None
    for ch in client.chat.completions.create(**kw, stream=True):
        if ch.choices:
            text += ch.choices[0].delta.content or ""
            finish = ch.choices[0].finish_reason or finish
    assert finish in ("stop", "length"), finish
    return text


def sustained(s, clients, seconds, max_tokens):
    solo = {q: ask(s.client(timeout=600), q, max_tokens, stream=False) for q in QUESTIONS}
    # A warm-up at full concurrency first: the RSS compared is the one a loaded server has.
    warm = run_clients(s, clients, seconds / 4, max_tokens, solo)
    rss_warm = s.rss_mb()
    counts, wall = run_clients(s, clients, seconds, max_tokens, solo)
    return {"clients": clients, "seconds": wall, **counts, "warm_up": warm[0], "rss_warm_mb": rss_warm,
            "rss_after_mb": s.rss_mb(), "preemptions": s.metric("ferrolm_preemptions_total")}


def run_clients(s, clients, seconds, max_tokens, solo):
    """`clients` threads asking in turn until `seconds` pass; counts answers equal to `solo`."""
    stop_at = time.monotonic() + seconds
    counts = {"ok": 0, "mismatch": 0, "error": 0}
    lock = threading.Lock()

    def client(c):
        cl = s.client(timeout=600)
        i = c
        while time.monotonic() < stop_at:
            q = QUESTIONS[i % len(QUESTIONS)]
            try:
                key = "ok" if ask(cl, q, max_tokens) == solo[q] else "mismatch"
            except Exception as e:  # noqa: BLE001 (counted and reported)
                print("error:", repr(e)[:200], flush=True)
                key = "error"
            with lock:
                counts[key] += 1
            i += 1

    t0 = time.monotonic()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    return counts, time.monotonic() - t0


def overload(extra=200):
    """Seats 4 and a queue of 4, all held by long streams; then `extra` more requests at once."""
    s = Server("--max-seqs", "4", "--queue-size", "4")
    try:
        body = {"model": "m", "messages": [{"role": "user", "content": "Count to a thousand."}], "max_tokens": 2000,
                "stream": True, "logit_bias": {"2": -100}}
        h = httpx.Client(timeout=600)
        held = []
        # Until 4 run and the queue holds 4 (one more waits inside the batch for a seat).
        while len(held) < 20 and not (s.metric("ferrolm_requests_running") == 4 and s.metric("ferrolm_queue_depth") == 4):
            cm = h.stream("POST", s.url + "/v1/chat/completions", json=body)
            held.append((cm, cm.__enter__()))
            time.sleep(0.2)
        codes, retry_after = [], set()

        def one(_):
            r = httpx.post(s.url + "/v1/chat/completions", json={**body, "stream": False, "max_tokens": 4}, timeout=30)
            retry_after.add(r.headers.get("retry-after"))
            return r.status_code

        t0 = time.monotonic()
        with ThreadPoolExecutor(32) as pool:
            codes = list(pool.map(one, range(extra)))
        answered_s = time.monotonic() - t0
        for cm, _ in held:
            cm.__exit__(None, None, None)
        h.close()
        return {"held": len(held), "requests": extra, "429": codes.count(429), "other": len(codes) - codes.count(429),
                "retry_after": sorted(x for x in retry_after if x), "answered_in_s": answered_s}
    finally:
        s.stop()


def disconnect(s):
    """Opens a long stream, reads a few tokens, disconnects; returns ms until the seat is free."""
    body = {"model": "m", "messages": [{"role": "user", "content": "Count to a thousand."}], "max_tokens": 2000,
            "stream": True, "logit_bias": {"2": -100}}
    with httpx.Client(timeout=60) as h, h.stream("POST", s.url + "/v1/chat/completions", json=body) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break
        t0 = time.monotonic()
    while s.metric("ferrolm_requests_running") != 0:
        time.sleep(0.005)
    return (time.monotonic() - t0) * 1e3


def private_copy(path):
    """A copy of the binary that a concurrent build cannot replace halfway through the run."""
    import shutil, tempfile
    dst = Path(tempfile.mkdtemp()) / "ferrolm"
    shutil.copy2(path, dst)
    return str(dst)


def main():
    global BIN
    BIN = private_copy(BIN)
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", default=str(ROOT / "bench/results"))
    a = ap.parse_args()
    s = Server("--queue-size", "256")
    try:
        res = {"sustained": sustained(s, a.clients, a.seconds, a.max_tokens), "disconnect_ms": disconnect(s)}
    finally:
        s.stop()
    res["overload"] = overload()
    print(json.dumps(res, indent=1))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    res["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    (out / "load_test.json").write_text(json.dumps(res, indent=1))
    sus = res["sustained"]
    ok = sus["error"] == 0 and sus["mismatch"] == 0 and sus["warm_up"]["error"] == 0 and res["overload"]["other"] == 0
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
