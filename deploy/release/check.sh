#!/usr/bin/env bash
# Checks deploy/release/build.sh's packaging with the CPU binary (run by .ci/run; the CUDA build
# itself is not run here): two packagings of one binary are byte-identical; a CPU binary is
# refused as a CUDA variant; the tarball holds the binary, the demo assets (equal to the
# repository's), the systemd files, README and BUILD-INFO with valid checksums; and the unpacked
# server serves the demo from its own assets/ (the checkout's are hidden from it in a private
# mount namespace) and drains on SIGTERM.
# Usage: deploy/release/check.sh [path/to/dflash-serve]   (default: target/debug/dflash-serve)
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
BIN=${1:-target/debug/dflash-serve}
[ -x "$BIN" ] || { echo "no dflash-serve binary at $BIN: build it with cargo build -p dflash-serve" >&2; exit 1; }
. deploy/need.sh
need curl curl
need readelf binutils
need unshare util-linux
WORK=$(mktemp -d)
PID=
cleanup() { [ -n "$PID" ] && kill -9 "$PID" 2>/dev/null; rm -rf "$WORK"; }
trap cleanup EXIT
fail() { echo "release check: $*" >&2; exit 1; }

FLAGS=()
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
  echo "the checkout has uncommitted changes: packaging with --allow-dirty"
  FLAGS+=(--allow-dirty)
fi
deploy/release/build.sh --binary "$BIN" --variant cpu --out "$WORK/a" "${FLAGS[@]}"
sleep 1  # a later wall-clock second must not change the bytes
deploy/release/build.sh --binary "$BIN" --variant cpu --out "$WORK/b" "${FLAGS[@]}" > /dev/null
TARBALL=$(ls "$WORK"/a/*.tar.gz)
NAME=$(basename "$TARBALL" .tar.gz)
cmp "$TARBALL" "$WORK/b/$NAME.tar.gz" || fail "two packagings of one binary differ"
(cd "$WORK/a" && sha256sum -c --quiet "$NAME.tar.gz.sha256") || fail "the tarball's .sha256 does not match"
echo "reproducible: two packagings are byte-identical"
if deploy/release/build.sh --binary "$BIN" --variant cuda13.0-sm90 --out "$WORK/c" "${FLAGS[@]}" > "$WORK/refused.txt" 2>&1; then
  fail "a CPU binary was packaged as a CUDA variant"
fi
grep -q "not a CUDA build" "$WORK/refused.txt" || { cat "$WORK/refused.txt"; fail "unexpected refusal message"; }

mkdir "$WORK/x"
tar -xzf "$TARBALL" -C "$WORK/x"
X=$WORK/x/$NAME
for f in dflash-serve README.md BUILD-INFO SHA256SUMS systemd/dflash-serve.service systemd/dflash-serve.env \
         assets/tiny-coder-demo/config.json assets/tiny-coder-demo/model.safetensors \
         assets/tiny-coder-demo-dflash/config.json assets/tiny-coder-demo-dflash/model.safetensors; do
  [ -f "$X/$f" ] || fail "$f missing from the tarball"
done
(cd "$X" && sha256sum -c --quiet SHA256SUMS) || fail "SHA256SUMS does not match the files"
git ls-files serve/assets | while read -r f; do
  cmp -s "$f" "$X/assets/${f#serve/assets/}" || fail "assets/${f#serve/assets/} differs from $f"
done
grep -q "^variant: cpu$" "$X/BUILD-INFO" || fail "BUILD-INFO names no variant"
grep -q "^commit: $(git rev-parse HEAD)" "$X/BUILD-INFO" || fail "BUILD-INFO names the wrong commit"
VERSION_LINE=$("$X/dflash-serve" --version)
grep -q "^dflash-serve " <<<"$VERSION_LINE" || fail "the packaged binary does not run"
echo "contents: $(cd "$X" && find . -type f | wc -l) files, checksums OK; $(grep glibc "$X/BUILD-INFO")"

# Serve the demo from the unpacked copy. The binary also knows its source checkout's assets (a
# compile-time path); hide those behind an empty tmpfs in a private mount namespace so the
# server must find the ones next to it.
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
if unshare -m --propagation private true 2>/dev/null; then
  unshare -m --propagation private sh -c "mount -t tmpfs none '$ROOT/serve/assets' && exec '$X/dflash-serve' --host 127.0.0.1 --port $PORT" > "$WORK/server.log" 2>&1 &
  HIDDEN=1
else
  echo "warning: no private mount namespace here (unshare -m); pointing the server at the packaged assets with flags instead" >&2
  "$X/dflash-serve" --host 127.0.0.1 --port "$PORT" --model-path "$X/assets/tiny-coder-demo" \
    --speculative-draft-model-path "$X/assets/tiny-coder-demo-dflash" > "$WORK/server.log" 2>&1 &
  HIDDEN=
fi
PID=$!
for _ in $(seq 1 900); do
  grep -q "fired up and ready to roll" "$WORK/server.log" && break
  kill -0 "$PID" 2>/dev/null || { cat "$WORK/server.log"; fail "the packaged server exited during startup"; }
  sleep 0.2
done
grep -q "fired up and ready to roll" "$WORK/server.log" || { cat "$WORK/server.log"; fail "the packaged server is not ready"; }
URL=http://127.0.0.1:$PORT
MODEL=$(curl -fsS "$URL/model_info" | python3 -c 'import json,sys; print(json.load(sys.stdin)["model_path"])')
case $MODEL in
  "$X"/assets/tiny-coder-demo) ;;
  *) fail "the packaged server serves $MODEL, not its own assets/" ;;
esac
DRAFT=$(curl -fsS "$URL/server_info" | python3 -c 'import json,sys; print(json.load(sys.stdin)["speculative_draft_model_path"])')
case $DRAFT in
  "$X"/assets/tiny-coder-demo-dflash) ;;
  *) fail "the packaged server drafts with $DRAFT, not its own assets/" ;;
esac
curl -fsS "$URL/generate" -H 'content-type: application/json' \
  -d '{"text":"def fib(n):","sampling_params":{"max_new_tokens":8,"temperature":0,"ignore_eos":true}}' \
  | python3 -c 'import json,sys; v=json.load(sys.stdin); assert v["meta_info"]["completion_tokens"] == 8, v' \
  || fail "the packaged server did not generate"
kill -TERM "$PID"
STATUS=0; wait "$PID" || STATUS=$?
PID=
[ "$STATUS" = 0 ] || { cat "$WORK/server.log"; fail "the packaged server exited $STATUS on SIGTERM"; }
echo "release check OK: $NAME serves the demo from its own assets${HIDDEN:+, with the source checkout copy hidden}"
