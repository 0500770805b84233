#!/usr/bin/env python3
"""The long-context fidelity model: the demo model (models/demo, 7.3M parameters, 4K context)
trained further, with the demo model's recipe (scripts/train-demo-model.py's Llama, data from
scripts/demo_data.py), on rows of 8K, 16K and 32K tokens that hold retrieval probes in the
quality harness's three formats, so that full attention answers them at 8K..32K. It is the
yardstick for KV strategies that only act on contexts longer than SmolLM2's 8K (MAC, ParisKV).

Two steps:
  1. here (CPU): gather the training data into a folder to carry to the GPU machine
       python3 scripts/train-longctx-model.py prepare --out DIR
     (needs the Debian packages bible-kjv-text and bible-kjv for the KJV text, public domain;
     uses models/demo's tokenizer; writes kjv.txt, verses.bin/.idx and copies the scripts,
     the tokenizer files and tests/data/eval/filler.txt; about 4 MB after xz)
  2. on one GPU (torch; no network):
       python3 DIR/train-longctx-model.py train --data DIR --init models/demo --out OUT \\
           --time-budget 150
     writes OUT/{config.json (max_position_embeddings 32768), model.safetensors (bf16, 14.7 MB),
     tokenizer files} and prints teacher-forced retrieval accuracy on harness-like probes.

Rows: 75% long retrieval documents (KJV filler lines, one to three of: "The secret code of
<Name> is <NNNN>." facts, a passkey sentence, a block of "<word>-<NNN>: <NNNN>" records; then
one to four "Question: ...\\nAnswer: <value>" pairs, answers weighted as demo_data does), 25%
the demo model's own mix (demo_data.Gen.row: text, short retrieval, chat) so it keeps its other
skills. Names of the harness (demo_data.EVAL_NAMES) never appear in training facts. Each step
picks a row length of 8K, 16K or 32K tokens and about 128K tokens per batch; AdamW, lr warm-up
then cosine decay to 10%, bf16 autocast, SDPA (flash) attention.
"""
import argparse
import importlib.util
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import demo_data as dd  # noqa: E402

CTX = 32768
LENGTHS = (8192, 16384, 32768)
TOKENS_PER_STEP = 131072
# the harness's key words (tools/eval_retrieval.c) are plain English words; training keys use
# demo_data's key words so the evaluation keys stay unseen as keys
KV_RECORDS = 8
W_SCALE = 10          # answer weights x10 (uint8: demo_data's CRIT_W 24 -> 240)


# ---- step 1: data -------------------------------------------------------------------------
def prepare(a):
    from tokenizers import Tokenizer
    os.makedirs(a.out, exist_ok=True)
    raw = subprocess.run(["bible", "-l0", "gen1:1-rev22:21"], check=True, capture_output=True,
                         text=True).stdout
    with open(os.path.join(a.out, "kjv.txt"), "w", encoding="utf-8") as f:
        f.write(raw)
    verses = dd.load_kjv(os.path.join(a.out, "kjv.txt"))
    demo = os.path.join(ROOT, "models", "demo")
    tok = Tokenizer.from_file(os.path.join(demo, "tokenizer.json"))
    pr, pt = dd.encode_pools(tok, verses)
    np.array([t for p in pr + pt for t in p], dtype=np.uint16).tofile(os.path.join(a.out, "verses.bin"))
    np.array([len(p) for p in pr + pt], dtype=np.uint32).tofile(os.path.join(a.out, "verses.idx"))
    for name in ("demo_data.py", "train-demo-model.py", "train-longctx-model.py"):
        shutil.copy(os.path.join(HERE, name), a.out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(demo, name), a.out)
    shutil.copy(os.path.join(ROOT, "tests", "data", "eval", "filler.txt"), a.out)
    print("prepared %s: %d verses" % (a.out, len(verses)))


# ---- step 2: training ---------------------------------------------------------------------
def load_tdm():
    spec = importlib.util.spec_from_file_location("tdm", os.path.join(HERE, "train-demo-model.py"))
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


class LongGen:
    """Long retrieval rows in the harness's formats, on demo_data.Gen's filler and weights."""

    def __init__(self, gen):
        self.g = gen
        self.r = gen.rng
        self.p_single = 0.5

    def items(self):
        """(lines to splice in, their placement 'early'/'any', questions [(q, value)])."""
        r, g = self.r, self.g
        kinds = r.sample(["fact", "passkey", "kv"], r.choice([1, 1, 2, 3]))
        lines, where, qs = [], [], []
        for k in kinds:
            if k == "fact":
                names = r.sample(dd.NAMES, r.randint(2, 6))
                codes = [str(r.randint(1000, 9999)) for _ in names]
                for i, (n, c) in enumerate(zip(names, codes)):
                    lines.append("The secret code of %s is %s.\n" % (n, c))
                    where.append("early" if i == 0 and r.random() < 0.5 else "any")
                for i in r.sample(range(len(names)), r.randint(1, min(3, len(names)))):
                    qs.append(("What is the secret code of %s?" % names[i], codes[i]))
            elif k == "passkey":
                v = str(r.randint(10000, 99999))
                lines.append("The pass key is %s. Remember it. %s is the pass key.\n" % (v, v))
                where.append("any")
                qs.append(("What is the pass key?", v))
            else:
                keys = set()
                while len(keys) < KV_RECORDS:
                    keys.add("%s-%d" % (r.choice(dd.KEY_WORDS), r.randint(10, 999)))
                keys = list(keys)
                vals = [str(r.randint(1000, 9999)) for _ in keys]
                lines.append("".join("%s: %s\n" % kv for kv in zip(keys, vals)))
                where.append("any")
                for i in r.sample(range(len(keys)), r.randint(1, 3)):
                    qs.append(("What is the value of %s?" % keys[i], vals[i]))
        r.shuffle(qs)
        return lines, where, qs

    def doc(self, n_tokens):
        g, r = self.g, self.r
        lines, where, qs = self.items()
        tail, tail_w = [], []
        for q, v in qs:
            ids, w = g.answer("Question: %s\nAnswer:" % q, " %s\n" % v, v)
            tail += ids
            tail_w += w
        item_ids = [g.enc(s) for s in lines]
        budget = n_tokens - len(tail) - sum(map(len, item_ids))
        filler = g.filler(max(budget, 0), with_refs=False)
        nl = len(filler)
        slots = [r.randint(0, max(0, nl // 4)) if w == "early" else r.randint(0, nl) for w in where]
        body = []
        for li in range(nl + 1):
            for k, s in enumerate(slots):
                if s == li:
                    body += item_ids[k]
            if li < nl:
                body += filler[li]
        return body + tail, [1] * len(body) + tail_w

    def row(self, T):
        """T+1 ids and weights: one document of the whole row (half the rows, the longest
        distances) or 2-4 shorter ones (more questions per step), <|endoftext|> between."""
        r = self.r
        k = 1 if r.random() < self.p_single else r.choice([2, 3, 4])
        ids, w = [], []
        for i in range(k):
            d, dw = self.doc((T + 1) // k - 1)
            ids += d + [self.g.eot]
            w += dw + [1]
        pad = T + 1 - len(ids)
        if pad > 0:   # filler lines rarely fill the budget exactly: end-of-text tokens, weight 0
            ids, w = [self.g.eot] * pad + ids, [0] * pad + w
        return ids[-(T + 1):], w[-(T + 1):]


def make_batches(data_dir, seed, mix_p, p_longest, p_single):
    """Endless (ids, weights) batches of ~TOKENS_PER_STEP tokens, for one DataLoader worker."""
    import torch
    from tokenizers import Tokenizer
    tdm = load_tdm()
    info = torch.utils.data.get_worker_info()
    wid = info.id if info else 0
    tok = Tokenizer.from_file(os.path.join(data_dir, "tokenizer.json"))
    verses = dd.load_kjv(os.path.join(data_dir, "kjv.txt"))
    gen = dd.Gen(tok, verses, seed=seed * 1000 + wid, pools=tdm.load_pools(data_dir, len(verses)))
    lg = LongGen(gen)
    lg.p_single = p_single
    r = random.Random(seed * 7919 + wid)
    while True:
        T = LENGTHS[-1] if r.random() < p_longest else r.choice(LENGTHS[:-1])
        B = max(1, TOKENS_PER_STEP // T)
        xs, ws = [], []
        for _ in range(B):
            if r.random() < mix_p:
                # the demo mix (documents of up to 4K) packed into a row of T tokens
                ids, w = gen.row(T)
            else:
                ids, w = lg.row(T)
            xs.append(ids)
            # answers weigh W_SCALE times demo_data's weights against the text: a row of 32K
            # tokens holds only a few answers
            ws.append([x if x <= 1 else x * W_SCALE for x in w])
        yield torch.tensor(xs, dtype=torch.int32), torch.tensor(ws, dtype=torch.uint8)


def harness_like_probe(tok, lines, r, L, fmt):
    """A probe built like tools/eval_retrieval.c's (EVAL_NAMES, the harness's key words,
    filler lines from a random start): (prompt ids, value)."""
    words = ["river", "lamp", "garden", "window", "silver", "candle", "harbor", "meadow", "copper",
             "orchard", "lantern", "pepper", "marble", "thunder", "violet", "anchor"]
    if fmt == "fact":
        names = r.sample(dd.EVAL_NAMES, 3)
        codes = [str(r.randint(1000, 9999)) for _ in names]
        items = ["The secret code of %s is %s.\n" % (n, c) for n, c in zip(names, codes)]
        early = [True, False, False]
        q, v = "Question: What is the secret code of %s?\nAnswer:" % names[0], codes[0]
    elif fmt == "passkey":
        v = str(r.randint(10000, 99999))
        items, early = ["The pass key is %s. Remember it. %s is the pass key.\n" % (v, v)], [False]
        q = "Question: What is the pass key?\nAnswer:"
    else:
        keys = set()
        while len(keys) < KV_RECORDS:
            keys.add("%s-%d" % (r.choice(words), r.randint(10, 999)))
        keys = list(keys)
        vals = [str(r.randint(1000, 9999)) for _ in keys]
        i = r.randrange(len(keys))
        items, early = ["".join("%s: %s\n" % kv for kv in zip(keys, vals))], [False]
        q, v = "Question: What is the value of %s?\nAnswer:" % keys[i], vals[i]
    fixed = len(tok.encode(q).ids) + sum(len(tok.encode(s).ids) for s in items)
    start, nl, tot = r.randrange(len(lines)), 0, 0
    while True:
        n = len(tok.encode(lines[(start + nl) % len(lines)]).ids)
        if tot + n > L - fixed:
            break
        tot += n
        nl += 1
    slots = [r.randint(0, nl // 4 if e else nl) for e in early]
    text = []
    for i in range(nl + 1):
        text += [s for s, k in zip(items, slots) if k == i]
        if i < nl:
            text.append(lines[(start + i) % len(lines)])
    return tok.encode("".join(text) + q).ids, v


def eval_probes(model, tok, lines, n, dev):
    """Teacher-forced exact match of " " + value then a non-digit, per length and format."""
    import torch
    model.eval()
    res = {}
    r = random.Random(4242)
    with torch.no_grad():
        for L in LENGTHS:
            for fmt in ("fact", "passkey", "kv"):
                ok = 0
                for _ in range(n):
                    p, v = harness_like_probe(tok, lines, r, L, fmt)
                    ans = tok.encode(" " + v).ids
                    x = torch.tensor([p + ans], device=dev)
                    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev != "cpu"):
                        pred = model(x)[0, len(p) - 1:].argmax(-1).tolist()
                    nxt = tok.decode([pred[len(ans)]])
                    ok += int(pred[:len(ans)] == ans and not nxt[:1].isalnum())
                res["%d/%s" % (L, fmt)] = ok / n
    model.train()
    return res


def train(a):
    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer
    tdm = load_tdm()
    t0 = time.time()
    dev = a.device
    torch.manual_seed(a.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    with open(os.path.join(a.init, "config.json")) as f:
        cfg = json.load(f)
    model = tdm.Llama(cfg)
    sd = {}
    for k, v in load_file(os.path.join(a.init, "model.safetensors")).items():
        k = k[len("model."):].replace(".self_attn.", ".").replace(".mlp.", ".")
        sd[k] = v.float()
    model.load_state_dict(sd, strict=True)
    model.to(dev)
    tok = Tokenizer.from_file(os.path.join(a.data, "tokenizer.json"))
    lines = dd.load_filler_lines(os.path.join(a.data, "filler.txt"))
    print("torch %s on %s; init %s" % (torch.__version__, dev, a.init), flush=True)

    class DS(torch.utils.data.IterableDataset):
        def __iter__(self):
            return make_batches(a.data, a.seed, a.mix, a.p_longest, a.p_single)

    dl = torch.utils.data.DataLoader(DS(), batch_size=None, num_workers=a.workers,
                                     pin_memory=dev != "cpu", prefetch_factor=4 if a.workers else None,
                                     persistent_workers=a.workers > 0)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=dev.startswith("cuda"))
    amp = dict(device_type=dev.split(":")[0], dtype=torch.bfloat16, enabled=dev != "cpu")
    t_train = t0 + a.time_budget - a.eval_reserve
    step, seen, t_start = 0, 0, time.time()
    it = iter(dl)
    while time.time() < t_train and (a.max_steps == 0 or step < a.max_steps):
        xb, wb = next(it)
        if a.debug_len:
            xb, wb = xb[:1, :a.debug_len + 1], wb[:1, :a.debug_len + 1]
        xb = xb.to(dev, non_blocking=True).long()
        wb = wb.to(dev, non_blocking=True).float()
        p = min(1.0, (time.time() - t_start) / max(1.0, t_train - t_start))
        lr = a.lr * min(1.0, (step + 1) / a.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))
        for g in opt.param_groups:
            g["lr"] = lr
        x, y, w = xb[:, :-1], xb[:, 1:], wb[:, 1:]
        with torch.autocast(**amp):
            h = model.hidden(x)
        # the loss in chunks of rows: the logits of 128K tokens x 8192 ids in fp32 are 4 GB
        total_w = w.sum()
        loss_sum, crit_sum, crit_n = 0.0, 0.0, 0
        opt.zero_grad(set_to_none=True)
        hs = h.detach().requires_grad_(True)
        for i in range(0, x.shape[0], 2):
            logits = F.linear(hs[i:i + 2].float(), model.embed_tokens.weight.float())
            ce = F.cross_entropy(logits.view(-1, logits.shape[-1]), y[i:i + 2].reshape(-1), reduction="none")
            wf = w[i:i + 2].reshape(-1)
            loss = (ce * wf).sum() / total_w
            loss.backward()
            loss_sum += loss.item()
            crit = wf == dd.CRIT_W * W_SCALE
            crit_sum += ce.detach()[crit].sum().item()
            crit_n += int(crit.sum().item())
        h.backward(hs.grad)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        seen += x.numel()
        if step % 20 == 0 or step == 1:
            el = time.time() - t_start
            print("step %4d T %5d loss %.4f lookup %.3f lr %.2e tok/s %.0f elapsed %.0fs" %
                  (step, x.shape[1], loss_sum, crit_sum / max(1, crit_n), lr, seen / el, time.time() - t0),
                  flush=True)
    print("trained %d steps, %.1fM tokens in %.0fs" % (step, seen / 1e6, time.time() - t_start), flush=True)
    del it, dl
    cfg["max_position_embeddings"] = CTX
    os.makedirs(a.out, exist_ok=True)
    save_file(model.hf_state_dict(), os.path.join(a.out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    for name in ("tokenizer.json", "generation_config.json"):
        shutil.copy(os.path.join(a.data, name), a.out)
    with open(os.path.join(a.data, "tokenizer_config.json")) as f:
        tc = json.load(f)
    tc["model_max_length"] = CTX
    with open(os.path.join(a.out, "tokenizer_config.json"), "w") as f:
        json.dump(tc, f, indent=2)
        f.write("\n")
    print("saved to %s" % a.out, flush=True)
    if a.eval_n:
        res = eval_probes(model, tok, lines, a.eval_n, dev)
        print("teacher-forced harness-like probes (%d each): %s" %
              (a.eval_n, ", ".join("%s %.0f%%" % (k, 100 * v) for k, v in res.items())), flush=True)
    print("done in %.0fs" % (time.time() - t0), flush=True)


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--out", required=True)
    t = sub.add_parser("train")
    t.add_argument("--data", default=HERE)
    t.add_argument("--init", default=os.path.join(ROOT, "models", "demo"))
    t.add_argument("--out", required=True)
    t.add_argument("--time-budget", type=float, default=180)
    t.add_argument("--eval-reserve", type=float, default=30)
    t.add_argument("--eval-n", type=int, default=10, help="probes per length and format (0: none)")
    t.add_argument("--lr", type=float, default=5e-4)
    t.add_argument("--warmup", type=int, default=20)
    t.add_argument("--mix", type=float, default=0.25, help="share of rows from the demo mix")
    t.add_argument("--p-longest", type=float, default=1 / 3, help="share of steps with rows of 32K")
    t.add_argument("--p-single", type=float, default=0.5, help="share of rows that are one document")
    t.add_argument("--workers", type=int, default=12)
    t.add_argument("--max-steps", type=int, default=0)
    t.add_argument("--debug-len", type=int, default=0, help="CPU smoke test: one row cut to N tokens")
    t.add_argument("--seed", type=int, default=1)
    t.add_argument("--device", default="cuda")
    a = ap.parse_args()
    prepare(a) if a.cmd == "prepare" else train(a)


if __name__ == "__main__":
    main()
