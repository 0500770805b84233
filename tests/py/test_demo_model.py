"""Checks the committed demo model directory (models/demo) against its specification:
config shape, safetensors header (every tensor bf16, shapes from the config, tied embeddings),
tokenizer (vocabulary, special token ids, chat template, EOS), size limits, and that the
reference file's prompt ids are what the `tokenizers` library gives for the prompts (the
reference was made with transformers). Uses only the CI venv (tokenizers, numpy)."""
import json
import os
import struct
import sys

from tokenizers import Tokenizer

ROOT = os.environ.get("KVS_ROOT", os.path.join(os.path.dirname(__file__), "..", ".."))
D = os.path.join(ROOT, "models", "demo")
failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        failures.append(what)


def load_json(name):
    with open(os.path.join(D, name), encoding="utf-8") as f:
        return json.load(f)


cfg = load_json("config.json")
check(cfg.get("architectures") == ["LlamaForCausalLM"], "config: LlamaForCausalLM")
hd = cfg["head_dim"]
check(hd == 64 and cfg["hidden_size"] == cfg["num_attention_heads"] * hd, "config: head_dim 64")
check(cfg["num_attention_heads"] == 4 * cfg["num_key_value_heads"], "config: GQA 4:1")
check(cfg["num_hidden_layers"] >= 6, "config: at least 6 layers")
check(cfg["max_position_embeddings"] == 4096, "config: 4096 positions")
check(cfg["rope_theta"] >= 100000 and cfg.get("rope_scaling") is None, "config: plain large-theta RoPE")
check(cfg["tie_word_embeddings"] is True, "config: tied embeddings")

# safetensors: 8-byte little-endian header length, JSON header, data
path = os.path.join(D, "model.safetensors")
size = os.path.getsize(path)
check(size < 15 * 1000 * 1000, "model.safetensors under 15 MB (%d bytes)" % size)
with open(path, "rb") as f:
    (hlen,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(hlen))
header.pop("__metadata__", None)
V, H, I = cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"]
KV = cfg["num_key_value_heads"] * hd
want = {"model.embed_tokens.weight": [V, H], "model.norm.weight": [H]}
for i in range(cfg["num_hidden_layers"]):
    p = "model.layers.%d." % i
    want.update({p + "self_attn.q_proj.weight": [H, H], p + "self_attn.k_proj.weight": [KV, H],
                 p + "self_attn.v_proj.weight": [KV, H], p + "self_attn.o_proj.weight": [H, H],
                 p + "mlp.gate_proj.weight": [I, H], p + "mlp.up_proj.weight": [I, H],
                 p + "mlp.down_proj.weight": [H, I], p + "input_layernorm.weight": [H],
                 p + "post_attention_layernorm.weight": [H]})
check(set(header) == set(want), "safetensors: exactly the expected tensors (%d)" % len(want))
check(all(header[k]["dtype"] == "BF16" and header[k]["shape"] == want[k]
          for k in want if k in header), "safetensors: bf16 tensors of the config's shapes")
end = max(v["data_offsets"][1] for v in header.values())
check(8 + hlen + end == size, "safetensors: data fills the file exactly")
n_params = sum(a * (b if b else 1) for a, b in
               [(s[0], s[1] if len(s) > 1 else 0) for s in want.values()])
print("parameters: %.2fM" % (n_params / 1e6))

tok = Tokenizer.from_file(os.path.join(D, "tokenizer.json"))
check(tok.get_vocab_size() == V, "tokenizer: vocabulary %d matches config" % V)
ids = {s: tok.token_to_id(s) for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
check(ids == {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}, "tokenizer: special ids %s" % ids)
tc = load_json("tokenizer_config.json")
check(tc["eos_token"] == "<|im_end|>" and not tc.get("bos_token") and not tc["add_bos_token"],
      "tokenizer_config: eos <|im_end|>, no BOS")
tmpl = tc["chat_template"]
check("'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'" in tmpl
      and "'<|im_start|>assistant\\n'" in tmpl, "tokenizer_config: ChatML template")
gc = load_json("generation_config.json")
eos = gc["eos_token_id"] if isinstance(gc["eos_token_id"], list) else [gc["eos_token_id"]]
check(2 in eos and 0 in eos, "generation_config: eos includes <|im_end|> and <|endoftext|>")
chat = "<|im_start|>user\nRecite Genesis 1:1.<|im_end|>\n<|im_start|>assistant\n"
enc = tok.encode(chat, add_special_tokens=False)
check(enc.ids[0] == 1 and enc.ids[-3:-1] == [1, tok.token_to_id("assistant")] and
      tok.decode(enc.ids, skip_special_tokens=False) == chat, "tokenizer: ChatML round trip")
text = "The secret code of Alice is 4821.\n"
check(tok.decode(tok.encode(text).ids) == text and
      [tok.id_to_token(i) for i in tok.encode("4821").ids] == list("4821"),
      "tokenizer: round trip, single digits")

with open(os.path.join(ROOT, "tests", "data", "demo_reference.json"), encoding="utf-8") as f:
    ref = json.load(f)
check(len(ref["cases"]) >= 3, "reference: %d cases" % len(ref["cases"]))
for c in ref["cases"]:
    got = tok.encode(c["prompt"], add_special_tokens=False).ids
    check(got == c["prompt_ids"], "reference %s: prompt ids equal tokenizers' encoding" % c["name"])
    check(len(c["greedy_ids"]) == ref["n_new"] and len(c["top5_last"]["ids"]) == 5 and
          c["top5_last"]["ids"][0] == c["greedy_ids"][0] and
          all(0 <= i < V for i in c["greedy_ids"]), "reference %s: well formed" % c["name"])

print("%d checks failed" % len(failures) if failures else "all checks passed")
sys.exit(1 if failures else 0)
