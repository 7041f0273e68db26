#!/usr/bin/env bash
# A short GPU check for when device time is scarce (~4 minutes): kernel self-checks, the copy
# bandwidth (the roofline), then batch-1 decode (graph, 3 runs, with its share of the roofline)
# and prefill on the 1B and 8B shapes with graph = eager, decode from a short context, prefill
# without the flash kernel (same tokens), the previous defaults' products beside the current
# ones (same tokens), the token read-back by copies instead of the host mirror (same tokens), the
# one-kernel decode layer (FERROLM_CUDA_LAYER=1), and, when the carried binary was built with
# NCCL=1, the NCCL reducer at world 1 (scripts/gpu/nccl_check.sh).
#   run(command="bash scripts/gpu/quick_check.sh", carry=["gpu-carry"])
set -uo pipefail
source "$(dirname "$0")/env.sh"
unpack_ferrolm
"$W/bin/ferrolm" gpu-check 2>&1 | grep -v "^ok"
python scripts/gpu/make_models.py "$W/models" gpu-carry/tokenizer llama-3.2-1b llama-3.1-8b 2>&1 | grep made
field() { grep -o "\"$1\":[^,]*" | head -1; }
# The roofline's denominator, measured here (scripts/gpu/checks.py: best device-to-device copy).
bw=$(python scripts/gpu/checks.py "$W/bin" "$W/models" "$OUT" bandwidth | grep -o "d2d copy bandwidth [0-9]*" | grep -o "[0-9]*$")
echo "d2d copy bandwidth $bw GB/s on $(nvidia-smi --query-gpu=name --format=csv,noheader)"
# Decode tok/s as a share of the weights-only roofline (bandwidth ÷ weight bytes).
roof() { local tps=${1#*:} wb=${2#*:}; python3 -c "print(f'{100 * $tps * $wb / ($bw * 1e9):.1f}% of the roofline')"; }
for m in llama-3.2-1b llama-3.1-8b; do
  a=(bench --model "$W/models/$m" --device cuda --prompt-tokens 2048 --decode-tokens 128 --json)
  g=$("$W/bin/ferrolm" "${a[@]}" --runs 3)
  e=$(FERROLM_CUDA_GRAPH=0 "$W/bin/ferrolm" "${a[@]}" --runs 1)
  same=$([ "$(echo "$g" | field decoded_ids)" = "$(echo "$e" | field decoded_ids)" ] && echo yes || echo NO)
  echo "$m graph $(echo "$g" | field decode_tps) ($(roof "$(echo "$g" | field decode_tps)" "$(echo "$g" | field weight_bytes)")) $(echo "$g" | field prefill_tps) eager $(echo "$e" | field decode_tps) graph=eager $same"
done
# Decode from a short context (a 16-token prompt): the weights-only roofline's own case.
for m in llama-3.2-1b llama-3.1-8b; do
  s=$("$W/bin/ferrolm" bench --model "$W/models/$m" --device cuda --prompt-tokens 16 --decode-tokens 128 --json --runs 3)
  echo "$m short context: graph $(echo "$s" | field decode_tps) ($(roof "$(echo "$s" | field decode_tps)" "$(echo "$s" | field weight_bytes)"))"
done
# Prefill through the masked-softmax composition instead of the flash kernel: the same tokens.
for m in llama-3.2-1b llama-3.1-8b; do
  a=(bench --model "$W/models/$m" --device cuda --prompt-tokens 2048 --decode-tokens 32 --json --runs 1)
  f=$("$W/bin/ferrolm" "${a[@]}")
  c=$(FERROLM_CUDA_FLASH=0 "$W/bin/ferrolm" "${a[@]}")
  same=$([ "$(echo "$f" | field decoded_ids)" = "$(echo "$c" | field decoded_ids)" ] && echo yes || echo NO)
  echo "$m prefill flash $(echo "$f" | field prefill_tps), composition $(echo "$c" | field prefill_tps), same tokens: $same"
done
# Decode with the defaults and with the settings "$@" (env assignments) side by side: both
# speeds and whether the greedy tokens are the same. $1: what the settings restore.
beside() {
  local label=$1 m base other same
  shift
  for m in llama-3.2-1b llama-3.1-8b; do
    local a=(bench --model "$W/models/$m" --device cuda --prompt-tokens 2048 --decode-tokens 128 --json --runs 3)
    base=$("$W/bin/ferrolm" "${a[@]}")
    other=$(env "$@" "$W/bin/ferrolm" "${a[@]}")
    same=$([ "$(echo "$other" | field decoded_ids)" = "$(echo "$base" | field decoded_ids)" ] && echo yes || echo NO)
    echo "$m default $(echo "$base" | field decode_tps), $label $(echo "$other" | field decode_tps), same tokens: $same"
  done
}
# The register-fed products without programmatic dependent launch (the defaults before
# 2026-12-04): every product variant is bit-identical.
beside "streaming products without PDL" FERROLM_CUDA_GEMV_VARIANT=streaming FERROLM_CUDA_PDL=0
# Each token read back by a copy and an event queued after its replay (the default before
# 2026-12-05) instead of the head kernel's store into the host mirror.
beside "tokens read by copies and events" FERROLM_TOKEN_MIRROR=0
# The one-kernel decode layer (FERROLM_CUDA_LAYER=1, off by default): graph and eager decode the
# same tokens as the separate kernels (it is bit-identical to them).
for m in llama-3.2-1b llama-3.1-8b; do
  a=(bench --model "$W/models/$m" --device cuda --prompt-tokens 2048 --decode-tokens 128 --json)
  base=$("$W/bin/ferrolm" "${a[@]}" --runs 1 | field decoded_ids)
  g=$(FERROLM_CUDA_LAYER=1 "$W/bin/ferrolm" "${a[@]}" --runs 3)
  e=$(FERROLM_CUDA_LAYER=1 FERROLM_CUDA_GRAPH=0 "$W/bin/ferrolm" "${a[@]}" --runs 1)
  same=$([ "$(echo "$g" | field decoded_ids)" = "$base" ] && [ "$(echo "$e" | field decoded_ids)" = "$base" ] && echo yes || echo NO)
  echo "$m layer kernel: graph $(echo "$g" | field decode_tps) eager $(echo "$e" | field decode_tps) same tokens as separate kernels: $same"
done
if ldd "$W/bin/ferrolm" | grep -q libnccl; then bash scripts/gpu/nccl_check.sh llama-3.2-1b; fi
