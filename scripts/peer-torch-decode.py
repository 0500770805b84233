#!/usr/bin/env python3
"""The PyTorch peer of build/kvserve-gpubench: the same Llama-3.1-8B shape (random bf16 weights,
32 layers, hidden 4096, 32/8 heads of 128, FFN 14336, vocabulary 128256), the same decode step
(each of B sequences decodes one token at position ctx-1 over a KV cache of ctx positions) and
the same prefill (one sequence, the whole prompt in one step), written the way a Python user
writes a fast decode loop: a static KV cache per layer ([B, kv_heads, ctx, head_dim], like
transformers' StaticCache), cuBLAS matmuls, F.scaled_dot_product_attention with enable_gqa, and
the whole step captured in one CUDA graph (no Python in the timed loop). --compile also wraps
each layer in torch.compile (fuses the elementwise ops; costs compile time per shape).

Prints one table; --markdown FILE writes it as Markdown.
  python3 scripts/peer-torch-decode.py --batches 1,8,32,128 --contexts 1024,8192,32768 --prefill 1024,8192
"""
import argparse
import time

import torch
import torch.nn.functional as F

DIM, NH, NKV, HD, FF, VOCAB, EPS = 4096, 32, 8, 128, 14336, 128256, 1e-5


def rnd(*shape, scale=0.02):
    return (torch.rand(*shape, device="cuda", dtype=torch.bfloat16) * 2 - 1) * scale


class Model:
    def __init__(self, n_layers):
        self.emb = rnd(VOCAB, DIM)
        self.head = rnd(VOCAB, DIM)
        self.fnorm = torch.ones(DIM, device="cuda", dtype=torch.bfloat16)
        self.layers = []
        for _ in range(n_layers):
            self.layers.append(dict(
                wq=rnd(DIM, DIM), wk=rnd(NKV * HD, DIM), wv=rnd(NKV * HD, DIM), wo=rnd(DIM, DIM),
                wg=rnd(FF, DIM), wu=rnd(FF, DIM), wd=rnd(DIM, FF),
                n1=torch.ones(DIM, device="cuda", dtype=torch.bfloat16),
                n2=torch.ones(DIM, device="cuda", dtype=torch.bfloat16)))
        inv = 1.0 / (500000.0 ** (torch.arange(0, HD, 2, device="cuda", dtype=torch.float32) / HD))
        self.inv_freq = inv
        self.weight_bytes = sum(t.numel() * 2 for L in self.layers for t in L.values()) + 2 * VOCAB * DIM * 2


def rmsnorm(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype) * w


def rope(x, cos, sin):
    # x [B, H, T, HD]; neox half split, as transformers' Llama
    x1, x2 = x[..., : HD // 2], x[..., HD // 2:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def layer(L, h, cos, sin, kc, vc, pos_idx, causal):
    B, T, _ = h.shape
    xn = rmsnorm(h, L["n1"])
    q = (xn @ L["wq"].T).view(B, T, NH, HD).transpose(1, 2)
    k = (xn @ L["wk"].T).view(B, T, NKV, HD).transpose(1, 2)
    v = (xn @ L["wv"].T).view(B, T, NKV, HD).transpose(1, 2)
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    kc.index_copy_(2, pos_idx, k)
    vc.index_copy_(2, pos_idx, v)
    if causal:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:
        o = F.scaled_dot_product_attention(q, kc, vc, enable_gqa=True)
    h = h + o.transpose(1, 2).reshape(B, T, DIM) @ L["wo"].T
    xn = rmsnorm(h, L["n2"])
    return h + (F.silu(xn @ L["wg"].T) * (xn @ L["wu"].T)) @ L["wd"].T


def step(M, fn, tok, pos_idx, caches, causal):
    h = M.emb[tok]
    ang = pos_idx.float()[:, None] * M.inv_freq[None, :]
    cos = torch.cat((ang.cos(), ang.cos()), -1).to(h.dtype)
    sin = torch.cat((ang.sin(), ang.sin()), -1).to(h.dtype)
    for L, (kc, vc) in zip(M.layers, caches):
        h = fn(L, h, cos, sin, kc, vc, pos_idx, causal)
    if causal:
        h = h[:, -1:]
    return rmsnorm(h, M.fnorm) @ M.head.T


def copy_bandwidth():
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ts = []
    for i in range(18):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        y.copy_(x)
        b.record()
        b.synchronize()
        if i >= 3:
            ts.append(a.elapsed_time(b))
    ts.sort()
    del x, y
    return 2 * (2 << 30) / (ts[len(ts) // 2] * 1e-3)


def profile_replays(g, B, ctx, reps=5):
    """Per-kernel GPU time of one decode step (mean over reps graph replays), largest first: shows
    where the peer's step goes (GEMMs, attention, the fused elementwise kernels)."""
    from torch.profiler import profile, ProfilerActivity
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
    rows = {}
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        r = rows.setdefault(e.name, [0.0, 0])
        r[0] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        r[1] += 1
    total = sum(v[0] for v in rows.values()) / reps
    print(f"  profile batch {B} context {ctx}: {total / 1e3:.3f} ms of kernels a step", flush=True)
    for name, (us, cnt) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:12]:
        print(f"    {us / reps / 1e3:8.3f} ms {cnt // reps:5d}x  {name[:110]}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--contexts", default="1024,8192,32768")
    ap.add_argument("--prefill", default="1024,8192")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--markdown")
    ap.add_argument("--profile", action="store_true",
                    help="after timing each decode shape, print its GPU kernels (torch.profiler, 5 replays)")
    a = ap.parse_args()
    torch.manual_seed(0)
    fn = torch.compile(layer, fullgraph=True) if a.compile else layer
    bw = copy_bandwidth()
    M = Model(a.layers)
    kv_tok = a.layers * 2 * NKV * HD * 2
    name = torch.cuda.get_device_name()
    print(f"device: {name}, torch {torch.__version__}, copy bandwidth {bw / 1e9:.0f} GB/s, "
          f"weights {M.weight_bytes / 1e9:.2f} GB, compile={a.compile}", flush=True)
    rows = []
    for B in [int(x) for x in a.batches.split(",") if x]:
        for ctx in [int(x) for x in a.contexts.split(",") if x]:
            free = torch.cuda.mem_get_info()[0]
            if B * ctx * kv_tok > free - (3 << 30):
                print(f"{B:6d} {ctx:8d}   skipped: KV of {B * ctx * kv_tok / 1e9:.1f} GB does not fit", flush=True)
                rows.append(f"| {B} | {ctx} | skipped (KV does not fit) | | | |")
                continue
            caches = [(rnd(B, NKV, ctx, HD, scale=1.0), rnd(B, NKV, ctx, HD, scale=1.0)) for _ in M.layers]
            tok = torch.randint(0, VOCAB, (B, 1), device="cuda")
            pos = torch.tensor([ctx - 1], device="cuda")
            with torch.no_grad():
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    for _ in range(3):
                        step(M, fn, tok, pos, caches, False)
                torch.cuda.current_stream().wait_stream(s)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    out = step(M, fn, tok, pos, caches, False)
                for _ in range(3):
                    g.replay()
                ts = []
                for _ in range(a.iters):
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    g.replay()
                    e1.record()
                    e1.synchronize()
                    ts.append(e0.elapsed_time(e1))
                assert torch.isfinite(out).all()
            if a.profile:
                profile_replays(g, B, ctx)
            ts.sort()
            ms = ts[len(ts) // 2]
            floor = (M.weight_bytes + B * ctx * kv_tok) / bw * 1e3
            print(f"{B:6d} {ctx:8d} {ms:9.3f} ms {B / (ms * 1e-3):10.0f} tok/s  floor {floor:.3f} ms "
                  f"achieved {100 * floor / ms:.1f}%", flush=True)
            rows.append(f"| {B} | {ctx} | {ms:.3f} | {B / (ms * 1e-3):.0f} | {floor:.3f} | {100 * floor / ms:.1f}% |")
            del g, caches, out
            torch.cuda.empty_cache()
    prows = []
    for P in [int(x) for x in a.prefill.split(",") if x and x != "none"]:
        caches = [(rnd(1, NKV, P, HD), rnd(1, NKV, P, HD)) for _ in M.layers]
        tok = torch.randint(0, VOCAB, (1, P), device="cuda")
        pos = torch.arange(P, device="cuda")
        ts = []
        with torch.no_grad():
            for i in range(4):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                out = step(M, fn, tok, pos, caches, True)
                e1.record()
                e1.synchronize()
                if i:
                    ts.append(e0.elapsed_time(e1))
            assert torch.isfinite(out).all()
        ts.sort()
        ms = ts[len(ts) // 2]
        flops = 2.0 * (M.weight_bytes / 2) * P + 4.0 * a.layers * NH * HD * P * P / 2
        print(f"prefill {P:6d}: {ms:.2f} ms, {P / (ms * 1e-3):.0f} tok/s, {flops / (ms * 1e-3) / 1e12:.1f} TFLOP/s",
              flush=True)
        prows.append(f"| {P} | {ms:.2f} | {P / (ms * 1e-3):.0f} | {flops / (ms * 1e-3) / 1e12:.1f} |")
        del caches
        torch.cuda.empty_cache()
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(f"PyTorch peer ({name}, torch {torch.__version__}, static KV cache, SDPA, CUDA graph"
                    f"{', torch.compile per layer' if a.compile else ''}; copy bandwidth {bw / 1e9:.0f} GB/s, "
                    f"date {time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}):\n\n")
            f.write("| batch | context | ms/step | tokens/s | floor ms | achieved |\n| ---: | ---: | ---: | ---: | ---: | ---: |\n")
            f.write("\n".join(rows) + "\n")
            if prows:
                f.write("\n| prompt tokens | ms | tokens/s | TFLOP/s |\n| ---: | ---: | ---: | ---: |\n")
                f.write("\n".join(prows) + "\n")


if __name__ == "__main__":
    main()
