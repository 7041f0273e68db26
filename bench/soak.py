"""Soak: mixed traffic from 16 clients against `ferrolm serve` for a while (30 minutes by
default), then checks that nothing broke: no error the client did not cause, RSS flat within 5%
after warm-up, no file descriptors leaked.

Each client loops over a mix: chat completions (whole and streamed), streams cancelled after a
few chunks, text completions, Anthropic messages (whole and streamed), Responses, JSON-schema constrained answers, and bad
requests (malformed JSON, wrong types, a prompt beyond the context, unknown routes) that must get
a 4xx in the API's shape. The server's RSS, open descriptors and threads are sampled every 10 s.

    python bench/soak.py [--minutes 30] [--clients 16] [--out bench/results/soak.json]

Writes the JSON report and a Markdown summary beside it (soak.md)."""
import argparse
import json
import os
import random
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "server"))
from conftest import Server  # noqa: E402
from hardening_util import error_shape_ok, rss_mb  # noqa: E402

TOPICS = ["the sea", "a city at night", "bread", "trains", "a library", "winter", "bees", "a lighthouse",
          "chess", "rain", "mountains", "a market", "clocks", "the moon", "gardens", "bridges", "owls",
          "coffee", "maps", "violins"]
ASKS = ["Write one sentence about {}.", "Give two facts about {}.", "Describe {} in a short poem.",
        "What is interesting about {}?"]


def prompt(rng):
    return rng.choice(ASKS).format(rng.choice(TOPICS))


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts = {}
        self.unexpected = []

    def add(self, kind, ok, detail=""):
        with self.lock:
            c = self.counts.setdefault(kind, {"ok": 0, "unexpected": 0})
            c["ok" if ok else "unexpected"] += 1
            if not ok and len(self.unexpected) < 100:
                self.unexpected.append(f"{kind}: {detail[:300]}")


def chat(c, rng, stream):
    body = {"messages": [{"role": "user", "content": prompt(rng)}], "max_tokens": rng.randint(8, 48),
            "temperature": rng.choice([0, 0.7]), "stream": stream}
    if not stream:
        r = c.post("/v1/chat/completions", json=body)
        return r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length"), r.text
    with c.stream("POST", "/v1/chat/completions", json=body) as r:
        text = "".join(r.iter_text())
    return r.status_code == 200 and text.rstrip().endswith("data: [DONE]"), text[-300:]


def cancelled(c, rng):
    body = {"messages": [{"role": "user", "content": prompt(rng)}], "max_tokens": 200, "stream": True,
            "logit_bias": {"2": -100}}
    with c.stream("POST", "/v1/chat/completions", json=body) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= rng.randint(2, 6):
                break
    return r.status_code == 200, str(r.status_code)


def completion(c, rng):
    r = c.post("/v1/completions", json={"prompt": prompt(rng), "max_tokens": rng.randint(8, 32),
                                        "stream": False, "n": rng.choice([1, 2])})
    return r.status_code == 200 and len(r.json()["choices"]) >= 1, r.text


def messages(c, rng, stream):
    body = {"model": "m", "max_tokens": rng.randint(8, 48), "stream": stream,
            "messages": [{"role": "user", "content": prompt(rng)}]}
    if not stream:
        r = c.post("/v1/messages", json=body)
        return r.status_code == 200 and r.json()["type"] == "message", r.text
    with c.stream("POST", "/v1/messages", json=body) as r:
        text = "".join(r.iter_text())
    return r.status_code == 200 and "message_stop" in text, text[-300:]


def responses(c, rng):
    r = c.post("/v1/responses", json={"input": prompt(rng), "max_output_tokens": 24, "store": False})
    return r.status_code == 200 and r.json()["status"] in ("completed", "incomplete"), r.text


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["title", "rating"],
          "properties": {"title": {"type": "string", "maxLength": 30}, "rating": {"type": "integer", "minimum": 1, "maximum": 5}}}


def structured(c, rng):
    """A JSON-schema constrained answer: when it finishes, it parses into the schema's keys."""
    body = {"messages": [{"role": "user", "content": "Review " + rng.choice(TOPICS) + " as JSON."}], "max_tokens": 60,
            "temperature": rng.choice([0, 0.8]), "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}}
    r = c.post("/v1/chat/completions", json=body)
    if r.status_code != 200:
        return False, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "length":
        return True, ""
    return set(json.loads(choice["message"]["content"])) == {"title", "rating"}, choice["message"]["content"]


BAD = [
    ("/v1/chat/completions", b'{"messages": ['),
    ("/v1/chat/completions", json.dumps({"messages": "x"}).encode()),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}).encode()),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi " * 9000}]}).encode()),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}], "guided_regex": "(unclosed"}).encode()),
    ("/v1/messages", json.dumps({"model": "m", "messages": []}).encode()),
    ("/v1/completions", json.dumps({"prompt": [10 ** 9]}).encode()),
    ("/v1/nothing", b"{}"),
]


def bad(c, rng):
    path, body = rng.choice(BAD)
    r = c.post(path, content=body, headers={"content-type": "application/json"})
    return 400 <= r.status_code < 500 and error_shape_ok(path, r.status_code, r.content), f"{path} {r.status_code} {r.text}"


MIX = [(30, "chat", lambda c, g: chat(c, g, False)), (20, "chat_stream", lambda c, g: chat(c, g, True)),
       (10, "cancelled_stream", cancelled), (10, "completion", completion),
       (8, "messages", lambda c, g: messages(c, g, False)), (7, "messages_stream", lambda c, g: messages(c, g, True)),
       (5, "responses", responses), (5, "structured", structured), (10, "bad_request", bad)]


def client(url, seed, until, tally):
    rng = random.Random(seed)
    weights = [w for w, _, _ in MIX]
    with httpx.Client(base_url=url, timeout=300) as c:
        while time.monotonic() < until:
            _, kind, fn = rng.choices(MIX, weights)[0]
            try:
                ok, detail = fn(c, rng)
            except (httpx.HTTPError, ValueError, KeyError) as e:
                ok, detail = False, repr(e)
            tally.add(kind, ok, detail)


def sample(pid, started):
    return {"t": round(time.monotonic() - started, 1), "rss_mb": round(rss_mb(pid), 1),
            "fds": len(os.listdir(f"/proc/{pid}/fd")), "threads": len(os.listdir(f"/proc/{pid}/task"))}


def summarize(args, samples, tally, warmup_s, idle_before, idle_after, alive):
    after = [s for s in samples if s["t"] >= warmup_s]
    base = after[0]["rss_mb"] if after else samples[-1]["rss_mb"]
    top = max(s["rss_mb"] for s in after) if after else base
    growth = (top - base) / base * 100
    total = {k: sum(c[k] for c in tally.counts.values()) for k in ("ok", "unexpected")}
    return {
        "minutes": args.minutes, "clients": args.clients, "warmup_s": warmup_s, "counts": tally.counts,
        "requests": total["ok"] + total["unexpected"], "unexpected": total["unexpected"],
        "unexpected_examples": tally.unexpected[:20], "rss_after_warmup_mb": base, "rss_max_after_warmup_mb": top,
        "rss_growth_pct": round(growth, 2), "fds_idle_before": idle_before, "fds_idle_after": idle_after,
        "server_alive": alive, "samples": samples,
        "ok": alive and total["unexpected"] == 0 and growth <= 5.0 and idle_after["fds"] <= idle_before["fds"],
    }


def markdown(r):
    lines = [f"# Soak: {r['minutes']} min, {r['clients']} clients, mixed traffic", "",
             f"- requests: {r['requests']}, unexpected errors: {r['unexpected']}",
             f"- RSS after warm-up ({r['warmup_s']} s): {r['rss_after_warmup_mb']} MB, max after: "
             f"{r['rss_max_after_warmup_mb']} MB ({r['rss_growth_pct']:+.2f}%)",
             f"- open fds idle before: {r['fds_idle_before']['fds']}, idle after: {r['fds_idle_after']['fds']}",
             f"- threads idle before / after: {r['fds_idle_before']['threads']} / {r['fds_idle_after']['threads']}",
             f"- server alive: {r['server_alive']}; verdict: {'ok' if r['ok'] else 'FAILED'}", "",
             "| kind | ok | unexpected |", "|---|---|---|"]
    lines += [f"| {k} | {c['ok']} | {c['unexpected']} |" for k, c in sorted(r["counts"].items())]
    lines += ["", "| t (s) | RSS MB | fds | threads |", "|---|---|---|---|"]
    step = max(1, len(r["samples"]) // 40)
    lines += [f"| {s['t']} | {s['rss_mb']} | {s['fds']} | {s['threads']} |" for s in r["samples"][::step]]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "soak.json"))
    args = ap.parse_args()
    # A prompt cache that fills during warm-up (the prompts repeat), so RSS can settle.
    s = Server("--prompt-cache-bytes", "128MB", "--header-timeout", "5")
    pid, started = s.proc.pid, time.monotonic()
    try:
        time.sleep(1)
        idle_before = sample(pid, started)
        duration = args.minutes * 60
        warmup_s = round(min(300.0, duration * 0.2), 1)
        tally, samples = Tally(), []
        until = time.monotonic() + duration
        threads = [threading.Thread(target=client, args=(s.url, i, until, tally)) for i in range(args.clients)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            samples.append(sample(pid, started))
            time.sleep(10)
        for t in threads:
            t.join()
        time.sleep(7)  # past --header-timeout: the clients' kept-alive connections are closed
        idle_after = sample(pid, started)
        alive = s.proc.poll() is None
    finally:
        s.stop()
    r = summarize(args, samples, tally, warmup_s, idle_before, idle_after, alive)
    out = Path(args.out)
    out.write_text(json.dumps(r, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(r))
    print(markdown(r))
    sys.exit(0 if r["ok"] else 1)


if __name__ == "__main__":
    main()
