#!/usr/bin/env bash
# Runs on the GPU machine through the device tool, from the repo root, after scripts/gpu/build.sh
# filled gpu-carry/ here:
#   run(command="bash scripts/gpu/run_checks.sh [STEP ...]", carry=["gpu-carry"])
# Unpacks the binary, runs ferrolm's CUDA kernel self-checks, makes the random-weight models with
# transformers, then scripts/gpu/checks.py (bandwidth, logits vs transformers, benchmarks).
# Logs and results.json land in $OUT.
set -uo pipefail
source "$(dirname "$0")/env.sh"
export NCCL_NVLS_ENABLE=0
unpack_ferrolm
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
git log -1 --format='%H %cd' 2>/dev/null | tee -a "$OUT/device.txt" || true
echo "== kernel self-checks"
"$W/bin/ferrolm" gpu-check > "$OUT/gpu-check.txt" 2>&1; grep -v "^ok" "$OUT/gpu-check.txt"
FERROLM_CUDA_GEMV=smem "$W/bin/ferrolm" gpu-check 2>&1 | grep -E "gemv|checks" | grep -v "^ok" | sed 's/^/smem: /'
FERROLM_CUDA_SOFTMAX=0 "$W/bin/ferrolm" gpu-check 2>&1 | grep -E "prefill|checks" | sed 's/^/candle softmax: /'
echo "== models"
python scripts/gpu/make_models.py "$W/models" gpu-carry/tokenizer ${MODELS:-} 2>&1 | tail -5
echo "== checks and benchmarks"
python scripts/gpu/checks.py "$W/bin" "$W/models" "$OUT" "$@" > "$OUT/checks.log" 2>&1
grep -v "Loading weights\|^bench .*: done" "$OUT/checks.log" | tail -20
if [ "${PROFILE:-1}" = 1 ]; then
  echo "== kernel profile"
  bash scripts/gpu/profile.sh --no-make ${PROFILE_MODELS:-smollm2-135m llama-3.1-8b} 2>&1 | tail -42
fi
