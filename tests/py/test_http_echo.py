"""echo on /v1/completions (issue 23 item 2), as vLLM returns it and as lm-evaluation-harness
(`local-completions`, loglikelihood tasks) asks for it.

lm-eval's request (lm_eval/models/openai_completions.py, LocalCompletionsAPI._create_payload with
generate=False; tokenized_requests=True sends token-id lists):
    {"model", "prompt": [[ids], ...], "temperature": 0, "max_tokens": 1, "logprobs": 1,
     "seed": 1234, "echo": true}
and its parse_logprobs: per choice (sorted by index) and context length ctxlen,
    logprob = sum(token_logprobs[ctxlen:-1]); is_greedy = every token_logprobs[i] equals
    max(top_logprobs[i].values()) for i in [ctxlen, -1).
That code is mirrored here (lm-eval itself pulls in torch: too heavy for the test venv).

1) fake model (build/kvserve-fake: the real engine over tests/fake/fake_model.h, prompt
   logprobs as kvs_http.next_byte_logprob predicts them): lm-eval's batch of three prompts,
   greedy and not-greedy continuations; max_tokens 0 with a text prompt (the prompt's tokens,
   first logprob null, finish "length", no completion tokens); echo without logprobs;
   logprobs 0 holds the sampled token; the sampled token is in top_logprobs even when not in
   the top N; streaming: the prompt and its logprobs are the first chunk.
2) real stack (build/kvserve-e2e, tiny Llama): a greedy continuation's own logprobs equal the
   echoed prompt logprobs of prompt + that continuation, and lm-eval calls it greedy."""
import json
import math
import os
import tempfile

import requests

from kvs_http import E2E_BIN, ROOT, Server, check, complete, next_byte_logprob, tokenize
from tiny_tokenizer import make_model_dir

LP_TOP = math.log(0.5)


def lm_eval_parse(out, ctxlens):
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=lambda c: c["index"]), ctxlens):
        assert ctxlen > 0
        lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        greedy = all(tok == max(top.values()) for tok, top in zip(lps, tops))
        res.append((sum(lps), greedy))
    return res


def fake_prompt_lp(ids, p):
    """prompt logprob of ids[p] (p >= 1)"""
    return next_byte_logprob(ids[p - 1], ids[p])


def fake_is_top(ids, p):
    """ids[p] is the most likely token after ids[p - 1]"""
    return ids[p] == (ids[p - 1] + 1) % 256


def tokstr(t):
    return {256: "<|endoftext|>", 257: "<|im_start|>", 258: "<|im_end|>", 259: "<|bos|>"}.get(t) or bytes([t]).decode(
        "utf-8", "replace")


def close(a, b):
    return abs(a - b) < 1e-5


def fake_checks():
    with Server("--quiet") as srv:
        C = srv.base + "/v1/completions"
        # lm-eval's loglikelihood batch: (context, continuation) token lists; "d" after "c" and "z"
        # after "y" are the fake's top choices (greedy), " Paris" is not
        reqs = [(list(b"The capital is"), list(b" Paris")), (list(b"abc"), list(b"d")), (list(b"xy"), list(b"z"))]
        prompts = [c + k for c, k in reqs]
        ctxlens = [len(c) for c, _ in reqs]
        r = requests.post(C, json={"model": "fake", "prompt": prompts, "temperature": 0, "max_tokens": 1,
                                   "logprobs": 1, "seed": 1234, "echo": True}, timeout=10)
        check(r.status_code == 200, f"lm-eval request: {r.status_code} {r.text}")
        out = r.json()
        check(len(out["choices"]) == 3, "one choice per prompt")
        for ch, pr in zip(sorted(out["choices"], key=lambda c: c["index"]), prompts):
            lp = ch["logprobs"]
            check(len(lp["tokens"]) == len(pr) + 1 and len(lp["token_logprobs"]) == len(pr) + 1,
                  f"prompt tokens + 1 generated: {len(lp['tokens'])} for {len(pr)}")
            check(lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None, "first prompt token: null")
            check(lp["tokens"][:len(pr)] == [tokstr(t) for t in pr], f"echoed tokens {lp['tokens']}")
            for p in range(1, len(pr)):
                check(close(lp["token_logprobs"][p], fake_prompt_lp(pr, p)), f"pos {p}: {lp['token_logprobs'][p]}")
                top = lp["top_logprobs"][p]
                check(tokstr(pr[p]) in top, f"pos {p}: the prompt token is in top_logprobs {top}")
            check(lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"]), "text_offset")
            gen_text = complete(pr, 1)[0]
            check(ch["text"] == bytes(pr).decode() + gen_text, f"echo text {ch['text']!r}")
            check(close(lp["token_logprobs"][-1], LP_TOP), "generated token's logprob")
        got = lm_eval_parse(out, ctxlens)
        for (lpsum, greedy), pr, cl in zip(got, prompts, ctxlens):
            want = sum(fake_prompt_lp(pr, p) for p in range(cl, len(pr)))
            want_greedy = all(fake_is_top(pr, p) for p in range(cl, len(pr)))
            check(close(lpsum, want) and greedy == want_greedy, f"lm-eval result {lpsum, greedy} want {want, want_greedy}")
        check(any(g for _, g in got) and not all(g for _, g in got), f"both greedy and not: {got}")

        # max_tokens 0: the prompt scored, nothing generated
        r = requests.post(C, json={"prompt": "abdz", "max_tokens": 0, "echo": True, "logprobs": 2}, timeout=10)
        check(r.status_code == 200, f"max_tokens 0: {r.status_code} {r.text}")
        ch = r.json()["choices"][0]
        ids = tokenize("abdz")
        check(ch["text"] == "abdz" and ch["finish_reason"] == "length", f"max_tokens 0 choice {ch}")
        check(r.json()["usage"]["completion_tokens"] == 0 and r.json()["usage"]["prompt_tokens"] == len(ids), "usage")
        lp = ch["logprobs"]
        check(lp["tokens"] == [tokstr(t) for t in ids], f"tokens {lp['tokens']}")
        check(lp["token_logprobs"][0] is None and all(close(v, fake_prompt_lp(ids, p)) for p, v in
                                                     enumerate(lp["token_logprobs"]) if p), f"{lp['token_logprobs']}")
        in_top2 = [(ids[p] - ids[p - 1] - 1) % 256 < 2 for p in range(1, len(ids))]
        check(any(in_top2) and not all(in_top2), f"both cases below: {in_top2}")
        for p in range(1, len(ids)):
            # 2 alternatives; the prompt token is one of them ("b" after "a", "d" after "b"), or a third entry
            check(len(lp["top_logprobs"][p]) == (2 if in_top2[p - 1] else 3), f"pos {p} top {lp['top_logprobs'][p]}")
        # echo without logprobs, with and without generation
        r = requests.post(C, json={"prompt": "abcd", "max_tokens": 3, "echo": True}, timeout=10).json()
        check(r["choices"][0]["text"] == "abcd" + complete(tokenize("abcd"), 3)[0] and r["choices"][0]["logprobs"] is None,
              f"echo + 3 tokens: {r}")
        r = requests.post(C, json={"prompt": "abcd", "max_tokens": 0, "echo": True}, timeout=10).json()
        check(r["choices"][0]["text"] == "abcd" and r["usage"]["completion_tokens"] == 0, f"echo only: {r}")
        # streaming: the prompt (with its logprobs) is the first chunk, then the tokens
        for mt in (2, 0):
            with requests.post(C, stream=True, timeout=10, json={"prompt": "abcd", "max_tokens": mt, "echo": True,
                                                                 "logprobs": 1, "stream": True}) as resp:
                chunks = [json.loads(ln[6:]) for ln in resp.iter_lines() if ln.startswith(b"data: {")]
            first = chunks[0]["choices"][0]
            ids = tokenize("abcd")
            check(first["text"] == "abcd" and first["logprobs"]["tokens"] == [tokstr(t) for t in ids]
                  and first["logprobs"]["token_logprobs"][0] is None, f"stream echo, first chunk: {first}")
            text = "".join(c["choices"][0]["text"] for c in chunks)
            check(text == "abcd" + complete(ids, mt)[0] if mt else text == "abcd", f"stream echo text {text!r}")
            check(chunks[-1]["choices"][0]["finish_reason"] == "length", f"stream echo end {chunks[-1]}")
            check(len(chunks) == 1 + mt + 1, f"prompt chunk, {mt} tokens, finish: {len(chunks)} chunks")
        # logprobs 0 (no echo) holds the sampled token, as in vLLM
        r = requests.post(C, json={"prompt": "abcd", "max_tokens": 2, "logprobs": 0}, timeout=10).json()
        tops = r["choices"][0]["logprobs"]["top_logprobs"]
        check(tops == [{"d": LP_TOP}, {"c": LP_TOP}] or all(list(t) == [k] and close(v, LP_TOP) for t, k in zip(tops, "dc")
                                                            for v in t.values()), f"logprobs 0: {tops}")


def real_checks():
    tmp = tempfile.mkdtemp(prefix="kvs-echo-")
    model = make_model_dir(os.path.join(ROOT, "tests", "data", "models", "llama"), os.path.join(tmp, "tiny-llama"))
    with Server("--quiet", "--set", "kv.memory_bytes=4194304", "--set", "cpu_threads=1", binary=E2E_BIN,
                model=model) as srv:
        C = srv.base + "/v1/completions"
        ctx = [5, 17, 300, 42, 7, 99, 128, 64]
        g = requests.post(C, json={"prompt": ctx, "max_tokens": 6, "temperature": 0, "logprobs": 1, "ignore_eos": True,
                                   "return_tokens_as_token_ids": True}, timeout=30).json()
        gl = g["choices"][0]["logprobs"]
        cont = [int(t.split(":")[1]) for t in gl["tokens"]]
        full = ctx + cont
        for rep in range(2):   # the second time the prompt's blocks are in the prefix cache
            r = requests.post(C, json={"prompt": full, "max_tokens": 0, "temperature": 0, "logprobs": 1, "echo": True,
                                       "return_tokens_as_token_ids": True}, timeout=30)
            check(r.status_code == 200, f"real echo: {r.status_code} {r.text}")
            lp = r.json()["choices"][0]["logprobs"]
            check(lp["tokens"] == [f"token_id:{t}" for t in full], "echoed ids")
            for i in range(len(cont)):
                a, b = lp["token_logprobs"][len(ctx) + i], gl["token_logprobs"][i]
                check(abs(a - b) < 1e-3, f"rep {rep} pos {len(ctx) + i}: prompt logprob {a} vs generated {b}")
            (s, greedy), = lm_eval_parse({"choices": [dict(r.json()["choices"][0], logprobs={
                k: v + [None] for k, v in lp.items()})]}, [len(ctx)])
            check(greedy and abs(s - sum(gl["token_logprobs"])) < 1e-3 * len(cont), f"lm-eval view {s} {greedy}")


def main():
    fake_checks()
    real_checks()
    print("echo: lm-eval's loglikelihood pattern (sums, greedy), max_tokens 0, echo without logprobs, "
          "logprobs 0; real stack: prompt logprobs == generated logprobs: ok")


if __name__ == "__main__":
    main()
