#!/usr/bin/env bash
# Sampling cost per decode step as a share of the step, at vocab 49,152 (SmolLM2-135M Q4_1, the
# default model) and 262,144 (Gemma 3 270M Q4_K_M). Measures each model's decode step with
# `ferrolm bench` and then the sampler (crates/sample/examples/sample_bench.rs) in the same run,
# and writes bench/results/sampling.md.   usage: bench/sampling.sh
set -euo pipefail
cd "$(dirname "$0")/.."
MODELS=${FERROLM_MODELS:-$HOME/.cache/ferrolm/models}
cargo build -q --release -p ferrolm-cli
cargo build -q --release -p ferrolm-sample --example sample_bench
step_ms() {  # median decode step in ms
  target/release/ferrolm bench --model "$1" --prompt-tokens 128 --decode-tokens 64 --runs 5 --device cpu --json |
    python3 -c 'import json,sys; print(round(1e3 / json.loads(sys.stdin.read())["decode_tps"], 3))'
}
small=$(step_ms "$MODELS/SmolLM2-135M-Instruct.Q4_1.gguf")
large=$(step_ms "$MODELS/gemma-3-270m-Q4_K_M.gguf")
out=bench/results/sampling.md
{
  echo "# Sampling cost per decode step"
  echo
  echo "$(date -u +%F), commit $(git rev-parse --short HEAD), $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)), command: bench/sampling.sh"
  echo
  echo "Decode step (ferrolm bench, CPU, median of 5): SmolLM2-135M Q4_1 (vocab 49,152) ${small} ms;"
  echo "Gemma 3 270M Q4_K_M (vocab 262,144) ${large} ms. Share = sample ÷ (step + sample)."
  echo "The goal (issue 4) is under 2% with all filters on. \"Auto\" is the path a request takes."
  echo
  target/release/examples/sample_bench --step-ms "49152=$small" --step-ms "262144=$large"
} > "$out"
cat "$out"
