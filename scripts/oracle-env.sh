#!/usr/bin/env bash
# Creates (once) the Python environment that holds the correctness oracles and benchmark peers:
# llama.cpp (llama-cpp-python, built natively for this CPU), gguf, numpy, mlx-lm on CPU
# (WITH_MLX=1) and sentence-transformers (WITH_ST=1).
# Developers run it; CI does not need it (fixtures are committed).
#   usage: source <(scripts/oracle-env.sh)   # prints `export ORACLE_PY=...`
set -euo pipefail
DIR=${FERROLM_ORACLE_ENV:-${XDG_CACHE_HOME:-$HOME/.cache}/ferrolm/oracle-venv}
if [ ! -x "$DIR/bin/python" ]; then
  python3 -m venv "$DIR" >&2
fi
PY="$DIR/bin/python"
if ! "$PY" -c 'import llama_cpp' 2>/dev/null; then
  # AMX disabled on purpose: llama.cpp's AMX matmul crashes on these CPUs for batch > 1
  # (upstream issue 20824; see PEERS.md).
  CMAKE_ARGS='-DGGML_NATIVE=ON "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"' \
    "$PY" -m pip install -q --no-cache-dir llama-cpp-python==0.3.36 >&2
fi
"$PY" -c 'import gguf, numpy' 2>/dev/null || "$PY" -m pip install -q gguf numpy safetensors >&2
if [ "${WITH_MLX:-0}" = 1 ]; then
  "$PY" -c 'import mlx_lm' 2>/dev/null || "$PY" -m pip install -q mlx==0.32.4 mlx-cpu==0.32.4 mlx-lm==0.32.2 tokenizers >&2
fi
# sentence-transformers, the embedding oracle (scripts/fixtures/embedding_fixtures.py), runs on
# the CPU; PyPI's torch wheel brings its CUDA libraries along (unused here).
if [ "${WITH_ST:-0}" = 1 ]; then
  "$PY" -c 'import sentence_transformers' 2>/dev/null \
    || "$PY" -m pip install -q torch==2.15.0 transformers==5.25.0 sentence-transformers==6.2.0 >&2
fi
echo "export ORACLE_PY='$PY'"
