"""A byte-level BPE tokenizer.json for the tiny test models (vocab 1024, no tokenizer of their
own): ids 0..255 are the bytes (GPT-2 byte-to-unicode alphabet), 256..1020 merge pairs of
lowercase letters, space and '.', 1021..1023 the specials <|endoftext|>, <|im_start|>,
<|im_end|>. Deterministic, so tests can write it into a temp model dir and compare the daemon
with Hugging Face `tokenizers` loading the very same file."""
import json
import os
import shutil

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def tokenizer_json(vocab_size=1024):
    b2u = bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    chars = [b2u[b] for b in b" abcdefghijklmnopqrstuvwxyz."]
    merges = []
    n_merge = vocab_size - 256 - len(SPECIALS)
    for a in chars:
        for b in chars:
            if len(merges) == n_merge:
                break
            merges.append(f"{a} {b}")
            vocab[a + b] = 256 + len(merges) - 1
    added = [{"id": vocab_size - len(SPECIALS) + i, "content": s, "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": True} for i, s in enumerate(SPECIALS)]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }


def make_model_dir(src, dst):
    """Copies tiny model dir src to dst and adds tokenizer.json + tokenizer_config.json (ChatML)."""
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "tokenizer.json"), "w") as f:
        json.dump(tokenizer_json(), f)
    with open(os.path.join(dst, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": None, "add_bos_token": False,
                   "tokenizer_class": "PreTrainedTokenizerFast"}, f)
    return dst
