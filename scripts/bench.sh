#!/usr/bin/env bash
# Side-by-side benchmark of this server against the Python reference
# (mcp-sandbox-computer-vm-for-ai 0.2.3), both driven over stdio by the official Python MCP
# client. One command, idempotent:
#
#   scripts/bench.sh [harness options]      e.g. --quick, --no-profile, --no-doc (python -m bench --help)
#
# Steps (each prints one line; a second run skips every install):
#   1. docker: a daemon answering `docker info` (scripts/ensure-dockerd.sh when it does not)
#   2. image: debian:bookworm-slim built locally without a registry (scripts/build-test-images.sh)
#   3. apt: python3-venv; strace and linux-perf for the profile (best effort)
#   4. .bench-env/ref: the reference from PyPI on the system Python (3.13 is not available on
#      Debian 12, so --ignore-requires-python; it runs on 3.11)
#   5. .bench-env/client: mcp + matplotlib from PyPI (a separate venv, so the client pin never
#      changes the reference's own dependencies)
#   6. cargo build --release --locked -p mcp-sandbox-computer-vm-for-ai --no-default-features:
#      the server with the Docker backend alone, which is what is measured; the cloud and WASM
#      backends (and their crates, which a bare `cargo build` in the workspace root builds as
#      default members) would only add compile time (steps 4 and 5 run in the background
#      meanwhile)
#   7. python -m bench: table on stdout, bench/results/<date>.json, docs/benchmarks.{md,png}
#
# Environment: PYTHON (interpreter for the venvs, default /usr/bin/python3),
# BENCH_ENV (default .bench-env), SKIP_BUILD=1 (use the existing release binary).
set -euo pipefail

LOG_PREFIX="[bench]"
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

REF_SPEC="mcp-sandbox-computer-vm-for-ai==0.2.3"
CLIENT_SPECS=("mcp==1.30.0" "matplotlib>=3.8,<4")
BENCH_ENV="${BENCH_ENV:-$REPO_ROOT/.bench-env}"
IMAGE="debian:bookworm-slim"
BIN="$REPO_ROOT/target/release/mcp-sandbox-computer-vm-for-ai"

T_START="$(now)"
STEP_T0=""
step_begin() {
    STEP_T0="$(now)"
    printf '%s %-8s ' "$LOG_PREFIX" "$1"
}
step_end() { printf '%s (%s)\n' "$1" "$(elapsed "$STEP_T0")"; }

pick_python() {
    local py="${PYTHON:-}"
    if [[ -z "$py" ]]; then
        if [[ -x /usr/bin/python3 ]]; then py=/usr/bin/python3; else py="$(command -v python3 || true)"; fi
    fi
    [[ -n "$py" ]] || die "no python3 found (set PYTHON)"
    "$py" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' ||
        die "$py is older than 3.11; the reference needs 3.11+ (set PYTHON)"
    printf '%s' "$py"
}

# venv_ready DIR STAMP: the venv exists and was completed for exactly STAMP.
venv_ready() {
    [[ -x "$1/bin/python" ]] && [[ "$(cat "$1/.bench-stamp" 2>/dev/null)" == "$2" ]]
}

# make_venv DIR STAMP PIP_ARGS...: (re)create DIR and install; the stamp is written last.
make_venv() {
    local dir="$1" stamp="$2"
    shift 2
    rm -rf "$dir"
    "$PY" -m venv "$dir" || die "could not create $dir with $PY (is python3-venv installed?)"
    local out
    if ! out="$("$dir/bin/python" -m pip install --disable-pip-version-check -q "$@" 2>&1)"; then
        printf '%s\n' "$out" | tail -n 30 >&2
        die "pip install $* failed"
    fi
    printf '%s' "$stamp" >"$dir/.bench-stamp"
}

# wait_install NAME PID T0: wait for a background install (none if PID is empty), report it.
wait_install() {
    local name="$1" pid="$2" t0="$3" log="$BENCH_ENV/.$1-install.log" rc=0
    [[ -n "$pid" ]] || return 0
    printf '%s %-8s ' "$LOG_PREFIX" "$name"
    if wait "$pid"; then
        printf 'installed (%s after it started)\n' "$(elapsed "$t0")"
    else
        rc=1
        printf 'FAILED\n'
        tail -n 30 "$log" >&2
    fi
    rm -f "$log"
    return "$rc"
}

main() {
    [[ "$(id -u)" == 0 ]] || die "run as root (the profile attaches strace/perf to the server; dockerd may need starting)"
    mkdir -p "$BENCH_ENV"
    # One benchmark at a time on this checkout (installs and the docs are shared).
    exec 8>"$BENCH_ENV/.lock"
    if ! flock -n 8; then
        log "another benchmark is running here; waiting for it"
        flock -w 1800 8 || die "timed out waiting for $BENCH_ENV/.lock"
    fi

    step_begin docker
    if docker info >/dev/null 2>&1; then
        step_end "running ($(docker version --format '{{.Server.Version}}' 2>/dev/null || echo '?'))"
    else
        printf '\n'
        SKIP_RUNSC=1 bash "$REPO_ROOT/scripts/ensure-dockerd.sh"
        step_end "started"
    fi
    command -v docker >/dev/null 2>&1 || die "the docker CLI is missing (the reference server shells out to it)"

    step_begin image
    if docker image inspect "$IMAGE" >/dev/null 2>&1; then
        step_end "$IMAGE present"
    else
        printf '\n'
        SKIP_PODMAN=1 bash "$REPO_ROOT/scripts/build-test-images.sh"
        step_end "$IMAGE built"
    fi

    step_begin apt
    apt_ensure python3-venv libc6-dev || die "could not install python3-venv and libc6-dev (the exec helper links statically)"
    local tools=()
    command -v strace >/dev/null 2>&1 || tools+=(strace)
    command -v perf >/dev/null 2>&1 || tools+=(linux-perf)
    if ((${#tools[@]})); then
        apt_ensure "${tools[@]}" || warn "could not install ${tools[*]}; the profile skips what is missing"
    fi
    step_end "ok"

    PY="$(pick_python)"
    local pyver
    pyver="$("$PY" -c 'import platform; print(platform.python_version())')"

    # The two venvs install in the background while cargo builds (downloads and unpacking
    # overlap the compile); each reports when it is done.
    local ref_stamp="$REF_SPEC python-$pyver" client_stamp="${CLIENT_SPECS[*]} python-$pyver"
    local ref_pid="" client_pid="" ref_t0="" client_t0="" ref_log="$BENCH_ENV/.ref-install.log" client_log="$BENCH_ENV/.client-install.log"
    if venv_ready "$BENCH_ENV/ref" "$ref_stamp"; then
        log "ref      $REF_SPEC already installed"
    else
        log "ref      installing $REF_SPEC on Python $pyver (--ignore-requires-python), in the background"
        (make_venv "$BENCH_ENV/ref" "$ref_stamp" --ignore-requires-python "$REF_SPEC") >"$ref_log" 2>&1 &
        ref_pid=$!
        ref_t0="$(now)"
    fi
    if venv_ready "$BENCH_ENV/client" "$client_stamp"; then
        log "client   ${CLIENT_SPECS[*]} already installed"
    else
        log "client   installing ${CLIENT_SPECS[*]}, in the background"
        (make_venv "$BENCH_ENV/client" "$client_stamp" "${CLIENT_SPECS[@]}") >"$client_log" 2>&1 &
        client_pid=$!
        client_t0="$(now)"
    fi

    step_begin build
    local build_rc=0 out
    if [[ "${SKIP_BUILD:-0}" == 1 && -x "$BIN" ]]; then
        step_end "skipped (SKIP_BUILD=1)"
    else
        out="$(cd "$REPO_ROOT" && cargo build --release --locked -p mcp-sandbox-computer-vm-for-ai --no-default-features 2>&1)" || build_rc=$?
        if [[ "$build_rc" == 0 ]]; then
            step_end "$(printf '%s\n' "$out" | tail -n 1 | sed 's/^ *//')"
        else
            printf 'FAILED\n'
            printf '%s\n' "$out" | tail -n 40 >&2
        fi
    fi

    local failed=0
    wait_install ref "$ref_pid" "$ref_t0" || failed=1
    wait_install client "$client_pid" "$client_t0" || failed=1
    [[ "$build_rc" == 0 ]] || die "cargo build --release --locked -p mcp-sandbox-computer-vm-for-ai --no-default-features failed"
    [[ "$failed" == 0 ]] || die "installing the Python side failed (see above)"

    log "harness: python -m bench $*"
    local rc=0
    # From the repository root, where the bench and testkit packages live.
    (cd "$REPO_ROOT" && exec "$BENCH_ENV/client/bin/python" -m bench \
        --rust-bin "$BIN" --python-bin "$BENCH_ENV/ref/bin/mcp-sandbox-computer-vm-for-ai" "$@") || rc=$?
    log "total $(elapsed "$T_START")"
    return "$rc"
}

main "$@"
