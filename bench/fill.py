#!/usr/bin/env python3
"""Fill (docs/fill.md) over HTTP: the recorded tool-call turns of tests/fixtures/fill/tool_turns.json
answered with fill on and off (`"fill": false`), alternating, on one `ferrolm serve`; the wall
time of each request (the prompt is a prompt-cache hit after the first round, as in an agent's
conversation), the answers compared, and `usage.fill`. Also what probing the tools costs: a
request with `max_tokens: 1` with fill on and off (fill renders the chat twice per tool).

    python bench/fill.py [--model PATH] [--rounds 5] [--out bench/results/fill.md]
"""
import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
MODELS = Path(os.environ.get("FERROLM_MODELS") or Path.home() / ".cache/ferrolm/models")
BIN = os.environ.get("FERROLM_BIN") or str(ROOT / "target/release/ferrolm")


def serve(model):
    proc = subprocess.Popen([BIN, "serve", "--port", "0", "--model", str(model)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    url = line.split(" at ")[1].split(" ")[0]
    return proc, url


def ask(url, messages, tools, **extra):
    body = {"model": "m", "messages": messages, "tools": tools, "max_tokens": 48, "temperature": 0, **extra}
    t = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    return time.perf_counter() - t, r.json()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(MODELS / "qwen2.5-coder-0.5b-instruct-Q4_K_M.gguf"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench/results/fill.md"))
    args = ap.parse_args()
    fixture = json.loads((ROOT / "tests/fixtures/fill/tool_turns.json").read_text())
    tools = fixture["tools"]
    proc, url = serve(args.model)
    rows, probe = [], {True: [], False: []}
    try:
        for turn in fixture["turns"]:
            times = {True: [], False: []}
            answers, usage = {}, None
            for rnd in range(args.rounds + 1):
                for fill in (False, True):
                    secs, r = ask(url, turn["messages"], tools, fill=fill)
                    if rnd:
                        times[fill].append(secs)
                    m = r["choices"][0]["message"]
                    # Tool call ids are random: compare names and arguments.
                    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or []]
                    answers[fill] = (m.get("content"), calls, r["choices"][0]["finish_reason"])
                    if fill:
                        usage = r["usage"]
            for rnd in range(args.rounds):
                for fill in (False, True):
                    probe[fill].append(ask(url, turn["messages"], tools, fill=fill, max_tokens=1)[0])
            off, on = statistics.median(times[False]), statistics.median(times[True])
            rows.append((turn["name"], usage["completion_tokens"], off, on, usage.get("fill", {}).get("assert", {}),
                         answers[True] == answers[False]))
            print(rows[-1], flush=True)
    finally:
        proc.terminate()
    total_off, total_on = sum(r[2] for r in rows), sum(r[3] for r in rows)
    p_off, p_on = statistics.median(probe[False]), statistics.median(probe[True])
    lines = [f"# Fill on recorded tool-call turns ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "",
             f"`python bench/fill.py --rounds {args.rounds}`, model `{Path(args.model).name}`, greedy, max_tokens 48, "
             "median wall time per request over the rounds (prompt-cache hits after round 0).", "",
             "| turn | tokens | fill off s | fill on s | saved | assert spans / injected / wasted | same answer |",
             "|---|---|---|---|---|---|---|"]
    for name, tokens, off, on, a, same in rows:
        lines.append(f"| {name} | {tokens} | {off:.3f} | {on:.3f} | {100 * (1 - on / off):.1f}% | "
                     f"{a.get('spans', 0)} / {a.get('injected', 0)} / {a.get('wasted', 0)} | {same} |")
    lines += [f"| all | | {total_off:.3f} | {total_on:.3f} | {100 * (1 - total_on / total_off):.1f}% | | |", "",
              f"Probing the tools (`max_tokens: 1`, median): {p_off * 1e3:.1f} ms with fill off, {p_on * 1e3:.1f} ms on.", ""]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
