#!/usr/bin/env python3
"""Trains the kvserve demo model (a small Llama) from scratch on one GPU and writes a Hugging
Face model directory (config.json, model.safetensors in bf16, tokenizer files).

Run in a folder prepared by scripts/prepare-demo-data.py (kjv.txt, verses.bin/.idx,
demo_data.py, tokenizer files) plus filler.txt (tests/data/eval/filler.txt):
  python3 train-demo-model.py --out OUT_DIR --time-budget 430 --eval-reserve 55

Two phases, both set by the wall clock (--drill-frac of the training time for phase 1):
  1. lookup drill: short rows (--drill-seq) made only of facts and questions
     (demo_data.Drill), loss on the answer tokens alone, constant lr. The key->value lookup
     has a long plateau before it is learnt; this phase gives it thousands of steps of dense
     signal. At its end the weights go to OUT_DIR-phase1 and retrieval is evaluated.
  2. the long-context mix: Bible text, retrieval documents (256..4096 tokens), ChatML chats
     and some drill examples, generated on the fly by DataLoader workers (demo_data.Gen),
     packed into rows of --seq tokens; cosine lr decay.
OUT_DIR gets model.safetensors (bf16) and config.json; copy the tokenizer files beside them.
"""
import argparse
import json
import math
import multiprocessing as mp
import os
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


def worker_gen(data_dir, seed):
    """demo_data.Gen for the calling DataLoader worker, seeded seed + worker id."""
    info = torch.utils.data.get_worker_info()
    wid = info.id if info else 0
    tok = Tokenizer.from_file(os.path.join(data_dir, "tokenizer.json"))
    verses = dd.load_kjv(os.path.join(data_dir, "kjv.txt"))
    return dd.Gen(tok, verses, seed=seed + wid, pools=load_pools(data_dir, len(verses)))


class Rows(torch.utils.data.IterableDataset):
    """Packed rows from demo_data.Gen. The curriculum's progress is the wall-clock fraction
    of the training time (t_start .. t_start + duration) when the row is made."""

    def __init__(self, data_dir, seq, seed, t_start, duration, drill_p=0.0):
        self.data_dir, self.seq, self.seed = data_dir, seq, seed
        self.t_start, self.duration, self.drill_p = t_start, duration, drill_p

    def __iter__(self):
        gen = worker_gen(self.data_dir, self.seed * 1000)
        if self.drill_p > 0:
            gen.drill, gen.drill_p = dd.Drill(gen), self.drill_p
            gen.drill.progress = 1.0
        while True:
            gen.progress = min(1.0, max(0.0, (time.time() - self.t_start) / self.duration))
            ids, w = gen.row(self.seq)
            yield torch.tensor(ids, dtype=torch.int32), torch.tensor(w, dtype=torch.uint8)


class DrillRows(torch.utils.data.IterableDataset):
    """Rows of the phase-1 lookup drill (demo_data.Drill); its curriculum (the number of
    facts per example) follows the wall-clock fraction of phase 1."""

    def __init__(self, data_dir, seq, seed, t_start, duration, level=None):
        self.data_dir, self.seq, self.seed = data_dir, seq, seed
        self.t_start, self.duration, self.level = t_start, duration, level

    def __iter__(self):
        gen = worker_gen(self.data_dir, self.seed * 1000 + 500)
        drill = dd.Drill(gen)
        while True:
            drill.progress = min(1.0, max(0.0, (time.time() - self.t_start) / self.duration))
            if self.level is not None:
                drill.max_facts = self.level.value
            ids, w = drill.row(self.seq)
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

    def hidden(self, ids):
        T = ids.shape[1]
        cos, sin = rope_cos_sin(T, self.c["head_dim"], self.c["rope_theta"], ids.device)
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)

    def forward(self, ids):
        return F.linear(self.hidden(ids), self.embed_tokens.weight)  # tied lm_head

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
    ap.add_argument("--eval-n-phase1", type=int, default=48)
    ap.add_argument("--drill-frac", type=float, default=0.5,
                    help="share of the training time given to phase 1 (the lookup drill)")
    ap.add_argument("--drill-seq", type=int, default=384)
    ap.add_argument("--drill-start", type=int, default=2,
                    help="most facts per drill example at the start")
    ap.add_argument("--level-up", type=float, default=0.9,
                    help="drill lookup accuracy that raises the most facts per example by 2")
    ap.add_argument("--drill-lr", type=float, default=3e-3, help="phase 1's constant lr")
    ap.add_argument("--drill-batch", type=int, default=128)
    ap.add_argument("--drill-p", type=float, default=0.1,
                    help="share of phase-2 documents that are drill examples")
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
    train_time = a.time_budget - a.eval_reserve
    t1_end = t0 + a.drill_frac * train_time          # phase 1 (lookup drill) ends here
    # adaptive curriculum: the most facts per drill example, raised by 2 each time the
    # lookup accuracy over the last 200 steps passes --level-up (shared with the workers)
    level = mp.Value("i", a.drill_start)
    dl1 = torch.utils.data.DataLoader(DrillRows(a.data, a.drill_seq, a.seed, t0,
                                                t1_end - t0, level),
                                      batch_size=a.drill_batch, num_workers=a.workers,
                                      pin_memory=True, prefetch_factor=4,
                                      persistent_workers=True)
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=dev.startswith("cuda"))
    hid = model.hidden if a.no_compile else torch.compile(model.hidden, dynamic=False)
    fwd = model if a.no_compile else torch.compile(model, dynamic=False)
    amp = dict(device_type=dev.split(":")[0], dtype=torch.bfloat16, enabled=dev != "cpu")

    def drill_loss(x, y, w):
        """Loss on the answer tokens only (logits are computed there alone)."""
        with torch.autocast(**amp):
            h = hid(x)
        sel = w > 0
        logits = F.linear(h[sel].float(), model.embed_tokens.weight.float())
        yy, wf = y[sel], w[sel].float()
        ce = F.cross_entropy(logits, yy, reduction="none")
        crit = wf == dd.CRIT_W
        acc = (logits[crit].argmax(-1) == yy[crit]).float().mean()
        return (ce * wf).sum() / wf.sum(), ce.detach()[crit].mean(), acc.detach()

    def lm_loss(x, y, w):
        with torch.autocast(**amp):
            logits = fwd(x)
        ce = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1),
                             reduction="none")
        wf = w.reshape(-1).float()
        crit = (wf == dd.CRIT_W).float()
        return ((ce * wf).sum() / wf.sum(), (ce.detach() * (wf == 1)).sum() / (wf == 1).sum(),
                (ce.detach() * crit).sum() / crit.sum().clamp(min=1))

    def train_step(loss, lr):
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    # ---- phase 1: lookup drill (short fact/question rows, loss on answers), constant lr ----
    it = iter(dl1)
    step, tok_seen, sums = 0, 0, [0.0, 0.0, 0.0, 0]
    t_p1 = time.time()
    while time.time() < t1_end:
        xb, wb = next(it)
        xb = xb.to(dev, non_blocking=True).long()
        wb = wb.to(dev, non_blocking=True)
        lr = a.drill_lr * min(1.0, (step + 1) / a.warmup)
        loss, crit, acc = drill_loss(xb[:, :-1], xb[:, 1:], wb[:, 1:])
        train_step(loss, lr)
        step += 1
        tok_seen += xb.shape[0] * (xb.shape[1] - 1)
        if step % 25 == 0:
            sums[0] += loss.item()
            sums[1] += crit.item()
            sums[2] += acc.item()
            sums[3] += 1
        if step % 200 == 0:
            n = max(1, sums[3])
            print("drill %5d facts<=%d loss %.4f lookup %.3f lookup-acc %.3f lr %.2e "
                  "elapsed %.0fs" % (step, level.value, sums[0] / n, sums[1] / n, sums[2] / n,
                                     lr, time.time() - t0), flush=True)
            if sums[2] / n > a.level_up and level.value < dd.DRILL_FACTS[1]:
                level.value = min(dd.DRILL_FACTS[1], level.value + 2)
            sums = [0.0, 0.0, 0.0, 0]
    sync(dev)
    del it, dl1
    print("phase 1: %d drill steps, %.1fM tokens in %.0fs" %
          (step, tok_seen / 1e6, time.time() - t_p1), flush=True)
    save_model(model, cfg, a.out + "-phase1")
    report(model, tok, verses, pools, lines, a.eval_n_phase1, dev, chat=False)

    # ---- phase 2: the long-context mix (text, retrieval, chat, some drill), cosine lr ----
    t2 = time.time()
    dur2 = max(10.0, t0 + train_time - t2)
    dl2 = torch.utils.data.DataLoader(Rows(a.data, a.seq, a.seed, t2, dur2, a.drill_p),
                                      batch_size=a.batch, num_workers=a.workers,
                                      pin_memory=True, prefetch_factor=4,
                                      persistent_workers=True)
    it = iter(dl2)
    step2, tok_seen, t_mark, tok_mark = 0, 0, None, 0
    while time.time() < t2 + dur2:
        xb, wb = next(it)
        xb = xb.to(dev, non_blocking=True).long()
        wb = wb.to(dev, non_blocking=True)
        p = min(1.0, (time.time() - t2) / dur2)
        lr = a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))
        loss, lm, crit = lm_loss(xb[:, :-1], xb[:, 1:], wb[:, 1:])
        train_step(loss, lr)
        step2 += 1
        tok_seen += xb.shape[0] * (xb.shape[1] - 1)
        if step2 == 10:
            sync(dev)
            t_mark, tok_mark = time.time(), tok_seen
        if step2 % 50 == 0 or step2 == 1:
            tps = (tok_seen - tok_mark) / (time.time() - t_mark) if t_mark and step2 > 10 else 0
            print("step %5d loss %.4f lm %.4f lookup %.3f lr %.2e tok/s %.0f elapsed %.0fs" %
                  (step2, loss.item(), lm.item(), crit.item(), lr, tps, time.time() - t0),
                  flush=True)
    sync(dev)
    print("phase 2: %d steps, %.1fM tokens in %.0fs, final loss %.4f lm %.4f" %
          (step2, tok_seen / 1e6, time.time() - t2, loss.item(), lm.item()), flush=True)
    save_model(model, cfg, a.out)
    report(model, tok, verses, pools, lines, a.eval_n, dev, chat=True)
    print("done in %.0fs" % (time.time() - t0), flush=True)


def save_model(model, cfg, out):
    """model.safetensors (bf16) and config.json; the tokenizer files are the data folder's."""
    os.makedirs(out, exist_ok=True)
    save_file(model.hf_state_dict(), os.path.join(out, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    print("saved to", out, flush=True)


def report(model, tok, verses, pools, lines, n, dev, chat):
    L = (1024, 2048, 4096)
    res = eval_retrieval(model, tok, verses, pools, L, n, dev)
    print("retrieval accuracy (held-out, %d probes each): %s" %
          (n, ", ".join("%dK %.1f%%" % (k // 1024, 100 * v) for k, v in res.items())),
          flush=True)
    res = eval_harness(model, tok, verses, pools, lines, L, n, dev)
    print("harness-format retrieval (held-out, %d probes each): %s" %
          (n, ", ".join("%dK %.1f%%" % (k // 1024, 100 * v) for k, v in res.items())),
          flush=True)
    if not chat:
        return
    for q in ("Recite Genesis 1:1.", "What does the book of Ruth say about Naomi?",
              "Who are you?", "Recite John 3:16."):
        ans = greedy(model, tok, dd.chatml([("user", q)], gen_prompt=True), dev)
        print("chat: %r -> %r" % (q, ans), flush=True)

if __name__ == "__main__":
    main()
