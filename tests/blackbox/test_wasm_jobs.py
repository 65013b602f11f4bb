"""Jobs on `--backend go_busybox` (docs/jobs.md, "Backends"), over stdio with the official
Python MCP client. A WASM computer has no shell that could keep a process, so its jobs are
tasks of the server and their output is kept in the server's memory. What one computer can
make the server keep is bounded (issue 30, follow-up of item 2): a computer that runs job after
job, each printing nearly the output limit, or thousands of tiny jobs, must not grow the
server. Ended jobs are evicted oldest first past the computer's budget of kept bytes and its
cap on kept jobs; the newest jobs stay readable byte for byte, an evicted job answers "not
found", and the server's peak resident set stays bounded.

The module is obtained as in test_wasm.py (the pinned wheel, cached once per run)."""

from __future__ import annotations

import base64
import time

import anyio
import pytest

from harness import limit_notice, wasm_env
from testkit.procfs import status_kib

pytestmark = [pytest.mark.anyio, pytest.mark.client_independent]

# docs/jobs.md, "A hostile computer": what in-server jobs keep per computer.
KEPT_BYTES_PER_COMPUTER = 16 * 1024 * 1024
# job_list's row limit at the default --max-jobs (16, clamped to at least 64).
KEPT_JOBS_PER_COMPUTER = 64
# Each job prints this file: under the default 2 MiB output limit, 250,000 numbered lines.
BIG_FILE = "".join(f"{i:07d}\n" for i in range(250_000)).encode()
# Jobs run per batch (under the default --max-jobs 16) and batches: 96 jobs print 192 MB in all,
# which a server keeping every ended job's output holds at once.
BATCH = 8
BATCHES = 12
# What the server may hold at its peak: its own ~40 MiB with the module loaded, the computer's
# 16 MiB of kept job output, and a batch's output on its way (each running guest's collected
# output, then its copy into the job). A server that kept every job's output reached 227 MiB.
PEAK_RSS_BOUND_MIB = 100
JOBS_ARGS = ["--backend", "go_busybox", "--job-tools", "--file-tools"]


async def wait_all_ended(srv, cid: str, deadline: float = 120.0) -> dict:
    end = time.monotonic() + deadline
    while True:
        listed = (await srv.call({"computer_id": cid}, name="job_list")).ok().structured
        if not any(job["running"] for job in listed["jobs"]):
            return listed
        assert time.monotonic() < end, f"jobs still running after {deadline}s: {listed}"
        await anyio.sleep(0.1)


# See: issue 30
async def test_issue_30_wasm_jobs_keep_a_bounded_amount_of_output_in_the_server(kbb):
    """96 jobs each print 2 MB: the computer keeps the newest jobs within its 16 MiB budget,
    the oldest are evicted (not found), the newest is read back whole, and the server's peak
    RSS stays bounded instead of holding 192 MB."""
    cid = kbb.new_id("wasm-jobs-bytes")
    async with kbb.server(*JOBS_ARGS, env=wasm_env(kbb)) as srv:
        await srv.run("true", computer_id=cid)
        written = await srv.call(
            {"path": "/big", "content": base64.b64encode(BIG_FILE).decode(), "encoding": "base64", "computer_id": cid},
            name="file_write",
        )
        assert not written.is_error, written
        started: list[str] = []
        for _ in range(BATCHES):
            for _ in range(BATCH):
                res = (await srv.call({"command": "cat /big", "yield_after": 0, "computer_id": cid})).ok()
                started.append(res.structured["job_id"])
            await wait_all_ended(srv, cid)
        hwm = status_kib(srv.pid, "VmHWM")
        print(f"server peak RSS {hwm // 1024} MiB after {len(started)} jobs of {len(BIG_FILE)} bytes")
        assert hwm <= PEAK_RSS_BOUND_MIB * 1024, f"server peak RSS {hwm // 1024} MiB"

        listed = (await srv.call({"computer_id": cid}, name="job_list")).ok().structured
        kept = [job["job_id"] for job in listed["jobs"]]
        assert listed.get("truncated") is None, listed
        assert all(job["exit_code"] == 0 and job["output_bytes"] == len(BIG_FILE) for job in listed["jobs"]), listed
        assert 4 <= len(kept) and sum(job["output_bytes"] for job in listed["jobs"]) <= KEPT_BYTES_PER_COMPUTER
        # The newest jobs are the ones kept, newest first.
        assert kept == started[::-1][: len(kept)]
        newest = (await srv.call({"job_id": started[-1], "since": 0}, name="job_output")).ok().structured
        assert (newest["stdout"].encode(), newest["exit_code"], newest["running"]) == (BIG_FILE, 0, False)
        oldest = await srv.call({"job_id": started[0]}, name="job_output")
        assert oldest.is_error and oldest.text == f"Job {started[0]} not found.", oldest
    assert srv.returncode() == 0


# See: issue 30
async def test_issue_30_wasm_jobs_kept_per_computer_are_capped(kbb):
    """Tiny jobs: past job_list's row limit the oldest ended job is evicted, so the listing
    shows every job the computer keeps (none is hidden behind "truncated") and the first job
    is gone."""
    cid = kbb.new_id("wasm-jobs-count")
    async with kbb.server(*JOBS_ARGS, env=wasm_env(kbb)) as srv:
        started: list[str] = []
        for n in range(KEPT_JOBS_PER_COMPUTER + 6):
            res = (await srv.call({"command": f"echo {n}", "yield_after": 30, "computer_id": cid})).ok()
            assert (res.structured["stdout"], res.structured["exit_code"]) == (f"{n}\n", 0)
            started.append(res.structured["job_id"])
        listed = (await srv.call({"computer_id": cid}, name="job_list")).ok().structured
        assert listed["count"] == KEPT_JOBS_PER_COMPUTER and listed.get("truncated") is None, listed
        assert [job["job_id"] for job in listed["jobs"]] == started[::-1][:KEPT_JOBS_PER_COMPUTER]
        for gone in started[:6]:
            res = await srv.call({"job_id": gone}, name="job_output")
            assert res.is_error and res.text == f"Job {gone} not found.", res
        last = (await srv.call({"job_id": started[-1], "since": 0}, name="job_output")).ok().structured
        assert last["stdout"] == f"{KEPT_JOBS_PER_COMPUTER + 5}\n"
    assert srv.returncode() == 0


# See: issue 30
async def test_issue_30_a_wasm_job_past_the_output_limit_ends_with_the_notice(kbb):
    """A WASM guest's output is collected like a command's, so a job is held to the output
    limit too: past it the job ends with exit code 1 and the output-limit notice, and keeps
    none of the bytes the backend uses to say the limit was crossed (it kept 2 MiB of NUL
    bytes as the job's stdout and no exit code)."""
    cid = kbb.new_id("wasm-jobs-limit")
    async with kbb.server(*JOBS_ARGS, "--output-limit", "100000", env=wasm_env(kbb)) as srv:
        await srv.run("true", computer_id=cid)
        written = await srv.call(
            {"path": "/big", "content": base64.b64encode(BIG_FILE[:60_000]).decode(), "encoding": "base64", "computer_id": cid},
            name="file_write",
        )
        assert not written.is_error, written
        res = (await srv.call({"command": "cat /big /big", "yield_after": 30, "computer_id": cid})).ok().structured
        assert (res["stdout"], res["exit_code"]) == ("", 1), {k: str(v)[:200] for k, v in res.items()}
        assert res["stderr"] == limit_notice(100000)
        listed = (await srv.call({"computer_id": cid}, name="job_list")).ok().structured
        assert listed["jobs"][0]["output_bytes"] == len(limit_notice(100000))
    assert srv.returncode() == 0
