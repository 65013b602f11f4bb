#!/usr/bin/env bash
# Runs the server from this checkout (stdio by default) with your arguments:
#
#   ./scripts/serve.sh [server options]        e.g. --transport http --port 8435
#
# As a normal user it installs nothing and never calls apt or sudo. It needs:
#   * for the docker backend (the default), a reachable Docker or Podman engine. When there is
#     none it says so in one line and exits 1 at once, before any build;
#   * a Rust toolchain (cargo; it builds the release binary once, a few minutes on 2 cores) or
#     else an installed `mcp-sandbox-computer-vm-for-ai` on PATH (README, "Install").
# Only when it runs as root on Debian does it provision what is missing: Debian's docker.io
# engine (scripts/ensure-dockerd.sh), libc6-dev (the exec helper links statically against it)
# and, on a machine that reaches no registry, a locally built default image.
#
# Diagnostics go to stderr: stdout carries the MCP protocol.
set -euo pipefail
cd "$(dirname "$0")/.."
LOG_PREFIX="[serve]"
# shellcheck source=scripts/lib.sh
source scripts/lib.sh

DEFAULT_IMAGE=debian:bookworm-slim
BINARY_NAME=mcp-sandbox-computer-vm-for-ai

# What the arguments ask for, read the way the server reads them (both `--flag value` and
# `--flag=value`); only the flags that decide which engine the server will talk to.
backend=docker engine=docker docker_host="" image_given=0
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    arg="${args[i]}" next="${args[i + 1]:-}"
    case "$arg" in
    --backend=*) backend="${arg#*=}" ;;
    --backend) backend="$next" ;;
    --engine=*) engine="${arg#*=}" ;;
    --engine) engine="$next" ;;
    --docker-host=*) docker_host="${arg#*=}" ;;
    --docker-host) docker_host="$next" ;;
    --image | --image=*) image_given=1 ;;
    esac
done

# The engine's API endpoint, chosen as the server chooses it (crates/docker/src/lib.rs).
engine_endpoint() {
    if [[ -n "$docker_host" ]]; then
        printf '%s' "$docker_host"
    elif [[ "$engine" != podman ]]; then
        printf '%s' "${DOCKER_HOST:-unix:///var/run/docker.sock}"
    else
        local candidate
        for candidate in "${DOCKER_HOST:-}" "unix://${XDG_RUNTIME_DIR:-/nonexistent}/podman/podman.sock" \
            "unix:///run/user/$(id -u)/podman/podman.sock" unix:///run/podman/podman.sock; do
            if [[ "$candidate" == unix://* && -S "${candidate#unix://}" ]]; then
                printf '%s' "$candidate"
                return
            fi
        done
    fi
}

# ping_socket PATH : the engine's /_ping over a Unix socket, with whatever client this
# machine has; succeeds without asking when it has neither curl nor python3.
ping_socket() {
    if command -v curl >/dev/null 2>&1; then
        [[ "$(curl -s --max-time 3 --unix-socket "$1" http://engine/_ping 2>/dev/null)" == OK ]]
    elif command -v python3 >/dev/null 2>&1; then
        python3 - "$1" <<'PY' >/dev/null 2>&1
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.settimeout(3)
s.connect(sys.argv[1])
s.sendall(b"GET /_ping HTTP/1.0\r\nHost: engine\r\n\r\n")
sys.exit(0 if b" 200 " in s.recv(4096) else 1)
PY
    fi
}

# engine_problem : prints why the engine cannot be used, or nothing when it can.
engine_problem() {
    local endpoint path
    endpoint="$(engine_endpoint)"
    if [[ -z "$endpoint" ]]; then
        printf 'no Podman API socket found (start it with: systemctl --user start podman.socket)'
        return
    fi
    case "$endpoint" in
    unix://*)
        path="${endpoint#unix://}"
        if [[ ! -S "$path" ]]; then
            printf 'no engine socket at %s' "$path"
        elif [[ ! -r "$path" || ! -w "$path" ]]; then
            printf 'permission denied on %s (add your user to the docker group and log in again, or run rootless Podman)' "$path"
        elif ! ping_socket "$path"; then
            printf 'the engine at %s does not answer' "$path"
        fi
        ;;
    *)
        # A remote engine (tcp://, ssh://): ask it when the docker CLI is here; otherwise the
        # server reports it on first use.
        if command -v docker >/dev/null 2>&1 && ! timeout 15 docker -H "$endpoint" version >/dev/null 2>&1; then
            printf 'the engine at %s does not answer' "$endpoint"
        fi
        ;;
    esac
}

{
    if [[ "$backend" == docker ]]; then
        problem="$(engine_problem)"
        if [[ -n "$problem" ]] && root_on_debian && [[ "$engine" == docker && -z "$docker_host" && -z "${DOCKER_HOST:-}" ]]; then
            log "no Docker engine running; installing and starting Debian's docker.io"
            SKIP_RUNSC=1 bash scripts/ensure-dockerd.sh
            problem="$(engine_problem)"
        fi
        if [[ -n "$problem" ]]; then
            die "no container engine reachable: $problem. Install and start Docker (https://docs.docker.com/engine/install/) or Podman (then add --engine podman), or pick an engine-free backend such as --backend wasm."
        fi
        if root_on_debian && ((image_given == 0)) && ! docker image inspect "$DEFAULT_IMAGE" >/dev/null 2>&1; then
            # The server pulls the image itself (with progress) on first use; on a machine that
            # reaches no registry, build it locally instead.
            docker pull "$DEFAULT_IMAGE" || bash scripts/build-test-images.sh
        fi
    fi

    if command -v cargo >/dev/null 2>&1; then
        # The exec helper (crates/helper-client/build.rs) links statically against glibc's libc.a; without it every
        # command falls back to one plain Docker exec each.
        if [[ "$(cc -print-file-name=libc.a 2>/dev/null)" != /* ]]; then
            if root_on_debian; then
                apt_ensure libc6-dev || warn "could not install libc6-dev; commands will use plain Docker exec"
            else
                warn "no static C library (Debian/Ubuntu: libc6-dev, Fedora: glibc-static); commands will use plain Docker exec, which is slower"
            fi
        fi
        [[ -x "target/release/$BINARY_NAME" ]] || log "building the release binary (first run only; several minutes)"
        cargo build --release --locked --quiet
        server="target/release/$BINARY_NAME"
    elif server="$(command -v "$BINARY_NAME")"; then
        log "no cargo here; running the installed $server"
    else
        die "no Rust toolchain (cargo) to build the server and no installed $BINARY_NAME on PATH: install Rust with https://rustup.rs (no root needed) and run this again, or install the server (README, \"Install\")."
    fi
} >&2
exec "$server" "$@"
