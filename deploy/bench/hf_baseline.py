#!/usr/bin/env python3
"""HF transformers baseline for `dflash-serve bench` (same figures, same shapes, random weights).

Runs only on the GPU machine (PyTorch + transformers, no network), never in CI:

    python3 deploy/bench/hf_baseline.py --out hf.json [--model qwen3-8b] [--contexts 1024,8192]

Figures: copy bandwidth and bf16 matmul rate (the rooflines), batch-1 greedy decode ms/token at
each context (DynamicCache, eager loop with a host sync per token as generate() does), forward
latency of n new tokens over a 1024-token cache (causal chain; tree with a 4D mask), a 5-layer
drafter-shaped forward of a 16-token block over 1K/8K of cached context, prefill of 4096 tokens.
"""
import argparse
import json
import sys
import time

import torch

SHAPES = {
    "qwen3-0.6b": (1024, 3072, 28, 16, 8, True),
    "qwen3-1.7b": (2048, 6144, 28, 16, 8, True),
    "qwen3-4b": (2560, 9728, 36, 32, 8, True),
    "qwen3-8b": (4096, 12288, 36, 32, 8, False),
    "qwen3-14b": (5120, 17408, 40, 40, 8, False),
    "qwen3-32b": (5120, 25600, 64, 64, 8, False),
}


def sync():
    torch.cuda.synchronize()


def median_ms(fn, reps):
    fn()
    sync()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t) * 1e3)
    times.sort()
    return times[len(times) // 2]


def build(name, layers=None, attn="sdpa"):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    h, i, l, nh, nkv, tie = SHAPES[name]
    cfg = Qwen3Config(
        vocab_size=151936, hidden_size=h, intermediate_size=i, num_hidden_layers=layers or l,
        num_attention_heads=nh, num_key_value_heads=nkv, head_dim=128, rope_theta=1e6,
        max_position_embeddings=40960, tie_word_embeddings=tie, rms_norm_eps=1e-6,
    )
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()
    return m


def fill(model, ctx):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    ids = torch.randint(0, 151936, (1, ctx), device="cuda")
    for s in range(0, ctx, 2048):
        chunk = ids[:, s:s + 2048]
        pos = torch.arange(s, s + chunk.shape[1], device="cuda")[None]
        model(input_ids=chunk, position_ids=pos, past_key_values=cache, use_cache=True,
              logits_to_keep=1)
    return cache


@torch.inference_mode()
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--out", required=True)
    ap.add_argument("--contexts", default="1024,8192")
    ap.add_argument("--sizes", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args()
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__,
           "command": " ".join(sys.argv), "model": args.model}
    n = 1 << 30
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), 5)
    out["copy_bandwidth_GBps"] = 2 * 2 * n / (ms / 1e3) / 1e9
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = median_ms(lambda: a @ a, 5)
    out["matmul_TFLOPs"] = 2 * 8192 ** 3 / (ms / 1e3) / 1e12
    del a

    model = build(args.model)
    # Decode at each context.
    dec = {}
    for ctx in [int(c) for c in args.contexts.split(",")]:
        cache = fill(model, ctx)
        tok = torch.tensor([[17]], device="cuda")

        def steps(k):
            nonlocal tok
            for s in range(k):
                pos = torch.tensor([[ctx + s]], device="cuda")
                logits = model(input_ids=tok, position_ids=pos, past_key_values=cache,
                               use_cache=True).logits
                tok = logits[:, -1:].argmax(-1)
                tok.item()  # host sync per token, as a decoding loop does
        steps(2)
        cache.crop(ctx)
        sync()
        t = time.perf_counter()
        steps(args.steps)
        ms = (time.perf_counter() - t) * 1e3 / args.steps
        dec[f"ctx_{ctx}"] = {"ms": ms, "tok_per_s": 1e3 / ms}
        del cache
    out["decode"] = dec

    # Forward of n new tokens over a 1024-token cache.
    cache = fill(model, 1024)
    for kind in ["chain", "tree"]:
        res = {}
        for nt in [int(s) for s in args.sizes.split(",")]:
            ids = torch.randint(0, 151936, (1, nt), device="cuda")
            kw = {}
            if kind == "tree":
                parent = [None] + [(i - 1) // 2 for i in range(1, nt)]
                depth = [0] * nt
                vis = torch.zeros(nt, nt, dtype=torch.bool)
                for i in range(nt):
                    if parent[i] is not None:
                        depth[i] = depth[parent[i]] + 1
                        vis[i] = vis[parent[i]]
                    vis[i, i] = True
                full = torch.ones(nt, 1024 + nt, dtype=torch.bool)
                full[:, 1024:] = vis
                mask = torch.zeros(1, 1, nt, 1024 + nt, dtype=torch.bfloat16)
                mask[0, 0][~full] = torch.finfo(torch.bfloat16).min
                kw["attention_mask"] = mask.cuda()
                pos = torch.tensor([[1024 + d for d in depth]], device="cuda")
            else:
                pos = torch.arange(1024, 1024 + nt, device="cuda")[None]

            def fwd():
                model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True, **kw)
                cache.crop(1024)
            try:
                res[str(nt)] = {"ms": median_ms(fwd, args.reps)}
            except Exception as e:  # a transformers version without 4D masks
                res[str(nt)] = {"error": str(e)[:200]}
                cache.crop(1024)
        out[f"forward_{kind}"] = res
    del cache

    # Prefill.
    ids = torch.randint(0, 151936, (1, 4096), device="cuda")
    ms = median_ms(lambda: model(input_ids=ids, logits_to_keep=1), args.reps)
    out["prefill_4096"] = {"s": ms / 1e3, "tok_per_s": 4096 / (ms / 1e3)}
    del model
    torch.cuda.empty_cache()

    # Drafter-shaped: 5 Qwen3 layers, 16-token block over cached context (no LM head).
    draft = build(args.model, layers=5)
    dr = {}
    for ctx in [1024, 8192]:
        cache = fill(draft, ctx)
        ids = torch.randint(0, 151936, (1, 16), device="cuda")
        pos = torch.arange(ctx, ctx + 16, device="cuda")[None]

        def blk():
            draft.model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True)
            cache.crop(ctx)
        dr[f"ctx_{ctx}"] = {"hidden_ms": median_ms(blk, args.reps)}
        del cache
    out["drafter"] = dr
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
