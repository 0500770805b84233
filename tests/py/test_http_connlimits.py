"""Stalled connections cannot lock clients out (issue 23, item 1).

600 sockets that send a request header and one body byte, then nothing:
  1) all from one client address: the per-client cap (server.max_connections_per_client) closes
     all but 64 at accept; /health from another address answers within 1 s, a completion
     succeeds, and after server.idle_timeout_s the stalled ones are closed by the daemon and
     their address is served again;
  2) spread over 10 addresses (60 each, under the per-client cap), 600 > max_connections: the
     probes (/health, /metrics) are served from server.reserved_connections; other requests
     beyond max_connections get 503 too_many_connections;
  3) a non-streaming request that waits on the engine longer than the idle timeout is not cut
     (suspended connections are not timed out)."""
import resource
import socket
import time

import requests

from kvs_http import Server, check

STALL = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
         b"Content-Length: 100\r\n\r\n{")


def stall(src, port):
    s = socket.socket()
    s.bind((src, 0))
    s.settimeout(5)
    s.connect(("127.0.0.1", port))
    try:
        s.sendall(STALL)
    except OSError:
        pass   # closed at accept (over the per-client cap)
    return s


def closed_by_server(s):
    s.settimeout(0.05)
    try:
        return s.recv(4096) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def timed_health(base):
    t0 = time.time()
    r = requests.get(base + "/health", timeout=5)
    return r.status_code, time.time() - t0


def main():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2048:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))

    # 1) one address, 600 stalled sockets (cap 64; the default, 256, leaves room for a client
    #    that opens many streams, as test_http_e2e's 64 concurrent ones with hang-ups do)
    with Server("--quiet", "--set", "server.idle_timeout_s=3", "--set", "server.max_connections_per_client=64") as srv:
        socks = [stall("127.0.0.2", srv.port) for _ in range(600)]
        time.sleep(0.3)
        st, dt = timed_health(srv.base)
        check(st == 200 and dt < 1.0, f"/health under 600 stalled sockets: {st} after {dt:.2f}s")
        r = requests.post(srv.base + "/v1/completions", json={"prompt": "abc", "max_tokens": 3}, timeout=5)
        check(r.status_code == 200 and r.json()["choices"][0]["text"] == "cba", f"completion: {r.status_code} {r.text}")
        n_closed = sum(closed_by_server(s) for s in socks)
        check(n_closed >= 600 - 64 and n_closed < 600, f"per-client cap: {n_closed} of 600 closed at accept (want 536)")
        time.sleep(4.5)   # idle timeout 3 s
        n_closed = sum(closed_by_server(s) for s in socks)
        check(n_closed == 600, f"idle timeout: only {n_closed} of 600 stalled sockets closed after 4.5 s")
        for s in socks:
            s.close()
        s = socket.socket()
        s.bind(("127.0.0.2", 0))
        s.connect(("127.0.0.1", srv.port))
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        s.settimeout(5)
        got = s.recv(4096)
        s.close()
        check(got.startswith(b"HTTP/1.1 200"), f"the stalled address served again: {got[:80]!r}")

    # 2) 10 addresses x 60 stalled sockets (under the per-client cap), 600 > max_connections 512
    with Server("--quiet", "--set", "server.idle_timeout_s=30") as srv:
        socks = [stall(f"127.0.0.{2 + i % 10}", srv.port) for i in range(600)]
        time.sleep(0.5)
        st, dt = timed_health(srv.base)
        check(st == 200 and dt < 1.0, f"/health with every ordinary slot taken: {st} after {dt:.2f}s")
        r = requests.get(srv.base + "/metrics", timeout=5)
        check(r.status_code == 200 and "vllm:num_requests_running" in r.text, f"/metrics: {r.status_code}")
        r = requests.post(srv.base + "/v1/completions", json={"prompt": "abc", "max_tokens": 3}, timeout=5)
        check(r.status_code == 503 and r.json()["error"]["code"] == "too_many_connections"
              and r.headers.get("Connection", "").lower() == "close",
              f"ordinary request over max_connections: {r.status_code} {r.text} {dict(r.headers)}")
        for s in socks[:200]:
            s.close()
        time.sleep(0.5)
        r = requests.post(srv.base + "/v1/completions", json={"prompt": "abc", "max_tokens": 3}, timeout=5)
        check(r.status_code == 200, f"served again below max_connections: {r.status_code} {r.text}")
        for s in socks[200:]:
            s.close()

    # 3) waiting on the engine is not idleness: 40 tokens x 100 ms = 4 s > idle timeout 2 s
    with Server("--quiet", "--set", "server.idle_timeout_s=2", env={"KVS_FAKE_STEP_MS": "100"}) as srv:
        r = requests.post(srv.base + "/v1/completions",
                          json={"prompt": "abcd", "max_tokens": 40, "ignore_eos": True}, timeout=30)
        check(r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 40, f"long request: {r.status_code}")
    print("connection limits: per-client cap, idle timeout, probe reserve, long waits kept: ok")


if __name__ == "__main__":
    main()
