"""The measured phases, each alternating the two servers run by run: cold start, warm calls
(with the floor interleaved), many computers in one session, many sessions at once."""

from __future__ import annotations

from typing import Any

import anyio

from bench.common import ECHO, log, perf
from bench.harness import Harness, Session, close_and_wait_gone, open_session
from bench.profile import profile_project
from testkit import procfs
from testkit.stats import percentile


def order(i: int) -> list[str]:
    """Alternate which server goes first, run by run."""
    return ["project", "python"] if i % 2 == 0 else ["python", "project"]


async def phase_cold(h: Harness, res: dict[str, Any]) -> None:
    """Per run: spawn → initialize, idle RSS, first call (create + echo), close → container gone.
    The floor's bare create+start (and force remove) runs in the same loop."""
    n = h.opts.cold
    keys = ("init", "first", "idle_rss_kib", "idle_tree_rss_kib", "close_gone", "close_exit")
    out = {k: {x: [] for x in keys} for k in h.servers}
    floor: dict[str, list[float]] = {"create": [], "start": [], "create_start": [], "first_exec": [], "first_call": [], "remove": []}
    for i in range(n):
        for key in order(i) + ["floor"]:
            if key == "floor":
                name = f"kilntainers-bench-{h.run_id}-cold-{i}"
                h.made[name] = "floor"
                cid, t = await anyio.to_thread.run_sync(
                    lambda: h.engine.create_start(name, {"kilntainers.bench": h.run_id})
                )
                floor["create"].append(t["create"])
                floor["start"].append(t["start"])
                floor["create_start"].append(t["total"])
                # The first call's engine work: create + start + the first exec in the new container.
                ex = await anyio.to_thread.run_sync(lambda: h.engine.exec_echo(cid))
                floor["first_exec"].append(ex["total"])
                floor["first_call"].append(t["total"] + ex["total"])
                floor["remove"].append(await anyio.to_thread.run_sync(lambda: h.engine.timed_remove(cid)))
                continue
            spec = h.servers[key]
            async with anyio.create_task_group() as tg:
                s = await open_session(tg, h, spec)
                await anyio.sleep(0.2)  # let start-up work settle before reading idle RSS
                out[key]["idle_rss_kib"].append(s.rss_kib())
                out[key]["idle_tree_rss_kib"].append(s.tree_rss_kib())
                assert s.session is not None
                await s.session.list_tools()  # the client caches the output schema (untimed)
                t_first, _ = await s.call(ECHO)
                out[key]["init"].append(s.t_init)
                out[key]["first"].append(t_first)
                gone, exits = await close_and_wait_gone(h, [s], timeout=h.opts.gone_timeout)
            s.check()
            name = s.computers[0]
            out[key]["close_gone"].append(gone.get(name, float("nan")))
            out[key]["close_exit"].append(exits[0] if exits else float("nan"))
            if name not in gone:
                log(f"cold {key}: {name} still present {h.opts.gone_timeout}s after close")
                h.sweep_containers(f"cold-{key}")
        log(
            f"cold run {i + 1}/{n}: "
            + ", ".join(
                f"{k} init {out[k]['init'][-1] * 1e3:.0f} ms first {out[k]['first'][-1] * 1e3:.0f} ms "
                f"gone {out[k]['close_gone'][-1] * 1e3:.0f} ms"
                for k in h.servers
            )
            + f", floor create+start {floor['create_start'][-1] * 1e3:.0f} ms"
        )
    res["cold"] = {"servers": out, "floor": floor}


async def phase_warm(h: Harness, res: dict[str, Any], profile: bool) -> None:
    """Both sessions open at once; echo calls alternate project / python / floor one by one."""
    n = h.opts.warm
    lat: dict[str, list[float]] = {"project": [], "python": []}
    floor: dict[str, list[float]] = {"create": [], "start": [], "inspect": [], "total": []}
    async with anyio.create_task_group() as tg:
        sessions = {k: await open_session(tg, h, spec) for k, spec in h.servers.items()}
        fname = f"kilntainers-bench-{h.run_id}-warm"
        h.made[fname] = "floor"
        fid, _ = await anyio.to_thread.run_sync(lambda: h.engine.create_start(fname, {"kilntainers.bench": h.run_id}))
        try:
            for s in sessions.values():
                assert s.session is not None
                await s.session.list_tools()
                for _ in range(h.opts.warmup):
                    await s.call(ECHO)
            for _ in range(h.opts.warmup):
                h.engine.exec_echo(fid)
            t_start = perf()
            for i in range(n):
                for key in order(i):
                    t, _ = await sessions[key].call(ECHO)
                    lat[key].append(t)
                f = h.engine.exec_echo(fid)
                for k, v in f.items():
                    floor[k].append(v)
                if (i + 1) % 100 == 0:
                    log(f"warm {i + 1}/{n}: project p50 {percentile(lat['project'], 50) * 1e3:.1f} ms, python p50 "
                        f"{percentile(lat['python'], 50) * 1e3:.1f} ms, floor p50 {percentile(floor['total'], 50) * 1e3:.1f} ms")
            res["warm_wall_s"] = perf() - t_start
            res["warm_rss_kib"] = {k: s.rss_kib() for k, s in sessions.items()}
            if profile:
                res["profile"] = await profile_project(h, sessions, fid)
        finally:
            await anyio.to_thread.run_sync(lambda: h.engine.force_remove(fid))
            gone, _ = await close_and_wait_gone(h, list(sessions.values()), timeout=h.opts.gone_timeout)
            res["warm_close_gone"] = {k: gone.get(s.computers[0]) if s.computers else None for k, s in sessions.items()}
    for s in sessions.values():
        s.check()
    h.sweep_containers("warm")
    res["warm"] = {"servers": lat, "floor": floor}


async def phase_many_computers(h: Harness, res: dict[str, Any]) -> None:
    """One session per server holding N temporary computers: RSS, and what closing leaves."""
    n = h.opts.computers
    out: dict[str, Any] = {}
    for key in ["project", "python"]:
        spec = h.servers[key]
        async with anyio.create_task_group() as tg:
            s = await open_session(tg, h, spec)
            assert s.session is not None
            await s.session.list_tools()
            await anyio.sleep(0.2)
            idle = s.rss_kib()
            ids = [f"bench-{h.run_id}-{key[:2]}-{i:02d}" for i in range(n)]
            for cid in ids:
                h.made[f"kilntainer-{cid}"] = key
            sem = anyio.Semaphore(h.opts.create_concurrency)
            lat: list[float] = []

            async def create(cid: str) -> None:
                async with sem:
                    t, _ = await s.call({**ECHO, "computer_id": cid, "temporary": True})
                    lat.append(t)

            t0 = perf()
            async with anyio.create_task_group() as inner:
                for cid in ids:
                    inner.start_soon(create, cid)
            t_all = perf() - t0
            await anyio.sleep(1.0)  # let per-computer background work (monitors) settle
            rss, tree = s.rss_kib(), s.tree_rss_kib()
            nproc = 1 + len(procfs.descendants(s.pid)) if s.pid else None
            gone, exits = await close_and_wait_gone(h, [s], timeout=h.opts.many_gone_timeout, quiet=4.0)
        s.check()
        left = h.sweep_containers(f"{n}-computers-{key}")
        out[key] = {
            "idle_rss_kib": idle,
            "rss_kib": rss,
            "tree_rss_kib": tree,
            "processes": nproc,
            "create_all_s": t_all,
            "create_latency": lat,
            "close_all_gone_s": max(gone.values()) if len(gone) == n else None,
            "gone_after_close": len(gone),
            "last_gone_s": max(gone.values()) if gone else None,
            "close_exit_s": exits[0] if exits else None,
            "left_behind": len(left),
        }
        log(
            f"{n} computers, {key}: created in {t_all:.1f} s, RSS {rss / 1024:.1f} MiB "
            f"(tree {tree / 1024:.1f} MiB, {nproc} processes), gone after close: {len(gone)}/{n}, "
            f"left behind: {len(left)}"
        )
    res["many_computers"] = out


async def phase_concurrent(h: Harness, res: dict[str, Any]) -> None:
    """N stdio sessions (N server processes) at once, M echo calls each; the first call of each
    session creates its computer. Clock starts when all are initialized."""
    n, m = h.opts.sessions, h.opts.commands
    out: dict[str, Any] = {}
    for r in range(h.opts.concurrent_runs):
        for key in order(r):
            spec = h.servers[key]
            lat: list[list[float]] = [[] for _ in range(n)]
            go = anyio.Event()
            finished: list[float] = []
            async with anyio.create_task_group() as tg:
                t_spawn0 = perf()
                sessions = [Session(h, spec) for _ in range(n)]
                for s in sessions:
                    tg.start_soon(s.actor)
                with anyio.fail_after(300):
                    for s in sessions:
                        await s.ready.wait()
                for s in sessions:
                    s.check()
                t_ready = perf() - t_spawn0

                async def worker(idx: int, s: Session) -> None:
                    await go.wait()
                    for _ in range(m):
                        t, _ = await s.call(ECHO)
                        lat[idx].append(t)
                    finished.append(perf())

                async with anyio.create_task_group() as inner:
                    for idx, s in enumerate(sessions):
                        inner.start_soon(worker, idx, s)
                    await anyio.sleep(0.05)
                    t0 = perf()
                    go.set()
                total = max(finished) - t0
                gone, exits = await close_and_wait_gone(h, sessions, timeout=h.opts.many_gone_timeout)
            left = h.sweep_containers(f"concurrent-{key}")
            flat = [x for row in lat for x in row]
            warm_only = [x for row in lat for x in row[1:]]
            names = [c for s in sessions for c in s.computers]
            rec = {
                "total_s": total,
                "spawn_to_all_initialized_s": t_ready,
                "latency": flat,
                "first_call": [row[0] for row in lat],
                "warm_latency": warm_only,
                "close_all_gone_s": max(gone.values()) if len(gone) == len(names) else None,
                "gone_within_timeout": len(gone),
                "close_exit_max_s": max(exits) if exits else None,
                "left_behind": len(left),
            }
            out.setdefault(key, []).append(rec)
            log(
                f"{n}x{m} concurrent, {key}: total {total:.2f} s, p50 {percentile(flat, 50) * 1e3:.0f} ms, "
                f"p99 {percentile(flat, 99) * 1e3:.0f} ms (all {n} initialized {t_ready:.1f} s after spawn; "
                f"gone after close {len(gone)}/{len(names)}, left behind {len(left)})"
            )
    res["concurrent"] = out


