#!/usr/bin/env bash
# Batched decode on the GPU (issue 38): correctness (each sequence of a batch against its decode
# alone) and aggregate decode tok/s at batch 1, 8, 32, 128 against the batched roofline and
# transformers, on random-weight Llama shapes built here.
#   run(command="bash scripts/gpu/batch_bench.sh [SHAPE ...]", carry=["gpu-carry"])
#   (default shapes: llama-3.2-1b llama-3.1-8b; BATCHES="1 8 32 128"; NO_HF=1 skips transformers;
#   SERVE_LOAD=0 skips the HTTP clients, CLIENTS=64 and SECONDS_LOAD=45 size them)
set -uo pipefail
source "$(dirname "$0")/env.sh"
unpack_ferrolm
shapes=${*:-llama-3.2-1b llama-3.1-8b}
python scripts/gpu/make_models.py "$W/models" gpu-carry/tokenizer $shapes 2>&1 | grep made
for m in $shapes; do
  # Batched greedy against each sequence alone: tokens agreeing from the start.
  "$W/bin/ferrolm" bench --model "$W/models/$m" --device cuda --prompt-tokens 128 --decode-tokens 64 --runs 1 \
    --concurrency 8 --check --max-batch-tokens 2048 2>&1 | tail -2
  python scripts/gpu/batch_bench.py "$W/bin" "$W/models" "$OUT" "$m" ${BATCHES:-1 8 32 128}
done
# Over HTTP: concurrent streaming clients against `ferrolm serve` on the first shape.
first=${shapes%% *}
[ "${SERVE_LOAD:-1}" = 1 ] && python scripts/gpu/serve_load.py "$W/bin/ferrolm" "$W/models/$first" "$OUT" ${CLIENTS:-64} ${SECONDS_LOAD:-45}
