#!/usr/bin/env bash
# The test command: fetches the models the tests use (verified by checksum), then runs every
# test of the workspace. Tests that run a model are built optimized (profile.test). Then the
# server's integration tests: the release binary, a venv with the pinned OpenAI SDK, pytest
# against a real `ferrolm serve` on the default model (tests/server).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 scripts/get_model.py ${FERROLM_TEST_MODELS:-smollm2-135m gemma3-270m qwen2.5-coder-0.5b qwen2.5-coder-1.5b all-minilm-l6-v2}
# The Hugging Face folders the folder tests load (tests/hf_folders.rs), converted from those
# GGUF files by scripts/gguf_to_hf.py, which needs `gguf` and `numpy`: the oracle venv has them,
# else a small venv. FERROLM_TEST_HF=0 skips this (those tests then skip with a notice).
if [ "${FERROLM_TEST_HF:-1}" = 1 ]; then
  CONVERT_PY=${FERROLM_ORACLE_ENV:-${XDG_CACHE_HOME:-$HOME/.cache}/ferrolm/oracle-venv}/bin/python
  if ! "$CONVERT_PY" -c 'import gguf, numpy' 2>/dev/null; then
    CONVERT_VENV=${XDG_CACHE_HOME:-$HOME/.cache}/ferrolm/convert-venv
    [ -x "$CONVERT_VENV/bin/python" ] || python3 -m venv "$CONVERT_VENV"
    CONVERT_PY=$CONVERT_VENV/bin/python
    "$CONVERT_PY" -c 'import gguf, numpy' 2>/dev/null \
      || "$CONVERT_PY" -m pip install -q --disable-pip-version-check gguf==0.19.0 numpy
  fi
  "$CONVERT_PY" scripts/hf_folders.py
fi
# --release: the test binaries and the server binary below share one build of the dependencies.
cargo test --workspace --release --locked "$@"

cargo build --release --locked -p ferrolm-cli
# The chat page's browser test (tests/server/test_chat_page.py) drives Debian's chromium: installed
# here when missing (as root, with apt; CI runs as root). If that fails the test skips, saying so.
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
      || echo "NOTICE: chromium could not be installed; the chat page's browser test will skip" >&2
  else
    echo "NOTICE: chromium is missing and cannot be installed here; the chat page's browser test will skip" >&2
  fi
fi
VENV=${FERROLM_TEST_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/ferrolm/test-venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -r tests/server/requirements.txt
FERROLM_BIN="$PWD/target/release/ferrolm" "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/server
