"""Jobs (docs/jobs.md) over stdio with the official Python MCP client against a real Docker
engine: the switch, yield_after, following a job to its end with no byte lost or repeated,
long-polling, an interactive program driven through job_write, job_kill of a whole tree, a
10 MB log read back in capped pages, a job on a permanent computer surviving a SIGKILL of the
server, foreground calls beside running jobs, --max-jobs, and every validation message.

The same cases run with the exec helper off (scripts/test.sh runs this file again with
KILNTAINERS_EXEC_HELPER=off)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time

import anyio
import pytest

from harness import BUSYBOX_ARGS, apoll, container_for, docker_exec, dump, poll, proc_scan_command

pytestmark = pytest.mark.anyio

JOB_TOOLS = ["terminal_execute", "job_output", "job_write", "job_kill", "job_list"]
YIELD_FIELDS = ["computer_id", "temporary", "stdout", "stderr", "exit_code", "exec_duration_ms", "job_id", "running"]
OUTPUT_FIELDS = ["job_id", "computer_id", "running", "exit_code", "stdout", "stderr", "next_since", "elapsed_ms"]
MORE = "[kilntainers: more output waiting; call job_output again]"


def without_marker(stdout: str) -> str:
    """The output of a page: the marker comes after a newline of its own."""
    return stdout[: -len(MORE) - 1] if stdout.endswith("\n" + MORE) else stdout
JOBS_ARGS = [*BUSYBOX_ARGS, "--job-tools"]


async def follow(srv, job_id: str, deadline: float = 60.0, wait: int = 2) -> tuple[str, str, dict]:
    """Reads a job to its end with job_output (session cursor); returns stdout, stderr and the
    last result."""
    out, err = [], []
    end = time.monotonic() + deadline
    while True:
        res = (await srv.call({"job_id": job_id, "wait": wait}, name="job_output")).ok()
        data = res.structured
        assert list(data) == OUTPUT_FIELDS
        out.append(without_marker(data["stdout"]))
        err.append(data["stderr"])
        if not data["running"] and not data["stdout"].endswith(MORE):
            return "".join(out), "".join(err), data
        assert time.monotonic() < end, f"job {job_id} still running after {deadline}s"


async def test_switch_off_changes_nothing_and_on_adds_four_tools(kbb):
    async with kbb.server(*BUSYBOX_ARGS) as srv:
        tools = await srv.list_tools()
        assert [t["name"] for t in tools] == ["terminal_execute"]
        assert "yield_after" not in tools[0]["inputSchema"]["properties"]
        assert "yield_after" not in srv.init["instructions"]
        res = (await srv.call({"command": "echo hi", "yield_after": 0})).ok()
        assert "job_id" not in res.structured
    async with kbb.server(*BUSYBOX_ARGS, env={"ENABLE_JOB_TOOLS": " TRUE "}) as srv:
        tools = await srv.list_tools()
        assert [t["name"] for t in tools] == JOB_TOOLS
        props = tools[0]["inputSchema"]["properties"]
        assert props["yield_after"]["type"] == "integer"
        assert tools[0]["outputSchema"]["properties"]["exit_code"]["type"] == ["integer", "null"]
        assert "pass yield_after to terminal_execute and follow the job with job_output" in srv.init["instructions"]
    async with kbb.server(*BUSYBOX_ARGS, "--job-tools", "--lifecycle-tools") as srv:
        names = [t["name"] for t in await srv.list_tools()]
        assert names[:5] == JOB_TOOLS and names[5] == "computer_dashboard"


async def test_a_quick_command_ends_within_yield_after_with_the_ordinary_result(kbb):
    async with kbb.server(*JOBS_ARGS) as srv:
        res = (await srv.call({"command": "echo out; echo err >&2; exit 3", "yield_after": 30})).ok()
        data = res.structured
        assert list(data) == YIELD_FIELDS[:7]
        assert (data["stdout"], data["stderr"], data["exit_code"]) == ("out\n", "err\n", 3)
        assert data["job_id"].startswith("j-") and len(data["job_id"]) == 10
        listed = (await srv.call({}, name="job_list")).ok().structured
        assert listed["count"] == 1 and listed["jobs"][0]["job_id"] == data["job_id"]
        assert listed["jobs"][0]["running"] is False and listed["jobs"][0]["exit_code"] == 3


async def test_a_job_is_followed_to_its_exit_code_with_no_byte_lost_or_repeated(kbb):
    script = "i=0; while [ $i -lt 25 ]; do echo line $i; echo warn $i >&2; i=$((i+1)); sleep 0.2; done; exit 7"
    async with kbb.server(*JOBS_ARGS) as srv:
        t0 = time.monotonic()
        res = (await srv.call({"command": script, "yield_after": 1})).ok()
        assert time.monotonic() - t0 < 4.5
        data = res.structured
        assert list(data) == YIELD_FIELDS
        assert data["running"] is True and data["exit_code"] is None
        out, err, last = await follow(srv, data["job_id"])
        out = data["stdout"] + out
        err = data["stderr"] + err
        assert out == "".join(f"line {i}\n" for i in range(25))
        assert err == "".join(f"warn {i}\n" for i in range(25))
        assert last["exit_code"] == 7 and last["elapsed_ms"] >= 4000
        # `since` reads the combined stream again from any offset.
        again = (await srv.call({"job_id": data["job_id"], "since": 0}, name="job_output")).ok().structured
        assert again["stdout"] == out and again["stderr"] == err
        assert again["next_since"] == len(out) + len(err)
        # Reading from an explicit offset leaves the session's own place alone.
        (await srv.call({"job_id": data["job_id"], "since": 5}, name="job_output")).ok()
        after = (await srv.call({"job_id": data["job_id"]}, name="job_output")).ok().structured
        assert (after["stdout"], after["stderr"], after["next_since"]) == ("", "", len(out) + len(err))


async def test_wait_returns_early_when_output_arrives(kbb):
    async with kbb.server(*JOBS_ARGS) as srv:
        res = (await srv.call({"command": "sleep 2; echo late; sleep 30", "yield_after": 0})).ok().structured
        job = res["job_id"]
        t0 = time.monotonic()
        got = (await srv.call({"job_id": job, "wait": 30}, name="job_output")).ok().structured
        took = time.monotonic() - t0
        assert got["stdout"] == "late\n" and got["running"] is True
        assert took < 15, took
        (await srv.call({"job_id": job, "signal": "KILL"}, name="job_kill")).ok()


async def test_an_interactive_read_is_answered_through_job_write(kbb):
    prog = 'printf "name? "; read name; echo "hello $name"; printf "again? "; read a; echo "bye $a"'
    async with kbb.server(*JOBS_ARGS) as srv:
        res = (await srv.call({"command": prog, "yield_after": 1, "keep_stdin_open": True})).ok().structured
        assert res["running"] is True and res["stdout"] == "name? "
        job = res["job_id"]
        got = (await srv.call({"job_id": job, "stdin": "ada\n", "wait": 5}, name="job_write")).ok().structured
        assert got["stdout"].startswith("hello ada\n"), got
        got = (await srv.call({"job_id": job, "stdin": "now\n", "close_stdin": True, "wait": 5}, name="job_write")).ok().structured
        out, _, last = await follow(srv, job)
        assert "bye now\n" in got["stdout"] + out
        assert last["exit_code"] == 0
        refused = await srv.call({"job_id": job, "stdin": "more\n"}, name="job_write")
        assert refused.is_error and refused.text == f"Job {job} is not accepting input."


async def test_job_kill_ends_the_whole_tree(kbb):
    async with kbb.server(*JOBS_ARGS) as srv:
        sleeps = ["sleep 301", "sleep 302", "sleep 303"]
        cmd = "sh -c 'sleep 301' & (setsid sh -c 'sleep 302' &) ; sleep 303"
        res = (await srv.call({"command": cmd, "yield_after": 1})).ok().structured
        job, computer = res["job_id"], res["computer_id"]
        container = container_for(computer)
        scan = proc_scan_command(*sleeps)

        def running() -> int:
            return sum(line.split(" ", 1)[1].strip() in sleeps for line in docker_exec(container, "sh", "-c", scan).stdout.splitlines())

        assert poll(lambda: running() == 3, 10)
        t0 = time.monotonic()
        killed = (await srv.call({"job_id": job}, name="job_kill")).ok().structured
        assert killed["running"] is False and time.monotonic() - t0 < 20
        assert running() == 0
        # Killing an ended job returns its final state.
        again = (await srv.call({"job_id": job, "signal": "KILL"}, name="job_kill")).ok().structured
        assert again["running"] is False and again["exit_code"] == killed["exit_code"]


async def test_ten_megabytes_of_output_come_back_whole_in_capped_pages(kbb):
    limit = 1_000_000
    async with kbb.server(*JOBS_ARGS, "--output-limit", str(limit)) as srv:
        cmd = "i=0; while [ $i -lt 100000 ]; do printf '%099d\\n' $i; i=$((i+1)); done"
        res = (await srv.call({"command": cmd, "yield_after": 0})).ok().structured
        job = res["job_id"]
        assert len(without_marker(res["stdout"]).encode()) <= limit
        out, pages = [without_marker(res["stdout"])], 1  # the first page came with the start
        while True:
            got = (await srv.call({"job_id": job, "wait": 5}, name="job_output")).ok().structured
            text = got["stdout"]
            assert len(without_marker(text).encode()) <= limit
            out.append(without_marker(text))
            pages += 1
            if not got["running"] and not text.endswith(MORE):
                break
        whole = (await srv.call({"job_id": job, "since": 0}, name="job_output")).ok().structured
        assert whole["stdout"].endswith("\n" + MORE)
        expected = "".join(f"{i:099d}\n" for i in range(100000))
        assert hashlib.sha256("".join(out).encode()).hexdigest() == hashlib.sha256(expected.encode()).hexdigest()
        assert pages >= 10


async def test_foreground_calls_run_beside_ten_jobs(kbb):
    async with kbb.server(*JOBS_ARGS) as srv:
        first = (await srv.call({"command": "echo ready"})).ok().structured
        jobs = []
        for i in range(10):
            res = (await srv.call({"command": f"echo job{i}; sleep 20", "yield_after": 0})).ok().structured
            jobs.append(res["job_id"])
        results = {}

        async def fg(i: int) -> None:
            results[i] = (await srv.call({"command": f"echo fg{i}"})).ok().structured

        t0 = time.monotonic()
        async with anyio.create_task_group() as tg:
            for i in range(10):
                tg.start_soon(fg, i)
        assert time.monotonic() - t0 < 15
        assert all(results[i]["stdout"] == f"fg{i}\n" for i in range(10))
        listed = (await srv.call({"computer_id": first["computer_id"]}, name="job_list")).ok().structured
        assert listed["count"] == 10 and all(j["running"] for j in listed["jobs"])
        assert sorted(j["job_id"] for j in listed["jobs"]) == sorted(jobs)
        for job in jobs:
            (await srv.call({"job_id": job, "signal": "KILL"}, name="job_kill")).ok()


async def test_max_jobs_is_enforced_with_the_spec_message(kbb):
    async with kbb.server(*JOBS_ARGS, "--max-jobs", "2") as srv:
        a = (await srv.call({"command": "sleep 60", "yield_after": 0})).ok().structured
        (await srv.call({"command": "sleep 60", "yield_after": 0, "computer_id": None})).ok()
        third = await srv.call({"command": "sleep 60", "yield_after": 0})
        assert third.is_error
        assert third.text == (
            f"Computer {a['computer_id']} already runs 2 jobs; wait for one to end or kill one with job_kill."
        )
        # An ended job frees its place.
        (await srv.call({"job_id": a["job_id"], "signal": "KILL"}, name="job_kill")).ok()
        (await srv.call({"command": "sleep 60", "yield_after": 0})).ok()


async def test_validation_messages(kbb):
    async with kbb.server(*JOBS_ARGS) as srv:
        cases = [
            ({"command": "x", "yield_after": -1}, "terminal_execute", "yield_after must be between 0 and 3600 seconds."),
            ({"command": "x", "yield_after": 3601}, "terminal_execute", "yield_after must be between 0 and 3600 seconds."),
            ({"job_id": "j-00000000"}, "job_output", "Job j-00000000 not found."),
            ({"job_id": "nope"}, "job_output", "Job nope not found."),
            ({"job_id": "j-00000000", "stdin": "x"}, "job_write", "Job j-00000000 not found."),
            ({"job_id": "j-00000000"}, "job_kill", "Job j-00000000 not found."),
            ({"job_id": "j-00000000", "wait": 61}, "job_output", "wait must be between 0 and 60 seconds."),
            ({"job_id": "j-00000000", "signal": "STOP"}, "job_kill", "signal must be one of TERM, INT, KILL, HUP."),
        ]
        for args, tool, message in cases:
            res = await srv.call(args, name=tool)
            assert res.is_error and res.text == message, (tool, args, res)
        assert (await srv.call({}, name="job_list")).ok().structured == {"jobs": [], "count": 0}
        assert srv.containers() == [], "job_list without a default computer creates none"


async def test_timeout_is_the_jobs_wall_clock_limit(kbb):
    async with kbb.server(*JOBS_ARGS) as srv:
        res = (await srv.call({"command": "echo started; sleep 60", "yield_after": 0, "timeout": 2})).ok().structured
        out, err, last = await follow(srv, res["job_id"], deadline=30)
        assert last["exit_code"] == 124
        assert err.endswith("[kilntainers: command timed out after 2s]")


async def test_a_job_on_a_permanent_computer_survives_a_server_sigkill(kbb):
    cid = kbb.new_id("jobs-keep")
    home = kbb.home()
    async with kbb.server(*JOBS_ARGS, home=home) as srv:
        res = (await srv.call({"command": "i=0; while :; do echo tick $i; i=$((i+1)); sleep 0.2; done",
                               "yield_after": 1, "computer_id": cid, "temporary": False})).ok().structured
        job = res["job_id"]
        os.kill(srv.pid, signal.SIGKILL)
        kbb.track(cid, temporary=False)
    async with kbb.server(*JOBS_ARGS, home=home) as srv:
        listed = (await srv.call({"computer_id": cid}, name="job_list")).ok().structured
        assert [j["job_id"] for j in listed["jobs"]] == [job] and listed["jobs"][0]["running"] is True
        got = (await srv.call({"job_id": job, "since": 0, "wait": 2}, name="job_output")).ok().structured
        assert got["running"] is True and got["stdout"].startswith("tick 0\ntick 1\n")
        killed = (await srv.call({"job_id": job}, name="job_kill")).ok().structured
        assert killed["running"] is False
    async with kbb.server(*JOBS_ARGS, home=home) as srv:
        # A fresh process that never listed the computer still finds the job by its id.
        got = (await srv.call({"job_id": job}, name="job_output")).ok().structured
        assert got["running"] is False and got["computer_id"] == cid


async def test_progress_notifications_for_foreground_calls(kbb):
    async with kbb.server(*BUSYBOX_ARGS) as srv:
        seen: list[tuple[float, str | None]] = []

        async def on_progress(progress: float, total: float | None, message: str | None) -> None:
            seen.append((progress, message))

        res = await srv.session.call_tool(
            "terminal_execute",
            {"command": "for i in 1 2 3 4; do echo step $i; sleep 1; done"},
            progress_callback=on_progress,
        )
        raw = dump(res)
        assert not raw.get("isError")
        assert len(seen) >= 2, seen
        assert any(m and m.startswith("step ") for _, m in seen), seen
        assert all(b[0] >= a[0] for a, b in zip(seen, seen[1:])), seen
        data = json.loads(raw["content"][0]["text"])
        assert data["stdout"].count("step") == 4


async def test_restart_ends_jobs_and_delete_removes_them(kbb):
    cid = kbb.new_id("jobs-restart")
    async with kbb.server(*JOBS_ARGS, "--lifecycle-tools") as srv:
        res = (await srv.call({"command": "sleep 300", "yield_after": 0, "computer_id": cid})).ok().structured
        job = res["job_id"]
        (await srv.call({"computer_id": cid}, name="computer_restart")).ok()
        listed = (await srv.call({"computer_id": cid}, name="job_list")).ok().structured
        (row,) = listed["jobs"]
        assert row["job_id"] == job and row["running"] is False
        assert row["exit_code"] is None and row["ended_at"]
        got = (await srv.call({"job_id": job}, name="job_output")).ok().structured
        assert got["running"] is False and got["exit_code"] is None
        (await srv.call({"computer_id": cid}, name="computer_delete")).ok()
        gone = await srv.call({"job_id": job}, name="job_output")
        assert gone.is_error and gone.text == f"Job {job} not found."


FORGED_SLEEPS = ["sleep 1231", "sleep 1232", "sleep 1233"]
# Orphans of a command that forged job tags: of a job that does not exist, a supervisor's tag,
# and a job whose directory the command made itself (a directory alone is no running job).
FORGE_JOB_TAGS = (
    "(KILNTAINERS_EXEC_ID=job-j-0badf00d setsid sleep 1231 &); "
    "(KILNTAINERS_EXEC_ID=jobsup-j-0badf00e setsid sleep 1232 &); "
    "mkdir -p /.kilntainers/jobs/j-0badf00f && echo 1 > /.kilntainers/jobs/j-0badf00f/pid; "
    "(KILNTAINERS_EXEC_ID=job-j-0badf00f setsid sleep 1233 &); "
    "sleep 100"
)


@pytest.mark.parametrize("helper", ["on", "off"])
async def test_issue_30_a_forged_job_tag_does_not_escape_the_timeout_kill(kbb, helper):
    """See: issue 30 (item 10). Kill sweeps spare orphans tagged `job…` only when that job
    runs: orphans that forged a job tag die with their command's timeout, while a real job
    started on the same computer during that command keeps running."""
    async with kbb.server(*JOBS_ARGS, env={"KILNTAINERS_EXEC_HELPER": helper}) as srv:
        computer = (await srv.run("true")).structured["computer_id"]
        container = container_for(computer)
        real = "sleep 1240"
        scan = proc_scan_command(*FORGED_SLEEPS, real)

        def running() -> list[str]:
            out = docker_exec(container, "sh", "-c", scan).stdout
            return sorted(line.split(" ", 1)[1].strip() for line in out.splitlines())

        outcome: dict = {}

        async def forge() -> None:
            outcome["res"] = await srv.call({"command": FORGE_JOB_TAGS, "timeout": 5})

        async with anyio.create_task_group() as tg:
            tg.start_soon(forge)
            assert await apoll(lambda: running() == FORGED_SLEEPS, 10), running()
            job = (await srv.call({"command": real, "yield_after": 0})).ok().structured["job_id"]
        assert outcome["res"].ok().structured["exit_code"] == 124
        assert running() == [real], "an orphan with a forged job tag outlived its command's timeout"
        listed = (await srv.call({}, name="job_list")).ok().structured
        assert [(j["job_id"], j["running"]) for j in listed["jobs"]] == [(job, True)]
        (await srv.call({"job_id": job, "signal": "KILL"}, name="job_kill")).ok()
        assert running() == []
