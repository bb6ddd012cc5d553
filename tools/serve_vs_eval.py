#!/usr/bin/env python3
"""Per-prompt chain acceptance of a running dflash-serve against `dflash-train eval`'s replay.

`dflash-train eval` (offline mode) replays each prompt's speculative rounds on the target's
cached greedy continuation and features, which follow transformers' hidden_states (a tap on
layer i is hidden_states[i + 1]; tests/tests/tap_parity.rs). This script sends every cached
prompt's exact token ids to a dflash-serve started with the same target, drafter and
`--speculative-verify chain` (`/generate`, temperature 0, the cache's max_new_tokens), and checks
per prompt that
  - the served tokens are the cached greedy continuation (up to where the engine stops),
  - spec_verify_ct equals the replay's number of chain rounds, and
  - spec_correct_drafts_histogram equals the histogram of the replay's accepted drafts per round
    (batch 1: one round per engine step, so serve's histogram is exact per round).
Exit status 1 on any difference. Standard library only.

Usage: serve_vs_eval.py --url http://127.0.0.1:30000 --cache-dir DIR --eval-json FILE --drafter NAME
"""
import argparse
import json
import struct
import sys
import urllib.request


def cached_tokens(cache_dir):
    """Each cached prompt's tokens (prompt + continuation) from features.safetensors."""
    with open(f"{cache_dir}/features.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        base = 8 + n
        out = {}
        for name, meta in header.items():
            if not name.endswith(".tokens"):
                continue
            assert meta["dtype"] == "U32", meta
            a, b = meta["data_offsets"]
            f.seek(base + a)
            raw = f.read(b - a)
            out[int(name.split(".")[0])] = list(struct.unpack(f"<{len(raw) // 4}I", raw))
    return out


def histogram(streaks):
    h = [0] * (max(streaks, default=0) + 1)
    for s in streaks:
        h[s] += 1
    return h


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--cache-dir", required=True)
    ap.add_argument("--eval-json", required=True)
    ap.add_argument("--drafter", required=True, help="the drafter's name in eval.json")
    args = ap.parse_args()
    with open(f"{args.cache_dir}/manifest.json") as f:
        manifest = json.load(f)
    with open(args.eval_json) as f:
        report = json.load(f)
    tokens = cached_tokens(args.cache_dir)
    drafter = next(d for d in report["drafters"] if d["name"] == args.drafter)
    chain = next(m for m in drafter["offline"]["modes"] if m["mode"] == "chain")
    replay = {p["id"]: p["streaks"] for p in chain["per_prompt"]}
    bad = 0
    print(f"{'prompt':<20} {'rounds':>6} {'accepted':>8} {'tau':>6}  serve == replay")
    for i, e in enumerate(manifest["entries"]):
        p = e["prompt_len"]
        body = {"input_ids": tokens[i][:p],
                "sampling_params": {"max_new_tokens": manifest["max_new_tokens"], "temperature": 0}}
        req = urllib.request.Request(f"{args.url}/generate", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req) as r:
            out = json.load(r)
        meta = out["meta_info"]
        streaks = replay[e["id"]]
        want = tokens[i][p:p + e["generated"]]
        same_tokens = out["output_ids"] == want
        served_hist = meta.get("spec_correct_drafts_histogram", [])
        same_rounds = meta.get("spec_verify_ct") == len(streaks)
        same_hist = served_hist + [0] * (len(histogram(streaks)) - len(served_hist)) == histogram(streaks) \
            + [0] * (len(served_hist) - len(histogram(streaks)))
        ok = same_tokens and same_rounds and same_hist
        bad += not ok
        tau = (len(streaks) + sum(streaks)) / max(len(streaks), 1)
        print(f"{e['id']:<20} {len(streaks):>6} {sum(streaks):>8} {tau:>6.3f}  "
              f"{'yes' if ok else 'NO'} (tokens {same_tokens}, rounds {meta.get('spec_verify_ct')}, "
              f"histogram {served_hist})")
    print(f"{len(manifest['entries']) - bad} of {len(manifest['entries'])} prompts agree")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
