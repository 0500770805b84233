"""Chat roles over HTTP (issue 23 items 8 and 9): role "tool" (with its tool_call_id) is accepted
and a developer message is rendered the way each chat format's own template renders it.

For every conversation of tests/data/chat_references.json that holds a tool or developer message
(and no documents), the daemon's /tokenize of the messages must equal the fake tokenizer's ids of
the text transformers' apply_chat_template made for that format (chatml, qwen3, llama3: the
fake daemon started with model.chat_format set to each). So this checks the whole request path,
role validation included, byte for byte against the real templates. Then a chat completion with
a tool result answers from exactly that prompt (the fake model's reply is predictable from the
prompt ids), and the request's tools stay refused."""
import json
import os

import requests

from kvs_http import ROOT, Server, check, complete, tokenize

REFS = os.path.join(ROOT, "tests", "data", "chat_references.json")


def main():
    with open(REFS, encoding="utf-8") as f:
        cases = [c for c in json.load(f)["cases"] if not c["documents"] and
                 any(m["role"] in ("tool", "developer") for m in c["messages"])]
    roles = {m["role"] for c in cases for m in c["messages"]}
    check(len(cases) >= 6 and {"tool", "developer"} <= roles, f"references with tool/developer turns: {len(cases)}")
    n_checked = 0
    for fmt in ("chatml", "qwen3", "llama3"):
        with Server("--quiet", "--set", "model.chat_format=" + fmt) as srv:
            for c in cases:
                r = requests.post(srv.base + "/tokenize", json={"messages": c["messages"]}, timeout=5)
                check(r.status_code == 200, f"{fmt}/{c['name']}: {r.status_code} {r.text}")
                want = tokenize(c["expected"][fmt], add_special=False)
                check(r.json()["tokens"] == want, f"{fmt}/{c['name']}: rendered prompt differs from transformers")
                n_checked += 1
            if fmt != "chatml":
                continue
            # a chat completion after a tool result: 200, and the reply is the fake model's answer
            # to exactly the reference prompt
            c = next(c for c in cases if c["name"] == "tool_result")
            ids = tokenize(c["expected"]["chatml"], add_special=False)
            r = requests.post(srv.base + "/v1/chat/completions", timeout=30,
                              json={"messages": c["messages"], "max_tokens": 12, "ignore_eos": True})
            check(r.status_code == 200, f"chat with a tool message: {r.status_code} {r.text}")
            body = r.json()
            check(body["usage"]["prompt_tokens"] == len(ids), f"prompt tokens: {body['usage']}")
            check(body["choices"][0]["message"]["content"] == complete(ids, 12, ignore_eos=True)[0],
                  f"reply to the tool conversation: {body['choices'][0]}")
            # the empty forms of the tool fields pass; tools themselves stay refused
            msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "tool_calls": []},
                    {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "r"}]}]
            r = requests.post(srv.base + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 2}, timeout=30)
            check(r.status_code == 200, f"empty tool_calls, tool content parts: {r.status_code} {r.text}")
            tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
            r = requests.post(srv.base + "/v1/chat/completions", timeout=5,
                              json={"messages": msgs, "tools": [tool], "max_tokens": 2})
            e = r.json().get("error", {})
            check(r.status_code == 400 and e.get("code") == "unsupported_parameter" and e.get("param") == "tools",
                  f"tools still refused: {r.status_code} {r.text}")
    print(f"chat roles: {len(cases)} tool/developer conversations x 3 formats = {n_checked} prompts equal to "
          "transformers over /tokenize; chat completion after a tool result; tools still refused: ok")


if __name__ == "__main__":
    main()
