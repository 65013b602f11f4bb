# shellcheck shell=bash
# Shared helpers for the test-environment scripts (sourced, never executed).
#
#   source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
#
# Provides: REPO_ROOT, TEST_ENV_DIR, RUN_DIR, CACHE_DIR, log/warn/die, step timing,
# root_on_debian, apt_ensure (apt-get update at most once per setup run, install only what is
# missing), npm_ci (node >= 20, and a directory's npm packages as its package-lock.json pins
# them), wait_until (poll with a deadline) and pidfile helpers that let a teardown stop exactly
# the processes these scripts started.

if [[ -n "${_KILNTAINERS_LIB_SOURCED:-}" ]]; then
    return 0
fi
_KILNTAINERS_LIB_SOURCED=1

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
TEST_ENV_DIR="$REPO_ROOT/.test-env"
RUN_DIR="$TEST_ENV_DIR/run"
CACHE_DIR="$TEST_ENV_DIR/cache"
export REPO_ROOT TEST_ENV_DIR RUN_DIR CACHE_DIR

LOG_PREFIX="${LOG_PREFIX:-[test-env]}"

log() { printf '%s %s\n' "$LOG_PREFIX" "$*"; }
warn() { printf '%s WARNING: %s\n' "$LOG_PREFIX" "$*" >&2; }
die() {
    printf '%s ERROR: %s\n' "$LOG_PREFIX" "$*" >&2
    exit 1
}

# Monotonic-enough wall clock in seconds with microseconds (bash >= 5).
now() { printf '%s' "${EPOCHREALTIME:-$(date +%s.%N)}"; }

# elapsed START -> "1.23s"
elapsed() {
    local start="$1" end
    end="$(now)"
    awk -v s="$start" -v e="$end" 'BEGIN { printf "%.2fs", e - s }'
}

# ---------------------------------------------------------------------------
# apt

# Only root on Debian provisions packages; everyone else is told what to install.
root_on_debian() { [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; }

pkg_installed() {
    [[ "$(dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null)" == "installed" ]]
}

# apt_ensure PKG... : install the packages that are not installed yet. Runs
# `apt-get update` at most once per process tree (KILNTAINERS_APT_UPDATED is exported).
# Prints nothing when everything is already installed.
apt_ensure() {
    local missing=() p
    for p in "$@"; do
        pkg_installed "$p" || missing+=("$p")
    done
    ((${#missing[@]} == 0)) && return 0
    command -v apt-get >/dev/null 2>&1 || die "apt-get not found; cannot install: ${missing[*]}"
    if [[ "$(id -u)" != 0 ]]; then
        die "must run as root to install: ${missing[*]}"
    fi
    export DEBIAN_FRONTEND=noninteractive
    if [[ -z "${KILNTAINERS_APT_UPDATED:-}" ]]; then
        log "apt-get update (missing: ${missing[*]})"
        apt-get update -qq >/dev/null || die "apt-get update failed"
        export KILNTAINERS_APT_UPDATED=1
    fi
    log "apt-get install ${missing[*]}"
    # -o Dpkg::Use-Pty=0 keeps the output quiet; we show it only on failure.
    local out
    if ! out="$(apt-get install -y -qq -o Dpkg::Use-Pty=0 "${missing[@]}" 2>&1)"; then
        printf '%s\n' "$out" | tail -n 30 >&2
        return 1
    fi
}

# ---------------------------------------------------------------------------
# Node.js

# npm_ci DIR [FILE] : DIR's node_modules as DIR/package-lock.json pins them. Dies unless node
# >= 20 and npm are on PATH (Debian 12's own nodejs is 18: not enough). `npm ci` runs only when
# the lock file's sha256 differs from the stamp the last one left in DIR/node_modules, or when
# FILE (relative to DIR, e.g. the package's command) is missing; logs which it did.
npm_ci() {
    local dir="$1" need="${2:-}" what major stamp want t0
    what="${dir#"$REPO_ROOT"/}"
    command -v node >/dev/null 2>&1 || die "node (>= 20) is required for $what"
    command -v npm >/dev/null 2>&1 || die "npm is required for $what"
    major="$(node -p 'process.versions.node.split(".")[0]')"
    ((major >= 20)) || die "node >= 20 is required for $what (found $(node --version))"
    stamp="$dir/node_modules/.kilntainers-lock.sha256"
    want="$(sha256sum "$dir/package-lock.json" | cut -d' ' -f1)"
    if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" && (-z "$need" || -e "$dir/$need") ]]; then
        log "npm packages     up to date ($what)"
        return 0
    fi
    t0="$(now)"
    log "npm ci in $what"
    (cd "$dir" && npm ci --no-audit --no-fund --loglevel=error) >&2 || die "npm ci in $what failed"
    printf '%s\n' "$want" >"$stamp"
    log "npm ci           $(elapsed "$t0") ($what)"
}

# ---------------------------------------------------------------------------
# polling

# wait_until SECONDS CMD... : run CMD every 0.2 s until it succeeds or the deadline passes.
wait_until() {
    local timeout="$1"
    shift
    local deadline=$((SECONDS + timeout))
    while true; do
        if "$@" >/dev/null 2>&1; then
            return 0
        fi
        ((SECONDS >= deadline)) && return 1
        sleep 0.2
    done
}

# ---------------------------------------------------------------------------
# processes and pid files
#
# A pid file written here has three lines: the pid, the process start time (field 22 of
# /proc/PID/stat, in clock ticks since boot) and the command line (NUL bytes turned into
# spaces). A process is only treated as "ours" when all three still match, so a recycled
# pid is never signalled.

proc_cmdline() {
    [[ -r "/proc/$1/cmdline" ]] || return 1
    tr '\0' ' ' <"/proc/$1/cmdline" | sed 's/ $//'
}

proc_starttime() {
    local stat
    stat="$(cat "/proc/$1/stat" 2>/dev/null)" || return 1
    # Fields after the last ')' start with field 3 (state); starttime is field 22.
    stat="${stat##*) }"
    # shellcheck disable=SC2086
    set -- $stat
    printf '%s' "${20}"
}

pid_alive() {
    [[ -n "${1:-}" && "$1" =~ ^[0-9]+$ ]] && kill -0 "$1" 2>/dev/null
}

# write_pidfile NAME PID
write_pidfile() {
    local name="$1" pid="$2" f
    mkdir -p "$RUN_DIR"
    f="$RUN_DIR/$name.pid"
    {
        printf '%s\n' "$pid"
        proc_starttime "$pid"
        printf '\n'
        proc_cmdline "$pid"
        printf '\n'
    } >"$f.tmp"
    mv -f "$f.tmp" "$f"
}

# pidfile_pid NAME : print the pid recorded in NAME's pid file if that process is still
# the one we started (same start time and command line); fail otherwise.
pidfile_pid() {
    local f="$RUN_DIR/$1.pid" pid start cmd
    [[ -f "$f" ]] || return 1
    {
        IFS= read -r pid || true
        IFS= read -r start || true
        IFS= read -r cmd || true
    } <"$f"
    pid_alive "$pid" || return 1
    [[ "$(proc_starttime "$pid")" == "$start" ]] || return 1
    [[ "$(proc_cmdline "$pid")" == "$cmd" ]] || return 1
    printf '%s' "$pid"
}

# stop_pidfile NAME [TIMEOUT] : SIGTERM the process recorded in NAME's pid file (only if it
# is still ours), wait for it to exit, SIGKILL after TIMEOUT seconds. Removes the pid file.
stop_pidfile() {
    local name="$1" timeout="${2:-30}" f="$RUN_DIR/$1.pid" pid
    if [[ ! -f "$f" ]]; then
        log "$name: no pid file, nothing to stop"
        return 0
    fi
    if ! pid="$(pidfile_pid "$name")"; then
        log "$name: recorded process is gone or is no longer ours; removing stale pid file"
        rm -f "$f"
        return 0
    fi
    log "$name: stopping pid $pid"
    kill -TERM "$pid" 2>/dev/null || true
    local deadline=$((SECONDS + timeout))
    while pid_alive "$pid" && ((SECONDS < deadline)); do
        sleep 0.2
    done
    if pid_alive "$pid" && [[ "$(pidfile_pid "$name" 2>/dev/null)" == "$pid" ]]; then
        warn "$name: pid $pid did not exit after ${timeout}s; sending SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$f"
}
