"""kv.reuse=lazy over HTTP (build/kvserve-e2e: real stack, tiny Llama, byte-level tokenizer).

Documents posted once (POST /v1/documents with token ids) and cited by id in completions and chat
become doc segments. Checked against an independent reference in numpy (tests/py/np_llama.py): the
tiny Llama's forward pass straight from model.safetensors with Block-Attention semantics (each
document attends only to itself, at padded positions: document d starts at the sum of the
previous documents' lengths rounded up to the 16-token block; the prompt follows the last
document's padded end and attends to everything). Also: usage.prompt_tokens_details.cached_tokens
on a warm cache, the kvserve:doc_cache_* metrics, chat with documents (same output twice, the
second from the cache), and that without kv.reuse=lazy documents stay plain prompt text.

Greedy token comparisons go through greedy_check.check_greedy: exact on the CPU; with
KVS_TEST_DEVICE=cuda (bf16) a divergence is accepted only at a near-tie of the reference, and the
output after it is checked teacher-forced against the numpy reference. Per assertion:
  - completions with documents (cold and warm), chat with text documents, reuse=none: model vs
    the numpy reference (its margins and teacher-forced gaps, same segments);
  - chat with token documents twice: self-consistency (cold vs warm cache): exact text on the
    CPU (requests as they are); tolerant (GPU), the requests ask for token ids (logprobs, the
    host-sampling path) compared with the first answer's own top_logprobs margins, and the texts
    must be equal wherever the ids are;
  - prompt/cached token counts, doc_cache metrics, plain == causal (two references): exact
    everywhere."""
import os
import tempfile

import numpy as np
import requests
from tokenizers import Tokenizer

from greedy_check import TOLERANT, check_greedy, describe, top_margins
from kvs_http import E2E_BIN, ROOT, Server, check, chatml
from np_llama import BS, Ref
from tiny_tokenizer import make_model_dir


def complete(base, body):
    r = requests.post(base + "/v1/completions", json=dict(body, temperature=0, ignore_eos=True, logprobs=0,
                                                         return_tokens_as_token_ids=True), timeout=60)
    check(r.status_code == 200, f"{r.status_code} {r.text}")
    j = r.json()
    return [int(t.split(":")[1]) for t in j["choices"][0]["logprobs"]["tokens"]], j["usage"]


def main():
    tmp = tempfile.mkdtemp(prefix="kvs-lazy-")
    model = make_model_dir(os.path.join(ROOT, "tests", "data", "models", "llama"), os.path.join(tmp, "tiny-llama"))
    ref = Ref(model)
    rng = np.random.default_rng(7)
    docs = {f"doc{i}": [int(t) for t in rng.integers(0, 256, n)] for i, n in enumerate([23, 16, 1, 40])}
    cases = [(["doc0", "doc1"], 9), (["doc3", "doc0", "doc2"], 5), (["doc1", "doc3"], 12)]
    prompts = [[int(t) for t in rng.integers(0, 256, n)] for _, n in cases]
    margins = [[] for _ in cases]
    want = [ref.greedy([docs[d] for d in ids], pr, 6, margins=m) for (ids, _), pr, m in zip(cases, prompts, margins)]
    print(describe())

    with Server("--quiet", "--set", "kv.memory_bytes=4194304", "--set", "cpu_threads=1", "--set", "kv.reuse=lazy",
                binary=E2E_BIN, model=model) as srv:
        b = srv.base
        for name, ids in docs.items():
            r = requests.post(b + "/v1/documents", json={"id": name, "tokens": ids}, timeout=10)
            check(r.status_code == 200, f"post document: {r.status_code} {r.text}")
        for rnd in range(2):
            for (ids, _), pr, w, wm in zip(cases, prompts, want, margins):
                got, usage = complete(b, {"prompt": pr, "documents": ids, "max_tokens": 6})
                check_greedy(got, w, f"round {rnd} docs {ids} vs reference", margins=wm,
                             gaps=lambda g, ids=ids, pr=pr: ref.gaps([docs[d] for d in ids], pr, g))
                n_doc = sum(len(docs[d]) for d in ids)
                check(usage["prompt_tokens"] == n_doc + len(pr), f"prompt tokens {usage}")
                if rnd == 1:
                    cached = usage["prompt_tokens_details"]["cached_tokens"]
                    check(cached == n_doc, f"warm: cached_tokens {cached} != {n_doc}")
        m = srv.metrics()
        key = lambda n: next(v for k, v in m.items() if k.startswith(n + "{"))
        check(key("kvserve:doc_cache_misses_total") == 4, f"misses {key('kvserve:doc_cache_misses_total')}")
        check(key("kvserve:doc_cache_hits_total") == 2 * 7 - 4, "hits")
        check(key("kvserve:doc_cache_prefill_tokens_total") == sum(len(v) for v in docs.values()), "computed once")
        check(0.5 < key("kvserve:doc_cache_hit_ratio") < 1 and key("kvserve:doc_cache_bytes") > 0, "gauges")

        # chat with documents: template text around the documents is cached too; the second
        # identical request is served from the cache and answers the same
        # (tolerant, GPU: with token ids, i.e. logprobs: the host-sampling path; on the CPU as is)
        body = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what?"}],
                "documents": ["doc0", "doc3"], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                **({"logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True} if TOLERANT else {})}
        r1 = requests.post(b + "/v1/chat/completions", json=body, timeout=60).json()
        r2 = requests.post(b + "/v1/chat/completions", json=body, timeout=60).json()
        same = True
        if TOLERANT:
            lp1, lp2 = r1["choices"][0]["logprobs"]["content"], r2["choices"][0]["logprobs"]["content"]
            ids1, ids2 = ([int(c["token"].split(":")[1]) for c in lp] for lp in (lp1, lp2))
            check_greedy(ids2, ids1, "chat with token documents: warm vs cold",
                         margins=top_margins([[t["logprob"] for t in c["top_logprobs"]] for c in lp1]))
            same = ids1 == ids2
        if same:
            check(r1["choices"][0]["message"]["content"] == r2["choices"][0]["message"]["content"], "chat repeatable")
        check(r2["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(docs["doc0"]) + len(docs["doc3"]),
              f"chat cached tokens {r2['usage']}")
        check(r1["usage"]["prompt_tokens"] == r2["usage"]["prompt_tokens"], "chat usage")

        # chat with text documents against the reference: the rendered ChatML (kvs_http.chatml) cut at
        # the documents, every piece up to the last document a segment, tokenized by HF tokenizers
        hf = Tokenizer.from_file(os.path.join(model, "tokenizer.json"))
        texts = {"t0": "The quick brown fox jumps over the lazy dog. " * 2, "t1": "Paged KV caches share blocks."}
        for name, text in texts.items():
            r = requests.post(b + "/v1/documents", json={"id": name, "text": text}, timeout=10)
            check(r.status_code == 200, f"post text document: {r.text}")
        msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why?"}]
        rendered = chatml(msgs, [texts["t0"], texts["t1"]])
        segs, at = [], 0
        for t in (texts["t0"], texts["t1"]):
            i = rendered.index(t, at)
            if i > at:
                segs.append(hf.encode(rendered[at:i], add_special_tokens=False).ids)
            segs.append(hf.encode(t, add_special_tokens=False).ids)
            at = i + len(t)
        tail = hf.encode(rendered[at:], add_special_tokens=False).ids
        wm = []
        w = ref.greedy(segs, tail, 6, margins=wm)
        for rnd in range(2):
            r = requests.post(b + "/v1/chat/completions", json={
                "messages": msgs, "documents": ["t0", "t1"], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                "logprobs": True, "return_tokens_as_token_ids": True}, timeout=60).json()
            got = [int(c["token"].split(":")[1]) for c in r["choices"][0]["logprobs"]["content"]]
            check_greedy(got, w, f"chat round {rnd} with text documents vs reference", margins=wm,
                         gaps=lambda g: ref.gaps(segs, tail, g))

    # without lazy the documents are plain prompt text: the ordinary causal reference
    with Server("--quiet", "--set", "kv.memory_bytes=4194304", "--set", "cpu_threads=1", "--set", "kv.reuse=none",
                binary=E2E_BIN, model=model) as srv:
        for name, ids in docs.items():
            requests.post(srv.base + "/v1/documents", json={"id": name, "tokens": ids}, timeout=10)
        ids, _ = cases[0]
        flat = docs[ids[0]] + docs[ids[1]]
        got, usage = complete(srv.base, {"prompt": prompts[0], "documents": ids, "max_tokens": 6})
        plain = ref.greedy([flat], prompts[0], 6) if len(flat) % BS == 0 else None
        cm = []
        causal = ref.greedy([], flat + prompts[0], 6, margins=cm)  # no documents: positions 0.., causal
        check_greedy(got, causal, "reuse=none with documents vs plain causal reference", margins=cm,
                     gaps=lambda g: ref.gaps([], flat + prompts[0], g))
        check(plain is None or plain == causal, "one block-aligned document == causal")
    print("lazy over HTTP: completions with documents == numpy Block-Attention reference (cold and warm), "
          "cached_tokens, doc_cache metrics, chat (template pieces + documents as segments) == reference, reuse=none keeps documents as text: ok")


if __name__ == "__main__":
    main()
