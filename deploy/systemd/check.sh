#!/usr/bin/env bash
# Checks deploy/systemd/ (run by .ci/run):
#  1. `systemd-analyze verify` of dflash-serve.service, installed with its environment file and
#     the real binary into a scratch root (--root), so ExecStart's path is checked too; any
#     warning fails the check, and a deliberately broken copy must be reported (the check can
#     fail). This works without systemd running as PID 1 (containers, CI).
#  2. What the unit runs: ExecStart with DFLASH_SERVE_ARGS expanded as systemd expands an unquoted
#     $VAR (split at whitespace) starts the server; the unit's KillSignal then drains it: a running
#     request finishes, and the process exits 0 well within TimeoutStopSec (so systemd would not
#     SIGKILL it and Restart=on-failure would not fire).
# Usage: deploy/systemd/check.sh [path/to/dflash-serve]   (default: target/debug/dflash-serve)
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${1:-target/debug/dflash-serve}
[ -x "$BIN" ] || { echo "no dflash-serve binary at $BIN: build it with cargo build -p dflash-serve" >&2; exit 1; }
UNIT=deploy/systemd/dflash-serve.service
ENVF=deploy/systemd/dflash-serve.env

. deploy/need.sh
need curl curl
need systemd-analyze systemd

WORK=$(mktemp -d)
PID=
cleanup() { [ -n "$PID" ] && kill -9 "$PID" 2>/dev/null; rm -rf "$WORK"; }
trap cleanup EXIT

# The paths the unit names, inside a scratch root; the host's own units give the targets it
# orders against (network-online.target, multi-user.target, sysinit.target).
make_root() {
  local root=$1 unit_src=$2
  mkdir -p "$root/usr/lib/systemd" "$root/etc/systemd/system" "$root/etc/dflash-serve" "$root/opt/dflash-serve"
  cp -a /lib/systemd/system "$root/usr/lib/systemd/"
  cp "$unit_src" "$root/etc/systemd/system/dflash-serve.service"
  cp "$ENVF" "$root/etc/dflash-serve/dflash-serve.env"
  cp "$BIN" "$root/opt/dflash-serve/dflash-serve"
}
verify() {
  SYSTEMD_LOG_COLOR=0 systemd-analyze verify --root="$1" dflash-serve.service 2>&1
}

make_root "$WORK/root" "$UNIT"
if ! out=$(verify "$WORK/root") || [ -n "$out" ]; then
  echo "systemd-analyze verify rejects $UNIT:" >&2; echo "$out" >&2; exit 1
fi
echo "systemd-analyze verify: $UNIT OK ($(systemd-analyze --version | head -1))"

# The check must be able to fail: a misspelt restart policy and a missing binary are reported.
sed 's/^Restart=on-failure$/Restart=on-failur/' "$UNIT" > "$WORK/broken.service"
grep -q '^Restart=on-failur$' "$WORK/broken.service" || { echo "could not break the unit for the self-test" >&2; exit 1; }
make_root "$WORK/broken-root" "$WORK/broken.service"
rm "$WORK/broken-root/opt/dflash-serve/dflash-serve"
out=$(verify "$WORK/broken-root") || true
for want in "restart specifier" "is not executable"; do
  grep -q "$want" <<<"$out" || { echo "self-test: verify did not report '$want' in a broken unit:" >&2; echo "$out" >&2; exit 1; }
done
echo "systemd-analyze verify: a broken copy is rejected (self-test OK)"

# What systemd would execute: ExecStart with the environment file's variables expanded, the port
# moved to a free one (the shipped 30000 may be taken on this machine) and the host to loopback.
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
python3 - "$UNIT" "$ENVF" "$BIN" "$PORT" > "$WORK/argv" <<'PY'
import re, shlex, sys
unit, envf, binary, port = sys.argv[1:]
env = {}
for line in open(envf):
    line = line.strip()
    if not line or line.startswith("#"):
        continue
    key, _, value = line.partition("=")
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        value = value[1:-1]
    env[key.strip()] = value
service = {}
section = None
for line in open(unit):
    line = line.strip()
    if line.startswith("["):
        section = line
    elif section == "[Service]" and "=" in line and not line.startswith("#"):
        k, _, v = line.partition("=")
        service[k] = v
argv = []
for word in shlex.split(service["ExecStart"]):
    m = re.fullmatch(r"\$(\w+)", word)
    if m:  # unquoted $VAR: split at whitespace, as systemd.service(5) says
        argv += env.get(m.group(1), "").split()
    else:
        argv.append(re.sub(r"\$\{(\w+)\}", lambda m: env.get(m.group(1), ""), word))
assert argv[0] == "/opt/dflash-serve/dflash-serve", argv
argv[0] = binary
for flag, value in (("--port", port), ("--host", "127.0.0.1")):
    assert flag in argv, f"{envf} sets no {flag}"
    argv[argv.index(flag) + 1] = value
grace = float(argv[argv.index("--shutdown-grace-period") + 1])
stop = service["TimeoutStopSec"]
stop_s = float(stop[:-1]) if stop.endswith("s") else float(stop)
assert grace < stop_s, f"--shutdown-grace-period {grace} must stay below TimeoutStopSec {stop_s}"
assert service["KillSignal"] == "SIGTERM", service["KillSignal"]
print("\n".join(argv))
PY
mapfile -t ARGV < "$WORK/argv"
STOP_S=$(python3 - "$UNIT" <<'PY'
import sys
for line in open(sys.argv[1]):
    if line.startswith("TimeoutStopSec="):
        print(line.split("=", 1)[1].strip().rstrip("s"))
PY
)
echo "starting what the unit runs: ${ARGV[*]}"
set -a; . "$ENVF"; set +a
"${ARGV[@]}" > "$WORK/server.log" 2>&1 &
PID=$!
for _ in $(seq 1 900); do
  grep -q "fired up and ready to roll" "$WORK/server.log" && break
  kill -0 "$PID" 2>/dev/null || { cat "$WORK/server.log"; echo "the unit's command exited during startup" >&2; exit 1; }
  sleep 0.2
done
grep -q "fired up and ready to roll" "$WORK/server.log" || { cat "$WORK/server.log"; echo "not ready after 180 s" >&2; exit 1; }
URL=http://127.0.0.1:$PORT
METRICS=$(curl -fsS "$URL/metrics")
grep -q '^sglang:num_requests_total' <<<"$METRICS" || { echo "--enable-metrics from the env file did not reach the server" >&2; exit 1; }

# A request running when the stop signal arrives must finish.
curl -sS -N "$URL/generate" -H 'content-type: application/json' \
  -d '{"text":"def main():","stream":true,"sampling_params":{"max_new_tokens":200,"temperature":0,"ignore_eos":true}}' \
  > "$WORK/stream.txt" &
CURL=$!
for _ in $(seq 1 500); do
  [ "$(curl -fsS "$URL/get_load" | python3 -c 'import json,sys; print(json.load(sys.stdin)[0]["num_reqs"])')" = 1 ] && break
  sleep 0.02
done
T0=$(date +%s.%N)
kill -TERM "$PID"
STATUS=0; wait "$PID" || STATUS=$?
PID=
T1=$(date +%s.%N)
wait "$CURL"
ELAPSED=$(python3 -c "print(round($T1 - $T0, 2))")
[ "$STATUS" = 0 ] || { cat "$WORK/server.log"; echo "the server exited $STATUS after SIGTERM: systemd would count a failure" >&2; exit 1; }
python3 -c "import sys; sys.exit(0 if $ELAPSED < $STOP_S else 1)" || { echo "the drain took ${ELAPSED}s, over TimeoutStopSec=${STOP_S}s" >&2; exit 1; }
[ "$(tail -c 14 "$WORK/stream.txt")" = 'data: [DONE]' ] || { echo "the running request did not finish during the drain:" >&2; tail -c 500 "$WORK/stream.txt" >&2; exit 1; }
grep -q '"completion_tokens":200' "$WORK/stream.txt" || { echo "the running request was cut short" >&2; exit 1; }
grep -q "all requests finished; exiting" "$WORK/server.log" || { echo "no drain line in the server log" >&2; exit 1; }
echo "systemd check OK: the unit verifies; its command serves, drains a running request on SIGTERM and exits 0 in ${ELAPSED}s (TimeoutStopSec ${STOP_S}s)"
