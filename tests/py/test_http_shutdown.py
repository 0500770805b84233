"""Graceful shutdown under load: SIGTERM while streams run -> /health 503, new work 503 with
Retry-After, running streams finish correctly, exit code 0 within the grace period. And with a
short grace period: the daemon cancels what is left and still exits 0 on time."""
import signal
import threading
import time

import requests

from kvs_http import Server, check, complete, tokenize
from test_http_concurrency import stream_request


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
    print("SIGTERM under load: draining answers 503, running streams complete, exit 0 within the grace period")


if __name__ == "__main__":
    main()
