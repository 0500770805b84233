"""The demo model in kvserve agrees with Hugging Face transformers.

tests/data/demo_reference.json (scripts/make-demo-reference.py, transformers on the CPU, fp32
activations on the bf16 weights) holds, per case, the prompt ids, the top-5 logits at the last
prompt position and the 24-token greedy continuation with each step's top-1/top-2 margin.
kvserve's CPU backend (fp32) must reproduce the prompt ids from the text (tokenizer + chat
format), the top-5 ids and logits (abs error < 1e-3), and the greedy ids; a greedy step may
differ only where the reference's margin is below 1e-3 (a near-tie), after which the rest is
not compared.
"""
import json
import os
import subprocess
import sys

root = os.environ.get("KVS_ROOT", ".")
build = os.environ.get("KVS_BUILD", "build")
kvs = os.path.join(root, build, "kvserve")
ref = json.load(open(os.path.join(root, "tests/data/demo_reference.json")))
failures = 0


def check(cond, what):
    global failures
    print(("ok: " if cond else "FAIL: ") + what)
    if not cond:
        failures += 1


for case in ref["cases"]:
    ids = case["prompt_ids"]
    out = subprocess.run(
        [kvs, "generate", "--model", os.path.join(root, "models/demo"), "--prompt-ids",
         ",".join(map(str, ids)), "-n", str(ref["n_new"]), "--temperature", "0", "--ignore-eos",
         "--print-ids", "--threads", "2"],
        capture_output=True, text=True, timeout=300)
    check(out.returncode == 0, f"{case['name']}: kvserve generate exits 0 ({out.stderr.strip()[-200:]})")
    got = [int(x) for x in out.stdout.split()]
    want = case["greedy_ids"]
    n_cmp = len(want)
    for i, m in enumerate(case["greedy_margins"]):
        if m < 1e-3:
            n_cmp = i
            break
    check(got[:n_cmp] == want[:n_cmp],
          f"{case['name']}: greedy ids equal transformers for {n_cmp} steps (got {got[:n_cmp]}, want {want[:n_cmp]})")

# Our tokenizer reproduces the reference prompt ids from the prompt text (special tokens parsed,
# no BOS: the ChatML template writes everything itself).
tok = os.path.join(root, build, "kvs-tokenize")
lines = "".join("E 0 1 " + c["prompt"].encode().hex() + "\n" for c in ref["cases"])
out = subprocess.run([tok, os.path.join(root, "models/demo"), "--batch"], input=lines,
                     capture_output=True, text=True, timeout=60)
got_lines = out.stdout.strip().split("\n")
for case, line in zip(ref["cases"], got_lines):
    got = [int(x) for x in line.split()]
    check(got == case["prompt_ids"], f"{case['name']}: tokenizer gives the reference prompt ids")
check(len(got_lines) == len(ref["cases"]), "one tokenizer answer per case")
print(f"{failures} failures")
sys.exit(1 if failures else 0)
