#!/usr/bin/env python3
"""The cuBLAS GEMMs of a Llama-3.1-8B decode step (q/k/v/o/gate/up/down of 32 layers, distinct
random weights, no LM head) in one CUDA graph through PyTorch, at 16 / 32 / 128 rows, with bf16
and with fp32 output: what the peer's GEMMs cost and which kernels cuBLAS picks (torch.profiler).
Needs a GPU and torch >= 2.9 (torch.mm out_dtype). Usage: python3 scripts/peer-torch-gemms.py"""
import torch, sys
torch.manual_seed(0)
L = 32
shapes = {"q": (4096, 4096), "k": (1024, 4096), "v": (1024, 4096), "o": (4096, 4096), "gate": (14336, 4096), "up": (14336, 4096), "down": (4096, 14336)}
W = {n: [torch.randn(o, i, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(L)] for n, (o, i) in shapes.items()}
def run(M, dt):
    X = {n: torch.randn(M, i, device="cuda", dtype=torch.bfloat16) for n, (o, i) in shapes.items()}
    outs = []
    def step():
        for l in range(L):
            for n in shapes:
                if dt is None:
                    outs.append(X[n] @ W[n][l].T)
                else:
                    outs.append(torch.mm(X[n], W[n][l].T, out_dtype=dt))
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s): step()
    torch.cuda.current_stream().wait_stream(s); outs.clear()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g): step()
    for _ in range(3): g.replay()
    ts = []
    for _ in range(15):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
    ts.sort(); ms = ts[7]
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        g.replay(); torch.cuda.synchronize()
    rows = {}
    for e in p.events():
        if e.device_type.name == "CUDA":
            r = rows.setdefault(e.name[:70], [0, 0]); r[0] += e.device_time_total; r[1] += 1
    print(f"M={M} out={dt}: {ms:.3f} ms for {L} layers of q,k,v,o,gate,up,down ({sum(o*i*2 for o,i in shapes.values())*L/ms/1e6:.0f} GB/s)")
    for k, (us, c) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:6]:
        print(f"   {us/1e3:7.3f} ms {c:4d}x {us/c:7.1f} us  {k}")
for M in (16, 32, 128):
    run(M, None)
    try:
        run(M, torch.float32)
    except Exception as e:
        print("out_dtype fp32 unsupported:", str(e)[:100])
