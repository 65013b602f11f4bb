#!/usr/bin/env bash
# The MCP conformance suite (@modelcontextprotocol/conformance 0.1.12, pinned in
# tests/conformance) in server mode against this server over Streamable HTTP.
# Idempotent; builds nothing.
#
#   scripts/conformance-test.sh                 run every applicable scenario
#   scripts/conformance-test.sh SCENARIO...     run only these (each must be applicable)
#
# Steps:
#   1. node >= 20 and npm must be present (Debian 12's own nodejs is 18: not enough; 0.1.14
#      and later of the suite need Node 22, hence the pin)
#   2. `npm ci` in tests/conformance, skipped while package-lock.json is unchanged since the
#      last one and the suite's command is there (npm_ci in scripts/lib.sh)
#   3. Docker and the sandbox-busybox:full image: scripts/setup-test-env.sh when either is
#      missing (with SKIP_PODMAN=1 SKIP_RUNSC=1 unless set otherwise)
#   4. the server binary: $KILNTAINERS_BIN if set, else target/debug/mcp-sandbox-computer-vm-for-ai
#      (run `cargo build --all-features --locked` first; this script never builds)
#   5. every scenario `conformance list --server` prints must be classified below, as run or
#      as skipped with its reason (the reasons are explained in docs/conformance.md); an
#      unclassified scenario fails the run instead of being ignored
#   6. the server: --transport http on a free 127.0.0.1 port, lifecycle tools on, a private
#      HOME (so its instance lock, and its crash GC, see nothing but this run), and
#      --allow-unauthenticated-http (the runner sends no Authorization header); never
#      --oauth-issuer: the suite has no server-side auth scenario (its auth/* scenarios test
#      clients), see docs/conformance.md, "Authorization (OAuth) scenarios"
#   7. one `conformance server --scenario NAME` per applicable scenario; checks.json of each
#      in tests/conformance/results/
#   8. SIGTERM to the server (it must exit 0), then no container labelled with its instance
#      may be left (any found is force-removed by id and fails the run)
#
# Exit status: 0 when every scenario run passed (warnings allowed), the server stopped
# cleanly, logged no panic and left nothing behind; 1 otherwise.
set -euo pipefail

# shellcheck disable=SC2034 # read by lib.sh
LOG_PREFIX="[conformance]"
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)"
# shellcheck source=scripts/lib.sh
source "$SCRIPT_DIR/lib.sh"
cd "$REPO_ROOT"

CONF_DIR="$REPO_ROOT/tests/conformance"
RESULTS_DIR="$CONF_DIR/results"
CONFORMANCE="$CONF_DIR/node_modules/.bin/conformance"

# Scenarios this server is tested against. server-sse-polling belongs to the suite's
# "pending" set and names a test tool (test_reconnection) we do not have; it is run for its
# transport checks (priming event, retry field), its resume check ends as a warning.
APPLICABLE=(
    server-initialize
    ping
    tools-list
    resources-list
    prompts-list
    server-sse-multiple-streams
    server-sse-polling
    dns-rebinding-protection
)

# Scenarios skipped by name: "name|reason". docs/conformance.md has the details.
NOT_APPLICABLE=(
    "logging-set-level|no logging capability (docs/decisions.md, 'Server identity and capabilities': logging is not used)"
    "completion-complete|no completions capability (docs/decisions.md, 'Server identity and capabilities': completions are not used)"
    "tools-call-simple-text|needs the suite's test tool test_simple_text"
    "tools-call-image|needs the suite's test tool test_image_content"
    "tools-call-audio|needs the suite's test tool test_audio_content"
    "tools-call-embedded-resource|needs the suite's test tool test_embedded_resource"
    "tools-call-mixed-content|needs the suite's test tool test_multiple_content_types"
    "tools-call-with-logging|needs the suite's test tool test_tool_with_logging and logging"
    "tools-call-error|needs the suite's test tool test_error_handling"
    "tools-call-with-progress|needs the suite's test tool test_tool_with_progress"
    "tools-call-sampling|needs the suite's test tool test_sampling (this server never samples)"
    "tools-call-elicitation|needs the suite's test tool test_elicitation (this server never elicits)"
    "json-schema-2020-12|needs the suite's test tool json_schema_2020_12_tool (pending suite)"
    "elicitation-sep1034-defaults|needs the suite's test tool test_elicitation_sep1034_defaults (no elicitation)"
    "elicitation-sep1330-enums|needs the suite's test tool test_elicitation_sep1330_enums (no elicitation)"
    "resources-read-text|needs the suite's resource test://static-text"
    "resources-read-binary|needs the suite's resource test://static-binary"
    "resources-templates-read|needs the suite's resource template test://template/{id}/data"
    "resources-subscribe|resources.subscribe is false (docs/decisions.md, 'Server identity and capabilities')"
    "resources-unsubscribe|resources.subscribe is false (docs/decisions.md, 'Server identity and capabilities')"
    "prompts-get-simple|needs the suite's prompt test_simple_prompt (this server has no prompts)"
    "prompts-get-with-args|needs the suite's prompt test_prompt_with_arguments (no prompts)"
    "prompts-get-embedded-resource|needs the suite's prompt test_prompt_with_embedded_resource (no prompts)"
    "prompts-get-with-image|needs the suite's prompt test_prompt_with_image (no prompts)"
)

# Bounds, in seconds.
SCENARIO_TIMEOUT=120 # one scenario; the slowest (server-sse-polling) takes under a second
START_TIMEOUT=30     # server start to /healthz answering
STOP_TIMEOUT=25      # SIGTERM to exit: the server's own cleanup bound is 20 s

in_list() {
    local needle="$1" x
    shift
    for x in "$@"; do
        [[ "$x" == "$needle" ]] && return 0
    done
    return 1
}

# 1 and 2. Node.js, and the suite pinned by package-lock.json.
npm_ci "$CONF_DIR" node_modules/.bin/conformance
suite_version="$(node -p "require('$CONF_DIR/node_modules/@modelcontextprotocol/conformance/package.json').version")"
[[ "$suite_version" == "0.1.12" ]] || die "expected conformance 0.1.12, found $suite_version"

# 3. Docker engine and the test image.
if ! docker info >/dev/null 2>&1 || ! docker image inspect sandbox-busybox:full >/dev/null 2>&1; then
    log "Docker or sandbox-busybox:full missing: running scripts/setup-test-env.sh"
    SKIP_PODMAN="${SKIP_PODMAN:-1}" SKIP_RUNSC="${SKIP_RUNSC:-1}" bash "$SCRIPT_DIR/setup-test-env.sh"
fi
docker image inspect sandbox-busybox:full >/dev/null 2>&1 || die "image sandbox-busybox:full is missing"

# 4. The server binary (never built here).
BIN="${KILNTAINERS_BIN:-$REPO_ROOT/target/debug/mcp-sandbox-computer-vm-for-ai}"
[[ -x "$BIN" ]] || die "$BIN is not an executable; run: cargo build --all-features --locked (or set KILNTAINERS_BIN)"

# 5. Every scenario of the suite is either run or skipped by name.
mapfile -t listed < <("$CONFORMANCE" list --server | sed -n 's/^  - //p')
((${#listed[@]} > 0)) || die "conformance list --server printed no scenarios"
skipped_names=()
for entry in "${NOT_APPLICABLE[@]}"; do
    skipped_names+=("${entry%%|*}")
done
unclassified=()
for s in "${listed[@]}"; do
    in_list "$s" "${APPLICABLE[@]}" || in_list "$s" "${skipped_names[@]}" || unclassified+=("$s")
done
((${#unclassified[@]} == 0)) ||
    die "scenarios neither run nor skipped (classify them here and in docs/conformance.md): ${unclassified[*]}"
for s in "${APPLICABLE[@]}" "${skipped_names[@]}"; do
    in_list "$s" "${listed[@]}" || die "scenario $s is classified here but not offered by the suite"
done

TO_RUN=("$@")
if ((${#TO_RUN[@]} == 0)); then
    TO_RUN=("${APPLICABLE[@]}")
fi
for s in "${TO_RUN[@]}"; do
    in_list "$s" "${APPLICABLE[@]}" || die "$s is not an applicable scenario (see docs/conformance.md)"
done
if (($# == 0)); then
    for entry in "${NOT_APPLICABLE[@]}"; do
        log "SKIP ${entry%%|*}: ${entry#*|}"
    done
fi

# 6. The server.
WORK="$(mktemp -d "${TMPDIR:-/tmp}/kilntainers-conformance.XXXXXX")"
SERVER_PID=""
INSTANCE=""
failures=()

stop_server() {
    [[ -n "$SERVER_PID" ]] || return 0
    local pid="$SERVER_PID" rc=0 deadline
    SERVER_PID=""
    if pid_alive "$pid"; then
        kill -TERM "$pid" 2>/dev/null || true
        deadline=$((SECONDS + STOP_TIMEOUT))
        while pid_alive "$pid" && ((SECONDS < deadline)); do
            sleep 0.1
        done
        if pid_alive "$pid"; then
            warn "server pid $pid still running ${STOP_TIMEOUT}s after SIGTERM; sending SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
            failures+=("server did not exit within ${STOP_TIMEOUT}s of SIGTERM")
        fi
    fi
    wait "$pid" 2>/dev/null || rc=$?
    if ((rc != 0)); then
        failures+=("server exited with status $rc after SIGTERM (expected 0)")
    fi
}

# Containers of this run's server instance (temporary computers carry kilntainers.instance).
leftover_containers() {
    [[ -n "$INSTANCE" ]] || return 0
    docker ps -aq --filter "label=kilntainers.instance=$INSTANCE"
}

cleanup() {
    local rc=$?
    stop_server
    local left
    left="$(leftover_containers 2>/dev/null || true)"
    if [[ -n "$left" ]]; then
        # shellcheck disable=SC2086 # one id per word
        docker rm -f $left >/dev/null 2>&1 || true
    fi
    if ((rc != 0)) && [[ -f "$WORK/server.log" ]]; then
        warn "server log (last 40 lines):"
        tail -n 40 "$WORK/server.log" >&2 || true
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

free_port() {
    node -e 'const s=require("net").createServer();s.listen(0,"127.0.0.1",()=>{console.log(s.address().port);s.close();});'
}

healthz_ok() {
    node -e 'fetch(process.argv[1]).then(r=>process.exit(r.ok?0:1),()=>process.exit(1))' "$1"
}

mkdir -p "$WORK/home"
started=0
for attempt in 1 2 3; do
    PORT="$(free_port)"
    # The conformance runner sends no Authorization header, so this server opts out of the
    # token it would otherwise generate (loopback only, a private HOME, gone at exit).
    HOME="$WORK/home" RUST_LOG="${RUST_LOG:-info}" "$BIN" --transport http --host 127.0.0.1 --port "$PORT" \
        --allow-unauthenticated-http --lifecycle-tools --image sandbox-busybox:full --shell /bin/sh \
        >"$WORK/server.log" 2>&1 &
    SERVER_PID=$!
    if wait_until "$START_TIMEOUT" healthz_ok "http://127.0.0.1:$PORT/healthz"; then
        started=1
        break
    fi
    warn "server did not answer on port $PORT (attempt $attempt)"
    tail -n 5 "$WORK/server.log" >&2 || true
    stop_server
    failures=()
done
((started)) || die "the server did not start"
lock="$(find "$WORK/home/.mcp-sandbox-computer-vm-for-ai/instances" -maxdepth 1 -name '*.lock' 2>/dev/null | head -n 1)"
[[ -n "$lock" ]] || die "the server wrote no instance lock file"
INSTANCE="$(basename "$lock" .lock)"
URL="http://127.0.0.1:$PORT/mcp"
log "server pid $SERVER_PID, instance $INSTANCE, $URL ($("$BIN" --version 2>/dev/null || echo "?"))"

# 7. The scenarios.
rm -rf "$RESULTS_DIR"
mkdir -p "$RESULTS_DIR"
passed=()
failed=()
for s in "${TO_RUN[@]}"; do
    out="$RESULTS_DIR/$s.log"
    t0="$(now)"
    rc=0
    (cd "$CONF_DIR" && timeout "$SCENARIO_TIMEOUT" "$CONFORMANCE" server --url "$URL" --scenario "$s" \
        -o "$RESULTS_DIR") >"$out" 2>&1 || rc=$?
    # Tally the checks of this scenario's checks.json (one directory per scenario run).
    checks="$(find "$RESULTS_DIR" -maxdepth 2 -path "$RESULTS_DIR/server-$s-*/checks.json" | head -n 1)"
    tally="no checks.json"
    if [[ -n "$checks" ]]; then
        # shellcheck disable=SC2016 # JavaScript template literals, not shell expansions
        tally="$(node -e '
            const c = JSON.parse(require("fs").readFileSync(process.argv[1], "utf8"));
            const n = (s) => c.filter((x) => x.status === s).length;
            const bad = c.filter((x) => x.status === "FAILURE" || x.status === "WARNING")
              .map((x) => `\n      ${x.status} ${x.id}: ${x.errorMessage ?? ""}`).join("");
            console.log(`${n("SUCCESS")} passed, ${n("FAILURE")} failed, ${n("WARNING")} warnings${bad}`);
        ' "$checks")"
    fi
    if ((rc == 0)); then
        passed+=("$s")
        log "PASS $s ($(elapsed "$t0")): $tally"
    else
        failed+=("$s")
        log "FAIL $s ($(elapsed "$t0"), exit $rc): $tally"
        sed 's/^/      /' "$out" | tail -n 20
    fi
done

# 8. Stop the server; nothing of its instance may remain.
stop_server
if grep -q 'panicked' "$WORK/server.log"; then
    failures+=("the server log contains a panic")
    grep -n 'panicked' "$WORK/server.log" | head -n 5 >&2
fi
left="$(leftover_containers)"
if [[ -n "$left" ]]; then
    failures+=("containers of instance $INSTANCE left behind: $(echo "$left" | tr '\n' ' ')")
fi

log "passed: ${#passed[@]} (${passed[*]:-})"
log "failed: ${#failed[@]} (${failed[*]:-})"
if (($# == 0)); then
    log "not applicable: ${#NOT_APPLICABLE[@]} (docs/conformance.md)"
fi
for f in "${failures[@]}"; do
    warn "$f"
done
((${#failed[@]} == 0 && ${#failures[@]} == 0)) || exit 1
log "OK"
