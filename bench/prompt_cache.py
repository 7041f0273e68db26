#!/usr/bin/env python3
"""Prompt cache over HTTP, one machine, one run: time to first token per turn of a 10-turn chat
with about 2,000 tokens of history (a long system prompt), and of 4 such conversations
interleaved, for

- ferrolm serve (prompt cache on: its default),
- ferrolm serve --prompt-cache-bytes 0 (off: every turn prefills the whole conversation),
- llama.cpp's llama-server (its default prompt caching per slot), --parallel 1 and 4,

and a restart: ferrolm with --kv-disk, the conversations played, the server stopped and
started again, then each conversation's next turn (served from disk) against the same turn
with the cache off (cold).

    python bench/prompt_cache.py [--llama-server PATH] [--out bench/results]

Needs httpx (the test venv has it). The client appends each answer to its conversation as chat
clients do; answers are greedy and short (32 tokens) so that prefill dominates.
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
MODELS = Path(os.environ.get("FERROLM_MODELS") or Path.home() / ".cache/ferrolm/models")
GGUF = MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf"
BIN = os.environ.get("FERROLM_BIN") or str(ROOT / "target/release/ferrolm")
DOC = ("The history of the printing press is the history of how ideas learned to travel. Before movable type, "
       "every book was copied by hand, and a single manuscript could take a scribe many months to finish. ")
QUESTIONS = ["Who is this text about?", "Summarize it in one sentence.", "What came before movable type?",
             "How long did copying take?", "Name one consequence.", "Is the tone formal?", "Give a title.",
             "What is a scribe?", "Why did ideas travel faster?", "Say it again, shorter."]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd_for_port):
    port = free_port()
    proc = subprocess.Popen(cmd_for_port(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode})")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError("server not ready")


def ferrolm(*flags):
    return lambda port: [BIN, "serve", "--model", str(GGUF), "--port", str(port), *flags]


def llama(path, parallel):
    return lambda port: [path, "-m", str(GGUF), "-t", "2", "-np", str(parallel), "-c", str(8192 * parallel),
                         "--port", str(port), "--host", "127.0.0.1"]


def system_prompt(conv):
    # ~2,000 tokens of history; each conversation its own document so they share nothing.
    return f"Conversation {conv}. Read this document:\n\n" + DOC * 45


def turn(url, messages):
    """One streamed chat turn: (TTFT seconds, answer text)."""
    body = {"model": "m", "messages": messages, "max_tokens": 32, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    first, text = None, ""
    with httpx.Client(timeout=600) as h, h.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ch = json.loads(line[6:])
                if ch.get("choices") and ch["choices"][0]["delta"].get("content"):
                    first = first or time.perf_counter()
                    text += ch["choices"][0]["delta"]["content"]
    return (first or time.perf_counter()) - t0, text


def play(url, convs, turns, histories=None):
    """`convs` conversations interleaved turn by turn; returns TTFTs per turn and histories."""
    histories = histories or {c: [{"role": "system", "content": system_prompt(c)}] for c in convs}
    ttft = {t: [] for t in range(turns)}
    for t in range(turns):
        for c in convs:
            h = histories[c]
            h.append({"role": "user", "content": QUESTIONS[(len(h) // 2) % len(QUESTIONS)]})
            s, answer = turn(url, h)
            h.append({"role": "assistant", "content": answer})
            ttft[t].append(s)
    return {t: statistics.median(v) for t, v in ttft.items()}, histories


def run_system(label, cmd, convs, turns=10):
    proc, url = start(cmd)
    try:
        per_turn, _ = play(url, convs, turns)
    finally:
        proc.terminate()
        proc.wait(30)
    return {"system": label, "conversations": len(convs), "ttft_s": per_turn}


def restart(kv_dir):
    """Plays 4 conversations for 3 turns with --kv-disk, restarts, then the 4th turn of each:
    from disk, and cold (cache off) for comparison."""
    flags = ("--kv-disk", str(kv_dir))
    proc, url = start(ferrolm(*flags))
    try:
        _, histories = play(url, range(4), 3)
    finally:
        proc.terminate()
        proc.wait(30)
    out = {}
    for label, cmd in [("after restart (disk)", ferrolm(*flags)), ("cold (cache off)", ferrolm("--prompt-cache-bytes", "0"))]:
        proc, url = start(cmd)
        try:
            hs = json.loads(json.dumps(histories))
            per_turn, _ = play(url, range(4), 1, {int(k): v for k, v in hs.items()})
            out[label] = per_turn[0]
        finally:
            proc.terminate()
            proc.wait(30)
    return out


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
    ap.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"))
    ap.add_argument("--out", default=str(ROOT / "bench/results"))
    a = ap.parse_args()
    rows = []
    systems = [("ferrolm (cache on)", ferrolm()), ("ferrolm (cache off)", ferrolm("--prompt-cache-bytes", "0"))]
    for convs in ([0], [0, 1, 2, 3]):
        for label, cmd in systems + ([(f"llama-server -np {len(convs)}", llama(a.llama_server, len(convs)))] if a.llama_server else []):
            r = run_system(label, cmd, convs)
            rows.append(r)
            print(label, len(convs), " ".join(f"{v:.2f}" for v in r["ttft_s"].values()), flush=True)
    with tempfile.TemporaryDirectory() as d:
        rs = restart(Path(d))
    print("restart", rs, flush=True)
    write(rows, rs, Path(a.out))


def write(rows, rs, out):
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cores": os.cpu_count(), "model": GGUF.name,
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()}
    out.mkdir(parents=True, exist_ok=True)
    (out / "prompt_cache.json").write_text(json.dumps({"meta": meta, "rows": rows, "restart": rs}, indent=1))
    lines = [f"# Prompt cache over HTTP ({meta['date']}, commit {meta['commit']}, {meta['cores']} cores)", "",
             f"`python bench/prompt_cache.py`: {meta['model']}, a 10-turn chat over ~2,000 tokens of history, greedy "
             "32-token answers; median TTFT (s) per turn over the conversations.", "",
             "| system | conversations | " + " | ".join(f"turn {t + 1}" for t in range(10)) + " |",
             "|---|---|" + "---|" * 10]
    for r in rows:
        lines.append(f"| {r['system']} | {r['conversations']} | " + " | ".join(f"{v:.2f}" for v in r["ttft_s"].values()) + " |")
    lines += ["", "After a restart with `--kv-disk` (4 conversations, the 4th turn): " +
              ", ".join(f"{k} {v:.2f} s" for k, v in rs.items())]
    (out / "prompt_cache.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
