"""The warm pool (docs/warm-pool.md) against a real Docker engine, driven by the official MCP
client: `--warm-pool N` keeps N started spares, a session's first temporary computer is a spare
renamed `kilntainer-<id>`, the pool refills, permanent computers are always created fresh, a
spare killed or restarted behind the server's back is never handed out, and spares are gone
after SIGTERM, after the stdio session ends, and after SIGKILL plus the next start."""

from __future__ import annotations

import os
import signal
import time

import anyio
import pytest

from harness import (
    BUSYBOX_ARGS,
    apoll,
    await_gone,
    container_for,
    docker,
    inspect,
    wait_exit,
)

pytestmark = [pytest.mark.anyio, pytest.mark.client_independent]

POOL_ARGS = [*BUSYBOX_ARGS, "--lifecycle-tools", "--warm-pool", "2"]
SPARE_PREFIX = "/kilntainers-spare-"


def spares(instance: str) -> list[str]:
    """Full ids of the running spares of one server instance, oldest first."""
    out = docker(
        "ps", "-q", "--no-trunc",
        "--filter", f"label=kilntainers.instance={instance}",
        "--filter", "label=kilntainers.pooled=true",
    ).stdout.split()
    found = []
    for container in out:
        info = inspect(container)
        if info and info["Name"].startswith(SPARE_PREFIX) and info["State"]["Running"]:
            found.append((info["Created"], container))
    return [c for _, c in sorted(found)]


async def spares_running(instance: str, size: int = 2, timeout: float = 60.0) -> list[str]:
    """The engine's view: `size` spare containers running (not yet ready to be handed out:
    the server checks readiness after the container runs)."""
    ready = await apoll(lambda: (s := spares(instance)) and len(s) == size and s, timeout, 0.1)
    assert ready, f"the pool did not fill to {size} spares: {spares(instance)}"
    return ready


async def full_pool(session, instance: str, size: int = 2, timeout: float = 60.0) -> list[str]:
    """The server's view: `computer_list` says `size` spares are ready; then their containers."""
    deadline = time.monotonic() + timeout
    while True:
        listing = (await session.call({}, name="computer_list")).ok().structured
        if listing["warm_pool"]["ready"] == size:
            break
        assert time.monotonic() < deadline, f"the pool did not become ready: {listing['warm_pool']}"
        await anyio.sleep(0.1)
    return await spares_running(instance, size)


def containers_of(instance: str) -> list[str]:
    return docker("ps", "-aq", "--no-trunc", "--filter", f"label=kilntainers.instance={instance}").stdout.split()


async def test_first_call_takes_a_spare_and_the_pool_refills(kbb):
    permanent = kbb.new_id("pool-perm")
    named = kbb.new_id("pool-named")
    async with kbb.http_server(*POOL_ARGS) as srv:
        instance = srv.instance_id
        async with kbb.http_session(srv) as s:
            before = await full_pool(s, instance)
            listing = (await s.call({}, name="computer_list")).ok().structured
            assert listing["computers"] == [] or all(
                not c["computer_id"].startswith("spare-") for c in listing["computers"]
            )
            assert listing["warm_pool"] == {"ready": 2, "size": 2}, listing

            first = (await s.run("echo warm")).structured
            assert first["stdout"] == "warm\n"
            computer = container_for(first["computer_id"])
            assert computer in before, "the first call did not get a spare"
            info = inspect(computer)
            assert info["Name"] == f"/kilntainer-{first['computer_id']}"
            labels = info["Config"]["Labels"]
            assert labels["kilntainers"] == "true"
            assert labels["kilntainers.temporary"] == "true"
            assert labels["kilntainers.instance"] == instance
            assert labels["kilntainers.pooled"] == "true"
            # Labels cannot change: a spare has no computer-id label, so nothing reads a wrong
            # id from it; its id is its name (docs/warm-pool.md, "Labels").
            assert "kilntainers.computer-id" not in labels

            # The pool refills with a new spare.
            after = await full_pool(s, instance)
            assert computer not in after and len(set(after) - set(before)) == 1, (before, after)

            # A named temporary computer is a spare too; a permanent one never is.
            pooled = set(after)
            tmp = (await s.run("echo named", computer_id=named, temporary=True)).structured
            assert container_for(named) in pooled
            assert tmp["temporary"] is True
            started = time.monotonic()
            perm = (await s.run("echo perm", computer_id=permanent, temporary=False)).structured
            cold = time.monotonic() - started
            perm_container = container_for(permanent)
            assert perm_container not in pooled and perm["temporary"] is False
            assert inspect(perm_container)["Config"]["Labels"] == {
                "kilntainers": "true",
                "kilntainers.computer-id": permanent,
                "kilntainers.temporary": "false",
                "kilntainers.image": BUSYBOX_ARGS[1],
                "kilntainers.owner": "default",
            }

            # Spares never show as computers; the handed-out ones do, under their ids.
            listing = (await s.call({}, name="computer_list")).ok().structured
            ids = {c["computer_id"] for c in listing["computers"]}
            assert {first["computer_id"], named, permanent} <= ids
            shown = {c["sandbox_id"] for c in listing["computers"]}
            assert not any(spare[:12] in shown for spare in spares(instance))

            # A spare's first command beats a cold create (a wide margin, not a benchmark).
            assert first["exec_duration_ms"] < cold * 1000, (first, cold)

            await s.call({"computer_id": permanent}, name="computer_delete")
        # The session's computers go with it; the pool stays.
        assert await await_gone(first["computer_id"], 15)
        assert await await_gone(named, 15)
        await spares_running(instance)
    # SIGTERM (the fixture's stop, exit 0 asserted there) removed every spare.
    assert containers_of(instance) == [], "spares outlived the server"


async def test_a_spare_stopped_or_restarted_behind_the_servers_back_is_not_handed_out(kbb):
    async with kbb.http_server(*POOL_ARGS) as srv:
        instance = srv.instance_id
        async with kbb.http_session(srv) as s:
            killed, restarted = await full_pool(s, instance)
            docker("kill", killed)
            docker("restart", "-t", "0", restarted)
            result = (await s.run("echo fresh")).structured
            assert result["stdout"] == "fresh\n"
            computer = container_for(result["computer_id"])
            assert computer not in (killed, restarted), "a tampered spare was handed out"
            # The restarted spare was removed, and the pool made new ones.
            assert await apoll(lambda: inspect(restarted) is None, 15, 0.1), "the restarted spare was kept"
            refilled = await full_pool(s, instance)
            assert not {killed, restarted} & set(refilled)


async def test_stdio_session_end_removes_spares_and_the_handed_out_computer(kbb):
    async with kbb.server(*POOL_ARGS) as srv:
        instance = srv.instance_id
        before = await full_pool(srv, instance)
        result = (await srv.run("echo stdio")).structured
        assert container_for(result["computer_id"]) in before
        await full_pool(srv, instance)
    assert wait_exit(srv, 20) == 0, srv.stderr()
    assert containers_of(instance) == [], "the stdio session's end left spares behind"


async def test_sigkill_leaves_spares_that_the_next_start_collects(kbb):
    home = kbb.home()
    async with kbb.server(*POOL_ARGS, home=home) as srv:
        instance = srv.instance_id
        left = await spares_running(instance)
        os.kill(srv.pid, signal.SIGKILL)
        assert wait_exit(srv, 10) == -signal.SIGKILL
    assert sorted(left) == sorted(spares(instance)), "spares vanished without a server to remove them"
    # The next server in the same HOME removes them in the background.
    async with kbb.server(*BUSYBOX_ARGS, home=home):
        gone = await apoll(lambda: containers_of(instance) == [], 15, 0.1)
        assert gone, f"the next start did not collect the dead server's spares: {containers_of(instance)}"


async def test_another_server_reads_a_handed_out_computer_by_its_name(kbb):
    async with kbb.http_server(*POOL_ARGS) as srv:
        async with kbb.http_session(srv) as s:
            await full_pool(s, srv.instance_id)
            computer_id = (await s.run("echo mine > /tmp/owner")).structured["computer_id"]
            async with kbb.server(*BUSYBOX_ARGS, "--lifecycle-tools") as other:
                rows = (await other.call({}, name="computer_list")).ok().structured["computers"]
                row = next((r for r in rows if r["computer_id"] == computer_id), None)
                assert row is not None, rows
                assert row["temporary"] is True and row["state"] == "running"
                assert not any(r["computer_id"].startswith("spare") for r in rows)
                again = (await other.run("cat /tmp/owner", computer_id=computer_id, temporary=True)).structured
                assert again["stdout"] == "mine\n"


async def test_a_burst_of_sessions_takes_spares_then_creates(kbb):
    sessions = 8
    async with kbb.http_server(*POOL_ARGS) as srv:
        instance = srv.instance_id
        async with kbb.http_session(srv) as observer:
            before = set(await full_pool(observer, instance))
        results: list[dict] = []

        async def one(n: int) -> None:
            async with kbb.http_session(srv) as s:
                for i in range(3):
                    res = (await s.run(f"echo {n}-{i}")).structured
                    assert res["stdout"] == f"{n}-{i}\n"
                results.append({**res, "container": container_for(res["computer_id"])})

        async with anyio.create_task_group() as tg:
            for n in range(sessions):
                tg.start_soon(one, n)
        assert len(results) == sessions
        served = {r["container"] for r in results} & before
        assert len(served) == 2, f"both ready spares should have been handed out: {served}"
        assert len({r["computer_id"] for r in results}) == sessions


def test_warm_pool_needs_the_docker_backend(kbb):
    import subprocess

    from harness import BIN

    proc = subprocess.run(
        [BIN, "--backend", "go_busybox", "--warm-pool", "2"],
        capture_output=True, text=True, timeout=30, env=kbb.env(kbb.home()), stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 1
    assert "--warm-pool (KILNTAINERS_WARM_POOL) is only available with --backend docker" in proc.stderr
    proc = subprocess.run(
        [BIN, "--warm-pool", "65"], capture_output=True, text=True, timeout=30,
        env=kbb.env(kbb.home()), stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 2 and "--warm-pool" in proc.stderr and "0..=64" in proc.stderr, proc.stderr
    assert os.environ.get("KILNTAINERS_WARM_POOL") is None
