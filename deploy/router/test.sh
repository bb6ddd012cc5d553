#!/usr/bin/env bash
# sglang-router (the pinned PyPI release in requirements.txt) in front of three dflash-serve CPU
# replicas of the bundled demo pair (run by .ci/run; README "Scaling out" shows these commands):
#  1. round_robin: sequential requests land evenly on the three replicas;
#  2. cache_aware: repeats of one prompt stay on one replica; then 300 requests (/generate and
#     /v1/chat/completions, streaming and not, 6 at a time) while one replica is SIGKILLed
#     mid-run and another drained with SIGTERM: the only failures allowed are requests in flight
#     on the killed replica (counted and reported), and traffic moves to the survivor.
# Usage: deploy/router/test.sh [path/to/dflash-serve]   (default: target/debug/dflash-serve)
# The router goes into target/router-venv (DFLASH_ROUTER_VENV overrides); the failover report
# into $DFLASH_ROUTER_REPORT (default: target/router-failover.json).
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${1:-target/debug/dflash-serve}
[ -x "$BIN" ] || { echo "no dflash-serve binary at $BIN: build it with cargo build -p dflash-serve" >&2; exit 1; }
. deploy/need.sh
need curl curl
VENV=${DFLASH_ROUTER_VENV:-target/router-venv}
REPORT=${DFLASH_ROUTER_REPORT:-target/router-failover.json}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -r deploy/router/requirements.txt
"$VENV/bin/python" -c 'import importlib.metadata as m; print("sglang-router", m.version("sglang-router"))'

WORK=$(mktemp -d)
PIDS=()
ROUTER_PID=
cleanup() {
  for p in $ROUTER_PID "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
dump_logs() { for f in "$WORK"/*.log; do echo "== $f"; tail -30 "$f"; done >&2; }

# Three replicas, one CPU thread each (the machine has two cores).
URLS=()
for n in 1 2 3; do
  port=$(free_port)
  RAYON_NUM_THREADS=1 "$BIN" --host 127.0.0.1 --port "$port" --enable-metrics \
    --shutdown-grace-period 30 > "$WORK/replica$n.log" 2>&1 &
  PIDS+=($!)
  URLS+=("http://127.0.0.1:$port")
done
for n in 0 1 2; do
  for _ in $(seq 1 900); do
    grep -q "fired up and ready to roll" "$WORK/replica$((n+1)).log" && break
    kill -0 "${PIDS[$n]}" 2>/dev/null || { dump_logs; echo "replica $((n+1)) exited during startup" >&2; exit 1; }
    sleep 0.2
  done
  grep -q "fired up and ready to roll" "$WORK/replica$((n+1)).log" || { dump_logs; echo "replica $((n+1)) not ready" >&2; exit 1; }
done
echo "replicas: ${URLS[*]}"

RPORT= MPORT=
start_router() {  # POLICY [extra flags]
  RPORT=$(free_port)
  MPORT=$(free_port)
  # Health checks every second and one failure to drop a replica (defaults: 60 s and 3); retries
  # that outlast that second (10 attempts, backoff 50 ms x 1.5^n: about 4 s; default 5, 0.4 s),
  # since cache_aware keeps choosing a dead or draining replica for prompts it has seen until
  # the health check drops it.
  "$VENV/bin/python" -m sglang_router.launch_router --host 127.0.0.1 --port "$RPORT" \
    --worker-urls "${URLS[@]}" --policy "$@" \
    --health-check-interval-secs 1 --health-failure-threshold 1 --worker-startup-check-interval 1 \
    --retry-max-retries 10 \
    --prometheus-host 127.0.0.1 --prometheus-port "$MPORT" --log-level warn \
    > "$WORK/router-$1.log" 2>&1 &
  ROUTER_PID=$!
  for _ in $(seq 1 150); do
    if [ "$(curl -fsS "http://127.0.0.1:$RPORT/workers" 2>/dev/null | python3 -c 'import json,sys; print(sum(w["is_healthy"] for w in json.load(sys.stdin)["workers"]))' 2>/dev/null)" = 3 ]; then
      echo "router ($1) on port $RPORT with 3 healthy workers"
      return
    fi
    kill -0 "$ROUTER_PID" 2>/dev/null || { dump_logs; echo "the router exited during startup" >&2; exit 1; }
    sleep 0.2
  done
  dump_logs; echo "the router did not register the three replicas" >&2; exit 1
}
stop_router() { kill "$ROUTER_PID"; wait "$ROUTER_PID" 2>/dev/null || true; ROUTER_PID=; }
REPLICA_ARGS=()
for u in "${URLS[@]}"; do REPLICA_ARGS+=(--replica "$u"); done
ROUTER() { echo "http://127.0.0.1:$RPORT"; }

# What the router polls on each replica answers as SGLang's does.
for u in "${URLS[@]}"; do
  for path in /health /get_server_info /get_model_info /get_load /v1/models; do
    curl -fsS -o /dev/null "$u$path" || { echo "$u$path does not answer 200" >&2; exit 1; }
  done
done

start_router round_robin
python3 deploy/router/failover.py spread --router "$(ROUTER)" "${REPLICA_ARGS[@]}" --requests 30 --expect-even
# The router's own /get_loads reads every replica's /get_load.
curl -fsS "$(ROUTER)/get_loads" | python3 -c '
import json, sys
loads = json.load(sys.stdin)["workers"]
assert len(loads) == 3 and all(w["load"] >= 0 for w in loads), loads
print("  router /get_loads:", [w["load"] for w in loads])'
stop_router

# cache_aware balances by shortest queue once a replica runs more than --balance-abs-threshold
# requests over the least loaded one (default 64: with six clients it would never balance).
start_router cache_aware --balance-abs-threshold 2
python3 deploy/router/failover.py spread --router "$(ROUTER)" "${REPLICA_ARGS[@]}" --requests 6 --expect-sticky
mkdir -p "$(dirname "$REPORT")"
if ! python3 deploy/router/failover.py failover --router "$(ROUTER)" "${REPLICA_ARGS[@]}" \
    --requests 300 --concurrency 6 --max-tokens 16 \
    --kill "${URLS[0]}=${PIDS[0]}" --drain "${URLS[1]}=${PIDS[1]}=$WORK/replica2.log" \
    --router-metrics "http://127.0.0.1:$MPORT/metrics" --out "$REPORT"; then
  dump_logs; exit 1
fi
STATUS=0; wait "${PIDS[0]}" || STATUS=$?
[ "$STATUS" = 137 ] || { echo "the killed replica exited $STATUS, not 137 (SIGKILL)" >&2; exit 1; }
STATUS=0; wait "${PIDS[1]}" || STATUS=$?
[ "$STATUS" = 0 ] || { dump_logs; echo "the drained replica exited $STATUS after SIGTERM" >&2; exit 1; }
HEALTHY=$(curl -fsS "$(ROUTER)/workers" | python3 -c 'import json,sys; print(" ".join(w["url"] for w in json.load(sys.stdin)["workers"] if w["is_healthy"]))')
[ "$HEALTHY" = "${URLS[2]}" ] || { echo "the router still counts as healthy: $HEALTHY" >&2; exit 1; }
stop_router
echo "router test OK (report: $REPORT)"
