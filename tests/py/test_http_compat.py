"""What clients written against vLLM and OpenAI expect (issue 23 items 3, 8, 9, 10):
  - HEAD /health (load balancers), /ping (vLLM's liveness route, GET and POST), /version;
  - /v1/completions without max_tokens generates 16 tokens (OpenAI and vLLM default), chat
    still goes up to the context;
  - the chat stream sends the role with the first token, not before the prefill (a client that
    times the first chunk must see the prefill in it);
  - tools, tool_choice, response_format, suffix: 400 unsupported_parameter naming the field; their
    neutral values (no tools, "none", {"type": "text"}, "") pass;
  - a request with more choices than scheduler.max_waiting: 400 naming the limit, not a 429 that
    a client honouring Retry-After would retry forever;
  - a seed beyond what a JSON number holds exactly: the message says the range;
  - a document longer than the model's context: refused at upload (400 document_too_long);
  - /tokenize with messages and add_generation_prompt false leaves the generation prompt out;
  - best_of (real stack, tiny Llama): of best_of sampled candidates the n with the highest
    cumulative logprob come back, best first; the candidates are those of the same request with
    n = best_of (choice j samples with seed + j)."""
import json
import time

import requests

import os
import tempfile

from kvs_http import E2E_BIN, ROOT, Server, chatml, check, complete, tokenize
from tiny_tokenizer import make_model_dir


def main():
    with Server("--quiet", "--max-waiting", "4", "--documents-max-tokens", "100000",
                env={"KVS_FAKE_PREFILL_MS": "300"}) as srv:
        b = srv.base
        r = requests.head(b + "/health", timeout=5)
        check(r.status_code == 200 and not r.content, f"HEAD /health: {r.status_code}")
        for m in ("get", "post"):
            r = getattr(requests, m)(b + "/ping", timeout=5)
            check(r.status_code == 200, f"{m} /ping: {r.status_code}")
        r = requests.get(b + "/version", timeout=5)
        check(r.status_code == 200 and r.json()["version"], f"/version: {r.text}")

        # default max_tokens: completions 16, chat up to the context (the fake's EOS ends it)
        long_prompt = "abcdefghijklmnopqrstuvwxyz0123456789"
        r = requests.post(b + "/v1/completions", json={"prompt": long_prompt}, timeout=30).json()
        check(r["usage"]["completion_tokens"] == 16 and r["choices"][0]["finish_reason"] == "length"
              and r["choices"][0]["text"] == complete(tokenize(long_prompt), 16)[0], f"completions default: {r}")
        r = requests.post(b + "/v1/chat/completions", timeout=30,
                          json={"messages": [{"role": "user", "content": long_prompt}], "ignore_eos": True}).json()
        check(r["usage"]["completion_tokens"] == 256 - r["usage"]["prompt_tokens"], f"chat default up to the context: {r['usage']}")

        # the chat stream's first chunk comes with the first token, after the prefill (300 ms)
        t0 = time.time()
        with requests.post(b + "/v1/chat/completions", stream=True, timeout=30, json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}) as resp:
            first, t_first = None, None
            for line in resp.iter_lines():
                if line.startswith(b"data: ") and first is None:
                    first, t_first = json.loads(line[6:]), time.time() - t0
        d = first["choices"][0]["delta"]
        check(d.get("role") == "assistant" and d.get("content"), f"first chunk has role and token: {first}")
        check(t_first >= 0.25, f"first chunk after the prefill: {t_first:.3f}s")

        # unsupported parameters are refused by name; neutral values pass
        C, CH = b + "/v1/completions", b + "/v1/chat/completions"
        msgs = [{"role": "user", "content": "x"}]
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        for url, body, name in [(CH, {"messages": msgs, "tools": [tool]}, "tools"),
                                (CH, {"messages": msgs, "tool_choice": "auto"}, "tool_choice"),
                                (CH, {"messages": msgs, "response_format": {"type": "json_object"}}, "response_format"),
                                (C, {"prompt": "x", "response_format": {"type": "json_schema"}}, "response_format"),
                                (C, {"prompt": "x", "suffix": "tail"}, "suffix")]:
            r = requests.post(url, json=dict(body, max_tokens=2), timeout=5)
            e = r.json().get("error", {})
            check(r.status_code == 400 and e.get("code") == "unsupported_parameter" and e.get("param") == name,
                  f"{name}: {r.status_code} {r.text}")
        for url, body in [(CH, {"messages": msgs, "tools": [], "tool_choice": "none"}),
                          (CH, {"messages": msgs, "response_format": {"type": "text"}}),
                          (C, {"prompt": "x", "suffix": ""}), (C, {"prompt": "x", "suffix": None})]:
            r = requests.post(url, json=dict(body, max_tokens=2), timeout=5)
            check(r.status_code == 200, f"neutral {body}: {r.status_code} {r.text}")

        # never admittable: n 5 > max_waiting 4 -> 400 (not 429 + Retry-After)
        r = requests.post(C, json={"prompt": "abc", "n": 5, "max_tokens": 2}, timeout=5)
        check(r.status_code == 400 and "max_waiting" in r.json()["error"]["message"] and "Retry-After" not in r.headers,
              f"never admittable: {r.status_code} {r.text}")
        r = requests.post(C, json={"prompt": "abc", "n": 4, "max_tokens": 2}, timeout=10)
        check(r.status_code == 200 and len(r.json()["choices"]) == 4, f"n 4 fits: {r.status_code}")

        # seed beyond 2^53: the message says the range
        r = requests.post(C, data=b'{"prompt": "x", "seed": 18446744073709551616}', timeout=5,
                          headers={"Content-Type": "application/json"})
        check(r.status_code == 400 and "2^53" in r.json()["error"]["message"], f"big seed: {r.text}")

        # a document longer than the context (256 tokens in the fake) is refused at upload
        r = requests.post(b + "/v1/documents", json={"text": "y" * 300}, timeout=5)
        check(r.status_code == 400 and r.json()["error"]["code"] == "document_too_long"
              and "256" in r.json()["error"]["message"], f"document over the context: {r.status_code} {r.text}")
        r = requests.post(b + "/v1/documents", json={"text": "y" * 100}, timeout=5)
        check(r.status_code == 200, f"document within the context: {r.status_code} {r.text}")
        # /tokenize with messages honours add_generation_prompt
        msgs = [{"role": "user", "content": "hi"}]
        full = chatml(msgs)
        r = requests.post(b + "/tokenize", json={"messages": msgs}, timeout=5).json()
        check(r["tokens"] == tokenize(full, add_special=False), f"tokenize messages: {r}")
        r = requests.post(b + "/tokenize", json={"messages": msgs, "add_generation_prompt": False}, timeout=5).json()
        check(r["tokens"] == tokenize(full[:-len("<|im_start|>assistant\n")], add_special=False),
              f"tokenize without the generation prompt: {r}")
    tmp = tempfile.mkdtemp(prefix="kvs-compat-")
    model = make_model_dir(os.path.join(ROOT, "tests", "data", "models", "llama"), os.path.join(tmp, "tiny-llama"))
    with Server("--quiet", "--set", "kv.memory_bytes=4194304", "--set", "cpu_threads=1", binary=E2E_BIN,
                model=model) as srv:
        C = srv.base + "/v1/completions"
        body = {"prompt": [5, 17, 300, 42], "max_tokens": 8, "temperature": 1.0, "seed": 7, "ignore_eos": True,
                "logprobs": 1, "return_tokens_as_token_ids": True}
        cands = requests.post(C, json=dict(body, n=4), timeout=30).json()["choices"]
        score = sorted(((sum(c["logprobs"]["token_logprobs"]), c["text"]) for c in cands), reverse=True)
        check(len({t for _, t in score}) > 1, f"candidates differ: {score}")
        r = requests.post(C, json=dict(body, n=2, best_of=4), timeout=30).json()
        got = [(c["index"], c["text"]) for c in r["choices"]]
        check(got == [(0, score[0][1]), (1, score[1][1])], f"best_of 4, n 2: {got} vs ranked {score}")
        check(r["usage"]["completion_tokens"] == 16, f"usage counts the returned choices: {r['usage']}")
    print("compat: HEAD /health, /ping, /version, completions default 16, role with the first token, "
          "unsupported parameters refused, never-admittable 400, seed range, long document refused, tokenize add_generation_prompt: ok")


if __name__ == "__main__":
    main()
