#!/usr/bin/env python3
"""Quality of quantized KV caches, ferrolm beside llama.cpp on the same GGUF and the same text:
perplexity and mean KL divergence of next-token distributions to the float-KV run.

Text: Lewis Carroll's "Alice's Adventures in Wonderland" (Project Gutenberg, public domain) as
shipped in the Brotli 1.1.0 source package on PyPI (tests/testdata/alice29.txt, the Canterbury
corpus file; fetched with `pip download --no-binary :all: --no-deps brotli==1.1.0`).

ferrolm: `ferrolm perplexity` with FERROLM_CPU_EXACT=1 (f32 activations: the default 8-bit
activation rounding turns any small perturbation into ~0.004 KL of noise) against its f32-KV
run, all schemes in one process. llama.cpp: `llama-perplexity -fa on` with f16 KV saving the
base logits, then `-ctk/-ctv q8_0` and `q4_0` with --kl-divergence (its attention rotation on,
as shipped; LLAMA_ATTN_ROT_DISABLE=1 in a second pass when --norot). Both cut the text into
--ctx windows and score the second half of each.

    python bench/kv_quant_ppl.py --model ~/.cache/ferrolm/models/SmolLM2-135M-Instruct.Q4_1.gguf \
        --text /tmp/alice29.txt --chunks 81 --out bench/results/kv_quant_smollm2.json
"""
import argparse
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = os.environ.get("FERROLM_BIN") or str(ROOT / "target/release/ferrolm")
LLAMA_PPL = os.environ.get("LLAMA_PERPLEXITY") or str(
    Path("/work/peers/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-perplexity"))


def ferrolm(args):
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [BIN, "perplexity", "--model", args.model, "--text-file", args.text, "--ctx", str(args.ctx),
               "--chunks", str(args.chunks), "--kv", args.kv, "--json", f.name]
        env = dict(os.environ, FERROLM_CPU_EXACT="1")
        subprocess.run(cmd, check=True, env=env, stderr=subprocess.DEVNULL)
        return json.load(open(f.name))


def llama_run(args, extra, env_extra=None):
    cmd = [LLAMA_PPL, "-m", args.model, "-f", args.text, "-c", str(args.ctx), "--chunks", str(args.chunks),
           "-t", str(args.threads), "-fa", "on", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **(env_extra or {})))
    if out.returncode != 0:
        raise SystemExit(out.stderr[-2000:])
    return out.stdout + out.stderr


def number(pattern, text):
    m = re.search(pattern, text)
    return float(m.group(1)) if m else None


def llama(args):
    base = tempfile.mktemp(suffix=".kld")
    text = llama_run(args, ["--kl-divergence-base", base])
    rows = [{"kv": "f16", "ppl": number(r"Final estimate: PPL = ([0-9.]+)", text), "mean_kl": 0.0}]
    passes = [("", {})] + ([("-norot", {"LLAMA_ATTN_ROT_DISABLE": "1"})] if args.norot else [])
    for suffix, env in passes:
        for t in ["q8_0", "q4_0"]:
            text = llama_run(args, ["-ctk", t, "-ctv", t, "--kl-divergence-base", base, "--kl-divergence"], env)
            rows.append({
                "kv": t + suffix,
                "ppl": number(r"Mean PPL\(Q\)\s*:\s*([0-9.]+)", text),
                "delta_ppl": number(r"Mean PPL\(Q\)-PPL\(base\)\s*:\s*(-?[0-9.]+)", text),
                "mean_kl": number(r"Mean\s+KLD:\s*([0-9.]+)", text),
                "max_kl": number(r"Maximum KLD:\s*([0-9.]+)", text),
                "top1_same": (number(r"Same top p:\s*([0-9.]+)", text) or 0) / 100,
            })
    os.unlink(base)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--text", required=True)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=81)
    ap.add_argument("--kv", default="f32,q8g32,q8g64,q4g32,q4g64,turbo-k8v3")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--norot", action="store_true", help="also llama.cpp without its rotation")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    result = {"ferrolm": ferrolm(args), "llama.cpp": llama(args), "ctx": args.ctx, "chunks": args.chunks}
    Path(args.out).write_text(json.dumps(result, indent=2))
    for row in result["ferrolm"]["schemes"]:
        print(f"ferrolm   {row['kv']:<12} ppl {row['ppl']:.4f} KL {row['mean_kl']:.6f} top1 {100 * row['top1_same']:.2f}% "
              f"{row['bytes_per_token_per_layer']} B/tok/layer")
    for row in result["llama.cpp"]:
        print(f"llama.cpp {row['kv']:<12} ppl {row['ppl']} KL {row['mean_kl']}")


if __name__ == "__main__":
    main()
