#!/usr/bin/env python3
"""Load test of a running dflash-serve (or SGLang) server over HTTP, as `python -m
sglang.bench_serving --backend sglang --dataset-name random` drives one: streaming POST
/generate with `input_ids` of `--input-len` random tokens, `max_new_tokens` = `--output-len`,
`ignore_eos`, greedy; per concurrency level, `--prompts-per-level` requests (default `--waves`
= 4 per client, at least 8) kept `concurrency` in flight. Standard library only, so it runs on the GPU
machine (no network there) and in CI.

Per level it reports (JSON, `--out`): output tok/s over the level's wall time, per-request
decode tok/s (output tokens after the first / time after the first), TTFT and ITL percentiles
(ITL = gap between chunks / new tokens in the chunk, as bench_serving computes it), failed
requests with their first errors, `num_retractions` summed from meta_info (0 where the server
does not report it), `cached_tokens` summed from meta_info, and the mean spec_accept_length.

Usage:
  deploy/bench/load.py http://127.0.0.1:30000 --concurrency 1,8,32 --input-len 512 \\
      --output-len 256 --out load.json
"""

import argparse
import http.client
import json
import random
import sys
import threading
import time
import urllib.parse


def percentiles(xs, ps=(50, 90, 99)):
    if not xs:
        return {f"p{p}": None for p in ps}
    s = sorted(xs)
    return {f"p{p}": s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))] for p in ps}


def connect(base, timeout):
    u = urllib.parse.urlparse(base)
    return http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)


def get_json(base, path, timeout=30):
    c = connect(base, timeout)
    try:
        c.request("GET", path)
        r = c.getresponse()
        body = r.read()
        return r.status, (json.loads(body) if body else None)
    finally:
        c.close()


def wait_ready(base, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            status, body = get_json(base, "/v1/models", 5)
            if status == 200:
                return body["data"][0]["id"]
        except (OSError, http.client.HTTPException, ValueError, KeyError):
            pass
        time.sleep(0.5)
    raise SystemExit(f"{base}/v1/models is not ready after {timeout} s")


def one_request(base, input_ids, output_len, timeout):
    """One streaming /generate; what bench_serving's sglang backend records."""
    payload = {
        "input_ids": input_ids,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": output_len, "ignore_eos": True},
        "stream": True,
        "return_logprob": False,
        "logprob_start_len": -1,
    }
    out = {"success": False, "ttft": None, "itl": [], "output_len": 0, "error": "",
           "retractions": 0, "cached_tokens": 0, "accept_length": None}
    st = time.perf_counter()
    c = connect(base, timeout)
    try:
        c.request("POST", "/generate", body=json.dumps(payload),
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            out["error"] = f"HTTP {r.status}: {r.read()[:300]!r}"
            return out
        last, last_len = st, 0
        for raw in r:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            ev = json.loads(data)
            if "error" in ev:
                out["error"] = json.dumps(ev)[:300]
                return out
            meta = ev.get("meta_info") or {}
            n = meta.get("completion_tokens", last_len)
            out["retractions"] = meta.get("num_retractions", out["retractions"]) or 0
            out["cached_tokens"] = meta.get("cached_tokens", out["cached_tokens"]) or 0
            if meta.get("spec_accept_length") is not None:
                out["accept_length"] = meta["spec_accept_length"]
            if n > last_len:
                ts = time.perf_counter()
                if out["ttft"] is None:
                    out["ttft"] = ts - st
                else:
                    out["itl"].extend([(ts - last) / (n - last_len)] * (n - last_len))
                last, last_len = ts, n
        out["output_len"] = last_len
        out["latency"] = time.perf_counter() - st
        out["success"] = last_len == output_len
        if not out["success"]:
            out["error"] = f"stream ended after {last_len} of {output_len} tokens"
    except (OSError, http.client.HTTPException, ValueError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        c.close()
    return out


def run_level(base, concurrency, n, input_len, output_len, vocab, seed, timeout):
    rng = random.Random(seed + concurrency)
    reqs = [[rng.randrange(10, vocab) for _ in range(input_len)] for _ in range(n)]
    outs, lock, nxt = [], threading.Lock(), [0]

    def client():
        while True:
            with lock:
                if nxt[0] >= len(reqs):
                    return
                i = nxt[0]
                nxt[0] += 1
            o = one_request(base, reqs[i], output_len, timeout)
            with lock:
                outs.append(o)

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ok = [o for o in outs if o["success"]]
    tokens = sum(o["output_len"] for o in outs)
    per_req = [(o["output_len"] - 1) / (o["latency"] - o["ttft"]) for o in ok
               if o["output_len"] > 1 and o["latency"] > o["ttft"]]
    itl = [x for o in ok for x in o["itl"]]
    acc = [o["accept_length"] for o in ok if o["accept_length"] is not None]
    return {
        "concurrency": concurrency,
        "requests": len(outs),
        "failed": len(outs) - len(ok),
        "errors": sorted({o["error"] for o in outs if not o["success"]})[:5],
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tok_per_s": tokens / wall if wall > 0 else 0.0,
        "per_request_tok_per_s": percentiles(per_req) | {"mean": sum(per_req) / len(per_req) if per_req else None},
        "ttft_ms": {k: (v * 1e3 if v is not None else None) for k, v in percentiles([o["ttft"] for o in ok]).items()},
        "itl_ms": {k: (v * 1e3 if v is not None else None) for k, v in percentiles(itl).items()},
        "retractions": sum(o["retractions"] for o in outs),
        "cached_tokens": sum(o["cached_tokens"] for o in outs),
        "mean_spec_accept_length": sum(acc) / len(acc) if acc else None,
    }


def stream_body(input_ids, output_len):
    return json.dumps({"input_ids": input_ids, "stream": True, "sampling_params": {
        "temperature": 0.0, "max_new_tokens": output_len, "ignore_eos": True}}).encode()


def stream_times(base, input_ids, output_len, timeout, times, body=None):
    """One streaming request that appends (time, new tokens) per chunk to `times`; `body`:
    the request already serialised (`stream_body`)."""
    c = connect(base, timeout)
    try:
        body = body if body is not None else stream_body(input_ids, output_len)
        c.request("POST", "/generate", body=body, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        last = 0
        for raw in r:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            n = (json.loads(line[5:]).get("meta_info") or {}).get("completion_tokens", last)
            if n > last:
                times.append((time.perf_counter(), n - last))
                last = n
        return r.status
    finally:
        c.close()


def interference(base, streams, long_len, output_len, vocab, seed, timeout):
    """`streams` requests decode; once they are steady, one prompt of `long_len` tokens
    arrives. Reports the streams' inter-token latency before it (steady) and while it is
    prefilled (from its arrival to its first token), as SGLang's chunked prefill is judged."""
    rng = random.Random(seed)
    # The long prompt and its body are made before anything is timed: making them holds
    # Python's lock for ~30 ms, which stalled every stream's reader thread right before the
    # long prompt was sent (a ~40 ms gap in every stream that the server's step log did not
    # have; h200-2026-12-06-s16-interf).
    long_body = stream_body([rng.randrange(10, vocab) for _ in range(long_len)], 1)
    per = [[] for _ in range(streams)]
    threads = [threading.Thread(target=stream_times, args=(
        base, [rng.randrange(10, vocab) for _ in range(512)], output_len, timeout, per[i]))
        for i in range(streams)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    while min(len(p) for p in per) < 8:  # every stream decoding
        time.sleep(0.05)
    steady_from = time.perf_counter()
    time.sleep(2.0)
    t0_unix = time.time()
    t0 = time.perf_counter()
    long_times = []
    status = stream_times(base, None, 1, timeout, long_times, body=long_body)
    t1 = long_times[0][0] if long_times else time.perf_counter()
    for t in threads:
        t.join()

    def gaps(lo, hi):
        """Per-token gaps of the streams' chunks whose interval overlaps [lo, hi]."""
        return [(b - a) / n for p in per for (a, _), (b, n) in zip(p, p[1:])
                if a < hi and b > lo for _ in range(n)]

    steady = [g for p in per for (a, _), (b, n) in zip(p, p[1:]) if steady_from <= a and b <= t0
              for g in [(b - a) / n] * n]
    during = gaps(t0, t1)
    # The largest gaps: (ms per token, ms after the long prompt was sent, stream), to find
    # the server's step that made them (its step log, RUST_LOG=dflash_serve::steps=debug).
    top = sorted(((b - a) / n * 1e3, (a - t0) * 1e3, i) for i, p in enumerate(per)
                 for (a, _), (b, n) in zip(p, p[1:]) if a < t1 and b > t0)[-10:][::-1]
    pct = lambda xs: {k: (v * 1e3 if v is not None else None) for k, v in percentiles(xs).items()}
    med = percentiles(steady)["p50"]
    return {"streams": streams, "long_prompt_tokens": long_len, "long_status": status,
            "long_sent_unix": t0_unix, "largest_gaps_ms_at_ms_stream": top,
            "long_prefill_ms": (t1 - t0) * 1e3, "steady_itl_ms": pct(steady),
            "itl_during_prefill_ms": pct(during) | {"max": max(during) * 1e3 if during else None},
            "max_during_over_steady_p50": (max(during) / med) if during and med else None}


def shared_prefix(base, prefix_len, suffix_len, output_len, vocab, seed, timeout, repeats):
    """Time to first token of a request whose prompt starts with `prefix_len` tokens that an
    earlier request sent (the prefix cache's case: a shared system prompt or chat history)
    against the first (cold) request with that prefix; a fresh random prefix per repeat."""
    rng = random.Random(seed)
    rows = []
    for _ in range(repeats):
        prefix = [rng.randrange(10, vocab) for _ in range(prefix_len)]
        suffix = lambda: [rng.randrange(10, vocab) for _ in range(suffix_len)]
        cold = one_request(base, prefix + suffix(), output_len, timeout)
        warm = one_request(base, prefix + suffix(), output_len, timeout)
        if not (cold["success"] and warm["success"]):
            rows.append({"error": cold["error"] or warm["error"]})
            continue
        rows.append({"cold_ttft_ms": cold["ttft"] * 1e3, "warm_ttft_ms": warm["ttft"] * 1e3,
                     "cold_cached_tokens": cold["cached_tokens"],
                     "warm_cached_tokens": warm["cached_tokens"],
                     "speedup": cold["ttft"] / warm["ttft"]})
    ok = [r for r in rows if "speedup" in r]
    med = lambda k: percentiles([r[k] for r in ok])["p50"]
    return {"prefix_len": prefix_len, "suffix_len": suffix_len, "repeats": rows,
            "cold_ttft_ms_p50": med("cold_ttft_ms") if ok else None,
            "warm_ttft_ms_p50": med("warm_ttft_ms") if ok else None,
            "speedup_p50": med("speedup") if ok else None, "failed": len(rows) - len(ok)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("url")
    ap.add_argument("--concurrency", default="1,8,32", help="comma-separated levels")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--prompts-per-level", type=int, default=0,
                    help="requests per level (default: --waves per client, at least 8)")
    ap.add_argument("--waves", type=int, default=4,
                    help="requests per client at each level when --prompts-per-level is 0")
    ap.add_argument("--vocab", type=int, default=0,
                    help="random token ids below this (default: the server's vocab_size from /model_info, else 8192)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per request")
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    ap.add_argument("--out", help="write the JSON report here too")
    ap.add_argument("--interference", type=int, default=0, metavar="LONG_LEN",
                    help="instead of the levels: --interference-streams streams decode and one "
                         "prompt of LONG_LEN tokens arrives; report their ITL during its prefill")
    ap.add_argument("--interference-streams", type=int, default=16)
    ap.add_argument("--shared-prefix", type=int, default=0, metavar="PREFIX_LEN",
                    help="instead of levels: TTFT of a second request sharing a PREFIX_LEN-token "
                         "prefix with a first one, against the first (prefix cache)")
    ap.add_argument("--shared-prefix-repeats", type=int, default=5)
    ap.add_argument("--require-no-failures", action="store_true",
                    help="exit 1 if any request at any level failed")
    a = ap.parse_args()
    base = a.url.rstrip("/")
    model = wait_ready(base, a.ready_timeout)
    vocab = a.vocab
    if not vocab:
        try:
            _, info = get_json(base, "/model_info")
            vocab = int((info or {}).get("vocab_size") or 8192)
        except (OSError, http.client.HTTPException, ValueError, TypeError):
            vocab = 8192
    warm = one_request(base, [11] * min(a.input_len, 16), 4, a.timeout)
    if not warm["success"]:
        raise SystemExit(f"warm-up request failed: {warm['error']}")
    _, server_info = get_json(base, "/server_info")
    if a.shared_prefix:
        r = shared_prefix(base, a.shared_prefix, 64, 4, vocab, a.seed, a.timeout,
                          a.shared_prefix_repeats)
        r["command"] = " ".join(sys.argv)
        print(json.dumps(r, indent=1))
        if a.out:
            with open(a.out, "w") as f:
                json.dump(r, f, indent=1)
        return
    if a.interference:
        r = interference(base, a.interference_streams, a.interference, a.output_len, vocab,
                         a.seed, a.timeout)
        r["command"] = " ".join(sys.argv)
        print(json.dumps(r, indent=1))
        if a.out:
            with open(a.out, "w") as f:
                json.dump(r, f, indent=1)
        return
    levels = [int(x) for x in a.concurrency.split(",") if x.strip()]
    report = {"url": base, "model": model, "input_len": a.input_len, "output_len": a.output_len,
              "vocab": vocab, "command": " ".join(sys.argv), "levels": []}
    for c in levels:
        n = a.prompts_per_level or max(8, a.waves * c)
        lvl = run_level(base, c, n, a.input_len, a.output_len, vocab, a.seed, a.timeout)
        report["levels"].append(lvl)
        print(f"concurrency {c:4d}: {lvl['requests']} requests, {lvl['failed']} failed, "
              f"{lvl['output_tok_per_s']:.1f} output tok/s, per-request "
              f"{lvl['per_request_tok_per_s']['p50'] or 0:.1f} tok/s (p50), TTFT p50 "
              f"{lvl['ttft_ms']['p50'] or 0:.0f} ms, ITL p50 {lvl['itl_ms']['p50'] or 0:.1f} ms, "
              f"retractions {lvl['retractions']}", flush=True)
    report["server_info"] = {k: server_info.get(k) for k in
                             ("max_total_num_tokens", "max_running_requests", "device",
                              "speculative_algorithm", "context_length") if isinstance(server_info, dict)}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    if a.require_no_failures and any(l["failed"] for l in report["levels"]):
        raise SystemExit("some requests failed")


if __name__ == "__main__":
    main()
