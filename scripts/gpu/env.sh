# Sourced by the scripts run on the GPU machine: the CUDA libraries, and libnccl from PyTorch's
# wheels (a binary built with NCCL=1 links it) when present.
site=$(python -c "import site; print(site.getsitepackages()[0])" 2>/dev/null)
nccl_lib=$(dirname "$(find "${site:-/nonexistent}" -name 'libnccl.so.2' 2>/dev/null | head -1)" 2>/dev/null)
export LD_LIBRARY_PATH=${nccl_lib:+$nccl_lib:}/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
# The work folder (models, the binary) and the output folder, and the carried binary unpacked
# into the work folder (as `ferrolm`, or the name given).
W=/tmp/ferrolm-gpu
OUT=${OUT:-/tmp/ferrolm-gpu-out}
mkdir -p "$W/bin" "$W/models" "$OUT"
unpack_ferrolm() { xz -dc gpu-carry/ferrolm.xz > "$W/bin/${1:-ferrolm}" && chmod +x "$W/bin/${1:-ferrolm}"; }
