"""Bad input: every case gets the right status and an OpenAI-shaped error body (param naming the
field where there is one), and the daemon stays healthy and correct afterwards."""
import json
import socket

import requests

from kvs_http import Server, check, complete, tokenize

KEY = "secret-key"
H = {"Authorization": f"Bearer {KEY}"}
C = "/v1/completions"
CH = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]

# (name, method, path, body (dict -> JSON, str/bytes raw, None), status, param or None, code or None, headers)
CASES = [
    ("malformed json", "POST", C, '{"prompt": "x",', 400, None, None),
    ("not an object", "POST", C, '[1,2,3]', 400, None, None),
    ("string body", "POST", C, '"hello"', 400, None, None),
    ("empty body", "POST", C, "", 400, None, None),
    ("invalid utf8 json", "POST", C, b'{"prompt": "\xff\xfe', 400, None, None),
    ("missing prompt", "POST", C, {"max_tokens": 3}, 400, "prompt", None),
    ("prompt number", "POST", C, {"prompt": 5}, 400, "prompt", None),
    ("prompt empty array", "POST", C, {"prompt": []}, 400, "prompt", None),
    ("prompt nested bad", "POST", C, {"prompt": [{"a": 1}]}, 400, "prompt", None),
    ("prompt token out of range", "POST", C, {"prompt": [1, 2, 99999]}, 400, "prompt", None),
    ("prompt negative token", "POST", C, {"prompt": [-1]}, 400, "prompt", None),
    ("prompt float token", "POST", C, {"prompt": [1.5, 2]}, 400, "prompt", None),
    ("prompt mixed ids", "POST", C, {"prompt": [1, "a"]}, 400, "prompt", None),
    ("prompt empty id list", "POST", C, {"prompt": [[]]}, 400, "prompt", None),
    ("too many prompts", "POST", C, {"prompt": ["a"] * 65}, 400, "prompt", None),
    ("empty prompt string", "POST", C, {"prompt": "", "max_tokens": 1, "add_special_tokens": False}, 400, "prompt", None),
    ("max_tokens zero", "POST", C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
    ("max_tokens negative", "POST", C, {"prompt": "x", "max_tokens": -5}, 400, "max_tokens", None),
    ("max_tokens string", "POST", C, {"prompt": "x", "max_tokens": "10"}, 400, "max_tokens", None),
    ("max_tokens float", "POST", C, {"prompt": "x", "max_tokens": 2.5}, 400, "max_tokens", None),
    ("max_tokens huge", "POST", C, {"prompt": "x", "max_tokens": 1e12}, 400, "max_tokens", None),
    ("context exceeded", "POST", C, {"prompt": "x", "max_tokens": 1000}, 400, "prompt", "context_length_exceeded"),
    ("prompt alone too long", "POST", C, {"prompt": "y" * 300}, 400, "prompt", "context_length_exceeded"),
    ("temperature high", "POST", C, {"prompt": "x", "temperature": 3}, 400, "temperature", None),
    ("temperature negative", "POST", C, {"prompt": "x", "temperature": -0.1}, 400, "temperature", None),
    ("temperature string", "POST", C, {"prompt": "x", "temperature": "hot"}, 400, "temperature", None),
    ("top_p zero", "POST", C, {"prompt": "x", "top_p": 0}, 400, "top_p", None),
    ("top_p above one", "POST", C, {"prompt": "x", "top_p": 1.5}, 400, "top_p", None),
    ("top_k below -1", "POST", C, {"prompt": "x", "top_k": -2}, 400, "top_k", None),
    ("min_p above one", "POST", C, {"prompt": "x", "min_p": 2}, 400, "min_p", None),
    ("presence penalty", "POST", C, {"prompt": "x", "presence_penalty": 5}, 400, "presence_penalty", None),
    ("frequency penalty", "POST", C, {"prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty", None),
    ("repetition penalty zero", "POST", C, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty", None),
    ("n zero", "POST", C, {"prompt": "x", "n": 0}, 400, "n", None),
    ("n too big", "POST", C, {"prompt": "x", "n": 100}, 400, "n", None),
    ("prompts x n too big", "POST", C, {"prompt": ["a"] * 10, "n": 10}, 400, "n", None),
    ("stream not bool", "POST", C, {"prompt": "x", "stream": "yes"}, 400, "stream", None),
    ("stream_options without stream", "POST", C, {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options", None),
    ("stream_options not object", "POST", C, {"prompt": "x", "stream": True, "stream_options": 1}, 400, "stream_options", None),
    ("include_usage not bool", "POST", C, {"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}}, 400, "stream_options.include_usage", None),
    ("stop number", "POST", C, {"prompt": "x", "stop": 5}, 400, "stop", None),
    ("stop too many", "POST", C, {"prompt": "x", "stop": [str(i) for i in range(17)]}, 400, "stop", None),
    ("stop empty string", "POST", C, {"prompt": "x", "stop": [""]}, 400, "stop", None),
    ("stop too long", "POST", C, {"prompt": "x", "stop": ["z" * 300]}, 400, "stop", None),
    ("stop array of numbers", "POST", C, {"prompt": "x", "stop": [1, 2]}, 400, "stop", None),
    ("seed string", "POST", C, {"prompt": "x", "seed": "abc"}, 400, "seed", None),
    ("logit_bias array", "POST", C, {"prompt": "x", "logit_bias": [1, 2]}, 400, "logit_bias", None),
    ("logit_bias bad key", "POST", C, {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias", None),
    ("logit_bias id out of range", "POST", C, {"prompt": "x", "logit_bias": {"100000": 1}}, 400, "logit_bias", None),
    ("logit_bias value range", "POST", C, {"prompt": "x", "logit_bias": {"5": 500}}, 400, "logit_bias", None),
    ("logprobs too many", "POST", C, {"prompt": "x", "logprobs": 50}, 400, "logprobs", None),
    ("logprobs bool on completions", "POST", C, {"prompt": "x", "logprobs": True}, 400, "logprobs", None),
    ("echo with documents", "POST", C, {"prompt": "x", "echo": True, "documents": ["d"]}, 400, "echo", None),
    ("max_tokens 0 without echo", "POST", C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
    ("chat max_tokens 0", "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                           "max_tokens": 0}, 400, "max_tokens", None),
    ("best_of below n", "POST", C, {"prompt": "x", "best_of": 2, "n": 3}, 400, "best_of", None),
    ("best_of streamed", "POST", C, {"prompt": "x", "best_of": 3, "stream": True}, 400, "best_of", None),
    ("best_of too many", "POST", C, {"prompt": ["a", "b", "c", "d", "e"], "best_of": 16}, 400, "best_of", None),
    ("model wrong type", "POST", C, {"prompt": "x", "model": 7}, 400, "model", None),
    ("unknown model", "POST", C, {"prompt": "x", "model": "gpt-4"}, 404, "model", "model_not_found"),
    ("documents not array", "POST", C, {"prompt": "x", "documents": "doc1"}, 400, "documents", None),
    ("documents bad id", "POST", C, {"prompt": "x", "documents": ["../etc/passwd"]}, 400, "documents", None),
    ("unknown document", "POST", C, {"prompt": "x", "documents": ["nope"]}, 404, "documents", "document_not_found"),
    ("user not string", "POST", C, {"prompt": "x", "user": 1}, 400, "user", None),
    ("chat missing messages", "POST", CH, {"max_tokens": 1}, 400, "messages", None),
    ("chat messages object", "POST", CH, {"messages": {"role": "user"}}, 400, "messages", None),
    ("chat empty messages", "POST", CH, {"messages": []}, 400, "messages", None),
    ("chat bad role", "POST", CH, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages", None),
    ("chat tool without tool_call_id", "POST", CH, {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages", None),
    ("chat tool_call_id number", "POST", CH, {"messages": [{"role": "tool", "tool_call_id": 1, "content": "x"}]}, 400, "messages", None),
    ("chat tool_call_id on user", "POST", CH, {"messages": [{"role": "user", "tool_call_id": "c", "content": "x"}]}, 400, "messages", None),
    ("chat tool without content", "POST", CH, {"messages": [{"role": "tool", "tool_call_id": "c"}]}, 400, "messages", None),
    ("chat assistant tool_calls", "POST", CH, {"messages": [MSG[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, 400, "messages", "unsupported_parameter"),
    ("chat missing content", "POST", CH, {"messages": [{"role": "user"}]}, 400, "messages", None),
    ("chat content number", "POST", CH, {"messages": [{"role": "user", "content": 3}]}, 400, "messages", None),
    ("chat image part", "POST", CH, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages", None),
    ("chat message not object", "POST", CH, {"messages": ["hi"]}, 400, "messages", None),
    ("chat logprobs int", "POST", CH, {"messages": MSG, "logprobs": 3}, 400, "logprobs", None),
    ("chat top_logprobs without logprobs", "POST", CH, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs", None),
    ("chat top_logprobs too many", "POST", CH, {"messages": MSG, "logprobs": True, "top_logprobs": 99}, 400, "top_logprobs", None),
    ("chat context exceeded", "POST", CH, {"messages": MSG, "max_completion_tokens": 5000}, 400, "messages", "context_length_exceeded"),
    ("chat max_completion_tokens zero", "POST", CH, {"messages": MSG, "max_completion_tokens": 0}, 400, "max_completion_tokens", None),
    ("tokenize neither", "POST", "/tokenize", {}, 400, "prompt", None),
    ("tokenize both", "POST", "/tokenize", {"prompt": "a", "messages": MSG}, 400, "prompt", None),
    ("tokenize prompt number", "POST", "/tokenize", {"prompt": 1}, 400, "prompt", None),
    ("tokenize add_special not bool", "POST", "/tokenize", {"prompt": "a", "add_special_tokens": 1}, 400, "add_special_tokens", None),
    ("detokenize missing tokens", "POST", "/detokenize", {}, 400, "tokens", None),
    ("detokenize string tokens", "POST", "/detokenize", {"tokens": "abc"}, 400, "tokens", None),
    ("detokenize out of range", "POST", "/detokenize", {"tokens": [1, 70000]}, 400, "tokens", None),
    ("document neither", "POST", "/v1/documents", {"id": "a"}, 400, "text", None),
    ("document both", "POST", "/v1/documents", {"text": "a", "tokens": [1]}, 400, "text", None),
    ("document empty text", "POST", "/v1/documents", {"text": ""}, 400, "text", None),
    ("document empty tokens", "POST", "/v1/documents", {"tokens": []}, 400, "tokens", None),
    ("document bad id", "POST", "/v1/documents", {"text": "a", "id": "a/b"}, 400, "id", None),
    ("document too long", "POST", "/v1/documents", {"text": "q" * 500}, 400, "text", "document_too_long"),
    ("get unknown document", "GET", "/v1/documents/missing", None, 404, "id", "document_not_found"),
    ("delete unknown document", "DELETE", "/v1/documents/missing", None, 404, "id", "document_not_found"),
    ("documents limit zero", "GET", "/v1/documents?limit=0", None, 400, "limit", None),
    ("documents limit text", "GET", "/v1/documents?limit=ten", None, 400, "limit", None),
    ("documents bad order", "GET", "/v1/documents?order=sideways", None, 400, "order", None),
    ("documents unknown after", "GET", "/v1/documents?after=nothere", None, 400, "after", None),
    ("document id starting with dot", "POST", "/v1/documents", {"text": "a", "id": ".hidden"}, 400, "id", None),
    ("unknown model card", "GET", "/v1/models/gpt-4", None, 404, "model", "model_not_found"),
    ("POST on model card", "POST", "/v1/models/fake", {}, 405, None, None),
    ("unknown path", "GET", "/v2/whatever", None, 404, None, None),
    ("unknown v1 path", "POST", "/v1/embeddings", {"input": "x"}, 404, None, None),
    ("GET on completions", "GET", C, None, 405, None, None),
    ("PUT on chat", "PUT", CH, {"messages": MSG}, 405, None, None),
    ("POST on models", "POST", "/v1/models", {}, 405, None, None),
    ("POST on health", "POST", "/health", {}, 405, None, None),
    ("DELETE on documents list", "DELETE", "/v1/documents", None, 405, None, None),
    ("body too large", "POST", C, {"prompt": "x" * 70000}, 413, None, None),
]

AUTH_CASES = [
    ("no key", {}, 401),
    ("wrong key", {"Authorization": "Bearer nope"}, 401),
    ("key prefix", {"Authorization": f"Bearer {KEY[:-1]}"}, 401),
    ("key longer", {"Authorization": f"Bearer {KEY}x"}, 401),
    ("basic auth", {"Authorization": "Basic abc"}, 401),
]


def send(srv, method, path, body, headers):
    data = None
    h = dict(headers)
    if isinstance(body, dict) or isinstance(body, list):
        data = json.dumps(body)
        h["Content-Type"] = "application/json"
    elif body is not None:
        data = body
    return requests.request(method, srv.base + path, data=data, headers=h, timeout=10)


def check_error(r, status, param, code, name):
    check(r.status_code == status, f"{name}: status {r.status_code} != {status}: {r.text[:300]}")
    j = r.json()
    e = j.get("error")
    check(isinstance(e, dict) and set(e) == {"message", "type", "param", "code"}, f"{name}: error shape {j}")
    check(isinstance(e["message"], str) and e["message"], f"{name}: message")
    if param is not None:
        check(e["param"] == param, f"{name}: param {e['param']!r} != {param!r}")
    if code is not None:
        check(e["code"] == code, f"{name}: code {e['code']!r} != {code!r}")


def main():
    with Server("--api-key", KEY, "--max-body", "65536", "--documents-max-tokens", "128") as srv:
        for name, method, path, body, status, param, code in CASES:
            check_error(send(srv, method, path, body, H), status, param, code, name)
            if status == 405:
                r = send(srv, method, path, body, H)
                allow = {"/v1/documents": "GET, POST", "/v1/models": "GET", "/health": "GET, HEAD"}.get(path)
                allow = allow or ("GET" if path.startswith("/v1/models/") else "POST")
                check(r.headers.get("Allow") == allow, f"{name}: Allow {r.headers.get('Allow')!r} != {allow!r}")
        for name, headers, status in AUTH_CASES:
            check_error(send(srv, "POST", C, {"prompt": "x"}, headers), status, None, "invalid_api_key", name)
            check_error(send(srv, "GET", "/v1/models", None, headers), status, None, "invalid_api_key", name)
        # raw protocol abuse: garbage request line, truncated body, then the daemon still answers
        for raw in (b"GARBAGE\r\n\r\n", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro",
                    b"\x00\x01\x02\x03\r\n\r\n"):
            s = socket.create_connection(("127.0.0.1", srv.port))
            s.sendall(raw)
            s.settimeout(2)
            try:
                s.recv(4096)
            except OSError:
                pass
            s.close()
        # still healthy and still right
        check(requests.get(srv.base + "/health", timeout=5).status_code == 200, "healthy after bad input")
        r = send(srv, "POST", C, {"prompt": "sanity", "max_tokens": 4}, H)
        check(r.status_code == 200 and r.json()["choices"][0]["text"] == complete(tokenize("sanity"), 4)[0],
              f"completion after bad input: {r.text}")
        m = srv.metrics()
        check(m['kvserve:kv_blocks_used{model_name="fake"}'] == 0, "no KV blocks leaked")
        total = len(CASES) + 2 * len(AUTH_CASES)
    print(f"{total} bad-input cases answered with the right status and error shape; daemon healthy after")


if __name__ == "__main__":
    main()
