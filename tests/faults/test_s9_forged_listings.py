"""Scenario 9: a computer whose shell forges the answers of the server's own listing programs
(issue 30, item 2). Its /bin/sh is replaced by a script that answers `job_list` with 320,000
forged job rows (8.3 MB, just under the 8 MiB the server used to read) or 9,000 (under the
listing's 256 KiB cap), and `file_list` with 500,000 short entries (7.9 MB, under its old
8 MiB cap), 130,000 (under its 2 MiB cap) or 255 paths of 8 KB. Each flood is sent six times
while computer B on the same server answers `echo`. An answer over its cap must be refused, one
under it cut to its row limit; B must keep answering, and the server's peak resident set
(`VmHWM`, plus `VmRSS` sampled every 20 ms per flood) must stay at or under 64 MiB: what a
computer answers is capped, parsed only up to the limit, and never kept."""

from __future__ import annotations

import subprocess

import anyio
import pytest

from faultkit import bb, mib, ms
from test_s4_output_flood import RssSampler
from testkit.procfs import status_kib
from testkit.stats import percentile

pytestmark = [pytest.mark.anyio, pytest.mark.scenario("9")]

PEAK_RSS_BOUND_MIB = 64
REPEATS = 6
CALL_TIMEOUT = 120
# What /bin/sh answers, chosen by /tmp/mode; every other program runs the real shell.
FORGING_SHELL = r"""#!/bin/busybox sh
mode=$(/bin/busybox cat /tmp/mode)
case "$*" in
*"printf 'J %s"*)
  n=$(/bin/busybox cat /tmp/floods 2>/dev/null || echo 0); echo $((n + 1)) > /tmp/floods
  case "$mode" in
  rows) /bin/busybox awk -v b="$n" 'BEGIN { for (i = 0; i < 9000; i++) printf "J j-%08x\n{}\nrunning\n0\n", b * 1000000 + i }' ;;
  *) /bin/busybox awk -v b="$n" 'BEGIN { for (i = 0; i < 320000; i++) printf "J j-%08x\n{}\nrunning\n0\n", b * 1000000 + i }' ;;
  esac
  exit 0 ;;
*"-mindepth 1"*)
  case "$mode" in
  long) /bin/busybox awk 'BEGIN { print "ok"; p = sprintf("%08000d", 0); for (i = 0; i < 255; i++) printf "81a4 1 1 /%s%d\n", p, i }' ;;
  entries) /bin/busybox awk 'BEGIN { print "ok"; for (i = 0; i < 130000; i++) printf "81a4 1 1 /%x\n", i }' ;;
  *) /bin/busybox awk 'BEGIN { print "ok"; for (i = 0; i < 500000; i++) printf "81a4 1 1 /%x\n", i }' ;;
  esac
  exit 0 ;;
esac
exec /bin/busybox sh "$@"
"""
# (name, /tmp/mode, tool, arguments, what the answer must be: "refused" or the most rows)
FLOODS = [
    ("job_list 320,000 rows (8.3 MB)", "flood", "job_list", {}, "refused"),
    ("job_list 9,000 rows (230 KB)", "rows", "job_list", {}, 64),
    ("file_list 500,000 entries (7.9 MB)", "flood", "file_list", {"path": "/"}, "refused"),
    ("file_list 130,000 entries (1.9 MB)", "entries", "file_list", {"path": "/"}, 1000),
    ("file_list 255 paths of 8 KB (2.0 MB)", "long", "file_list", {"path": "/"}, 255),
]


def install_shell(container: str) -> None:
    install = "cat > /tmp/.forging-sh && chmod 755 /tmp/.forging-sh && mv -f /tmp/.forging-sh /bin/sh"
    proc = subprocess.run(
        ["docker", "exec", "-i", container, "/bin/busybox", "sh", "-c", install],
        input=FORGING_SHELL, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr


def describe(res) -> str:
    if res.is_error:
        return f"refused: {(res.text or '')[:120]}"
    data = res.structured
    rows = data.get("jobs", data.get("entries", []))
    return f"{len(rows)} rows, truncated {bool(data.get('truncated'))}"


async def test_forged_job_and_file_listings(kbb, figures):
    """A replaced shell answers job_list and file_list with forged floods over and under their
    caps, six times each, beside a neighbour answering echo: each answer is refused or cut to
    its limit and the server's peak RSS stays at or under 64 MiB."""
    a, b = kbb.new_id("s9-a"), kbb.new_id("s9-b")
    args = [*bb.BUSYBOX_ARGS, "--job-tools", "--file-tools"]
    async with kbb.server(*args, env={"KILNTAINERS_EXEC_HELPER": "on"}) as srv:
        for cid in (a, b):
            await srv.run("true", computer_id=cid)
        container = bb.container_for(a)
        install_shell(container)
        figures["rss_before_mib"] = mib(status_kib(srv.pid, "VmRSS"))
        outcomes: dict[str, list[str]] = {}
        peaks: dict[str, float | None] = {}
        latencies: dict[str, list[float]] = {}
        current = {"flood": "before"}
        stop = anyio.Event()

        async def neighbour() -> None:
            while not stop.is_set():
                res = await srv.call({"command": "echo b", "computer_id": b}, timeout=30)
                assert res.ok().structured["stdout"] == "b\n"
                latencies.setdefault(current["flood"], []).append(res.elapsed)
                await anyio.sleep(0.05)

        async with anyio.create_task_group() as tg:
            tg.start_soon(neighbour)
            for name, mode, tool, extra, expected in FLOODS:
                assert bb.docker_exec(container, "/bin/busybox", "sh", "-c", f"echo {mode} > /tmp/mode").returncode == 0
                current["flood"] = name
                with RssSampler(srv.pid) as sampler:
                    results = [
                        await srv.call({"computer_id": a, **extra}, name=tool, timeout=CALL_TIMEOUT)
                        for _ in range(REPEATS)
                    ]
                peaks[name] = mib(sampler.peak_kib)
                outcomes[name] = sorted({describe(res) for res in results})
                for res in results:
                    if expected == "refused":
                        assert res.is_error and "than" in (res.text or ""), describe(res)
                    else:
                        assert res.ok().structured["count"] == expected, describe(res)
            stop.set()
        hwm = status_kib(srv.pid, "VmHWM")
        during = [t for name, seen in latencies.items() if name != "before" for t in seen]
        figures.update(
            calls=REPEATS * len(FLOODS),
            outcomes=outcomes,
            sampled_peak_rss_per_flood_mib=peaks,
            neighbour_answered=len(during),
            neighbour_p50_ms=ms(percentile(during, 50)) if during else None,
            neighbour_max_per_flood_ms={name: ms(max(seen)) for name, seen in latencies.items() if name != "before"},
            peak_rss_mib=mib(hwm),
            rss_after_mib=mib(status_kib(srv.pid, "VmRSS")),
        )
        assert during, "the neighbour never answered during the floods"
        assert hwm <= PEAK_RSS_BOUND_MIB * 1024, f"server peak RSS {mib(hwm)} MiB"
    assert srv.returncode() == 0
