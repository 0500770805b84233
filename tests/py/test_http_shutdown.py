"""Graceful shutdown under load: SIGTERM while streams run -> /health 503, new work 503 with
Retry-After, running streams finish correctly, exit code 0 within the grace period. And with a
short grace period: the daemon cancels what is left and still exits 0 on time."""
import json
import signal
import socket
import threading
import time

import requests

from kvs_http import Server, check, complete, tokenize
from test_http_concurrency import stream_request


def raw_stream(port, body):
    """The data: payloads of a streaming completion, read until the server closes."""
    payload = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
              b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    buf = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        buf += chunk
    s.close()
    return [ln[6:].strip().decode() for ln in buf.split(b"\n") if ln.startswith(b"data: ")]


def run_streams(srv, n, max_tokens):
    results, errors = [None] * n, []

    def worker(i):
        try:
            results[i] = stream_request(srv.port, {"prompt": f"drain {i}", "max_tokens": max_tokens, "stream": True})
        except Exception as e:  # noqa: BLE001
            errors.append(f"stream {i}: {e!r}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads, results, errors


def main():
    # 1) graceful: 16 streams of 60 tokens x 20 ms ~ 1.2 s, grace 8 s: all complete
    srv = Server("--grace", "8", "--quiet", env={"KVS_FAKE_STEP_MS": "20"})
    threads, results, errors = run_streams(srv, 16, 60)
    time.sleep(0.4)
    t0 = time.time()
    srv.proc.send_signal(signal.SIGTERM)
    time.sleep(0.1)
    r = requests.get(srv.base + "/health", timeout=2)
    check(r.status_code == 503 and "error" in r.json(), f"health while draining: {r.status_code} {r.text}")
    r = requests.post(srv.base + "/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=2)
    check(r.status_code == 503 and r.headers.get("Retry-After"), f"new request while draining: {r.status_code}")
    for t in threads:
        t.join(30)
    check(not errors, "\n".join(errors))
    for i, res in enumerate(results):
        text, finish, done = res
        want = complete(tokenize(f"drain {i}"), 60)[0]
        check(done and finish == "length" and text == want, f"stream {i} cut short during drain: {res}")
    srv.proc.wait(10)
    dt = time.time() - t0
    check(srv.proc.returncode == 0 and dt < 8, f"exit {srv.proc.returncode} after {dt:.1f}s")
    srv.stop()

    # 2) grace 1 s, streams that would need 10 s: cancelled, exit 0 on time
    srv = Server("--grace", "1", "--quiet", env={"KVS_FAKE_STEP_MS": "50"})
    threads, results, errors = run_streams(srv, 8, 200)
    time.sleep(0.5)
    t0 = time.time()
    srv.proc.send_signal(signal.SIGTERM)
    srv.proc.wait(10)
    dt = time.time() - t0
    check(srv.proc.returncode == 0 and dt < 3, f"exit {srv.proc.returncode} after {dt:.1f}s with grace 1s")
    for t in threads:
        t.join(10)
    srv.stop()

    # 3) streams cut at the end of the grace get an ending (error chunk in OpenAI's shape, then
    # data: [DONE]); a waiting non-streaming request a 503; the access log says what was done and
    # that the server ended them; a client that hangs up is logged as ended by the client
    srv = Server("--grace", "1", env={"KVS_FAKE_STEP_MS": "50", "KVS_FAKE_PREFILL_MS": "20"})
    cut, nonstream = [None] * 4, []

    def cut_worker(i):
        cut[i] = raw_stream(srv.port, {"prompt": f"cut {i}", "max_tokens": 200, "stream": True, "ignore_eos": True})

    def nonstream_worker():
        nonstream.append(requests.post(srv.base + "/v1/completions", timeout=30,
                                       json={"prompt": "wait", "max_tokens": 200, "ignore_eos": True}))

    threads = [threading.Thread(target=cut_worker, args=(i,)) for i in range(4)]
    threads.append(threading.Thread(target=nonstream_worker))
    for t in threads:
        t.start()
    stream_request(srv.port, {"prompt": "leaver", "max_tokens": 200, "stream": True}, disconnect_after=3)
    time.sleep(0.5)
    srv.proc.send_signal(signal.SIGTERM)
    srv.proc.wait(10)
    for t in threads:
        t.join(10)
    for i, events in enumerate(cut):
        check(events and events[-1] == "[DONE]", f"cut stream {i} has no [DONE]: {events and events[-3:]}")
        err = json.loads(events[-2])
        check(set(err) == {"error"} and "grace" in err["error"]["message"] and err["error"]["type"],
              f"cut stream {i}: error chunk {events[-2]}")
        check(len(events) > 4, f"cut stream {i} had tokens before the cut: {len(events)} events")
    check(nonstream and nonstream[0].status_code == 503 and "grace" in nonstream[0].json()["error"]["message"],
          f"non-streaming request at the cut: {nonstream and (nonstream[0].status_code, nonstream[0].text)}")
    log = srv.logtext()
    lines = [ln for ln in log.splitlines() if "access POST /v1/completions" in ln]
    cut_lines = [ln for ln in lines if "ended_by=server reason=shutdown_grace" in ln]
    check(len(cut_lines) == 5, f"5 requests cut by the server in the log:\n" + "\n".join(lines))
    for ln in cut_lines:
        f = dict(kv.split("=", 1) for kv in ln.split() if "=" in kv)
        check(int(f["prompt_tokens"]) > 0 and int(f["completion_tokens"]) > 0 and float(f["ttft"].rstrip("s")) > 0,
              f"cut request logged with what was done: {ln}")
    leaver = [ln for ln in lines if "ended_by=client" in ln]
    check(len(leaver) == 1 and "client_gone" not in log, f"client hang-up logged once as ended_by=client:\n{log[-3000:]}")
    srv.stop()
    print("SIGTERM under load: draining answers 503, running streams complete, exit 0 within the grace period")


if __name__ == "__main__":
    main()
