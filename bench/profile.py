"""Where the project's warm exec path spends its time: CPU per call of every process
involved (/proc), the engine's own phases (the floor), the client's validation share, and
strace and perf profiles of the server (best effort: each step records why it was skipped)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import anyio

from bench.common import ECHO, TOOL, BenchError, log, perf
from bench.floor import shim_for
from bench.harness import Harness, Session
from testkit import procfs
from testkit.stats import percentile, summary


def _cpu_snapshot(pids: dict[str, tuple[int, bool]]) -> dict[str, int | None]:
    return {k: procfs.cpu_ticks(pid, children) for k, (pid, children) in pids.items()}


async def cpu_per_call(h: Harness, s: Session, n: int) -> tuple[dict[str, Any], dict[str, float]]:
    """CPU time per warm call of the server (with its reaped children: the reference's docker
    CLI runs), this client process, dockerd, containerd and the container's shim (with its
    reaped children: runc and the exec'd shell), from /proc/<pid>/stat."""
    assert s.pid and s.computers
    cid = h.engine.ok("GET", f"/containers/{s.computers[0]}/json")["Id"]
    tick = os.sysconf("SC_CLK_TCK")
    pids: dict[str, tuple[int, bool]] = {"server": (s.pid, True), "client": (os.getpid(), False)}
    for comm in ("dockerd", "containerd"):
        found = procfs.pids_by_comm(comm)
        if found:
            pids[comm] = (found[0], False)
    shim = shim_for(cid)
    if shim:
        pids["shim+runc+shell"] = (shim, True)
    # Background rate of the shared daemons (other users of the engine), over a quiet window.
    b0 = _cpu_snapshot(pids)
    tb0 = perf()
    await anyio.sleep(2.0)
    b1 = _cpu_snapshot(pids)
    tb = perf() - tb0
    a0 = _cpu_snapshot(pids)
    t0 = perf()
    walls = []
    for _ in range(n):
        t, _ = await s.call(ECHO)
        walls.append(t)
    wall = perf() - t0
    a1 = _cpu_snapshot(pids)
    cpu = {}
    for k in pids:
        if a0[k] is None or a1[k] is None:
            continue
        used = (a1[k] - a0[k]) / tick
        background = 0.0
        if k in ("dockerd", "containerd") and b0[k] is not None and b1[k] is not None:
            background = ((b1[k] - b0[k]) / tick) * (wall / tb)
        cpu[k] = {"ms_per_call": used / n * 1e3, "background_ms_per_call": background / n * 1e3}
    log(f"profile ({s.spec.key}): cpu per call " + ", ".join(f"{k} {v['ms_per_call']:.2f} ms" for k, v in cpu.items()))
    return cpu, summary(walls)


async def profile_project(h: Harness, sessions: dict[str, Session], floor_container: str) -> dict[str, Any]:
    n = h.opts.profile_calls
    s = sessions["project"]
    prof: dict[str, Any] = {"calls": n}

    # 1. CPU per call, both servers (the reference over fewer calls: each takes longer).
    prof["cpu"], prof["wall"] = await cpu_per_call(h, s, n)
    prof["python_calls"] = max(20, n // 3)
    prof["cpu_python"], prof["wall_python"] = await cpu_per_call(h, sessions["python"], prof["python_calls"])

    # 2. Engine API phases, seen from the floor client (same container type, same command).
    fl: dict[str, list[float]] = {"create": [], "start": [], "inspect": [], "total": []}
    for _ in range(min(n, 40)):
        for k, v in h.engine.exec_echo(floor_container).items():
            fl[k].append(v)
    prof["floor_phases_ms"] = {k: percentile(v, 50) * 1e3 for k, v in fl.items()}

    # 2b. The client's own share: the official client validates every result against the
    #     tool's outputSchema (the reference declares none, so it skips this).
    prof["client_validation_ms"] = {k: await validation_cost(ss) for k, ss in sessions.items()}

    # 2c. Who burns CPU inside the engine during raw execs: a system-wide software-clock
    #     profile by command name (other users of the machine show up too: see "other").
    if shutil.which("perf"):
        try:
            prof["engine_by_comm"] = await engine_by_comm(h, floor_container, min(n, 40))
        except Exception as e:  # noqa: BLE001
            prof["engine_by_comm_error"] = repr(e)
            log(f"profile: system-wide perf failed: {e!r}")

    # 3. strace timeline of the server's syscalls: where the wall time of one call goes.
    if shutil.which("strace"):
        try:
            prof["strace"] = await strace_phases(h, s, min(n, 30))
        except Exception as e:  # noqa: BLE001 - a profile is best effort
            prof["strace_error"] = repr(e)
            log(f"profile: strace failed: {e!r}")
    else:
        prof["strace_error"] = "strace not installed"

    # 4. perf: where the server's own CPU goes (software clock; no hardware counters needed).
    if shutil.which("perf"):
        try:
            prof["perf"] = await perf_profile(h, s, n)
        except Exception as e:  # noqa: BLE001
            prof["perf_error"] = repr(e)
            log(f"profile: perf failed: {e!r}")
    else:
        prof["perf_error"] = "perf not installed"
    return prof


def _spawn_tool(args: list[str], out: Path) -> subprocess.Popen:
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(out, "w"), start_new_session=True)


def _stop_tool(p: subprocess.Popen, grace: float = 15) -> None:
    """Stop a profiler this harness started (by its pid) and wait for it."""
    if p.poll() is None:
        p.send_signal(signal.SIGINT)
    try:
        p.wait(grace)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


STRACE_LINE = re.compile(
    r"^(?P<tid>\d+)\s+(?P<ts>\d+:\d+:\d+\.\d+)\s+(?:(?P<call>\w+)\((?P<args>.*?)|<\.\.\. (?P<rcall>\w+) resumed>(?P<rargs>.*?))"
    r"(?:\)\s+=\s+(?P<ret>-?\d+|\?)(?P<rest>[^<]*)(?:<(?P<dur>[\d.]+)>)?|\s*<unfinished \.\.\.>)\s*$"
)


def _ts(s: str) -> float:
    hh, mm, ss = s.split(":")
    return int(hh) * 3600 + int(mm) * 60 + float(ss)


async def strace_phases(h: Harness, s: Session, n: int) -> dict[str, Any]:
    out = h.tmp / "strace.txt"
    err = h.logs / "strace.stderr"
    assert s.pid
    p = _spawn_tool(
        ["strace", "-f", "-tt", "-T", "-s", "100", "-qq", "-o", str(out),
         "-e", "trace=read,write,writev,readv,recvfrom,sendto,recvmsg,sendmsg", "-p", str(s.pid)],
        err,
    )
    try:
        await anyio.sleep(1.0)  # attach
        if p.poll() is not None:
            raise BenchError(f"strace exited: {err.read_text()[-300:]}")
        walls = []
        for _ in range(n):
            t, _ = await s.call(ECHO)
            walls.append(t)
        await anyio.sleep(0.3)
    finally:
        await anyio.to_thread.run_sync(_stop_tool, p)
    # Count syscalls per call too (a separate `strace -c` pass, all syscalls).
    counts = await strace_counts(h, s, n)
    return {**parse_strace(out.read_text(errors="replace"), n), "wall_under_strace": summary(walls), "syscalls_per_call": counts}


async def strace_counts(h: Harness, s: Session, n: int) -> dict[str, float]:
    out = h.tmp / "strace-c.txt"
    assert s.pid
    p = _spawn_tool(["strace", "-f", "-c", "-o", str(out), "-p", str(s.pid)], h.logs / "strace-c.stderr")
    try:
        await anyio.sleep(1.0)
        for _ in range(n):
            await s.call(ECHO)
    finally:
        await anyio.to_thread.run_sync(_stop_tool, p)
    counts: dict[str, float] = {}
    for line in out.read_text(errors="replace").splitlines():
        f = line.split()
        if len(f) >= 5 and f[0].replace(".", "").isdigit() and f[-1] != "total":
            try:
                calls = int(f[3])
            except ValueError:
                continue
            counts[f[-1]] = calls / n
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def parse_strace(text: str, n: int) -> dict[str, Any]:
    """Split each tools/call into: our code before/between/after engine requests, and the time
    each engine request was outstanding (request written → last response byte read)."""
    events = []  # (t_end, t_start, kind, fd, nbytes, data)
    pending: dict[str, tuple[float, str, str]] = {}
    for line in text.splitlines():
        m = STRACE_LINE.match(line)
        if not m:
            continue
        tid, ts = m["tid"], _ts(m["ts"])
        if m["call"] and line.rstrip().endswith("<unfinished ...>"):
            pending[tid] = (ts, m["call"], m["args"])
            continue
        if m["rcall"]:
            if tid not in pending:
                continue
            t_start, call, args = pending.pop(tid)
            args = args + (m["rargs"] or "")
            t_end = ts
        else:
            call, args, t_start = m["call"], m["args"], ts
            t_end = ts + float(m["dur"] or 0)
        ret = m["ret"]
        if ret is None or ret == "?" or int(ret) < 0:
            continue
        fdm = re.match(r"(\d+),\s*(.*)", args)
        if not fdm:
            continue
        fd, rest = int(fdm[1]), fdm[2]
        kind = "w" if call in ("write", "writev", "sendto", "sendmsg") else "r"
        events.append((t_end, t_start, kind, fd, int(ret), rest))
    events.sort()
    calls = []
    cur: dict[str, Any] | None = None
    http_fds: set[int] = set()
    for t_end, t_start, kind, fd, nbytes, data in events:
        # rmcp reads and writes the stdio pipes through dup'ed fds: recognise them by content.
        if kind == "r" and nbytes > 0 and "tools/call" in data:
            cur = {"t_in": t_end, "reqs": []}
            continue
        if cur is None:
            continue
        if kind == "w" and "jsonrpc" in data:
            cur["t_out"] = t_end
            calls.append(cur)
            cur = None
            continue
        if kind == "w" and re.match(r'\[?\{?(iov_base=)?"(POST|GET|DELETE|PUT|HEAD) /', data):
            http_fds.add(fd)
            method_path = re.search(r'"(\w+ /[^ "\\]*)', data)
            cur["reqs"].append({"what": method_path[1] if method_path else "?", "fd": fd, "t_write": t_start, "t_last": None})
            continue
        if kind == "r" and fd in http_fds and cur["reqs"]:
            # attribute the read to the latest request on that fd
            for req in reversed(cur["reqs"]):
                if req["fd"] == fd:
                    req["t_last"] = t_end
                    break
    phases: dict[str, list[float]] = {}
    shapes: dict[str, int] = {}
    for c in calls:
        reqs = [r for r in c["reqs"] if r["t_last"] is not None]
        if not reqs:
            continue
        shape = " → ".join(_req_kind(r["what"]) for r in reqs)
        shapes[shape] = shapes.get(shape, 0) + 1
        ours = reqs[0]["t_write"] - c["t_in"]
        phases.setdefault("ours: request read → first engine request", []).append(ours)
        engine_total = 0.0
        for i, r in enumerate(reqs):
            k = _req_kind(r["what"])
            d = r["t_last"] - r["t_write"]
            engine_total += d
            phases.setdefault(f"engine: {k}", []).append(d)
            if i + 1 < len(reqs):
                gap = reqs[i + 1]["t_write"] - r["t_last"]
                ours += gap
                phases.setdefault(f"ours: between {k} and {_req_kind(reqs[i + 1]['what'])}", []).append(gap)
        after = c["t_out"] - reqs[-1]["t_last"]
        ours += after
        phases.setdefault("ours: last engine response → result written", []).append(after)
        phases.setdefault("server total (request read → response written)", []).append(c["t_out"] - c["t_in"])
        phases.setdefault("engine total", []).append(engine_total)
        phases.setdefault("our code total", []).append(ours)
    return {
        "calls_parsed": len(calls),
        "shapes": shapes,
        "phases_ms_p50": {k: percentile(v, 50) * 1e3 for k, v in phases.items()},
    }


def _req_kind(what: str) -> str:
    m = re.match(r"(\w+) (?:/v[\d.]+)?(/.*)", what)
    if not m:
        return what
    method, path = m[1], m[2].split("?")[0]
    path = re.sub(r"/containers/[^/]+", "/containers/{id}", path)
    path = re.sub(r"/exec/[^/]+", "/exec/{id}", path)
    return f"{method} {path}"


async def validation_cost(s: Session, n: int = 200) -> float:
    """Milliseconds the official client spends per call validating a result (output schema)."""
    assert s.session is not None
    res = await s.session.call_tool(TOOL, ECHO)
    validate = getattr(s.session, "_validate_tool_result", None)
    if validate is None:
        return float("nan")
    t0 = perf()
    for _ in range(n):
        await validate(TOOL, res)
    return (perf() - t0) / n * 1e3


ENGINE_COMMS = ("dockerd", "containerd", "containerd-shim", "runc", "runc:[2:INIT]", "runc:[1:CHILD]", "runc:[0:PARENT]", "bash")


async def engine_by_comm(h: Harness, container: str, n: int) -> dict[str, Any]:
    data = h.tmp / "perf-engine.data"
    p = _spawn_tool(["perf", "record", "-a", "-k", "CLOCK_MONOTONIC", "-e", "cpu-clock", "-F", "1000", "-o", str(data)],
                    h.logs / "perf-engine.stderr")
    try:
        await anyio.sleep(1.0)
        if p.poll() is not None:
            raise BenchError(f"perf record -a exited: {(h.logs / 'perf-engine.stderr').read_text()[-300:]}")
        m0 = time.monotonic()
        for _ in range(n):
            h.engine.exec_echo(container)
        m1 = time.monotonic()
        wall = m1 - m0
    finally:
        await anyio.to_thread.run_sync(_stop_tool, p)
    window = ["--time", f"{m0:.6f},{m1:.6f}"]  # only the samples taken during the execs
    rep = subprocess.run(["perf", "report", "-i", str(data), "--stdio", "--no-children", "--sort", "comm", "-q", "--percent-limit", "0", *window],
                         capture_output=True, text=True, timeout=120)
    hdr = subprocess.run(["perf", "report", "-i", str(data), "--stdio", "--sort", "comm", *window], capture_output=True, text=True, timeout=120)
    m = re.search(r"# Event count \(approx\.\): (\d+)", hdr.stdout)
    total_ms = int(m[1]) / 1e6 if m else None  # cpu-clock event count is in ns
    rows: dict[str, float] = {}
    for line in rep.stdout.splitlines():
        mm = re.match(r"\s*([\d.]+)%\s+(.*)$", line)
        if mm:
            comm = mm[2].strip()
            key = comm if comm in ENGINE_COMMS else ("swapper (idle)" if comm == "swapper" else "other")
            rows[key] = rows.get(key, 0.0) + float(mm[1])
    per_call = {k: (v / 100 * total_ms / n if total_ms else None) for k, v in rows.items()}
    return {"calls": n, "wall_ms_per_call": wall / n * 1e3, "cpu_ms_per_call": dict(sorted(per_call.items(), key=lambda kv: -(kv[1] or 0)))}


async def perf_profile(h: Harness, s: Session, n: int) -> dict[str, Any]:
    data = h.tmp / "perf.data"
    assert s.pid
    p = _spawn_tool(["perf", "record", "-e", "cpu-clock", "-F", "4000", "-o", str(data), "-p", str(s.pid)], h.logs / "perf.stderr")
    try:
        await anyio.sleep(1.0)
        if p.poll() is not None:
            raise BenchError(f"perf record exited: {(h.logs / 'perf.stderr').read_text()[-300:]}")
        for _ in range(n):
            await s.call(ECHO)
    finally:
        await anyio.to_thread.run_sync(_stop_tool, p)
    result: dict[str, Any] = {"note": "cpu-clock samples at 4 kHz of the server process only; flat (no call graphs)"}
    for sort in ("dso", "sym"):
        rep = subprocess.run(
            ["perf", "report", "-i", str(data), "--stdio", "--no-children", "--sort", sort, "-q", "--percent-limit", "0"],
            capture_output=True, text=True, timeout=120,
        )
        rows = []
        for line in rep.stdout.splitlines():
            m = re.match(r"\s*([\d.]+)%\s+(.*)$", line)
            if m:
                rows.append([float(m[1]), m[2].strip()])
        result[sort] = rows[:15] if sort == "dso" else [r for r in rows if r[0] >= 1.0][:15]
        if sort == "sym":
            groups: dict[str, float] = {}
            for share, sym in rows:
                g = _sym_group(sym)
                groups[g] = groups.get(g, 0.0) + share
            result["groups"] = sorted(([round(v, 2), k] for k, v in groups.items()), reverse=True)
    hdr = subprocess.run(["perf", "report", "-i", str(data), "--stdio", "--sort", "dso"], capture_output=True, text=True, timeout=60)
    m = re.search(r"# Samples: (\S+)", hdr.stdout)
    result["samples"] = m[1] if m else None
    return result


def _sym_group(sym: str) -> str:
    """Coarse owner of a perf symbol: the kernel, libc, or the Rust crate that owns it."""
    if sym.startswith("[k]"):
        return "kernel (syscalls, scheduler, unix sockets)"
    name = sym.removeprefix("[.]").strip()
    if name.startswith("__") or name in ("malloc", "free", "cfree", "realloc") or "memcpy" in name or "memmove" in name or "memset" in name or name.startswith("_int_"):
        return "libc (memcpy/memset/malloc)"
    m = re.search(r"(?:^|[<\s(&])(?:_<)?([a-z_][a-z0-9_]*)::", name)
    if not m:
        return "libc / vdso (other)"
    crate = m[1]
    if crate == "mcp_sandbox_computer_vm_for_ai":
        return "our crate"
    if crate in ("core", "alloc", "std"):
        return "Rust std (core/alloc/std)"
    return crate


