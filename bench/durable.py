#!/usr/bin/env python3
"""What durable generations cost (issue 35, docs/durable.md).

1. Decode throughput: C concurrent seeded requests of M tokens, on a server without
   checkpoints, with `--checkpoint-dir` (a record every 16 tokens, fsync on), and with fsync off;
   the configurations alternate for R repetitions (a busy machine drifts) and the median of each
   is reported.
2. Resume: a streaming request is killed (`kill -9`) after about K tokens; after a restart its
   retry replays the saved prefix and continues. Reported: the time to the first replayed chunk
   and to the first new token (chunk K'+1, K' = tokens in the log), against a cold re-run of
   the same request on a fresh server (the time to reach the same chunk).
3. The cost of one fdatasync of a small append in the checkpoint directory (what the writer
   thread pays per group commit, off the engine thread).

    python3 bench/durable.py --json bench/results/durable.json
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import crash_harness as ch  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


def body(seed, max_tokens, stream=False):
    return {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens, "temperature": 0.8,
            "seed": seed, "stream": stream}


def throughput(url, concurrency, max_tokens, seed0):
    """Completion tokens per second of `concurrency` requests together, and the tokens."""
    tokens = [0] * concurrency

    def one(i):
        r = httpx.post(url + "/v1/chat/completions", json=body(seed0 + i, max_tokens), timeout=600)
        tokens[i] = r.json()["usage"]["completion_tokens"]

    t0 = time.monotonic()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(tokens) / (time.monotonic() - t0), sum(tokens)


def paired(args, ckdir):
    """Both servers (no checkpoints; a record every 16 tokens) loaded at the same time with the
    same requests, so that a busy machine's noise hits both alike: the ratio of their rates."""
    servers = {"none": ch.Server(args.bin, args.model),
               "every16": ch.Server(args.bin, args.model, "--checkpoint-dir", str(ckdir), "--checkpoint-every", "16")}
    ratios, cpu_ratios = [], []
    try:
        for s in servers.values():
            throughput(s.url, 1, 8, 1)
        for rep in range(args.reps):
            got, cpu0 = {}, {k: cpu_seconds(s.proc.pid) for k, s in servers.items()}

            def run(name):
                got[name] = throughput(servers[name].url, args.concurrency, args.max_tokens, 100 * rep)

            threads = [threading.Thread(target=run, args=(k,)) for k in servers]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            cpu = {k: (cpu_seconds(s.proc.pid) - cpu0[k]) / got[k][1] for k, s in servers.items()}
            ratios.append(got["every16"][0] / got["none"][0])
            cpu_ratios.append(cpu["every16"] / cpu["none"])
            print(f"paired rep {rep}: rate ratio {ratios[-1]:.3f}, CPU per token ratio {cpu_ratios[-1]:.3f}", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    return {"rate_ratio": [round(r, 4) for r in ratios], "median_rate_ratio": round(statistics.median(ratios), 4),
            "cpu_per_token_ratio": [round(r, 4) for r in cpu_ratios], "median_cpu_per_token_ratio": round(statistics.median(cpu_ratios), 4)}


def cpu_seconds(pid):
    """User + system CPU time of a process and its threads (/proc/PID/stat), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def chunk_times(url, key, b):
    """Arrival time of every content chunk of a streaming request (from the request's start)."""
    headers = {"Idempotency-Key": key} if key else {}
    out, t0 = [], time.monotonic()
    with httpx.stream("POST", url + "/v1/chat/completions", json=b, headers=headers, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                c = json.loads(line[6:])["choices"]
                if c and (c[0].get("delta") or {}).get("content"):
                    out.append(time.monotonic() - t0)
    return out


def resume_case(args, ckdir):
    flags = ["--checkpoint-dir", str(ckdir), "--checkpoint-every", "16"]
    b = body(7, args.resume_tokens * 2, stream=True)
    s = ch.Server(args.bin, args.model, *flags)
    seen = []
    t = threading.Thread(target=ch.stream, args=(s.url, "bench-resume", b, seen), daemon=True)
    t.start()
    while len(seen) < args.resume_tokens and t.is_alive():
        time.sleep(0.005)
    s.kill9()
    saved = ch.saved_tokens(ch.log_path(ckdir, "bench-resume"))
    s2 = ch.Server(args.bin, args.model, *flags)
    resumed = chunk_times(s2.url, "bench-resume", b)
    s2.stop()
    cold_server = ch.Server(args.bin, args.model)
    cold = chunk_times(cold_server.url, None, b)
    cold_server.stop()
    k = min(saved, len(resumed) - 1, len(cold) - 1)
    return {"saved_tokens": saved, "first_replayed_chunk_ms": round(resumed[0] * 1e3, 1),
            "resume_first_new_token_ms": round(resumed[k] * 1e3, 1), "cold_same_chunk_ms": round(cold[k] * 1e3, 1),
            "speedup": round(cold[k] / resumed[k], 1)}


def fsync_cost(ckdir, n=200):
    """Median and p99 of append + fdatasync of a 100-byte record, in ms."""
    path = Path(ckdir) / "fsync-probe"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    times = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            os.write(fd, b"x" * 100)
            os.fdatasync(fd)
            times.append((time.perf_counter() - t0) * 1e3)
    finally:
        os.close(fd)
        path.unlink()
    times.sort()
    return {"median_ms": round(statistics.median(times), 3), "p99_ms": round(times[int(n * 0.99) - 1], 3)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.environ.get("FERROLM_BIN") or str(ch.ROOT / "target/release/ferrolm"))
    ap.add_argument("--model", default=str(ch.SMOLLM2))
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--resume-tokens", type=int, default=160)
    ap.add_argument("--json")
    args = ap.parse_args()
    ckdir = Path(tempfile.mkdtemp(prefix="ferrolm-bench-ckpt-"))
    configs = {"none": [], "every16": ["--checkpoint-dir", str(ckdir), "--checkpoint-every", "16"],
               "every16_nofsync": ["--checkpoint-dir", str(ckdir), "--checkpoint-every", "16", "--checkpoint-fsync", "false"]}
    rates = {k: [] for k in configs}
    cpu_ms = {k: [] for k in configs}
    for rep in range(args.reps):
        for name, flags in configs.items():
            s = ch.Server(args.bin, args.model, *flags)
            try:
                throughput(s.url, 1, 8, 1)  # warm-up
                c0 = cpu_seconds(s.proc.pid)
                rate, tokens = throughput(s.url, args.concurrency, args.max_tokens, 100 * rep)
                rates[name].append(rate)
                cpu_ms[name].append(1e3 * (cpu_seconds(s.proc.pid) - c0) / tokens)
            finally:
                s.stop()
            print(f"rep {rep} {name}: {rate:.1f} tok/s, {cpu_ms[name][-1]:.2f} CPU ms/token", flush=True)
    med = {k: round(statistics.median(v), 1) for k, v in rates.items()}
    med_cpu = {k: round(statistics.median(v), 3) for k, v in cpu_ms.items()}
    out = {
        "concurrency": args.concurrency, "max_tokens": args.max_tokens, "reps": args.reps,
        "decode_tok_s": rates, "median_tok_s": med, "cpu_ms_per_token": cpu_ms, "median_cpu_ms_per_token": med_cpu,
        "checkpoint_cpu_cost_pct": round(100 * (med_cpu["every16"] / med_cpu["none"] - 1), 1),
        "checkpoint_cost_pct": round(100 * (1 - med["every16"] / med["none"]), 1),
        "checkpoint_nofsync_cost_pct": round(100 * (1 - med["every16_nofsync"] / med["none"]), 1),
        "paired": paired(args, ckdir),
        "resume": resume_case(args, ckdir),
        "fdatasync": fsync_cost(ckdir),
    }
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
