#!/usr/bin/env bash
# Kernel-time profile of ferrolm's decode on the GPU machine (nsys when present, else ferrolm's
# own event timing, FERROLM_CUDA_PROFILE=1):
#   run(command="bash scripts/gpu/profile.sh [MODEL_NAME ...]", carry=["gpu-carry"])
# Makes the named random-weight models (scripts/gpu/make_models.py), then for each runs
# `ferrolm bench` under nsys with the static step eager (FERROLM_CUDA_GRAPH=0: every kernel
# launch is visible) and prints the kernel summary. Output in $OUT.
set -uo pipefail
source "$(dirname "$0")/env.sh"
unpack_ferrolm
NSYS=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
echo "nsys: ${NSYS:-none}"
if [ "${1:-}" = --no-make ]; then shift; else
  python scripts/gpu/make_models.py "$W/models" gpu-carry/tokenizer "$@" 2>&1 | grep made
fi
for m in "$@"; do
  args=(bench --model "$W/models/$m" --device cuda --prompt-tokens 2048 --decode-tokens 64 --runs 1 --json)
  if [ -n "$NSYS" ]; then
    FERROLM_CUDA_GRAPH=0 "$NSYS" profile -q -t cuda -o "$W/$m" --force-overwrite true "$W/bin/ferrolm" "${args[@]}" > /dev/null 2>&1
    "$NSYS" stats -q -r cuda_gpu_kern_sum -f csv "$W/$m.nsys-rep" 2> /dev/null > "$OUT/kern-$m.csv"
    python3 - "$OUT/kern-$m.csv" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
print(sys.argv[1])
for r in rows[:16]:
    print(f"{float(r['Time (%)']):5.1f}% {int(r['Instances']):6d} x {float(r['Avg (ns)'])/1e3:7.1f}us {r['Name'][:70]}")
PY
  else
    echo "== $m: eager static step, per-kernel device time"
    FERROLM_CUDA_PROFILE=1 FERROLM_CUDA_GRAPH=0 "$W/bin/ferrolm" "${args[@]}" 2>&1 >/dev/null | python3 scripts/gpu/last_profiles.py ${PROFILE_ROWS:-24}
    echo "== $m: graph, decode tok/s after a 2048- and a 16-token prompt"
    FERROLM_CUDA_PROFILE=1 "$W/bin/ferrolm" "${args[@]}" 2>&1 | grep -o 'graph nodes.*\|"decode_tps":[0-9.]*' | sort -u
    "$W/bin/ferrolm" "${args[@]/2048/16}" | grep -o '"decode_tps":[0-9.]*'
    FERROLM_CUDA_ARENA=0 "$W/bin/ferrolm" "${args[@]}" | grep -o '"decode_tps":[0-9.]*' | sed 's/^/arena off: /'
    FERROLM_CUDA_PDL=0 "$W/bin/ferrolm" "${args[@]}" | grep -o '"decode_tps":[0-9.]*\|"prefill_tps":[0-9.]*' | sed 's/^/pdl off: /'
  fi
done
