"""Batched decode on the GPU (issue 38), run on the GPU machine by scripts/gpu/batch_bench.sh.
usage: python scripts/gpu/batch_bench.py BIN_DIR MODELS_DIR OUT_DIR SHAPE [BATCH ...]
For each batch size N: ferrolm's aggregate decode tok/s (`ferrolm bench --concurrency N`, N
sequences of 512-token prompts, 128 greedy tokens each, through the engine step), the batched
roofline (bytes one step reads: the weights once plus every sequence's K/V, over the measured
device copy bandwidth) and transformers `generate` on the same weights at the same batch size
(bf16, eager, greedy). With N > 1 ferrolm runs twice in the same call: batched decode steps
replayed as captured graphs (the default) and eager (FERROLM_BATCH_GRAPHS=0), for the A/B.
Appends rows to OUT_DIR/batch_bench.json and prints a markdown table."""
import json, os, subprocess, sys, time
import torch, transformers
from common import d2d_bandwidth

BIN, MODELS, OUT, SHAPE = sys.argv[1:5]
BATCHES = [int(b) for b in sys.argv[5:]] or [1, 8, 32, 128]
PROMPT, DECODE = 512, 128
path = f"{MODELS}/{SHAPE}"
results_file = f"{OUT}/batch_bench.json"
results = json.load(open(results_file)) if os.path.exists(results_file) else {}


def log(*a):
    print(*a, flush=True)


def config():
    c = json.load(open(f"{path}/config.json"))
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return c, head_dim


def weight_bytes():
    return sum(os.path.getsize(f"{path}/{f}") for f in os.listdir(path) if f.endswith(".safetensors"))


def kv_bytes_per_token():
    c, d = config()
    return 2 * 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * d


def ferrolm(n, graphs=True):
    cmd = [f"{BIN}/ferrolm", "bench", "--model", path, "--device", "cuda", "--prompt-tokens", str(PROMPT),
           "--decode-tokens", str(DECODE), "--runs", "2" if n == 1 else "1", "--json"]
    if n > 1:
        cmd += ["--concurrency", str(n), "--max-batch-tokens", "4096"]
    env = dict(os.environ, FERROLM_BATCH_GRAPHS="1" if graphs else "0")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=500, env=env)
    if p.returncode != 0:
        log(f"ferrolm N={n} failed: {p.stderr[-1500:]}")
        return None
    return json.loads(p.stdout.strip().splitlines()[-1])


def hf(n):
    m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    g = torch.Generator("cuda").manual_seed(0)
    ids = torch.randint(3, 49152, (n, PROMPT), device="cuda", generator=g)
    mask = torch.ones_like(ids)
    out = {}
    with torch.no_grad():
        for r in range(2):
            torch.cuda.synchronize(); t = time.perf_counter()
            m(ids, attention_mask=mask)
            torch.cuda.synchronize(); tp = time.perf_counter() - t
            t = time.perf_counter()
            m.generate(ids, attention_mask=mask, max_new_tokens=DECODE, min_new_tokens=DECODE, do_sample=False, pad_token_id=0)
            torch.cuda.synchronize(); tg = time.perf_counter() - t
            out = {"decode_tps": n * DECODE / max(tg - tp, 1e-9), "prefill_tps": n * PROMPT / tp}
    del m; torch.cuda.empty_cache()
    return out


bw = results.get("copy_bytes_per_s") or d2d_bandwidth()
results["copy_bytes_per_s"] = bw
wb, kvt = weight_bytes(), kv_bytes_per_token()
rows = results.setdefault(SHAPE, {})
for n in BATCHES:
    f = ferrolm(n)
    e = ferrolm(n, graphs=False) if n > 1 else None
    h = hf(n) if os.environ.get("NO_HF") != "1" else None
    # Mean context over the decode: the prompt plus half the new tokens.
    step_bytes = wb + n * kvt * (PROMPT + DECODE // 2)
    roof = n * bw / step_bytes
    rows[str(n)] = {"ferrolm": f, "ferrolm_eager": e, "transformers": h, "roofline_tps": roof, "step_bytes": step_bytes}
    json.dump(results, open(results_file, "w"), indent=1)
    fd = f["decode_tps"] if f else float("nan")
    hd = h["decode_tps"] if h else float("nan")
    ed = e["decode_tps"] if e else float("nan")
    log(f"{SHAPE} N={n}: ferrolm {fd:.0f} tok/s (eager steps {ed:.0f}), roofline {roof:.0f} ({fd / roof:.1%}), transformers {hd:.0f} ({fd / hd:.2f}x)")

log(f"\n| shape | N | ferrolm decode tok/s (graphs) | eager steps | graphs / eager | batched roofline | share | transformers | ratio |")
log("|---|---|---|---|---|---|---|---|---|")
for n in BATCHES:
    r = rows[str(n)]
    fd = r["ferrolm"]["decode_tps"] if r["ferrolm"] else float("nan")
    hd = r["transformers"]["decode_tps"] if r["transformers"] else float("nan")
    ed = r["ferrolm_eager"]["decode_tps"] if r.get("ferrolm_eager") else float("nan")
    log(f"| {SHAPE} | {n} | {fd:,.0f} | {ed:,.0f} | {fd / ed:.2f}x | {r['roofline_tps']:,.0f} | {fd / r['roofline_tps']:.1%} | {hd:,.0f} | {fd / hd:.2f}x |")
