"""The HTTP layer over the real stack (build/kvserve-e2e: real model loader, tokenizer, engine)
with the tiny Llama test model plus a byte-level tokenizer (tests/py/tiny_tokenizer.py).
Independent references: transformers' greedy continuations committed in
tests/data/models/llama/reference.json, and Hugging Face `tokenizers` on the same tokenizer.json."""
import json
import os
import random
import tempfile
import threading
import time

import openai
import requests
from tokenizers import Tokenizer

from kvs_http import E2E_BIN, ROOT, Server, check
from test_http_concurrency import stream_request
from tiny_tokenizer import make_model_dir


def main():
    tmp = tempfile.mkdtemp(prefix="kvs-e2e-")
    model = make_model_dir(os.path.join(ROOT, "tests", "data", "models", "llama"), os.path.join(tmp, "tiny-llama"))
    hf = Tokenizer.from_file(os.path.join(model, "tokenizer.json"))
    ref = json.load(open(os.path.join(model, "reference.json")))
    # 4 MiB of f32 KV at 512 bytes/token = 8192 tokens = 512 blocks of 16
    with Server("--quiet", "--set", "kv.memory_bytes=4194304", "--set", "cpu_threads=1", binary=E2E_BIN,
                model=model) as srv:
        b = srv.base
        client = openai.OpenAI(base_url=b + "/v1", api_key="none", max_retries=0, timeout=60)
        check(client.models.list().data[0].id == "tiny-llama", "model id = directory name")

        # greedy continuations equal transformers' (token ids via return_tokens_as_token_ids)
        for p in ref["prompts"]:
            r = requests.post(b + "/v1/completions", json={
                "prompt": p["prompt"], "max_tokens": len(p["greedy"]), "temperature": 0, "ignore_eos": True,
                "logprobs": 0, "return_tokens_as_token_ids": True}, timeout=60).json()
            ids = [int(t.split(":")[1]) for t in r["choices"][0]["logprobs"]["tokens"]]
            check(ids == p["greedy"], f"greedy ids for a {len(p['prompt'])}-token prompt:\n{ids}\n{p['greedy']}")
            check(r["usage"]["prompt_tokens"] == len(p["prompt"]), "prompt tokens")
            want = hf.decode(p["greedy"], skip_special_tokens=True)
            if "\ufffd" not in want:
                check(r["choices"][0]["text"] == want, f"text {r['choices'][0]['text']!r} != {want!r}")
            # without logprobs the same request takes the device-argmax fast path: same text
            fast = requests.post(b + "/v1/completions", json={
                "prompt": p["prompt"], "max_tokens": len(p["greedy"]), "temperature": 0, "ignore_eos": True},
                timeout=60).json()
            check(fast["choices"][0]["text"] == r["choices"][0]["text"], f"greedy fast path text differs: {fast}")
        m = srv.metrics()
        n_fast = m['kvserve:argmax_tokens_total{model_name="tiny-llama"}']
        check(n_fast == sum(len(p["greedy"]) for p in ref["prompts"]),
              f"greedy without logprobs: every token picked on the device ({n_fast})")

        # /tokenize and /detokenize equal HF tokenizers on the same file
        for text in ["hello world.", "the quick brown fox <|im_end|> ok", "naïve café 😀", ""]:
            r = requests.post(b + "/tokenize", json={"prompt": text}).json()
            check(r["tokens"] == hf.encode(text).ids and r["max_model_len"] == 512, f"tokenize {text!r}: {r}")
            d = requests.post(b + "/detokenize", json={"tokens": r["tokens"]}).json()
            check(d["prompt"] == hf.decode(r["tokens"], skip_special_tokens=False), f"detokenize {text!r}: {d}")

        # chat: the prompt is ChatML tokenized like HF; streaming equals non-streaming (greedy)
        msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
        chatml = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs) + "<|im_start|>assistant\n"
        r = client.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=12, temperature=0)
        check(r.usage.prompt_tokens == len(hf.encode(chatml).ids), f"chat prompt tokens {r.usage}")
        text = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
            model="tiny-llama", messages=msgs, max_tokens=12, temperature=0, stream=True) if ch.choices)
        check(text == r.choices[0].message.content, f"stream {text!r} != {r.choices[0].message.content!r}")

        # documents: a document's tokens placed before the prompt give the same continuation as
        # sending the concatenated ids directly
        doc = requests.post(b + "/v1/documents", json={"text": "the doc says hello."}).json()
        doc_ids = hf.encode("the doc says hello.").ids
        r1 = requests.post(b + "/v1/completions", json={"prompt": "and then", "documents": [doc["id"]],
                                                        "max_tokens": 8, "temperature": 0, "ignore_eos": True}).json()
        r2 = requests.post(b + "/v1/completions", json={"prompt": doc_ids + hf.encode("and then").ids,
                                                        "max_tokens": 8, "temperature": 0, "ignore_eos": True}).json()
        n_ids = len(doc_ids) + len(hf.encode("and then").ids)
        check(r1["choices"][0]["text"] == r2["choices"][0]["text"] and doc["tokens"] == len(doc_ids) and
              r1["usage"]["prompt_tokens"] == r2["usage"]["prompt_tokens"] == n_ids, f"documents {r1} {r2}")

        # 64 concurrent streams, a third hang up at random points (0 = right after sending, before
        # the first token): the others get exactly the text a lone non-streaming request gets
        rng = random.Random(7)
        N = 64
        plan = [rng.choice([0, 1, 2, 3, 5, 8]) if i % 3 == 0 else None for i in range(N)]
        body = lambda i: {"prompt": f"stream number {i} of the test", "max_tokens": 24, "temperature": 0,
                          "ignore_eos": True}
        results, errors = [None] * N, []

        def worker(i):
            try:
                results[i] = stream_request(srv.port, dict(body(i), stream=True), disconnect_after=plan[i])
            except Exception as e:  # noqa: BLE001
                errors.append(f"{i}: {e!r}")

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(N)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        check(not errors, "\n".join(errors))
        for i, res in enumerate(results):
            if plan[i] is None:
                alone = requests.post(b + "/v1/completions", json=body(i), timeout=60).json()["choices"][0]
                check(res[2] and res[1] == "length" and res[0] == alone["text"],
                      f"stream {i}: {res} != {alone}")
        end = time.time() + 20
        while time.time() < end:
            m = srv.metrics()
            if m['kvserve:kv_blocks_used{model_name="tiny-llama"}'] == 0 and \
                    m['vllm:num_requests_running{model_name="tiny-llama"}'] == 0:
                break
            time.sleep(0.1)
        check(m['kvserve:kv_blocks_used{model_name="tiny-llama"}'] == 0, f"KV blocks still used: {m}")
        check(m['kvserve:kv_blocks_total{model_name="tiny-llama"}'] == 512, "pool size")
    print("real stack: greedy = transformers for 4 prompts (with logprobs, and without through the device-argmax "
          "fast path), tokenize = HF, chat, documents, streams with disconnects, KV pool full again")


if __name__ == "__main__":
    main()
