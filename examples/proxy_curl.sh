#!/usr/bin/env bash
# Talk to a running `fedroute proxy` with curl (walk-through: docs/openai_proxy.md).
#   PROXY=http://127.0.0.1:8080 TOKEN=$(cat proxy_tokens) bash examples/proxy_curl.sh
set -euo pipefail
PROXY=${PROXY:-http://127.0.0.1:8080}
: "${TOKEN:?set TOKEN to a proxy caller token}"
AUTH="Authorization: Bearer $TOKEN"
ASK='"messages": [{"role": "user", "content": "Prove that the square root of 2 is irrational."}]'

echo "# routed (model=fedroute); the response headers say which model answered"
curl -sS -D headers.txt "$PROXY/v1/chat/completions" -H "$AUTH" -H "Content-Type: application/json" \
    -d "{\"model\": \"fedroute:lam=100\", $ASK}" > reply.json
grep -i '^x-fedroute' headers.txt
jq -r '.choices[0].message.content' reply.json

echo "# streamed (server-sent events passed through)"
curl -sS -N "$PROXY/v1/chat/completions" -H "$AUTH" -H "Content-Type: application/json" \
    -d "{\"model\": \"fedroute\", \"stream\": true, $ASK}" | grep -c '^data: ' | sed 's/$/ events/'

echo "# score the first answer: one row in the device's EvalLog"
curl -sS "$PROXY/v1/fedroute/feedback" -H "$AUTH" -H "Content-Type: application/json" \
    -d "{\"id\": \"$(jq -r .id reply.json)\", \"score\": 1.0}"; echo

echo "# a malformed model string is an OpenAI-style 400"
curl -sS -o /dev/null -w '%{http_code}\n' "$PROXY/v1/chat/completions" -H "$AUTH" -H "Content-Type: application/json" \
    -d "{\"model\": \"fedroute:budget=0\", $ASK}"

echo "# metrics (Prometheus)"
curl -sS "$PROXY/metrics" -H "$AUTH" | grep '^fedroute_proxy_requests_total'
rm -f headers.txt reply.json
