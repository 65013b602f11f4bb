"""A newcomer's first run: `./scripts/serve.sh` from its start to its first answered
`terminal_execute` (README, "Quick start"; docs/install.md).

    python3 bench/first_call.py [--out FILE] [-- serve.sh options]

Standard library only, so it runs on a machine that has nothing else yet: it speaks MCP's
stdio framing (one JSON-RPC message a line) itself. It prints serve.sh's own lines with the
seconds since the start, then the two figures (initialize answered, first command answered),
and writes them with the machine's facts to bench/results/first-call-<date>.json. Closing
stdin afterwards ends the server, which removes the temporary computer.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEADLINE_S = 3600


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / f"first-call-{date.today()}.json")
    parser.add_argument("serve_args", nargs="*", help="options passed to serve.sh (after --)")
    args = parser.parse_args()

    started = time.monotonic()
    server = subprocess.Popen(
        [str(REPO / "scripts" / "serve.sh"), *args.serve_args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0,
    )

    def relay_stderr() -> None:
        assert server.stderr is not None
        for raw in server.stderr:
            line = raw.decode(errors="replace").rstrip()
            print(f"{time.monotonic() - started:8.1f}s  {line}", file=sys.stderr, flush=True)

    threading.Thread(target=relay_stderr, daemon=True).start()

    def send(message: dict) -> None:
        assert server.stdin is not None
        server.stdin.write((json.dumps(message) + "\n").encode())
        server.stdin.flush()

    def answer_to(request_id: int) -> dict:
        assert server.stdout is not None
        while time.monotonic() - started < DEADLINE_S:
            raw = server.stdout.readline()
            if not raw:
                raise SystemExit(f"serve.sh ended (exit {server.wait()}) before answering request {request_id}")
            message = json.loads(raw)
            if message.get("id") == request_id:
                return message
        raise SystemExit(f"no answer to request {request_id} within {DEADLINE_S} s")

    send({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "first-call-bench", "version": "1"}}})
    answer_to(1)
    initialized_s = time.monotonic() - started
    send({"jsonrpc": "2.0", "method": "notifications/initialized"})
    send({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
          "params": {"name": "terminal_execute", "arguments": {"command": "echo first call"}}})
    reply = answer_to(2)
    first_call_s = time.monotonic() - started
    result = reply.get("result") or {}
    text = json.dumps(result.get("structuredContent") or result.get("content"))
    server.stdin.close()
    exit_code = server.wait(timeout=60)
    if "first call" not in text or result.get("isError"):
        raise SystemExit(f"terminal_execute did not run the command: {reply}")

    figures = {
        "what": "./scripts/serve.sh to its first answered terminal_execute",
        "date": str(date.today()),
        "serve_args": args.serve_args,
        "initialize_answered_s": round(initialized_s, 1),
        "first_terminal_execute_answered_s": round(first_call_s, 1),
        "server_exit_code": exit_code,
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(), "user_id": os.getuid()},
    }
    print(json.dumps(figures, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=2) + "\n")
    print(f"written to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
