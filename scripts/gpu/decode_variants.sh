#!/usr/bin/env bash
# Batch-1 graph decode tok/s of ferrolm under several kernel settings, on the GPU machine:
#   run(command="bash scripts/gpu/decode_variants.sh MODEL ...", carry=["gpu-carry"])
# VARIANTS: space-separated variants, each a comma-separated list of env assignments ("-" =
# defaults), e.g. VARIANTS="- FERROLM_CUDA_PDL=0 FERROLM_CUDA_PDL=0,FERROLM_CUDA_GEMV_VARIANT=streaming".
# A variant "ptx:NAME" loads the kernels from gpu-carry/ptx/NAME.ptx.xz (scripts/gpu/ptx_variants.sh
# builds them) through FERROLM_CUDA_PTX, other assignments may follow it after commas.
# Prints each variant's decode tok/s and whether it decoded the same tokens as the first.
# Makes the models first (scripts/gpu/make_models.py) unless they exist.
set -uo pipefail
source "$(dirname "$0")/env.sh"
[ -x "$W/bin/ferrolm" ] || unpack_ferrolm
missing=(); for m in "$@"; do [ -d "$W/models/$m" ] || missing+=("$m"); done
[ ${#missing[@]} = 0 ] || python scripts/gpu/make_models.py "$W/models" gpu-carry/tokenizer "${missing[@]}" 2>&1 | grep made
mkdir -p "$W/ptx"
for f in gpu-carry/ptx/*.ptx.xz; do [ -e "$f" ] && xz -dc "$f" > "$W/ptx/$(basename "$f" .xz)"; done
# A variant's env assignments, one per line.
assignments() {
  [ "$1" = - ] && return
  local a
  for a in ${1//,/ }; do
    case $a in ptx:*) echo "FERROLM_CUDA_PTX=$W/ptx/${a#ptx:}.ptx" ;; *) echo "$a" ;; esac
  done
}
for m in "$@"; do
  first=""
  for v in ${VARIANTS:--}; do
    out=$(env $(assignments "$v") "$W/bin/ferrolm" bench --model "$W/models/$m" --device cuda \
      --prompt-tokens ${PROMPT:-2048} --decode-tokens ${DECODE:-64} --runs ${RUNS:-3} --json)
    ids=$(echo "$out" | grep -o '"decoded_ids":\[[^]]*\]' | md5sum | cut -c1-8)
    [ -n "$first" ] || first=$ids
    echo "$m $v $(echo "$out" | grep -o '"decode_tps":[0-9.]*') same tokens as the first: $([ "$ids" = "$first" ] && echo yes || echo NO)"
  done
done
