#!/usr/bin/env bash
# The NCCL reducer on the GPU machine, where only one GPU is lent: loads a model through the
# tensor-parallel path at world 1 (FERROLM_TENSOR_PARALLEL_LOADER=1), so NCCL starts, and every
# block's reduce runs through ncclGroupStart/ncclReduce/ncclGroupEnd; greedy tokens must equal the
# unsplit model's. Needs gpu-carry/ferrolm.xz built with `NCCL=1 bash scripts/gpu/build.sh` and
# the models of make_models.py. libnccl comes from PyTorch's wheels on the GPU machine.
#   run(command="bash scripts/gpu/nccl_check.sh MODEL", carry=["gpu-carry"])
set -uo pipefail
m=${1:-llama-3.2-1b}
source "$(dirname "$0")/env.sh"
echo "libnccl: $nccl_lib"
unpack_ferrolm ferrolm-nccl
[ -d "$W/models/$m" ] || python scripts/gpu/make_models.py "$W/models" gpu-carry/tokenizer "$m" 2>&1 | grep made
args=(bench --model "$W/models/$m" --device cuda --prompt-tokens 512 --decode-tokens 32 --runs 1 --json)
ids() { grep -o '"decoded_ids":\[[0-9,]*\]'; }
one=$("$W/bin/ferrolm-nccl" "${args[@]}" --no-static | ids)
tp=$(FERROLM_TENSOR_PARALLEL_LOADER=1 NCCL_DEBUG=WARN "$W/bin/ferrolm-nccl" "${args[@]}" --tensor-parallel 1 2> "$W/nccl.log" | ids)
grep -i "nccl" "$W/nccl.log" | head -5
echo "unsplit: $one"
echo "tp+nccl: $tp"
[ -n "$tp" ] && [ "$one" = "$tp" ] && echo "nccl world 1: same tokens" || echo "nccl world 1: DIFFERENT or failed"
