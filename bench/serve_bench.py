#!/usr/bin/env python3
"""Serving benchmark for a running kvserve daemon: an HTTP load generator that prints what
`vllm bench serve` prints (request throughput, output tok/s, TTFT / TPOT / ITL mean, p50, p99),
plus the engine ceiling measured in the same run from the daemon's own step timing (/metrics:
kvserve:engine_forward_seconds_total etc.) and the ratio of the two.

Stdlib only (asyncio + raw HTTP/1.1), so it runs on the GPU machine, which has no package
registry. Prompts are random token ids (no tokenizer needed: the daemon serves a token-id-only
model directory), sent as token-id arrays to /v1/completions, streamed, temperature 0 with
ignore_eos so that every request produces exactly its output length.

Workloads (--workload, repeatable; lengths in tokens):
  decode     64 in / 512 out (decode-heavy)
  prompt     512 in / 128 out (prompt-heavy)
  sharegpt   ShareGPT-like lengths: log-normal input (median ~180) and output (median ~150),
             clipped to --max-input / --max-output, seeded
  fixed      --input-len / --output-len
Each workload runs at each --concurrency level (closed loop: that many requests in flight,
--num-prompts in all, default max(2 x concurrency, --min-prompts (16))).

Ceiling. Between the two /metrics scrapes around a level the daemon reports its forward time
F (seconds in forward passes, prefill steps included), its step wall time W (forward plus host
work) and the tokens it generated G. The engine ceiling is G / F: the output rate if the device
never waited for the host or the client (for prompt-heavy traffic it counts prefill at the
rate measured in the same run: the prefill-aware ceiling). ratio = measured output tok/s over
that ceiling. It also prints the mean decode-only step time and batch (decode steps / rows)
and the host share (W - F) / W. --step-ms B=MS,... adds an external ceiling (batch B / MS, e.g.
kvserve-gpubench's graph replay step time at that batch and context).
Prefill-aware ceiling (issue 22's yardstick for prompt-heavy traffic): the output rate of an
ideal server that prefills every prompt at the measured prefill rate P (--prefill-tok-s, e.g.
kvserve-gpubench's prefill tokens/s in the same device call; default: the daemon's prompt
tokens / forward seconds of the steps that carried prefill, which counts decode rows riding in
those steps as prefill time) and decodes at a full batch of `concurrency` rows at the step time
S (--step-ms for that level, else the daemon's mean decode-only step):
    T = in_tokens / P + (out_tokens / concurrency) * S,   ceiling = out_tokens / T.
pf ratio = measured output tok/s / that ceiling.

  python3 bench/serve_bench.py --url http://127.0.0.1:8000 --vocab 128256 \\
      --workload decode --concurrency 1,16,64,128,256 --markdown out.md
"""
import argparse
import asyncio
import json
import math
import random
import sys
import time
import urllib.parse
import urllib.request

WORKLOADS = {"decode": (64, 512), "prompt": (512, 128)}


def pct(xs, p):
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def scrape(url):
    """The daemon's /metrics as {name: value} (label-free sum per series name)."""
    out = {}
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if not line or line[0] == "#":
                continue
            name_labels, _, val = line.rpartition(" ")
            name = name_labels.split("{", 1)[0]
            try:
                out[name] = out.get(name, 0.0) + float(val)
            except ValueError:
                pass
    return out


def model_name(url):
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
        return json.loads(r.read())["data"][0]["id"]


def make_requests(workload, n, args, rng):
    reqs = []
    for _ in range(n):
        if workload == "sharegpt":
            # ShareGPT's conversation turns: long-tailed lengths (log-normal fits them well)
            li = int(min(args.max_input, max(4, rng.lognormvariate(math.log(180), 0.9))))
            lo = int(min(args.max_output, max(4, rng.lognormvariate(math.log(150), 0.8))))
        elif workload == "fixed":
            li, lo = args.input_len, args.output_len
        else:
            li, lo = WORKLOADS[workload]
        prompt = [rng.randrange(args.min_id, args.vocab) for _ in range(li)]
        reqs.append((prompt, lo))
    return reqs


def request_bytes(host, port, path, model, prompt, max_tokens):
    """The whole HTTP request of one streamed completion (built before the clock starts: the
    client's JSON work is not the server's time)."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}).encode()
    return ("POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
            "Content-Length: %d\r\nConnection: close\r\n\r\n" % (path, host, port, len(body))).encode() + body


async def one_request(host, port, req, n_in, timeout):
    """Streams one completion (req: request_bytes); returns a dict with t_start, first, chunk
    times, tokens, error."""
    res = {"t0": time.perf_counter(), "times": [], "tokens": 0, "err": None, "in": n_in}
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except Exception as ex:  # noqa: BLE001 -- any connect failure is a failed request
        res["err"] = "connect: %s" % ex
        return res
    try:
        writer.write(req)
        await writer.drain()
        status = await asyncio.wait_for(reader.readline(), timeout)
        chunked = False
        while True:
            h = await asyncio.wait_for(reader.readline(), timeout)
            if h in (b"\r\n", b"\n", b""):
                break
            if h.lower().startswith(b"transfer-encoding:") and b"chunked" in h.lower():
                chunked = True
        if b" 200 " not in status:
            rest = await asyncio.wait_for(reader.read(), timeout)
            res["err"] = "%s %s" % (status.decode().strip(), rest[-300:].decode(errors="replace"))
            return res
        buf = b""
        done = False
        while not done:
            if chunked:
                size_line = await asyncio.wait_for(reader.readline(), timeout)
                if not size_line:
                    break
                size = int(size_line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    break
                data = await asyncio.wait_for(reader.readexactly(size + 2), timeout)
                data = data[:-2]
            else:
                data = await asyncio.wait_for(reader.read(65536), timeout)
                if not data:
                    break
            now = time.perf_counter()
            buf += data
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                for line in ev.split(b"\n"):
                    if not line.startswith(b"data: "):
                        continue
                    payload = line[6:].strip()
                    if payload == b"[DONE]":
                        done = True
                        continue
                    # token chunks are told apart without parsing them (the client must keep up
                    # with >10k chunks/s): a token's chunk says "finish_reason":null; the closing
                    # chunk (finish_reason set, maybe the last text), the usage chunk and errors
                    # are parsed
                    if b'"finish_reason":null' in payload:
                        res["times"].append(now)
                        continue
                    j = json.loads(payload)
                    if "error" in j:
                        res["err"] = str(j["error"])
                        continue
                    ch = j.get("choices")
                    if ch and ch[0].get("text"):
                        res["times"].append(now)
                    if j.get("usage"):
                        res["tokens"] = j["usage"]["completion_tokens"]
    except Exception as ex:  # noqa: BLE001
        res["err"] = "%s: %s" % (type(ex).__name__, ex)
    finally:
        writer.close()
    res["t1"] = time.perf_counter()
    if res["err"] is None and res["tokens"] == 0:
        res["err"] = "no usage chunk"
    return res


async def run_level(url, model, reqs, conc, timeout):
    u = urllib.parse.urlparse(url)
    host, port = u.hostname, u.port or 80
    queue = [(request_bytes(host, port, "/v1/completions", model, prompt, lo), len(prompt)) for prompt, lo in reqs]
    results = []

    async def worker():
        while queue:
            req, n_in = queue.pop()
            results.append(await one_request(host, port, req, n_in, timeout))

    t0 = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(min(conc, len(reqs)))])
    return results, time.perf_counter() - t0


def summarize(workload, conc, results, dur, m0, m1, step_ms, prefill_tok_s=0.0):
    ok = [r for r in results if r["err"] is None]
    bad = [r for r in results if r["err"] is not None]
    ttft = [(r["times"][0] - r["t0"]) * 1e3 for r in ok if r["times"]]
    itl, tpot = [], []
    for r in ok:
        t = r["times"]
        itl += [(b - a) * 1e3 for a, b in zip(t, t[1:])]
        if r["tokens"] > 1 and t:
            tpot.append((r["t1"] - t[0]) * 1e3 / (r["tokens"] - 1))
    out_tok = sum(r["tokens"] for r in ok)
    in_tok = sum(r["in"] for r in ok)
    d = {k: m1.get(k, 0.0) - m0.get(k, 0.0) for k in m1}
    fwd = d.get("kvserve:engine_forward_seconds_total", 0.0)
    wall = d.get("kvserve:engine_step_seconds_total", 0.0)
    gen = d.get("vllm:generation_tokens_total", 0.0)
    dsteps = d.get("kvserve:engine_decode_steps_total", 0.0)
    drows = d.get("kvserve:engine_decode_rows_total", 0.0)
    dfwd = d.get("kvserve:engine_decode_forward_seconds_total", 0.0)
    row = {
        "workload": workload, "conc": conc, "ok": len(ok), "failed": len(bad), "dur": dur,
        "req_s": len(ok) / dur if dur > 0 else 0.0, "out_tok_s": out_tok / dur if dur > 0 else 0.0,
        "tot_tok_s": (in_tok + out_tok) / dur if dur > 0 else 0.0, "in_tok": in_tok, "out_tok": out_tok,
        "ttft_mean": mean(ttft), "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
        "tpot_mean": mean(tpot), "tpot_p50": pct(tpot, 50), "tpot_p99": pct(tpot, 99),
        "itl_mean": mean(itl), "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99),
        "ceiling": gen / fwd if fwd > 0 else float("nan"),
        "host_share": (wall - fwd) / wall if wall > 0 else float("nan"),
        "dstep_ms": dfwd * 1e3 / dsteps if dsteps else float("nan"),
        "dbatch": drows / dsteps if dsteps else float("nan"),
        "steps": d.get("kvserve:engine_steps_total", 0.0),
        "launch_ms": d.get("kvserve:engine_launch_seconds_total", 0.0) * 1e3 / d["kvserve:engine_steps_total"]
        if d.get("kvserve:engine_steps_total") else float("nan"),
        "sched_ms": d.get("kvserve:engine_schedule_seconds_total", 0.0) * 1e3 / d["kvserve:engine_steps_total"]
        if d.get("kvserve:engine_steps_total") else float("nan"),
        "post_ms": (wall - fwd - d.get("kvserve:engine_schedule_seconds_total", 0.0)) * 1e3
        / d["kvserve:engine_steps_total"] if d.get("kvserve:engine_steps_total") else float("nan"),
        "step_wall_ms": wall * 1e3 / d["kvserve:engine_steps_total"] if d.get("kvserve:engine_steps_total") else float("nan"),
    }
    row["ratio"] = row["out_tok_s"] / row["ceiling"] if row["ceiling"] > 0 else float("nan")
    ext = step_ms.get(conc)
    # prefill-aware ceiling (module docstring): prefill at P, decode at a full batch
    prompt_tok = d.get("vllm:prompt_tokens_total", 0.0) or in_tok
    pf_rate = prefill_tok_s if prefill_tok_s > 0 else (prompt_tok / (fwd - dfwd) if fwd > dfwd else float("nan"))
    step_s = (ext if ext else row["dstep_ms"]) / 1e3
    t_ideal = in_tok / pf_rate + out_tok / max(1, min(conc, len(ok) or 1)) * step_s
    row["pf_rate"] = pf_rate
    row["pf_ceiling"] = out_tok / t_ideal if t_ideal > 0 else float("nan")
    row["pf_ratio"] = row["out_tok_s"] / row["pf_ceiling"] if row["pf_ceiling"] > 0 else float("nan")
    row["ext_ceiling"] = conc / (ext / 1e3) if ext else float("nan")
    row["ext_ratio"] = row["out_tok_s"] / row["ext_ceiling"] if ext else float("nan")
    p = print
    p("============ Serving Benchmark Result: %s, concurrency %d ============" % (workload, conc))
    p("%-40s %d" % ("Successful requests:", len(ok)))
    p("%-40s %d" % ("Failed requests:", len(bad)))
    for r in bad[:3]:
        p("  error: %s" % r["err"])
    p("%-40s %.2f" % ("Benchmark duration (s):", dur))
    p("%-40s %d" % ("Total input tokens:", in_tok))
    p("%-40s %d" % ("Total generated tokens:", out_tok))
    p("%-40s %.2f" % ("Request throughput (req/s):", row["req_s"]))
    p("%-40s %.2f" % ("Output token throughput (tok/s):", row["out_tok_s"]))
    p("%-40s %.2f" % ("Total Token throughput (tok/s):", row["tot_tok_s"]))
    for title, key in (("Time to First Token", "ttft"), ("Time per Output Token (excl. 1st token)", "tpot"),
                       ("Inter-token Latency", "itl")):
        p(("{:-^50}").format(title))
        up = key.upper()
        p("%-40s %.2f" % ("Mean %s (ms):" % up, row[key + "_mean"]))
        p("%-40s %.2f" % ("Median %s (ms):" % up, row[key + "_p50"]))
        p("%-40s %.2f" % ("P99 %s (ms):" % up, row[key + "_p99"]))
    p(("{:-^50}").format("Engine ceiling (daemon step timing)"))
    p("%-40s %.2f" % ("Ceiling output tok/s (gen / forward s):", row["ceiling"]))
    p("%-40s %.3f" % ("Ratio measured / ceiling:", row["ratio"]))
    p("%-40s %.3f" % ("Host share of step wall time:", row["host_share"]))
    p("%-40s %.2f" % ("Mean step wall time (ms):", row["step_wall_ms"]))
    p("%-40s %.3f / %.3f" % ("Host ms per step, before / after fwd:", row["sched_ms"], row["post_ms"]))
    p("%-40s %.3f" % ("Runner ms per step until queued (launch):", row["launch_ms"]))
    p("%-40s %.2f at batch %.1f" % ("Decode-only forward step (ms):", row["dstep_ms"], row["dbatch"]))
    if ext:
        p("%-40s %.2f (%.2f ms/step), ratio %.3f" % ("External ceiling (batch/step):", row["ext_ceiling"], ext,
                                                      row["ext_ratio"]))
    p("%-40s %.2f (prefill %.0f tok/s), ratio %.3f" % ("Prefill-aware ceiling (tok/s):", row["pf_ceiling"],
                                                        row["pf_rate"], row["pf_ratio"]))
    p("=" * 50)
    sys.stdout.flush()
    return row


def markdown(rows):
    lines = ["| workload | conc | ok | req/s | out tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | ITL p50 / p99 ms"
             " | ceiling tok/s | ratio | host share | decode step ms @ batch | ext. ratio | prefill-aware ceiling (ratio) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append("| %s | %d | %d%s | %.2f | %.0f | %.0f / %.0f | %.1f / %.1f | %.1f / %.1f | %.0f | %.3f | %.3f "
                     "| %.2f @ %.1f | %s | %.0f (%.3f) |" % (
                         r["workload"], r["conc"], r["ok"], " (%d failed)" % r["failed"] if r["failed"] else "",
                         r["req_s"], r["out_tok_s"], r["ttft_p50"], r["ttft_p99"], r["tpot_p50"], r["tpot_p99"],
                         r["itl_p50"], r["itl_p99"], r["ceiling"], r["ratio"], r["host_share"], r["dstep_ms"],
                         r["dbatch"], "%.3f" % r["ext_ratio"] if r["ext_ratio"] == r["ext_ratio"] else "-",
                         r["pf_ceiling"], r["pf_ratio"]))
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", help="model name (default: the first of /v1/models)")
    ap.add_argument("--vocab", type=int, default=1000, help="prompt ids are drawn from [--min-id, vocab)")
    ap.add_argument("--min-id", type=int, default=16)
    ap.add_argument("--workload", action="append", choices=["decode", "prompt", "sharegpt", "fixed"])
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-input", type=int, default=1024)
    ap.add_argument("--max-output", type=int, default=512)
    ap.add_argument("--concurrency", default="1,16,64,128,256")
    ap.add_argument("--num-prompts", type=int, default=0, help="per level (default max(2 x concurrency, --min-prompts))")
    ap.add_argument("--min-prompts", type=int, default=16, help="fewest requests of a level by default")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--warmup", type=int, default=2, help="requests sent before the first level")
    ap.add_argument("--step-ms", default="", help="external step times: B=MS,... (ceiling B / MS)")
    ap.add_argument("--prefill-tok-s", type=float, default=0.0,
                    help="measured prefill rate for the prefill-aware ceiling (default: the daemon's)")
    ap.add_argument("--markdown", help="append the summary table to this file")
    ap.add_argument("--min-ok-ratio", type=float, default=1.0,
                    help="exit 1 when fewer than this fraction of the requests succeed")
    args = ap.parse_args()
    workloads = args.workload or ["decode"]
    levels = [int(x) for x in args.concurrency.split(",") if x]
    step_ms = {int(k): float(v) for k, v in (kv.split("=") for kv in args.step_ms.split(",") if kv)}
    model = args.model or model_name(args.url)
    rng = random.Random(args.seed)
    if args.warmup:
        warm = make_requests("fixed", args.warmup, argparse.Namespace(**{**vars(args), "input_len": 8,
                                                                          "output_len": 8}), rng)
        asyncio.run(run_level(args.url, model, warm, args.warmup, args.timeout))
    rows = []
    worst = 1.0
    for w in workloads:
        for c in levels:
            n = args.num_prompts or max(2 * c, args.min_prompts)
            reqs = make_requests(w, n, args, random.Random("%d/%s/%d" % (args.seed, w, c)))
            m0 = scrape(args.url)
            results, dur = asyncio.run(run_level(args.url, model, reqs, c, args.timeout))
            m1 = scrape(args.url)
            row = summarize(w, c, results, dur, m0, m1, step_ms, args.prefill_tok_s)
            rows.append(row)
            worst = min(worst, row["ok"] / max(1, len(results)))
    table = markdown(rows)
    print(table)
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write(table)
    return 0 if worst >= args.min_ok_ratio else 1


if __name__ == "__main__":
    sys.exit(main())
