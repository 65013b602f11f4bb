"""Crash recovery (docs/decisions.md, "Crash recovery"): a server killed with SIGKILL leaves its temporary computer
behind; the next server started with the same HOME removes it in the background within ~10 s,
logs `kilntainers: removed <n> temporary computer(s) left by a previous server: <ids>` and deletes
the dead instance's lock file.  Permanent computers, containers without an instance marker
(Python reference) and the temporary computers of a server that is still alive are never
touched (docs/decisions.md, "Acceptance checklist" item 13)."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from harness import (
    BUSYBOX,
    BUSYBOX_ARGS,
    apoll,
    container_for,
    inspect,
    is_running,
    wait_exit,
)

pytestmark = [pytest.mark.anyio, pytest.mark.client_independent]

GC_BOUND = 10.0


def gc_line(ids: list[str]) -> str:
    return f"kilntainers: removed {len(ids)} temporary computer(s) left by a previous server: {', '.join(ids)}"


async def start_and_crash(kbb, home, *, permanent_id: str | None = None):
    """Start server A in `home`, give it a temporary default computer (and optionally a
    permanent one), SIGKILL it and return (temporary id, container, instance id)."""
    async with kbb.server(*BUSYBOX_ARGS, home=home) as a:
        tmp_id = (await a.run("echo a > /tmp/a")).structured["computer_id"]
        if permanent_id:
            await a.run("true", computer_id=permanent_id, temporary=False)
        container = container_for(tmp_id)
        instance = inspect(container)["Config"]["Labels"]["kilntainers.instance"]
        locks = kbb.instance_locks(home)
        assert instance in [p.stem for p in locks]
        data = json.loads((home / ".mcp-sandbox-computer-vm-for-ai" / "instances" / f"{instance}.lock").read_text())
        assert data["pid"] == a.pid
        os.kill(a.pid, signal.SIGKILL)
        rc = wait_exit(a, 10)
        assert rc == -signal.SIGKILL, rc
    # the killed server could not clean up
    assert container_for(tmp_id) == container and is_running(container)
    return tmp_id, container, instance


async def test_crash_gc_removes_dead_servers_temporaries(kbb):
    home = kbb.home()
    perm = kbb.new_id("gc-perm")
    tmp_id, container, dead_instance = await start_and_crash(kbb, home, permanent_id=perm)
    perm_container = container_for(perm)
    # a temporary container without an instance marker (as the Python reference makes them)
    noinst = kbb.new_id("gc-noinst")
    noinst_container = kbb.python_style_container(noinst, BUSYBOX, temporary="true")

    async with kbb.server(*BUSYBOX_ARGS, home=home) as b:
        started = time.monotonic()
        gone = await apoll(lambda: container_for(tmp_id) is None, GC_BOUND + 5, 0.2)
        took = time.monotonic() - started
        assert gone, f"crash GC did not remove {tmp_id} within {GC_BOUND + 5} s"
        assert took <= GC_BOUND, f"crash GC took {took:.1f} s"
        line = gc_line([tmp_id])
        logged = await apoll(lambda: line in b.stderr().splitlines(), 5, 0.1)
        assert logged, f"missing log line {line!r} in stderr:\n{b.stderr()[-3000:]}"
        # the dead instance's lock file is gone; B's own lock file exists
        locks = await apoll(lambda: dead_instance not in [p.stem for p in kbb.instance_locks(home)], 5, 0.1)
        assert locks, "dead instance lock file not deleted"
        assert len(kbb.instance_locks(home)) == 1
        # untouched: the permanent computer and the marker-less temporary container
        assert is_running(perm_container)
        assert container_for(noinst) == noinst_container and is_running(noinst_container)
        # B works normally
        res = await b.run("echo b")
        assert res.structured["stdout"] == "b\n"
    assert b.returncode() == 0


async def test_live_servers_computers_are_not_collected(kbb):
    """Server C is alive and holds a temporary computer when server D starts with the same HOME.
    A crashed server's computer is the synchronisation point: once D has collected it, C's
    computer must still exist and work."""
    home = kbb.home()
    async with kbb.server(*BUSYBOX_ARGS, home=home) as c:
        c_id = (await c.run("echo c > /tmp/c")).structured["computer_id"]
        c_container = container_for(c_id)
        tmp_id, _container, _instance = await start_and_crash(kbb, home)

        async with kbb.server(*BUSYBOX_ARGS, home=home) as d:
            gone = await apoll(lambda: container_for(tmp_id) is None, GC_BOUND + 5, 0.2)
            assert gone, "crash GC of the dead server did not run"
            line = gc_line([tmp_id])
            assert await apoll(lambda: line in d.stderr().splitlines(), 5, 0.1), d.stderr()[-3000:]
            # C's computer is untouched and C still uses it
            assert container_for(c_id) == c_container and is_running(c_container)
            res = await c.run("cat /tmp/c")
            assert res.structured["computer_id"] == c_id and res.structured["stdout"] == "c\n"
            # D's own session is unaffected by C
            d_id = (await d.run("true")).structured["computer_id"]
            assert d_id != c_id
        assert d.returncode() == 0
        # C's computer survives D's shutdown too
        assert container_for(c_id) == c_container and is_running(c_container)
        res = await c.run("cat /tmp/c")
        assert res.structured["stdout"] == "c\n"
    assert c.returncode() == 0
