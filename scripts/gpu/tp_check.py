"""Tensor parallelism on a machine with several GPUs (issue 8), run by scripts/gpu/tp_check.sh.
usage: python scripts/gpu/tp_check.py BIN MODEL_DIR OUT
For TP = 2, 4, ... up to the GPUs present: ferrolm's teacher-forced logits of the sharded model
(96 ids: 48 through one prefill, then 48 single-token decode steps, as checks.py) against the
unsplit model on one GPU, and batch-1 decode / prefill tok/s (2,048-token prompt, 128 tokens)
at TP = 1, 2, 4 with the scaling against TP = 1.
Tolerance: the sharded logits pass when their max |difference| from the unsplit ones, relative
to the largest logit, is within 2x transformers' own bf16 error (its bf16 against its f32
logits on the same weights and ids) + 1e-3: sharding only reorders bf16 sums and rounds the
partial products once more before the all-reduce."""
import json, os, subprocess, sys
import numpy as np, torch, transformers

BIN, MODEL, OUT = sys.argv[1:4]
gpus = torch.cuda.device_count()
vocab = json.load(open(f"{MODEL}/config.json"))["vocab_size"]
ids = [1] + np.random.default_rng(0).integers(3, 49152, 95).tolist()
START = 48
results = {"gpus": gpus, "model": os.path.basename(MODEL)}


def save():
    json.dump(results, open(f"{OUT}/tp_results.json", "w"), indent=1)


def ferrolm_logits(tp):
    f = f"/tmp/tp-logits-{tp}.bin"
    subprocess.run([f"{BIN}/ferrolm-nccl", "dump-logits", "--model", MODEL, "--ids", json.dumps(ids), "--out", f,
                    "--device", "cuda", "--from", str(START), "--tensor-parallel", str(tp)], check=True, timeout=900)
    return np.fromfile(f, dtype="<f4").reshape(-1, vocab)


def hf_logits(dtype):
    m = transformers.AutoModelForCausalLM.from_pretrained(MODEL, dtype=dtype).cuda().eval()
    with torch.no_grad():
        out = m(torch.tensor([ids], device="cuda")).logits[0, START:].float().cpu().numpy()
    del m
    torch.cuda.empty_cache()
    return out


def rel(got, want):
    return float(np.abs(got - want).max() / np.abs(want).max())


def bench(tp):
    r = subprocess.run([f"{BIN}/ferrolm-nccl", "bench", "--model", MODEL, "--device", "cuda", "--prompt-tokens", "2048",
                        "--decode-tokens", "128", "--runs", "3", "--json", "--tensor-parallel", str(tp)],
                       capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        return {"error": r.stderr[-2000:]}
    j = json.loads(r.stdout.strip().splitlines()[-1])
    return {k: j[k] for k in ("decode_tps", "prefill_tps", "decode_path", "decoded_ids")}


ranks = [tp for tp in (2, 4, 8) if tp <= gpus]
print(f"{gpus} GPUs: {torch.cuda.get_device_name(0)}; TP sizes {ranks}", flush=True)
yard = rel(hf_logits(torch.bfloat16), hf_logits(torch.float32))
one = ferrolm_logits(1)
results["transformers_bf16_rel"] = yard
for tp in ranks:
    got = ferrolm_logits(tp)
    r = {"rel": rel(got, one), "top1_agree": float((got.argmax(-1) == one.argmax(-1)).mean())}
    r["ok"] = r["rel"] <= 2 * yard + 1e-3
    results.setdefault("logits", {})[tp] = r
    save()
    print(f"logits TP={tp} vs 1 GPU: rel {r['rel']:.4f} (bound {2 * yard + 1e-3:.4f}), top-1 agree {r['top1_agree']:.2f}: "
          f"{'ok' if r['ok'] else 'FAILED'}", flush=True)
base = None
for tp in [1] + ranks:
    b = bench(tp)
    results.setdefault("bench", {})[tp] = b
    save()
    if "error" in b:
        print(f"bench TP={tp}: FAILED {b['error']}", flush=True)
        continue
    base = base or b
    print(f"bench TP={tp}: decode {b['decode_tps']:.1f} tok/s (x{b['decode_tps'] / base['decode_tps']:.2f}, path "
          f"{b['decode_path']}), prefill {b['prefill_tps']:.0f} tok/s (x{b['prefill_tps'] / base['prefill_tps']:.2f}), "
          f"same greedy tokens as TP=1: {b['decoded_ids'] == base['decoded_ids']}", flush=True)
