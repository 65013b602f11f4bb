#!/usr/bin/env bash
# The whole test suite, from a fresh Debian 12 machine or an already prepared one:
# installs and starts what the tests need (idempotent), checks formatting and lints (Rust,
# every cargo feature on its own, shell scripts, Python tests), builds, then runs the Rust
# tests, the black-box MCP tests against a real Docker engine with both generations of the
# official Python MCP client, the install paths (tests/install: the PyPI wheel, serve.sh as a
# normal user), the MCP conformance suite, the browser tests and the fault suite
# (last: it restarts the Docker daemon this script's setup started; its figures go to the
# ignored tests/faults/results/, never into docs/reliability.md).
#
# This is the full run: every integration environment must be there. A test that would skip
# for want of one (Podman, gVisor, a venv) fails instead (KILNTAINERS_REQUIRE_ALL=1).
#
# Each step prints its wall time, and a summary of all of them closes the run; a cold run on
# 2 cores is meant to stay under an hour (docs/testing.md, "Time budget").
set -euo pipefail
cd "$(dirname "$0")/.."

STEP_NAMES=()
STEP_SECONDS=()
STEP_NAME=""
STEP_START=0
RUN_START=$SECONDS

finish_step() {
    if [[ -n "$STEP_NAME" ]]; then
        local took=$((SECONDS - STEP_START))
        STEP_NAMES+=("$STEP_NAME")
        STEP_SECONDS+=("$took")
        printf -- '-- %s: %dm%02ds\n' "$STEP_NAME" $((took / 60)) $((took % 60))
    fi
    STEP_NAME=""
}

step() {
    finish_step
    STEP_NAME="$*"
    STEP_START=$SECONDS
    printf '\n== %s ==\n' "$*"
}

summary() {
    local status=$?
    finish_step
    printf '\n== step times ==\n'
    local i
    for i in "${!STEP_NAMES[@]}"; do
        printf '%5dm%02ds  %s\n' $((STEP_SECONDS[i] / 60)) $((STEP_SECONDS[i] % 60)) "${STEP_NAMES[i]}"
    done
    local total=$((SECONDS - RUN_START))
    printf '%5dm%02ds  total (%s)\n' $((total / 60)) $((total % 60)) "$([[ $status == 0 ]] && echo passed || echo "FAILED, exit $status")"
}
trap summary EXIT

step "test environment"
bash scripts/setup-test-env.sh
# shellcheck disable=SC1091
source .test-env/env
export KILNTAINERS_REQUIRE_ALL=1

step "format and lints"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --all-features --locked -- -D warnings
# Each optional feature on its own and none at all: what a user's `--features` choice builds
# must build without warnings too (the library and binaries; the tests need every feature).
for features in "" fly e2b modal wasm kubernetes oauth; do
    printf -- '-- clippy --no-default-features --features "%s"\n' "$features"
    cargo clippy -p mcp-sandbox-computer-vm-for-ai --no-default-features --features "$features" --locked -- -D warnings
done
shellcheck --severity=style scripts/*.sh .ci/run
"$KILNTAINERS_TEST_VENV/bin/ruff" check --quiet tests bench testkit fakes

step "build"
# Binaries (the server, the `fake-modal` test fake) and every test target in one invocation:
# one feature set (dev-dependencies add tokio's test clock), so the dependencies compile once
# and the tests below reuse all of it.
cargo build --workspace --all-targets --all-features --locked

step "rust tests"
cargo test --workspace --all-features --locked

export KILNTAINERS_BIN="$PWD/target/debug/mcp-sandbox-computer-vm-for-ai"

step "black-box MCP tests (Python MCP client 1.x)"
"$KILNTAINERS_TEST_VENV/bin/python" -m pytest tests/blackbox -q -p no:cacheprovider

step "black-box MCP tests (Python MCP client 2.x; what does not depend on the client ran once, above)"
"$KILNTAINERS_TEST_VENV_MCP2/bin/python" -m pytest tests/blackbox -q -p no:cacheprovider -m "not client_independent"

step "black-box core tests again, with the exec helper off (one Docker exec per command)"
KILNTAINERS_EXEC_HELPER=off "$KILNTAINERS_TEST_VENV/bin/python" -m pytest -q -p no:cacheprovider \
    tests/blackbox/test_cli.py tests/blackbox/test_surface.py tests/blackbox/test_exec.py \
    tests/blackbox/test_limits.py tests/blackbox/test_lifecycle_docker.py \
    tests/blackbox/test_crash_gc.py tests/blackbox/test_jobs.py tests/blackbox/test_files.py \
    tests/blackbox/test_ports.py tests/blackbox/test_warm_pool.py \
    tests/blackbox/test_checkpoints.py tests/blackbox/test_tasks.py

step "install paths: the PyPI wheel (built, audited, installed without Rust) and serve.sh as a normal user"
# The install tests check the packaging and the install paths, not the binary's speed: the
# wheel is built with the `wheel-test` profile (release without optimisation), quicker cold.
wheel="$(KILNTAINERS_WHEEL_PROFILE=wheel-test bash scripts/build-wheel.sh)"
KILNTAINERS_WHEEL="$wheel" "$KILNTAINERS_TEST_VENV/bin/python" -m pytest tests/install -q -p no:cacheprovider

step "MCP conformance suite (server scenarios over Streamable HTTP)"
bash scripts/conformance-test.sh

step "dashboard in headless Chromium and the MCP Inspector CLI"
bash scripts/browser-test.sh

step "fault suite (restarts dockerd; figures into tests/faults/results/)"
bash scripts/fault-test.sh
