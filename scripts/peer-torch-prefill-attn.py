#!/usr/bin/env python3
"""The PyTorch peer of the prefill attention alone: causal scaled_dot_product_attention (the
backend PyTorch picks, and each of flash / cuDNN / efficient forced where available) at the
Llama-3.1-8B shape (32 query heads, 8 KV heads, head_dim 128, bf16, GQA through enable_gqa), one
sequence of P tokens, for all 32 layers' worth of FLOPs as kvserve-gpubench counts them
(4 x layers x heads x head_dim x P^2 / 2). Runs on the GPU machine (torch with CUDA):
  python3 scripts/peer-torch-prefill-attn.py --prefill 1024,8192,32768
"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

NH, NKV, HD, LAYERS = 32, 8, 128, 32


def time_ms(fn, iters=10):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(iters):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1))
    ts.sort()
    return ts[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", default="1024,8192,32768")
    a = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    backends = [("default", None), ("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                ("efficient", SDPBackend.EFFICIENT_ATTENTION)]
    for P in [int(x) for x in a.prefill.split(",") if x]:
        q = torch.randn(1, NH, P, HD, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, NKV, P, HD, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, NKV, P, HD, device="cuda", dtype=torch.bfloat16)
        flops = 4.0 * NH * HD * P * P / 2
        for name, be in backends:
            def run():
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            try:
                if be is None:
                    ms = time_ms(run)
                else:
                    with sdpa_kernel([be]):
                        ms = time_ms(run)
            except Exception as e:  # a backend that does not take this shape: said, not hidden
                print(f"{P:6d} {name:9s} not available: {str(e).splitlines()[0][:100]}", flush=True)
                continue
            print(f"{P:6d} {name:9s} {ms * LAYERS:9.2f} ms for {LAYERS} layers {flops / (ms * 1e-3) / 1e12:8.1f} TFLOP/s",
                  flush=True)


if __name__ == "__main__":
    main()
