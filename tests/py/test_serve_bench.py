"""The serving benchmark (bench/serve_bench.py) against the real daemon on a token-id-only model
directory (tests/data/models/llama: config.json + safetensors, no tokenizer.json), test-sized,
so that the benchmark and the token-id-only serving path cannot rot:
  - the daemon starts without a tokenizer; text prompts, chat messages and /tokenize get a 400
    naming the missing tokenizer; token-id prompts are served, and a streamed completion has one
    chunk per token (there is no text to carry them);
  - /metrics carries the step timing the benchmark's ceiling is computed from, consistent with
    the tokens generated;
  - the benchmark runs a few requests at two concurrency levels and two workloads, exits 0, and
    its table has every request successful and a finite ceiling and ratio, and a finite
    prefill-aware ceiling (prefill at the daemon's measured rate, decode at a full batch).
"""
import json
import math
import os
import subprocess
import sys
import tempfile

import requests

from kvs_http import BUILD, ROOT, Server

MODEL = os.path.join(ROOT, "tests", "data", "models", "llama")


def check(cond, msg):
    if not cond:
        raise AssertionError(msg)


def main():
    check(not os.path.exists(os.path.join(MODEL, "tokenizer.json")), "the test model must have no tokenizer.json")
    with Server(binary=os.path.join(ROOT, BUILD, "kvserve"), model=MODEL) as s:
        for path, body, param in (("/v1/completions", {"prompt": "hello", "max_tokens": 2}, "prompt"),
                                  ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
                                  ("/tokenize", {"prompt": "hi"}, "prompt")):
            r = requests.post(s.base + path, json=body, timeout=30)
            check(r.status_code == 400, f"{path}: text on a token-id-only model gave {r.status_code}: {r.text}")
            err = r.json()["error"]
            check(err["code"] == "no_tokenizer" and err["param"] == param and "tokenizer" in err["message"],
                  f"{path}: unexpected error {err}")
        r = requests.post(s.base + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 5, "temperature": 0,
                                                              "ignore_eos": True}, timeout=30)
        check(r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5, f"token ids: {r.text}")
        chunks = 0
        with requests.post(s.base + "/v1/completions", stream=True, timeout=30,
                           json={"prompt": [5, 6, 7], "max_tokens": 7, "temperature": 0, "ignore_eos": True,
                                 "stream": True}) as r:
            for line in r.iter_lines():
                ch = json.loads(line[6:])["choices"] if line.startswith(b"data: {") else None
                if ch and ch[0]["finish_reason"] is None:   # the closing chunk carries no token
                    chunks += 1
        check(chunks == 7, f"a streamed 7-token completion had {chunks} chunks, want one per token")
        m = s.metrics()
        steps = m['kvserve:engine_steps_total{model_name="llama"}']
        fwd = m['kvserve:engine_forward_seconds_total{model_name="llama"}']
        wall = m['kvserve:engine_step_seconds_total{model_name="llama"}']
        dsteps = m['kvserve:engine_decode_steps_total{model_name="llama"}']
        drows = m['kvserve:engine_decode_rows_total{model_name="llama"}']
        # 2 requests: one prefill step each, then 4 and 6 decode-only steps (one row each)
        check(steps == 12 and dsteps == 10 and drows == 10, f"step counters {steps} {dsteps} {drows}")
        check(0 < fwd <= wall, f"forward {fwd} s vs step wall {wall} s")

        md = tempfile.NamedTemporaryFile(suffix=".md", delete=False).name
        cmd = [sys.executable, os.path.join(ROOT, "bench", "serve_bench.py"), "--url", s.base, "--vocab", "1024",
               "--workload", "fixed", "--input-len", "24", "--output-len", "12", "--workload", "sharegpt",
               "--max-input", "64", "--max-output", "16", "--concurrency", "1,4", "--num-prompts", "6",
               "--step-ms", "4=1000", "--markdown", md]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        check(p.returncode == 0, f"serve_bench failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
        for want in ("Request throughput (req/s):", "Output token throughput (tok/s):", "P99 TTFT (ms):",
                     "Median ITL (ms):", "P99 TPOT (ms):", "Ratio measured / ceiling:"):
            check(want in p.stdout, f"serve_bench output lacks {want!r}")
        rows = [ln.split("|")[1:-1] for ln in open(md).read().splitlines()[2:]]
        os.unlink(md)
        check(len(rows) == 4, f"want 4 table rows, got {rows}")
        for r in rows:
            wl, conc, ok, ceiling, ratio = r[0].strip(), int(r[1]), r[2].strip(), float(r[8]), float(r[9])
            check(ok == "6", f"{wl} at {conc}: {ok} successful of 6")
            check(math.isfinite(ceiling) and ceiling > 0, f"{wl} at {conc}: ceiling {ceiling}")
            # the client cannot get tokens faster than the engine's forward passes make them
            check(0 < ratio <= 1.05, f"{wl} at {conc}: ratio {ratio}")
            check((r[12].strip() != "-") == (conc == 4), f"external ceiling only where --step-ms names the batch: {r}")
            # prefill-aware ceiling "C (R)": prefill at the daemon's own rate, decode at a full batch
            pf, pr = r[13].strip().rstrip(")").split(" (")
            check(math.isfinite(float(pf)) and float(pf) > 0 and math.isfinite(float(pr)) and float(pr) > 0,
                  f"{wl} at {conc}: prefill-aware ceiling {r[13]}")
    print("serve_bench: token-id-only daemon refuses text, streams one chunk per token; benchmark ran 4 levels")


if __name__ == "__main__":
    main()
