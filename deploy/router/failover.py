#!/usr/bin/env python3
"""Drives sglang-router in front of dflash-serve replicas and checks what clients see
(deploy/router/test.sh runs it; standard library only).

Modes:
  spread     sequential requests; with --expect-even (round_robin) every replica's
             sglang:num_requests_total must grow by exactly the same amount; with
             --expect-sticky (cache_aware) repeats of one long prompt must all land on the
             replica that served it first.
  failover   --requests requests (/generate and /v1/chat/completions, streaming and not,
             --concurrency at a time). After a quarter of them complete, --kill's replica is
             SIGKILLed while it runs requests; after a half, --drain's replica gets SIGTERM
             and drains. Checks:
               * every failed request was in flight when the replica was killed, and there are
                 no more of them than the killed replica was running (read from its /get_load
                 just before the kill, plus any request the client started in between);
               * the drain costs no request;
               * every request started after the drained replica exited succeeds, and the
                 survivor's own counter shows it served them;
               * before the kill, every replica served traffic.
             A JSON report goes to --out.
"""

import argparse
import http.client
import json
import os
import queue
import signal
import sys
import threading
import time
import urllib.parse
import urllib.request

PROMPTS = [
    "def fibonacci(n):",
    "import numpy as np\n\ndef normalize(v):",
    "class Stack:\n    def __init__(self):",
    "# read a file and count the words\n",
    "def quicksort(xs):",
    "from collections import Counter\n",
    "async def fetch(url):",
    "def is_prime(n):",
    "class Matrix:\n",
    "def parse_args():\n    parser =",
    "import json\n\ndef load(path):",
    "def binary_search(a, x):",
]
KINDS = [("generate", False), ("generate", True), ("chat", False), ("chat", True)]


def metric(base, name="sglang:num_requests_total"):
    """A replica's counter from its /metrics (summed over its series: request counters carry
    SGLang's `is_streaming` label), or None when it does not answer."""
    try:
        with urllib.request.urlopen(f"{base}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    ]
    if not values:
        raise SystemExit(f"{base}/metrics has no {name}")
    return sum(values)


def load_of(base):
    with urllib.request.urlopen(f"{base}/get_load", timeout=5) as r:
        return json.load(r)[0]["num_reqs"]


def request_body(kind, stream, prompt, max_tokens):
    if kind == "generate":
        return "/generate", {
            "text": prompt,
            "stream": stream,
            "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
        }
    return "/v1/chat/completions", {
        "model": "tiny-coder-demo",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def check_result(kind, stream, status, body, max_tokens):
    """None when the response is a complete, well-formed success; else what is wrong."""
    if status != 200:
        return f"HTTP {status}: {body[:200]!r}"
    if not stream:
        try:
            v = json.loads(body)
        except ValueError:
            return f"not JSON: {body[:200]!r}"
        if kind == "generate":
            ok = v.get("meta_info", {}).get("completion_tokens") == max_tokens
        else:
            ok = v.get("usage", {}).get("completion_tokens") == max_tokens and v["choices"][0][
                "finish_reason"
            ] == "length"
        return None if ok else f"incomplete: {body[:300]!r}"
    events = [e for e in body.split("\n\n") if e.strip()]
    if not events or events[-1] != "data: [DONE]":
        return f"stream cut after {len(events)} events (no [DONE]): {body[-200:]!r}"
    payloads = []
    for e in events[:-1]:
        if not e.startswith("data: "):
            return f"not an SSE data line: {e[:200]!r}"
        v = json.loads(e[len("data: "):])
        if "error" in v:
            return f"error event: {e[:300]!r}"
        payloads.append(v)
    if kind == "generate":
        done = payloads[-1]["meta_info"].get("finish_reason")
    else:
        done = next((c["choices"][0]["finish_reason"] for c in reversed(payloads) if c.get("choices")), None)
    return None if done else f"stream ended without a finish reason: {body[-300:]!r}"


def send(router, i, max_tokens):
    kind, stream = KINDS[i % len(KINDS)]
    prompt = f"{PROMPTS[i % len(PROMPTS)]}  # case {i}"
    path, body = request_body(kind, stream, prompt, max_tokens)
    u = urllib.parse.urlparse(router)
    rec = {"i": i, "kind": kind, "stream": stream, "t0": time.time()}
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        rec["status"] = resp.status
        raw = b""
        try:
            while True:
                chunk = resp.read1(65536) if stream else resp.read()
                if not chunk:
                    break
                raw += chunk
                if not stream:
                    break
        except (http.client.IncompleteRead, ConnectionError, OSError) as e:
            rec["transport"] = f"{type(e).__name__}: {e}"
        text = raw.decode(errors="replace")
        problem = check_result(kind, stream, resp.status, text, max_tokens)
        if problem and "transport" in rec:
            problem = f"{rec['transport']}; {problem}"
        rec["error"] = problem
    except (ConnectionError, OSError, http.client.HTTPException) as e:
        rec["status"] = None
        rec["error"] = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    rec["t1"] = time.time()
    return rec


def spread(args):
    bases = args.replica
    before = [metric(b) for b in bases]
    if args.expect_sticky:
        prompt_i = 0
        records = [send(args.router, prompt_i * len(KINDS), args.max_tokens) for _ in range(args.requests)]
    else:
        records = [send(args.router, i, args.max_tokens) for i in range(args.requests)]
    bad = [r for r in records if r["error"]]
    if bad:
        raise SystemExit(f"{len(bad)} requests failed through the router: {bad[:3]}")
    after = [metric(b) for b in bases]
    served = [int(a - b) for a, b in zip(after, before)]
    print(f"  {args.requests} sequential requests; served per replica: {served}")
    if sum(served) != args.requests:
        raise SystemExit(f"replicas counted {sum(served)} requests, {args.requests} were sent")
    if args.expect_even and len(set(served)) != 1:
        raise SystemExit(f"round_robin did not spread evenly: {served}")
    if args.expect_sticky and sorted(served)[-1] != args.requests:
        raise SystemExit(f"cache_aware sent one repeated prompt to several replicas: {served}")


def failover(args):
    bases = args.replica
    kill_base, kill_pid = args.kill.split("=")
    drain_base, drain_pid, drain_log = args.drain.split("=")
    survivors = [b for b in bases if b not in (kill_base, drain_base)]
    if len(survivors) != 1:
        raise SystemExit(f"need exactly one survivor, have {survivors}")
    survivor = survivors[0]
    todo = queue.Queue()
    for i in range(args.requests):
        todo.put(i)
    records = []
    lock = threading.Lock()

    def worker():
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            rec = send(args.router, i, args.max_tokens)
            with lock:
                records.append(rec)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(args.concurrency)]
    t_start = time.time()
    for t in threads:
        t.start()

    def completed():
        with lock:
            return len(records)

    def wait_completed(n):
        while completed() < n:
            if not any(t.is_alive() for t in threads):
                raise SystemExit("the client threads stopped early")
            time.sleep(0.02)

    report = {"requests": args.requests, "concurrency": args.concurrency, "max_tokens": args.max_tokens}
    wait_completed(args.requests // 4)
    # Kill the replica while it is running requests, so some are in flight.
    victim_running = 0
    deadline = time.time() + 20
    while time.time() < deadline:
        t_read = time.time()
        victim_running = load_of(kill_base)
        if victim_running >= 1:
            break
        time.sleep(0.01)
    served_before_kill = {b: metric(b) for b in bases}
    os.kill(int(kill_pid), signal.SIGKILL)
    t_kill = time.time()
    report.update(
        killed=kill_base,
        killed_running_at_kill=victim_running,
        served_before_kill=served_before_kill,
        t_kill=t_kill - t_start,
    )
    print(f"  SIGKILL {kill_base} while it ran {victim_running} requests "
          f"({completed()} of {args.requests} done)")
    if victim_running < 1:
        raise SystemExit(f"{kill_base} ran no request for 20 s: the router sent it no traffic")
    idle = [b for b, n in served_before_kill.items() if not n]
    if idle:
        raise SystemExit(f"replicas that served nothing before the kill: {idle}")

    wait_completed(args.requests // 2)
    os.kill(int(drain_pid), signal.SIGTERM)
    t_drain = time.time()
    print(f"  SIGTERM {drain_base} ({completed()} done)")
    deadline = time.time() + 120
    while "all requests finished; exiting" not in open(drain_log).read():
        if time.time() > deadline:
            raise SystemExit(f"{drain_base} did not finish draining in 120 s")
        time.sleep(0.05)
    t_drained = time.time()
    survivor_at_drained = metric(survivor)
    print(f"  {drain_base} drained and exited {t_drained - t_drain:.2f} s after SIGTERM "
          f"({completed()} done)")
    for t in threads:
        t.join()
    t_end = time.time()

    errors = [r for r in records if r["error"]]
    in_flight_at_kill = [r for r in errors if r["t0"] < t_kill <= r["t1"]]
    others = [r for r in errors if r not in in_flight_at_kill]
    started_in_gap = sum(1 for r in records if t_read <= r["t0"] < t_kill)
    late = [r for r in records if r["t0"] >= t_drained]
    survivor_served_late = metric(survivor) - survivor_at_drained
    report.update(
        drained=drain_base,
        t_drain=t_drain - t_start,
        drain_seconds=t_drained - t_drain,
        survivor=survivor,
        wall_seconds=t_end - t_start,
        ok=len(records) - len(errors),
        errors=len(errors),
        errors_in_flight_at_kill=len(in_flight_at_kill),
        errors_other=len(others),
        error_details=[{k: r.get(k) for k in ("i", "kind", "stream", "status", "error")} for r in errors],
        by_kind={
            f"{k}{' stream' if s else ''}": sum(1 for r in records if (r["kind"], r["stream"]) == (k, s))
            for k, s in KINDS
        },
        started_after_drain_exit=len(late),
        survivor_served_after_drain_exit=survivor_served_late,
        served_at_end={b: metric(b) for b in bases},
    )
    if args.router_metrics:
        with urllib.request.urlopen(args.router_metrics, timeout=5) as r:
            text = r.read().decode()
        for name in ("smg_worker_retries_total", "smg_worker_retries_exhausted_total"):
            report[f"router_{name}"] = sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith(name + "{") or line.startswith(name + " ")
            )
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"  {len(records)} requests in {t_end - t_start:.1f} s: {report['ok']} ok, "
          f"{len(errors)} failed ({len(in_flight_at_kill)} in flight on the killed replica)"
          + (f"; the router retried {report['router_smg_worker_retries_total']:.0f} times, "
             f"gave up {report['router_smg_worker_retries_exhausted_total']:.0f} times"
             if args.router_metrics else ""))
    for r in errors:
        print(f"    #{r['i']} {r['kind']}{' stream' if r['stream'] else ''}: {r['error'][:160]}")
    if len(records) != args.requests:
        raise SystemExit(f"only {len(records)} of {args.requests} requests ran")
    if others:
        raise SystemExit(f"{len(others)} requests failed that were not in flight at the kill: {others[:3]}")
    if len(in_flight_at_kill) > victim_running + started_in_gap:
        raise SystemExit(
            f"{len(in_flight_at_kill)} in-flight failures, but the killed replica ran only "
            f"{victim_running} (+{started_in_gap} started just before the kill)"
        )
    if not late:
        raise SystemExit("no request started after the drained replica exited: raise --requests")
    if survivor_served_late < len(late):
        raise SystemExit(
            f"{len(late)} requests started after the drain, but the survivor counted only "
            f"{survivor_served_late}"
        )
    print(f"  traffic moved to the survivor: {len(late)} requests after the drain, "
          f"{int(survivor_served_late)} served by {survivor}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["spread", "failover"])
    p.add_argument("--router", required=True)
    p.add_argument("--replica", action="append", required=True, help="a replica's base URL (repeat)")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--expect-even", action="store_true")
    p.add_argument("--expect-sticky", action="store_true")
    p.add_argument("--kill", help="URL=PID of the replica to SIGKILL")
    p.add_argument("--drain", help="URL=PID=LOG of the replica to SIGTERM")
    p.add_argument("--router-metrics", help="the router's own /metrics (--prometheus-port), for its retry counts")
    p.add_argument("--out", default="router-failover.json")
    args = p.parse_args()
    if args.mode == "spread":
        spread(args)
    else:
        if not (args.kill and args.drain):
            p.error("failover needs --kill and --drain")
        failover(args)


if __name__ == "__main__":
    sys.exit(main())
