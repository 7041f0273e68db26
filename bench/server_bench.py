#!/usr/bin/env python3
"""Server overhead and peers, measured over HTTP on one machine in one run:

1. ferrolm direct (`crates/server/examples/engine_direct.rs`: the server's own `EngineHandle`,
   warm, in one process, no HTTP) against `ferrolm serve` streaming `/v1/completions`: time to
   first token and streamed decode tok/s for the same prompt and the same greedy tokens.
   Overhead = what the server adds (HTTP, JSON, tokenization on the blocking pool, the text
   pipeline, SSE).
2. The same streamed requests to mlx_lm.server (mlx-lm on CPU, the model as an f32 Hugging Face
   folder, OpenBLAS preloaded) and to llama.cpp's server (llama-cpp-python[server], the same
   GGUF, 2 threads).
3. `/health` latency while ferrolm runs a 4,000-token prefill (and idle, for reference).

    python bench/server_bench.py [--runs 5] [--decode 128] [--peers mlx,llamacpp] [--out bench/results]

Needs httpx (the test venv, ~/.cache/ferrolm/test-venv, has it). The peers run from the oracle
venv ($ORACLE_PY; WITH_MLX=1 scripts/oracle-env.sh, plus `pip install
'llama-cpp-python[server]==0.3.36'` there). Decode tok/s follows mlx-lm's
convention: tokens after the first over the time from the first to the last. Runs of the
systems alternate, so drift in machine load falls on all of them alike; medians are reported.
Every request starts with its own line ("Request N."), so no server can reuse a cached prefix
(mlx-lm and llama-cpp-python both would).
"""
import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
MODELS = Path(os.environ.get("FERROLM_MODELS") or Path.home() / ".cache/ferrolm/models")
GGUF = MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf"
HF = MODELS / "hf" / "SmolLM2-135M-Instruct-f32"
BIN = os.environ.get("FERROLM_BIN") or str(ROOT / "target/release/ferrolm")
DIRECT = os.environ.get("FERROLM_DIRECT_BIN") or str(Path(BIN).parent / "examples" / "engine_direct")
ORACLE = os.environ.get("ORACLE_PY") or str(Path.home() / ".cache/ferrolm/oracle-venv/bin/python")
BLAS = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"

# Counting never reaches an end of text within a few hundred tokens: every system generates
# exactly the requested number of tokens, greedily. One number per line, so that no generated
# token is a lone space: mlx-lm's streaming detokenizer holds a lone space back until the next
# token, which would merge chunks (and delay its first one by a token) with "1, 2, 3," counting.
SHORT = "Count from one, one number per line:\n" + "".join(f"{i}\n" for i in range(1, 21))
FILLER = ("The history of the printing press is the history of how ideas learned to travel. Before "
          "movable type, every book was copied by hand, and a single manuscript could take a scribe "
          "many months to finish. ")


def long_prompt(words):
    text = (FILLER * (words // len(FILLER.split()) + 1)).split()[:words]
    return " ".join(text) + "\n\n" + SHORT


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url, proc, path="/health", timeout=600):
    end = time.time() + timeout
    while time.time() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited ({proc.returncode})")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} not ready")


def start(kind):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ)
    if kind == "ferrolm":
        cmd, ready = [BIN, "serve", "--model", str(GGUF), "--port", str(port)], "/health"
    elif kind == "mlx":
        if Path(BLAS).exists():
            env["LD_PRELOAD"] = BLAS
        cmd, ready = [ORACLE, "-m", "mlx_lm", "server", "--model", str(HF), "--port", str(port)], "/health"
    elif kind == "llamacpp":
        cmd = [ORACLE, "-m", "llama_cpp.server", "--model", str(GGUF), "--port", str(port),
               "--n_threads", "2", "--n_ctx", "8192", "--n_batch", "512"]
        ready = "/v1/models"
    else:
        raise ValueError(kind)
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    wait_ready(url, p, ready)
    return p, url, time.perf_counter() - t0


# llama-cpp-python's server applies repeat_penalty 1.1 unless told otherwise; greedy everywhere.
EXTRA = {"llamacpp": {"repeat_penalty": 1.0}}


def stream_completion(client, prompt, n, model, extra=None):
    """(ttft s, decode tok/s, tokens) of one streamed greedy completion. `client` is kept open
    across requests (connection reused), so neither building an httpx client (~10 ms, mostly
    its SSL context) nor a TCP connect is timed."""
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0.0, "stream": True,
            **(extra or {})}
    t0 = time.perf_counter()
    stamps = []
    with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ch = json.loads(line[6:])
            if ch.get("choices") and ch["choices"][0].get("text"):
                stamps.append(time.perf_counter())
    ttft = stamps[0] - t0
    # Chunks carry about one token each; count tokens by chunk (usage is not in every peer's stream).
    tps = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0
    return ttft, tps, len(stamps)


class Direct:
    """The engine_direct example, kept running (warm) and fed one request per line."""

    def __init__(self):
        if not Path(DIRECT).exists():
            sys.exit(f"{DIRECT} missing: cargo build --release -p ferrolm-server --example engine_direct")
        self.p = subprocess.Popen([DIRECT, str(GGUF)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def run(self, prompt, n):
        self.p.stdin.write(json.dumps({"prompt": prompt, "max_tokens": n}) + "\n")
        self.p.stdin.flush()
        r = json.loads(self.p.stdout.readline())
        return r["ttft_ms"] / 1e3, r["decode_tps"], r["tokens"]

    def close(self):
        self.p.terminate()


def steal_s():
    """CPU time the hypervisor gave to other guests (all CPUs, s): interference we cannot see."""
    try:
        with open("/proc/stat") as f:
            return int(f.readline().split()[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def busy_fraction(seconds=0.5):
    """Share of all CPUs busy over a short window (between rounds, our servers are idle)."""
    def read():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v) - v[3] - v[4], sum(v)  # not idle, not iowait
    b0, t0 = read()
    time.sleep(seconds)
    b1, t1 = read()
    return (b1 - b0) / max(1, t1 - t0)


def wait_quiet(limit_s=600):
    """Waits (up to limit_s) until the machine is idle, so another user's compile does not
    fall into a round; returns the seconds waited."""
    t0 = time.time()
    while time.time() - t0 < limit_s and busy_fraction() > 0.15:
        time.sleep(2)
    return time.time() - t0


def machine_busy_s():
    """CPU seconds all CPUs spent busy (not idle, iowait or stolen) since boot."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4] - v[7]) / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pids):
    """CPU seconds used so far by these processes (all their threads)."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            pass
    return total


def with_steal(fn, *a):
    s0 = steal_s()
    return (*fn(*a), steal_s() - s0)


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def health_during_prefill(url, words):
    """/health latencies (ms) idle, then while a long prompt is prefilled."""
    prompt = long_prompt(words)
    idle = []
    with httpx.Client(base_url=url) as h:
        for _ in range(50):
            t0 = time.perf_counter()
            h.get("/health")
            idle.append((time.perf_counter() - t0) * 1e3)
    result = {}

    def run():
        t0 = time.perf_counter()
        r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=600)
        result["prefill_s"] = time.perf_counter() - t0
        result["prompt_tokens"] = r.json()["usage"]["prompt_tokens"]

    t = threading.Thread(target=run)
    t.start()
    busy = []
    time.sleep(0.2)
    with httpx.Client(base_url=url) as h:
        while t.is_alive():
            t0 = time.perf_counter()
            h.get("/health")
            busy.append((time.perf_counter() - t0) * 1e3)
            time.sleep(0.02)
    t.join()
    q = lambda xs, p: sorted(xs)[min(len(xs) - 1, int(p * len(xs)))]
    return {"prompt_tokens": result["prompt_tokens"], "prefill_s": result["prefill_s"],
            "idle_ms": {"p50": q(idle, .5), "p99": q(idle, .99), "max": max(idle)},
            "busy_ms": {"n": len(busy), "p50": q(busy, .5), "p99": q(busy, .99), "max": max(busy)}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--long-words", type=int, default=330, help="words in the long prompt (~450 tokens)")
    ap.add_argument("--peers", default="mlx,llamacpp")
    ap.add_argument("--health-words", type=int, default=3450, help="about 4,000 tokens")
    ap.add_argument("--max-other-cpu", type=float, default=0.5,
                    help="CPU seconds other processes may use during a round before it is run again")
    ap.add_argument("--out", default=str(ROOT / "bench/results"))
    args = ap.parse_args()
    peers = [p for p in args.peers.split(",") if p]
    prompts = {"short": SHORT, "long": long_prompt(args.long_words)}
    servers = {}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    steal0, wall0 = steal_s(), time.time()
    source = git_commit()  # before the run: the binaries were built from this tree
    direct = Direct()
    dropped = {}
    uid = iter(range(1, 1 << 30))
    unique = lambda prompt: f"Request {next(uid)}.\n{prompt}"
    try:
        for kind in ["ferrolm", *peers]:
            p, url, ready = start(kind)
            servers[kind] = {"proc": p, "url": url, "ready_s": ready,
                             "client": httpx.Client(base_url=url, timeout=600)}
            print(f"{kind}: {url} ready in {ready:.2f} s", flush=True)
        ours = [os.getpid(), direct.p.pid, *(v["proc"].pid for v in servers.values())]
        model = {"ferrolm": "m", "mlx": str(HF), "llamacpp": str(GGUF)}
        results = {}
        for name, prompt in prompts.items():
            runs = {k: [] for k in ["direct", *servers]}
            for k in servers:  # warm-up
                stream_completion(servers[k]["client"], unique(prompt), 8, model[k], EXTRA.get(k))
            direct.run(unique(prompt), 8)
            i = redone = 0
            while i < args.runs:
                waited = wait_quiet()
                if waited > 1:
                    print(f"  waited {waited:.0f} s for the machine to go idle", flush=True)
                busy0, ours0 = machine_busy_s(), process_cpu_s(ours)
                # Each round starts with another system (the first one runs on a machine that has
                # just been idle; on this VM that alone moved a 1 s TTFT by up to 20%).
                order = list(runs)
                for k in order[i % len(order):] + order[:i % len(order)]:
                    if k == "direct":
                        runs[k].append(with_steal(direct.run, unique(prompt), args.decode))
                    else:
                        runs[k].append(with_steal(stream_completion, servers[k]["client"], unique(prompt),
                                                  args.decode, model[k], EXTRA.get(k)))
                others = (machine_busy_s() - busy0) - (process_cpu_s(ours) - ours0)
                print(f"  {name} run {i + 1}: " + ", ".join(
                    f"{k} {r[-1][0] * 1e3:.0f} ms/{r[-1][1]:.1f} tok/s" for k, r in runs.items()) +
                    f" (steal {sum(r[-1][3] for r in runs.values()):.2f} s, other processes {others:.1f} s)",
                    flush=True)
                # Another user's process took CPU during the round: drop the round and run it again.
                if others > args.max_other_cpu and redone < 4 * args.runs:
                    for v in runs.values():
                        v.pop()
                    redone += 1
                    print("    (dropped: other processes were busy)", flush=True)
                    continue
                i += 1
            dropped[name] = redone
            for k, v in runs.items():
                if any(r[2] != args.decode for r in v):
                    print(f"  warning: {k} streamed {[r[2] for r in v]} text chunks, not {args.decode} "
                          "(decode tok/s counts chunks as tokens)", flush=True)
            results[name] = {k: {"ttft_ms": med([r[0] for r in v]) * 1e3, "decode_tps": med([r[1] for r in v]),
                                 "tokens": med([r[2] for r in v]), "runs": v} for k, v in runs.items()}
        wait_quiet()
        health = health_during_prefill(servers["ferrolm"]["url"], args.health_words)
    finally:
        direct.close()
        for s in servers.values():
            s["client"].close()
            s["proc"].terminate()
    steal = {"steal_s": steal_s() - steal0, "wall_s": time.time() - wall0, "rounds_dropped": dropped}
    write(Path(args.out), args, results, health, {k: v["ready_s"] for k, v in servers.items()}, steal, source)


def cpu_model():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit():
    try:
        rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.split("\n")
        dirty = [line[3:] for line in dirty if line.strip()]
        return rev, dirty
    except OSError:
        return "unknown", []


def write(out, args, results, health, ready, steal, source):
    out.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    rev, dirty = source
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": rev, "modified_files": dirty,
            "machine": cpu_model(), "cpus": os.cpu_count(), "loadavg_at_end": load, "runs": args.runs,
            "decode_tokens": args.decode, **steal}
    (out / "server.json").write_text(json.dumps({"meta": meta, "results": results, "health": health,
                                                 "ready_s": ready}, indent=1) + "\n")
    lines = ["# ferrolm serve: server overhead and peers", "",
             f"`bench/server_bench.py`, {meta['date']}, commit {rev}"
             + (f" (with uncommitted changes to {', '.join(dirty)})" if dirty else "") +
             f", {meta['machine']}, {meta['cpus']} CPUs, load average at the end {load[0]:.1f}, CPU time "
             f"stolen by other guests {steal['steal_s']:.1f} s over {steal['wall_s']:.0f} s, rounds run again "
             f"because other processes were busy: {steal['rounds_dropped']}. SmolLM2-135M-Instruct; ferrolm and llama.cpp on the Q4_1 GGUF, mlx-lm on "
             f"the same weights as f32 (OpenBLAS). Greedy, {args.decode} generated tokens, median of "
             f"{args.runs} alternating runs. Streamed `/v1/completions`; decode tok/s = tokens after "
             "the first / time from the first to the last.", "",
             "| prompt | system | TTFT ms | decode tok/s |", "|---|---|---|---|"]
    for name, res in results.items():
        for k, r in res.items():
            label = {"direct": "ferrolm engine, no HTTP", "ferrolm": "ferrolm serve",
                     "mlx": "mlx_lm.server", "llamacpp": "llama.cpp server"}[k]
            lines.append(f"| {name} | {label} | {r['ttft_ms']:.0f} | {r['decode_tps']:.1f} |")
    for name, res in results.items():
        d, s = res["direct"], res["ferrolm"]
        lines.append("")
        # Paired: run i of the server against run i of the engine (adjacent in time).
        pt = med([(b[0] / a[0] - 1) * 100 for a, b in zip(d["runs"], s["runs"])])
        pd = med([(b[1] / a[1] - 1) * 100 for a, b in zip(d["runs"], s["runs"])])
        lines.append(f"Server overhead ({name} prompt), medians: TTFT {s['ttft_ms'] - d['ttft_ms']:+.1f} ms "
                     f"({(s['ttft_ms'] / d['ttft_ms'] - 1) * 100:+.1f}%), decode "
                     f"{(s['decode_tps'] / d['decode_tps'] - 1) * 100:+.1f}%; median of the paired runs: "
                     f"TTFT {pt:+.1f}%, decode {pd:+.1f}%.")
    h = health
    lines += ["", f"`/health` during a {h['prompt_tokens']}-token prefill ({h['prefill_s']:.1f} s): "
              f"p50 {h['busy_ms']['p50']:.1f} ms, p99 {h['busy_ms']['p99']:.1f} ms, max "
              f"{h['busy_ms']['max']:.1f} ms over {h['busy_ms']['n']} probes (idle: p50 "
              f"{h['idle_ms']['p50']:.1f} ms, max {h['idle_ms']['max']:.1f} ms).",
              "", "Ready to serve (process start to first 200): " +
              ", ".join(f"{k} {v:.2f} s" for k, v in ready.items()) + "."]
    (out / "server.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
