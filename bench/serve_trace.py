#!/usr/bin/env python3
"""Where a serving run's time goes, from two timelines (stdlib only; runs on the GPU machine):

  serve_trace.py steps TRACE [TRACE...]   the engine's step trace (KVS_STEP_TRACE=path on the
                                          daemon: engine/scheduler.c step_trace)
  serve_trace.py nsys CSV                 `nsys stats -r cuda_gpu_trace -f csv` of a daemon run

Both split the run into bursts (steps or device work separated by > --idle-ms of nothing: the
benchmark's concurrency levels) and print, per burst:

steps: the prefill wave (steps from the burst's start until the first decode-only step: their
tokens, each step's time from its begin (or the end before it, when it was queued behind it) to
its end, and the prefill rate over the wave), then the decode-only steps at the burst's largest
batch: the interval between consecutive ends (the device's step time while the host keeps ahead:
under scheduler.async it launches step N+1 before it waits for N, and how long that wait was
tells whether it was ahead), and the scheduler thread's own time
per step: schedule + stage + launch (t_launched - t_sched) and applying the results (t_applied -
t_end: tokens, text, events).

nsys: the device's busy time (union of kernels and copies), its idle time and the idle gaps
over 20 us, and per name (kernels, graph launches, memcpy kinds) the count and total time, so a
decode step's time splits into the graph replay and what runs outside it.
"""
import argparse
import csv
import statistics as st
import sys


def bursts(items, start, end, idle_s):
    out, last = [], None
    for it in items:
        if out and start(it) - last <= idle_s:
            out[-1].append(it)
            last = max(last, end(it))
        else:
            out.append([it])
            last = end(it)
    return out


def q(xs, p):
    s = sorted(xs)
    return s[min(len(s) - 1, int(p * (len(s) - 1) + 0.5))] if s else float("nan")


def steps_report(path, idle_ms):
    rows = []
    for line in open(path):
        if line.startswith("#") or not line.strip():
            continue
        f = line.split()
        rows.append(dict(k=int(f[0]), ts=float(f[1]), tb=float(f[2]), tl=float(f[3]), te=float(f[4]),
                         ta=float(f[5]), seqs=int(f[6]), dec=int(f[7]), pre=int(f[8])))
    print("== step trace %s: %d steps" % (path, len(rows)))
    for b in bursts(rows, lambda r: r["ts"], lambda r: r["ta"], idle_ms):
        if len(b) < 8:
            continue
        span = b[-1]["te"] - b[0]["tb"]
        print("-- burst at %.0f ms: %d steps, %.1f ms begin to last end, max batch %d" %
              (b[0]["tb"], len(b), span, max(r["seqs"] for r in b)))
        # the wave: every step until the last one with prefill tokens in the burst's first half
        # (a closed loop's later admissions come when requests end, near its end)
        half = b[0]["tb"] + span / 2
        last_pre = max((i for i, r in enumerate(b) if r["pre"] > 0 and r["tb"] < half), default=-1)
        wave, prev_end = b[:last_pre + 1], b[0]["tb"]
        for i, r in enumerate(wave):
            if i >= 12 and r["pre"] == 0:
                prev_end = r["te"]
                continue
            start = max(r["tb"], prev_end)
            print("   wave step %d: begun %+.1f ms, launch %.2f ms, %d seqs (%d decode rows + %d other tokens), "
                  "%.1f ms to its end" % (i + 1, r["tb"] - b[0]["tb"], r["tl"] - r["tb"], r["seqs"], r["dec"],
                                          r["pre"], r["te"] - start))
            prev_end = r["te"]
        if wave:
            tot = sum(r["pre"] for r in wave)
            t = wave[-1]["te"] - wave[0]["tb"]
            print("   wave: %d steps (%d with prefill), %d prefill tokens in %.1f ms (first begin to last end): "
                  "%.0f tok/s" % (len(wave), sum(r["pre"] > 0 for r in wave), tot, t,
                                  tot / (t / 1e3) if t > 0 else float("nan")))
        dec = [r for r in b if r["pre"] == 0 and r["dec"] > 0]
        if len(dec) < 4:
            continue
        top = max(r["seqs"] for r in dec)
        ends = {r["k"]: r for r in b}
        iv, waits = [], []
        for r in dec:
            p = ends.get(r["k"] - 1)
            if r["seqs"] != top or not p:
                continue
            iv.append(r["te"] - p["te"])
            # under scheduler.async step N+1 is launched before N's end is waited for: a wait
            # near 0 means N was already done (the device may have idled), a long one that the
            # host was ahead
            waits.append(p["te"] - r["tl"])
        host = [r["tl"] - r["ts"] for r in dec if r["seqs"] == top]
        apply_ = [r["ta"] - r["te"] for r in dec if r["seqs"] == top]
        if iv:
            print("   decode-only steps at batch %d: %d; end-to-end interval ms: median %.3f, mean %.3f, p10 %.3f, "
                  "p90 %.3f; host wait for the step before after launching this one: median %.3f ms, under 0.05 ms "
                  "in %d steps" % (top, len(iv), st.median(iv), st.mean(iv), q(iv, 0.1), q(iv, 0.9),
                                   st.median(waits), sum(w < 0.05 for w in waits)))
            print("   scheduler thread per step at batch %d, ms: schedule + stage + launch median %.3f (p90 %.3f), "
                  "apply (tokens, text, events) median %.3f (p90 %.3f)" %
                  (top, st.median(host), q(host, 0.9), st.median(apply_), q(apply_, 0.9)))
        last = b[-1]
        print("   last decode step end to last applied: %.1f ms; first begin to last end %.1f ms" %
              (last["ta"] - last["te"], span))


def nsys_report(path, idle_ms):
    with open(path, newline="") as fh:
        rd = csv.reader(fh)
        hdr = next(rd)
        ci = {h: i for i, h in enumerate(hdr)}

        def col(*names):
            for n in names:
                for h, i in ci.items():
                    if h.startswith(n):
                        return i
            raise SystemExit("nsys csv: no column %s in %s" % (names, hdr))
        i_s, i_d, i_n = col("Start"), col("Duration"), col("Name")
        ops = []
        for f in rd:
            try:
                ops.append((int(f[i_s]), int(f[i_d]), f[i_n]))
            except (ValueError, IndexError):
                pass
    ops.sort()
    print("== nsys %s: %d device operations" % (path, len(ops)))
    for b in bursts(ops, lambda o: o[0] / 1e6, lambda o: (o[0] + o[1]) / 1e6, idle_ms):
        if len(b) < 100:
            continue
        t0, t1 = b[0][0], max(o[0] + o[1] for o in b)
        busy, cur_s, cur_e = 0, b[0][0], b[0][0] + b[0][1]
        gaps = []
        for s, d, _ in b[1:]:
            if s > cur_e:
                busy += cur_e - cur_s
                gaps.append(s - cur_e)
                cur_s, cur_e = s, s + d
            else:
                cur_e = max(cur_e, s + d)
        busy += cur_e - cur_s
        span = t1 - t0
        big = [g for g in gaps if g > 20000]
        print("-- burst at %.0f ms: %.1f ms, device busy %.1f ms (%.2f%%), idle %.1f ms in %d gaps (%d over 20 us: "
              "%.1f ms; largest %.2f ms)" % (t0 / 1e6, span / 1e6, busy / 1e6, 100.0 * busy / span,
                                             (span - busy) / 1e6, len(gaps), len(big), sum(big) / 1e6,
                                             max(gaps, default=0) / 1e6))
        per = {}
        for s, d, n in b:
            key = n if len(n) < 90 else n[:87] + "..."
            c = per.setdefault(key, [0, 0])
            c[0] += 1
            c[1] += d
        print("   %-90s %8s %10s %9s" % ("name", "count", "total ms", "mean us"))
        for n, (c, d) in sorted(per.items(), key=lambda kv: -kv[1][1])[:24]:
            print("   %-90s %8d %10.2f %9.1f" % (n, c, d / 1e6, d / 1e3 / c))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["steps", "nsys"])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--idle-ms", type=float, default=40.0,
                    help="a gap this long between steps or device work starts a new burst")
    a = ap.parse_args()
    for f in a.files:
        (steps_report if a.what == "steps" else nsys_report)(f, a.idle_ms)
    return 0


if __name__ == "__main__":
    sys.exit(main())
