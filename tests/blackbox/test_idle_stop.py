"""Idle stop with a real engine (docs/idle-stop.md): `--idle-stop 3s` stops a permanent computer
nobody uses even while a client lists computers every second, the next command starts it again
with its files, a temporary computer is never stopped, a running job keeps its computer awake,
another server's helper on the computer keeps it running, and bad durations and the Modal
backend are refused at startup."""

from __future__ import annotations

import subprocess
import time

import anyio
import pytest

from harness import BIN, BUSYBOX_ARGS, container_for, is_running

pytestmark = [pytest.mark.anyio, pytest.mark.client_independent]

IDLE = "3s"
# The stop comes within the duration plus one round (a quarter of it) plus the docker stop's
# grace; the deadline is generous for a loaded machine.
STOP_DEADLINE = 30.0


async def wait_stopped(container: str, deadline: float, while_waiting=None) -> bool:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if not is_running(container):
            return True
        if while_waiting is not None:
            await while_waiting()
        await anyio.sleep(0.5)
    return not is_running(container)


async def test_a_forgotten_permanent_computer_stops_despite_listing_and_starts_again(kbb):
    cid = kbb.new_id("idle")
    scratch = kbb.new_id("idle-tmp")
    async with kbb.server(*BUSYBOX_ARGS, "--lifecycle-tools", "--idle-stop", IDLE) as srv:
        await srv.run("echo kept > /root/kept", computer_id=cid, temporary=False)
        await srv.run("true", computer_id=scratch, temporary=True)
        container, temporary = container_for(cid), container_for(scratch)
        listed = await srv.call({}, name="computer_list")
        rows = {row["computer_id"]: row for row in listed.structured["computers"]}
        assert "idle_stop_at" in rows[cid], rows[cid]
        assert "idle_stop_at" not in rows[scratch], "a temporary computer has no idle deadline"

        async def list_again():
            res = await srv.call({}, name="computer_list")
            assert not res.is_error, res

        assert await wait_stopped(container, STOP_DEADLINE, list_again), "listing kept it running"
        assert is_running(temporary), "a temporary computer was stopped"
        res = await srv.run("cat /root/kept", computer_id=cid, temporary=False)
        assert res.structured["stdout"] == "kept\n"
        assert res.structured["exit_code"] == 0
        assert container_for(cid) == container, "started again, not recreated"
        assert is_running(container)


async def test_without_the_option_nothing_stops_and_nothing_is_listed(kbb):
    cid = kbb.new_id("no-idle")
    async with kbb.server(*BUSYBOX_ARGS, "--lifecycle-tools") as srv:
        await srv.run("true", computer_id=cid, temporary=False)
        listed = await srv.call({}, name="computer_list")
        row = next(r for r in listed.structured["computers"] if r["computer_id"] == cid)
        assert "idle_stop_at" not in row


async def test_a_running_job_keeps_its_computer_awake(kbb):
    cid = kbb.new_id("idle-job")
    async with kbb.server(*BUSYBOX_ARGS, "--job-tools", "--idle-stop", IDLE) as srv:
        res = await srv.run("sleep 12; echo done", computer_id=cid, temporary=False, yield_after=0)
        job = res.structured.get("job_id")
        assert job, res.structured
        container = container_for(cid)
        # Well past the duration while the job runs: still running.
        assert not await wait_stopped(container, 8.0), "stopped under a running job"
        stdout, end = "", time.monotonic() + 60
        while True:
            out = (await srv.call({"job_id": job, "wait": 5}, name="job_output")).ok().structured
            stdout += out["stdout"]
            if not out["running"]:
                break
            assert time.monotonic() < end, "the job did not end"
        assert "done" in stdout, out
        # The job ended: now it stops.
        assert await wait_stopped(container, STOP_DEADLINE)


async def test_another_servers_work_keeps_the_computer_running(kbb):
    cid = kbb.new_id("idle-shared")
    async with kbb.server(*BUSYBOX_ARGS) as holder:
        await holder.run("true", computer_id=cid, temporary=False)
        container = container_for(cid)
        async with kbb.server(*BUSYBOX_ARGS, "--idle-stop", IDLE) as idle:
            await idle.run("true", computer_id=cid, temporary=False)
            # A command of the holder runs for longer than the duration, through its own exec.
            with anyio.fail_after(60):
                res = await holder.run("sleep 10; echo still-here", computer_id=cid, temporary=False)
            assert res.structured["stdout"] == "still-here\n"
            assert is_running(container)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("soon", "--idle-stop must be a duration such as 90s, 30m, 2h or 1h30m, or 0 to never stop; got 'soon'."),
        ("31d", "--idle-stop must be between 1s and 30d (or 0 to never stop); got '31d'."),
    ],
)
def test_bad_durations_are_refused_at_startup(value, message, tmp_path):
    proc = subprocess.run(
        [BIN, "--idle-stop", value],
        capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL,
        env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


def test_modal_refuses_idle_stop_at_startup(tmp_path):
    proc = subprocess.run(
        [BIN, "--backend", "modal", "--idle-stop", "30m"],
        capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL,
        env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "MODAL_TOKEN_ID": "ak-x", "MODAL_TOKEN_SECRET": "as-x"},
    )
    assert proc.returncode == 1, proc.stderr
    assert "--idle-stop is not available on the modal backend: a Modal sandbox cannot be stopped and resumed, only terminated." in proc.stderr
