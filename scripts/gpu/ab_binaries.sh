#!/usr/bin/env bash
# Decode tok/s of two ferrolm binaries side by side, alternating (A/B of kernel changes that have
# no runtime switch), on the GPU machine:
#   run(command="bash scripts/gpu/ab_binaries.sh A.xz B.xz MODEL ...", carry=["gpu-carry"])
# A.xz and B.xz: packed binaries in gpu-carry/ (scripts/gpu/build.sh makes ferrolm.xz; copy the
# other one aside). PROMPT (2048), DECODE (128), ROUNDS (3). Prints each run's decode tok/s and
# whether both decode the same greedy tokens.
set -uo pipefail
source "$(dirname "$0")/env.sh"
a=$1 b=$2; shift 2
xz -dc "gpu-carry/$a" > "$W/bin/ab_a" && xz -dc "gpu-carry/$b" > "$W/bin/ab_b" && chmod +x "$W/bin/ab_a" "$W/bin/ab_b"
missing=(); for m in "$@"; do [ -d "$W/models/$m" ] || missing+=("$m"); done
[ ${#missing[@]} = 0 ] || python scripts/gpu/make_models.py "$W/models" gpu-carry/tokenizer "${missing[@]}" 2>&1 | grep made
for m in "$@"; do
  for round in $(seq ${ROUNDS:-3}); do
    line="$m prompt ${PROMPT:-2048} round $round:"
    for bin in ab_a ab_b; do
      out=$("$W/bin/$bin" bench --model "$W/models/$m" --device cuda --prompt-tokens ${PROMPT:-2048} \
        --decode-tokens ${DECODE:-128} --runs 3 --json)
      ids=$(echo "$out" | grep -o '"decoded_ids":\[[^]]*\]' | md5sum | cut -c1-8)
      line="$line $([ $bin = ab_a ] && echo "$a" || echo "$b") $(echo "$out" | grep -o '"decode_tps":[0-9.]*' | cut -d: -f2) ($ids)"
    done
    echo "$line"
  done
done
