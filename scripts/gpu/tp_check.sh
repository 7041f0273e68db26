#!/usr/bin/env bash
# Tensor parallelism over NCCL on a machine with several GPUs (issue 8): the sharded model's
# logits against the unsplit model's on one GPU (TP = 2, 4 where present), and decode / prefill
# tok/s at TP = 1, 2, 4 with the scaling (scripts/gpu/tp_check.py says how). Needs the binary
# built with NCCL=1 (`NCCL=1 bash scripts/gpu/build.sh`); NVLink multicast stays off (env.sh).
#   run(command="bash scripts/gpu/tp_check.sh [MODEL]", carry=["gpu-carry"], kind="nvidia-h100-x4")
# Results: $OUT/tp_results.json and the printed lines.
set -uo pipefail
m=${1:-llama-3.1-8b}
source "$(dirname "$0")/env.sh"
echo "libnccl: $nccl_lib; NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE"
unpack_ferrolm ferrolm-nccl
ldd "$W/bin/ferrolm-nccl" | grep -q libnccl || { echo "gpu-carry/ferrolm.xz was not built with NCCL=1"; exit 1; }
[ -d "$W/models/$m" ] || python scripts/gpu/make_models.py "$W/models" gpu-carry/tokenizer "$m" 2>&1 | grep made
python scripts/gpu/tp_check.py "$W/bin" "$W/models/$m" "$OUT"
