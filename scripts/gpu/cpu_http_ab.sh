#!/usr/bin/env bash
# Continuous batching over HTTP on the quiet GPU host's CPU: `bench/batching.py` (ferrolm and
# ferrolm --max-seqs 1) for two CPU binaries, each server pinned to 2 cores with 2 threads (the
# dev machine's size), the Python clients on the host's other cores.
#   here:   ferrolm-a.xz, ferrolm-b.xz and a SmolLM2 GGUF (*.gguf.xz, e.g. scripts/truncate_gguf.py's
#           output, under the 64 MiB carry limit) in cpu-carry/
#   device: run(command="bash scripts/gpu/cpu_http_ab.sh [LEVELS]", carry=["cpu-carry"])
set -euo pipefail
cd "$(dirname "$0")/../.."
levels=${1:-1,16}
work=$(mktemp -d)
for f in cpu-carry/*.xz; do xz -dc "$f" > "$work/$(basename "${f%.xz}")"; done
chmod +x "$work"/ferrolm-*
# batching.py looks for SmolLM2-135M-Instruct.Q4_1.gguf under FERROLM_MODELS.
ln -sf "$(ls "$work"/*.gguf | head -1)" "$work/SmolLM2-135M-Instruct.Q4_1.gguf"
export FERROLM_MODELS=$work FERROLM_THREADS=2
python3 -c "import httpx" 2>/dev/null || { echo "httpx missing on this host"; exit 1; }
for b in a b; do
  printf '#!/bin/sh\nexec taskset -c 2,3 %s "$@"\n' "$work/ferrolm-$b" > "$work/run-$b"
  chmod +x "$work/run-$b"
  FERROLM_BIN="$work/run-$b" python3 bench/batching.py --levels "$levels" --systems ferrolm,ferrolm-serial \
    --out "${OUT:-$work}/$b" 2>&1 | tail -8
  echo "== $b done"
done
