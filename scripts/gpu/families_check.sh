#!/usr/bin/env bash
# The model families' tiny fixtures (tests/fixtures/tiny: Qwen3, Llama 3.x scaling, Qwen3-MoE,
# Qwen2-MoE, Mixtral) on CUDA: each folder's and GGUF's teacher-forced logits (prompt prefilled,
# then one decode step per later token) written to $OUT, for scripts/gpu/families_compare.py to
# compare here with the transformers record.
#   run(command="bash scripts/gpu/families_check.sh", carry=["gpu-carry"])
set -uo pipefail
source "$(dirname "$0")/env.sh"
unpack_ferrolm
for dir in tests/fixtures/tiny/*/; do
  fam=$(basename "$dir")
  ids=$(python3 -c "import json; print(json.dumps(json.load(open('$dir/logits.json'))['ids']))")
  from=$(python3 -c "import json; print(json.load(open('$dir/logits.json'))['prompt_len'])")
  for kind in folder gguf; do
    model=$dir; [ "$kind" = gguf ] && model=$dir/model-f16.gguf
    if "$W/bin/ferrolm" dump-logits --model "$model" --ids "$ids" --from "$from" --device cuda --out "$OUT/$fam-$kind.f32"; then
      echo "$fam $kind: written"
    else
      echo "$fam $kind: FAILED"
    fi
  done
done
