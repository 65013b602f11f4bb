"""Checkpoints, rollback and fork (docs/checkpoints.md) over stdio with the official Python MCP
client against a real Docker engine: the switch (off: nothing changes), a tree of binary files,
symlinks, modes and a file later deleted rolled back byte-exact (SHA-256 of the whole tree), the
checkpoint tree after rollbacks and forks, a server restart in between, four forks each
independent, delete leaving no image, a checkpoint while a job and a command run, a rollback
while a command runs, every bad input refused with its message and nothing changed, and a
volume the image declares refused rather than left out.

The same cases run with the exec helper off (scripts/test.sh runs this file again with
KILNTAINERS_EXEC_HELPER=off)."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess

import anyio
import pytest

from harness import BUSYBOX, BUSYBOX_ARGS, RUN_PREFIX, apoll, checkpoint_images, container_for, docker, wait_exit
from test_principals import ALICE, BOB

pytestmark = [pytest.mark.anyio, pytest.mark.client_independent]

CHECKPOINT_ARGS = [*BUSYBOX_ARGS, "--checkpoint-tools", "--lifecycle-tools"]
CHECKPOINT_TOOLS = ["computer_checkpoint", "computer_rollback", "computer_fork", "checkpoint_list", "checkpoint_delete"]

# Every entry of /work: type, path, mode, and the content's (or link target's) SHA-256.
TREE_HASH = (
    "cd /work && find . | sort | while read -r f; do "
    'if [ -L "$f" ]; then echo "L $f $(readlink "$f")"; '
    'elif [ -f "$f" ]; then echo "F $f $(stat -c %a "$f") $(sha256sum < "$f")"; '
    'else echo "D $f $(stat -c %a "$f")"; fi; done | sha256sum'
)

MAKE_TREE = (
    "mkdir -p /work/sub/deep && cd /work && "
    "head -c 300000 /dev/urandom > blob.bin && chmod 640 blob.bin && "
    "printf 'hello\\n' > sub/hello.txt && chmod 755 sub/hello.txt && "
    "ln -s sub/hello.txt link && ln -s /nonexistent dangling && "
    "head -c 5000 /dev/urandom > sub/deep/gone.bin && chmod 700 sub/deep"
)

CHANGE_TREE = (
    "cd /work && rm sub/deep/gone.bin && head -c 1000 /dev/urandom >> blob.bin && "
    "chmod 600 sub/hello.txt && rm link && ln -s blob.bin link && echo new > added.txt"
)


async def run(srv, command: str, cid: str):
    """terminal_execute on a permanent computer."""
    return await srv.run(command, computer_id=cid, temporary=False)


async def tree_hash(srv, cid: str) -> str:
    return (await run(srv, TREE_HASH, cid)).structured["stdout"]


async def call_ok(srv, name: str, args: dict) -> dict:
    res = await srv.call(args, name=name)
    assert not res.is_error, f"{name}: {res.text}"
    return res.structured


async def call_error(srv, name: str, args: dict) -> str:
    res = await srv.call(args, name=name)
    assert res.is_error, f"{name} should have failed: {res.structured}"
    return res.text


async def test_switch_off_changes_nothing(kbb):
    async with kbb.server(*BUSYBOX_ARGS) as srv:
        assert [t["name"] for t in await srv.list_tools()] == ["terminal_execute"]
        with pytest.raises(Exception, match="tool not found"):
            await srv.call({}, name="computer_checkpoint")
        assert "checkpoint" not in srv.init.get("instructions", "")
        assert "checkpoint tools" not in srv.stderr()


async def test_switch_on_lists_the_tools_before_the_lifecycle_tools(kbb):
    async with kbb.server(*BUSYBOX_ARGS, env={"ENABLE_CHECKPOINT_TOOLS": "true", "ENABLE_LIFECYCLE_TOOLS": "true"}) as srv:
        names = [t["name"] for t in await srv.list_tools()]
        assert names[1:6] == CHECKPOINT_TOOLS
        assert names[6] == "computer_dashboard"
        assert "checkpoint tools: on" in srv.stderr()


async def test_rollback_is_byte_exact_and_the_tree_survives_a_restart(kbb):
    cid = kbb.new_id("cp")
    home = kbb.home()
    async with kbb.server(*CHECKPOINT_ARGS, home=home) as srv:
        await run(srv, MAKE_TREE, cid)
        original = await tree_hash(srv, cid)
        first = await call_ok(srv, "computer_checkpoint", {"computer_id": cid, "name": "base", "note": "before changes"})
        assert list(first) == ["computer_id", "checkpoint", "parent", "created_at", "size_bytes", "memory", "note"]
        assert first["checkpoint"] == "base" and first["parent"] is None and first["memory"] is False
        assert first["note"] == "before changes"
        assert first["size_bytes"] >= 300000
        await run(srv, CHANGE_TREE, cid)
        changed = await tree_hash(srv, cid)
        assert changed != original
        await call_ok(srv, "computer_checkpoint", {"computer_id": cid, "name": "changed"})
        before = container_for(cid)
        rolled = await call_ok(srv, "computer_rollback", {"computer_id": cid, "checkpoint": "base"})
        assert list(rolled) == ["computer_id", "checkpoint", "restored_at", "memory"]
        assert container_for(cid) != before
        assert await tree_hash(srv, cid) == original
        await run(srv, "test -f /work/sub/deep/gone.bin", cid)
        await call_ok(srv, "computer_checkpoint", {"computer_id": cid, "name": "retry"})
    # A second server process finds everything through the labels.
    async with kbb.server(*CHECKPOINT_ARGS) as srv:
        listed = await call_ok(srv, "checkpoint_list", {"computer_id": cid})
        assert listed["current"] == "retry"
        tree = [(c["checkpoint"], c["parent"]) for c in listed["checkpoints"]]
        assert tree == [("base", None), ("changed", "base"), ("retry", "base")]
        await call_ok(srv, "computer_rollback", {"computer_id": cid, "checkpoint": "changed"})
        assert await tree_hash(srv, cid) == changed
        assert (await call_ok(srv, "checkpoint_list", {"computer_id": cid}))["current"] == "changed"
        # Deleting a checkpoint re-parents its children.
        await call_ok(srv, "checkpoint_delete", {"computer_id": cid, "checkpoint": "base"})
        listed = await call_ok(srv, "checkpoint_list", {"computer_id": cid})
        assert [(c["checkpoint"], c["parent"]) for c in listed["checkpoints"]] == [("changed", None), ("retry", None)]
        # A factory reset keeps the checkpoints, so it can be rolled back.
        await call_ok(srv, "computer_factory_reset", {"computer_id": cid})
        await call_ok(srv, "computer_rollback", {"computer_id": cid, "checkpoint": "changed"})
        assert await tree_hash(srv, cid) == changed
        await call_ok(srv, "computer_delete", {"computer_id": cid})
        assert checkpoint_images({cid}) == []


async def test_four_forks_are_independent_and_leave_nothing(kbb):
    cid = kbb.new_id("fk")
    async with kbb.server(*CHECKPOINT_ARGS) as srv:
        await run(srv, MAKE_TREE, cid)
        original = await tree_hash(srv, cid)
        forked = await call_ok(srv, "computer_fork", {"computer_id": cid, "count": 4})
        forks = forked["computers"]
        for fork in forks:
            kbb.track(fork)
        assert forked["source"] == cid and forked["checkpoint"].startswith("fork-")
        assert forks == [f"{cid}-f{n}" for n in range(1, 5)]
        async with anyio.create_task_group() as tg:
            for n, fork in enumerate(forks):
                tg.start_soon(run, srv, f"echo {n} > /work/mine", fork)
        for n, fork in enumerate(forks):
            assert (await run(srv, "cat /work/mine", fork)).structured["stdout"] == f"{n}\n"
        await run(srv, "rm -r /work/sub", cid)
        await run(srv, "rm /work/mine", forks[0])
        assert await tree_hash(srv, forks[0]) == original
        listed = await call_ok(srv, "checkpoint_list", {"computer_id": forks[1]})
        assert listed["current"] == forked["checkpoint"]
        assert [c["checkpoint"] for c in listed["checkpoints"]] == [forked["checkpoint"]]
        # A fork id that exists, and the next free numbers.
        message = await call_error(srv, "computer_fork", {"computer_id": cid, "new_computer_id": forks[0]})
        assert message == f"Computer '{forks[0]}' already exists; choose another new_computer_id."
        await call_ok(srv, "computer_delete", {"computer_id": cid})
        assert checkpoint_images({cid}) == []
        for fork in forks:
            await call_ok(srv, "computer_delete", {"computer_id": fork})
        assert checkpoint_images({cid, *forks}) == []


async def test_bad_input_is_refused_and_changes_nothing(kbb):
    cid = kbb.new_id("bad")
    async with kbb.server(*CHECKPOINT_ARGS, "--max-checkpoints", "2") as srv:
        await run(srv, "echo x > /x", cid)
        await call_ok(srv, "computer_checkpoint", {"computer_id": cid, "name": "one"})
        sandbox = container_for(cid)
        assert await call_error(srv, "computer_rollback", {"computer_id": cid, "checkpoint": "nope"}) == (
            f"No checkpoint nope on {cid}; checkpoint_list shows them."
        )
        assert await call_error(srv, "computer_checkpoint", {"computer_id": cid, "name": "one"}) == (
            f"Checkpoint one already exists on {cid}."
        )
        assert "lowercase letters" in await call_error(srv, "computer_checkpoint", {"computer_id": cid, "name": "Bad_Name"})
        assert "between 1 and 8" in await call_error(srv, "computer_fork", {"computer_id": cid, "count": 9})
        assert "between 1 and 8" in await call_error(srv, "computer_fork", {"computer_id": cid, "count": 0})
        assert "count 1" in await call_error(srv, "computer_fork", {"computer_id": cid, "count": 2, "new_computer_id": "x"})
        assert "500" in await call_error(srv, "computer_checkpoint", {"computer_id": cid, "note": "n" * 501})
        await call_ok(srv, "computer_checkpoint", {"computer_id": cid, "name": "two"})
        assert "checkpoint_delete" in await call_error(srv, "computer_checkpoint", {"computer_id": cid, "name": "three"})
        assert "No checkpoint" in await call_error(srv, "checkpoint_delete", {"computer_id": cid, "checkpoint": "three"})
        assert container_for(cid) == sandbox
        listed = await call_ok(srv, "checkpoint_list", {"computer_id": cid})
        assert [c["checkpoint"] for c in listed["checkpoints"]] == ["one", "two"]
        await call_ok(srv, "computer_delete", {"computer_id": cid})


async def test_rollback_ends_the_running_command_and_a_checkpoint_does_not(kbb):
    cid = kbb.new_id("run")
    async with kbb.server(*CHECKPOINT_ARGS, "--job-tools") as srv:
        await run(srv, "echo one > /state", cid)
        job = await srv.call({"command": "for i in $(seq 1 60); do echo $i; sleep 0.5; done", "computer_id": cid, "temporary": False, "yield_after": 0})
        job_id = job.structured["job_id"]
        results = {}

        async def slow():
            results["slow"] = await srv.call({"command": "sleep 2; echo done", "computer_id": cid, "temporary": False})

        async with anyio.create_task_group() as tg:
            tg.start_soon(slow)
            await anyio.sleep(0.5)
            cp = await call_ok(srv, "computer_checkpoint", {"computer_id": cid, "name": "mid"})
            assert cp["checkpoint"] == "mid"
            assert "slow" not in results  # the checkpoint did not wait for the command
        assert results["slow"].structured["stdout"] == "done\n"
        jobs = await srv.call({"computer_id": cid}, name="job_list")
        assert any(j["job_id"] == job_id and j["running"] for j in jobs.structured["jobs"])
        await run(srv, "echo two > /state", cid)

        async def long():
            results["long"] = await srv.call({"command": "sleep 60", "computer_id": cid, "temporary": False})

        async with anyio.create_task_group() as tg:
            tg.start_soon(long)
            await anyio.sleep(1)
            await call_ok(srv, "computer_rollback", {"computer_id": cid, "checkpoint": "mid"})
        assert results["long"].is_error and "rolled back" in results["long"].text
        assert (await run(srv, "cat /state", cid)).structured["stdout"] == "one\n"
        # The job ended with the old computer's processes.
        jobs = await srv.call({"computer_id": cid}, name="job_list")
        assert not any(j["job_id"] == job_id and j["running"] for j in jobs.structured.get("jobs", []))
        await call_ok(srv, "computer_delete", {"computer_id": cid})


PODMAN_SOCKET = os.environ.get("KILNTAINERS_PODMAN_SOCKET", "unix:///run/podman/podman.sock")


def podman(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=60)


def podman_checkpoint_images(prefix: str) -> list[str]:
    out = podman("images", "--format", "{{.Repository}}:{{.Tag}}").stdout
    return [line for line in out.split() if f"kilntainers-checkpoint/{prefix}" in line]


async def test_podman_core_case(kbb):
    """Podman through its Docker-compatible API: checkpoint, rollback byte-exact, a fork, and
    delete leaving no image."""
    if not os.path.exists(PODMAN_SOCKET.removeprefix("unix://")):
        pytest.skip("no Podman socket")
    cid = kbb.new_id("pod")
    args = ["--engine", "podman", "--docker-host", PODMAN_SOCKET, "--image", "localhost/sandbox-busybox:full",
            "--shell", "/bin/sh", "--checkpoint-tools", "--lifecycle-tools"]
    try:
        async with kbb.server(*args) as srv:
            await run(srv, MAKE_TREE, cid)
            original = await tree_hash(srv, cid)
            await call_ok(srv, "computer_checkpoint", {"computer_id": cid, "name": "base"})
            await run(srv, CHANGE_TREE, cid)
            assert await tree_hash(srv, cid) != original
            await call_ok(srv, "computer_rollback", {"computer_id": cid, "checkpoint": "base"})
            assert await tree_hash(srv, cid) == original
            forked = await call_ok(srv, "computer_fork", {"computer_id": cid, "checkpoint": "base"})
            assert forked["computers"] == [f"{cid}-f1"]
            assert await tree_hash(srv, f"{cid}-f1") == original
            listed = await call_ok(srv, "checkpoint_list", {"computer_id": cid})
            assert listed["current"] == "base"
            for computer in (cid, f"{cid}-f1"):
                await call_ok(srv, "computer_delete", {"computer_id": computer})
            assert podman_checkpoint_images(cid) == []
    finally:
        for name in (f"kilntainer-{cid}", f"kilntainer-{cid}-f1"):
            podman("rm", "-f", name)
        images = podman_checkpoint_images(cid)
        if images:
            podman("rmi", "-f", *images)


async def test_crash_gc_removes_the_checkpoints_of_a_killed_servers_temporary_computers(kbb):
    """A server killed with SIGKILL cannot remove its temporary computers or their checkpoints;
    the next server on the same home removes both. A permanent computer's stay."""
    home = kbb.home()
    perm = kbb.new_id("gcp")
    async with kbb.server(*CHECKPOINT_ARGS, home=home) as a:
        tmp = (await a.run("echo a > /a")).structured["computer_id"]
        await call_ok(a, "computer_checkpoint", {"computer_id": tmp, "name": "t1"})
        await run(a, "echo p > /p", perm)
        await call_ok(a, "computer_checkpoint", {"computer_id": perm, "name": "p1"})
        os.kill(a.pid, signal.SIGKILL)
        assert wait_exit(a, 10) == -signal.SIGKILL
    assert checkpoint_images({tmp}) == [f"kilntainers-checkpoint/{tmp}:t1"]
    async with kbb.server(*CHECKPOINT_ARGS, home=home) as b:
        assert await apoll(lambda: container_for(tmp) is None and not checkpoint_images({tmp}), 20, 0.2)
        assert checkpoint_images({perm}) == [f"kilntainers-checkpoint/{perm}:p1"]
        await call_ok(b, "computer_rollback", {"computer_id": perm, "checkpoint": "p1"})
        await call_ok(b, "computer_delete", {"computer_id": perm})
        assert checkpoint_images({perm}) == []


def owner_tag(principal: str) -> str:
    return hashlib.sha256(principal.encode()).hexdigest()[:16]


async def test_another_principal_gets_the_unknown_name_answer(kbb, tmp_path):
    """Checkpoints belong to the computer's principal: with the same computer_id, another
    principal reaches its own computer, where the checkpoint is unknown (docs/auth.md)."""
    tokens = {ALICE: "alice-" + "a" * 40, BOB: "bob-" + "b" * 40}
    path = tmp_path / "tokens"
    path.write_text("".join(f"{p}  {t}\n" for p, t in tokens.items()))
    path.chmod(0o600)
    box = kbb.new_id("shared")
    for principal in tokens:
        kbb.track(f"{box}.{owner_tag(principal)}", temporary=False)
    async with kbb.http_server("--auth-tokens-file", str(path), *CHECKPOINT_ARGS) as srv:
        async with kbb.http_session(srv, headers={"Authorization": f"Bearer {tokens[ALICE]}"}) as alice, \
                kbb.http_session(srv, headers={"Authorization": f"Bearer {tokens[BOB]}"}) as bob:
            await alice.run("echo alice > /who", computer_id=box, temporary=False)
            await call_ok(alice, "computer_checkpoint", {"computer_id": box, "name": "mine"})
            unknown = f"No checkpoint mine on {box}; checkpoint_list shows them."
            assert await call_error(bob, "computer_rollback", {"computer_id": box, "checkpoint": "mine"}) == unknown
            assert await call_error(bob, "checkpoint_delete", {"computer_id": box, "checkpoint": "mine"}) == unknown
            assert await call_error(bob, "computer_fork", {"computer_id": box, "checkpoint": "mine"}) == unknown
            assert (await call_ok(bob, "checkpoint_list", {"computer_id": box}))["checkpoints"] == []
            assert (await call_ok(alice, "checkpoint_list", {"computer_id": box}))["current"] == "mine"
            for session in (alice, bob):
                await call_ok(session, "computer_delete", {"computer_id": box})
    assert checkpoint_images({f"{box}.{owner_tag(p)}" for p in tokens}) == []


async def test_a_volume_the_image_declares_is_refused_and_nothing_recorded(kbb):
    """A commit never holds a volume's files, so a computer with one is refused, never
    checkpointed without its data (docs/checkpoints.md, "Docker and Podman", Volumes)."""
    image = f"kbb-volume-{RUN_PREFIX}:latest"
    subprocess.run(["docker", "build", "-q", "-t", image, "-"], input=f"FROM {BUSYBOX}\nVOLUME /data\n",
                   text=True, capture_output=True, check=True, timeout=120)
    cid = kbb.new_id("vol")
    try:
        async with kbb.server("--image", image, "--shell", "/bin/sh", "--checkpoint-tools", "--lifecycle-tools") as srv:
            await run(srv, "echo kept > /data/f && echo top > /top", cid)
            message = await call_error(srv, "computer_checkpoint", {"computer_id": cid, "name": "v1"})
            assert message == (
                f"Cannot checkpoint computer '{cid}': the volume at /data cannot be checkpointed "
                "(its files are not part of the computer's image); nothing was recorded."
            )
            message = await call_error(srv, "computer_fork", {"computer_id": cid})
            assert "the volume at /data cannot be checkpointed" in message
            listed = await call_ok(srv, "checkpoint_list", {"computer_id": cid})
            assert listed["checkpoints"] == [] and listed["current"] is None
            assert checkpoint_images({cid}) == []
            assert (await run(srv, "cat /data/f", cid)).structured["stdout"] == "kept\n"
            await call_ok(srv, "computer_delete", {"computer_id": cid})
    finally:
        docker("rmi", "-f", image, check=False)
