#!/usr/bin/env bash
# The whole test suite, from a fresh Debian 12 machine or an already prepared one:
# installs and starts what the tests need (idempotent), checks formatting and lints, builds,
# then runs the Rust tests, the black-box MCP tests against a real Docker engine, the MCP
# conformance suite, the browser tests and the fault suite (last: it restarts the Docker daemon
# this script's setup started, and rewrites docs/reliability.md from its figures).
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n== %s ==\n' "$*"; }

step "test environment"
bash scripts/setup-test-env.sh
# shellcheck disable=SC1091
source .test-env/env

step "format and lints"
cargo fmt --all -- --check
cargo clippy --all-targets --all-features --locked -- -D warnings

step "build"
cargo build --all-features --locked

step "rust tests"
cargo test --all-features --locked

step "black-box MCP tests"
export KILNTAINERS_BIN="$PWD/target/debug/mcp-sandbox-computer-vm-for-ai"
"$KILNTAINERS_TEST_VENV/bin/python" -m pytest tests/blackbox -q -p no:cacheprovider

step "black-box core tests again, with the exec helper off (one Docker exec per command)"
KILNTAINERS_EXEC_HELPER=off "$KILNTAINERS_TEST_VENV/bin/python" -m pytest -q -p no:cacheprovider \
    tests/blackbox/test_cli.py tests/blackbox/test_surface.py tests/blackbox/test_exec.py \
    tests/blackbox/test_limits.py tests/blackbox/test_lifecycle_docker.py \
    tests/blackbox/test_crash_gc.py

step "MCP conformance suite (server scenarios over Streamable HTTP)"
bash scripts/conformance-test.sh

step "dashboard in headless Chromium and the MCP Inspector CLI"
bash scripts/browser-test.sh

step "fault suite (restarts dockerd; figures into docs/reliability.md)"
bash scripts/fault-test.sh
