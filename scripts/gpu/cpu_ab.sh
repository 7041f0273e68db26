#!/usr/bin/env bash
# Quiet CPU A/B timings on the lent GPU host's CPU (the dev machine is shared and noisy):
# two CPU binaries, alternated, pinned to 2 cores with 2 threads (the dev machine's size).
#   here:   put ferrolm-a.xz, ferrolm-b.xz and a model (*.gguf.xz, e.g. scripts/truncate_gguf.py's
#           output, to fit the 64 MiB carry limit) in cpu-carry/
#   device: run(command="bash scripts/gpu/cpu_ab.sh [ROUNDS]", carry=["cpu-carry"])
# Prints, per round, engine-only decode tok/s at 16 sequences and at 1 (median of 3) for a then b.
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-5}
work=$(mktemp -d)
for f in cpu-carry/*.xz; do xz -dc "$f" > "$work/$(basename "${f%.xz}")"; done
chmod +x "$work"/ferrolm-*
model=$(ls "$work"/*.gguf | head -1)
lscpu | grep -E "Model name|^CPU\(s\)" || true
pin="taskset -c 2,3"
export FERROLM_THREADS=2
rate() { grep -o "decode [0-9.]* tok/s" | grep -o "[0-9.]*" | head -1; }
for r in $(seq "$rounds"); do
  for b in a b; do
    c16=$($pin "$work/ferrolm-$b" bench --model "$model" --concurrency 16 --prompt-tokens 128 --decode-tokens 128 --runs 1 2>&1 | rate)
    c1=$($pin "$work/ferrolm-$b" bench --model "$model" --prompt-tokens 128 --decode-tokens 128 --runs 3 2>&1 | rate)
    echo "round $r $b: c16 $c16 c1 $c1"
  done
done
