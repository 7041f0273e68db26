#!/usr/bin/env bash
# The fuzz and abuse suite in full (CI runs its short form, tests/server/test_fuzz.py):
# 3,000+ generated malformed requests over every route and field, special-token injections,
# bodies at and past a 16 MiB limit, 32 half-sent / stalled requests, 1,000 idle connections,
# against `ferrolm serve` on SmolLM2-135M with a 256 MB KV budget. Writes bench/results/fuzz.json;
# exits non-zero if any check fails. Extra arguments go to tests/server/fuzz.py (--count N…).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${FERROLM_TEST_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/ferrolm/test-venv}
[ -x target/release/ferrolm ] || cargo build --release --locked -p ferrolm-cli
[ -x "$VENV/bin/python" ] || { python3 -m venv "$VENV" && "$VENV/bin/python" -m pip install -q -r tests/server/requirements.txt; }
FERROLM_BIN="${FERROLM_BIN:-$PWD/target/release/ferrolm}" "$VENV/bin/python" tests/server/fuzz.py "$@"
