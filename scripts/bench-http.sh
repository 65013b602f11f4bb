#!/usr/bin/env bash
# HTTP transport benchmark: 200 concurrent Streamable HTTP sessions with the official Python
# MCP client, each creating its temporary computer and running 5 commands; half close with
# DELETE, half are abandoned and must be reaped by --session-timeout (bench/http_sessions.py).
# A measurement, not a test; idempotent.
#
#   scripts/bench-http.sh [harness options]    e.g. --sessions 20 --no-doc (python -m bench.http_sessions --help)
#
# Steps:
#   1. Docker, the sandbox-busybox:full image and .test-env/venv (mcp==1.30.0):
#      scripts/setup-test-env.sh when any is missing (SKIP_PODMAN=1 SKIP_RUNSC=1 unless set)
#   2. the release build: `cargo build --release --locked -p mcp-sandbox-computer-vm-for-ai
#      --no-default-features` (the Docker backend alone, the same binary scripts/bench.sh
#      measures), unless SKIP_BUILD=1 or KILNTAINERS_BIN names a binary
#   3. bench/http_sessions.py: figures on stdout, bench/results/http-<date>.json, and the
#      "HTTP: 200 sessions" section of docs/benchmarks.md
#
# Exit status: the harness's (1 if a container is left after the idle timeout, a call failed,
# or the server did not stop cleanly).
set -euo pipefail

# shellcheck disable=SC2034 # read by lib.sh
LOG_PREFIX="[bench-http]"
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)"
# shellcheck source=scripts/lib.sh
source "$SCRIPT_DIR/lib.sh"
cd "$REPO_ROOT"

VENV_PY="$TEST_ENV_DIR/venv/bin/python"
MCP_VERSION="1.30.0"

venv_ok() {
    [[ -x "$VENV_PY" ]] &&
        [[ "$("$VENV_PY" -c 'from importlib.metadata import version; print(version("mcp"))' 2>/dev/null)" == "$MCP_VERSION" ]]
}

# 1. Engine, image, client venv.
if ! docker info >/dev/null 2>&1 || ! docker image inspect sandbox-busybox:full >/dev/null 2>&1 || ! venv_ok; then
    log "Docker, sandbox-busybox:full or the test venv missing: running scripts/setup-test-env.sh"
    SKIP_PODMAN="${SKIP_PODMAN:-1}" SKIP_RUNSC="${SKIP_RUNSC:-1}" bash "$SCRIPT_DIR/setup-test-env.sh"
fi
venv_ok || die "$VENV_PY does not have mcp==$MCP_VERSION"

# 2. The release binary.
BUILD_ARGS=()
if [[ -n "${KILNTAINERS_BIN:-}" ]]; then
    BIN="$KILNTAINERS_BIN"
else
    BIN="$REPO_ROOT/target/release/mcp-sandbox-computer-vm-for-ai"
    BUILD_ARGS=(--build "cargo build --release --locked -p mcp-sandbox-computer-vm-for-ai --no-default-features")
    if [[ "${SKIP_BUILD:-0}" != 1 ]]; then
        t0="$(now)"
        cargo build --release --locked -p mcp-sandbox-computer-vm-for-ai --no-default-features --quiet || die "cargo build --release failed"
        log "cargo build --release $(elapsed "$t0")"
    fi
fi
[[ -x "$BIN" ]] || die "$BIN is not an executable"

# 3. The harness (it stops its server and removes what it left, whatever happens).
log "load average: $(cut -d' ' -f1-3 /proc/loadavg), $(nproc) cores"
cd "$REPO_ROOT"  # where the bench and testkit packages live
exec "$VENV_PY" -m bench.http_sessions --bin "$BIN" "${BUILD_ARGS[@]}" "$@"
