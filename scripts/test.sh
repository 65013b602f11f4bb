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
# Each step prints its wall time and how many tests it ran, and a summary of all of them closes
# the run (docs/testing.md, "Time budget"). Compiles go through the machine's compiler cache
# (scripts/setup-test-env.sh). Environment: KILNTAINERS_TEST_WORKERS, the black-box tests'
# workers (default 4).
set -euo pipefail
cd "$(dirname "$0")/.."

RESULTS=.test-env/results
WORKERS="${KILNTAINERS_TEST_WORKERS:-4}"
STEP_NAMES=()
STEP_SECONDS=()
STEP_COUNTS=()
STEP_NAME=""
STEP_COUNT=""
STEP_START=0
RUN_START=$SECONDS

finish_step() {
    if [[ -n "$STEP_NAME" ]]; then
        local took=$((SECONDS - STEP_START))
        STEP_NAMES+=("$STEP_NAME")
        STEP_SECONDS+=("$took")
        STEP_COUNTS+=("$STEP_COUNT")
        printf -- '-- %s: %dm%02ds%s\n' "$STEP_NAME" $((took / 60)) $((took % 60)) "${STEP_COUNT:+, $STEP_COUNT}"
    fi
    STEP_NAME=""
    STEP_COUNT=""
}

step() {
    finish_step
    STEP_NAME="$*"
    STEP_START=$SECONDS
    printf '\n== %s ==\n' "$*"
}

# counted WHAT: adds to the current step's count of tests ("498 tests; 2 ignored").
counted() {
    STEP_COUNT="${STEP_COUNT:+$STEP_COUNT + }$*"
}

summary() {
    local status=$?
    finish_step
    stop_beside
    printf '\n== step times ==\n'
    local i
    for i in "${!STEP_NAMES[@]}"; do
        printf '%5dm%02ds  %-28s %s\n' $((STEP_SECONDS[i] / 60)) $((STEP_SECONDS[i] % 60)) \
            "${STEP_COUNTS[i]:--}" "${STEP_NAMES[i]}"
    done
    local total=$((SECONDS - RUN_START))
    printf '%5dm%02ds  total (%s)\n' $((total / 60)) $((total % 60)) "$([[ $status == 0 ]] && echo passed || echo "FAILED, exit $status")"
}
trap summary EXIT

# The steps that only compile (the lints of each feature set, the wheel) run beside the tests,
# in the background at low priority: the tests mostly wait on the engine, and the compiles take
# the processor time they leave. Their output goes to .test-env/results/beside.log, their times
# to beside.times; join_beside waits for them and adds their lines to the summary.
BESIDE_PID=""
start_beside() {
    set -m # a process group of its own, so that stop_beside stops the compilers too
    (
        renice -n 15 -p "$BASHPID" >/dev/null
        beside
    ) >"$RESULTS/beside.log" 2>&1 &
    BESIDE_PID=$!
    set +m
}
stop_beside() {
    if [[ -n "$BESIDE_PID" ]]; then
        kill -TERM -- "-$BESIDE_PID" 2>/dev/null || true
        wait "$BESIDE_PID" 2>/dev/null || true
        BESIDE_PID=""
    fi
}
join_beside() {
    local rc=0 name took
    wait "$BESIDE_PID" || rc=$?
    BESIDE_PID=""
    while IFS=$'\t' read -r took name; do
        STEP_NAMES+=("$name (beside the tests)")
        STEP_SECONDS+=("$took")
        STEP_COUNTS+=("")
    done <"$RESULTS/beside.times"
    if ((rc != 0)); then
        printf -- '-- a step beside the tests failed; its output (.test-env/results/beside.log) ends:\n'
        tail -n 60 "$RESULTS/beside.log"
        return "$rc"
    fi
}
# beside_step NAME: times what follows in the background lane (a line of beside.times each).
BESIDE_STEP="" BESIDE_START=0
beside_step() {
    if [[ -n "$BESIDE_STEP" ]]; then
        printf '%s\t%s\n' $((SECONDS - BESIDE_START)) "$BESIDE_STEP" >>"$RESULTS/beside.times"
    fi
    BESIDE_STEP="$*" BESIDE_START=$SECONDS
    if [[ -n "$BESIDE_STEP" ]]; then printf '\n== %s ==\n' "$BESIDE_STEP"; fi
}
beside() {
    set -euo pipefail
    : >"$RESULTS/beside.times"
    beside_step "clippy, each optional feature on its own and none"
    # What a user's `--features` choice builds must build without warnings too (the library
    # and binaries; the tests need every feature). In a target directory of its own, so as not
    # to wait on the build's lock; the helper and the broker it embeds are only data to a
    # lint, so an empty file stands in for each instead of building them again.
    : >"$RESULTS/empty-binary"
    local features
    for features in "" fly e2b modal wasm kubernetes oauth; do
        printf -- '-- clippy --no-default-features --features "%s"\n' "$features"
        CARGO_TARGET_DIR=target/feature-lints KILNTAINERS_HELPER_BINARY="$PWD/$RESULTS/empty-binary" \
            KILNTAINERS_BROKER_BINARY="$PWD/$RESULTS/empty-binary" \
            cargo clippy -p mcp-sandbox-computer-vm-for-ai --no-default-features --features "$features" --locked -- -D warnings
    done
    beside_step "the wheel for the install tests"
    # The install tests check the packaging and the install paths, not the binary's speed: the
    # wheel is built with the `wheel-test` profile (release without optimisation), quicker cold.
    KILNTAINERS_WHEEL_PROFILE=wheel-test bash scripts/build-wheel.sh >"$RESULTS/wheel.path"
    beside_step ""
}

# junit_count FILE: "N tests" (and ", M skipped") from a JUnit report, or nothing without one.
junit_count() {
    [[ -f "$1" ]] || return 0
    python3 - "$1" <<'PY'
import sys
import xml.etree.ElementTree as ET
cases = list(ET.parse(sys.argv[1]).getroot().iter("testcase"))
skipped = sum(1 for c in cases if c.find("skipped") is not None)
print(f"{len(cases) - skipped} tests" + (f", {skipped} skipped" if skipped else ""))
PY
}

# pytest_run NAME PYTHON ARGS...: pytest with a JUnit report under .test-env/results, whose
# count goes to the step's; the exit status is pytest's.
pytest_run() {
    local name="$1" python="$2" rc=0
    shift 2
    local report="$RESULTS/$name.xml"
    rm -f "$report"
    "$python" -m pytest -q -p no:cacheprovider --junitxml="$report" "$@" || rc=$?
    counted "$(junit_count "$report")"
    return "$rc"
}

# pytest_workers: the options that spread a black-box run over the workers (pytest-xdist):
# tests one at a time, each to the next free worker, except that a group marked
# `xdist_group` runs on one worker, one test after another (tests/blackbox/conftest.py).
pytest_workers() {
    printf '%s\n' -n "$WORKERS" --dist loadgroup
}

# cargo_test ARGS...: cargo test, with the sum of its binaries' results as the step's count.
cargo_test() {
    local log="$RESULTS/cargo-test.log" rc=0
    cargo test "$@" 2>&1 | tee "$log" || rc=$?
    counted "$(awk '/^test result:/ { p += $4; f += $6; i += $8 } END { printf "%d tests, %d ignored", p + f, i }' "$log")"
    return "$rc"
}

step "test environment"
bash scripts/setup-test-env.sh
# shellcheck disable=SC1091
source .test-env/env
export KILNTAINERS_REQUIRE_ALL=1
mkdir -p "$RESULTS"

step "format and lints (rustfmt, shellcheck, ruff)"
cargo fmt --all -- --check
shellcheck --severity=style scripts/*.sh .ci/run
"$KILNTAINERS_TEST_VENV/bin/ruff" check --quiet tests bench testkit fakes

start_beside

step "build and clippy: every binary and test target with every feature, linted as it compiles"
# One compile does both: clippy-driver, as `cargo clippy` runs it, compiles each crate of the
# workspace and lints it on the way (its arguments are `cargo clippy -- -D warnings`'s), and
# the dependencies compile once, for the build. Binaries (the server, the `fake-modal` test
# fake) and every test target in one invocation: one feature set (dev-dependencies add
# tokio's test clock), so the tests below reuse all of it.
export RUSTC_WORKSPACE_WRAPPER=clippy-driver CLIPPY_ARGS="-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__"
cargo build --workspace --all-targets --all-features --locked

step "rust tests"
cargo_test --workspace --all-features --locked
unset RUSTC_WORKSPACE_WRAPPER CLIPPY_ARGS

export KILNTAINERS_BIN="$PWD/target/debug/mcp-sandbox-computer-vm-for-ai"
mapfile -t workers < <(pytest_workers)

step "black-box MCP tests (Python MCP client 1.x)"
pytest_run blackbox-mcp1 "$KILNTAINERS_TEST_VENV/bin/python" "${workers[@]}" tests/blackbox

step "black-box MCP tests (Python MCP client 2.x; what does not depend on the client ran once, above)"
pytest_run blackbox-mcp2 "$KILNTAINERS_TEST_VENV_MCP2/bin/python" "${workers[@]}" tests/blackbox -m "not client_independent"

step "black-box core tests again, with the exec helper off (one Docker exec per command)"
KILNTAINERS_EXEC_HELPER=off pytest_run blackbox-helper-off "$KILNTAINERS_TEST_VENV/bin/python" "${workers[@]}" \
    tests/blackbox/test_cli.py tests/blackbox/test_surface.py tests/blackbox/test_exec.py \
    tests/blackbox/test_limits.py tests/blackbox/test_lifecycle_docker.py \
    tests/blackbox/test_crash_gc.py tests/blackbox/test_jobs.py tests/blackbox/test_files.py \
    tests/blackbox/test_ports.py tests/blackbox/test_warm_pool.py \
    tests/blackbox/test_checkpoints.py tests/blackbox/test_tasks.py

step "waiting for the lints and the wheel beside the tests"
join_beside

step "install paths: the PyPI wheel (built, audited, installed without Rust) and serve.sh as a normal user"
KILNTAINERS_WHEEL="$(cat "$RESULTS/wheel.path")" pytest_run install "$KILNTAINERS_TEST_VENV/bin/python" tests/install

step "MCP conformance suite (server scenarios over Streamable HTTP)"
bash scripts/conformance-test.sh 2>&1 | tee "$RESULTS/conformance.log"
counted "$(sed -n 's/^\[conformance\] passed: \([0-9]*\).*/\1 scenarios/p' "$RESULTS/conformance.log")"

step "dashboard in headless Chromium and the MCP Inspector CLI"
bash scripts/browser-test.sh 2>&1 | tee "$RESULTS/browser.log"
counted "$(sed -n 's/^ℹ tests \([0-9]*\)$/\1 tests/p' "$RESULTS/browser.log")"

step "fault suite (restarts dockerd; figures into tests/faults/results/)"
rc=0
PYTEST_ADDOPTS="--junitxml=$RESULTS/faults.xml" bash scripts/fault-test.sh || rc=$?
counted "$(junit_count "$RESULTS/faults.xml")"
[[ "$rc" == 0 ]] || exit "$rc"
