#!/usr/bin/env python3
"""Writes a Hugging Face Llama model directory with random bf16 weights (config.json +
model.safetensors, no tokenizer: kvserve serves it by token ids) in the shape of a real model,
for GPU benchmarks that need real sizes but not real weights (kvserve-ragbench at long
contexts). Weights are N(0, 0.02), norms 1, so activations stay finite.

  python3 scripts/make-random-model.py --shape llama-3.2-1b --out /tmp/llama-1b [--device cuda]
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
    # Llama-3.1-8B
    "llama-3.1-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False,
                         max_position_embeddings=131072, rope_theta=500000.0),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    c = SHAPES[a.shape]
    t0 = time.time()
    g = torch.Generator(device=a.device).manual_seed(a.seed)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g, device=a.device, dtype=torch.float32) * 0.02).to(torch.bfloat16).cpu()

    H, hd, nh, nkv, ff = c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"], \
        c["intermediate_size"]
    t = {"model.embed_tokens.weight": rnd(c["vocab_size"], H), "model.norm.weight": torch.ones(H, dtype=torch.bfloat16)}
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
        t[p + "input_layernorm.weight"] = torch.ones(H, dtype=torch.bfloat16)
        t[p + "post_attention_layernorm.weight"] = torch.ones(H, dtype=torch.bfloat16)
    os.makedirs(a.out, exist_ok=True)
    save_file(t, os.path.join(a.out, "model.safetensors"), metadata={"format": "pt"})
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
