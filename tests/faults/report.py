"""Turns the fault suite's figures (`.test-env/faults/results.json`, written by the tests)
into a table on stdout and, with `--write PATH`, into the reliability page
(`docs/reliability.md`): a fixed text saying what each scenario does, the run's date and
machine, and one row per test with its outcome and figures.

    python tests/faults/report.py [--results FILE] [--write docs/reliability.md]

Standard library only, so it runs without the test venv."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_RESULTS = Path(os.environ.get("KILNTAINERS_FAULTS_RESULTS") or REPO / ".test-env" / "faults" / "results.json")

HEADER = """\
# Reliability: the fault suite

What a hostile computer, a vanishing client or a failing engine does to the server, measured.
`scripts/fault-test.sh` runs `tests/faults/` (pytest, the official MCP Python client, a real
Docker engine) and regenerates this page from the figures the tests record
(`tests/faults/report.py`). Everything inside a computer is treated as hostile; every test
cleans up what it made and checks that nothing (containers, processes, temporary directories)
is left behind.

## Scenarios

1. **SIGKILL of the server.** A server holding three temporary and two permanent computers (a
   command running in one of them) is killed with SIGKILL. The next server started with the same
   HOME must remove the dead server's temporary computers (crash GC) and attach the permanent
   ones again, a 256 KiB file in each intact.
2. **Docker daemon restart mid-session.** The daemon started by `scripts/ensure-dockerd.sh` is
   stopped and started again through the scripts' own path while a server holds a permanent
   and a temporary computer. The server must survive; the next command on the permanent
   computer must work (the container started again transparently, or one clear error and then
   success); nothing is left after shutdown. Only run by `scripts/fault-test.sh`
   (`KILNTAINERS_FAULTS_DAEMON_RESTART=1`), since it stops every container on the engine.
3. **Clients that vanish.** A stdio client is killed with SIGKILL to its process group while a
   command runs (the server only sees EOF); 100 HTTP sessions (bearer token) each run one
   command on their own temporary computer and drop their connections without a DELETE, on a
   server with `--session-timeout 10`. Every computer of theirs must be removed (0 left).
4. **2 GiB output floods.** Zeros without a newline, `yes`, random bytes on stderr, two
   background producers, an argv-mode `head`, through the exec helper and through plain Docker
   exec. Each must end with the output-limit notice (2 MiB default) while the server's peak
   RSS (`VmHWM`) stays under 100 MiB.
5. **Kill escapes.** 33 techniques that try to outlive `timeout: 1` (background jobs, nohup,
   setsid, double forks, disown, traps, renamed processes, `exec -a`, respawning loops,
   coproc, start-stop-daemon, …, and six that drop the exec tag from their environment:
   `env -i`, `setsid env -i sh -c`, unset or overwritten tag, perl clearing `%ENV`). After each
   timeout the container's `/proc` is listed out of band; any new live process is an escape.
   The tag-keeping techniques are ended by the process-group kill and the exec-tag sweep; the
   tag-dropping ones need a kill that does not rely on the tag.
6. **A hostile neighbour.** In computer A a fork bomb (default pids limit 4096), then A's exec
   helper replaced by `#!/bin/sh` / `exec sleep 600`. Computer B on the same server must answer
   each of 30 `echo` calls during each attack (latency p50/max recorded); A's next command must
   return within its timeout plus a few seconds and the server must stay alive.
7. **Fuzzed requests.** 2,000 seeded fuzzed `tools/call` requests (random types per argument,
   unicode, lone UTF-16 surrogate escapes, `1e400`, integers beyond 64 bits) and 200 malformed
   JSON-RPC lines plus one line over 16 MiB, written raw to stdin. Every request with a readable
   id must get exactly one response with that id, every unreadable line one null-id error.
8. **HTTP exposure.** With a token: no or wrong token → 401, foreign `Host` → 421, foreign
   `Origin` → 403, a 50 MB body (`Content-Length` and chunked) → 413 with the server's peak RSS
   recorded. A non-loopback bind without a token is refused at startup.
"""


UNITS = {"_mib": " (MiB)", "_ms": " (ms)", "_seconds": " (s)"}


def format_key(key: str) -> str:
    for suffix, unit in UNITS.items():
        if key.endswith(suffix):
            return key[: -len(suffix)].replace("_", " ") + unit
    return key.replace("_", " ")


def format_value(value) -> str:
    if isinstance(value, dict) and len(value) > 3 and all(v == 0 for v in value.values()):
        return f"0 for each of {len(value)}"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {format_value(v)}" for k, v in value.items())
    if isinstance(value, list):
        return "; ".join(format_value(v) for v in value)
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def figures_text(figures: dict) -> str:
    return "; ".join(f"{format_key(key)} = {format_value(value)}" for key, value in figures.items())


def rows(data: dict) -> list[tuple[str, str, str, str, str]]:
    out = []
    for nodeid, entry in sorted(data.get("tests", {}).items(), key=lambda kv: (kv[1].get("scenario", ""), kv[0])):
        test = nodeid.split("::", 1)[-1]
        outcome = entry.get("outcome", "?")
        if entry.get("message"):
            outcome += f" ({entry['message']})"
        out.append((entry.get("scenario", "?"), test, outcome, str(entry.get("duration_s", "")),
                    figures_text(entry.get("figures", {}))))
    return out


def machine_text(run: dict) -> str:
    parts = [
        f"run on {run.get('date', '?')}",
        f"{run.get('cores', '?')} × {run.get('cpu', '?')}",
        f"{run.get('memory_gib', '?')} GiB RAM",
        f"Linux {run.get('kernel', '?')}",
        f"Docker Engine {run.get('docker', '?')}",
        f"binary `{run.get('binary', '?')}` built {run.get('binary_built', '?')} from commit {run.get('commit', '?')}",
    ]
    return ", ".join(parts)


def escape_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(data: dict) -> str:
    lines = [HEADER, "## Figures", "", machine_text(data.get("run", {})) + ".", ""]
    lines.append("| # | test | outcome | s | figures |")
    lines.append("|---|------|---------|---|---------|")
    for scenario, test, outcome, seconds, figs in rows(data):
        lines.append(f"| {scenario} | `{escape_cell(test)}` | {escape_cell(outcome)} | {seconds} | {escape_cell(figs)} |")
    missing = sorted(set("12345678") - {entry.get("scenario") for entry in data.get("tests", {}).values()})
    if missing:
        lines += ["", f"Not run in this run: scenario {', '.join(missing)}."]
    lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS)
    parser.add_argument("--write", type=Path, help="write the markdown page here")
    args = parser.parse_args()
    if not args.results.exists():
        print(f"no results at {args.results}; run scripts/fault-test.sh", file=sys.stderr)
        return 1
    data = json.loads(args.results.read_text())
    print(machine_text(data.get("run", {})))
    for scenario, test, outcome, seconds, figs in rows(data):
        print(f"\n[{scenario}] {test}: {outcome} ({seconds} s)\n    {figs}")
    if args.write:
        args.write.write_text(markdown(data))
        print(f"\nwrote {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
