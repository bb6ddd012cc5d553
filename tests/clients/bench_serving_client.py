"""A client that speaks to dflash-serve exactly as `python -m sglang.bench_serving --backend
sglang` (sglang 0.5.23, sglang/benchmark/serving.py) does, for CI machines where installing
sglang (it imports torch) is too heavy. Written after reading that source:

* readiness: GET /v1/models until 200; model id from data[0].id;
* one warm-up request, then POST /flush_cache;
* each request: POST /generate with {"text" | "input_ids", "sampling_params": {"temperature",
  "max_new_tokens", "ignore_eos"}, "stream": true, "lora_path": null, "return_logprob": false,
  "return_routed_experts": false, "logprob_start_len": -1};
* each SSE line: strip, drop "data: ", skip "[DONE]", json-parse; take meta_info.spec_accept_length
  when present; when "text" is non-empty: generated_text = text (cumulative), output_len =
  meta_info.completion_tokens, TTFT at the first, ITL = chunk gap / new tokens after;
* afterwards: GET /server_info, unwrap ["decode"][0] if present, read
  internal_states[0].avg_spec_accept_length ("Accept length").

The real sglang.bench_serving was run against dflash-serve too (see the issue note); this
replica keeps that path tested in CI. Exits non-zero if any request fails or a field is missing.
Usage: python bench_serving_client.py http://127.0.0.1:PORT [num_prompts] [concurrency]
"""

import json
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx


def wait_ready(base: str, timeout: float = 120.0) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            r = httpx.get(f"{base}/v1/models", timeout=5)
            if r.status_code == 200:
                return r.json()["data"][0]["id"]
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"Server at {base}/v1/models is not ready. Exiting.")


def one_request(base: str, input_ids: list, output_len: int) -> dict:
    payload = {
        "input_ids": input_ids,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": output_len, "ignore_eos": True},
        "stream": True,
        "lora_path": None,
        "return_logprob": False,
        "return_routed_experts": False,
        "logprob_start_len": -1,
    }
    out = {"success": False, "ttft": 0.0, "itl": [], "output_len": output_len, "error": ""}
    st = time.perf_counter()
    most_recent, last_output_len, generated_text = st, 0, ""
    with httpx.stream("POST", f"{base}/generate", json=payload, timeout=600) as response:
        if response.status_code != 200:
            out["error"] = f"HTTP {response.status_code}: {response.read()!r}"
            return out
        for line in response.iter_lines():
            chunk = line.strip()
            if not chunk:
                continue
            data_str = chunk[6:] if chunk.startswith("data: ") else chunk
            if data_str == "[DONE]":
                continue
            data = json.loads(data_str)
            if "error" in data:
                out["error"] = json.dumps(data)
                return out
            meta = data.get("meta_info") or {}
            if meta.get("spec_accept_length") is not None:
                out["spec_accept_length"] = meta["spec_accept_length"]
            if data.get("text"):
                ts = time.perf_counter()
                generated_text = data["text"]
                output_len = data["meta_info"]["completion_tokens"]
                if out["ttft"] == 0.0:
                    out["ttft"] = ts - st
                else:
                    new = output_len - last_output_len
                    if new == 0:
                        continue
                    out["itl"].extend([(ts - most_recent) / new] * new)
                most_recent, last_output_len = ts, output_len
    out.update(success=True, generated_text=generated_text, output_len=output_len,
               latency=time.perf_counter() - st)
    return out


def main(base: str, num_prompts: int, concurrency: int) -> None:
    model = wait_ready(base)
    vocab = httpx.post(f"{base}/tokenize", json={"prompt": "x"}, timeout=30).status_code
    assert vocab == 200
    rng = random.Random(0)
    requests = [([rng.randrange(100, 8000) for _ in range(64)], 32) for _ in range(num_prompts)]
    warm = one_request(base, *requests[0])
    assert warm["success"], warm["error"]
    r = httpx.post(f"{base}/flush_cache", params={"timeout": 60.0}, timeout=70)
    assert r.status_code == 200, r.text
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        outs = list(pool.map(lambda a: one_request(base, *a), requests))
    duration = time.perf_counter() - start
    failed = [o["error"] for o in outs if not o["success"]]
    assert not failed, failed[:3]
    assert all(o["output_len"] == 32 for o in outs), [o["output_len"] for o in outs]
    assert all("spec_accept_length" in o for o in outs), "meta_info.spec_accept_length missing"
    info = httpx.get(f"{base}/server_info", timeout=30).json()
    if "decode" in info:
        info = info["decode"][0]
    accept = info["internal_states"][0]["avg_spec_accept_length"]
    tokens = sum(o["output_len"] for o in outs)
    ttft = sorted(o["ttft"] for o in outs)
    print(f"bench_serving-like ({model}): {len(outs)} requests, {tokens} tokens in {duration:.1f} s "
          f"({tokens / duration:.1f} tok/s), median TTFT {ttft[len(ttft) // 2] * 1e3:.0f} ms, "
          f"Accept length: {accept:.2f}")
    assert accept >= 1.0, accept


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0].rstrip("/"), int(args[1]) if len(args) > 1 else 32, int(args[2]) if len(args) > 2 else 8)
