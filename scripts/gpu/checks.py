"""GPU checks and benchmarks, run on the GPU machine by scripts/gpu/run_checks.sh.
usage: python scripts/gpu/checks.py BIN_DIR MODELS_DIR OUT_DIR [STEP ...]
STEPs: bandwidth, logits, bench (default: all). Prints a markdown table and writes
OUT_DIR/results.json. Every figure comes from this one run on this one machine."""
import json, os, subprocess, sys, time
import numpy as np, torch, transformers
from common import d2d_bandwidth

BIN, MODELS, OUT = sys.argv[1], sys.argv[2], sys.argv[3]
STEPS = sys.argv[4:] or ["bandwidth", "logits", "bench"]
SHAPES = ["smollm2-135m", "llama-3.2-1b", "llama-3.1-8b"]
results = {}
if os.path.exists(f"{OUT}/results.json"):
    results = json.load(open(f"{OUT}/results.json"))


def save():
    json.dump(results, open(f"{OUT}/results.json", "w"), indent=1)


def log(*a):
    print(*a, flush=True)


def hf_logits(path, ids, dtype, start):
    m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
    with torch.no_grad():
        out = m(torch.tensor([ids], device="cuda")).logits[0, start:].float().cpu().numpy()
    del m; torch.cuda.empty_cache()
    return out


def ferrolm_logits(path, ids, device, start, vocab):
    f = f"/tmp/logits-{os.path.basename(path)}-{device.replace(':', '')}.bin"
    subprocess.run([f"{BIN}/ferrolm", "dump-logits", "--model", path, "--ids", json.dumps(ids), "--out", f,
                    "--device", device, "--from", str(start)], check=True, timeout=600)
    return np.fromfile(f, dtype="<f4").reshape(-1, vocab)


def compare(got, want):
    d = np.abs(got - want)
    return {"max_abs": float(d.max()), "rel": float(d.max() / np.abs(want).max()),
            "top1_agree": float((got.argmax(-1) == want.argmax(-1)).mean())}


def logits_checks():
    """Teacher-forced: 96 ids, the first 48 through one prefill, then 48 single-token decode steps.
    transformers f32 is the reference; transformers bf16 is the yardstick for bf16 rounding:
    ferrolm (bf16) passes when its error is within 2x the yardstick's (+1e-3 relative).
    ferrolm CPU (f32 math on the bf16 weights) must match transformers f32 within 1e-3 relative."""
    rng = np.random.default_rng(0)
    ids = [1] + rng.integers(3, 49152, 95).tolist()
    start = 48
    for name in ["smollm2-135m", "llama-3.2-1b"]:
        path = f"{MODELS}/{name}"
        vocab = json.load(open(f"{path}/config.json"))["vocab_size"]
        ref = hf_logits(path, ids, torch.float32, start)
        yard = compare(hf_logits(path, ids, torch.bfloat16, start), ref)
        gpu = compare(ferrolm_logits(path, ids, "cuda", start, vocab), ref)
        r = {"transformers_bf16": yard, "ferrolm_cuda": gpu,
             "cuda_ok": gpu["rel"] <= 2 * yard["rel"] + 1e-3}
        cpu = compare(ferrolm_logits(path, ids, "cpu", start, vocab), ref)
        r["ferrolm_cpu"] = cpu
        r["cpu_ok"] = cpu["rel"] <= 1e-3
        os.environ["FERROLM_CUDA_KERNELS"] = "0"  # candle's ops only: tells kernels from the rest
        r["ferrolm_cuda_candle_ops"] = compare(ferrolm_logits(path, ids, "cuda", start, vocab), ref)
        del os.environ["FERROLM_CUDA_KERNELS"]
        results.setdefault("logits", {})[name] = r
        save()
        log(f"logits {name}: {json.dumps(r)}")


def ferrolm_bench(name, prompt, decode, runs, variant="graph"):
    """variant: graph (the default decode: captured static step), eager-static
    (FERROLM_CUDA_GRAPH=0: the same step, not captured) or regular (--no-static)."""
    cmd = [f"{BIN}/ferrolm", "bench", "--model", f"{MODELS}/{name}", "--device", "cuda",
           "--prompt-tokens", str(prompt), "--decode-tokens", str(decode), "--runs", str(runs), "--json"]
    env = dict(os.environ)
    if variant == "eager-static":
        env["FERROLM_CUDA_GRAPH"] = "0"
    if variant == "graph-smem":
        env["FERROLM_CUDA_GEMV"] = "smem"
    if variant == "graph-cublas":
        env["FERROLM_CUDA_GEMV"] = "0"
    if variant == "regular":
        cmd.append("--no-static")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    if p.stderr.strip():
        open(f"{OUT}/bench-{name}-{variant}.log", "w").write(p.stderr)
    if p.returncode != 0:
        log(f"ferrolm bench {name} failed: {p.stderr[-2000:]}")
        return None
    return json.loads(p.stdout.strip().splitlines()[-1])


def hf_bench(name, prompt, decode, runs):
    """transformers 5 eager, bf16: prefill = one forward over the prompt; decode = (generate of
    `decode` tokens - prefill) per token. Medians of `runs` after a warm-up."""
    m = transformers.AutoModelForCausalLM.from_pretrained(f"{MODELS}/{name}", dtype=torch.bfloat16).cuda().eval()
    ids = torch.randint(3, 49152, (1, prompt), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    pre, dec = [], []
    with torch.no_grad():
        for r in range(runs + 1):
            torch.cuda.synchronize(); t = time.perf_counter()
            m(ids)
            torch.cuda.synchronize(); tp = time.perf_counter() - t
            t = time.perf_counter()
            m.generate(ids, max_new_tokens=decode, min_new_tokens=decode, do_sample=False, pad_token_id=0)
            torch.cuda.synchronize(); tg = time.perf_counter() - t
            if r:
                pre.append(prompt / tp); dec.append(decode / max(tg - tp, 1e-9))
    del m; torch.cuda.empty_cache()
    return {"prefill_tps": float(np.median(pre)), "decode_tps": float(np.median(dec))}


def kv_bytes(name, context):
    """Bytes of bf16 K and V a decode step reads at `context` cached tokens (all layers)."""
    c = json.load(open(f"{MODELS}/{name}/config.json"))
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * context


PROMPT, DECODE = 2048, 128  # the benchmark's prompt and decoded tokens


def benches():
    bw = results.get("d2d_bytes_per_s")
    for name in SHAPES:
        if not os.path.isdir(f"{MODELS}/{name}"):
            continue
        quick = os.environ.get("QUICK") == "1"  # a short run: no transformers, no regular path
        f = ferrolm_bench(name, PROMPT, DECODE, 3)
        # The same decode after a 16-token prompt: the step then reads the weights and hardly any
        # K/V (after the 2,048-token prompt it also reads the cache, which the roofline leaves out).
        short = ferrolm_bench(name, 16, DECODE, 3)
        eager = None if quick else ferrolm_bench(name, PROMPT, DECODE, 1, "eager-static")
        regular = None if quick else ferrolm_bench(name, PROMPT, DECODE, 1, "regular")
        h = {"prefill_tps": float("nan"), "decode_tps": float("nan")} if quick else hf_bench(name, PROMPT, DECODE, 2)
        row = {"ferrolm": f, "short_prompt": short, "kv_bytes": kv_bytes(name, PROMPT + DECODE // 2), "eager_static": eager, "regular": regular, "transformers": h}
        for v in ("graph-smem", "graph-cublas"):  # A/B of the matrix-vector kernel
            r = ferrolm_bench(name, PROMPT, DECODE, 1, v)
            row[v] = {"decode_tps": r["decode_tps"], "prefill_tps": r["prefill_tps"], "same_ids": r["decoded_ids"] == f["decoded_ids"]} if r and f else None
        if f and eager:
            # The captured step must replay exactly what the eager step computes.
            row["graph_equals_eager"] = f["decoded_ids"] == eager["decoded_ids"]
        if f and regular:
            n = next((i for i, (a, b) in enumerate(zip(f["decoded_ids"], regular["decoded_ids"])) if a != b), len(f["decoded_ids"]))
            row["graph_equals_regular_tokens"] = n
        if f and bw:
            row["roofline_tps"] = bw / f["weight_bytes"]
        results.setdefault("bench", {})[name] = row
        save()
        log(f"bench {name}: done")


def table():
    lines = ["| shape | weight GB | roofline tok/s | ferrolm decode | % roofline | % of weights + K/V | decode, 16-token prompt | its % roofline | transformers decode | ferrolm ÷ tf decode | ferrolm prefill (2048) | transformers prefill | eager-static decode | regular decode | graph = eager |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, row in results.get("bench", {}).items():
        f, h = row["ferrolm"] or {}, row["transformers"]
        roof = row.get("roofline_tps", float("nan"))
        fd = f.get("decode_tps", float("nan"))
        sd = (row.get("short_prompt") or {}).get("decode_tps", float("nan"))
        # The step's own bytes at the mean context of the decoded tokens: weights and K/V.
        kv_share = fd * (f.get("weight_bytes", 0) + row.get("kv_bytes", 0)) / results.get("d2d_bytes_per_s", float("nan"))
        lines.append(f"| {name} | {f.get('weight_bytes', 0) / 1e9:.2f} | {roof:.0f} | {fd:.1f} | {100 * fd / roof:.1f}% | {100 * kv_share:.1f}% | {sd:.1f} | {100 * sd / roof:.1f}% | "
                     f"{h['decode_tps']:.1f} | {fd / h['decode_tps']:.2f} | {f.get('prefill_tps', float('nan')):.0f} | {h['prefill_tps']:.0f} | "
                     f"{(row.get('eager_static') or {}).get('decode_tps', float('nan')):.1f} | {(row.get('regular') or {}).get('decode_tps', float('nan')):.1f} | "
                     f"{row.get('graph_equals_eager')} |")
    for name, r in results.get("logits", {}).items():
        lines.append(f"logits {name}: " + ", ".join(f"{k} rel {v['rel']:.4f} top1 {v['top1_agree']:.2f}" if isinstance(v, dict) else f"{k} {v}" for k, v in r.items()))
    for name, row in results.get("bench", {}).items():
        lines.append(f"{name}: path {(row['ferrolm'] or {}).get('decode_path')}, graph = eager {row.get('graph_equals_eager')}, "
                     f"graph = regular for the first {row.get('graph_equals_regular_tokens')} tokens; "
                     f"gemv smem {row.get('graph-smem')}; cuBLAS {row.get('graph-cublas')}")
    text = "\n".join(lines)
    open(f"{OUT}/table.md", "w").write(text + "\n")
    log(text)


if "bandwidth" in STEPS:
    results["d2d_bytes_per_s"] = d2d_bandwidth()
    save()
    log(f"d2d copy bandwidth {results['d2d_bytes_per_s'] / 1e9:.0f} GB/s")
if "logits" in STEPS:
    logits_checks()
if "bench" in STEPS:
    benches()
table()
