#!/usr/bin/env bash
# Real clients against the real dflash-serve binary (run by .ci/run after the Rust tests):
# the official `openai` Python package, and a client that speaks exactly as SGLang's
# bench_serving (sglang itself imports torch, too heavy for CI; see bench_serving_client.py).
# Usage: tests/clients/run.sh [path/to/dflash-serve]   (default: target/debug/dflash-serve)
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${1:-target/debug/dflash-serve}
[ -x "$BIN" ] || { echo "no dflash-serve binary at $BIN: build it with cargo build -p dflash-serve" >&2; exit 1; }
VENV=${DFLASH_CLIENT_VENV:-target/client-venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "openai>=1.40" httpx
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
LOG=$(mktemp)
"$BIN" --host 127.0.0.1 --port "$PORT" --tool-call-parser qwen25 >"$LOG" 2>&1 &
PID=$!
trap 'kill $PID 2>/dev/null || true; rm -f "$LOG"' EXIT
for _ in $(seq 1 600); do
  grep -q "fired up and ready to roll" "$LOG" && break
  kill -0 $PID 2>/dev/null || { cat "$LOG"; echo "dflash-serve exited during startup" >&2; exit 1; }
  sleep 0.2
done
URL=http://127.0.0.1:$PORT
"$VENV/bin/python" tests/clients/openai_client.py "$URL"
"$VENV/bin/python" tests/clients/bench_serving_client.py "$URL" 32 8
# The load tool (deploy/bench/load.py, standard library only) at two small concurrency levels.
python3 deploy/bench/load.py "$URL" --concurrency 1,4 --input-len 32 --output-len 16 \
  --prompts-per-level 8 --require-no-failures --out "${TMPDIR:-/tmp}/dflash-load-ci.json"
kill -TERM $PID
wait $PID
echo "clients OK; dflash-serve exited cleanly on SIGTERM"
