"""GGUF tokenizer parity: kvserve's tokenizer built from SmolLM2-135M-Instruct's GGUF metadata
(engine/tokenizer_gguf.c) against Hugging Face `tokenizers`.

1. A `tokenizers.Tokenizer` built here from the same metadata the way transformers 5 does it
   (integrations/gguf/gguf_tokenizer_mapping.py: byte-level BPE from tokenizer.ggml.tokens and
   merges, ByteLevel pre-tokenizer and decoder, CONTROL tokens as special added tokens) is first
   checked against transformers' own ids on 600 corpus lines (tests/data/gguf/smollm2_tokens.json,
   made by scripts/make-gguf-references.py smollm2).
2. The reference is that tokenizer with SmolLM2's own pre-tokenizer, which kvserve (like
   llama.cpp for tokenizer.ggml.pre = "smollm") uses: individual digits, then ByteLevel.
   transformers' GGUF path drops the digit split. They differ only on text holding a digit
   (where a digit follows a run of whitespace, "a  1" -> "ĠĠ" "1" vs "Ġ" "Ġ" "1", or is a
   non-ASCII digit whose bytes merge with a preceding space, "١٢٣"); the test checks that every
   text where they differ holds a digit, and counts them.
3. kvs-tokenize on the GGUF file must give the reference's ids on the whole tokenizer parity
   corpus (tests/py/test_tokenizer_parity.py) plus invalid UTF-8, for add_special and
   parse_special on and off, and its decode (streaming too) must equal HF's.
The model is fetched by scripts/setup (scripts/fetch-smollm2); missing, the test fails with the
command to fetch it, or prints SKIP when KVS_ALLOW_NO_SMOLLM2=1 (offline machines).
"""
import json
import os
import random
import struct
import sys
import unicodedata

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_tokenizer_parity import ROOT, Batch, corpus, invalid_utf8  # noqa: E402

GGUF = os.path.join(ROOT, "models", "cache", "smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


def read_metadata(path):
    """The metadata of a GGUF file (a minimal reader: scalars, strings, arrays of them)."""
    scal = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
    with open(path, "rb") as f:
        buf = f.read(64 << 20)
    pos = 0

    def take(fmt):
        nonlocal pos
        v = struct.unpack_from(fmt, buf, pos)[0]
        pos += struct.calcsize(fmt)
        return v

    def string():
        nonlocal pos
        n = take("<Q")
        s = buf[pos:pos + n].decode("utf-8")
        pos += n
        return s

    def value(t):
        if t == 8:
            return string()
        if t == 9:
            et, n = take("<I"), take("<Q")
            return [value(et) for _ in range(n)]
        return take(scal[t])

    assert buf[:4] == b"GGUF"
    pos = 4
    take("<I")
    take("<Q")
    n_kv = take("<Q")
    meta = {}
    for _ in range(n_kv):
        k = string()
        meta[k] = value(take("<I"))
    return meta


def hf_from_metadata(meta):
    """transformers' byte_level_tokenizer + add_gguf_special_tokens, for a gpt2-type file."""
    assert meta["tokenizer.ggml.model"] == "gpt2"
    toks = meta["tokenizer.ggml.tokens"]
    vocab = {t: i for i, t in enumerate(toks)}
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    types = meta["tokenizer.ggml.token_type"]
    tk.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, ty in zip(toks, types) if ty == 3])
    tk.add_tokens([AddedToken(t, normalized=False, special=False) for t, ty in zip(toks, types) if ty == 4])
    return tk


def main():
    if not os.path.exists(GGUF):
        if os.environ.get("KVS_ALLOW_NO_SMOLLM2") == "1":
            print(f"SKIP: {GGUF} is missing and KVS_ALLOW_NO_SMOLLM2=1")
            return
        sys.exit(f"FAIL: {GGUF} is missing: fetch it with scripts/fetch-smollm2 (scripts/setup does), "
                 "or set KVS_ALLOW_NO_SMOLLM2=1 on an offline machine")
    meta = read_metadata(GGUF)
    hf = hf_from_metadata(meta)
    with open(os.path.join(ROOT, "tests", "data", "gguf", "smollm2_tokens.json")) as f:
        ref = json.load(f)
    mism = sum(hf.encode(r["text"], add_special_tokens=False).ids != r["ids"] for r in ref)
    print(f"reference tokenizer vs transformers' GGUF tokenizer: {len(ref) - mism}/{len(ref)} lines equal")
    if mism:
        sys.exit(f"FAIL: the reference tokenizer built here differs from transformers on {mism} lines")

    lines = corpus()
    rng = random.Random(5)
    texts = [(l.encode(), l) for l in lines] + [(b, b.decode("utf-8", "replace")) for b in invalid_utf8(rng)]
    tf_ids = [e.ids for e in hf.encode_batch([t for _, t in texts], add_special_tokens=False)]
    hf.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    own_ids = [e.ids for e in hf.encode_batch([t for _, t in texts], add_special_tokens=False)]
    differ = [t for (_, t), a, b in zip(texts, tf_ids, own_ids) if a != b]
    unexplained = [t for t in differ if not any(unicodedata.category(ch)[0] == "N" for ch in t)]
    print(f"SmolLM2's digit split vs transformers' GGUF pre-tokenizer: {len(differ)}/{len(texts)} texts differ, "
          f"all holding digits: {not unexplained}")
    if unexplained:
        sys.exit(f"FAIL: the digit split changes texts without non-ASCII digits, e.g. {unexplained[0][:60]!r}")
    reqs, want = [], []
    for add, parse in [(0, 1), (1, 1), (0, 0), (1, 0)]:
        hf.encode_special_tokens = not parse
        for (b, _), e in zip(texts, hf.encode_batch([t for _, t in texts], add_special_tokens=bool(add))):
            reqs.append(f"E {add} {parse} {b.hex()}")
            want.append(e.ids)
    hf.encode_special_tokens = False
    dreq, dwant = [], []
    for ids in want[: len(texts)]:
        for skip in (0, 1):
            dreq.append(f"D {skip} " + " ".join(map(str, ids)))
            dwant.append(hf.decode(ids, skip_special_tokens=bool(skip)))
    got = Batch(GGUF).run(reqs + dreq)
    enc_bad = dec_bad = stream_bad = 0
    for k, (r, w) in enumerate(zip(got[: len(reqs)], want)):
        ids = [int(x) for x in r.split()] if r else []
        if ids != w:
            enc_bad += 1
            if enc_bad <= 5:
                print(f"  MISMATCH {reqs[k][:60]}...\n    ours {ids[:30]}\n    hf   {w[:30]}")
    for k, (r, w) in enumerate(zip(got[len(reqs):], dwant)):
        hx, ok = r.rsplit(" ", 1) if " " in r else ("", r)
        stream_bad += ok != "1"
        if bytes.fromhex(hx).decode("utf-8") != w:
            dec_bad += 1
            if dec_bad <= 5:
                print(f"  DECODE MISMATCH {dreq[k][:80]}")
    print(f"SmolLM2 GGUF: encode {len(reqs) - enc_bad}/{len(reqs)} equal to HF ({len(texts)} texts x 4 modes); "
          f"decode {len(dwant) - dec_bad}/{len(dwant)} equal; streaming==full {len(dwant) - stream_bad}/{len(dwant)}")
    if enc_bad or dec_bad or stream_bad:
        sys.exit(f"FAIL: {enc_bad + dec_bad + stream_bad} mismatches")
    print("OK")


if __name__ == "__main__":
    main()
