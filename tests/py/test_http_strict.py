"""Strict JSON input (issue 23 item 4): bodies that RFC 8259 forbids get 400 naming the problem
(raw NUL byte, raw control characters, invalid UTF-8: overlong, surrogate, stray continuation
bytes), valid multi-byte UTF-8 passes; duplicate keys: the last wins (JavaScript, Python); a body
over server.max_body_bytes gets its 413 JSON also from a client that sends it without waiting
for 100 Continue, and at once from one that waits."""
import json
import socket

import requests

from kvs_http import Server, check, complete, tokenize


def raw_post(port, body, expect=False):
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n" + ("Expect: 100-continue\r\n" if expect else "") + "\r\n").encode()
    s.sendall(head)
    if not expect:
        s.sendall(body)
    data = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
            if b"\r\n\r\n" in data:
                hdr, _, rest = data.partition(b"\r\n\r\n")
                cl = [int(l.split(b":")[1]) for l in hdr.split(b"\r\n") if l.lower().startswith(b"content-length:")]
                if cl and len(rest) >= cl[0]:
                    break
    finally:
        s.close()
    return data


def main():
    with Server("--quiet", "--max-body", "65536") as srv:
        C = srv.base + "/v1/completions"
        bad = [
            ("raw NUL", b'{"prompt": "ab\x00cd", "max_tokens": 2}', "NUL byte"),
            ("raw control byte", b'{"prompt": "ab\x01cd", "max_tokens": 2}', "control character 0x01"),
            ("raw newline in a string", b'{"prompt": "ab\ncd", "max_tokens": 2}', "control character 0x0a"),
            ("invalid byte", b'{"prompt": "ab\xffcd", "max_tokens": 2}', "not valid UTF-8"),
            ("overlong", b'{"prompt": "ab\xc0\xafcd", "max_tokens": 2}', "not valid UTF-8"),
            ("surrogate", b'{"prompt": "ab\xed\xa0\x80cd", "max_tokens": 2}', "not valid UTF-8"),
            ("stray continuation", b'{"prompt": "\x80", "max_tokens": 2}', "not valid UTF-8"),
            ("truncated sequence", b'{"prompt": "ab\xe6\x97", "max_tokens": 2}', "not valid UTF-8"),
            ("NUL after the object", b'{"prompt": "ab", "max_tokens": 2}\x00', "NUL byte"),
        ]
        for name, body, want in bad:
            r = requests.post(C, data=body, headers={"Content-Type": "application/json"}, timeout=5)
            check(r.status_code == 400 and want in r.json()["error"]["message"], f"{name}: {r.status_code} {r.text}")
        # whitespace between tokens is fine, and so is every valid multi-byte sequence
        text = "h\u00e9llo \u65e5\u672c \U0001F600"
        r = requests.post(C, data=('{\n\t"prompt": "%s",\r\n "max_tokens": 3}' % text).encode(),
                          headers={"Content-Type": "application/json"}, timeout=5)
        check(r.status_code == 200 and r.json()["choices"][0]["text"] == complete(tokenize(text), 3)[0],
              f"valid UTF-8: {r.status_code} {r.text}")
        # duplicate keys: the last wins
        r = requests.post(C, data=b'{"prompt": "zz", "prompt": "abcd", "max_tokens": 1, "max_tokens": 3}',
                          headers={"Content-Type": "application/json"}, timeout=5).json()
        check(r["usage"]["completion_tokens"] == 3 and r["choices"][0]["text"] == complete(tokenize("abcd"), 3)[0],
              f"duplicate keys: {r}")
        r = requests.post(C, data=b'{"prompt": "abcd", "stream_options": {"include_usage": 5, "include_usage": true}, '
                                  b'"stream": true, "max_tokens": 1}', headers={"Content-Type": "application/json"},
                          timeout=5)
        check(r.status_code == 200, f"nested duplicate keys, last wins: {r.status_code} {r.text}")
        # over max_body_bytes: 2 MiB sent at once (no Expect) -> 413 JSON read back; with Expect at once
        big = json.dumps({"prompt": "x" * (2 << 20)}).encode()
        for expect in (False, True):
            resp = raw_post(srv.port, big, expect)
            head, _, body = resp.partition(b"\r\n\r\n")
            check(head.startswith(b"HTTP/1.1 413") and b"larger than the limit" in body,
                  f"413 (expect {expect}): {resp[:300]!r}")
        check(requests.get(srv.base + "/health", timeout=5).status_code == 200, "healthy after")
    print(f"strict input: {len(bad)} malformed bodies -> 400 naming the problem, valid UTF-8 ok, duplicate keys last "
          "wins, 413 with and without Expect: ok")


if __name__ == "__main__":
    main()
