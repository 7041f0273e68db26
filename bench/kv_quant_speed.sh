#!/usr/bin/env bash
# Decode and prefill tok/s with f16, 8-bit, 4-bit and TurboQuant KV (docs/kv_quant.md):
# `ferrolm bench` at $CTXS prompt tokens (default 512 4096 16384), one line of JSON per run into
# $OUT (default bench/results/kv_quant_speed.jsonl). Schemes alternate inside each (model,
# context, round), and so do the binaries of $FERROLM_BINS (several builds to compare, e.g. the
# commits before and after a kernel change; each line records its `bin`), so that a busy
# machine's load spreads over all of them; $ROUNDS rounds (default 2). Each line also records
# the 1-minute load average when the run ended.
#   FERROLM_BINS="/tmp/ferrolm-new /tmp/ferrolm-old" bench/kv_quant_speed.sh [model.gguf ...]
set -euo pipefail
BINS=(${FERROLM_BINS:-${FERROLM_BIN:-target/release/ferrolm}})
OUT=${OUT:-bench/results/kv_quant_speed.jsonl}
MODELS=("$@")
[ ${#MODELS[@]} -eq 0 ] && MODELS=(~/.cache/ferrolm/models/SmolLM2-135M-Instruct.Q4_1.gguf ~/.cache/ferrolm/models/qwen2.5-coder-0.5b-instruct-Q4_K_M.gguf)
: > "$OUT"
for m in "${MODELS[@]}"; do
  for ctx in ${CTXS:-512 4096 16384}; do
    for round in $(seq 1 "${ROUNDS:-2}"); do
      for bin in "${BINS[@]}"; do
        for kv in "--kv-bits 16" "--kv-bits 8" "--kv-bits 4" "--kv-quant turbo"; do
          # shellcheck disable=SC2086  # $kv is two words on purpose
          "$bin" bench --model "$m" --device cpu --prompt-tokens $ctx --decode-tokens 32 --runs 1 $kv --json \
            | python3 -c "import json,sys; d=json.load(sys.stdin); d.pop('decoded_ids',None); d['round']=$round; d['bin']='$bin'; d['load']=open('/proc/loadavg').read().split()[0]; print(json.dumps(d))" >> "$OUT"
        done
      done
    done
  done
done
python3 - "$OUT" <<'PY'
import json, sys, collections
best = collections.defaultdict(lambda: {"prefill_tps": 0, "decode_tps": 0})
for line in open(sys.argv[1]):
    d = json.loads(line)
    key = (d.get("bin", ""), d["model"].split("/")[-1], d["prompt_tokens"], d["kv"], d["kv_bytes_per_token"])
    for f in ("prefill_tps", "decode_tps"):
        best[key][f] = max(best[key][f], d[f])
for (binary, model, ctx, kv, bpt), v in sorted(best.items()):
    print(f"{binary:<24} {model:<40} ctx {ctx:>5} {kv:<16} {bpt:>6} B/tok  prefill {v['prefill_tps']:7.1f} tok/s  decode {v['decode_tps']:6.1f} tok/s")
PY
