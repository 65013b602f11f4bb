#!/usr/bin/env bash
# Dashboard and MCP Inspector tests (tests/browser): installs what they need, then runs them.
# Idempotent; works from a fresh clone on a fresh Debian 12 machine and when run again.
#
#   scripts/browser-test.sh            install what is missing, build, run all browser tests
#   scripts/browser-test.sh FILE...    run only these test files (relative to tests/browser)
#
# Steps:
#   1. apt: chromium (+ fonts-liberation, fonts-dejavu-core for stable screenshots) if missing
#   2. node >= 20 and npm must be present (Debian 12's own nodejs is 18: not enough)
#   3. `npm ci` in tests/browser and in tests/oauth (the OAuth test issuer), each skipped while
#      its package-lock.json is unchanged since the last one (npm_ci in scripts/lib.sh)
#   4. Docker and the sandbox-busybox:full image: scripts/setup-test-env.sh when either is
#      missing (with SKIP_PODMAN=1 SKIP_RUNSC=1 unless set otherwise)
#   5. the server: $KILNTAINERS_BIN if set, else `cargo build --locked` (the dashboard HTML is
#      compiled into the binary, so a stale binary would test a stale page)
#   6. node --test: dashboard.test.mjs (app mode via the ext-apps AppBridge), web.test.mjs
#      (GET / over HTTP), oauth.test.mjs (the web dashboard's OAuth sign-in against
#      tests/oauth/issuer.mjs), inspector.test.mjs (MCP Inspector CLI 0.15.0), resume.test.mjs
#      (the TypeScript SDKs' reconnect after a cut connection), ports.test.mjs (a computer's
#      page against the port proxy without authentication)
#
# Screenshots land in tests/browser/output/. Exit status is the test runner's.
set -euo pipefail

# shellcheck disable=SC2034 # read by lib.sh
LOG_PREFIX="[browser-test]"
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)"
# shellcheck source=scripts/lib.sh
source "$SCRIPT_DIR/lib.sh"
cd "$REPO_ROOT"

BROWSER_DIR="$REPO_ROOT/tests/browser"
TEST_FILES=("$@")
if ((${#TEST_FILES[@]} == 0)); then
    TEST_FILES=(dashboard.test.mjs web.test.mjs oauth.test.mjs inspector.test.mjs resume.test.mjs ports.test.mjs)
fi

# 1. Chromium from Debian (Playwright's own browser download cannot work here).
t0="$(now)"
apt_ensure chromium fonts-liberation fonts-dejavu-core || die "could not install chromium"
[[ -x /usr/bin/chromium ]] || die "/usr/bin/chromium is missing after installing chromium"
log "chromium         $(elapsed "$t0")  $(/usr/bin/chromium --version 2>/dev/null | head -n 1)"

# 2 and 3. Node.js, and the npm packages pinned by each package-lock.json.
npm_ci "$BROWSER_DIR"
npm_ci "$REPO_ROOT/tests/oauth"

# 4. Docker engine and the test image.
if ! docker info >/dev/null 2>&1 || ! docker image inspect sandbox-busybox:full >/dev/null 2>&1; then
    log "Docker or sandbox-busybox:full missing: running scripts/setup-test-env.sh"
    SKIP_PODMAN="${SKIP_PODMAN:-1}" SKIP_RUNSC="${SKIP_RUNSC:-1}" bash "$SCRIPT_DIR/setup-test-env.sh"
fi
docker image inspect sandbox-busybox:full >/dev/null 2>&1 || die "image sandbox-busybox:full is missing"

# 5. The server binary.
if [[ -n "${KILNTAINERS_BIN:-}" ]]; then
    [[ -x "$KILNTAINERS_BIN" ]] || die "KILNTAINERS_BIN=$KILNTAINERS_BIN is not an executable"
else
    t0="$(now)"
    cargo build --locked --quiet || die "cargo build failed"
    export KILNTAINERS_BIN="$REPO_ROOT/target/debug/mcp-sandbox-computer-vm-for-ai"
    log "cargo build      $(elapsed "$t0")"
fi

# 6. The tests.
log "running ${TEST_FILES[*]} against $KILNTAINERS_BIN"
cd "$BROWSER_DIR"
exec node --test --test-concurrency=1 --test-reporter=spec "${TEST_FILES[@]}"
