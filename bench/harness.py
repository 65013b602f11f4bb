"""The two servers under test, each session in its own task, and the run's bookkeeping: every
server gets a HOME under one temporary directory and an environment marker, and every
container the run causes is tracked by exact name so that anything left is removed."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

from bench.common import ECHO_OUT, IMAGE, RUST_STATE_DIR, SHELL, TAG_ENV, TOOL, BenchError, log, perf
from bench.floor import FloorEngine, GonePoller
from testkit import procfs


@dataclass
class ServerSpec:
    key: str  # "project" | "python"
    label: str
    command: str
    args: list[str]


class Harness:
    def __init__(self, opts: argparse.Namespace) -> None:
        self.opts = opts
        self.run_id = secrets.token_hex(3)
        self.tmp = Path(tempfile.mkdtemp(prefix=f"kilntainers-bench-{self.run_id}-"))
        self.home = self.tmp / "home"
        self.home.mkdir()
        self.logs = self.tmp / "logs"
        self.logs.mkdir()
        self.engine = FloorEngine()
        self.counter = 0
        # Everything this run caused on the engine: container name -> who made it.
        self.made: dict[str, str] = {}
        self.rust_instances: set[str] = set()
        self.leftovers: dict[str, list[str]] = {}
        rust_bin = Path(opts.rust_bin).resolve()
        py_bin = Path(opts.python_bin).resolve()
        common = ["--image", IMAGE, "--shell", SHELL]
        self.servers = {
            "project": ServerSpec("project", "project (Rust)", str(rust_bin), common),
            "python": ServerSpec("python", "reference (Python 0.2.3)", str(py_bin), common),
        }

    def next_tag(self, key: str) -> str:
        self.counter += 1
        return f"{self.run_id}-{key}-{self.counter}"

    def server_env(self, tag: str) -> dict[str, str]:
        env = {"HOME": str(self.home), "PATH": os.environ.get("PATH", "/usr/bin:/bin"), TAG_ENV: tag}
        for k in ("DOCKER_HOST", "LANG", "LC_ALL"):
            if k in os.environ:
                env[k] = os.environ[k]
        return env

    def note_rust_instances(self) -> None:
        d = self.home / RUST_STATE_DIR / "instances"
        if d.is_dir():
            for p in d.iterdir():
                if p.name.endswith(".lock") and not p.name.startswith("."):
                    self.rust_instances.add(p.name[: -len(".lock")])

    # -- cleanup ------------------------------------------------------------------------------

    def sweep_containers(self, phase: str) -> list[str]:
        """Force-remove (by exact id) whatever this run caused that is still there."""
        removed = []
        seen: dict[str, dict[str, Any]] = {}
        # Warm-pool spares have no computer-id label; their instance label is the run's.
        for label in ("kilntainers.computer-id", "kilntainers.pooled", f"kilntainers.bench={self.run_id}"):
            for c in self.engine.list_containers(label):
                seen[c["Id"]] = c
        for cid, c in seen.items():
            names = [n.lstrip("/") for n in c.get("Names") or []]
            labels = c.get("Labels") or {}
            ours = (
                any(n in self.made for n in names)
                or labels.get("kilntainers.bench") == self.run_id
                or labels.get("kilntainers.instance") in self.rust_instances
            )
            if ours:
                who = next((self.made[n] for n in names if n in self.made), "harness")
                self.engine.force_remove(cid)
                removed.append(f"{who}:{names[0] if names else cid[:12]}")
        if removed:
            self.leftovers.setdefault(phase, []).extend(removed)
            log(f"{phase}: force-removed {len(removed)} container(s) left behind: {', '.join(removed[:6])}"
                f"{' …' if len(removed) > 6 else ''}")
        return removed

    def stray_processes(self) -> list[int]:
        """Processes still carrying this run's marker (none should)."""
        return procfs.pids_with_environ(f"{TAG_ENV}={self.run_id}-")


class Session:
    """One server process + one MCP session, owned by its own task (anyio scopes are per task)."""

    def __init__(self, h: Harness, spec: ServerSpec) -> None:
        self.h = h
        self.spec = spec
        self.tag = h.next_tag(spec.key)
        self.errpath = h.logs / f"{self.tag}.stderr"
        self.ready = anyio.Event()
        self.close_evt = anyio.Event()
        self.done = anyio.Event()
        self.session: ClientSession | None = None
        self.pid: int | None = None
        self.t_spawn = 0.0
        self.t_init: float | None = None
        self.t_close = 0.0
        self.t_exit: float | None = None
        self.error: BaseException | None = None
        self.computers: list[str] = []
        self._seen: set[str] = set()

    async def actor(self) -> None:
        errf = open(self.errpath, "w")
        try:
            params = StdioServerParameters(
                command=self.spec.command, args=self.spec.args, env=self.h.server_env(self.tag)
            )
            self.t_spawn = perf()
            async with stdio_client(params, errlog=errf) as (r, w):
                async with ClientSession(r, w) as s:
                    await s.initialize()
                    self.t_init = perf() - self.t_spawn
                    self.session = s
                    self.pid = self._find_pid()
                    if self.spec.key == "project":
                        self.h.note_rust_instances()
                    self.ready.set()
                    await self.close_evt.wait()
            self.t_exit = perf() - self.t_close
        except BaseException as e:  # noqa: BLE001 - surfaced by the caller
            self.error = e
            if not isinstance(e, Exception):
                raise
        finally:
            errf.close()
            self.ready.set()
            self.done.set()

    def _find_pid(self) -> int | None:
        me = os.getpid()
        for pid in procfs.pids_with_environ(f"{TAG_ENV}={self.tag}", whole_entry=True):
            if procfs.ppid(pid) == me:
                return pid
        return None

    def check(self) -> None:
        if self.error is not None:
            tail = ""
            try:
                tail = self.errpath.read_text()[-1500:]
            except OSError:
                pass
            raise BenchError(f"{self.spec.label} session {self.tag} failed: {self.error!r}\nserver stderr:\n{tail}")

    async def call(self, args: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        assert self.session is not None
        t0 = perf()
        res = await self.session.call_tool(TOOL, args)
        elapsed = perf() - t0
        data = res.structuredContent
        if data is None and res.content:
            data = json.loads(res.content[0].text)  # type: ignore[union-attr]
        if res.isError or not isinstance(data, dict) or data.get("exit_code") != 0 or data.get("stdout") != ECHO_OUT:
            raise BenchError(f"{self.spec.label}: unexpected result {data!r}"[:500])
        name = f"kilntainer-{data['computer_id']}"
        self.h.made.setdefault(name, self.spec.key)
        if name not in self._seen:
            self._seen.add(name)
            self.computers.append(name)
        return elapsed, data

    def rss_kib(self) -> int | None:
        return procfs.status_kib(self.pid) if self.pid else None

    def tree_rss_kib(self) -> int | None:
        if not self.pid:
            return None
        total = 0
        for p in [self.pid, *procfs.descendants(self.pid)]:
            total += procfs.status_kib(p) or 0
        return total

    def request_close(self) -> None:
        self.t_close = perf()
        self.close_evt.set()


async def open_session(tg: anyio.abc.TaskGroup, h: Harness, spec: ServerSpec, timeout: float = 120) -> Session:
    s = Session(h, spec)
    tg.start_soon(s.actor)
    with anyio.fail_after(timeout):
        await s.ready.wait()
    s.check()
    return s


async def close_and_wait_gone(h: Harness, sessions: list[Session], timeout: float,
                              quiet: float | None = None) -> tuple[dict[str, float], list[float]]:
    """Close the sessions at once; return when each container vanished and each process exit time."""
    names = [n for s in sessions for n in s.computers]
    t0 = perf()
    poller = GonePoller(FloorEngine(h.engine.path), names, t0, timeout, quiet=quiet)
    poller._t_exited = 0.0
    poller.start()
    for s in sessions:
        s.request_close()
    with anyio.fail_after(timeout + 30):
        for s in sessions:
            await s.done.wait()
    poller.servers_exited()
    gone = await anyio.to_thread.run_sync(poller.finish)
    exits = [s.t_exit for s in sessions if s.t_exit is not None]
    return gone, exits


