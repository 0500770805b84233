"""Helpers for the HTTP tests: start build/kvserve-fake on a free 127.0.0.1 port, wait for
/health, stop it; and an independent model of its fake model (tests/fake/fake_model.h, run by
the real engine and tokenizer: tests/fake/kvserve_fake_main.c) so tests can predict every
completion exactly.

The HTTP suite against a CUDA daemon (on a GPU machine; `make` builds with CUDA when it finds
nvcc; the Python venv .venv as for `make test`):
    make -j16 && KVS_TEST_DEVICE=cuda TESTS='http|demo' tests/run
KVS_TEST_DEVICE=cuda starts the real-stack daemons (build/kvserve-e2e: test_http_e2e,
test_http_lazy) with `--set device=cuda`, test_demo_parity's `kvserve generate` with
`--device cuda` and test_demo_serve's daemon with `--set device=cuda`; each fails if the GPU
cannot be used. Greedy token comparisons then accept bf16 near-tie flips only
(tests/py/greedy_check.py says exactly what is accepted and why). The other test_http_* tests
run build/kvserve-fake (no weights, no device: the HTTP layer over the real engine, whose
behaviour does not depend on the backend); they run unchanged and print a note saying so. test_http_tolerance
proves the tolerant comparisons on the CPU (KVS_TEST_TOLERANT=1 forces them there, with
planted divergences) and runs its daemons on the CPU whatever KVS_TEST_DEVICE says.

The fake model: the byte-level tokenizer of tests/data/fake (ids 0..255 = bytes,
256 <|endoftext|> EOS, 257 <|im_start|>, 258 <|im_end|> EOS, 259 <|bos|> BOS); completion token k
is prompt[n-1 - (k mod n)] with logprob log(0.5); an EOS ends with "stop" (unless ignore_eos) and
counts as a completion token (the engine's rule, as in vLLM) with no text; stop strings end with
"stop" and are not emitted. Prompt logprobs (echo): next_byte_logprob.
"""
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import requests

ROOT = os.environ.get("KVS_ROOT", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BUILD = os.environ.get("KVS_BUILD", "build")
BIN = os.path.join(ROOT, BUILD, "kvserve-fake")
E2E_BIN = os.path.join(ROOT, BUILD, "kvserve-e2e")

SPECIAL = {"<|endoftext|>": 256, "<|im_start|>": 257, "<|im_end|>": 258, "<|bos|>": 259}
EOS = {256, 258}
BOS = 259


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Server:
    _fake_noted = False

    def __init__(self, *args, env=None, wait=True, binary=None, model=None):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="kvserve-", suffix=".log", delete=False)
        e = dict(os.environ)
        e.update(env or {})
        binary = binary or BIN
        cmd = [binary, "--port", str(self.port), "--model", model or os.path.join(ROOT, "tests", "data", "fake")] + list(args)
        # KVS_TEST_DEVICE=cuda runs the real-stack daemons on the GPU (their startup fails if it
        # cannot be used): the HTTP suite end to end on that backend
        if binary != BIN and os.environ.get("KVS_TEST_DEVICE"):
            cmd += ["--set", "device=" + os.environ["KVS_TEST_DEVICE"]]
        elif binary == BIN and os.environ.get("KVS_TEST_DEVICE") and not Server._fake_noted:
            Server._fake_noted = True
            print(f"note: KVS_TEST_DEVICE={os.environ['KVS_TEST_DEVICE']} does not apply here: build/kvserve-fake "
                  "has no model and no device (these checks are of the HTTP layer); they run unchanged")
        if not os.path.exists(binary):
            raise SystemExit(f"missing {binary}: run make first")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=e)
        if wait:
            self.wait_healthy()

    def wait_healthy(self, timeout=20):
        end = time.time() + timeout
        while time.time() < end:
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited with {self.proc.returncode}:\n{self.logtext()}")
            try:
                if requests.get(self.base + "/health", timeout=1).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.05)
        raise AssertionError("daemon did not become healthy\n" + self.logtext())

    def logtext(self):
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def stop(self, timeout=15):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError("daemon did not stop on SIGTERM\n" + self.logtext())
        rc = self.proc.returncode
        if rc != 0:
            raise AssertionError(f"daemon exit code {rc}\n" + self.logtext()[-3000:])
        for pat in ("AddressSanitizer", "runtime error", "LeakSanitizer"):
            if pat in self.logtext():
                raise AssertionError("sanitizer report in the daemon log\n" + self.logtext()[-5000:])
        os.unlink(self.log.name)

    def __enter__(self):
        return self

    def __exit__(self, et, ev, tb):
        if et is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
            sys.stderr.write(self.logtext()[-4000:])
            return False
        self.stop()

    def metrics(self):
        out = {}
        for line in requests.get(self.base + "/metrics", timeout=5).text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name, val = line.rsplit(" ", 1)
            out[name] = float(val)
        return out


def tokenize(text, add_special=True, parse_special=True):
    ids = [BOS] if add_special else []
    b = text.encode("utf-8")
    i = 0
    while i < len(b):
        hit = None
        if parse_special:
            for s, tid in SPECIAL.items():
                if b.startswith(s.encode(), i):
                    hit = (tid, len(s))
                    break
        if hit:
            ids.append(hit[0])
            i += hit[1]
        else:
            ids.append(b[i])
            i += 1
    return ids


def chatml(messages, documents=()):
    """engine/text/chat.h's ChatML rendering: every role printed as given (developer and tool
    included); documents, then the system content, joined by a blank line, in the system turn
    (created when messages[0] is not system)."""
    msgs = [dict(m) for m in messages]
    if documents:
        if msgs and msgs[0]["role"] == "system":
            parts = list(documents) + ([msgs[0]["content"]] if msgs[0]["content"] else [])
            msgs[0]["content"] = "\n\n".join(parts)
        else:
            msgs.insert(0, {"role": "system", "content": "\n\n".join(documents)})
    out = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs)
    return out + "<|im_start|>assistant\n"


def complete(prompt_ids, max_tokens, stop=(), ignore_eos=False):
    """(text, finish_reason, completion_tokens) the fake model produces."""
    n = len(prompt_ids)
    out = bytearray()
    count = 0
    for k in range(max_tokens):
        tok = prompt_ids[n - 1 - (k % n)]
        count += 1
        if tok in EOS and not ignore_eos:
            return out.decode("utf-8", "replace"), "stop", count
        if tok < 256:
            out.append(tok)
        text = out.decode("utf-8", "ignore")
        cuts = [text.find(s) for s in stop if s in text]
        if cuts:
            return text[: min(cuts)], "stop", count
    return out.decode("utf-8", "replace"), "length", count


NB_TOP = 24   # fake_model.h FAKE_NB_TOP
VOCAB = 260


def next_byte_logprob(prev, tok):
    """fake_model.h FAKE_LOGITS_NEXT_BYTE: log-probability of tok right after prev (prompt
    logprobs): (prev + 1 + i) % 256 has 2^-(i+1) for i < NB_TOP, the other ids share the rest."""
    i = (tok - prev - 1) % 256
    if tok < 256 and i < NB_TOP:
        return -(i + 1) * math.log(2)
    return -NB_TOP * math.log(2) - math.log(VOCAB - NB_TOP)


def check(cond, msg):
    if not cond:
        raise AssertionError(msg)
