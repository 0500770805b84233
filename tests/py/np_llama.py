"""An independent float64 numpy forward pass of a Llama model (the tiny test Llama, the demo
model), read straight from model.safetensors, for the real-stack tests' references.

Block-Attention semantics for documents (kv.reuse=lazy): each document attends only to itself,
at padded positions (document d starts at the sum of the previous documents' lengths rounded up
to the 16-token block); the prompt follows the last document's padded end and attends to
everything. With no documents this is the ordinary causal model.

bf16=True emulates the CUDA backend's numerics (kernels/cuda/cuda_backend.cu: 2-D weights,
every GEMM input and the stored K/V rounded to bf16, the rest in high precision). On the tiny
Llama it reproduces the logits error measured on an H200 (worst relative L2 5.5e-2 here, 5.9e-2
there: tests/gpu/test_cuda_model.c), so tests can produce GPU-like greedy sequences on the CPU
(tests/py/test_http_tolerance.py).
"""
import json
import os
import struct

import numpy as np

BS = 16


def bf16_round(x):
    """Rounds to the nearest bf16 (ties to even), returned as float64."""
    a = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    u = a.view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def load_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        hdr = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, t in hdr.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        if t["dtype"] == "F32":
            v = np.frombuffer(data[a:b], dtype=np.float32)
        elif t["dtype"] == "BF16":
            v = (np.frombuffer(data[a:b], dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            raise AssertionError(f"{name}: {t['dtype']}")
        out[name] = v.reshape(t["shape"]).astype(np.float64)
    return out


class Ref:
    def __init__(self, model_dir, bf16=False):
        self.c = json.load(open(os.path.join(model_dir, "config.json")))
        self.w = load_safetensors(os.path.join(model_dir, "model.safetensors"))
        self.bf16 = bf16
        if bf16:
            self.w = {k: bf16_round(v) if v.ndim == 2 else v for k, v in self.w.items()}
        c = self.c
        self.hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        theta = (c.get("rope_parameters") or {}).get("rope_theta") or c.get("rope_theta")
        self.inv = (1.0 / (theta ** (np.arange(0, self.hd, 2, dtype=np.float64) / self.hd))).astype(np.float32)

    def _b(self, x):
        return bf16_round(x) if self.bf16 else x

    def rope(self, x, pos):  # x [T][H][hd]
        ang = (np.float32(1) * pos.astype(np.float32)[:, None] * self.inv[None, :]).astype(np.float64)
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        h = self.hd // 2
        x1, x2 = x[..., :h], x[..., h:]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)

    def norm(self, x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.c["rms_norm_eps"]) * w

    def hidden(self, tok, pos, seg):
        """The residual stream after the last layer, [T][hidden]."""
        c, w, B = self.c, self.w, self._b
        nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], self.hd
        T = len(tok)
        seg = np.array(seg)
        allowed = np.tril(np.ones((T, T), dtype=bool)) & ((seg[:, None] < 0) | (seg[:, None] == seg[None, :]))
        x = w["model.embed_tokens.weight"][tok]
        pos = np.array(pos)
        for l in range(c["num_hidden_layers"]):
            p = f"model.layers.{l}."
            xn = B(self.norm(x, w[p + "input_layernorm.weight"]))
            q = self.rope((xn @ w[p + "self_attn.q_proj.weight"].T).reshape(T, nh, hd), pos)
            k = B(self.rope((xn @ w[p + "self_attn.k_proj.weight"].T).reshape(T, nkv, hd), pos))
            v = B((xn @ w[p + "self_attn.v_proj.weight"].T).reshape(T, nkv, hd))
            g = nh // nkv
            out = np.zeros((T, nh, hd))
            for h in range(nh):
                sc = q[:, h, :] @ k[:, h // g, :].T / np.sqrt(hd)
                sc = np.where(allowed, sc, -np.inf)
                sc = np.exp(sc - sc.max(-1, keepdims=True))
                out[:, h, :] = (sc / sc.sum(-1, keepdims=True)) @ v[:, h // g, :]
            x = x + B(out.reshape(T, nh * hd)) @ w[p + "self_attn.o_proj.weight"].T
            xn = B(self.norm(x, w[p + "post_attention_layernorm.weight"]))
            gt = xn @ w[p + "mlp.gate_proj.weight"].T
            up = xn @ w[p + "mlp.up_proj.weight"].T
            x = x + B(gt / (1 + np.exp(-gt)) * up) @ w[p + "mlp.down_proj.weight"].T
        return x

    def head(self):
        return self.w.get("lm_head.weight", self.w["model.embed_tokens.weight"])

    def next_logits(self, tok, pos, seg):
        x = self.hidden(tok, pos, seg)
        xn = self._b(self.norm(x[-1], self.w["model.norm.weight"]))
        return self.head() @ xn

    def next_token(self, tok, pos, seg):
        return int(np.argmax(self.next_logits(tok, pos, seg)))

    @staticmethod
    def layout(docs, prompt):
        """(tokens, positions, segments, next position) of documents then prompt."""
        tok, pos, seg, slot = [], [], [], 0
        for d, ids in enumerate(docs):
            tok += ids
            pos += [slot + j for j in range(len(ids))]
            seg += [d] * len(ids)
            slot += (len(ids) + BS - 1) // BS * BS
        for t in prompt:
            tok.append(t), pos.append(slot), seg.append(-1)
            slot += 1
        return tok, pos, seg, slot

    def greedy(self, docs, prompt, n, margins=None):
        """n greedy tokens after the documents and the prompt (full recompute each step). When a
        list is given as margins, each step's top1-top2 logit gap is appended to it."""
        tok, pos, seg, slot = self.layout(docs, prompt)
        out = []
        for _ in range(n):
            lg = self.next_logits(tok, pos, seg)
            t = int(np.argmax(lg))
            if margins is not None:
                top2 = np.sort(lg)[-2:]
                margins.append(float(top2[1] - top2[0]))
            out.append(t)
            tok.append(t), pos.append(slot), seg.append(-1)
            slot += 1
        return out

    def gaps(self, docs, prompt, got):
        """Teacher-forced along the given continuation: for each j, the best logit minus the logit
        of got[j], after documents + prompt + got[:j] (0 where got[j] is this model's greedy
        choice). One causal pass over the whole sequence."""
        if not got:
            return []
        tok, pos, seg, slot = self.layout(docs, prompt)
        n0 = len(tok)
        tok = tok + list(got[:-1])
        pos = pos + list(range(slot, slot + len(got) - 1))
        seg = seg + [-1] * (len(got) - 1)
        x = self.hidden(tok, pos, seg)[n0 - 1:]
        lg = self._b(self.norm(x, self.w["model.norm.weight"])) @ self.head().T
        return [float(row.max() - row[t]) for row, t in zip(lg, got)]
