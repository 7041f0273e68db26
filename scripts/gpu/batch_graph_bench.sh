#!/usr/bin/env bash
# Captured batched decode steps (issue 38) in one call: graph = eager bit for bit across the
# buckets (batch_graph_check.sh), batched greedy tokens against each sequence alone, then
# aggregate decode tok/s at N = 1, 8, 32, 128 with graphs and with eager steps
# (FERROLM_BATCH_GRAPHS=0) against the batched roofline (batch_bench.py, transformers skipped).
#   run(command="bash scripts/gpu/batch_graph_bench.sh [SHAPE ...]", carry=["gpu-carry"])
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/gpu/env.sh
unpack_ferrolm
shapes=${*:-llama-3.2-1b}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python scripts/gpu/make_models.py "$W/models" gpu-carry/tokenizer $shapes 2>&1 | grep made
first=${shapes%% *}
[ "${SKIP_CHECK:-0}" = 1 ] || bash scripts/gpu/batch_graph_check.sh "$first"
for m in $shapes; do
  echo "== $m: batched greedy (graphs) against each sequence alone"
  "$W/bin/ferrolm" bench --model "$W/models/$m" --device cuda --prompt-tokens 128 --decode-tokens 64 --runs 1 \
    --concurrency 8 --check --max-batch-tokens 2048 2>&1 | tail -1
  NO_HF=1 python scripts/gpu/batch_bench.py "$W/bin" "$W/models" "$OUT" "$m" ${BATCHES:-1 8 32 128}
done
