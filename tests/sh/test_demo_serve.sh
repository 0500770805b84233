#!/usr/bin/env bash
# What `make run` does: serve config/default.json (the demo model), answer a chat request with
# text, stream a completion, shut down cleanly on SIGTERM.
set -u
KVS=${KVS_BUILD:-build}/kvserve
log=$(mktemp); trap 'kill $pid 2>/dev/null; rm -f "$log"' EXIT
# KVS_TEST_DEVICE=cuda (tests/py/kvs_http.py): on the GPU explicitly (startup fails if it cannot be
# used); otherwise the config's device (auto). The checks are not token-exact: the same on any backend.
dev=(); [ -n "${KVS_TEST_DEVICE:-}" ] && dev=(--set "device=$KVS_TEST_DEVICE")
"$KVS" --config config/default.json "${dev[@]}" --port 0 >"$log" 2>&1 &
pid=$!
port=""
for _ in $(seq 100); do
  port=$(sed -n 's|.*serving on http://127.0.0.1:\([0-9]*\).*|\1|p' "$log" | head -1)
  [ -n "$port" ] && curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
  kill -0 $pid 2>/dev/null || { port=""; break; }  # exited (e.g. the device cannot be used)
  sleep 0.2
done
[ -n "$port" ] || { echo "FAIL: daemon did not come up"; cat "$log"; exit 1; }
echo "ok: serving on port $port"
resp=$(curl -s "http://127.0.0.1:$port/v1/chat/completions" -H 'Content-Type: application/json' \
  -d '{"model":"demo","messages":[{"role":"user","content":"Who are you?"}],"max_tokens":40,"temperature":0}')
echo "chat: $resp"
python3 - "$resp" <<'PY' || exit 1
import json, sys
r = json.loads(sys.argv[1])
text = r["choices"][0]["message"]["content"]
words = text.split()
assert len(words) >= 5, f"answer too short: {text!r}"
assert sum(w.strip(".,;:!?").isalpha() for w in words) >= 0.8 * len(words), f"not words: {text!r}"
assert r["usage"]["completion_tokens"] > 0
print("ok: fluent answer:", text)
PY
stream=$(curl -sN "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
  -d '{"model":"demo","prompt":"In the beginning","max_tokens":16,"stream":true}')
grep -q '^data: \[DONE\]' <<<"$stream" && echo "ok: streamed completion ends with [DONE]" || { echo "FAIL: stream: $stream"; exit 1; }
# on the CPU the KV pool is sized by need: the demo's 4096-token context x 64 running requests
if grep -q "cpu backend, KV pool" "$log"; then
  grep -q "KV pool .* = $((4096 * 64)) tokens" "$log" && echo "ok: CPU KV pool sized by need (context x max_running)" \
    || { echo "FAIL: CPU KV pool not sized by need: $(grep 'KV pool' "$log")"; exit 1; }
fi
kill -TERM $pid; wait $pid; rc=$?
[ $rc = 0 ] && echo "ok: SIGTERM exits 0" || { echo "FAIL: exit code $rc"; tail "$log"; exit 1; }
