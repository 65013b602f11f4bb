"""Kubernetes backend: `echo hi` through the exec helper (one long-lived pods/exec stream per
Pod) against one pods/exec WebSocket per command, on the local fake API server.

One FakeKubernetes in this process (its Pods are local `sandbox-busybox:full` containers); for
`--exec-helper on` and then `off`, one server over stdio with the official MCP client
(`--backend k8s --k8s-mode pod`): the first call (Pod create, readiness, helper upload and
connect) timed alone, then N warm calls on the same temporary computer, counting the fake's
pods/exec requests for that Pod meanwhile. Prints a table and writes
`bench/results/kubernetes-<date>.json`. Asserts nothing.

    .test-env/venv/bin/python -m bench.kubernetes [--bin target/release/mcp-sandbox-computer-vm-for-ai] [-n 100]

The fake shares this Python process (and its GIL) with the client, and runs `docker exec` for
every pods/exec request, so absolute figures are the fake's, not a cluster's; the ratio and
the request counts are what carry over.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

from bench.common import ECHO, ECHO_OUT, REPO, TOOL, BenchError, log, perf, write_json
from fakes.kubernetes import FakeKubernetes
from testkit import machine
from testkit.engine import Engine
from testkit.stats import percentile

TOKEN = "bench-k8s-token"
IMAGE = "sandbox-busybox:full"


def write_kubeconfig(path: Path, url: str) -> Path:
    # The same shape as tests/blackbox/test_kubernetes.py writes: one context, token auth.
    path.write_text(
        "apiVersion: v1\nkind: Config\n"
        f"clusters:\n- name: fake\n  cluster:\n    server: {url}\n"
        f"users:\n- name: fake\n  user:\n    token: {TOKEN}\n"
        "contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: default\n"
        "current-context: fake\n"
    )
    return path


async def measure(binary: str, n: int, fake: FakeKubernetes, home: Path, config: Path, helper: str) -> dict:
    # A fresh HOME per server so no state dir or cache carries from one setting to the other;
    # KILNTAINERS_EXEC_HELPER is left out so only the flag decides.
    (home / helper).mkdir()
    env = {"HOME": str(home / helper), "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
           "XDG_CACHE_HOME": str(home / helper / ".cache"),
           "KUBECONFIG": str(config)}
    args = ["--backend", "k8s", "--k8s-mode", "pod", "--image", IMAGE, "--shell", "/bin/sh", "--exec-helper", helper]
    async with stdio_client(StdioServerParameters(command=binary, args=args, env=env)) as (read, write):
        async with ClientSession(read, write) as session:
            await session.initialize()
            t0 = perf()
            first = await session.call_tool(TOOL, ECHO)
            first_s = perf() - t0
            if first.isError or not first.structuredContent:
                raise BenchError(f"exec helper {helper}: first call failed: {first.content}")
            pod = first.structuredContent["computer_id"]
            exec_path = f"/api/v1/namespaces/default/pods/{pod}/exec"
            first_execs = len(fake.requests_matching("GET", exec_path))
            warm, bad = [], 0
            for _ in range(n):
                t0 = perf()
                res = await session.call_tool(TOOL, ECHO)
                warm.append(perf() - t0)
                # Counted, not asserted: a wrong answer makes its timing meaningless, not the run.
                bad += res.isError or (res.structuredContent or {}).get("stdout") != ECHO_OUT
            warm_execs = len(fake.requests_matching("GET", exec_path)) - first_execs
    # The session has ended; its temporary Pod should go (the server deletes it on the way out).
    deadline = time.monotonic() + 15
    while fake.get("pods", "default", pod) is not None and time.monotonic() < deadline:
        await anyio.sleep(0.1)
    return {
        "pod": pod,
        "first_call_s": first_s,
        "first_call_exec_requests": first_execs,
        "warm_n": n,
        "warm_p50_s": percentile(warm, 50),
        "warm_p90_s": percentile(warm, 90),
        "warm_p99_s": percentile(warm, 99),
        "warm_samples_s": warm,
        "warm_bad_results": bad,
        "warm_exec_requests": warm_execs,
        "exec_requests_per_warm_call": warm_execs / n if n else None,
        "pod_deleted_after_session": fake.get("pods", "default", pod) is None,
    }


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.kubernetes", description=__doc__.splitlines()[0])
    ap.add_argument("--bin", default=str(REPO / "target/release/mcp-sandbox-computer-vm-for-ai"))
    ap.add_argument("-n", type=int, default=100)
    opts = ap.parse_args()
    if not os.access(opts.bin, os.X_OK):
        print(f"no server binary at {opts.bin}; build it or pass --bin", file=sys.stderr)
        return 1
    parts = Path(opts.bin).parts
    build = "release" if "release" in parts else "debug" if "debug" in parts else "unknown"
    figures = {}
    with tempfile.TemporaryDirectory(prefix="kilntainers-bench-kubernetes-") as tmp, \
            FakeKubernetes(namespaces=["default"], tokens=[TOKEN]) as fake:
        config = write_kubeconfig(Path(tmp) / "kubeconfig", fake.url)
        for helper in ("on", "off"):
            log(f"exec helper {helper}: first call + {opts.n} warm calls", prefix="bench-kubernetes")
            figures[helper] = anyio.run(measure, opts.bin, opts.n, fake, Path(tmp), config, helper)
        violations = fake.violations()
    # The fake force-removes its containers on close; anything left is a leak worth seeing.
    left = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=fakek8s={fake.run}"],
                          capture_output=True, text=True).stdout.split()

    print(f"{'exec helper':<12} {'first call':>11} {'warm p50':>9} {'warm p90':>9} {'warm p99':>9}"
          f"  pods/exec per warm call (n={opts.n}, {build} build)")
    for helper, f in figures.items():
        print(f"{helper:<12} {f['first_call_s'] * 1e3:8.0f} ms {f['warm_p50_s'] * 1e3:6.1f} ms"
              f" {f['warm_p90_s'] * 1e3:6.1f} ms {f['warm_p99_s'] * 1e3:6.1f} ms  {f['exec_requests_per_warm_call']:.2f}")
    for helper, f in figures.items():
        if f["warm_bad_results"]:
            print(f"warning: exec helper {helper}: {f['warm_bad_results']} warm calls gave an error or wrong output")
        if not f["pod_deleted_after_session"]:
            print(f"warning: exec helper {helper}: Pod {f['pod']} still present 15 s after its session ended")
    if violations:
        print(f"warning: the fake saw requests outside the published definitions: {violations}")
    if left:
        print(f"warning: containers labelled fakek8s={fake.run} left behind: {' '.join(left)}")

    now = dt.datetime.now(dt.timezone.utc)
    res = {
        "date": now.strftime("%Y-%m-%d %H:%M"),
        "binary": opts.bin,
        "build": build,
        "image": IMAGE,
        "machine": machine.describe(Engine()),
        "figures": figures,
        "fake_violations": violations,
        "containers_left": left,
    }
    path = REPO / "bench/results" / f"kubernetes-{now:%Y-%m-%d}.json"
    write_json(path, res)
    log(f"results in {os.path.relpath(path, REPO)}", prefix="bench-kubernetes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
