"""The bf16-tolerant greedy comparisons (tests/py/greedy_check.py) that the real-stack HTTP tests
use on the GPU (KVS_TEST_DEVICE=cuda), proven on the CPU:

1. check_greedy on synthetic sequences: exact mode fails on any difference; tolerant mode
   accepts a divergence only below the near-tie threshold, fails at a confident position, and
   after an accepted near-tie fails a later confident gap of the teacher-forced reference.
2. A bf16 emulation of the CUDA backend (np_llama.Ref(bf16=True)) on the tiny Llama: its greedy
   sequences differ from transformers' (fp32) at near-ties and must pass the tolerant
   comparison; the same emulation with a real-looking bug (RoPE pairs interleaved, RoPE theta
   halved, no RoPE, the final norm weight ignored) must fail it on every reference prompt.
3. test_http_e2e, test_http_lazy and test_demo_parity themselves with KVS_TEST_TOLERANT=1 (the
   tolerant code path against the real daemon on the CPU) pass; with KVS_TEST_PLANT a token of
   the daemon's output at a confident position is replaced, in each kind of comparison (model vs
   fp32 reference, and daemon path vs daemon path with the daemon's own top_logprobs margins),
   and the run must fail saying so.
The daemons here always run on the CPU (KVS_TEST_DEVICE is removed for the subprocesses): the
point is the comparison logic; on the GPU the real tests exercise it directly."""
import json
import os
import subprocess
import sys

import numpy as np

import greedy_check
from greedy_check import TIE, check_greedy, cmpl_margins, top_margins
from kvs_http import ROOT, check
from np_llama import Ref

HERE = os.path.dirname(os.path.abspath(__file__))


def raises(fn, text):
    try:
        fn()
    except AssertionError as e:
        check(text in str(e), f"expected an error with {text!r}, got: {e}")
        return
    raise AssertionError(f"expected an AssertionError with {text!r}")


def unit():
    want = [5, 6, 7, 8, 9]
    margins = [2.0, 0.1, 1.5, 0.05, 3.0]
    for tol in (False, True):
        check(check_greedy(want, want, "equal", margins, tolerant=tol) == 5, "equal sequences")
    # exact mode: any difference fails, even at a near-tie
    raises(lambda: check_greedy([5, 1, 7, 8, 9], want, "strict", margins, tolerant=False), "token 1 differs")
    raises(lambda: check_greedy([5, 6, 7, 8], want, "strict short", margins, tolerant=False), "token 4 differs")
    # tolerant: a near-tie divergence ends the comparison (no reference model for the rest)
    check(check_greedy([5, 1, 0, 0, 0], want, "near-tie", margins, tolerant=True) == 1, "near-tie accepted")
    check(check_greedy([5, 6, 7], want, "ends at a near-tie", margins, tolerant=True) == 3, "early end at a near-tie")
    raises(lambda: check_greedy([1, 6, 7, 8, 9], want, "confident", margins, tolerant=True), "confident position 0")
    raises(lambda: check_greedy([5, 6, 1, 8, 9], want, "confident", margins, tolerant=True), "confident position 2")
    raises(lambda: check_greedy(want + [1], want, "longer", margins, tolerant=True), "confident position 5")
    raises(lambda: check_greedy([5, 1, 7, 8, 9], want, "no margins", None, tolerant=True), "margin unknown")
    raises(lambda: check_greedy([5, 6, 7, 8, 9], [5, 6, 7, 8, 1], "at the threshold", [1, 1, 1, 1, TIE],
                                tolerant=True), "confident position 4")
    # tolerant with a teacher-forced reference: every later token must be within TIE of its best
    check(check_greedy([5, 1, 2, 3, 4], want, "gaps ok", margins, tolerant=True,
                       gaps=lambda g: [0, 0.3, 0, 0.59, 0]) == 1, "near-tie then close gaps")
    raises(lambda: check_greedy([5, 1, 2, 3, 4], want, "gap", margins, tolerant=True,
                                gaps=lambda g: [0, 0.3, 0, 1.2, 0]), "(3, 1.2)")
    # the daemon's own margins from its raw top logprobs
    check(top_margins([[-0.5, -1.25], [-3.0]]) == [0.75, float("inf")], "top_margins")
    check(cmpl_margins({"logprobs": {"top_logprobs": [{"token_id:3": -2.0, "token_id:9": -0.5}]}}) == [1.5],
          "cmpl_margins")
    # the plant
    os.environ["KVS_TEST_PLANT"] = "confident:planted"
    try:
        check(check_greedy(want, want, "not this one", margins, tolerant=True) == 5, "plant filter")
        raises(lambda: check_greedy(want, want, "planted", margins, tolerant=True), "confident position 4")
    finally:
        del os.environ["KVS_TEST_PLANT"]
    print("check_greedy: exact and tolerant modes on synthetic sequences: ok")


class InterleavedRope(Ref):
    """A real-looking bug: RoPE rotating adjacent pairs (GPT-J) instead of the two halves."""

    def rope(self, x, pos):
        ang = pos.astype("float64")[:, None] * self.inv[None, :].astype("float64")
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        out = np.empty_like(x)
        out[..., 0::2] = x[..., 0::2] * c - x[..., 1::2] * s
        out[..., 1::2] = x[..., 1::2] * c + x[..., 0::2] * s
        return out


class HalfTheta(Ref):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.inv = (self.inv * 0.5).astype(self.inv.dtype)


class NoRope(Ref):
    def rope(self, x, pos):
        return x


class NoFinalNormWeight(Ref):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.w["model.norm.weight"] = self.w["model.norm.weight"] * 0 + 1


def emulation():
    d = os.path.join(ROOT, "tests", "data", "models", "llama")
    ref = json.load(open(os.path.join(d, "reference.json")))
    fp = Ref(d)
    # the numpy reference is transformers' model: on transformers' greedy paths its own choice
    # is the same token (gap 0) except within fp32 rounding
    for p in ref["prompts"]:
        g = fp.gaps([], p["prompt"], p["greedy"])
        check(max(g) < 1e-3, f"np_llama vs transformers on a {len(p['prompt'])}-token prompt: gaps {g}")
    flips = 0
    emu = Ref(d, bf16=True)
    for p in ref["prompts"]:
        got = emu.greedy([], p["prompt"], len(p["greedy"]))
        n = check_greedy(got, p["greedy"], f"bf16 emulation, {len(p['prompt'])}-token prompt",
                         margins=p["greedy_margins"], tolerant=True, gaps=lambda g, p=p: fp.gaps([], p["prompt"], g))
        flips += n < len(p["greedy"])
    check(flips >= 2, f"the bf16 emulation flips near-ties on {flips} of 4 prompts (expected several)")
    print(f"bf16 emulation: greedy differs from transformers on {flips} of 4 prompts, each at a near-tie, "
          f"and stays within {TIE} of the reference after it: accepted")
    for cls in (InterleavedRope, HalfTheta, NoRope, NoFinalNormWeight):
        bug = cls(d, bf16=True)
        caught = 0
        for p in ref["prompts"]:
            got = bug.greedy([], p["prompt"], len(p["greedy"]))
            try:
                check_greedy(got, p["greedy"], f"{cls.__name__}", margins=p["greedy_margins"], tolerant=True,
                             gaps=lambda g, p=p: fp.gaps([], p["prompt"], g))
            except AssertionError:
                caught += 1
        check(caught == len(ref["prompts"]), f"bf16 emulation with the bug {cls.__name__}: caught on {caught} of 4")
        print(f"bf16 emulation with the bug {cls.__name__}: fails the tolerant comparison on 4 of 4 prompts")


def run(test, plant=None):
    env = {k: v for k, v in os.environ.items() if k not in ("KVS_TEST_DEVICE", "KVS_TEST_PLANT")}
    env["KVS_TEST_TOLERANT"] = "1"
    if plant:
        env["KVS_TEST_PLANT"] = "confident:" + plant
    p = subprocess.run([sys.executable, os.path.join(HERE, test + ".py")], env=env, capture_output=True, text=True,
                       timeout=300)
    return p.returncode, p.stdout + p.stderr


def real_tests():
    plants = {
        "test_http_e2e": ["greedy ids", "(warm)", "chat: streamed", "documents:", "concurrent"],
        "test_http_lazy": ["round 0", "round 1", "warm vs cold", "chat round 0", "reuse=none"],
        "test_demo_parity": ["chat_retrieval"],
    }
    for test, names in plants.items():
        rc, out = run(test)
        check(rc == 0 and ("KVS_TEST_TOLERANT=1" in out or "< 0.6" in out),
              f"{test} with KVS_TEST_TOLERANT=1: rc {rc}\n{out[-3000:]}")
        for name in names:
            rc, out = run(test, name)
            planted = [ln for ln in out.splitlines() if ln.startswith("KVS_TEST_PLANT: ") and name in ln]
            check(rc != 0 and planted and "divergence at a confident position" in out,
                  f"{test} with a confident divergence planted in {name!r}: rc {rc}, not caught:\n{out[-3000:]}")
        print(f"{test}: passes with the tolerant comparisons on the CPU; a divergence planted at a confident "
              f"position fails it in each of: {', '.join(names)}")


def main():
    if greedy_check.DEVICE != "cpu":
        print(f"note: KVS_TEST_DEVICE={greedy_check.DEVICE}: this test's daemons run on the CPU anyway (it proves the "
              "comparison logic; the real tests exercise it on the device)")
    unit()
    emulation()
    real_tests()


if __name__ == "__main__":
    main()
