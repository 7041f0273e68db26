#!/usr/bin/env bash
# Builds the CUDA ferrolm binary on a CPU-only machine and packs it for the device tool's `carry`.
#   usage: bash scripts/gpu/build.sh      -> gpu-carry/ferrolm.xz (git-ignored; carry "gpu-carry")
#          NCCL=1 bash scripts/gpu/build.sh   (with the nccl feature; see scripts/gpu/nccl_check.sh)
# Uses its own target dir so CPU builds in target/ are untouched. See ../shared/GPU.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
features=cuda
target=$PWD/target-cuda
# NCCL=1: also the `nccl` feature (tensor parallelism over GPUs), linked against libnccl from
# PyPI's nvidia-nccl-cu13 wheel; its own target dir (other link flags rebuild everything).
if [ "${NCCL:-0}" = 1 ]; then
  nccl=$HOME/.cache/ferrolm/nccl
  if [ ! -e "$nccl/nvidia/nccl/lib/libnccl.so" ]; then
    python3 -m pip download --no-deps nvidia-nccl-cu13 -d "$nccl/dl"
    python3 -m zipfile -e "$nccl"/dl/nvidia_nccl_cu13-*.whl "$nccl"
    ln -sf libnccl.so.2 "$nccl/nvidia/nccl/lib/libnccl.so"
  fi
  export RUSTFLAGS="-L $nccl/nvidia/nccl/lib"
  features=cuda,nccl
  target=$PWD/target-cuda-nccl
fi
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$target}
cargo fetch
eval "$(bash ../shared/gpu/cuda-toolchain.sh)"
CUDA_COMPUTE_CAP=90 cargo build --release -p ferrolm-cli --features "$features"
mkdir -p gpu-carry
strip -o gpu-carry/ferrolm "$CARGO_TARGET_DIR/release/ferrolm"
xz -T2 -f gpu-carry/ferrolm
# SmolLM2's tokenizer files, for the random-weight model folders made on the GPU machine.
tok=${TOKENIZER_DIR:-$HOME/.cache/ferrolm/models/hf/SmolLM2-135M-Instruct-bf16}
mkdir -p gpu-carry/tokenizer
cp "$tok/tokenizer.json" "$tok/tokenizer_config.json" gpu-carry/tokenizer/
ls -l gpu-carry
