#!/usr/bin/env python3
"""Trains the kvserve demo model (a small Llama) from scratch on one GPU and writes a Hugging
Face model directory (config.json, model.safetensors in bf16, tokenizer files).

Run in a folder prepared by scripts/prepare-demo-data.py (kjv.txt, verses.bin/.idx,
demo_data.py, tokenizer files):
  python3 train-demo-model.py --out OUT_DIR --time-budget 420

Training documents are generated on the fly by DataLoader workers (demo_data.Gen): Bible text,
long-context retrieval documents and ChatML chats, packed into rows of --seq tokens.
The schedule is set by time: after the first steps the step time is measured and the number of
steps chosen so that training ends within --time-budget seconds of the start.
"""
import argparse
import json
import math
import os
import shutil
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import demo_data as dd  # noqa: E402


# ---- data ---------------------------------------------------------------------------------
def load_pools(data_dir, n_verses):
    flat = np.fromfile(os.path.join(data_dir, "verses.bin"), dtype=np.uint16)
    lens = np.fromfile(os.path.join(data_dir, "verses.idx"), dtype=np.uint32)
    if len(lens) != 2 * n_verses or lens.sum() != len(flat):
        raise SystemExit("verses.bin/.idx do not match kjv.txt")
    offs = np.zeros(len(lens) + 1, dtype=np.int64)
    offs[1:] = np.cumsum(lens, dtype=np.int64)
    seqs = [flat[offs[i]:offs[i + 1]].tolist() for i in range(len(lens))]
    return seqs[:n_verses], seqs[n_verses:]


class Rows(torch.utils.data.IterableDataset):
    """Packed rows from demo_data.Gen. The curriculum's progress is the wall-clock fraction
    of the training time (t_start .. t_start + duration) when the row is made."""

    def __init__(self, data_dir, seq, seed, t_start, duration):
        self.data_dir, self.seq, self.seed = data_dir, seq, seed
        self.t_start, self.duration = t_start, duration

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid = info.id if info else 0
        tok = Tokenizer.from_file(os.path.join(self.data_dir, "tokenizer.json"))
        verses = dd.load_kjv(os.path.join(self.data_dir, "kjv.txt"))
        gen = dd.Gen(tok, verses, seed=self.seed * 1000 + wid,
                     pools=load_pools(self.data_dir, len(verses)))
        while True:
            gen.progress = min(1.0, max(0.0, (time.time() - self.t_start) / self.duration))
            ids, w = gen.row(self.seq)
            yield torch.tensor(ids, dtype=torch.int32), torch.tensor(w, dtype=torch.uint8)


# ---- model (Hugging Face Llama layout and numerics) ---------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        dt = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dt)


def rope_cos_sin(T, hd, theta, device):
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64, device=device).float()
                           / hd))
    t = torch.arange(T, device=device).float()
    f = torch.outer(t, inv)
    emb = torch.cat([f, f], dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        d, hd = c["hidden_size"], c["head_dim"]
        self.nh, self.nkv, self.hd = c["num_attention_heads"], c["num_key_value_heads"], hd
        self.q_proj = nn.Linear(d, self.nh * hd, bias=False)
        self.k_proj = nn.Linear(d, self.nkv * hd, bias=False)
        self.v_proj = nn.Linear(d, self.nkv * hd, bias=False)
        self.o_proj = nn.Linear(self.nh * hd, d, bias=False)
        self.gate_proj = nn.Linear(d, c["intermediate_size"], bias=False)
        self.up_proj = nn.Linear(d, c["intermediate_size"], bias=False)
        self.down_proj = nn.Linear(c["intermediate_size"], d, bias=False)
        self.input_layernorm = RMSNorm(d, c["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(d, c["rms_norm_eps"])

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(B, T, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(h).view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(h).view(B, T, self.nkv, self.hd).transpose(1, 2)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = self.nh // self.nkv
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(B, T, self.nh * self.hd))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Llama(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList([Block(c) for _ in range(c["num_hidden_layers"])])
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        std = c["initializer_range"]
        for n, p in self.named_parameters():
            if p.dim() == 2:
                s = std / math.sqrt(2 * c["num_hidden_layers"]) \
                    if n.endswith(("o_proj.weight", "down_proj.weight")) else std
                nn.init.normal_(p, 0.0, s)

    def forward(self, ids):
        T = ids.shape[1]
        cos, sin = rope_cos_sin(T, self.c["head_dim"], self.c["rope_theta"], ids.device)
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        x = self.norm(x)
        return F.linear(x, self.embed_tokens.weight)  # tied lm_head

    def hf_state_dict(self):
        out = {}
        for n, p in self.state_dict().items():
            n2 = n
            for k in ("q_proj", "k_proj", "v_proj", "o_proj"):
                n2 = n2.replace("." + k, ".self_attn." + k)
            for k in ("gate_proj", "up_proj", "down_proj"):
                n2 = n2.replace("." + k, ".mlp." + k)
            out["model." + n2] = p.detach().to(torch.bfloat16).contiguous().cpu()
        return out


def make_config(a):
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": a.vocab, "hidden_size": a.hidden, "intermediate_size": a.ffn,
        "num_hidden_layers": a.layers, "num_attention_heads": a.heads,
        "num_key_value_heads": a.kv_heads, "head_dim": a.hidden // a.heads,
        "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "rope_scaling": None, "attention_bias": False,
        "attention_dropout": 0.0, "mlp_bias": False, "tie_word_embeddings": True,
        "initializer_range": 0.02, "bos_token_id": None, "eos_token_id": 2, "pad_token_id": 0,
        "torch_dtype": "bfloat16", "use_cache": True,
    }


# ---- evaluation ---------------------------------------------------------------------------
def teacher_forced(model, probes, dev, extra=0):
    """For each (prompt ids, answer ids) probe, yields (answer, argmax predictions at the answer
    positions plus `extra` positions after it), in batches of 8, teacher-forced."""
    for i in range(0, len(probes), 8):
        chunk = probes[i:i + 8]
        T = max(len(p) + len(a) for p, a in chunk)
        x = torch.zeros(len(chunk), T, dtype=torch.long)
        for j, (p, a) in enumerate(chunk):
            s = p + a
            x[j, :len(s)] = torch.tensor(s)
        with torch.autocast(dev.split(":")[0], dtype=torch.bfloat16, enabled=dev != "cpu"):
            pred = model(x.to(dev)).argmax(-1).cpu()
        for j, (p, a) in enumerate(chunk):
            yield a, pred[j, len(p) - 1:len(p) - 1 + len(a) + extra].tolist()


@torch.no_grad()
def eval_retrieval(model, tok, verses, pools, lengths, n, dev):
    model.eval()
    res = {}
    for L in lengths:
        gen = dd.Gen(tok, verses, seed=99991 + L, pools=pools, eval_mode=True)
        probes = [dd.eval_probe(gen, L) for _ in range(n)]
        res[L] = sum(int(got == a) for a, got in teacher_forced(model, probes, dev)) / n
    model.train()
    return res


@torch.no_grad()
def eval_harness(model, tok, verses, pools, lines, lengths, n, dev):
    """Accuracy on probes made like build/kvserve-eval's (demo_data.harness_probe): the
    teacher-forced argmax must give " " + code, then a token that is no digit or letter."""
    model.eval()
    res = {}
    for L in lengths:
        gen = dd.Gen(tok, verses, seed=77773 + L, pools=pools, eval_mode=True)
        probes = []
        for _ in range(n):
            p, code = dd.harness_probe(gen, L, lines)
            probes.append((p, gen.enc_val(code)))
        ok = 0
        for a, got in teacher_forced(model, probes, dev, extra=1):
            ok += int(got[:-1] == a and not tok.decode([got[-1]])[:1].isalnum())
        res[L] = ok / n
    model.train()
    return res


@torch.no_grad()
def greedy(model, tok, prompt, dev, max_new=48):
    model.eval()
    ids = tok.encode(prompt, add_special_tokens=False).ids
    out = []
    for _ in range(max_new):
        x = torch.tensor([ids + out], device=dev)
        with torch.autocast(dev.split(":")[0], dtype=torch.bfloat16, enabled=dev != "cpu"):
            nxt = int(model(x)[0, -1].argmax())
        if nxt in (0, 2):
            break
        out.append(nxt)
    model.train()
    return tok.decode(out)


def sync(dev):
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=HERE)
    ap.add_argument("--out", required=True)
    ap.add_argument("--time-budget", type=float, default=420, help="seconds, whole run")
    ap.add_argument("--eval-reserve", type=float, default=40,
                    help="seconds of the budget kept for evaluation and saving")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--ffn", type=int, default=640)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--filler", default=os.path.join(HERE, "filler.txt"),
                    help="the quality harness's filler text (tests/data/eval/filler.txt)")
    ap.add_argument("--eval-n", type=int, default=96)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    t0 = time.time()
    torch.manual_seed(a.seed)
    dev = a.device
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    print("torch", torch.__version__, torch.cuda.get_device_name(0) if dev == "cuda" else dev,
          flush=True)

    tok = Tokenizer.from_file(os.path.join(a.data, "tokenizer.json"))
    if tok.get_vocab_size() != a.vocab:
        raise SystemExit("tokenizer has %d tokens, --vocab is %d" % (tok.get_vocab_size(),
                                                                      a.vocab))
    verses = dd.load_kjv(os.path.join(a.data, "kjv.txt"))
    pools = load_pools(a.data, len(verses))
    cfg = make_config(a)
    model = Llama(cfg).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    print("params %.2fM, config %s" % (n_params / 1e6, json.dumps(cfg)), flush=True)

    lines = dd.load_filler_lines(a.filler)
    dl = torch.utils.data.DataLoader(Rows(a.data, a.seq, a.seed, t0,
                                          a.time_budget - a.eval_reserve),
                                     batch_size=a.batch,
                                     num_workers=a.workers, pin_memory=True,
                                     prefetch_factor=4, persistent_workers=True)
    it = iter(dl)
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=dev.startswith("cuda"))
    fwd = model if a.no_compile else torch.compile(model)

    def loss_fn(x, y, w):
        with torch.autocast(dev.split(":")[0], dtype=torch.bfloat16, enabled=dev != "cpu"):
            logits = fwd(x)
        ce = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1),
                             reduction="none")
        wf = w.reshape(-1).float()
        crit = (wf == dd.CRIT_W).float()
        return ((ce * wf).sum() / wf.sum(), (ce.detach() * (wf == 1)).sum() / (wf == 1).sum(),
                (ce.detach() * crit).sum() / crit.sum().clamp(min=1))

    total_steps = None
    step = 0
    tok_seen = 0
    t_mark, tok_mark = None, 0
    lm_ema = None
    while True:
        if total_steps is not None and step >= total_steps:
            break
        xb, wb = next(it)
        xb = xb.to(dev, non_blocking=True).long()
        wb = wb.to(dev, non_blocking=True)
        x, y, w = xb[:, :-1], xb[:, 1:], wb[:, 1:]
        if total_steps is None:
            lr = a.lr * min(1.0, (step + 1) / a.warmup)
        else:
            if step < a.warmup:
                lr = a.lr * (step + 1) / a.warmup
            else:
                p = (step - a.warmup) / max(1, total_steps - a.warmup)
                lr = a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))
        for g in opt.param_groups:
            g["lr"] = lr
        loss, lm, crit = loss_fn(x, y, w)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tok_seen += x.numel()
        if step == 10:
            sync(dev)
            t_mark, tok_mark = time.time(), tok_seen
        if step == 40 and total_steps is None:
            sync(dev)
            dt = (time.time() - t_mark) / 30
            left = a.time_budget - a.eval_reserve - (time.time() - t0)
            total_steps = max(step + 10, step + int(left / dt))
            print("step time %.3fs -> %d steps in all" % (dt, total_steps), flush=True)
        if step % 50 == 0 or step == 1:
            lv, lmv = loss.item(), lm.item()
            lm_ema = lmv if lm_ema is None else 0.9 * lm_ema + 0.1 * lmv
            el = time.time() - t0
            tps = (tok_seen - tok_mark) / (time.time() - t_mark) if t_mark and step > 10 else 0
            print("step %5d loss %.4f lm %.4f lookup %.3f lr %.2e tok/s %.0f elapsed %.0fs" %
                  (step, lv, lmv, crit.item(), lr, tps, el), flush=True)
    sync(dev)
    t_train = time.time() - t0
    tps = (tok_seen - tok_mark) / (time.time() - t_mark)
    print("trained %d steps, %.1fM tokens, %.0fs, %.0f tok/s, final loss %.4f lm %.4f" %
          (step, tok_seen / 1e6, t_train, tps, loss.item(), lm.item()), flush=True)

    os.makedirs(a.out, exist_ok=True)
    save_file(model.hf_state_dict(), os.path.join(a.out, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(a.data, name), a.out)
    print("saved to", a.out, flush=True)

    res = eval_retrieval(model, tok, verses, pools, (1024, 2048, 4096), a.eval_n, dev)
    print("retrieval accuracy (held-out, %d probes each): %s" %
          (a.eval_n, ", ".join("%dK %.1f%%" % (L // 1024, 100 * v) for L, v in res.items())),
          flush=True)
    res = eval_harness(model, tok, verses, pools, lines, (1024, 2048, 4096), a.eval_n, dev)
    print("harness-format retrieval (held-out, %d probes each): %s" %
          (a.eval_n, ", ".join("%dK %.1f%%" % (L // 1024, 100 * v) for L, v in res.items())),
          flush=True)
    for q in ("Recite Genesis 1:1.", "What does the book of Ruth say about Naomi?", "What does the book of Ruth say about Boaz?",
              "Who are you?", "Recite John 3:16."):
        ans = greedy(model, tok, dd.chatml([("user", q)], gen_prompt=True), dev)
        print("chat: %r -> %r" % (q, ans), flush=True)
    print("done in %.0fs" % (time.time() - t0), flush=True)


if __name__ == "__main__":
    main()
