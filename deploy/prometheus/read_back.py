#!/usr/bin/env python3
"""Reads dflash-serve's metrics back through a running Prometheus's HTTP API (deploy/prometheus/check.sh).

1. Waits until Prometheus scrapes the server (`up{job="dflash-serve"} == 1`).
2. Sends requests to the server (native and OpenAI, streaming and not) and sums the
   completion tokens the server reported.
3. Waits until Prometheus holds exactly those numbers: sglang:num_requests_total equals the
   requests sent and sglang:generation_tokens_total the tokens the responses reported.
4. Evaluates every query of the Grafana dashboard (deploy/grafana/dflash-serve.json), with its
   variables set to match everything, and requires each to succeed with at least one series,
   so a panel over a misspelt or missing metric fails the check.
Standard library only. Usage: read_back.py PROMETHEUS_URL SERVER_URL DASHBOARD_JSON
"""

import json
import re
import sys
import time
import urllib.parse
import urllib.request

TIMEOUT_S = 60


def get_json(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)


def post_json(url, body):
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.read().decode()


def query(prom, expr):
    v = get_json(f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    if v.get("status") != "success":
        raise SystemExit(f"Prometheus refused {expr!r}: {v}")
    return v["data"]["result"]


def scalar(prom, expr):
    result = query(prom, expr)
    return float(result[0]["value"][1]) if result else None


def wait_for(what, fn, want):
    deadline = time.monotonic() + TIMEOUT_S
    got = None
    while time.monotonic() < deadline:
        got = fn()
        if got == want:
            print(f"  {what} = {got}")
            return
        time.sleep(0.5)
    raise SystemExit(f"{what}: Prometheus shows {got}, expected {want} after {TIMEOUT_S} s")


def send_requests(server):
    tokens = 0
    n = 0
    for prompt, max_new in (("def fib(n):", 8), ("import os\n", 5)):
        v = json.loads(
            post_json(
                f"{server}/generate",
                {"text": prompt, "sampling_params": {"max_new_tokens": max_new, "temperature": 0}},
            )
        )
        tokens += v["meta_info"]["completion_tokens"]
        n += 1
    body = post_json(
        f"{server}/generate",
        {"text": "class A:", "stream": True, "sampling_params": {"max_new_tokens": 6}},
    )
    events = [e[len("data: "):] for e in body.split("\n\n") if e.startswith("data: ")]
    if events[-1] != "[DONE]":
        raise SystemExit(f"stream did not end with [DONE]: {body[-300:]}")
    tokens += json.loads(events[-2])["meta_info"]["completion_tokens"]
    n += 1
    v = json.loads(
        post_json(
            f"{server}/v1/chat/completions",
            {"model": "tiny-coder-demo", "max_tokens": 7,
             "messages": [{"role": "user", "content": "write a loop"}]},
        )
    )
    tokens += v["usage"]["completion_tokens"]
    n += 1
    return n, tokens


def dashboard_queries(path):
    """Every panel query, after checking what Grafana needs to lay the panels out: unique panel
    ids and refIds, and grid positions inside the 24-column grid that do not overlap."""
    dash = json.load(open(path))
    ids = [p["id"] for p in dash["panels"]]
    if len(set(ids)) != len(ids):
        raise SystemExit(f"{path}: duplicate panel ids {ids}")
    cells = {}
    for panel in dash["panels"]:
        g = panel["gridPos"]
        if g["x"] < 0 or g["x"] + g["w"] > 24:
            raise SystemExit(f"{path}: panel {panel['title']!r} leaves the 24-column grid: {g}")
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                if (x, y) in cells:
                    raise SystemExit(f"{path}: panels {cells[(x, y)]!r} and {panel['title']!r} overlap")
                cells[(x, y)] = panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        if len(set(refs)) != len(refs) or not refs:
            raise SystemExit(f"{path}: panel {panel['title']!r} has no or duplicate refIds {refs}")
    names = {v["name"] for v in dash["templating"]["list"]}
    if not {"datasource", "model_name", "instance"} <= names:
        raise SystemExit(f"{path}: templating variables {names} lack datasource, model_name or instance")
    for panel in dash["panels"]:
        for t in panel.get("targets", []):
            yield panel["title"], t["expr"]


def main():
    prom, server, dashboard = sys.argv[1:]
    print("waiting for Prometheus to scrape dflash-serve")
    wait_for('up{job="dflash-serve"}', lambda: scalar(prom, 'up{job="dflash-serve"}'), 1.0)
    n, tokens = send_requests(server)
    print(f"sent {n} requests; the server reported {tokens} completion tokens")
    # Summed over the series: request counters and latency histograms carry SGLang's
    # `is_streaming` label, one series per value.
    sel = '{job="dflash-serve",model_name="tiny-coder-demo"}'
    wait_for("sglang:num_requests_total", lambda: scalar(prom, f"sum(sglang:num_requests_total{sel})"), float(n))
    wait_for(
        "sglang:generation_tokens_total",
        lambda: scalar(prom, f"sum(sglang:generation_tokens_total{sel})"),
        float(tokens),
    )
    wait_for(
        "sglang:time_to_first_token_seconds_count",
        lambda: scalar(prom, f"sum(sglang:time_to_first_token_seconds_count{sel})"),
        float(n),
    )
    # One more scrape, so rate() windows hold two samples after the requests.
    time.sleep(6)
    # The emptiness check must be able to fail: a misspelt series has no data.
    if query(prom, 'sglang:num_request_total{job="dflash-serve"}'):
        raise SystemExit("a misspelt metric returned series: the dashboard check cannot fail")
    checked = 0
    for title, expr in dashboard_queries(dashboard):
        expr = expr.replace("$__rate_interval", "1m")
        expr = re.sub(r"\$(model_name|instance)\b", ".*", expr)
        if "$" in expr:
            raise SystemExit(f"panel {title!r}: unknown variable left in {expr!r}")
        result = query(prom, expr)
        if not result:
            raise SystemExit(f"panel {title!r}: no series for {expr!r}")
        checked += 1
    print(f"  {checked} dashboard queries return data")
    print("Prometheus read-back OK")


if __name__ == "__main__":
    main()
