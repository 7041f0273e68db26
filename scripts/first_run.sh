#!/usr/bin/env bash
# A new user's first run: clone the repository into a temporary folder, run the README's setup
# command there (fetch the default model, build, serve), wait until the server is ready, ask five
# everyday questions over HTTP at temperature 0 and check each answer and that it stopped by
# itself (finish_reason "stop", not the token limit). Exits non-zero if any check fails.
#
#   scripts/first_run.sh [REPO]        REPO: what to clone (default: this checkout)
#
# Environment: FERROLM_FIRST_RUN_ARGS  extra `serve` flags (e.g. "--model PATH" to try another
#              model; the default model is what the README's command serves)
#              CARGO_TARGET_DIR        reuse a build folder (else the clone builds from scratch,
#                                      about 20 minutes on 2 cores)
# Not part of CI: it builds from scratch. The server's port is 8080, as in the README.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
repo=${1:-$here}
work=$(mktemp -d)
server_pid=
cleanup() {
  if [ -n "$server_pid" ]; then kill -- "-$server_pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

git clone -q "$repo" "$work/ferrolm"
cd "$work/ferrolm"
# The README's own command, so the script and the README cannot drift apart.
setup=$(grep -m1 '^python3 scripts/get_model.py' README.md)
echo "first run: $setup ${FERROLM_FIRST_RUN_ARGS:-}"
log=$work/serve.log
start=$(date +%s)
setsid bash -c "$setup ${FERROLM_FIRST_RUN_ARGS:-}" >"$log" 2>&1 &
server_pid=$!

# Ready when `ferrolm serve` prints its address; a cold build takes many minutes.
url=
while [ -z "$url" ]; do
  if ! kill -0 "$server_pid" 2>/dev/null; then
    tail -30 "$log"
    echo "first run: the setup command exited before the server was ready" >&2
    exit 1
  fi
  if [ $(($(date +%s) - start)) -gt 5400 ]; then
    echo "first run: no server after 90 minutes" >&2
    exit 1
  fi
  url=$(grep -o 'at http://[^ ]*' "$log" | head -1 | cut -c4- || true)
  sleep 2
done
echo "first run: $(grep -m1 'ferrolm serve:' "$log") after $(($(date +%s) - start)) s"

# The five questions and their checks: scripts/first_run_questions.py (stdlib only).
python3 scripts/first_run_questions.py "$url"
