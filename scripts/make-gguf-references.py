#!/usr/bin/env python3
"""References for kvserve's GGUF tests, made with independent code: gguf-py (llama.cpp's own
Python package: GGUFWriter, gguf.quants.dequantize) and transformers (its GGUF loader).

  python3 scripts/make-gguf-references.py quant     tests/data/gguf/quant_ref.bin
                                                    tests/data/gguf/tiny-{llama,qwen2,qwen3}.gguf + .samples.json
  python3 scripts/make-gguf-references.py fuzz      tests/fuzz/corpus/gguf/*.gguf (seeds)
  python3 scripts/make-gguf-references.py smollm2   tests/data/gguf/smollm2_ref.bin (+ _tokens.json)

Needs: pip install gguf numpy (quant); + torch transformers accelerate (smollm2), and the model
fetched by scripts/fetch-smollm2. Outputs are deterministic (seeded).

quant_ref.bin: "KVSGQR01", u32 n; n times: u32 ggml type, u32 n_elems, u32 n_bytes, the raw
blocks (random bytes with every fp16 scale field set to a finite random half), then float32
[n_elems] = gguf.quants.dequantize(raw, type).

tiny-<arch>.gguf: a one-layer random model whose tensors use every supported type (K-quants
where the row is 256 wide), written by GGUFWriter; Llama's q/k are permuted the way
convert_hf_to_gguf.py's LlamaModel.permute does. <arch>.samples.json: for each tensor's Hugging
Face name, its shape and values at sampled (row, col) of the HF layout, computed from the
dequantized GGUF data with the converter's permutation inverted in numpy.

smollm2_ref.bin: "KVSGSM01", u32 n_prompts, u32 vocab, u32 n_steps, u32 top; per prompt: u32
n_ids, int32 ids[n_ids] (transformers' apply_chat_template), int32 greedy[n_steps]
(argmax of the full logits fed back for n_steps steps, not stopping at EOS, fp32), int32 top_ids[top] and float32 top_logits[top] (the top
`top` logits at the last prompt position, fp32). smollm2_tokens.json: transformers' ids of a
corpus of lines for the tokenizer parity test.
"""
import json
import os
import struct
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "data", "gguf")
SMOLLM2 = os.path.join(ROOT, "models", "cache", "smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


def rand_half(rng, n, lo=-3.0, hi=3.0):
    return rng.uniform(lo, hi, n).astype(np.float16)


def random_blocks(rng, qt, n_elems):
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T
    be, bb = GGML_QUANT_SIZES[qt]
    nb = n_elems // be
    if qt == T.F32:
        return rng.standard_normal(n_elems).astype(np.float32).view(np.uint8)
    if qt == T.F16:
        return rand_half(rng, n_elems).view(np.uint8)
    if qt == T.BF16:
        f = rng.standard_normal(n_elems).astype(np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    raw = rng.integers(0, 256, (nb, bb), dtype=np.uint8)
    halves = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0], T.Q4_K: [0, 2],
              T.Q5_K: [0, 2], T.Q6_K: [208]}[qt]
    for off in halves:
        # small scales, like real models; the minimum of Q4_1/Q5_1 and dmin of K-quants signed
        raw[:, off:off + 2] = rand_half(rng, nb, -0.05, 0.05).view(np.uint8).reshape(nb, 2)
    return raw.reshape(-1)


def dequant(raw, qt, n_elems):
    from gguf.quants import dequantize
    return dequantize(raw, qt).astype(np.float32).reshape(-1)[:n_elems]


def make_quant():
    from gguf.constants import GGMLQuantizationType as T
    rng = np.random.default_rng(21)
    types = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K]
    out = bytearray(b"KVSGQR01" + struct.pack("<I", len(types)))
    for qt in types:
        n = 1024
        raw = random_blocks(rng, qt, n)
        ref = dequant(raw, qt, n)
        assert np.all(np.isfinite(ref)), qt
        out += struct.pack("<III", int(qt), n, raw.nbytes) + raw.tobytes() + ref.astype("<f4").tobytes()
    with open(os.path.join(OUT, "quant_ref.bin"), "wb") as f:
        f.write(out)


def permute(w, n_head, n_head_kv):
    """convert_hf_to_gguf.py LlamaModel.permute"""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def make_tiny(arch):
    import gguf
    from gguf.constants import GGMLQuantizationType as T
    rng = np.random.default_rng({"llama": 1, "qwen2": 2, "qwen3": 3}[arch])
    H, I, V, NH, NKV, HD = 256, 64, 96, 2, 1, 32   # q dim 64: o_proj and down rows are 64 wide
    path = os.path.join(OUT, f"tiny-{arch}.gguf")
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    w.add_context_length(512)
    w.add_embedding_length(H)
    w.add_feed_forward_length(I)
    w.add_head_count(NH)
    w.add_head_count_kv(NKV)
    w.add_key_length(HD)
    w.add_value_length(HD)
    w.add_rope_dimension_count(HD)
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    toks = [chr(0x100 + i) if i >= 64 else chr(0x21 + i) for i in range(V)]
    w.add_token_list(toks)
    w.add_token_types([1] * V)
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    # (gguf name, HF name, HF shape [out, in], type, q/k permutation heads)
    L = "model.layers.0."
    spec = [
        ("token_embd.weight", "model.embed_tokens.weight", (V, H), T.Q8_0, 0),
        ("output_norm.weight", "model.norm.weight", (H,), T.F32, 0),
        ("output.weight", "lm_head.weight", (V, H), T.Q6_K, 0),
        ("blk.0.attn_norm.weight", L + "input_layernorm.weight", (H,), T.F16, 0),
        ("blk.0.ffn_norm.weight", L + "post_attention_layernorm.weight", (H,), T.BF16, 0),
        ("blk.0.attn_q.weight", L + "self_attn.q_proj.weight", (NH * HD, H), T.Q4_K, NH),
        ("blk.0.attn_k.weight", L + "self_attn.k_proj.weight", (NKV * HD, H), T.Q5_K, NKV),
        ("blk.0.attn_v.weight", L + "self_attn.v_proj.weight", (NKV * HD, H), T.Q4_1, 0),
        ("blk.0.attn_output.weight", L + "self_attn.o_proj.weight", (H, NH * HD), T.Q4_0, 0),
        ("blk.0.ffn_gate.weight", L + "mlp.gate_proj.weight", (I, H), T.Q5_0, 0),
        ("blk.0.ffn_up.weight", L + "mlp.up_proj.weight", (I, H), T.Q5_1, 0),
        ("blk.0.ffn_down.weight", L + "mlp.down_proj.weight", (H, I), T.Q8_0, 0),
    ]
    if arch == "qwen2":
        spec += [("blk.0.attn_q.bias", L + "self_attn.q_proj.bias", (NH * HD,), T.F32, 0),
                 ("blk.0.attn_k.bias", L + "self_attn.k_proj.bias", (NKV * HD,), T.F32, 0),
                 ("blk.0.attn_v.bias", L + "self_attn.v_proj.bias", (NKV * HD,), T.F32, 0)]
    if arch == "qwen3":
        spec += [("blk.0.attn_q_norm.weight", L + "self_attn.q_norm.weight", (HD,), T.F32, 0),
                 ("blk.0.attn_k_norm.weight", L + "self_attn.k_norm.weight", (HD,), T.F16, 0)]
    samples = {}
    for gname, hname, shape, qt, heads in spec:
        n = int(np.prod(shape))
        raw = random_blocks(rng, qt, n)
        vals = dequant(raw, qt, n).reshape(shape)   # what the GGUF holds, in its (permuted) row order
        if heads and arch == "llama":
            # the file holds permute(hf); invert: hf rows = the permutation's inverse applied to vals
            idx = permute(np.arange(shape[0]), NH if "attn_q" in gname else NH, NKV if "attn_k" in gname else None)
            hf = np.empty_like(vals)
            hf[idx] = vals        # file row r holds hf row idx[r]
        else:
            hf = vals
        if qt == T.F32:
            w.add_tensor(gname, raw.view(np.float32).reshape(shape))
        elif qt == T.F16:
            w.add_tensor(gname, raw.view(np.float16).reshape(shape))
        elif len(shape) == 1:
            w.add_tensor(gname, raw, raw_dtype=qt)
        else:
            w.add_tensor(gname, raw.reshape(shape[0], -1), raw_dtype=qt)
        pts = []
        for _ in range(24):
            ix = tuple(int(rng.integers(0, s)) for s in shape)
            pts.append([list(ix), float(hf[ix])])
        samples[hname] = {"shape": list(shape), "type": qt.name, "samples": pts}
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with open(os.path.join(OUT, f"tiny-{arch}.samples.json"), "w") as f:
        json.dump(samples, f, indent=0)


def make_fuzz_seeds():
    """Small valid GGUF files for tests/fuzz/corpus/gguf/ (and two broken ones)."""
    import gguf
    from gguf.constants import GGMLQuantizationType as T
    d = os.path.join(ROOT, "tests", "fuzz", "corpus", "gguf")
    os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng(7)
    for kind, pre in (("gpt2", "smollm"), ("llama", "default"), ("gpt2", "qwen2")):
        path = os.path.join(d, f"valid_{kind}_{pre}.gguf")
        w = gguf.GGUFWriter(path, "llama")
        w.add_block_count(1)
        w.add_context_length(64)
        w.add_embedding_length(32)
        w.add_feed_forward_length(32)
        w.add_head_count(2)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_tokenizer_model(kind)
        w.add_tokenizer_pre(pre)
        if kind == "gpt2":
            toks = ["<|endoftext|>", "<|im_start|>"] + [chr(c) for c in range(0x21, 0x7f)] + ["\u0120", "\u0120H", "He"]
            merges = ["\u0120 H", "H e"]
            types = [3, 3] + [1] * (len(toks) - 2)
        else:
            toks = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["\u2581", "\u2581H", "H", "e"]
            merges = ["\u2581 H"]
            types = [2, 3, 3] + [6] * 256 + [1] * 4
        w.add_token_list(toks)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(1)
        w.add_eos_token_id(1)
        w.add_chat_template("{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}")
        for qt in (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K):
            n = 256 if qt in (T.Q4_K, T.Q5_K, T.Q6_K) else 32
            raw = random_blocks(rng, qt, n)
            w.add_tensor(f"t.{qt.name}", raw, raw_dtype=qt)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    good = open(os.path.join(d, "valid_gpt2_smollm.gguf"), "rb").read()
    open(os.path.join(d, "bad_truncated.gguf"), "wb").write(good[:len(good) // 2])
    open(os.path.join(d, "bad_magic.gguf"), "wb").write(b"GGUX" + good[4:200])


PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "Who wrote Romeo and Juliet?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Give me a tip for learning to code.",
]
N_STEPS, TOP = 64, 2048


def make_smollm2():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    d, f = os.path.split(SMOLLM2)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32)
    model.eval()
    vocab = model.config.vocab_size
    out = bytearray(b"KVSGSM01" + struct.pack("<IIII", len(PROMPTS), vocab, N_STEPS, TOP))
    for p in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        x = torch.tensor([ids])
        with torch.no_grad():
            # greedy by hand: argmax over the full logits, fed back for N_STEPS steps even past
            # <|im_end|> (generate() would stop there, or mask EOS with min_new_tokens)
            out_ = model(x, use_cache=True)
            logits = out_.logits[0, -1].float().numpy()
            past, nxt, gen = out_.past_key_values, int(np.argmax(logits)), []
            for _ in range(N_STEPS):
                gen.append(nxt)
                o = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
                past, nxt = o.past_key_values, int(torch.argmax(o.logits[0, -1]))
        top = np.argsort(-logits, kind="stable")[:TOP]
        out += struct.pack("<I", len(ids)) + np.asarray(ids, "<i4").tobytes() + np.asarray(gen, "<i4").tobytes()
        out += top.astype("<i4").tobytes() + logits[top].astype("<f4").tobytes()
        print(repr(p), "->", repr(tok.decode(gen, skip_special_tokens=False)[:80]))
    with open(os.path.join(OUT, "smollm2_ref.bin"), "wb") as fo:
        fo.write(out)
    # tokenizer ids for the parity test: the tokenizer parity corpus' lines
    sys.path.insert(0, os.path.join(ROOT, "tests", "py"))
    from test_tokenizer_parity import corpus
    lines = corpus()[:600]
    ref = [{"text": s, "ids": tok(s, add_special_tokens=False)["input_ids"]} for s in lines]
    with open(os.path.join(OUT, "smollm2_tokens.json"), "w") as fo:
        json.dump(ref, fo, ensure_ascii=True, separators=(",", ":"))


def main():
    os.makedirs(OUT, exist_ok=True)
    what = sys.argv[1:] or ["quant"]
    if "quant" in what:
        make_quant()
        for a in ("llama", "qwen2", "qwen3"):
            make_tiny(a)
    if "fuzz" in what:
        make_fuzz_seeds()
    if "smollm2" in what:
        make_smollm2()


if __name__ == "__main__":
    main()
