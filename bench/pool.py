"""The warm pool phase (docs/warm-pool.md): this project's server only, over Streamable HTTP,
where every session gets its own default computer. Its figures sit beside the reference's
first call and its 50-session p99 from the same run (the stdio phases `cold` and `concurrent`).

1. *First call with a warm pool*: one server with `--warm-pool 2`; N sessions one after the
   other, each opened once the pool is full again (as a session that arrives some time after
   the last one finds it), timed from the first `terminal_execute` sent to its answer.
2. *M sessions × K commands with a pool*: one server with `--warm-pool 8`, opened once the pool
   is full; M sessions initialize, then all start their K calls at the same moment, as the stdio
   phase does with M server processes. The first 8 get spares, the rest wait for creates. The
   same burst against a server without a pool runs just before, so the pool's own effect is
   seen under the same conditions (the engine's create rate varies a lot between runs).

Spares carry the `kilntainers.instance` label of the server, whose lock file is in the run's
HOME, so the harness's sweep finds anything left; the phase asserts none is.
"""

from __future__ import annotations

import json
import secrets
import signal
import socket
import subprocess
import time
from typing import Any

import anyio
import httpx
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

from bench.common import ECHO, ECHO_OUT, IMAGE, SHELL, TOOL, BenchError, log, perf
from bench.harness import Harness
from testkit.stats import percentile

START_BOUND = 30.0  # spawn → /healthz answering
FILL_BOUND = 120.0  # a pool of 8 on a busy 2-core engine
STOP_BOUND = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PoolServer:
    """One project server over HTTP with `--warm-pool <size>`, in the run's HOME."""

    def __init__(self, h: Harness, size: int) -> None:
        self.h, self.size = h, size
        self.tag = h.next_tag("project-pool")
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.errpath = h.logs / f"{self.tag}.stderr"
        self.proc: subprocess.Popen | None = None
        self.instance: str | None = None

    def start(self) -> None:
        before = self._instances()
        argv = [self.h.servers["project"].command, "--transport", "http", "--port", str(self.port),
                "--image", IMAGE, "--shell", SHELL, "--warm-pool", str(self.size), "--lifecycle-tools"]
        env = {**self.h.server_env(self.tag), "KILNTAINERS_AUTH_TOKEN": self.token}
        with open(self.errpath, "w") as err:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=err, stderr=err, env=env)
        deadline = perf() + START_BOUND
        while perf() < deadline and self.proc.poll() is None:
            new = self._instances() - before
            if new and self._healthy():
                self.instance = new.pop()
                self.h.note_rust_instances()
                return
            time.sleep(0.05)  # start() runs before any session exists: nothing else to serve
        raise BenchError(f"pool server did not start: {self.errpath.read_text()[-1500:]}")

    def _instances(self) -> set[str]:
        self.h.note_rust_instances()
        return set(self.h.rust_instances)

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    async def full(self) -> None:
        """Until the server reports every spare ready (`computer_list`'s `warm_pool`): a running
        spare container is not ready before the server has checked it."""
        client = httpx.AsyncClient(headers={"Authorization": f"Bearer {self.token}"}, timeout=httpx.Timeout(30))
        async with client:
            async with streamable_http_client(self.url, http_client=client) as streams:
                async with ClientSession(streams[0], streams[1]) as session:
                    await session.initialize()
                    with anyio.fail_after(FILL_BOUND):
                        while True:
                            res = await session.call_tool("computer_list", {})
                            pool = (res.structuredContent or {}).get("warm_pool") or {}
                            if pool.get("ready", 0) >= self.size:
                                return
                            await anyio.sleep(0.05)

    def containers(self) -> int:
        return len(self.h.engine.list_containers(f"kilntainers.instance={self.instance}"))

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=STOP_BOUND)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None


async def session_calls(server: PoolServer, commands: int, go: anyio.Event | None = None,
                        opened: anyio.Event | None = None) -> list[float]:
    """One session: initialize, list tools, then `commands` echo calls; their latencies."""
    client = httpx.AsyncClient(headers={"Authorization": f"Bearer {server.token}"},
                               timeout=httpx.Timeout(30, read=600))
    lat: list[float] = []
    async with client:
        async with streamable_http_client(server.url, http_client=client) as streams:
            async with ClientSession(streams[0], streams[1]) as session:
                await session.initialize()
                await session.list_tools()
                if opened is not None:
                    opened.set()
                if go is not None:
                    await go.wait()
                for _ in range(commands):
                    t0 = perf()
                    res = await session.call_tool(TOOL, ECHO)
                    lat.append(perf() - t0)
                    data = res.structuredContent
                    if data is None and res.content:
                        data = json.loads(res.content[0].text)  # type: ignore[union-attr]
                    if res.isError or not isinstance(data, dict) or data.get("stdout") != ECHO_OUT:
                        raise BenchError(f"pool: unexpected result {data!r}"[:500])
                    server.h.made.setdefault(f"kilntainer-{data['computer_id']}", "project")
    return lat


async def first_calls(h: Harness, n: int) -> dict[str, Any]:
    server = PoolServer(h, 2)
    server.start()
    firsts: list[float] = []
    try:
        for _ in range(n):
            await server.full()
            firsts.append((await session_calls(server, 1))[0])
        log(f"warm pool: first call p50 {percentile(firsts, 50) * 1e3:.1f} ms, "
            f"p95 {percentile(firsts, 95) * 1e3:.1f} ms over {n} sessions")
    finally:
        rc = server.stop()
    left = server.containers()
    if rc != 0 or left:
        raise BenchError(f"pool server exit {rc}, {left} container(s) left: {server.errpath.read_text()[-1500:]}")
    return {"pool": 2, "first_call": firsts}


async def burst(h: Harness, sessions: int, commands: int, size: int) -> dict[str, Any]:
    server = PoolServer(h, size)
    server.start()
    rows: list[list[float]] = [[] for _ in range(sessions)]
    try:
        await server.full()
        go = anyio.Event()
        opened = [anyio.Event() for _ in range(sessions)]

        async def one(i: int) -> None:
            rows[i] = await session_calls(server, commands, go, opened[i])

        async with anyio.create_task_group() as tg:
            for i in range(sessions):
                tg.start_soon(one, i)
            with anyio.fail_after(300):
                for e in opened:
                    await e.wait()
            t0 = perf()
            go.set()
        total = perf() - t0
    finally:
        rc = server.stop()
    left = server.containers()
    if rc != 0 or left:
        raise BenchError(f"pool server exit {rc}, {left} container(s) left: {server.errpath.read_text()[-1500:]}")
    flat = [x for row in rows for x in row]
    log(f"{sessions}x{commands} with a pool of {size}: total {total:.2f} s, p50 {percentile(flat, 50) * 1e3:.0f} ms, "
        f"p99 {percentile(flat, 99) * 1e3:.0f} ms")
    return {"pool": size, "total_s": total, "latency": flat, "first_call": [row[0] for row in rows]}


async def phase_pool(h: Harness, res: dict[str, Any]) -> None:
    o = h.opts
    out: dict[str, Any] = {"transport": "http"}
    out["first"] = await first_calls(h, o.pool_sessions)
    out["burst_without_pool"] = await burst(h, o.sessions, o.commands, 0)
    out["burst"] = await burst(h, o.sessions, o.commands, o.pool_size)
    res["pool"] = out
