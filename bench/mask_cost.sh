#!/usr/bin/env bash
# Grammar masks' cost per decode step through the engine (issue 33): SmolLM2-135M Q4_1 (vocab
# 49,152) and Gemma 3 270M (262,144), batches 1 and 16, a JSON schema, each MaskSchedule
# (serial = the code before masks were computed ahead; parallel over the CPU pool; overlapped
# with the forward). Prints a markdown table (crates/engine/tests/mask_cost.rs says what each
# column is). The test binary is copied to a private path first: others rebuild target/.
#   bench/mask_cost.sh                      # CPU
#   FERROLM_BENCH_DEVICE=cuda:0 CARGO_FEATURES=cuda bench/mask_cost.sh   # GPU
set -euo pipefail
cd "$(dirname "$0")/.."
features=${CARGO_FEATURES:+--features $CARGO_FEATURES}
bin=$(cargo test --release -p ferrolm-engine $features --test mask_cost --no-run --message-format=json 2>/dev/null \
  | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "mask_cost" and m.get("executable"):
        print(m["executable"])')
private=$(mktemp -d)/mask_cost
cp "$bin" "$private"
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg), device ${FERROLM_BENCH_DEVICE:-cpu}"
"$private" --ignored --nocapture --test-threads 1 mask_cost_per_step 2>&1 | grep -E '^\||SKIP|panicked|test result'
# The masks of 16 rows per step without a model, serial vs over the pool (FERROLM_THREADS sets
# its size; FERROLM_BENCH_TOKENIZERS a folder of smollm2/ and gemma3/ tokenizer.json folders).
"$private" --ignored --nocapture --test-threads 1 masks_of_sixteen_rows_over_threads 2>&1 | grep -E '^\||SKIP|panicked|test result'
