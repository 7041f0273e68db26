#!/usr/bin/env bash
# Prefill attention on the GPU machine (~3 minutes): the kernel self-checks (prefill lines),
# ferrolm CUDA's logits against transformers f32 (scripts/gpu/checks.py logits: a 48-token prefill
# then 48 decode steps, teacher-forced), and prefill/decode tok/s with the flash prefill kernel
# beside the masked-softmax composition (FERROLM_CUDA_FLASH=0) on the 1B and 8B shapes.
#   run(command="bash scripts/gpu/prefill_check.sh", carry=["gpu-carry"])
set -uo pipefail
source "$(dirname "$0")/env.sh"
unpack_ferrolm
"$W/bin/ferrolm" gpu-check 2>&1 | grep -E "prefill|checks|FAIL"
python scripts/gpu/make_models.py "$W/models" gpu-carry/tokenizer smollm2-135m llama-3.2-1b llama-3.1-8b 2>&1 | grep made
python scripts/gpu/checks.py "$W/bin" "$W/models" "$OUT" logits 2>&1 | grep "^logits\|Error" | cut -c1-600
field() { grep -o "\"$1\":[^,]*" | head -1; }
for m in llama-3.2-1b llama-3.1-8b; do
  for flash in 1 0 1 0; do
    r=$(FERROLM_CUDA_FLASH=$flash "$W/bin/ferrolm" bench --model "$W/models/$m" --device cuda --prompt-tokens 2048 \
      --decode-tokens 32 --runs 3 --json)
    echo "$m flash=$flash $(echo "$r" | field prefill_tps) $(echo "$r" | field decode_tps) ids $(echo "$r" | field decoded_ids | md5sum | cut -c1-8)"
  done
done
