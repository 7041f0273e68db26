#!/usr/bin/env bash
# Builds scripts/gpu/layer_bench.cu (decode-layer variants side by side) into gpu-carry/layer_bench
# with the PyPI nvcc (see ../shared/GPU.md); run it on the GPU machine:
#   run(command="gpu-carry/layer_bench", carry=["gpu-carry"])
# EXTRA=-DFL_TIMELINE adds the per-kernel timeline (kernels.cu's TL_* probes).
# Variants of the kernel build with -DLAYER_CHUNKS=n (weight chunks in flight per warp, default 2)
# or -DLAYER_THREADS=n (threads per block, default 512) added to EXTRA.
set -euo pipefail
cd "$(dirname "$0")/../.."
eval "$(bash ../shared/gpu/cuda-toolchain.sh)"
mkdir -p gpu-carry
nvcc -O3 -std=c++17 -arch=sm_90 -cudart static ${EXTRA:-} scripts/gpu/layer_bench.cu -o gpu-carry/layer_bench
ls -l gpu-carry/layer_bench
