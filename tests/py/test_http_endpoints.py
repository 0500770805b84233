"""Every endpoint with plain HTTP (requests + raw SSE parsing): health while loading, models,
tokenize/detokenize, metrics names and values, documents (CRUD, persistence across restarts,
use in completions and chat), SSE framing and keep-alive comments, per-request timeout."""
import json
import os
import re
import tempfile
import time

import requests
from tokenizers import Tokenizer

from kvs_http import ROOT, Server, check, chatml, complete, tokenize


def sse_events(resp):
    """Raw SSE lines of a streaming response: returns (data payloads, comment lines)."""
    data, comments = [], []
    buf = b""
    for chunk in resp.iter_content(chunk_size=None):
        buf += chunk
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            line = ev.decode()
            if line.startswith(":"):
                comments.append(line)
            else:
                check(line.startswith("data: "), f"bad SSE event {line!r}")
                data.append(line[6:])
    check(buf == b"", f"trailing bytes {buf!r}")
    return data, comments


def test_loading():
    srv = Server(env={"KVS_FAKE_LOAD_MS": "1500"}, wait=False)
    try:
        deadline = time.time() + 5
        seen503 = False
        while time.time() < deadline:
            try:
                r = requests.get(srv.base + "/health", timeout=1)
                if r.status_code == 503:
                    check(r.json()["error"]["message"] == "Loading model", f"loading body {r.text}")
                    check(r.headers.get("Retry-After"), "Retry-After while loading")
                    r2 = requests.post(srv.base + "/v1/completions", json={"prompt": "x"}, timeout=2)
                    check(r2.status_code == 503, f"completion while loading: {r2.status_code}")
                    seen503 = True
                    break
            except requests.ConnectionError:
                time.sleep(0.02)
        check(seen503, "never saw 503 while loading")
        srv.wait_healthy()
    finally:
        srv.stop()


def test_main():
    docdir = tempfile.mkdtemp(prefix="kvs-docs-")
    with Server("--documents-dir", docdir, "--keepalive", "0.2", "--served-name", "tiny",
                env={"KVS_FAKE_PREFILL_MS": "900"}) as srv:
        b = srv.base
        r = requests.get(b + "/v1/models").json()
        m = r["data"][0]
        check(r["object"] == "list" and m["id"] == "tiny" and m["object"] == "model" and m["owned_by"]
              and isinstance(m["created"], int) and m["max_model_len"] == 256, f"models {r}")

        # the fake's tokenizer file is a real one: HF `tokenizers` gives the ids kvs_http predicts
        hf = Tokenizer.from_file(os.path.join(ROOT, "tests", "data", "fake", "tokenizer.json"))
        for text in ("hi<|im_end|>", "<|im_start|>user\nnaïve 😀<|endoftext|>", "a<|bos|>b"):
            check(hf.encode(text).ids == tokenize(text), f"HF ids of {text!r}: {hf.encode(text).ids}")
            check(hf.encode(text, add_special_tokens=False).ids == tokenize(text, add_special=False), f"{text!r}")

        # tokenize / detokenize (vLLM shapes)
        r = requests.post(b + "/tokenize", json={"prompt": "hi<|im_end|>"}).json()
        check(r == {"tokens": tokenize("hi<|im_end|>"), "count": 4, "max_model_len": 256}, f"tokenize {r}")
        r = requests.post(b + "/tokenize", json={"prompt": "hi", "add_special_tokens": False}).json()
        check(r["tokens"] == [104, 105], f"tokenize no special {r}")
        msgs = [{"role": "user", "content": "yo"}]
        r = requests.post(b + "/tokenize", json={"messages": msgs}).json()
        check(r["tokens"] == tokenize(chatml(msgs), add_special=False), f"tokenize messages {r}")
        r = requests.post(b + "/detokenize", json={"tokens": [104, 105, 258]}).json()
        check(r == {"prompt": "hi<|im_end|>"}, f"detokenize {r}")

        # documents: create (text and tokens), list, get, use, delete
        r = requests.post(b + "/v1/documents", json={"text": "ALPHA", "id": "doc-a"})
        check(r.status_code == 200 and r.json()["id"] == "doc-a" and r.json()["tokens"] == 5
              and r.json()["object"] == "document", f"doc create {r.text}")
        r = requests.post(b + "/v1/documents", json={"tokens": [66, 69, 84, 65]}).json()
        gen_id = r["id"]
        check(re.fullmatch(r"doc-[0-9a-f]{24}", gen_id) and r["tokens"] == 4, f"generated id {r}")
        r = requests.post(b + "/v1/documents", json={"text": "dup", "id": "doc-a"})
        check(r.status_code == 409 and r.json()["error"]["code"] == "document_exists", f"dup {r.text}")
        lst = requests.get(b + "/v1/documents").json()
        check([d["id"] for d in lst["data"]] == ["doc-a", gen_id] and lst["has_more"] is False, f"list {lst}")
        lst = requests.get(b + "/v1/documents?limit=1").json()
        check([d["id"] for d in lst["data"]] == ["doc-a"] and lst["has_more"] is True, f"list limit {lst}")
        lst = requests.get(b + "/v1/documents?limit=5&after=doc-a").json()
        check([d["id"] for d in lst["data"]] == [gen_id], f"list after {lst}")
        lst = requests.get(b + "/v1/documents?order=desc").json()
        check([d["id"] for d in lst["data"]] == [gen_id, "doc-a"], f"list desc {lst}")
        d = requests.get(b + f"/v1/documents/{gen_id}").json()
        check(d["text"] == "BETA", f"get {d}")
        # completions: BOS, then documents in order, then the prompt
        r = requests.post(b + "/v1/completions", json={"prompt": "xy", "max_tokens": 12,
                                                        "documents": [gen_id, "doc-a"]}).json()
        ids = [259] + list(b"BETA") + list(b"ALPHA") + list(b"xy")
        check(r["usage"]["prompt_tokens"] == len(ids) and r["choices"][0]["text"] == complete(ids, 12)[0],
              f"completion with documents {r}")
        # chat: document text in the system turn
        r = requests.post(b + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 40,
                                                             "documents": ["doc-a"]}).json()
        ids = tokenize(chatml(msgs, documents=["ALPHA"]), add_special=False)
        want_text, want_reason, chat_n = complete(ids, 40)
        check(r["usage"]["prompt_tokens"] == len(ids) and r["choices"][0]["message"]["content"] == want_text
              and r["choices"][0]["finish_reason"] == want_reason == "stop", f"chat with documents {r}")

        # SSE framing + keep-alive comments during the (fake) 900 ms prefill (0.2 s keep-alive on the
        # server's 0.25 s tick: 2 or 3 comments; 700 ms left room for only 2, 1 when a tick came late)
        with requests.post(b + "/v1/completions", json={"prompt": "abc", "max_tokens": 3, "stream": True},
                           stream=True) as resp:
            check(resp.headers["Content-Type"].startswith("text/event-stream"), "SSE content type")
            data, comments = sse_events(resp)
        check(data[-1] == "[DONE]", f"last event {data[-1]}")
        chunks = [json.loads(x) for x in data[:-1]]
        check("".join(c["choices"][0]["text"] for c in chunks) == "cba", f"stream text {chunks}")
        check(chunks[-1]["choices"][0]["finish_reason"] == "length", "final chunk finish_reason")
        check(all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1]), "finish only at the end")
        check(len(comments) >= 2 and all(c == ": keep-alive" for c in comments), f"keep-alives {comments}")

        # metrics: vLLM names with model_name, histograms, kvserve counters
        text = requests.get(b + "/metrics").text
        for name in ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                     "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                     "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                     "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_count",
                     "vllm:e2e_request_latency_seconds_sum", "vllm:request_queue_time_seconds_count",
                     "kvserve:kv_blocks_total", "kvserve:kv_blocks_used", "kvserve:kv_blocks_free",
                     "kvserve:documents", "kvserve:requests_rejected_total"]:
            check(re.search(r"^" + re.escape(name) + r"\{.*model_name=\"tiny\".*\} ", text, re.M), f"metric {name}")
        mm = srv.metrics()
        check(mm['vllm:request_success_total{finished_reason="length",model_name="tiny"}'] == 2, "length count")
        check(mm['vllm:request_success_total{finished_reason="stop",model_name="tiny"}'] == 1, "stop count")
        check(mm['vllm:e2e_request_latency_seconds_count{model_name="tiny"}'] == 3, "e2e count")
        n_ttft = 2 + (chat_n > 0)
        check(mm['vllm:time_to_first_token_seconds_bucket{le="0.5",model_name="tiny"}'] == 0
              and mm['vllm:time_to_first_token_seconds_bucket{le="2.5",model_name="tiny"}'] == n_ttft
              and mm['vllm:time_to_first_token_seconds_count{model_name="tiny"}'] == n_ttft, "ttft buckets (prefill 0.9s)")
        check(mm['kvserve:documents{model_name="tiny"}'] == 2, "documents gauge")
        check(mm['vllm:generation_tokens_total{model_name="tiny"}'] == 12 + chat_n + 3, "generation tokens")

        r = requests.delete(b + "/v1/documents/doc-a").json()
        check(r == {"id": "doc-a", "object": "document", "deleted": True}, f"delete {r}")
        check(requests.get(b + "/v1/documents/doc-a").status_code == 404, "deleted doc is gone")

    # persistence: the remaining document is back after a restart
    with Server("--documents-dir", docdir) as srv:
        lst = requests.get(srv.base + "/v1/documents").json()
        check([d["id"] for d in lst["data"]] == [gen_id], f"persisted docs {lst}")
        check(requests.get(srv.base + f"/v1/documents/{gen_id}").json()["text"] == "BETA", "persisted text")

    # engine failures: 500 before the response started; in-band error + [DONE] after a stream started
    with Server("--max-connections", "4") as srv:
        r = requests.post(srv.base + "/v1/completions", json={"prompt": "x!fail!", "max_tokens": 10})
        check(r.status_code == 500 and r.json()["error"]["type"] == "server_error"
              and "sampling failed" in r.json()["error"]["message"], f"engine error: {r.status_code} {r.text}")
        with requests.post(srv.base + "/v1/chat/completions", stream=True, json={
                "messages": [{"role": "user", "content": "abc!fail!"}], "max_tokens": 10, "stream": True}) as resp:
            data, _ = sse_events(resp)
        check(resp.status_code == 200 and data[-1] == "[DONE]", f"stream end {data}")
        err = json.loads(data[-2])
        check(set(err) == {"error"} and "sampling failed" in err["error"]["message"], f"in-band error {data[-2]}")
        check(len(data) == 4 and json.loads(data[0])["choices"][0]["delta"]["role"] == "assistant",
              f"2 tokens (the role with the first), error, [DONE]: {data}")
        # connection limit: 4 idle sockets hold every ordinary slot; /health is served from the
        # reserve (server.reserved_connections), anything else gets 503 too_many_connections
        import socket
        socks = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(4)]
        time.sleep(0.3)
        check(requests.get(srv.base + "/health", timeout=2).status_code == 200, "/health from the reserve")
        r = requests.get(srv.base + "/v1/models", timeout=2)
        check(r.status_code == 503 and r.json()["error"]["code"] == "too_many_connections", f"over the limit: {r.text}")
        for s in socks:
            s.close()
        time.sleep(0.3)
        check(requests.get(srv.base + "/v1/models", timeout=2).status_code == 200, "served again below the limit")
    # without a reserve a connection over the limit is not served at all
    with Server("--max-connections", "4", "--set", "server.reserved_connections=0") as srv:
        import socket
        socks = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(4)]
        time.sleep(0.3)
        try:
            requests.get(srv.base + "/health", timeout=2)
            refused = False
        except requests.RequestException:
            refused = True
        check(refused, "connection over max_connections was served")
        for s in socks:
            s.close()
        time.sleep(0.3)
        check(requests.get(srv.base + "/health", timeout=2).status_code == 200, "served again below the limit")

    # per-request timeout: slow engine, 1 s limit
    with Server("--timeout", "1", env={"KVS_FAKE_STEP_MS": "100"}) as srv:
        t0 = time.time()
        r = requests.post(srv.base + "/v1/completions", json={"prompt": "abc", "max_tokens": 100}).json()
        dt = time.time() - t0
        check(r["choices"][0]["finish_reason"] == "timeout" and dt < 5, f"timeout {r} after {dt:.1f}s")


def main():
    test_loading()
    test_main()
    print("endpoints: health/loading, models, tokenize, detokenize, documents (+persistence), SSE keep-alive, "
          "metrics, timeout: ok")


if __name__ == "__main__":
    main()
