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
# The release binary holds only what the arguments use: the chosen backend's cargo feature
# (none for docker) and `oauth` with an OAuth issuer. Another backend later is a rebuild of the
# server crate alone; the dependencies stay built.
# Only when it runs as root on Debian does it provision what is missing: Debian's docker.io
# engine (scripts/ensure-dockerd.sh), libc6-dev (the exec helper links statically against it)
# and, on a machine that reaches no registry, a locally built default image. The build runs
# meanwhile, in the background.
#
# Diagnostics go to stderr: stdout carries the MCP protocol.
set -euo pipefail
cd "$(dirname "$0")/.."
LOG_PREFIX="[serve]"
# shellcheck source=scripts/lib.sh
source scripts/lib.sh

DEFAULT_IMAGE=debian:bookworm-slim
BINARY_NAME=mcp-sandbox-computer-vm-for-ai

# What the arguments ask for, read the way the server reads them: `--flag value` and
# `--flag=value`, and (clap's infer_long_args) any unambiguous prefix of a flag's name. Only
# the flags that decide the engine and the cargo features. The shortest unambiguous prefixes
# are checked against the server's flags by the tidy test (tests/suite/tidy.rs).
backend=docker engine=docker docker_host="" image_given=0 oauth_issuer="${KILNTAINERS_OAUTH_ISSUER:-}"

# flag_named ARG: the full name of the flag ARG (`--name` or `--name=value`) when it is one
# of those, else nothing. Each entry is the flag's name and its shortest accepted prefix.
flag_named() {
    local given="${1%%=*}" entry name shortest
    given="${given#--}"
    for entry in backend:b engine:en docker-host:docker-h image:im oauth-issuer:oauth-i; do
        name="${entry%%:*}" shortest="${entry#*:}"
        if [[ "${given#"$shortest"}" != "$given" && "${name#"$given"}" != "$name" ]]; then
            printf '%s' "$name"
            return
        fi
    done
}

args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    arg="${args[i]}"
    [[ "$arg" == --?* ]] || continue
    [[ "$arg" == *=* ]] && value="${arg#*=}" || value="${args[i + 1]:-}"
    case "$(flag_named "$arg")" in
    backend) backend="$value" ;;
    engine) engine="$value" ;;
    docker-host) docker_host="$value" ;;
    image) image_given=1 ;;
    oauth-issuer) oauth_issuer="$value" ;;
    esac
done

# The cargo features this server needs (Cargo.toml, [features]).
features=()
case "$backend" in
fly | e2b | modal | kubernetes) features+=("$backend") ;;
k8s) features+=(kubernetes) ;;
wasm | go_busybox) features+=(wasm) ;;
esac
[[ -z "$oauth_issuer" ]] || features+=(oauth)

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

# The release build, started in the background as soon as nothing can stop the server from
# running (on a fresh machine it overlaps the engine's install and the image's build).
build_pid=""
start_build() {
    [[ -z "$build_pid" ]] && command -v cargo >/dev/null 2>&1 || return 0
    # The exec helper (crates/helper-client/build.rs) links statically against glibc's libc.a;
    # without it every command falls back to one plain Docker exec each.
    if [[ "$(cc -print-file-name=libc.a 2>/dev/null)" != /* ]]; then
        if root_on_debian; then
            apt_ensure libc6-dev || warn "could not install libc6-dev; commands will use plain Docker exec"
        else
            warn "no static C library (Debian/Ubuntu: libc6-dev, Fedora: glibc-static); commands will use plain Docker exec, which is slower"
        fi
    fi
    [[ -x "target/release/$BINARY_NAME" ]] || log "building the release binary (first run only; several minutes)"
    # Its own process group (setsid without a fork: a background job is no group leader), so
    # that leaving early stops the compilers too.
    # `-p`: a bare `cargo build` here would also build every provider crate (default members).
    setsid cargo build --release --locked --quiet -p "$BINARY_NAME" --no-default-features --features "${features[*]}" &
    build_pid=$!
}
stop_build() {
    [[ -n "$build_pid" ]] && kill -TERM -- "-$build_pid" 2>/dev/null
    return 0
}
trap stop_build EXIT

{
    if [[ "$backend" == docker ]]; then
        problem="$(engine_problem)"
        if [[ -n "$problem" ]] && root_on_debian && [[ "$engine" == docker && -z "$docker_host" && -z "${DOCKER_HOST:-}" ]]; then
            start_build
            log "no Docker engine running; installing and starting Debian's docker.io"
            SKIP_RUNSC=1 bash scripts/ensure-dockerd.sh
            problem="$(engine_problem)"
        fi
        if [[ -n "$problem" ]]; then
            die "no container engine reachable: $problem. Install and start Docker (https://docs.docker.com/engine/install/) or Podman (then add --engine podman), or pick an engine-free backend such as --backend wasm."
        fi
        start_build
        if root_on_debian && ((image_given == 0)) && ! docker image inspect "$DEFAULT_IMAGE" >/dev/null 2>&1; then
            # The server pulls the image itself (with progress) on first use; on a machine that
            # reaches no registry, build it locally instead.
            docker pull "$DEFAULT_IMAGE" || bash scripts/build-test-images.sh "$DEFAULT_IMAGE"
        fi
    fi
    start_build

    if [[ -n "$build_pid" ]]; then
        wait "$build_pid" || die "the release build failed (cargo's messages above)"
        build_pid=""
        server="target/release/$BINARY_NAME"
    elif server="$(command -v "$BINARY_NAME")"; then
        log "no cargo here; running the installed $server"
    else
        die "no Rust toolchain (cargo) to build the server and no installed $BINARY_NAME on PATH: install Rust with https://rustup.rs (no root needed) and run this again, or install the server (README, \"Install\")."
    fi
} >&2
trap - EXIT
exec "$server" "$@"
