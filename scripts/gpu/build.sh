#!/usr/bin/env bash
# Builds the CUDA ferrolm binary on a CPU-only machine and packs it for the device tool's `carry`.
#   usage: bash scripts/gpu/build.sh      -> gpu-carry/ferrolm.xz (git-ignored; carry "gpu-carry")
# Uses its own target dir so CPU builds in target/ are untouched. See ../shared/GPU.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target-cuda}
cargo fetch
eval "$(bash ../shared/gpu/cuda-toolchain.sh)"
CUDA_COMPUTE_CAP=90 cargo build --release -p ferrolm-cli --features cuda
mkdir -p gpu-carry
strip -o gpu-carry/ferrolm "$CARGO_TARGET_DIR/release/ferrolm"
xz -T2 -f gpu-carry/ferrolm
# SmolLM2's tokenizer files, for the random-weight model folders made on the GPU machine.
tok=${TOKENIZER_DIR:-$HOME/.cache/ferrolm/models/hf/SmolLM2-135M-Instruct-bf16}
mkdir -p gpu-carry/tokenizer
cp "$tok/tokenizer.json" "$tok/tokenizer_config.json" gpu-carry/tokenizer/
ls -l gpu-carry
