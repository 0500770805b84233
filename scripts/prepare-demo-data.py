#!/usr/bin/env python3
"""Prepares the demo model's tokenizer and training data on the CPU.

  /opt/refenv/bin/python scripts/prepare-demo-data.py --model-dir models/demo \
      --carry-dir /work/main/.carry/demo

Needs the Debian packages bible-kjv-text and bible-kjv (the `bible` program extracts the
King James Version text, public domain). Writes:
  MODEL_DIR/tokenizer.json, tokenizer_config.json (ChatML template), generation_config.json
  CARRY_DIR/kjv.txt (the extracted text), verses.bin + verses.idx (token ids of every verse
  line in both renderings, uint16), copies of demo_data.py and train-demo-model.py and the
  tokenizer files: everything the GPU run needs.
"""
import argparse
import json
import os
import random
import shutil
import subprocess
import sys

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, \
    processors, trainers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import demo_data as dd  # noqa: E402

QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
              r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
                 "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def synthetic_lines(n, seed):
    """Plain text like the generated documents' templates, for the tokenizer's training."""
    r = random.Random(seed)
    out = []
    for _ in range(n):
        name = r.choice(dd.NAMES + dd.EVAL_NAMES)
        st = r.choice(["code", "city", "color", "animal", "item", "kv", "passkey"])
        if st == "kv":
            subj = "%s-%d" % (r.choice(dd.KEY_WORDS + dd.EVAL_KEY_WORDS), r.randint(10, 999))
            val = str(r.randint(1000, 9999))
        else:
            subj = name
            val = {"code": str(r.randint(1000, 99999)), "city": r.choice(dd.CITIES),
                   "color": r.choice(dd.COLORS), "animal": r.choice(dd.ANIMALS),
                   "item": r.choice(dd.ITEMS), "passkey": str(r.randint(10000, 99999))}[st]
        g = dd.Gen.__new__(dd.Gen)
        line, q, a = g.fact(st, subj, val)
        out.append(line + "Question: %s\nAnswer: %s\n" % (q, a))
        out.append("Q: %s\nA: %s\n" % (q, dd.sentence(st, val, line)))
    return out


def train_tokenizer(verses, vocab_size):
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                     use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                              use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2,
                                  special_tokens=dd.SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["%s %s\n" % (dd.ref(v), v[3]) for v in verses]
    corpus += synthetic_lines(20000, 1)
    chat = [dd.chatml([("user", "Recite %s." % dd.ref(v)), ("assistant", v[3])])
            for v in verses[::10]]
    corpus += [c.replace("<|im_start|>", "").replace("<|im_end|>", "") for c in chat]
    tok.train_from_iterator(corpus, trainer=trainer)
    for i, s in enumerate(dd.SPECIALS):
        if tok.token_to_id(s) != i:
            raise SystemExit("special token %s has id %s" % (s, tok.token_to_id(s)))
    return tok


def check_exact(tok, gen, n):
    """Concatenated piece ids must equal the tokenization of the decoded text."""
    bad = 0
    for i in range(n):
        ids, w = gen.row(4096)
        text = tok.decode(ids, skip_special_tokens=False)
        ref = tok.encode(text, add_special_tokens=False).ids
        if ref != ids:
            bad += 1
            k = next((j for j in range(min(len(ref), len(ids))) if ref[j] != ids[j]), None)
            print("row %d differs at %s: %r" % (i, k, tok.decode(ids[max(0, k - 5):k + 5])))
        if len(w) != len(ids):
            raise SystemExit("weights and ids differ in length")
    return bad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--carry-dir", required=True)
    ap.add_argument("--kjv", help="text from `bible -l0 gen1:1-rev22:21` (default: run it)")
    ap.add_argument("--vocab", type=int, default=8192)
    args = ap.parse_args()
    os.makedirs(args.model_dir, exist_ok=True)
    os.makedirs(args.carry_dir, exist_ok=True)

    if args.kjv:
        with open(args.kjv, encoding="utf-8") as f:
            raw = f.read()
    else:
        raw = subprocess.run(["bible", "-l0", "gen1:1-rev22:21"], check=True,
                             capture_output=True, text=True).stdout
    kjv_path = os.path.join(args.carry_dir, "kjv.txt")
    with open(kjv_path, "w", encoding="utf-8") as f:
        f.write(raw)
    verses = dd.load_kjv(kjv_path)
    print("verses:", len(verses))

    tok = train_tokenizer(verses, args.vocab)
    print("vocab:", tok.get_vocab_size())
    tok.save(os.path.join(args.model_dir, "tokenizer.json"))
    tcfg = {
        "add_bos_token": False, "add_prefix_space": False,
        "added_tokens_decoder": {str(i): {"content": s, "lstrip": False, "normalized": False,
                                          "rstrip": False, "single_word": False,
                                          "special": True}
                                 for i, s in enumerate(dd.SPECIALS)},
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None, "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>", "errors": "replace", "model_max_length": 4096,
        "pad_token": "<|endoftext|>", "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": None,
    }
    with open(os.path.join(args.model_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tcfg, f, indent=2)
        f.write("\n")
    gcfg = {"bos_token_id": None, "eos_token_id": [2, 0], "pad_token_id": 0,
            "do_sample": False, "max_new_tokens": 256}
    with open(os.path.join(args.model_dir, "generation_config.json"), "w") as f:
        json.dump(gcfg, f, indent=2)
        f.write("\n")

    pr, pt = dd.encode_pools(tok, verses)
    flat = np.array([t for p in pr + pt for t in p], dtype=np.uint16)
    lens = np.array([len(p) for p in pr + pt], dtype=np.uint32)
    flat.tofile(os.path.join(args.carry_dir, "verses.bin"))
    lens.tofile(os.path.join(args.carry_dir, "verses.idx"))
    print("verse tokens: ref %d, text %d" % (sum(map(len, pr)), sum(map(len, pt))))

    gen = dd.Gen(tok, verses, seed=123, pools=(pr, pt))
    bad = check_exact(tok, gen, 40)
    if bad:
        raise SystemExit("%d rows are not exact tokenizations" % bad)
    egen = dd.Gen(tok, verses, seed=7, pools=(pr, pt), eval_mode=True)
    for L in (1024, 4096):
        p, a = dd.eval_probe(egen, L)
        print("probe %d: %d+%d tokens, tail %r -> %r" % (L, len(p), len(a),
              tok.decode(p[-20:], skip_special_tokens=False), tok.decode(a)))
    ids, w = gen.row(4096)
    print("sample row head:", repr(tok.decode(ids[:300], skip_special_tokens=False)))
    print("answer-weighted tokens in 20 rows: %.2f%%" % (100 * np.mean(
        [x > 1 for _ in range(20) for x in gen.row(4096)[1]])))

    here = os.path.dirname(os.path.abspath(__file__))
    for name in ("demo_data.py", "train-demo-model.py"):
        shutil.copy(os.path.join(here, name), args.carry_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(args.model_dir, name), args.carry_dir)
    print("ok")


if __name__ == "__main__":
    main()
