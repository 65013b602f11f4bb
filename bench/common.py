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


def run_figures_bench(name: str, doc: str, measure, write_doc, default_n: int) -> int:
    """The command line of a one-server figures benchmark (`python -m bench.<name>`): parse
    `--bin`, `-n`, `--image`, `--no-doc`; run `measure(binary, n, image, home)` in a throwaway
    HOME; print the figures, write `bench/results/<name>-<date>.json` and, unless `--no-doc`,
    `write_doc(results, docs/benchmarks.md)`."""
    import argparse
    import datetime as dt
    import tempfile

    import anyio

    from testkit import machine
    from testkit.engine import Engine

    ap = argparse.ArgumentParser(prog=f"python -m bench.{name}", description=doc.split("\n\n")[0])
    ap.add_argument("--bin", default=str(REPO / "target/release/mcp-sandbox-computer-vm-for-ai"))
    ap.add_argument("-n", type=int, default=default_n)
    ap.add_argument("--image", default="sandbox-busybox:full")
    ap.add_argument("--no-doc", action="store_true")
    opts = ap.parse_args()
    if not os.access(opts.bin, os.X_OK):
        raise SystemExit(f"bench-{name}: {opts.bin} is not executable (cargo build --release --locked)")
    engine = Engine()
    with tempfile.TemporaryDirectory(prefix=f"kilntainers-bench-{name}-") as home:
        figures = anyio.run(measure, opts.bin, opts.n, opts.image, home)
    now = dt.datetime.now(dt.timezone.utc)
    res = {
        "date": now.strftime("%Y-%m-%d %H:%M"),
        "binary": os.path.relpath(opts.bin, REPO),
        "image": opts.image,
        "machine": machine.describe(engine),
        "figures": figures,
        "results_file": f"{name}-{now:%Y-%m-%d}.json",
    }
    width = max(len(n) for n in figures) + 1
    for fname, fig in figures.items():
        print(f"{fname:<{width}} p50 {fig['p50'] * 1e3:7.1f} ms   p95 {fig['p95'] * 1e3:7.1f} ms   n {fig['n']}")
    write_json(REPO / "bench/results" / res["results_file"], res)
    log(f"results in bench/results/{res['results_file']}", prefix=f"bench-{name}")
    if not opts.no_doc:
        write_doc(res, REPO / "docs/benchmarks.md")
    return 0
