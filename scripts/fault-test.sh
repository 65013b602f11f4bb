#!/usr/bin/env bash
# The fault suite (tests/faults/): SIGKILL of the server, a Docker daemon restart, vanishing
# clients, output floods, kill escapes, a hostile neighbour, fuzzed requests and the HTTP
# exposure checks, against the built binary and a real Docker engine. Then prints the figures
# and writes their table beside them, in tests/faults/results/ (ignored by git).
#
#   scripts/fault-test.sh                 whole suite; results/latest.md holds its table alone
#   scripts/fault-test.sh -k flood        only matching tests; their rows replace the same
#                                         tests' rows in results/latest.md, the others stay
#
# No run changes a tracked file: docs/reliability.md quotes one dated run, and a maintainer
# refreshes it on purpose after a whole run (python3 tests/faults/report.py --into-docs).
#
# The daemon-restart scenario stops and starts the dockerd that scripts/ensure-dockerd.sh
# started (every container on it stops), so this script is meant to run when nothing else
# uses that engine; it sets KILNTAINERS_FAULTS_DAEMON_RESTART=1 to allow it.
#
# Environment: KILNTAINERS_BIN (default target/debug/mcp-sandbox-computer-vm-for-ai),
# KILNTAINERS_TEST_VENV (default .test-env/venv), KILNTAINERS_FAULTS_RESULTS (this run's
# figures, default tests/faults/results/latest.json; the table goes beside it, as .md).
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -f .test-env/env ]]; then
    # shellcheck disable=SC1091
    source .test-env/env
fi
export KILNTAINERS_BIN="${KILNTAINERS_BIN:-$PWD/target/debug/mcp-sandbox-computer-vm-for-ai}"
export KILNTAINERS_FAULTS_RESULTS="${KILNTAINERS_FAULTS_RESULTS:-$PWD/tests/faults/results/latest.json}"
export KILNTAINERS_FAULTS_DAEMON_RESTART=1
python="${KILNTAINERS_TEST_VENV:-$PWD/.test-env/venv}/bin/python"
table="${KILNTAINERS_FAULTS_RESULTS%.json}.md"

# The figures file describes this run only; the table keeps a partial run's other rows.
rm -f "$KILNTAINERS_FAULTS_RESULTS"
update=(--update)
if (($# == 0)); then
    update=()
fi

rc=0
"$python" -m pytest tests/faults -q -p no:cacheprovider "$@" || rc=$?

"$python" tests/faults/report.py --results "$KILNTAINERS_FAULTS_RESULTS" --table "$table" --write "${update[@]}" ||
    rc=$((rc ? rc : 1))
echo "fault-suite figures: $KILNTAINERS_FAULTS_RESULTS; table: $table"
echo "to quote this run in docs/reliability.md (after a whole run): python3 tests/faults/report.py --into-docs"
exit "$rc"
