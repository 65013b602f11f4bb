#!/usr/bin/env bash
# Make sure a Docker daemon answers on the default socket, and that the gVisor runtime
# `runsc` is registered with it (best effort).
#
# Idempotent: when `docker info` already works and runsc is registered it only checks.
# Otherwise it installs docker.io (Debian's engine, 20.10), starts `dockerd` in its own
# session with nohup (there is no init system on the test machines), records its pid in
# .test-env/run/dockerd.pid so `scripts/setup-test-env.sh --stop-services` can stop exactly
# that process, and polls `docker info` with a deadline.
#
# gVisor: installs Debian's `runsc` and adds
#   {"runtimes": {"runsc": {"path": "/usr/bin/runsc",
#                           "runtimeArgs": ["--network=none", "--host-uds=open"]}}}
# to /etc/docker/daemon.json (merged into an existing file; an existing runsc entry is left
# alone, except the one earlier versions of this script wrote, without --host-uds=open, which
# the egress proxy's socket wiring needs: docs/egress.md, "Socket wiring"). A running daemon
# is sent SIGHUP (runtimes are reloadable). Any failure in this part is a warning, not an
# error: the runsc tests skip themselves.
#
# Environment:
#   DOCKERD_LOG            daemon log file (default /var/log/kilntainers-dockerd.log)
#   DOCKERD_START_TIMEOUT  seconds to wait for `docker info` (default 60)
#   SKIP_RUNSC=1           do not install or register runsc
set -euo pipefail

LOG_PREFIX="[ensure-dockerd]"
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

DOCKERD_LOG="${DOCKERD_LOG:-/var/log/kilntainers-dockerd.log}"
DOCKERD_START_TIMEOUT="${DOCKERD_START_TIMEOUT:-60}"
DAEMON_JSON=/etc/docker/daemon.json
DOCKER_PIDFILE=/var/run/docker.pid
RUNSC_PATH=/usr/bin/runsc

docker_ok() { docker info >/dev/null 2>&1; }

# The pid in dockerd's own pid file, if that process is a live dockerd.
system_dockerd_pid() {
    local pid
    pid="$(cat "$DOCKER_PIDFILE" 2>/dev/null)" || return 1
    pid_alive "$pid" || return 1
    [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == dockerd ]] || return 1
    printf '%s' "$pid"
}

# ---------------------------------------------------------------------------
# gVisor registration (runs before the daemon starts so a fresh daemon reads it at once)

RUNSC_CHANGED=0

register_runsc() {
    if [[ "${SKIP_RUNSC:-0}" == 1 ]]; then
        log "runsc: skipped (SKIP_RUNSC=1)"
        return 1
    fi
    if ! pkg_installed runsc; then
        if ! apt_ensure runsc; then
            warn "runsc: could not install Debian package 'runsc'; gVisor tests will skip"
            return 1
        fi
    fi
    if ! "$RUNSC_PATH" --version >/dev/null 2>&1; then
        warn "runsc: $RUNSC_PATH --version fails; gVisor tests will skip"
        return 1
    fi
    mkdir -p "$(dirname "$DAEMON_JSON")"
    local py result
    py="$(command -v python3 || true)"
    [[ -x /usr/bin/python3 ]] && py=/usr/bin/python3
    if [[ -z "$py" ]]; then
        if [[ -s "$DAEMON_JSON" ]]; then
            grep -q '"runsc"' "$DAEMON_JSON" && return 0
            warn "runsc: $DAEMON_JSON exists and no python3 is available to merge it; not touching it"
            return 1
        fi
        printf '%s\n' '{"runtimes": {"runsc": {"path": "/usr/bin/runsc", "runtimeArgs": ["--network=none", "--host-uds=open"]}}}' >"$DAEMON_JSON"
        RUNSC_CHANGED=1
        return 0
    fi
    # Prints "unchanged", "changed" or "invalid: <reason>".
    result="$("$py" - "$DAEMON_JSON" "$RUNSC_PATH" <<'PY'
import json, os, sys
path, runsc = sys.argv[1], sys.argv[2]
data = {}
if os.path.exists(path) and os.path.getsize(path) > 0:
    try:
        with open(path) as f:
            data = json.load(f)
    except ValueError as e:
        print("invalid: %s" % e); sys.exit(0)
    if not isinstance(data, dict):
        print("invalid: top level is not an object"); sys.exit(0)
runtimes = data.get("runtimes")
if runtimes is None:
    runtimes = data["runtimes"] = {}
if not isinstance(runtimes, dict):
    print("invalid: 'runtimes' is not an object"); sys.exit(0)
wanted = {"path": runsc, "runtimeArgs": ["--network=none", "--host-uds=open"]}
earlier = {"path": runsc, "runtimeArgs": ["--network=none"]}
if "runsc" in runtimes and runtimes["runsc"] != earlier:
    print("unchanged"); sys.exit(0)
runtimes["runsc"] = wanted
tmp = path + ".tmp"
with open(tmp, "w") as f:
    json.dump(data, f, indent=2)
    f.write("\n")
os.replace(tmp, path)
print("changed")
PY
)"
    case "$result" in
        changed)
            RUNSC_CHANGED=1
            log "runsc: registered in $DAEMON_JSON"
            ;;
        unchanged) ;;
        *)
            warn "runsc: $DAEMON_JSON: $result; not touching it; gVisor tests will skip"
            return 1
            ;;
    esac
}

runsc_listed() {
    docker info --format '{{range $k, $v := .Runtimes}}{{$k}} {{end}}' 2>/dev/null | tr ' ' '\n' | grep -qx runsc
}

# ---------------------------------------------------------------------------
# daemon

start_dockerd() {
    # A docker *client* may exist without an engine (this machine kind ships
    # /usr/local/bin/docker), so look for the daemon, not for `docker`.
    if ! command -v dockerd >/dev/null 2>&1; then
        # runc explicitly: with it requested, a later podman install keeps its
        # "crun | runc" dependency on runc (crun does not work on cgroup v1 hybrid).
        apt_ensure runc docker.io || die "could not install docker.io"
    fi
    command -v dockerd >/dev/null 2>&1 || die "dockerd not found after installing docker.io"

    local pid started=0
    if pid="$(system_dockerd_pid)"; then
        log "dockerd pid $pid is running but not answering yet; waiting"
    else
        mkdir -p "$(dirname "$DOCKERD_LOG")" "$RUN_DIR"
        log "starting dockerd (log: $DOCKERD_LOG)"
        {
            printf '\n==== %s ensure-dockerd: starting dockerd ====\n' "$(date -Is)"
        } >>"$DOCKERD_LOG"
        # setsid: own session, so the caller's process group being killed (CI step end,
        # a test runner's cleanup) does not take the daemon down. nohup: ignore SIGHUP
        # from a closing terminal. Non-interactive bash => the child is not a group
        # leader, so setsid execs in place and $! is dockerd's pid.
        setsid nohup dockerd >>"$DOCKERD_LOG" 2>&1 </dev/null &
        pid=$!
        started=1
    fi

    if ! wait_until "$DOCKERD_START_TIMEOUT" docker info; then
        printf '%s dockerd did not answer "docker info" within %ss; last lines of %s:\n' \
            "$LOG_PREFIX" "$DOCKERD_START_TIMEOUT" "$DOCKERD_LOG" >&2
        tail -n 40 "$DOCKERD_LOG" >&2 || true
        if [[ "$started" == 1 ]] && pid_alive "$pid" &&
            [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == dockerd ]]; then
            log "stopping the dockerd we started (pid $pid) so a retry starts clean"
            kill -TERM "$pid" 2>/dev/null || true
        fi
        die "dockerd failed to start"
    fi
    # If we started it, record the daemon's own pid (from /var/run/docker.pid) as ours.
    local real
    if [[ "$started" == 1 ]] && real="$(system_dockerd_pid)"; then
        write_pidfile dockerd "$real"
    fi
}

main() {
    local t0
    t0="$(now)"
    local runsc_ok=1
    register_runsc || runsc_ok=0

    if docker_ok; then
        if [[ "$RUNSC_CHANGED" == 1 ]]; then
            local pid
            if pid="$(system_dockerd_pid)"; then
                log "runsc: sending SIGHUP to dockerd pid $pid to reload runtimes"
                kill -HUP "$pid" || warn "runsc: could not signal dockerd pid $pid"
            else
                warn "runsc: daemon.json changed but no dockerd pid in $DOCKER_PIDFILE to SIGHUP; restart dockerd to load runsc"
            fi
        fi
        log "docker: already running ($(docker version --format '{{.Server.Version}}' 2>/dev/null || echo '?'))"
    else
        start_dockerd
        log "docker: up ($(docker version --format '{{.Server.Version}}' 2>/dev/null || echo '?')) in $(elapsed "$t0")"
    fi

    if [[ "$runsc_ok" == 1 ]]; then
        if wait_until 10 runsc_listed; then
            log "runsc: registered with dockerd"
        else
            warn "runsc: dockerd does not list the runsc runtime (see $DAEMON_JSON and $DOCKERD_LOG); gVisor tests will skip"
        fi
    fi
}

main "$@"
