#!/usr/bin/env bash
# Proves the runtime image without a registry: builds the binary on the host, packs it with the
# Dockerfile's `prebuilt` target onto the local debian:bookworm-slim, runs the image with the
# host's Docker socket mounted, and checks from the host that /healthz answers, the image's
# HEALTHCHECK passes, one terminal_execute runs in a sibling sandbox container, DELETE removes
# that temporary container, and `docker stop` ends the server with exit code 0.
# Idempotent: removes its container, volume and image on every exit.
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=kilntainers-image-test:local
NAME=kilntainers-image-test
PORT="${KILNTAINERS_IMAGE_TEST_PORT:-18080}"
SANDBOX_IMAGE="${KILNTAINERS_IMAGE_TEST_SANDBOX:-sandbox-busybox:full}"
SANDBOX_SHELL="${KILNTAINERS_IMAGE_TEST_SHELL:-/bin/sh}"
URL="http://127.0.0.1:${PORT}"
COMPUTER="image-test-$$"
TMP="$(mktemp -d)"

cleanup() {
  docker rm -f -v "$NAME" >/dev/null 2>&1 || true
  docker rm -f "kilntainer-${COMPUTER}" >/dev/null 2>&1 || true
  docker rmi -f "$IMAGE" >/dev/null 2>&1 || true
  rm -rf "$TMP"
}
trap cleanup EXIT
cleanup
mkdir -p "$TMP"

fail() {
  echo "docker-image-test: FAIL: $*" >&2
  docker logs "$NAME" >&2 2>&1 || true
  exit 1
}

echo "== host build"
cargo build --release --locked

echo "== image (target prebuilt)"
docker build --force-rm --target prebuilt -t "$IMAGE" . >"$TMP/build.log" 2>&1 || {
  cat "$TMP/build.log" >&2
  fail "docker build"
}
docker run --rm --entrypoint /bin/sh "$IMAGE" -c \
  'test -x /usr/local/bin/mcp-sandbox-computer-vm-for-ai' || fail "binary missing from the image"

echo "== run"
docker run -d --name "$NAME" \
  -p "127.0.0.1:${PORT}:8080" \
  -v /var/run/docker.sock:/var/run/docker.sock \
  "$IMAGE" \
  --transport http --host 0.0.0.0 --port 8080 --backend docker --allow-unauthenticated-http \
  --image "$SANDBOX_IMAGE" --shell "$SANDBOX_SHELL" >/dev/null

ready=""
for _ in $(seq 1 100); do
  if curl -fsS "$URL/healthz" >"$TMP/health" 2>/dev/null; then
    ready=1
    break
  fi
  sleep 0.2
done
[ -n "$ready" ] || fail "/healthz did not answer"
grep -qx '{"status":"ok"}' "$TMP/health" || fail "unexpected /healthz body: $(cat "$TMP/health")"
echo "/healthz: $(cat "$TMP/health")"

echo "== terminal_execute over HTTP"
post() {
  curl -sS -D "$TMP/headers" "$URL/mcp" \
    -H 'Content-Type: application/json' \
    -H 'Accept: application/json, text/event-stream' \
    "$@"
}
post -d '{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"docker-image-test","version":"1"}}}' >/dev/null
SESSION="$(tr -d '\r' <"$TMP/headers" | awk 'tolower($1) == "mcp-session-id:" {print $2}')"
[ -n "$SESSION" ] || fail "no Mcp-Session-Id"
post -H "Mcp-Session-Id: $SESSION" -H 'MCP-Protocol-Version: 2025-06-18' \
  -d '{"jsonrpc":"2.0","method":"notifications/initialized"}' >/dev/null
post -H "Mcp-Session-Id: $SESSION" -H 'MCP-Protocol-Version: 2025-06-18' \
  -d "{\"jsonrpc\":\"2.0\",\"id\":2,\"method\":\"tools/call\",\"params\":{\"name\":\"terminal_execute\",\"arguments\":{\"computer_id\":\"${COMPUTER}\",\"command\":\"echo hello from \$(hostname)\"}}}" \
  >"$TMP/call"
grep -q '"exit_code":0' "$TMP/call" || fail "terminal_execute failed: $(cat "$TMP/call")"
grep -q "hello from" "$TMP/call" || fail "unexpected output: $(cat "$TMP/call")"
grep -o '"structuredContent":{[^}]*}' "$TMP/call"
docker inspect "kilntainer-${COMPUTER}" >/dev/null 2>&1 || fail "no sandbox container on the host engine"

echo "== DELETE removes the session's temporary computer"
curl -sS -o /dev/null -X DELETE "$URL/mcp" -H "Mcp-Session-Id: $SESSION" -H 'MCP-Protocol-Version: 2025-06-18'
gone=""
for _ in $(seq 1 50); do
  if ! docker inspect "kilntainer-${COMPUTER}" >/dev/null 2>&1; then
    gone=1
    break
  fi
  sleep 0.2
done
[ -n "$gone" ] || fail "the temporary container survived DELETE"

echo "== HEALTHCHECK"
health=""
for _ in $(seq 1 50); do
  health="$(docker inspect --format '{{.State.Health.Status}}' "$NAME")"
  [ "$health" = healthy ] && break
  sleep 1
done
[ "$health" = healthy ] || fail "container health is '$health'"
echo "health: $health"

echo "== docker stop"
docker stop -t 30 "$NAME" >/dev/null
code="$(docker inspect --format '{{.State.ExitCode}}' "$NAME")"
[ "$code" = 0 ] || fail "exit code $code after SIGTERM"
echo "docker-image-test: OK"
