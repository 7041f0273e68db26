#!/usr/bin/env python3
"""Speculative decoding over HTTP, one machine, one run: decode tok/s of plain decoding against
prompt lookup (n-gram drafts) and, with --draft-model, a draft model, for ferrolm and for
llama.cpp's llama-server on the same GGUFs, on

(a) a code edit: the model rewrites a ~200-line Python file given in the prompt with one
    change (most of the answer repeats the prompt: where prompt lookup guesses well), and
(b) open-ended chat (little to look up: speculation must not cost much).

Greedy; each system's answer with speculation must equal its answer without (ferrolm's does by
construction). Decode tok/s = answer tokens after the first / time from the first to the last.

    python bench/speculation.py [--model PATH] [--draft-model PATH] [--llama-server PATH]
                                [--name speculation] [--out bench/results]

e.g. the default model with Qwen2.5-Coder-0.5B drafting for it:
    python bench/speculation.py --model ~/.cache/ferrolm/models/qwen2.5-coder-1.5b-instruct.gguf \
        --draft-model ~/.cache/ferrolm/models/qwen2.5-coder-0.5b-instruct-Q4_K_M.gguf --llama-server PATH
"""
import argparse
import json
import os
import socket
import subprocess
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
MODELS = Path(os.environ.get("FERROLM_MODELS") or Path.home() / ".cache/ferrolm/models")
BIN = os.environ.get("FERROLM_BIN") or str(ROOT / "target/release/ferrolm")


def source_file():
    """A plain ~200-line Python module (the file the model is asked to edit)."""
    out = ["\"\"\"Inventory helpers.\"\"\"", "", "import math", ""]
    for i in range(16):
        out += [f"def item_{i}_total(prices, quantity):",
                f"    \"\"\"Total of item {i}: the sum of its prices times the quantity.\"\"\"",
                "    subtotal = 0.0",
                "    for price in prices:",
                "        subtotal += price",
                f"    discount = {i + 1} / 100",
                "    total = subtotal * quantity * (1 - discount)",
                "    return math.floor(total * 100) / 100",
                "", ""]
    return "\n".join(out) + "\n"


WORKLOADS = {
    "code edit": ([{"role": "user", "content": "Here is a Python file:\n\n```python\n" + source_file() + "```\n\n"
                    "Rewrite the whole file with the function `item_3_total` renamed to `item_three_total`. "
                    "Output the complete file, every function, and nothing else."}], 1500),
    "chat": ([{"role": "user", "content": "Write a short essay about the history of bridges."}], 256),
}


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


def decode(url, messages, max_tokens):
    """Streams one greedy answer: (decode tok/s, answer text, usage)."""
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    times, text, usage = [], "", None
    with httpx.Client(timeout=1200) as h, h.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ch = json.loads(line[6:])
            usage = ch.get("usage") or usage
            if ch.get("choices") and ch["choices"][0]["delta"].get("content"):
                times.append(time.perf_counter())
                text += ch["choices"][0]["delta"]["content"]
    n = (usage or {}).get("completion_tokens", len(times))
    return (n - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0, text, usage


def private_copy(path):
    """A copy of the binary that a concurrent build cannot replace halfway through the run."""
    import shutil, tempfile
    dst = Path(tempfile.mkdtemp()) / "ferrolm"
    shutil.copy2(path, dst)
    return str(dst)


def systems_for(a):
    """Each system's server command for a port: ferrolm and llama-server, plain and speculating."""
    fl = lambda p: [BIN, "serve", "--model", a.model, "--port", str(p)]
    systems = {
        "ferrolm": fl,
        "ferrolm ngram": lambda p: fl(p) + ["--draft-kind", "ngram", "--num-draft-tokens", str(a.drafts)],
    }
    if a.draft_model:
        systems["ferrolm draft"] = lambda p: fl(p) + ["--draft-model", a.draft_model, "--num-draft-tokens", str(a.draft_tokens)]
    if a.llama_server:
        base = lambda p: [a.llama_server, "-m", a.model, "-t", "2", "-c", "8192", "--port", str(p), "--host", "127.0.0.1"]
        systems["llama-server"] = base
        systems["llama-server ngram"] = lambda p: base(p) + ["--spec-type", "ngram-simple", "--spec-draft-n-max", str(a.drafts)]
        if a.draft_model:
            systems["llama-server draft"] = lambda p: base(p) + ["-md", a.draft_model, "--spec-type", "draft-simple",
                                                                 "--spec-draft-n-max", str(a.draft_tokens)]
    return systems


def main():
    global BIN
    BIN = private_copy(BIN)
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(MODELS / "qwen2.5-coder-0.5b-instruct-Q4_K_M.gguf"))
    ap.add_argument("--draft-model", help="a GGUF of the model's tokenizer that drafts for it (both servers)")
    ap.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"))
    ap.add_argument("--drafts", type=int, default=8, help="prompt lookup's drafts per step at most")
    ap.add_argument("--draft-tokens", type=int, default=8, help="the draft model's drafts per step at most")
    ap.add_argument("--only", help="comma-separated systems to run (the others are left out)")
    ap.add_argument("--workloads", help="comma-separated workloads to run (default: all: " + ", ".join(WORKLOADS) + ")")
    ap.add_argument("--name", default="speculation", help="results file name (NAME.md, NAME.json)")
    ap.add_argument("--out", default=str(ROOT / "bench/results"))
    a = ap.parse_args()
    systems = systems_for(a)
    if a.only:
        systems = {k: v for k, v in systems.items() if k in a.only.split(",")}
    rows = []
    for name, cmd in systems.items():
        proc, url = start(cmd)
        try:
            for wl, (messages, max_tokens) in WORKLOADS.items():
                if a.workloads and wl not in a.workloads.split(","):
                    continue
                decode(url, [{"role": "user", "content": "Hi"}], 4)  # warm-up
                tps, text, usage = decode(url, messages, max_tokens)
                rows.append({"system": name, "workload": wl, "decode_tps": tps, "text": text, "usage": usage})
                spec = (usage or {}).get("speculation")
                print(f"{name:18s} {wl:10s} {tps:6.1f} tok/s {usage.get('completion_tokens') if usage else '?'} tokens {spec or ''}", flush=True)
        finally:
            proc.terminate()
            proc.wait(30)
    write(rows, a, Path(a.out))


def load_average():
    try:
        return open("/proc/loadavg").read().split()[0]
    except OSError:
        return "?"


def write(rows, a, out):
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": Path(a.model).name, "drafts": a.drafts,
            "draft_model": a.draft_model and Path(a.draft_model).name, "draft_tokens": a.draft_tokens,
            "load_average_1min_at_end": load_average(), "cpus": os.cpu_count(),
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    by = {(r["system"], r["workload"]): r for r in rows}
    lines = [f"# Speculative decoding over HTTP ({meta['date']}, commit {meta['commit']})", "",
             f"`python bench/speculation.py`: {meta['model']}, greedy; prompt lookup up to {a.drafts} drafts per step"
             + (f", draft model {meta['draft_model']} up to {a.draft_tokens}" if a.draft_model else "") + ". "
             "Decode tok/s; × plain = the same system without speculation; same answer = the text equals that system's plain answer. "
             f"{meta['cpus']} CPUs, 1-minute load average {meta['load_average_1min_at_end']} at the end "
             "(the systems run one after another: compare ratios, not absolute rates, when it is above the CPU count).", "",
             "| workload | system | decode tok/s | × plain | same answer | drafted / accepted |", "|---|---|---|---|---|---|"]
    for r in rows:
        plain = by.get((r["system"].split(" ")[0], r["workload"]))
        ratio = r["decode_tps"] / plain["decode_tps"] if plain and plain["decode_tps"] else 0
        spec = (r["usage"] or {}).get("speculation") or {}
        lines.append(f"| {r['workload']} | {r['system']} | {r['decode_tps']:.1f} | {ratio:.2f} | "
                     f"{'yes' if plain and plain['text'] == r['text'] else 'NO'} | {spec.get('drafted', '—')} / {spec.get('accepted', '—')} |")
    (out / f"{a.name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
