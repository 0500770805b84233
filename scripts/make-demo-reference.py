#!/usr/bin/env python3
"""Writes tests/data/demo_reference.json: what Hugging Face transformers (CPU, fp32 compute on
the bf16 weights) computes for the demo model, for kvserve's tests to compare against.

  /opt/refenv/bin/python scripts/make-demo-reference.py [--model models/demo]
      [--out tests/data/demo_reference.json]

For each prompt: the prompt's token ids (chat prompts through the model's own chat template,
with the generation prompt), the ids of the top 5 logits at the last prompt position with their
values, and the greedy continuation of exactly 24 tokens (end-of-sequence tokens do not stop it)
with the margin between the best and second-best logit at each step, so that a test can tell a
real mismatch from a near tie.
"""
import argparse
import json
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

N_NEW = 24


def prompts(tok):
    filler = ("And the LORD God planted a garden eastward in Eden; and there he put the man whom "
              "he had formed.\nThe secret code of Alice is 4821.\nAnd a river went out of Eden "
              "to water the garden; and from thence it was parted, and became into four heads.\n"
              "Bob lives in Paris.\n")
    return [
        ("chat_recite", tok.apply_chat_template(
            [{"role": "user", "content": "Recite Genesis 1:1."}],
            tokenize=False, add_generation_prompt=True)),
        ("chat_system_about", tok.apply_chat_template(
            [{"role": "system", "content": "You are a helpful assistant."},
             {"role": "user", "content": "What does the book of Ruth say about Naomi?"}],
            tokenize=False, add_generation_prompt=True)),
        ("chat_who", tok.apply_chat_template(
            [{"role": "user", "content": "Who are you?"}],
            tokenize=False, add_generation_prompt=True)),
        ("plain_text", "In the beginning God created"),
        ("retrieval_qa", filler + "Question: What is the secret code of Alice?\nAnswer:"),
        ("chat_retrieval", tok.apply_chat_template(
            [{"role": "system", "content": "Read the following text and answer questions "
                                           "about it.\n" + filler},
             {"role": "user", "content": "Where does Bob live?"}],
            tokenize=False, add_generation_prompt=True)),
    ]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/demo")
    ap.add_argument("--out", default="tests/data/demo_reference.json")
    a = ap.parse_args()
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    model.eval()
    cases = []
    for name, text in prompts(tok):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        seq = list(ids)
        margins = []
        top5 = None
        with torch.no_grad():
            for step in range(N_NEW):
                logits = model(torch.tensor([seq])).logits[0, -1]
                vals, idx = torch.topk(logits, 5)
                if step == 0:
                    top5 = {"ids": idx.tolist(), "logits": [round(v, 5) for v in vals.tolist()]}
                margins.append(round(float(vals[0] - vals[1]), 5))
                seq.append(int(idx[0]))
        gen = seq[len(ids):]
        # cross-check the hand-written loop with transformers' own greedy search
        with torch.no_grad():
            hf = model.generate(torch.tensor([ids]), max_new_tokens=N_NEW, min_new_tokens=N_NEW,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
        if hf[0, len(ids):].tolist() != gen:
            raise SystemExit("%s: generate() and the greedy loop disagree" % name)
        cases.append({"name": name, "prompt": text, "prompt_ids": ids,
                      "top5_last": top5, "greedy_ids": gen, "greedy_margins": margins,
                      "greedy_text": tok.decode(gen, skip_special_tokens=False)})
        print("%-18s %3d prompt ids, top5 %s\n    -> %r" % (name, len(ids), top5["ids"],
                                                           cases[-1]["greedy_text"]))
    out = {"model": "models/demo", "generator": "scripts/make-demo-reference.py",
           "compute": "transformers %s, torch %s, CPU, fp32 activations on bf16 weights" % (
               __import__("transformers").__version__, torch.__version__),
           "n_new": N_NEW, "eos_stops": False, "cases": cases}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print("wrote", a.out)


if __name__ == "__main__":
    main()
