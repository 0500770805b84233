#!/usr/bin/env python3
"""Reference logits from Hugging Face transformers for tests/gpu/test_cuda_hf.c.

Loads MODEL_DIR (float32 weights on the GPU when there is one: the tightest reference for a bf16
model), feeds a fixed sequence of N_PROMPT + N_DECODE seeded random token ids in one forward
pass (teacher forced: kvserve sees the same ids, prefilled then decoded one at a time), and
writes the fp32 logits of the last N_ROWS positions:

  header   8 bytes "KVSHF001", then int32 vocab, n_tokens, first_row, n_rows
  tokens   int32 [n_tokens]
  logits   float32 [n_rows][vocab]   (positions first_row .. first_row + n_rows - 1)

  python3 scripts/hf-logits-reference.py MODEL_DIR OUT.bin
"""
import struct
import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM

N_PROMPT, N_DECODE, N_ROWS = 192, 8, 16


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    model_dir, out = sys.argv[1], sys.argv[2]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    except TypeError:  # transformers before 4.56 names it torch_dtype
        model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model = model.to(dev).eval()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1234)
    n = N_PROMPT + N_DECODE
    ids = torch.randint(0, vocab, (1, n), generator=g)
    with torch.no_grad():
        logits = model(ids.to(dev)).logits[0].float().cpu().numpy()
    first = n - N_ROWS
    with open(out, "wb") as f:
        f.write(b"KVSHF001")
        f.write(struct.pack("<4i", vocab, n, first, N_ROWS))
        f.write(ids[0].numpy().astype("<i4").tobytes())
        f.write(np.ascontiguousarray(logits[first:], dtype="<f4").tobytes())
    top = np.sort(logits[first:], axis=1)
    print(f"wrote {out}: {model.config.architectures[0]}, {model.config.num_hidden_layers} layers, vocab {vocab}, "
          f"{n} tokens, logits of positions {first}..{n - 1}; smallest top-2 margin {np.min(top[:, -1] - top[:, -2]):.4f}",
          flush=True)


if __name__ == "__main__":
    main()
