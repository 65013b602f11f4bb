"""Side-by-side benchmark: this project's server vs the Python reference 0.2.3.

Both servers are driven over stdio by the official Python MCP client (`mcp` on PyPI), with the
same local image and shell (`debian:bookworm-slim`, `/bin/bash`), alternating the two servers
run by run. The floor (what the Docker Engine API itself costs) is measured in the same run with
a raw Engine-API client over the unix socket (`http.client` / a raw socket, no SDK).

Run it through `scripts/bench.sh`, which installs everything first. Directly:

    .bench-env/client/bin/python -m bench [--quick] [--no-profile] [--no-doc]

Writes `bench/results/<date>.json`, `docs/benchmarks.png` and the generated part of
`docs/benchmarks.md`, and prints the table on stdout. See bench/README.md.

Hygiene: every server gets a HOME under one temporary directory (removed at the end) and an
environment marker `KILNTAINERS_BENCH_TAG`; every container the run causes is tracked by exact
name (`kilntainer-<computer_id>` from the servers' results and labels, `kilntainers-bench-*`
for the floor) and anything still present at the end is force-removed by exact id and reported.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

import anyio

from bench.common import ECHO, IMAGE, REPO, SHELL, log, perf, write_json
from bench.harness import Harness
from bench.phases import phase_cold, phase_concurrent, phase_many_computers, phase_warm
from bench.pool import phase_pool
from bench.report import build_rows, chart, machine_info, text_table, write_doc


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rust-bin", default=str(REPO / "target/release/mcp-sandbox-computer-vm-for-ai"))
    ap.add_argument("--python-bin", default=str(REPO / ".bench-env/ref/bin/mcp-sandbox-computer-vm-for-ai"))
    ap.add_argument("--cold", type=int, default=10, help="cold runs per server (default 10)")
    ap.add_argument("--warm", type=int, default=200, help="warm calls per server (default 200)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--computers", type=int, default=50)
    ap.add_argument("--create-concurrency", type=int, default=10)
    ap.add_argument("--sessions", type=int, default=50)
    ap.add_argument("--commands", type=int, default=10)
    ap.add_argument("--concurrent-runs", type=int, default=1)
    ap.add_argument("--pool-sessions", type=int, default=20, help="sessions timed for the first call with a warm pool")
    ap.add_argument("--pool-size", type=int, default=8, help="--warm-pool of the concurrent sessions with a pool")
    ap.add_argument("--profile-calls", type=int, default=100)
    ap.add_argument("--gone-timeout", type=float, default=20.0)
    ap.add_argument("--many-gone-timeout", type=float, default=20.0)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--no-doc", action="store_true", help="do not touch docs/")
    ap.add_argument("--quick", action="store_true", help="tiny run counts, for trying the harness (implies --no-doc)")
    ap.add_argument("--only", default="cold,warm,many,concurrent,pool", help="comma list of phases")
    ap.add_argument("--results-dir", default=str(REPO / "bench/results"))
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, traces)")
    o = ap.parse_args()
    if o.quick:
        o.cold, o.warm, o.warmup, o.computers, o.sessions, o.commands, o.profile_calls = 2, 30, 3, 5, 5, 3, 30
        o.pool_sessions, o.pool_size = 3, 2
        o.no_doc = True  # never publish quick numbers
    return o


async def amain(h: Harness, res: dict[str, Any]) -> None:
    o = h.opts
    chosen = set(o.only.split(","))
    steps = [
        ("cold", f"cold start ({o.cold} runs per server, alternating)", lambda: phase_cold(h, res)),
        ("warm", f"warm echo ({o.warm} calls per server, alternating, floor interleaved)",
         lambda: phase_warm(h, res, profile=not o.no_profile)),
        ("many", f"{o.computers} computers in one session per server", lambda: phase_many_computers(h, res)),
        ("concurrent", f"{o.sessions} concurrent sessions × {o.commands} commands per server",
         lambda: phase_concurrent(h, res)),
        ("pool", f"project over HTTP with a warm pool: {o.pool_sessions} first calls (pool 2), "
                 f"{o.sessions} sessions × {o.commands} commands (pool {o.pool_size})", lambda: phase_pool(h, res)),
    ]
    # Every chosen phase has a key from the start, filled in with the load as it begins.
    load = res.setdefault("loadavg_before_phase", {name: None for name, _, _ in steps if name in chosen})
    for name, what, run in steps:
        if name in chosen:
            load[name] = os.getloadavg()
            log(f"phase: {what}")
            await run()


def main() -> int:
    opts = parse_args()
    for b in (opts.rust_bin, opts.python_bin):
        if not os.access(b, os.X_OK):
            raise SystemExit(f"bench: {b} is not executable (run scripts/bench.sh, which builds and installs both)")
    h = Harness(opts)
    if not h.engine.image_present(IMAGE):
        raise SystemExit(f"bench: image {IMAGE} is missing (scripts/build-test-images.sh builds it without a registry)")
    t0 = perf()
    now = dt.datetime.now(dt.timezone.utc)
    res: dict[str, Any] = {"date": now.strftime("%Y-%m-%d %H:%M"), "run_id": h.run_id, "machine": machine_info(h)}
    res["params"] = {k: v for k, v in vars(opts).items() if k not in ("rust_bin", "python_bin", "results_dir")}
    res["params"].update({"image": IMAGE, "shell": SHELL, "command": ECHO["command"]})
    print(
        f"bench: run {h.run_id}: {opts.cold} cold runs/server, {opts.warm} warm calls/server, "
        f"{opts.computers} computers/server, {opts.concurrent_runs}× {opts.sessions} sessions × {opts.commands} commands/server, "
        f"profile {'off' if opts.no_profile else f'{opts.profile_calls} calls'}; image {IMAGE}, shell {SHELL}",
        flush=True,
    )
    failed: BaseException | None = None
    try:
        anyio.run(amain, h, res)
    except BaseException as e:  # noqa: BLE001 - clean up first, then report
        failed = e
        traceback.print_exc()
    finally:
        try:
            h.sweep_containers("final")
        except Exception as e:  # noqa: BLE001
            log(f"final sweep failed: {e!r}")
        stray = sorted(set(h.stray_processes()))
        if stray:
            log(f"processes still carrying this run's marker: {stray}; killing them by pid")
            for p in stray:
                try:
                    os.kill(p, signal.SIGKILL)
                except OSError:
                    pass
        if opts.keep or failed is not None:
            log(f"kept {h.tmp} (logs, traces)" if opts.keep else f"server logs in {h.logs} (kept after a failure)")
        if not opts.keep and failed is None:
            shutil.rmtree(h.tmp, ignore_errors=True)
    if failed is not None:
        return 1
    res["wall_s"] = perf() - t0
    res["loadavg_end"] = os.getloadavg()
    res["leftovers_removed_by_harness"] = h.leftovers
    rows = build_rows(res, opts)
    res["table"] = [
        {"figure": r.figure, "unit": r.unit, "project": r.project, "python": r.python, "ratio": r.ratio,
         "floor": r.floor, "target_ratio": r.target, "note": r.note}
        for r in rows
    ]
    results_dir = Path(opts.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    stem = now.strftime("%Y-%m-%d") + ("-quick" if opts.quick else "")
    name = stem + ".json"
    # A second run on the same day keeps the first one's figures.
    n = 2
    while (results_dir / name).exists():
        name = f"{stem}-{n}.json"
        n += 1
    res["results_file"] = name
    write_json(results_dir / name, res)
    print()
    print(text_table(rows))
    print()
    print(f"bench: results in {results_dir / name}; harness wall time {res['wall_s']:.0f} s")
    if not opts.no_doc:
        png = REPO / "docs/benchmarks.png"
        doc = REPO / "docs/benchmarks.md"
        png.parent.mkdir(exist_ok=True)
        chart(res, png, opts)
        write_doc(res, rows, opts, doc, png)
        print(f"bench: wrote {doc.relative_to(REPO)} and {png.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
