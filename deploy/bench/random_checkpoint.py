#!/usr/bin/env python3
"""Writes a random-weight Qwen3 checkpoint of a published shape (and optionally a random z-lab
DFlash drafter for it) that `dflash-serve --model-path DIR` loads unchanged, for measuring the
server at scale without downloading weights (deploy/bench/load.py drives it). Weights are
N(0, 0.02) in bf16, norms 1; the tokenizer is a word-level vocabulary of `vocab_size` dummy
tokens, so any token id decodes (benchmarks send `input_ids`). Output is NOT a language model.

Needs torch and safetensors (and tokenizers), as on the GPU machine; never run in CI.
Usage: deploy/bench/random_checkpoint.py --shape qwen3-8b --out /tmp/q8 [--drafter /tmp/q8-dflash]
"""

import argparse
import json
import os

import torch
from safetensors.torch import save_file

SHAPES = {
    # hidden, intermediate, layers, heads, kv heads, head_dim, vocab, max positions, tied
    "qwen3-0.6b": (1024, 3072, 28, 16, 8, 128, 151936, 40960, True),
    "qwen3-4b": (2560, 9728, 36, 32, 8, 128, 151936, 40960, True),
    "qwen3-8b": (4096, 12288, 36, 32, 8, 128, 151936, 40960, False),
    "qwen3-14b": (5120, 17408, 40, 40, 8, 128, 151936, 40960, False),
}


def layer_tensors(prefix, h, inter, nh, nkv, d, gen, dev):
    def w(*shape):
        return (torch.randn(*shape, generator=gen, device=dev) * 0.02).to(torch.bfloat16)

    ones = lambda n: torch.ones(n, dtype=torch.bfloat16, device=dev)
    return {
        f"{prefix}.self_attn.q_proj.weight": w(nh * d, h),
        f"{prefix}.self_attn.k_proj.weight": w(nkv * d, h),
        f"{prefix}.self_attn.v_proj.weight": w(nkv * d, h),
        f"{prefix}.self_attn.o_proj.weight": w(h, nh * d),
        f"{prefix}.self_attn.q_norm.weight": ones(d),
        f"{prefix}.self_attn.k_norm.weight": ones(d),
        f"{prefix}.mlp.gate_proj.weight": w(inter, h),
        f"{prefix}.mlp.up_proj.weight": w(inter, h),
        f"{prefix}.mlp.down_proj.weight": w(h, inter),
        f"{prefix}.input_layernorm.weight": ones(h),
        f"{prefix}.post_attention_layernorm.weight": ones(h),
    }


def save(tensors, path):
    save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, path, metadata={"format": "pt"})


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--out", required=True)
    ap.add_argument("--drafter", help="also write a random 5-layer DFlash drafter here")
    ap.add_argument("--drafter-layers", type=int, default=5)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    h, inter, layers, nh, nkv, d, vocab, max_pos, tied = SHAPES[a.shape]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(a.seed)
    os.makedirs(a.out, exist_ok=True)
    cfg = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": h,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": nh,
        "num_key_value_heads": nkv, "head_dim": d, "vocab_size": vocab,
        "max_position_embeddings": max_pos, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
        "tie_word_embeddings": tied, "torch_dtype": "bfloat16", "bos_token_id": 151643,
        "eos_token_id": 151645, "hidden_act": "silu", "attention_bias": False,
        "rope_scaling": None, "sliding_window": None, "use_sliding_window": False,
        "max_window_layers": layers, "attention_dropout": 0.0,
    }
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    with open(os.path.join(a.out, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [151645], "bos_token_id": 151643}, f)
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(a.out, "tokenizer.json"))
    with open(os.path.join(a.out, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "t151645",
                   "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}"}, f)
    w = lambda *s: (torch.randn(*s, generator=gen, device=dev) * 0.02).to(torch.bfloat16)
    # One file per few layers keeps host memory bounded.
    index, shard, n = {}, {}, 0

    def flush():
        nonlocal shard, n
        if shard:
            name = f"model-{n:05d}.safetensors"
            save(shard, os.path.join(a.out, name))
            index.update({k: name for k in shard})
            shard, n = {}, n + 1

    shard["model.embed_tokens.weight"] = w(vocab, h)
    shard["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16, device=dev)
    if not tied:
        shard["lm_head.weight"] = w(vocab, h)
    flush()
    for i in range(layers):
        shard.update(layer_tensors(f"model.layers.{i}", h, inter, nh, nkv, d, gen, dev))
        if i % 4 == 3:
            flush()
    flush()
    with open(os.path.join(a.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": index}, f)
    if a.drafter:
        os.makedirs(a.drafter, exist_ok=True)
        nl = a.drafter_layers
        # z-lab's rule for the taps: nl layers spread over 1 .. L-3.
        taps = [round(1 + j * (layers - 4) / max(nl - 1, 1)) for j in range(nl)]
        dcfg = dict(cfg, architectures=["DFlashDraftModel"], num_hidden_layers=nl,
                    num_target_layers=layers, block_size=a.block_size,
                    dflash_config={"mask_token_id": 151669, "target_layer_ids": taps},
                    layer_types=["full_attention"] * nl)
        with open(os.path.join(a.drafter, "config.json"), "w") as f:
            json.dump(dcfg, f, indent=1)
        t = {"fc.weight": w(h, len(taps) * h),
             "hidden_norm.weight": torch.ones(h, dtype=torch.bfloat16, device=dev),
             "norm.weight": torch.ones(h, dtype=torch.bfloat16, device=dev)}
        for i in range(nl):
            t.update(layer_tensors(f"layers.{i}", h, inter, nh, nkv, d, gen, dev))
        save(t, os.path.join(a.drafter, "model.safetensors"))
    print(f"wrote {a.shape} to {a.out}" + (f" and a drafter to {a.drafter}" if a.drafter else ""))


if __name__ == "__main__":
    main()
