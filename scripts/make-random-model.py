#!/usr/bin/env python3
"""Writes a Hugging Face model directory with random bf16 weights (config.json +
model.safetensors, no tokenizer: kvserve serves it by token ids) in the shape of a real model:
for GPU benchmarks that need real sizes but not real weights (kvserve-ragbench at long
contexts), and for checking the CUDA runner's logits against transformers on the real configs
(scripts/check-hf-logits). Weights are N(0, 0.02), norms 1 (--random-norms: 1 + N(0, 0.1), so a
norm applied to the wrong tensor shows), so activations stay finite.

  python3 scripts/make-random-model.py --shape llama-3.2-1b --out /tmp/llama-1b [--device cuda]
  python3 scripts/make-random-model.py --shape qwen3-8b --layers 4 --random-norms --out /tmp/q8

--layers N keeps the real shape of every layer but only N of them (every layer runs the same
code; a full 8B model is 16 GB to write and load).
"""
import argparse
import json
import os
import time

import torch
from safetensors.torch import save_file

SHAPES = {
    # Llama-3.2-1B: 16 layers, hidden 2048, 32/8 heads of 64, FFN 8192, tied embeddings, 128K context
    "llama-3.2-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=64, intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
                         max_position_embeddings=131072, rope_theta=500000.0),
    # Llama-3.1-8B (its config.json: llama3 RoPE scaling)
    "llama-3.1-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False,
                         max_position_embeddings=131072, rope_theta=500000.0,
                         rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192)),
    # SmolLM2-135M(-Instruct): 30 layers, hidden 576, 9/3 heads of 64, FFN 1536, tied embeddings, 8K context
    "smollm2-135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
                         max_position_embeddings=8192, rope_theta=100000.0),
    # Qwen3-8B (its config.json: q/k RMSNorm per head, rms_norm_eps 1e-6, untied head)
    "qwen3-8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=12288, vocab_size=151936, tie_word_embeddings=False,
                     max_position_embeddings=40960, rope_theta=1000000.0),
}
QWEN3 = {"qwen3-8b"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=0, help="keep only this many layers (0: the real count)")
    ap.add_argument("--random-norms", action="store_true", help="norm weights 1 + N(0, 0.1) instead of 1")
    a = ap.parse_args()
    c = dict(SHAPES[a.shape])
    if a.layers > 0:
        c["num_hidden_layers"] = a.layers
    qwen3 = a.shape in QWEN3
    t0 = time.time()
    g = torch.Generator(device=a.device).manual_seed(a.seed)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g, device=a.device, dtype=torch.float32) * 0.02).to(torch.bfloat16).cpu()

    def norm(n):
        if not a.random_norms:
            return torch.ones(n, dtype=torch.bfloat16)
        return (1.0 + 5.0 * rnd(n).float()).to(torch.bfloat16)

    H, hd, nh, nkv, ff = c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"], \
        c["intermediate_size"]
    t = {"model.embed_tokens.weight": rnd(c["vocab_size"], H), "model.norm.weight": norm(H)}
    if not c["tie_word_embeddings"]:
        t["lm_head.weight"] = rnd(c["vocab_size"], H)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = rnd(nh * hd, H)
        t[p + "self_attn.k_proj.weight"] = rnd(nkv * hd, H)
        t[p + "self_attn.v_proj.weight"] = rnd(nkv * hd, H)
        t[p + "self_attn.o_proj.weight"] = rnd(H, nh * hd)
        t[p + "mlp.gate_proj.weight"] = rnd(ff, H)
        t[p + "mlp.up_proj.weight"] = rnd(ff, H)
        t[p + "mlp.down_proj.weight"] = rnd(H, ff)
        t[p + "input_layernorm.weight"] = norm(H)
        t[p + "post_attention_layernorm.weight"] = norm(H)
        if qwen3:
            t[p + "self_attn.q_norm.weight"] = norm(hd)
            t[p + "self_attn.k_norm.weight"] = norm(hd)
    os.makedirs(a.out, exist_ok=True)
    save_file(t, os.path.join(a.out, "model.safetensors"), metadata={"format": "pt"})
    if qwen3:
        cfg = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_act="silu", rms_norm_eps=1e-6,
                   torch_dtype="bfloat16", attention_bias=False, bos_token_id=151643, eos_token_id=151645, **c)
    else:
        cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", rms_norm_eps=1e-5,
                   torch_dtype="bfloat16", attention_bias=False, mlp_bias=False, bos_token_id=128000,
                   eos_token_id=128001, **c)
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    n = sum(x.numel() for x in t.values())
    print(f"wrote {a.out}: {a.shape}, {n / 1e9:.2f}B parameters, {2 * n / 1e9:.2f} GB bf16, {time.time() - t0:.1f} s",
          flush=True)


if __name__ == "__main__":
    main()
