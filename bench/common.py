"""What every part of the side-by-side benchmark shares: the workload, logging, and how
results and generated documentation are written."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
IMAGE = "debian:bookworm-slim"
SHELL = "/bin/bash"
TOOL = "terminal_execute"
ECHO = {"command": "echo hi"}
ECHO_OUT = "hi\n"
TAG_ENV = "KILNTAINERS_BENCH_TAG"
RUST_STATE_DIR = ".mcp-sandbox-computer-vm-for-ai"

perf = time.perf_counter


class BenchError(RuntimeError):
    pass


def log(msg: str, prefix: str = "bench") -> None:
    try:
        print(f"[{prefix} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
    except OSError:
        pass  # stderr closed (e.g. piped into `head`): keep measuring, keep cleaning up


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write a results file atomically (a reader never sees half of it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=lambda _: None) + "\n")
    os.replace(tmp, path)


def splice_generated(doc: Path, begin: str, end: str, body: str, heading: str = "") -> None:
    """Replace what lies between the `begin` and `end` markers of `doc` with `body` (markers
    included in `body`); a doc without the markers gets `heading` (if any) and `body` appended."""
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    if begin in text and end in text:
        pre, rest = text.split(begin, 1)
        _, post = rest.split(end, 1)
        text = pre + body + post
    else:
        text = text.rstrip() + (f"\n\n{heading}" if heading else "") + f"\n\n{body}\n"
    tmp = doc.with_name(doc.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, doc)
