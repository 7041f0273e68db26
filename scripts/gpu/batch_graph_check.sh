#!/usr/bin/env bash
# Captured batched decode steps (issue 38): every replay of a bucket's graph against the same
# step run eagerly, bit for bit (FERROLM_BATCH_GRAPH_CHECK=1: the model runs the step again
# after each replay and compares the hidden rows; a difference fails the step and is logged).
# N sequences of 64-token prompts (PROMPT=n), 12 greedy tokens each, for N across the buckets 2..256,
# powers of two and padded sizes between them.
#   run(command="bash scripts/gpu/batch_graph_check.sh [SHAPE ...]", carry=["gpu-carry"])
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/gpu/env.sh
unpack_ferrolm
shapes=${*:-llama-3.2-1b}
[ -d "$W/models/${shapes%% *}" ] || python scripts/gpu/make_models.py "$W/models" gpu-carry/tokenizer $shapes 2>&1 | grep made
for m in $shapes; do
  for n in ${NS:-2 3 4 7 8 13 16 32 33 64 100 128 200 256}; do
    log="$OUT/graph-check-$m-$n-${PROMPT:-64}.log"
    FERROLM_BATCH_GRAPH_CHECK=1 FERROLM_BATCH_GRAPH_MAX_ROWS=256 FERROLM_LOG=ferrolm_models=info "$W/bin/ferrolm" bench --model "$W/models/$m" \
      --device cuda --prompt-tokens "${PROMPT:-64}" --decode-tokens 12 --runs 1 --concurrency "$n" --max-batch-tokens 8192 >"$log" 2>&1
    rc=$?
    echo "$m N=$n rc=$rc: $(grep -c 'differs from eager' "$log") differing; $(grep -o '[0-9]* replays, .*' "$log" | tail -1)"
    grep -m2 -i 'not captured\|run through the model' "$log"
  done
done
