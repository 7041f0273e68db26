#!/usr/bin/env bash
# Batch-1 graph decode tok/s of ferrolm under several kernel settings, on the GPU machine:
#   run(command="bash scripts/gpu/decode_variants.sh MODEL ...", carry=["gpu-carry"])
# VARIANTS: space-separated variants, each a comma-separated list of env assignments ("-" =
# defaults), e.g. VARIANTS="- FERROLM_CUDA_PDL=0 FERROLM_CUDA_PDL=0,FERROLM_CUDA_GEMV_VARIANT=streaming".
# Prints each variant's decode tok/s and whether it decoded the same tokens as the first.
# Makes the models first (scripts/gpu/make_models.py) unless they exist.
set -uo pipefail
source "$(dirname "$0")/env.sh"
[ -x "$W/bin/ferrolm" ] || unpack_ferrolm
missing=(); for m in "$@"; do [ -d "$W/models/$m" ] || missing+=("$m"); done
[ ${#missing[@]} = 0 ] || python scripts/gpu/make_models.py "$W/models" gpu-carry/tokenizer "${missing[@]}" 2>&1 | grep made
for m in "$@"; do
  first=""
  for v in ${VARIANTS:--}; do
    out=$(env $( [ "$v" = - ] || echo "${v//,/ }" ) "$W/bin/ferrolm" bench --model "$W/models/$m" --device cuda \
      --prompt-tokens ${PROMPT:-2048} --decode-tokens ${DECODE:-64} --runs ${RUNS:-3} --json)
    ids=$(echo "$out" | grep -o '"decoded_ids":\[[^]]*\]' | md5sum | cut -c1-8)
    [ -n "$first" ] || first=$ids
    echo "$m $v $(echo "$out" | grep -o '"decode_tps":[0-9.]*') same tokens as the first: $([ "$ids" = "$first" ] && echo yes || echo NO)"
  done
done
