#!/usr/bin/env python3
"""ferrolm vs llama.cpp on the CPU, side by side, on identical prompt token ids.

For each model: prefill tok/s on a 512-token prompt, decode tok/s over 128 greedy tokens at
batch 1, time to first token, load time and peak RSS; each the median of RUNS runs after a
warm-up, both engines using all cores. The engines run in separate processes, alternately
(llama.cpp, ferrolm, llama.cpp, ferrolm), so drift on a shared machine hits both.

    source <(scripts/oracle-env.sh)     # llama-cpp-python built for this CPU
    cargo build --release -p ferrolm-cli
    $ORACLE_PY bench/cpu_vs_llamacpp.py [--runs 5] [--rounds 2]

Writes bench/results/cpu_vs_llamacpp.{md,json}. llama.cpp runs with its defaults (f16 KV
cache, no flash attention on CPU), the configuration its users get.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = Path(os.environ.get("FERROLM_MODELS") or Path.home() / ".cache/ferrolm/models")
ROWS = [
    ("SmolLM2-135M Q4_1", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    ("SmolLM2-135M Q8_0", "SmolLM2-135M-Instruct.Q8_0.gguf"),
    ("SmolLM2-135M F16", "SmolLM2-135M-Instruct.F16.gguf"),
    ("Gemma 3 270M Q4_K_M", "gemma-3-270m-Q4_K_M.gguf"),
    ("Qwen2.5-Coder-1.5B Q4_K_M (default)", "qwen2.5-coder-1.5b-instruct.gguf"),
]
TEXT = (ROOT / "scripts/fixtures/prompts.py").read_text()

LLAMA_CHILD = r'''
import json, sys, time, resource, statistics
import numpy as np
t0 = time.perf_counter()
from llama_cpp import Llama
path, ids_file, runs, decode, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
ids = json.load(open(ids_file))
t1 = time.perf_counter()
llm = Llama(model_path=path, n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=threads, n_threads_batch=threads, verbose=False)
load_s = time.perf_counter() - t1
def logits():
    return np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),))
pre, dec, ttft = [], [], []
for run in range(runs + 1):
    llm.reset()
    s = time.perf_counter()
    llm.eval(ids)
    tok = int(np.argmax(logits()))
    first = time.perf_counter() - s
    s = time.perf_counter()
    for _ in range(decode):
        llm.eval([tok])
        tok = int(np.argmax(logits()))
    d = time.perf_counter() - s
    if run > 0:
        pre.append(len(ids) / first); dec.append(decode / d); ttft.append(first * 1e3)
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"load_s": load_s, "prefill_runs": pre, "decode_runs": dec, "ttft_runs": ttft, "peak_rss_mb": rss}))
'''


def prompt_ids(model: Path, n: int) -> list:
    from llama_cpp import Llama
    llm = Llama(model_path=str(model), vocab_only=True, verbose=False)
    ids = llm.tokenize(TEXT.encode(), add_bos=True, special=False)
    return ids[:n]


def run_llama(model: Path, ids_file: str, runs: int, decode: int, threads: int) -> dict:
    out = subprocess.run([sys.executable, "-c", LLAMA_CHILD, str(model), ids_file, str(runs), str(decode), str(threads)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_ferrolm(model: Path, ids_file: str, runs: int, decode: int, threads: int) -> dict:
    # FERROLM_BIN: a private copy (others rebuild target/release/ferrolm on a shared machine).
    binary = Path(os.environ.get("FERROLM_BIN") or ROOT / "target/release/ferrolm")
    env = dict(os.environ, FERROLM_THREADS=str(threads))
    out = subprocess.run([str(binary), "bench", "--model", str(model), "--prompt-ids-file", ids_file,
                          "--runs", str(runs), "--decode-tokens", str(decode), "--device", "cpu", "--json"],
                         check=True, capture_output=True, text=True, env=env)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return {"load_s": r["load_s"], "prefill_runs": r["prefill_runs"], "decode_runs": r["decode_runs"],
            "ttft_runs": [len(json.load(open(ids_file))) / p * 1e3 for p in r["prefill_runs"]],
            "peak_rss_mb": r["peak_rss_mb"]}


def merge(results: list) -> dict:
    m = lambda k: statistics.median([x for r in results for x in r[k]])
    return {"prefill_tps": m("prefill_runs"), "decode_tps": m("decode_runs"), "ttft_ms": m("ttft_runs"),
            "load_s": statistics.median(r["load_s"] for r in results),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in results)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--only", help="run only the rows whose label contains this (prints, does not write results)")
    ap.add_argument("--rows", help="run only the rows whose label contains one of these comma-separated words, "
                    "writing bench/results/cpu_vs_llamacpp-NAME.{md,json} (NAME from --name)")
    ap.add_argument("--name", default="subset")
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    rows = []
    for label, file in ROWS:
        if args.only and args.only not in label:
            continue
        if args.rows and not any(w in label for w in args.rows.split(",")):
            continue
        model = MODELS / file
        if not model.exists():
            print(f"skip {label}: {model} missing", file=sys.stderr)
            continue
        ids = prompt_ids(model, args.prompt)
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(ids, f)
        lc, fe = [], []
        for _ in range(args.rounds):
            lc.append(run_llama(model, f.name, args.runs, args.decode, args.threads))
            fe.append(run_ferrolm(model, f.name, args.runs, args.decode, args.threads))
        row = {"model": label, "prompt_tokens": len(ids), "llama_cpp": merge(lc), "ferrolm": merge(fe)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    write(rows, args, commit, save=not args.only)


def write(rows: list, args, commit: str, save: bool) -> None:
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    head = (f"# ferrolm vs llama.cpp on CPU\n\n{date.today()}, commit {commit}, {cpu}, {args.threads} threads, "
            f"{args.prompt}-token prompt, {args.decode} decode tokens, median of {args.runs} runs x {args.rounds} "
            f"alternating rounds. Ratio = ferrolm / llama.cpp (higher is better for tok/s; lower for TTFT, RSS).\n\n")
    lines = ["| model | prefill tok/s (llama.cpp / ferrolm / ratio) | decode tok/s (llama.cpp / ferrolm / ratio) "
             "| TTFT ms (llama.cpp / ferrolm) | load s | peak RSS MB (llama.cpp / ferrolm) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        a, b = r["llama_cpp"], r["ferrolm"]
        lines.append(
            f"| {r['model']} | {a['prefill_tps']:.0f} / {b['prefill_tps']:.0f} / **{b['prefill_tps'] / a['prefill_tps']:.2f}** "
            f"| {a['decode_tps']:.1f} / {b['decode_tps']:.1f} / **{b['decode_tps'] / a['decode_tps']:.2f}** "
            f"| {a['ttft_ms']:.0f} / {b['ttft_ms']:.0f} | {a['load_s']:.2f} / {b['load_s']:.2f} "
            f"| {a['peak_rss_mb']:.0f} / {b['peak_rss_mb']:.0f} |")
    print(head + "\n".join(lines))
    if save:
        out = ROOT / "bench/results"
        out.mkdir(parents=True, exist_ok=True)
        stem = f"cpu_vs_llamacpp-{args.name}" if args.rows else "cpu_vs_llamacpp"
        (out / f"{stem}.md").write_text(head + "\n".join(lines) + "\n")
        (out / f"{stem}.json").write_text(json.dumps({"commit": commit, "date": str(date.today()), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
