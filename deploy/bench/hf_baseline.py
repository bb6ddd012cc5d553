#!/usr/bin/env python3
"""HF transformers baseline for `dflash-serve bench` (same figures, same shapes, random weights).

Runs only on the GPU machine (PyTorch + transformers, no network), never in CI:

    python3 deploy/bench/hf_baseline.py --out hf.json [--model qwen3-8b] [--contexts 1024,8192]
    python3 deploy/bench/hf_baseline.py --out hf27.json --model qwen3.6-27b   (or qwen3.6-35b-a3b,
        qwen3-coder-30b-a3b, qwen3-30b-a3b: decode at 1K, prefill 4096, MoE chain forwards)

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


def _hybrid(layers, moe):
    kinds = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    rope = dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                mrope_section=[11, 11, 10], mrope_interleaved=True)
    common = dict(vocab_size=248320, num_hidden_layers=layers, head_dim=256,
                  linear_num_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                  linear_conv_kernel_dim=4, layer_types=kinds, rms_norm_eps=1e-6,
                  max_position_embeddings=262144, rope_parameters=rope, tie_word_embeddings=False)
    if moe:
        return dict(common, model_type="qwen3_5_moe_text", hidden_size=2048, num_attention_heads=16,
                    num_key_value_heads=2, linear_num_value_heads=32, num_experts=256,
                    num_experts_per_tok=8, moe_intermediate_size=512,
                    shared_expert_intermediate_size=512)
    return dict(common, model_type="qwen3_5_text", hidden_size=5120, intermediate_size=17408,
                num_attention_heads=24, num_key_value_heads=4, linear_num_value_heads=48)


def _moe(coder):
    return dict(vocab_size=151936, hidden_size=2048, intermediate_size=5472 if coder else 6144,
                num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                rms_norm_eps=1e-6, rope_theta=1e7 if coder else 1e6, tie_word_embeddings=False,
                num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])


# The non-dense shapes of `dflash-serve bench` (serve/src/bench/family_shapes.rs), same values.
FAMILIES = {
    "qwen3.6-27b": ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", lambda: _hybrid(64, False), True),
    "qwen3.6-35b-a3b": ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", lambda: _hybrid(40, True), True),
    "qwen3-coder-30b-a3b": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", lambda: _moe(True), False),
    "qwen3-30b-a3b": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", lambda: _moe(False), False),
}


def family_main(args, out):
    """Decode at 1K context and a 4096-token prefill (each on a fresh cache: a hybrid's
    recurrent state cannot be cropped back, so no verify-size sweep there), and for qwen3_moe
    the chain forwards over a 1K cache too. Every part records its error instead of ending
    the run."""
    import transformers

    model_cls, cfg_cls, values, hybrid = FAMILIES[args.model]
    # Without flash-linear-attention (and causal-conv1d) transformers runs its torch fallback
    # of the Gated DeltaNet layers: say which one this baseline measured.
    import importlib.util
    out["gdn_kernels"] = {m: importlib.util.find_spec(m) is not None for m in ("fla", "causal_conv1d")}
    try:
        cfg = getattr(transformers, cfg_cls)(**values())
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        # Built in bf16 from the start: an f32 build of the 27B (108 GB) does not fit an 80 GB
        # card before the cast (session 18's out-of-memory).
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device("cuda"):
                model = getattr(transformers, model_cls)(cfg).to(torch.bfloat16).eval()
        finally:
            torch.set_default_dtype(torch.float32)
        out["parameters_GB"] = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    except Exception as e:  # a transformers without the class, or out of memory
        out["error"] = f"build: {e}"[:400]
        return
    vocab = cfg.vocab_size
    try:
        ids = torch.randint(0, vocab, (1, 4096), device="cuda")
        ms = median_ms(lambda: model(input_ids=ids, logits_to_keep=1), args.reps)
        out["prefill_4096"] = {"s": ms / 1e3, "tok_per_s": 4096 / (ms / 1e3)}
    except Exception as e:
        out["prefill_4096"] = {"error": str(e)[:300]}
    try:
        prompt = torch.randint(0, vocab, (1, 1024), device="cuda")
        res = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
        cache = res.past_key_values
        tok = res.logits[:, -1:].argmax(-1)
        sync()
        t = time.perf_counter()
        for s in range(args.steps):
            pos = torch.tensor([[1024 + s]], device="cuda")
            res = model(input_ids=tok, position_ids=pos, past_key_values=cache, use_cache=True)
            tok = res.logits[:, -1:].argmax(-1)
            tok.item()  # host sync per token, as a decoding loop does
        ms = (time.perf_counter() - t) * 1e3 / args.steps
        out["decode"] = {"ctx_1024": {"ms": ms, "tok_per_s": 1e3 / ms}}
    except Exception as e:
        out["decode"] = {"error": str(e)[:300]}
    if not hybrid:
        try:
            cache = fill(model, 1024)
            res = {}
            for nt in [int(s) for s in args.sizes.split(",")]:
                ids = torch.randint(0, vocab, (1, nt), device="cuda")
                pos = torch.arange(1024, 1024 + nt, device="cuda")[None]

                def fwd():
                    model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True)
                    cache.crop(1024)
                res[str(nt)] = {"ms": median_ms(fwd, args.reps)}
            out["forward_chain"] = res
        except Exception as e:
            out["forward_chain"] = {"error": str(e)[:300]}


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

    if args.model in FAMILIES:
        family_main(args, out)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
        print(json.dumps(out))
        return

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
