#!/usr/bin/env bash
# The test command: fetches the models the tests use (verified by checksum), then runs every
# test of the workspace. Tests that run a model are built optimized (profile.test).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 scripts/get_model.py ${FERROLM_TEST_MODELS:-smollm2-135m}
cargo test --workspace --locked "$@"
