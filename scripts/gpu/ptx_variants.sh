#!/usr/bin/env bash
# Builds kernel variants as PTX files for the FERROLM_CUDA_PTX lever, here with the PyPI nvcc:
# each argument NAME=FLAGS (FLAGS: -D switches, comma-separated) becomes gpu-carry/ptx/NAME.ptx.xz,
# which scripts/gpu/decode_variants.sh loads for a variant "ptx:NAME", so kernel changes are
# A/B'd in the engine against one binary (no Rust rebuild, alternating in one device run):
#   bash scripts/gpu/ptx_variants.sh base= old=-DFL_WAIT_FIRST
#   run(command="VARIANTS='ptx:base ptx:old ptx:base ptx:old' bash scripts/gpu/decode_variants.sh llama-3.2-1b", carry=["gpu-carry"])
set -euo pipefail
cd "$(dirname "$0")/../.."
eval "$(bash ../shared/gpu/cuda-toolchain.sh)"
mkdir -p gpu-carry/ptx
# The same nvcc arguments as crates/backend/build.rs, plus the variant's switches.
pids=()
for spec in "$@"; do
  name=${spec%%=*} flags=${spec#*=}
  nvcc --ptx -O3 -std=c++17 -arch=sm_90 ${flags//,/ } crates/backend/src/cuda/kernels.cu -o "gpu-carry/ptx/$name.ptx" &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done  # a failed variant fails the script
xz -T2 -f gpu-carry/ptx/*.ptx
ls -l gpu-carry/ptx
