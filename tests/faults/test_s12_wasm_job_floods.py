"""Scenario 12: WASM computers whose jobs flood the server's memory (issue 30, follow-up of item
2). On `--backend go_busybox` a job is a task of the server and its output is kept in the
server's memory. Six computers, one after another, each run 48 jobs printing 2 MB (just under
the 2 MiB output limit), eight at a time: 576 MB of job output in all, which a server keeping
every ended job's output would hold at once. Meanwhile computer N on the same server answers
`echo`. Each computer must keep at most 16 MiB and all of them together at most 64 MiB
(docs/jobs.md, "What WASM jobs keep in the server": job_list's `output_bytes` summed), every
computer's newest job must read back whole, N must keep answering, and the server's peak
resident set (`VmHWM`, plus `VmRSS` sampled every 20 ms) must stay at or under 160 MiB: its own
~40 MiB with the module loaded, the 64 MiB budget, and eight running guests' output on its way."""

from __future__ import annotations

import base64
import time

import anyio
import pytest

from faultkit import bb, mib, ms
from test_s4_output_flood import RssSampler
from testkit.procfs import status_kib
from testkit.stats import percentile

pytestmark = [pytest.mark.anyio, pytest.mark.scenario("12")]

PEAK_RSS_BOUND_MIB = 160
KEPT_PER_COMPUTER = 16 * 1024 * 1024
KEPT_TOTAL = 64 * 1024 * 1024
COMPUTERS = 6
BATCHES = 6
BATCH = 8
# Under the default 2 MiB output limit: 250,000 numbered lines.
BIG_FILE = "".join(f"{i:07d}\n" for i in range(250_000)).encode()


async def wait_all_ended(srv, cid: str, deadline: float = 120.0) -> dict:
    end = time.monotonic() + deadline
    while True:
        listed = (await srv.call({"computer_id": cid}, name="job_list")).ok().structured
        if not any(job["running"] for job in listed["jobs"]):
            return listed
        assert time.monotonic() < end, f"jobs of {cid} still running after {deadline}s"
        await anyio.sleep(0.1)


async def test_wasm_job_output_floods(kbb, figures):
    """Six WASM computers each run 48 jobs printing 2 MB beside a neighbour answering echo:
    each keeps at most 16 MiB of job output, all together at most 64 MiB, the newest job of each
    reads back whole, and the server's peak RSS stays at or under 160 MiB."""
    flooders = [kbb.new_id(f"s12-{n}") for n in range(COMPUTERS)]
    neighbour_id = kbb.new_id("s12-n")
    async with kbb.server("--backend", "go_busybox", "--job-tools", "--file-tools", env=bb.wasm_env(kbb)) as srv:
        for cid in [*flooders, neighbour_id]:
            await srv.run("true", computer_id=cid)
        for cid in flooders:
            written = await srv.call(
                {"path": "/big", "content": base64.b64encode(BIG_FILE).decode(), "encoding": "base64", "computer_id": cid},
                name="file_write",
            )
            assert not written.is_error, written
        figures["rss_before_mib"] = mib(status_kib(srv.pid, "VmRSS"))
        latencies: list[float] = []
        newest: dict[str, str] = {}
        stop = anyio.Event()

        async def neighbour() -> None:
            while not stop.is_set():
                res = await srv.call({"command": "echo n", "computer_id": neighbour_id}, timeout=30)
                assert res.ok().structured["stdout"] == "n\n"
                latencies.append(res.elapsed)
                await anyio.sleep(0.05)

        started_at = time.monotonic()
        with RssSampler(srv.pid) as sampler:
            async with anyio.create_task_group() as tg:
                tg.start_soon(neighbour)
                for cid in flooders:
                    for _ in range(BATCHES):
                        for _ in range(BATCH):
                            res = (await srv.call({"command": "cat /big", "yield_after": 0, "computer_id": cid})).ok()
                            newest[cid] = res.structured["job_id"]
                        await wait_all_ended(srv, cid)
                stop.set()
        flood_seconds = time.monotonic() - started_at
        hwm = status_kib(srv.pid, "VmHWM")

        kept: dict[str, int] = {}
        for cid in flooders:
            listed = (await srv.call({"computer_id": cid}, name="job_list")).ok().structured
            kept[cid] = sum(job["output_bytes"] for job in listed["jobs"])
            back = (await srv.call({"job_id": newest[cid], "since": 0}, name="job_output")).ok().structured
            assert (back["stdout"].encode(), back["exit_code"]) == (BIG_FILE, 0), cid
        figures.update(
            jobs=COMPUTERS * BATCHES * BATCH,
            output_printed_mib=mib(COMPUTERS * BATCHES * BATCH * len(BIG_FILE) // 1024),
            kept_per_computer_mib=[mib(n // 1024) for n in kept.values()],
            kept_total_mib=mib(sum(kept.values()) // 1024),
            flood_seconds=round(flood_seconds, 1),
            neighbour_answered=len(latencies),
            neighbour_p50_ms=ms(percentile(latencies, 50)) if latencies else None,
            neighbour_max_ms=ms(max(latencies)) if latencies else None,
            sampled_peak_rss_mib=mib(sampler.peak_kib),
            peak_rss_mib=mib(hwm),
            rss_after_mib=mib(status_kib(srv.pid, "VmRSS")),
        )
        assert all(n <= KEPT_PER_COMPUTER for n in kept.values()), kept
        assert sum(kept.values()) <= KEPT_TOTAL, kept
        assert latencies, "the neighbour never answered during the floods"
        assert hwm <= PEAK_RSS_BOUND_MIB * 1024, f"server peak RSS {mib(hwm)} MiB"
    assert srv.returncode() == 0
