#!/usr/bin/env bash
# The fault suite (tests/faults/): SIGKILL of the server, a Docker daemon restart, vanishing
# clients, output floods, kill escapes, a hostile neighbour, fuzzed requests and the HTTP
# exposure checks, against the built binary and a real Docker engine. Then prints the figures
# and regenerates docs/reliability.md from them.
#
#   scripts/fault-test.sh                 whole suite; rewrites docs/reliability.md
#   scripts/fault-test.sh -k flood        only matching tests; prints their figures, leaves
#                                         docs/reliability.md alone
#
# The daemon-restart scenario stops and starts the dockerd that scripts/ensure-dockerd.sh
# started (every container on it stops), so this script is meant to run when nothing else
# uses that engine; it sets KILNTAINERS_FAULTS_DAEMON_RESTART=1 to allow it.
#
# Environment: KILNTAINERS_BIN (default target/debug/mcp-sandbox-computer-vm-for-ai),
# KILNTAINERS_TEST_VENV (default .test-env/venv), KILNTAINERS_FAULTS_RESULTS (default
# .test-env/faults/results.json).
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -f .test-env/env ]]; then
    # shellcheck disable=SC1091
    source .test-env/env
fi
export KILNTAINERS_BIN="${KILNTAINERS_BIN:-$PWD/target/debug/mcp-sandbox-computer-vm-for-ai}"
export KILNTAINERS_FAULTS_RESULTS="${KILNTAINERS_FAULTS_RESULTS:-$PWD/.test-env/faults/results.json}"
export KILNTAINERS_FAULTS_DAEMON_RESTART=1
python="${KILNTAINERS_TEST_VENV:-$PWD/.test-env/venv}/bin/python"

whole=0
if (($# == 0)); then
    whole=1
    rm -f "$KILNTAINERS_FAULTS_RESULTS"
fi

rc=0
"$python" -m pytest tests/faults -q -p no:cacheprovider "$@" || rc=$?

if ((whole)); then
    "$python" tests/faults/report.py --results "$KILNTAINERS_FAULTS_RESULTS" --write docs/reliability.md
else
    "$python" tests/faults/report.py --results "$KILNTAINERS_FAULTS_RESULTS"
fi
exit "$rc"
