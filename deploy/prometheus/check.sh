#!/usr/bin/env bash
# A real Prometheus (Debian's `prometheus` package, installed here if missing) scrapes a running
# dflash-serve with deploy/prometheus/prometheus.yml; read_back.py then reads the server's
# numbers back through Prometheus's HTTP API and runs every Grafana dashboard query
# (deploy/grafana/dflash-serve.json). Run by .ci/run.
# Usage: deploy/prometheus/check.sh [path/to/dflash-serve]   (default: target/debug/dflash-serve)
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${1:-target/debug/dflash-serve}
[ -x "$BIN" ] || { echo "no dflash-serve binary at $BIN: build it with cargo build -p dflash-serve" >&2; exit 1; }

. deploy/need.sh
need curl curl
need prometheus prometheus
need promtool prometheus
prometheus --version 2>&1 | head -1

WORK=$(mktemp -d)
SERVER_PID=; PROM_PID=
cleanup() {
  for p in $PROM_PID $SERVER_PID; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

SPORT=$(free_port)
"$BIN" --host 127.0.0.1 --port "$SPORT" --enable-metrics > "$WORK/server.log" 2>&1 &
SERVER_PID=$!

# The shipped config as it is; only the target files name this run's port.
cp -r deploy/prometheus/prometheus.yml deploy/prometheus/targets "$WORK/"
cat > "$WORK/targets/dflash-serve.json" <<EOF
[{"targets": ["127.0.0.1:$SPORT"], "labels": {"service": "dflash-serve"}}]
EOF
echo '[]' > "$WORK/targets/sglang-router.json"
promtool check config "$WORK/prometheus.yml"

for _ in $(seq 1 900); do
  grep -q "fired up and ready to roll" "$WORK/server.log" && break
  kill -0 "$SERVER_PID" 2>/dev/null || { cat "$WORK/server.log"; echo "dflash-serve exited during startup" >&2; exit 1; }
  sleep 0.2
done
grep -q "fired up and ready to roll" "$WORK/server.log" || { cat "$WORK/server.log"; echo "dflash-serve not ready after 180 s" >&2; exit 1; }
curl -fsS "http://127.0.0.1:$SPORT/metrics" > "$WORK/metrics.txt"
promtool check metrics < "$WORK/metrics.txt" > "$WORK/lint.txt" 2>&1 || true
# Parse errors (not lint advice such as missing HELP) would make Prometheus drop the scrape.
if grep -qiE "error while linting|text format parsing error" "$WORK/lint.txt"; then
  cat "$WORK/lint.txt" >&2; echo "promtool cannot parse /metrics" >&2; exit 1
fi

PPORT=$(free_port)
prometheus --config.file="$WORK/prometheus.yml" --storage.tsdb.path="$WORK/data" \
  --web.listen-address="127.0.0.1:$PPORT" > "$WORK/prometheus.log" 2>&1 &
PROM_PID=$!
for _ in $(seq 1 150); do
  curl -fsS "http://127.0.0.1:$PPORT/-/ready" >/dev/null 2>&1 && break
  kill -0 "$PROM_PID" 2>/dev/null || { cat "$WORK/prometheus.log"; echo "prometheus exited during startup" >&2; exit 1; }
  sleep 0.2
done
curl -fsS "http://127.0.0.1:$PPORT/-/ready" >/dev/null || { cat "$WORK/prometheus.log"; echo "prometheus not ready" >&2; exit 1; }

if ! python3 deploy/prometheus/read_back.py "http://127.0.0.1:$PPORT" "http://127.0.0.1:$SPORT" deploy/grafana/dflash-serve.json; then
  tail -20 "$WORK/prometheus.log" >&2
  exit 1
fi
echo "prometheus check OK"
