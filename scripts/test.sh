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
# Some steps run beside others, in lanes of their own (docs/testing.md, "Time budget"): the
# compiles that only lint or package (at low priority) beside the tests, the Rust tests beside
# the first black-box run, the black-box run with the exec helper off beside the second. Each
# step prints its wall time and how many tests it ran, and a summary of all of them closes the
# run. Compiles go through the machine's compiler cache (scripts/setup-test-env.sh).
# Environment: KILNTAINERS_TEST_WORKERS, the workers of a black-box run (default 4).
set -euo pipefail
cd "$(dirname "$0")/.."

RESULTS="$PWD/.test-env/results"
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

# counted WHAT: adds to the current step's count of tests ("498 tests").
counted() {
    STEP_COUNT="${STEP_COUNT:+$STEP_COUNT + }$*"
}

summary() {
    local status=$?
    finish_step
    stop_lanes
    printf '\n== step times ==\n'
    local i
    for i in "${!STEP_NAMES[@]}"; do
        printf '%5dm%02ds  %-24s %s\n' $((STEP_SECONDS[i] / 60)) $((STEP_SECONDS[i] % 60)) \
            "${STEP_COUNTS[i]:--}" "${STEP_NAMES[i]}"
    done
    local total=$((SECONDS - RUN_START))
    printf '%5dm%02ds  total (%s)\n' $((total / 60)) $((total % 60)) "$([[ $status == 0 ]] && echo passed || echo "FAILED, exit $status")"
}
trap summary EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ---------------------------------------------------------------------------------------------
# Lanes: a function run in the background, in a process group of its own (so that stopping
# it stops what it started), its output in .test-env/results/<lane>.log and the times and
# counts of its steps in <lane>.steps; lane_join waits for it and adds its steps to the
# summary, marked with the step they ran beside.

declare -A LANE_PIDS=() LANE_BESIDE=()

# lane_start LANE NICENESS BESIDE FUNCTION: runs FUNCTION as lane LANE; BESIDE says what it
# runs beside, for the summary.
lane_start() {
    local lane="$1" niceness="$2" beside="$3" function="$4"
    : >"$RESULTS/$lane.steps"
    set -m
    (
        renice -n "$niceness" -p "$BASHPID" >/dev/null
        LANE="$lane"
        "$function"
        lane_step ""
    ) >"$RESULTS/$lane.log" 2>&1 &
    LANE_PIDS[$lane]=$!
    LANE_BESIDE[$lane]="$beside"
    set +m
    printf -- '-- beside: lane %s started (its output: %s)\n' "$lane" "$RESULTS/$lane.log"
}

# In a lane: lane_step NAME starts timing a step (an empty NAME ends the last one);
# lane_count WHAT is the step's count of tests.
LANE="" LANE_STEP="" LANE_STEP_START=0 LANE_COUNT=""
lane_step() {
    if [[ -n "$LANE_STEP" ]]; then
        printf '%s|%s|%s\n' $((SECONDS - LANE_STEP_START)) "$LANE_COUNT" "$LANE_STEP" >>"$RESULTS/$LANE.steps"
    fi
    LANE_STEP="$*" LANE_STEP_START=$SECONDS LANE_COUNT=""
    if [[ -n "$LANE_STEP" ]]; then printf '\n== %s ==\n' "$LANE_STEP"; fi
}
lane_count() {
    LANE_COUNT="${LANE_COUNT:+$LANE_COUNT + }$*"
}

lane_join() {
    local lane="$1" rc=0 took count name
    [[ -n "${LANE_PIDS[$lane]:-}" ]] || return 0
    wait "${LANE_PIDS[$lane]}" || rc=$?
    unset "LANE_PIDS[$lane]"
    while IFS='|' read -r took count name; do
        STEP_NAMES+=("$name (beside ${LANE_BESIDE[$lane]})")
        STEP_SECONDS+=("$took")
        STEP_COUNTS+=("$count")
        printf -- '-- %s: %dm%02ds%s (beside %s)\n' "$name" $((took / 60)) $((took % 60)) "${count:+, $count}" \
            "${LANE_BESIDE[$lane]}"
    done <"$RESULTS/$lane.steps"
    if ((rc != 0)); then
        printf -- '-- lane %s failed (exit %s); its output (%s) ends:\n' "$lane" "$rc" "$RESULTS/$lane.log"
        tail -n 80 "$RESULTS/$lane.log"
        return "$rc"
    fi
}

# Stops the lanes still running (the run failed or was interrupted) as Ctrl-C would: pytest
# then runs its teardowns, so the computers and networks its tests made go too (a test's
# permanent computer left on the engine would stand in a later run's way). A lane still
# there after a minute is killed.
stop_lanes() {
    local lane pid tenths
    for lane in "${!LANE_PIDS[@]}"; do
        pid="${LANE_PIDS[$lane]}"
        kill -INT -- "-$pid" 2>/dev/null || true
        for ((tenths = 0; tenths < 600; tenths++)); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL -- "-$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    LANE_PIDS=()
}

# ---------------------------------------------------------------------------------------------
# Counting tests

# junit_count FILE: "N tests" (and ", M skipped") from a JUnit report, or nothing without one.
junit_count() {
    [[ -f "$1" ]] || return 0
    python3 - "$1" <<'PY'
import sys
import xml.etree.ElementTree as ET
cases = list(ET.parse(sys.argv[1]).getroot().iter("testcase"))
skipped = sum(1 for c in cases if c.find("skipped") is not None)
failed = sum(1 for c in cases if c.find("failure") is not None or c.find("error") is not None)
print(f"{len(cases) - skipped} tests" + (f", {failed} failed" if failed else "") + (f", {skipped} skipped" if skipped else ""))
PY
}

# pytest_run NAME PYTHON ARGS...: pytest with a JUnit report under .test-env/results; prints
# its count of tests last. The exit status is pytest's.
pytest_run() {
    local name="$1" python="$2" rc=0
    shift 2
    local report="$RESULTS/$name.xml"
    rm -f "$report"
    "$python" -m pytest -q -p no:cacheprovider --junitxml="$report" "$@" || rc=$?
    junit_count "$report" >"$RESULTS/$name.count"
    return "$rc"
}

# pytest_step NAME PYTHON ARGS...: pytest_run as a step of the main run, counted in the step
# whether it passes or not.
pytest_step() {
    local rc=0
    pytest_run "$@" || rc=$?
    counted "$(cat "$RESULTS/$1.count")"
    return "$rc"
}

# The options that spread a black-box run over WORKERS processes (pytest-xdist): each test to
# the next free worker, except that a group marked `xdist_group` runs on one worker, one test
# after another (tests/blackbox/conftest.py, docs/testing.md "Parallel black-box tests").
workers() {
    printf '%s\n' -n "$1" --dist loadgroup
}

# ---------------------------------------------------------------------------------------------
# The lanes' work

# Compiles that only lint or package, at low priority beside the tests: they take the
# processor time the tests leave while they wait on the engine.
compile_lane() {
    set -euo pipefail
    cd "$BUILD"
    unset RUSTC_WORKSPACE_WRAPPER CLIPPY_ARGS
    lane_step "clippy, each optional feature on its own and none"
    # What a user's `--features` choice builds must build without warnings too (the library
    # and binaries; the tests need every feature). In a target directory of its own, so as not
    # to wait on the build's lock; the helper and the broker it embeds are only data to a
    # lint, so an empty file stands in for each instead of building them again.
    : >"$RESULTS/empty-binary"
    local features
    for features in "" fly e2b modal wasm kubernetes oauth; do
        printf -- '-- clippy --no-default-features --features "%s"\n' "$features"
        CARGO_TARGET_DIR=target/feature-lints KILNTAINERS_HELPER_BINARY="$RESULTS/empty-binary" \
            KILNTAINERS_BROKER_BINARY="$RESULTS/empty-binary" \
            cargo clippy -p mcp-sandbox-computer-vm-for-ai --no-default-features --features "$features" --locked -- -D warnings
    done
    lane_count "7 feature sets"
    lane_step "the wheel for the install tests"
    # The install tests check the packaging and the install paths, not the binary's speed: the
    # wheel is built with the `wheel-test` profile (release without optimisation), quicker cold.
    KILNTAINERS_WHEEL_PROFILE=wheel-test bash scripts/build-wheel.sh >"$RESULTS/wheel.path"
}

# The Rust tests (unit, contract suite, provider suites): the sum of their binaries' results.
rust_lane() {
    set -euo pipefail
    cd "$BUILD"
    lane_step "rust tests"
    local rc=0
    cargo test --workspace --all-features --locked || rc=$?
    lane_count "$(awk '/^test result:/ { p += $4; f += $6; i += $8 } END { printf "%d tests, %d ignored", p + f, i }' \
        "$RESULTS/rust.log")"
    return "$rc"
}

# The core black-box files again with the exec helper off (one Docker exec per command); none
# of them is in an xdist group, so they run beside another black-box run.
helper_off_lane() {
    set -euo pipefail
    lane_step "black-box core tests again, with the exec helper off (one Docker exec per command)"
    local rc=0
    # shellcheck disable=SC2046 # the options are words
    KILNTAINERS_EXEC_HELPER=off pytest_run blackbox-helper-off "$KILNTAINERS_TEST_VENV/bin/python" \
        $(workers 2) \
        tests/blackbox/test_cli.py tests/blackbox/test_surface.py tests/blackbox/test_exec.py \
        tests/blackbox/test_limits.py tests/blackbox/test_lifecycle_docker.py \
        tests/blackbox/test_crash_gc.py tests/blackbox/test_jobs.py tests/blackbox/test_files.py \
        tests/blackbox/test_ports.py tests/blackbox/test_warm_pool.py \
        tests/blackbox/test_checkpoints.py tests/blackbox/test_tasks.py || rc=$?
    lane_count "$(cat "$RESULTS/blackbox-helper-off.count")"
    return "$rc"
}

# ---------------------------------------------------------------------------------------------
# The run

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

step "build and clippy: every binary and test target with every feature, linted as it compiles"
# Where cargo builds: a mirror of this checkout at a fixed path outside it (BUILD), whose target
# directory stays from run to run and from clone to clone, so that a fresh clone rebuilds only
# what differs from the last build on this machine (docs/testing.md, "Time budget"). One run
# at a time uses it; a second meanwhile builds in its own checkout.
BUILD="${KILNTAINERS_BUILD_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kilntainers/build}"
mkdir -p "$BUILD"
exec 8>"$BUILD.lock"
if flock -n 8; then
    python3 scripts/mirror-checkout.py "$BUILD"
else
    printf -- '-- %s is in use by another run: building in this checkout\n' "$BUILD"
    exec 8>&-
    BUILD="$PWD"
fi
# One compile does both: clippy-driver, as `cargo clippy` runs it, compiles each crate of the
# workspace and lints it on the way (its arguments are `cargo clippy -- -D warnings`'s), and
# the dependencies compile once, for the build. Binaries (the server, the `fake-modal` test
# fake) and every test target in one invocation: one feature set (dev-dependencies add
# tokio's test clock), so the tests below reuse all of it. The Rust tests keep the wrapper:
# cargo counts it in what is up to date.
export RUSTC_WORKSPACE_WRAPPER=clippy-driver CLIPPY_ARGS="-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__"
(cd "$BUILD" && cargo build --workspace --all-targets --all-features --locked)

export KILNTAINERS_BIN="$BUILD/target/debug/mcp-sandbox-computer-vm-for-ai"
lane_start compile 15 "the tests" compile_lane
lane_start rust 0 "the first black-box run" rust_lane
unset RUSTC_WORKSPACE_WRAPPER CLIPPY_ARGS

step "black-box MCP tests (Python MCP client 1.x)"
# shellcheck disable=SC2046 # the options are words
pytest_step blackbox-mcp1 "$KILNTAINERS_TEST_VENV/bin/python" $(workers "$WORKERS") tests/blackbox

step "waiting for the Rust tests"
lane_join rust

lane_start helper-off 0 "the second black-box run" helper_off_lane
step "black-box MCP tests (Python MCP client 2.x; what does not depend on the client ran once, above)"
# shellcheck disable=SC2046
pytest_step blackbox-mcp2 "$KILNTAINERS_TEST_VENV_MCP2/bin/python" $(workers "$WORKERS") tests/blackbox \
    -m "not client_independent"

step "waiting for the black-box run with the exec helper off"
lane_join helper-off

step "waiting for the compiles beside the tests (feature lints, the wheel)"
lane_join compile
exec 8>&- # the build directory is free for another run

step "install paths: the PyPI wheel (built, audited, installed without Rust) and serve.sh as a normal user"
KILNTAINERS_WHEEL="$(cat "$RESULTS/wheel.path")" pytest_step install "$KILNTAINERS_TEST_VENV/bin/python" tests/install

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
