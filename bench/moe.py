#!/usr/bin/env python3
"""Mixture-of-experts speed on the CPU: ferrolm vs llama.cpp on the same GGUF of a random-weight
model in Qwen3-30B-A3B's shape scaled down (every layer sparse, 64 experts, top 8 renormalised,
per-head q/k norms), made by scripts/fixtures/tiny_families.py's builder and llama.cpp's
converter. Prefill tok/s on a 512-token prompt and decode tok/s over 128 tokens, median of RUNS
runs, the engines alternating (bench/cpu_vs_llamacpp.py's runners).

    source <(scripts/oracle-env.sh)
    cargo build --release -p ferrolm-cli && cp target/release/ferrolm /tmp/ferrolm-moe
    FERROLM_BIN=/tmp/ferrolm-moe $ORACLE_PY bench/moe.py [--outtype q8_0] [--runs 3] [--rounds 2]

Writes bench/results/moe.{md,json} (with --save).
"""
import argparse
import json
import os
import sys
import tempfile
from datetime import date
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "scripts/fixtures"), str(ROOT / "bench")]
import tiny_families as tf  # noqa: E402
import cpu_vs_llamacpp as cvl  # noqa: E402

MODELS = Path(os.environ.get("FERROLM_MODELS") or Path.home() / ".cache/ferrolm/models")
SHAPE = dict(vocab_size=tf.VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=4, head_dim=64, moe_intermediate_size=256,
             num_experts=64, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
             max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=1e6,
             tie_word_embeddings=False, bos_token_id=0, eos_token_id=2)


def model(outtype: str) -> Path:
    dir = MODELS / "bench-qwen3moe"
    gguf = dir / f"model-{outtype}.gguf"
    if gguf.exists():
        return gguf
    spec = dict(cls="Qwen3MoeConfig", arch="Qwen3MoeForCausalLM", pre="qwen2", config=SHAPE)
    if not (dir / "config.json").exists():
        tf.build("qwen3moe", spec, dir)
    out = tf.convert(spec, dir, outtype)
    print(f"made {out} ({out.stat().st_size / 2**20:.0f} MiB)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--outtype", default="q8_0", help="GGUF type from the converter: f16, q8_0, bf16")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--save", action="store_true")
    args = ap.parse_args()
    gguf = model(args.outtype)
    ids = np.random.default_rng(0).integers(0, 256, args.prompt).tolist()
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(ids, f)
    lc, fe = [], []
    for _ in range(args.rounds):
        lc.append(cvl.run_llama(gguf, f.name, args.runs, args.decode, args.threads))
        fe.append(cvl.run_ferrolm(gguf, f.name, args.runs, args.decode, args.threads))
    a, b = cvl.merge(lc), cvl.merge(fe)
    row = {"model": f"Qwen3-MoE-shaped random, {args.outtype}", "prompt_tokens": len(ids), "llama_cpp": a, "ferrolm": b,
           "prefill_ratio": b["prefill_tps"] / a["prefill_tps"], "decode_ratio": b["decode_tps"] / a["decode_tps"]}
    print(json.dumps(row))
    line = (f"| {row['model']} | {a['prefill_tps']:.0f} / {b['prefill_tps']:.0f} = **{row['prefill_ratio']:.2f}** "
            f"| {a['decode_tps']:.1f} / {b['decode_tps']:.1f} = **{row['decode_ratio']:.2f}** "
            f"| {a['peak_rss_mb']:.0f} / {b['peak_rss_mb']:.0f} |")
    print(line)
    if args.save:
        head = (f"# MoE on CPU: ferrolm vs llama.cpp\n\n{date.today()}, {args.threads} threads, {len(ids)}-token prompt, "
                f"{args.decode} decode tokens, median of {args.runs} runs x {args.rounds} alternating rounds; shape "
                f"{json.dumps(SHAPE)}.\n\n| model | prefill tok/s (llama.cpp / ferrolm = ratio) "
                f"| decode tok/s (llama.cpp / ferrolm = ratio) | peak RSS MB (llama.cpp / ferrolm) |\n|---|---|---|---|\n")
        (ROOT / "bench/results/moe.md").write_text(head + line + "\n")
        (ROOT / "bench/results/moe.json").write_text(json.dumps(row, indent=1) + "\n")


if __name__ == "__main__":
    main()
