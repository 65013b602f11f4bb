"""Scenario 6: computer A attacks, computer B (same server) must keep answering.  First a fork
bomb in A under the default pids limit (4096), then A's exec helper replaced by
`#!/bin/sh\\nexec sleep 600` (and the running helper killed, so the next command connects to
the fake).  During each attack B's `echo` latency is sampled over 30 calls; every call must be
answered.  A's own next command after the helper swap must come back within its timeout plus a
few seconds, whatever its result (recorded), and the server must stay alive."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import pytest

from faultkit import bb, ms
from testkit.stats import percentile

pytestmark = [pytest.mark.anyio, pytest.mark.scenario("6")]

SAMPLES = 30
BOMB_TIMEOUT = 6
# A fork bomb under a 4096 pids limit fills it within a second or two; sampling starts once
# this many processes exist, or when the wait for it ends (the figures then say so).
BOMB_STARTED_PIDS = 1000
BOMB_START_WAIT = 10.0
A_NEXT_TIMEOUT = 5
# "A few seconds" over the call's own timeout: the kill sweep, a fallback to Docker exec.
A_NEXT_GRACE = 10
# A single `echo` in a healthy neighbour must never take this long, attack or not.
B_CALL_BOUND = 30.0
HOSTILE_HELPER = (
    "for f in /.kilntainers/helper-*; do rm -f \"$f\"; printf '#!/bin/sh\\nexec sleep 600\\n' > \"$f\"; "
    "chmod 755 \"$f\"; done; ls /.kilntainers; "
    # The command's parent is the helper (docs/exec-helper.md); under Docker exec it is 0.
    "[ \"$PPID\" -gt 1 ] && kill -9 \"$PPID\"; true"
)


def pids_current_file(container: str) -> Path:
    """The container's `pids.current` (v1 `pids` controller or v2), read on the host: a Docker
    exec cannot start while the bomb holds every pid."""
    info = bb.inspect(container)
    pid = info and info["State"]["Pid"]
    assert pid, f"container {container} is not running"
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "pids" in controllers.split(","):
            candidate = Path("/sys/fs/cgroup/pids") / path.lstrip("/") / "pids.current"
        elif controllers == "":
            candidate = Path("/sys/fs/cgroup") / path.lstrip("/") / "pids.current"
        else:
            continue
        if candidate.exists():
            return candidate
    raise AssertionError(f"no pids.current for container {container}")


def read_pids(path: Path) -> int:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return 0


async def sample_echo(srv, computer_id: str) -> list[float]:
    latencies = []
    for n in range(SAMPLES):
        res = await srv.call({"command": f"echo {n}", "computer_id": computer_id}, timeout=B_CALL_BOUND)
        res.ok()
        assert res.structured["stdout"] == f"{n}\n", res
        latencies.append(res.elapsed)
    return latencies


def latency_figures(prefix: str, latencies: list[float]) -> dict:
    return {
        f"{prefix}_answered": f"{len(latencies)}/{SAMPLES}",
        f"{prefix}_p50_ms": ms(percentile(latencies, 50)),
        f"{prefix}_max_ms": ms(max(latencies)),
    }


async def test_fork_bomb_and_hostile_helper_in_a_neighbour(kbb, figures):
    """A fork bomb (default pids limit) and then a helper replaced by `exec sleep 600` in
    computer A; computer B on the same server answers all 30 `echo` calls during each attack
    (p50/max recorded); A's next command returns within its timeout plus a few seconds and the
    server stays alive."""
    a, b = kbb.new_id("s6-a"), kbb.new_id("s6-b")
    async with kbb.server(*bb.BUSYBOX_ARGS) as srv:
        for cid in (a, b):
            await srv.run("true", computer_id=cid, temporary=True)
        container_a = bb.container_for(a)
        pids_file = pids_current_file(container_a)
        baseline_pids = read_pids(pids_file)
        figures["a_pids_before"] = baseline_pids
        figures.update(latency_figures("b_quiet", await sample_echo(srv, b)))

        # --- fork bomb in A -----------------------------------------------------------------
        bomb: dict = {}

        async def run_bomb() -> None:
            bomb["result"] = await srv.call(
                {"command": "bomb() { bomb | bomb & }; bomb; sleep 600", "computer_id": a, "timeout": BOMB_TIMEOUT},
                timeout=BOMB_TIMEOUT + 60,
            )

        peak = 0

        def bomb_spread() -> bool:
            nonlocal peak
            peak = max(peak, read_pids(pids_file))
            return peak >= BOMB_STARTED_PIDS

        async with anyio.create_task_group() as tg:
            tg.start_soon(run_bomb)
            await bb.apoll(bomb_spread, BOMB_START_WAIT, 0.05)
            figures["a_pids_when_sampling_started"] = peak
            under_bomb = await sample_echo(srv, b)
            bomb_spread()
        figures.update(latency_figures("b_under_fork_bomb", under_bomb))
        figures["a_pids_peak_seen"] = peak
        result = bomb["result"]
        figures["a_bomb_exit_code"] = result.structured.get("exit_code") if result.structured else result.text
        figures["a_bomb_call_seconds"] = round(result.elapsed, 1)
        assert result.elapsed <= BOMB_TIMEOUT + A_NEXT_GRACE, f"the bomb's call took {result.elapsed:.1f} s"
        # The helper may have started a thread or two meanwhile (pids.current counts threads).
        drained = await bb.apoll(lambda: read_pids(pids_file) <= baseline_pids + 2, 30, 0.2)
        figures["a_pids_after_kill"] = read_pids(pids_file)
        assert drained, f"the fork bomb outlived its timeout: {read_pids(pids_file)} pids in A"
        after_bomb = await srv.call({"command": "echo alive", "computer_id": a, "timeout": A_NEXT_TIMEOUT}, timeout=60)
        figures["a_after_bomb"] = _describe(after_bomb)

        # --- hostile helper in A --------------------------------------------------------------
        swap = await srv.call({"command": HOSTILE_HELPER, "computer_id": a, "timeout": 10}, timeout=60)
        figures["a_helper_swap_call"] = _describe(swap)
        listing = bb.docker_exec(container_a, "sh", "-c", "cat /.kilntainers/helper-*").stdout
        assert "exec sleep 600" in listing, f"the helper was not replaced: {listing[:200]!r}"

        a_next: dict = {}

        async def a_next_call() -> None:
            started = time.monotonic()
            try:
                a_next["result"] = await srv.call(
                    {"command": "echo after", "computer_id": a, "timeout": A_NEXT_TIMEOUT},
                    timeout=A_NEXT_TIMEOUT + A_NEXT_GRACE,
                )
            except TimeoutError:
                a_next["result"] = None
            a_next["seconds"] = time.monotonic() - started

        async with anyio.create_task_group() as tg:
            tg.start_soon(a_next_call)
            under_helper = await sample_echo(srv, b)
        figures.update(latency_figures("b_under_hostile_helper", under_helper))
        figures["a_next_call_seconds"] = round(a_next["seconds"], 1)
        figures["a_next_call"] = _describe(a_next["result"]) if a_next["result"] else "no answer"
        assert a_next["result"] is not None, (
            f"A's next command did not return within {A_NEXT_TIMEOUT} + {A_NEXT_GRACE} s"
        )
        second = await srv.call({"command": "echo again", "computer_id": a, "timeout": A_NEXT_TIMEOUT},
                                timeout=A_NEXT_TIMEOUT + A_NEXT_GRACE)
        figures["a_second_call"] = _describe(second)
        figures["server_alive"] = srv.alive()
        assert srv.alive()
        assert (await srv.run("echo b", computer_id=b)).structured["stdout"] == "b\n"
    assert srv.returncode() == 0


def _describe(res) -> str:
    if res.is_error or not res.structured:
        return f"error: {(res.text or '')[:160]}"
    s = res.structured
    text = f"exit {s['exit_code']} in {res.elapsed:.1f} s"
    if s.get("stdout"):
        text += f", stdout {s['stdout'][:60]!r}"
    if s.get("stderr"):
        text += f", stderr {s['stderr'][:160]!r}"
    return text
