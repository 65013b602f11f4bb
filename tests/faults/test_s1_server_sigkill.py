"""Scenario 1: the server dies by SIGKILL while it holds temporary and permanent computers.
Nothing can run at its end, so the next server started with the same HOME must collect the dead
server's temporary computers (crash GC, docs/decisions.md, "Crash recovery") and attach the permanent ones again,
their files intact."""

from __future__ import annotations

import hashlib
import os
import signal
import time

import anyio
import pytest

from faultkit import bb, instance_containers

pytestmark = [pytest.mark.anyio, pytest.mark.scenario("1")]

# Crash GC runs in the background right after startup (docs/decisions.md, "Crash recovery" says ~10 s); the extra
# margin absorbs a slow engine on a loaded 2-core machine.
GC_DEADLINE = 30.0
# Large enough that a truncated or partly rewritten file cannot go unnoticed.
PERMANENT_FILE_BYTES = 256 * 1024


async def test_sigkill_with_temporary_and_permanent_computers(kbb, figures):
    """A server with three temporary and two permanent computers (one command in flight) is
    killed with SIGKILL; the next server start removes the temporaries (0 left) and reattaches
    the permanents with their files intact."""
    home = kbb.home()
    permanents = [kbb.new_id("s1-perm-a"), kbb.new_id("s1-perm-b")]
    explicit_temporaries = [kbb.new_id("s1-tmp-a"), kbb.new_id("s1-tmp-b")]
    payload = os.urandom(PERMANENT_FILE_BYTES).hex()
    digest = hashlib.md5(payload.encode()).hexdigest()

    async with kbb.server(*bb.BUSYBOX_ARGS, home=home) as a:
        temporaries = [(await a.run("true")).structured["computer_id"]]
        for cid in explicit_temporaries:
            await a.run("true", computer_id=cid, temporary=True)
            temporaries.append(cid)
        for cid in permanents:
            res = await a.run("cat > /root/keep && md5sum /root/keep", computer_id=cid, temporary=False, stdin=payload)
            assert res.structured["stdout"].split()[0] == digest
        before = {cid: bb.container_for(cid) for cid in temporaries + permanents}
        assert all(before.values()), before
        dead_instance = a.instance_id
        assert dead_instance, "no instance lock file for server A"
        # A command still running when the server dies: its process is gone with the container.
        async with anyio.create_task_group() as tg:
            tg.start_soon(_call_ignoring_errors, a, {"command": "sleep 600", "computer_id": explicit_temporaries[0]})
            running = await bb.apoll(
                lambda: "sleep 600" in bb.docker_exec(before[explicit_temporaries[0]], "ps").stdout, 20, 0.2
            )
            assert running, "the in-flight command never started"
            os.kill(a.pid, signal.SIGKILL)
            assert bb.wait_exit(a, 10) == -signal.SIGKILL
            tg.cancel_scope.cancel()

    left_after_crash = len(instance_containers(dead_instance))
    figures["temporaries_left_by_the_crash"] = left_after_crash
    assert left_after_crash == len(temporaries), "the killed server cleaned up (it cannot have)"

    async with kbb.server(*bb.BUSYBOX_ARGS, home=home) as b:
        started = time.monotonic()
        collected = await bb.apoll(lambda: not instance_containers(dead_instance), GC_DEADLINE, 0.2)
        figures["crash_gc_seconds"] = round(time.monotonic() - started, 1)
        left = len(instance_containers(dead_instance))
        figures["temporaries_left_after_restart"] = left
        assert collected and left == 0, f"{left} temporary computers of the killed server survived"

        intact = 0
        for cid in permanents:
            assert bb.container_for(cid) == before[cid], f"{cid} is not the same container any more"
            res = await b.run("md5sum /root/keep", computer_id=cid, temporary=False)
            assert res.structured["computer_id"] == cid and res.structured["temporary"] is False
            assert res.structured["stdout"].split()[0] == digest, f"{cid}: file changed"
            intact += 1
        figures["permanents_reattached_intact"] = f"{intact}/{len(permanents)}"
        new_instance = b.instance_id
    assert b.returncode() == 0
    assert await bb.apoll(lambda: not instance_containers(new_instance), 15, 0.2)
    figures["leftovers_after_shutdown"] = len(instance_containers(dead_instance)) + len(instance_containers(new_instance))
    assert figures["leftovers_after_shutdown"] == 0


async def _call_ignoring_errors(server, arguments: dict) -> None:
    try:
        await server.call(arguments, timeout=700)
    except Exception:  # the server is killed under this call on purpose
        pass
