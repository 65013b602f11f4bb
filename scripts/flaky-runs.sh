#!/usr/bin/env bash
# The parallel part of scripts/test.sh, RUNS times in a row (default 5) on a loaded machine:
# black-box 1.x with the Rust tests beside it, then black-box 2.x with the exec-helper-off run
# beside it, each loop with a cold build of the workspace repeating beside it (the load). No
# reruns: every failure is in .test-env/flaky/rN-*.log, a line per loop in summary.txt.
# Needs a finished ./scripts/test.sh first (its environment and its build mirror).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
# shellcheck disable=SC1091 # written by scripts/setup-test-env.sh
source .test-env/env
BUILD="${KILNTAINERS_BUILD_DIR:-$HOME/.cache/kilntainers/build}"
export KILNTAINERS_REQUIRE_ALL=1 KILNTAINERS_BIN="$BUILD/target/debug/mcp-sandbox-computer-vm-for-ai"
OUT="$PWD/.test-env/flaky"
LOAD_TARGET="$PWD/.test-env/flaky-load-target"
mkdir -p "$OUT"
py1="$KILNTAINERS_TEST_VENV/bin/python"
py2="$KILNTAINERS_TEST_VENV_MCP2/bin/python"
core=(tests/blackbox/test_cli.py tests/blackbox/test_surface.py tests/blackbox/test_exec.py
    tests/blackbox/test_limits.py tests/blackbox/test_lifecycle_docker.py tests/blackbox/test_crash_gc.py
    tests/blackbox/test_jobs.py tests/blackbox/test_files.py tests/blackbox/test_ports.py
    tests/blackbox/test_warm_pool.py tests/blackbox/test_checkpoints.py tests/blackbox/test_tasks.py)
for ((run = 1; run <= ${RUNS:-5}; run++)); do
    set -m
    (while true; do
        rm -rf "$LOAD_TARGET"
        RUSTC_WRAPPER="" CARGO_TARGET_DIR="$LOAD_TARGET" cargo build --workspace --all-features --locked -q >/dev/null 2>&1
    done) &
    load=$!
    set +m
    start=$SECONDS
    (cd "$BUILD" && RUSTC_WORKSPACE_WRAPPER=clippy-driver CLIPPY_ARGS="-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__" \
        cargo test --workspace --all-features --locked >"$OUT/r$run-rust.log" 2>&1) &
    rust=$!
    "$py1" -m pytest tests/blackbox -q -p no:cacheprovider -n 4 --dist loadgroup \
        --junitxml="$OUT/r$run-mcp1.xml" >"$OUT/r$run-mcp1.log" 2>&1
    wait "$rust"
    (KILNTAINERS_EXEC_HELPER=off "$py1" -m pytest "${core[@]}" -q -p no:cacheprovider -n 2 --dist loadgroup \
        --junitxml="$OUT/r$run-off.xml" >"$OUT/r$run-off.log" 2>&1) &
    off=$!
    "$py2" -m pytest tests/blackbox -q -p no:cacheprovider -n 4 --dist loadgroup -m "not client_independent" \
        --junitxml="$OUT/r$run-mcp2.xml" >"$OUT/r$run-mcp2.log" 2>&1
    wait "$off"
    kill -- "-$load" 2>/dev/null
    wait "$load" 2>/dev/null
    rust_counts="$(awk '/^test result:/ { p += $4; f += $6 } END { printf "%d passed, %d failed", p, f }' "$OUT/r$run-rust.log")"
    printf 'run %d: %d s | rust %s | 1.x %s | 2.x %s | helper off %s\n' "$run" $((SECONDS - start)) "$rust_counts" \
        "$(tail -n 1 "$OUT/r$run-mcp1.log")" "$(tail -n 1 "$OUT/r$run-mcp2.log")" "$(tail -n 1 "$OUT/r$run-off.log")" |
        tee -a "$OUT/summary.txt"
done
rm -rf "$LOAD_TARGET"
