"""Lifecycle operations and the commands around them (issue 30, items 14 and 15), over stdio
with the official Python client and real Docker: a command queued behind a running one when a
restart, factory reset or delete of its computer begins is interrupted with the message the
running one gets, and never runs; a factory reset whose creation fails leaves no record of the
removed container, so the next command creates the computer again."""

from __future__ import annotations

import anyio
import pytest

from harness import BUSYBOX, RUN_PREFIX, apoll, container_for, docker, docker_exec

pytestmark = pytest.mark.anyio

VERBS = {"restart": "restarted", "factory_reset": "reset", "delete": "deleted"}
# The registry logs at debug when a command waits for its computer's turn: the one sign, seen
# from outside, that the queued command is queued before the lifecycle op begins.
DEBUG_LOG = {"ENABLE_LIFECYCLE_TOOLS": "true", "RUST_LOG": "warn,mcp_sandbox_computer_vm_for_ai=debug"}
QUEUED = "queued for the computer's exec turn"


@pytest.mark.parametrize("op", list(VERBS))
async def test_issue_30_a_command_queued_behind_a_lifecycle_op_is_interrupted(kbb, op):
    """See: issue 30 (item 14)."""
    cid = kbb.new_id(f"queued-{op.replace('_', '-')}")
    async with kbb.server("--image", BUSYBOX, "--shell", "/bin/sh", env=DEBUG_LOG) as srv:
        await srv.run("true", computer_id=cid, temporary=False)
        container = container_for(cid)
        results: dict = {}

        async def call(name: str, arguments: dict, tool: str = "terminal_execute") -> None:
            results[name] = await srv.call(arguments, name=tool)

        async with anyio.create_task_group() as tg:
            tg.start_soon(call, "running", {"command": "touch /tmp/running; sleep 100", "computer_id": cid, "temporary": False})
            assert await apoll(lambda: docker_exec(container, "sh", "-c", "test -f /tmp/running").returncode == 0, 20)
            tg.start_soon(call, "queued", {"command": "touch /tmp/queued; echo ran", "computer_id": cid, "temporary": False})
            assert await apoll(lambda: srv.stderr().count(QUEUED) >= 1, 20), srv.stderr()[-2000:]
            await call(op, {"computer_id": cid}, tool=f"computer_{op}")
        assert not results[op].is_error, results[op]
        message = f"Command interrupted because computer '{cid}' is being {VERBS[op]}."
        for name in ("running", "queued"):
            assert results[name].is_error and results[name].text == message, (name, results[name])
        if op == "restart":
            assert docker_exec(container, "sh", "-c", "test -f /tmp/queued").returncode == 1, "the queued command ran"


async def test_issue_30_a_failed_factory_reset_leaves_the_registry_consistent(kbb):
    """See: issue 30 (item 15). The reset removes the container, then its creation fails (the
    image's only tag is gone and its registry, on a closed loopback port, refuses the pull):
    the error says so, and once the image is back the next command creates the computer
    instead of reporting it vanished."""
    cid = kbb.new_id("reset-fails")
    image = f"127.0.0.1:1/kbb-{RUN_PREFIX}:reset"
    docker("tag", BUSYBOX, image)
    try:
        async with kbb.server("--image", image, "--shell", "/bin/sh", env={"ENABLE_LIFECYCLE_TOOLS": "true"}) as srv:
            await srv.run("echo before > /tmp/mark", computer_id=cid, temporary=False)
            old = container_for(cid)
            docker("rmi", image)
            failed = await srv.call({"computer_id": cid}, name="computer_factory_reset")
            assert failed.is_error and f"Failed to pull image '{image}'" in (failed.text or ""), failed
            assert container_for(cid) is None, "the reset did not remove the old container"
            docker("tag", BUSYBOX, image)
            after = await srv.call({"command": "cat /tmp/mark 2>/dev/null || echo fresh", "computer_id": cid, "temporary": False})
            assert after.ok().structured["stdout"] == "fresh\n", after
            assert container_for(cid) not in (None, old)
            listed = (await srv.call({}, name="computer_list")).ok().structured
            assert [c["computer_id"] for c in listed["computers"] if c["computer_id"] == cid] == [cid]
    finally:
        docker("rmi", image, check=False)
