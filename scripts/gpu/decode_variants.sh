#!/usr/bin/env bash
# Batch-1 graph decode tok/s of ferrolm under several kernel settings, on the GPU machine:
#   run(command="bash scripts/gpu/decode_variants.sh MODEL ...", carry=["gpu-carry"])
# VARIANTS: space-separated env assignments (one run each; "-" = defaults). Makes the models
# first (scripts/gpu/make_models.py) unless they exist.
set -uo pipefail
source "$(dirname "$0")/env.sh"
W=/tmp/ferrolm-gpu
mkdir -p "$W/bin" "$W/models"
[ -x "$W/bin/ferrolm" ] || { xz -dc gpu-carry/ferrolm.xz > "$W/bin/ferrolm" && chmod +x "$W/bin/ferrolm"; }
missing=(); for m in "$@"; do [ -d "$W/models/$m" ] || missing+=("$m"); done
[ ${#missing[@]} = 0 ] || python scripts/gpu/make_models.py "$W/models" gpu-carry/tokenizer "${missing[@]}" 2>&1 | grep made
for m in "$@"; do
  for v in ${VARIANTS:--}; do
    tps=$(env $( [ "$v" = - ] || echo "$v" ) "$W/bin/ferrolm" bench --model "$W/models/$m" --device cuda \
      --prompt-tokens ${PROMPT:-2048} --decode-tokens 64 --runs ${RUNS:-3} --json | grep -o '"decode_tps":[0-9.]*')
    echo "$m $v $tps"
  done
done
