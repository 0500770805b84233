"""64 concurrent streaming clients; a third disconnect at random points (some before their first
token, during the fake prefill). The others must get exactly the right text; afterwards nothing is
running or waiting and every KV block is back in the pool (read from /metrics)."""
import json
import random
import socket
import threading
import time

from kvs_http import Server, check, complete, tokenize

N = 64


def stream_request(port, body, disconnect_after=None, ids=False):
    """Raw HTTP/1.1 streaming POST. Returns (text, finish, done) or None when it hung up early;
    ids=True adds the token ids of the chunks' logprobs (a request with logprobs and
    return_tokens_as_token_ids) as a fourth element."""
    payload = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    if disconnect_after == 0:
        s.close()
        return None
    buf = b""
    events = []
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        buf += chunk
        # chunked transfer encoding framing is irrelevant to counting events: SSE payload lines
        events = [ln for ln in buf.split(b"\n") if ln.startswith(b"data: ")]
        if disconnect_after is not None and len(events) >= disconnect_after:
            s.close()
            return None
        if b"data: [DONE]" in buf:
            break
    s.close()
    head, _, body_bytes = buf.partition(b"\r\n\r\n")
    check(head.startswith(b"HTTP/1.1 200"), f"status line {head[:40]!r}")
    text, finish, tokens = "", None, []
    for ln in events:
        p = ln[6:].strip()
        if p == b"[DONE]":
            continue
        c = json.loads(p)
        text += c["choices"][0]["text"]
        finish = c["choices"][0]["finish_reason"] or finish
        tokens += [int(t.split(":")[1]) for t in (c["choices"][0].get("logprobs") or {}).get("tokens", [])]
    if ids:
        return text, finish, b"data: [DONE]" in buf, tokens
    return text, finish, b"data: [DONE]" in buf


def main():
    rng = random.Random(1234)
    with Server("--max-running", "64", "--quiet", env={"KVS_FAKE_STEP_MS": "20", "KVS_FAKE_PREFILL_MS": "100",
                                                          "KVS_FAKE_BLOCKS": "600"}) as srv:
        results = [None] * N
        errors = []
        plans = []
        for i in range(N):
            prompt = f"client {i:02d} says {rng.randrange(10**6):06d}"
            if i % 3 == 0:
                plans.append((prompt, 220, rng.choice([0, 0, 1, 2, 5, 10, 20])))
            else:
                plans.append((prompt, 30, None))

        def worker(i):
            prompt, mt, dis = plans[i]
            try:
                results[i] = stream_request(srv.port, {"prompt": prompt, "max_tokens": mt, "stream": True}, dis)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(f"client {i}: {e!r}")

        t0 = time.time()
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(N)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        check(not errors, "\n".join(errors))
        ok = 0
        for i, (prompt, mt, dis) in enumerate(plans):
            if dis is not None:
                continue
            text, finish, done = results[i]
            want, reason, _ = complete(tokenize(prompt), mt)
            check(done and text == want and finish == reason, f"client {i}: {text!r}/{finish} != {want!r}/{reason}")
            ok += 1
        # the engine learns about the disconnects and frees the blocks: well before the 220 tokens
        # x 20 ms = 4.4 s the disconnected requests would take to finish on their own
        end = t0 + 3.5
        key = lambda n: f'{n}{{model_name="fake"}}'
        while True:
            m = srv.metrics()
            idle = (m[key("vllm:num_requests_running")] == 0 and m[key("vllm:num_requests_waiting")] == 0
                    and m[key("kvserve:kv_blocks_used")] == 0)
            if idle or time.time() > end:
                break
            time.sleep(0.1)
        check(idle, f"not idle {time.time() - t0:.1f}s after the start: disconnects did not cancel: "
              f"{ {k: v for k, v in m.items() if 'seconds' not in k} }")
        check(m[key("kvserve:kv_blocks_free")] == m[key("kvserve:kv_blocks_total")] == 600, "KV pool full again")
        aborted = m['vllm:request_success_total{finished_reason="abort",model_name="fake"}']
        n_dis = sum(1 for p in plans if p[2] is not None)
        check(aborted == n_dis, f"{aborted} aborted requests != {n_dis} disconnected clients")
        check(m['vllm:request_success_total{finished_reason="length",model_name="fake"}'] == ok, "completed count")
    print(f"{N} streaming clients: {ok} completed exactly, {n_dis} disconnected and cancelled; KV pool full again")


if __name__ == "__main__":
    main()
