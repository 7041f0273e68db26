#!/usr/bin/env python3
"""Continuous batching over HTTP, one machine, one run: aggregate decode tok/s and p50/p95 time
to first token at 1, 4, 16 and 64 concurrent streaming chat clients, for

- ferrolm serve (continuous batching, its defaults),
- ferrolm serve --max-seqs 1 (one sequence at a time: the engine as it was before batching,
  same kernels),
- llama.cpp's llama-server with --parallel N (continuous batching over N slots).

Every client sends `--requests` chat requests one after the other (so sequences join and leave
mid-stream), each asking for `--max-tokens` tokens with the end-of-turn token banned (every
system generates exactly that many), greedy. Each request starts with its own line so no server
reuses a cached prefix. Systems alternate within each concurrency level.

    python bench/batching.py [--llama-server PATH] [--levels 1,4,16,64] [--out bench/results]

Needs httpx (the test venv, ~/.cache/ferrolm/test-venv, has it). llama-server builds from the
llama-cpp-python source package (../shared/PEERS.md); without it only ferrolm runs.
"""
import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
MODELS = Path(os.environ.get("FERROLM_MODELS") or Path.home() / ".cache/ferrolm/models")
GGUF = MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf"
BIN = os.environ.get("FERROLM_BIN") or str(ROOT / "target/release/ferrolm")
# <|im_end|> (id 2) ends SmolLM2's turns; banned, every answer runs to max_tokens.
NO_EOS = {"2": -100}
TOPICS = ["the sea", "a mountain", "bread", "a violin", "winter", "a robot", "tea", "a bridge",
          "the moon", "a library", "rain", "a garden", "coffee", "a train", "the desert", "a cat"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url, proc, timeout=300):
    end = time.time() + timeout
    while time.time() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited ({proc.returncode})")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} not ready")


def start(system, clients, llama_server):
    port = free_port()
    if system.startswith("ferrolm"):
        cmd = [BIN, "serve", "--model", str(GGUF), "--port", str(port), "--queue-size", "256"]
        if system == "ferrolm-serial":
            cmd += ["--max-seqs", "1"]
    else:
        cmd = [llama_server, "-m", str(GGUF), "-t", "2", "-np", str(clients), "-c", str(1024 * clients),
               "--port", str(port), "--host", "127.0.0.1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc)
    return proc, url


def rss_mb(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def one_request(url, n, max_tokens):
    """Streams one chat request; returns (ttft s, tokens, seconds)."""
    body = {"model": "m", "stream": True, "temperature": 0, "max_tokens": max_tokens, "logit_bias": NO_EOS,
            "messages": [{"role": "user", "content": f"Request {n}. Tell me a long story about {TOPICS[n % 16]}."}]}
    t0 = time.perf_counter()
    first, tokens = None, 0
    with httpx.Client(timeout=600) as h, h.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                tokens += 1
                first = first or time.perf_counter()
    return (first or time.perf_counter()) - t0, tokens, time.perf_counter() - t0


def load(url, clients, requests, max_tokens, base):
    """`clients` threads, each sending `requests` requests in turn."""
    results, lock = [], threading.Lock()

    def client(c):
        for i in range(requests):
            r = one_request(url, base + c * requests + i, max_tokens)
            with lock:
                results.append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttfts = sorted(r[0] for r in results)
    tokens = sum(r[1] for r in results)
    return {"tok_s": tokens / wall, "tokens": tokens, "wall_s": wall,
            "ttft_p50_s": statistics.median(ttfts), "ttft_p95_s": ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))]}


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
    ap.add_argument("--levels", default="1,4,16,64")
    ap.add_argument("--requests", type=int, default=2, help="requests per client, one after the other")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--systems", default="ferrolm,ferrolm-serial,llama-server")
    ap.add_argument("--out", default=str(ROOT / "bench/results"))
    a = ap.parse_args()
    systems = [s for s in a.systems.split(",") if s != "llama-server" or a.llama_server]
    rows = []
    base = 0
    for clients in [int(x) for x in a.levels.split(",")]:
        for system in systems:
            proc, url = start(system, clients, a.llama_server)
            try:
                one_request(url, 10_000 + base, 8)  # warm-up
                r = load(url, clients, a.requests, a.max_tokens, base)
                r.update(system=system, clients=clients, rss_mb=rss_mb(proc.pid))
                rows.append(r)
                print(f"{system:15s} {clients:3d} clients: {r['tok_s']:7.1f} tok/s, TTFT p50 {r['ttft_p50_s']:.2f} s "
                      f"p95 {r['ttft_p95_s']:.2f} s, {r['tokens']} tokens in {r['wall_s']:.1f} s, RSS {r['rss_mb']:.0f} MB",
                      flush=True)
            finally:
                proc.terminate()
                proc.wait(30)
            base += clients * a.requests
    write(rows, a, Path(a.out))


def write(rows, a, out):
    out.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "model": GGUF.name, "max_tokens": a.max_tokens, "requests_per_client": a.requests,
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()}
    (out / "batching.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    by = {(r["system"], r["clients"]): r for r in rows}
    lines = [f"# Continuous batching over HTTP ({meta['date']}, commit {meta['commit']}, {meta['cores']} cores)", "",
             f"`python bench/batching.py`: {meta['model']}, streamed chat, {a.max_tokens} tokens per answer (end of turn "
             f"banned), greedy, {a.requests} requests per client one after the other.", "",
             "| clients | system | aggregate tok/s | TTFT p50 s | TTFT p95 s | RSS MB | × serial | × llama-server |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        serial = by.get(("ferrolm-serial", r["clients"]))
        peer = by.get(("llama-server", r["clients"]))
        ratio = lambda o: f"{r['tok_s'] / o['tok_s']:.2f}" if o else "—"
        lines.append(f"| {r['clients']} | {r['system']} | {r['tok_s']:.1f} | {r['ttft_p50_s']:.2f} | {r['ttft_p95_s']:.2f} | "
                     f"{r['rss_mb']:.0f} | {ratio(serial)} | {ratio(peer)} |")
    (out / "batching.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
