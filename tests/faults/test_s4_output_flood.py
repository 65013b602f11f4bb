"""Scenario 4: commands that try to print 2 GiB (zeros without a newline, `yes`, random bytes
on stderr, two background producers at once, an argv-mode `head`).  The output limit (2 MiB by
default) must end each one with its fixed notice, and the server's peak resident set
(`VmHWM` in /proc/<pid>/status, plus `VmRSS` sampled every 20 ms) must stay bounded: output is
counted as it streams, never gathered first."""

from __future__ import annotations

import threading

import pytest

from faultkit import bb, mib
from testkit.procfs import status_kib

pytestmark = [pytest.mark.anyio, pytest.mark.scenario("4")]

# What the server may hold at its peak: its own ~10-20 MiB, one 2 MiB result (kept as bytes and
# again as JSON text) and buffers.  A server that gathered a flood before checking the limit
# would pass this within a fraction of a second.
PEAK_RSS_BOUND_MIB = 100
DEFAULT_OUTPUT_LIMIT = 2_097_152
# Each flood reaches the limit in well under a second; this bounds a server that stops counting.
FLOOD_TIMEOUT = 60
# Sampling interval of VmRSS (VmHWM is the kernel's exact peak; the samples show the shape).
SAMPLE_SECONDS = 0.02

FLOODS = [
    ("zeros on stdout, no newline", {"command": "head -c 2G /dev/zero"}),
    ("yes on stdout", {"command": "yes"}),
    ("random bytes on stderr", {"command": "head -c 2G /dev/urandom >&2"}),
    ("two background producers", {"command": "yes out & yes err >&2 & wait"}),
    ("argv mode", {"args": ["head", "-c", "2G", "/dev/zero"]}),
]


class RssSampler:
    def __init__(self, pid: int):
        self.pid = pid
        self.peak_kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_kib = max(self.peak_kib, status_kib(self.pid, "VmRSS") or 0)
            self._stop.wait(SAMPLE_SECONDS)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


@pytest.mark.parametrize("exec_helper", ["on", "off"])
async def test_two_gib_output_flood(kbb, figures, exec_helper):
    """Five 2 GiB floods with the default 2 MiB output limit, through the exec helper and
    through plain Docker exec: each ends with the output-limit notice, and the server's peak RSS
    stays under 100 MiB."""
    async with kbb.server("--image", bb.DEBIAN, env={"KILNTAINERS_EXEC_HELPER": exec_helper}) as srv:
        await srv.run("true")
        figures["rss_before_mib"] = mib(status_kib(srv.pid, "VmRSS"))
        seconds = {}
        with RssSampler(srv.pid) as sampler:
            for name, arguments in FLOODS:
                res = await srv.call({**arguments, "timeout": FLOOD_TIMEOUT}, timeout=FLOOD_TIMEOUT + 30)
                res.ok()
                assert res.structured["stderr"] == bb.limit_notice(DEFAULT_OUTPUT_LIMIT), f"{name}: {res!r}"
                assert res.structured["stdout"] == "" and res.structured["exit_code"] == 1, f"{name}: {res!r}"
                seconds[name] = round(res.elapsed, 2)
        hwm = status_kib(srv.pid, "VmHWM")
        figures.update(
            floods=len(FLOODS),
            slowest_flood_seconds=max(seconds.values()),
            peak_rss_mib=mib(hwm),
            sampled_peak_rss_mib=mib(sampler.peak_kib),
        )
        assert hwm is not None and hwm / 1024 < PEAK_RSS_BOUND_MIB, f"peak RSS {mib(hwm)} MiB"
        # The computer is still usable after the floods.
        assert (await srv.run("echo fine")).structured["stdout"] == "fine\n"
