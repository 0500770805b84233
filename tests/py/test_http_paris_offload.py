"""kv.paris.offload over HTTP (build/kvserve-e2e: real stack, tiny Llama, byte-level tokenizer).

A daemon whose GPU KV pool (here the CPU backend's pool) holds 160 tokens serves prompts of 400
tokens: chunked prefill writes each chunk's finished retrieval zone out to host pages and gives
its blocks back. At the neutral setting (beta 1, topk >= the zone) its greedy tokens must equal a
daemon with a big pool and full attention (exactly on the CPU; the split prefill attention's
rounding differs from attention()'s only in the last bits). Also: /v1/models reports the
offload-aware max_model_len (more than the pool holds), a request past it gets an OpenAI-shaped
400 (context_length_exceeded) whose message names the host KV pool and the GPU KV pool, and
/metrics shows the host KV bytes held and in the pool plus the recall counters (recall's exact
top-k reads the zone from the host pages; at beta 1 every exact top-k position is kept)."""
import os
import tempfile

import numpy as np
import requests

from kvs_http import E2E_BIN, ROOT, Server, check
from tiny_tokenizer import make_model_dir

POOL_BLOCKS = 10
BLOCK_BYTES = 8192          # the tiny Llama's K+V of 16 tokens, all layers (fp32)
HOST_PAGES = 26            # the 408-token requests need 25: no block falls back to the pool


def complete(base, prompt, n):
    r = requests.post(base + "/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0,
                                                      "ignore_eos": True, "logprobs": 0,
                                                      "return_tokens_as_token_ids": True}, timeout=120)
    check(r.status_code == 200, f"{r.status_code} {r.text}")
    return [int(t.split(":")[1]) for t in r.json()["choices"][0]["logprobs"]["tokens"]]


def main():
    tmp = tempfile.mkdtemp(prefix="kvs-paris-")
    model = make_model_dir(os.path.join(ROOT, "tests", "data", "models", "llama"), os.path.join(tmp, "tiny-llama"))
    rng = np.random.default_rng(19)
    prompts = [[int(t) for t in rng.integers(0, 256, 400)] for _ in range(2)]
    common = ["--quiet", "--set", "cpu_threads=1", "--set", "kv.reuse=none", "--set", "kv.block_size=16",
              "--set", "model.max_model_len=512", "--set", "scheduler.prefill_chunk=32"]
    with Server(*common, "--set", "kv.memory_bytes=4194304", binary=E2E_BIN, model=model) as srv:
        want = [complete(srv.base, p, 8) for p in prompts]

    paris = ["--set", "kv.decode=paris", "--set", "kv.paris.offload=true",
             "--set", f"kv.paris.host_bytes={HOST_PAGES * BLOCK_BYTES}", "--set", "kv.paris.dense_threshold=40",
             "--set", "kv.paris.sink=4", "--set", "kv.paris.local=8", "--set", "kv.paris.update_interval=16",
             "--set", "kv.paris.beta=1", "--set", "kv.paris.topk=600", "--set", "kv.paris.recall_every=4"]
    with Server(*common, "--set", f"kv.memory_bytes={POOL_BLOCKS * BLOCK_BYTES}", *paris, binary=E2E_BIN,
                model=model) as srv:
        models = requests.get(srv.base + "/v1/models", timeout=5).json()
        limit = models["data"][0]["max_model_len"]
        check(POOL_BLOCKS * 16 < 408 <= limit < 512, f"max_model_len {limit}: not past the {POOL_BLOCKS * 16}-token pool")
        got = [complete(srv.base, p, 8) for p in prompts]
        check(got == want, f"offload, 400-token prompts through a 160-token pool: {got} != full attention's {want}")
        m = {k.split("{")[0]: v for k, v in srv.metrics().items()}   # one model: drop the labels
        for name in ("kvserve:kv_paris_host_bytes", "kvserve:kv_paris_host_pool_bytes",
                     "kvserve:kv_paris_recall_total", "kvserve:kv_paris_recall_hits_total",
                     "kvserve:kv_paris_recall_coarse_hits_total", "kvserve:kv_paris_prefill_written_tokens_total",
                     "kvserve:kv_paris_host_prefill_rows_total", "kvserve:kv_paris_gpu_blocks_released_total"):
            check(name in m, f"/metrics lacks {name}")
        check(m["kvserve:kv_paris_host_pool_bytes"] == HOST_PAGES * BLOCK_BYTES and m["kvserve:kv_paris_host_bytes"] == 0,
              f"host KV bytes: pool {m['kvserve:kv_paris_host_pool_bytes']}, held {m['kvserve:kv_paris_host_bytes']}")
        check(m["kvserve:kv_paris_prefill_written_tokens_total"] > 0 and m["kvserve:kv_paris_host_prefill_rows_total"] > 0
              and m["kvserve:kv_paris_recall_total"] > 0
              and m["kvserve:kv_paris_recall_hits_total"] == m["kvserve:kv_paris_recall_total"],
              "offload counters did not move: " +
              str({k: v for k, v in m.items() if "paris" in k}))

        # past the limit: 400, OpenAI-shaped, naming both memories
        r = requests.post(srv.base + "/v1/completions", json={"prompt": prompts[0] + prompts[1][:limit - 400],
                                                              "max_tokens": 4}, timeout=30)
        check(r.status_code == 400, f"{r.status_code} {r.text}")
        err = r.json()["error"]
        check(err["code"] == "context_length_exceeded" and err["param"] == "prompt" and
              err["type"] == "invalid_request_error", f"error shape {err}")
        check(f"maximum context length is {limit} tokens" in err["message"] and "host KV pool" in err["message"] and
              "GPU KV pool" in err["message"], f"message does not name the limit and the memories: {err['message']}")
        print(f"ok offload over HTTP: 400-token prompts through a 160-token pool equal full attention's tokens; "
              f"max_model_len {limit}; past it: {err['message']}")
    print("test_http_paris_offload: ok")


if __name__ == "__main__":
    main()
