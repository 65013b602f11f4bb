"""A hostile computer against the server (issue 15, items 2 and 8): a root user inside a computer
replaces the exec helper, writes into the helper's pipes through /proc, or replaces the shell
that readiness runs.  Whatever it does, the server's peak memory and its log stay bounded,
another computer keeps answering, and the attacked computer's next command works: through a
fresh copy of the helper, or through Docker exec with a one-line notice in its stderr, once.

The server's peak RSS is its `VmHWM` (which also covers start-up); its log is its stderr file.
"""

from __future__ import annotations

import subprocess
import time

import anyio
import pytest

from harness import BUSYBOX_ARGS, container_for, docker_exec

pytestmark = [pytest.mark.anyio, pytest.mark.client_independent]

ON = {"KILNTAINERS_EXEC_HELPER": "on"}
LIFECYCLE = {"KILNTAINERS_EXEC_HELPER": "on", "ENABLE_LIFECYCLE_TOOLS": "true"}
PARENT = "tr '\\0' ' ' < /proc/$PPID/cmdline"
NOTICE = "[kilntainers: exec helper unavailable in this computer ("
# Bounds the tests assert.  The debug server idles near 20 MiB; the attacks below would take it
# to hundreds of MiB (100 MB and more flow through it) if anything were kept.
PEAK_RSS_KIB = 100 * 1024
LOG_GROWTH = 1024 * 1024


def peak_rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


async def helper_of(srv, **kw) -> tuple[str, str]:
    """(helper path, container) of the computer a command with `kw` runs on."""
    res = await srv.run(PARENT, **kw)
    parent = res.structured["stdout"].split()
    assert parent and parent[0].startswith("/.kilntainers/helper-"), parent
    container = container_for(res.structured["computer_id"])
    assert container
    return parent[0], container


async def neighbour_answers(srv, computer_id: str, stop: anyio.Event, latencies: list[float]) -> None:
    """Runs `echo` on another computer until `stop`, recording each call's latency."""
    while not stop.is_set():
        res = await srv.run("echo alive", computer_id=computer_id, timeout=20)
        assert res.structured["stdout"] == "alive\n"
        latencies.append(res.elapsed)
        await anyio.sleep(0.05)


async def under_attack(srv, neighbour: str, attack) -> tuple[object, list[float]]:
    """Runs `attack()` while a neighbour computer answers `echo`; returns its result and the
    neighbour's latencies."""
    stop = anyio.Event()
    latencies: list[float] = []
    outcome: list[object] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(neighbour_answers, srv, neighbour, stop, latencies)

        async def run_attack():
            try:
                outcome.append(await attack())
            finally:
                stop.set()

        tg.start_soon(run_attack)
    assert latencies, "the neighbour never answered"
    assert max(latencies) < 10, f"the neighbour stalled: {max(latencies):.1f} s"
    return outcome[0], latencies


def assert_bounded(srv, log_before: int) -> None:
    peak = peak_rss_kib(srv.pid)
    assert peak < PEAK_RSS_KIB, f"server peak RSS {peak} KiB"
    growth = srv.errlog.stat().st_size - log_before
    print(f"server peak RSS {peak} KiB, log growth {growth} bytes")
    assert growth < LOG_GROWTH, f"server log grew by {growth} bytes"


async def assert_recovers_with_one_notice(srv, computer_id: str) -> None:
    """The next command works through Docker exec and says so once; the one after is quiet."""
    first = (await srv.run("echo $PPID", computer_id=computer_id, timeout=20)).structured
    assert first["exit_code"] == 0 and first["stdout"] == "0\n", first
    assert first["stderr"].count(NOTICE) == 1, first["stderr"]
    assert first["stderr"].endswith("; using docker exec]\n"), first["stderr"]
    second = (await srv.run("echo again", computer_id=computer_id, timeout=20)).structured
    assert (second["stdout"], second["stderr"]) == ("again\n", ""), second


async def test_issue_15_a_helper_replaced_by_a_sleeper_is_put_back_before_the_next_connection(kbb):
    """See: issue 15 (item 8). `exec sleep 600` in the helper's place, then the helper dies:
    the next command must not wait for the sleeper (which made every command time out)."""
    cid = kbb.new_id("hostile-sleeper")
    async with kbb.server(*BUSYBOX_ARGS, env=ON) as srv:
        path, container = await helper_of(srv, computer_id=cid, temporary=False)
        fake = f"rm -f {path} && printf '#!/bin/sh\\nexec sleep 600\\n' > {path} && chmod 755 {path}"
        assert docker_exec(container, "sh", "-c", fake).returncode == 0
        # The running helper dies (its file was only unlinked, so it ran until now).
        killed = await srv.call({"command": "kill -9 $PPID; sleep 1000", "computer_id": cid, "temporary": False})
        assert killed.is_error and "exec helper" in killed.text, killed
        res = await srv.call({"command": "echo $PPID; echo ok", "computer_id": cid, "temporary": False, "timeout": 8})
        s = res.ok().structured
        assert (s["exit_code"], s["stdout"].split()[1:]) == (0, ["ok"]), s
        assert s["stdout"].split()[0] != "0", "the helper was not put back"
        assert res.elapsed < 5, f"took {res.elapsed:.1f} s"
    # A permanent computer keeps the fake across server restarts: a new server puts it back.
    fake = f"rm -f {path} && printf '#!/bin/sh\\nexec sleep 600\\n' > {path} && chmod 755 {path}"
    assert docker_exec(container, "sh", "-c", fake).returncode == 0
    async with kbb.server(*BUSYBOX_ARGS, env=ON) as srv:
        start = time.monotonic()
        res = await srv.call({"command": "echo ok", "computer_id": cid, "temporary": False, "timeout": 8})
        assert res.ok().structured["stdout"] == "ok\n", res
        assert time.monotonic() - start < 5, "readiness waited for the fake helper"
        assert (await helper_of(srv, computer_id=cid, temporary=False))[0] == path


async def test_issue_15_a_helper_that_stops_answering_is_given_up_after_one_timeout(kbb):
    """See: issue 15 (item 8). A helper stopped with SIGSTOP (or a fake that only says Hello)
    made every later command time out after its full timeout, blaming the command. One
    unanswered kill is enough: the computer falls back to Docker exec and says so once."""
    cid = kbb.new_id("hostile-stopped")
    async with kbb.server(*BUSYBOX_ARGS, env=ON) as srv:
        await helper_of(srv, computer_id=cid)
        container = container_for(cid)
        helper_pid = docker_exec(container, "sh", "-c", "echo $PPID").stdout  # a Docker exec: PPID 0
        assert helper_pid.strip() == "0"
        stop = "for d in /proc/[0-9]*; do case $(tr '\\0' ' ' < $d/cmdline 2>/dev/null) in " \
               "'/.kilntainers/helper-'*) kill -STOP ${d#/proc/};; esac; done"
        assert docker_exec(container, "sh", "-c", stop).returncode == 0
        res = await srv.call({"command": "echo never", "computer_id": cid, "timeout": 2})
        assert res.structured["exit_code"] == 124, res
        assert res.elapsed < 2 + 5 + 10, f"the timed-out call took {res.elapsed:.1f} s"
        start = time.monotonic()
        await assert_recovers_with_one_notice(srv, cid)
        assert time.monotonic() - start < 10, "the next commands waited for the stopped helper"


async def test_issue_15_a_stderr_flood_into_the_helper_is_capped_and_gives_it_up(kbb):
    """See: issue 15 (item 2). 50 MB of lines written into the live helper's stderr through
    /proc: a few log lines, then the helper is given up for Docker exec."""
    victim, neighbour = kbb.new_id("hostile-stderr"), kbb.new_id("hostile-neighbour")
    async with kbb.server(*BUSYBOX_ARGS, env=ON) as srv:
        await helper_of(srv, computer_id=victim)
        await srv.run("true", computer_id=neighbour)
        log_before = srv.errlog.stat().st_size
        flood = "yes '2026-01-01T00:00:00Z ERROR forged' | head -c 50000000 > /proc/$PPID/fd/2; echo done"
        res, _ = await under_attack(
            srv, neighbour, lambda: srv.call({"command": flood, "computer_id": victim, "timeout": 60})
        )
        assert_bounded(srv, log_before)
        await assert_recovers_with_one_notice(srv, victim)
        log = srv.stderr()
        assert "more than 256 KiB to its stderr" in log, log[-2000:]
        assert "\n2026-01-01T00:00:00Z ERROR forged" not in log, "a forged line reached the log as a line"


async def test_issue_15_forged_frames_in_the_helper_stdout_give_it_up(kbb):
    """See: issue 15 (item 2). A frame header claiming 8 MiB, then 20 MB, written into the live
    helper's stdout through /proc: refused from its header, the helper is given up."""
    victim, neighbour = kbb.new_id("hostile-frames"), kbb.new_id("hostile-neighbour2")
    async with kbb.server(*BUSYBOX_ARGS, env=ON) as srv:
        await helper_of(srv, computer_id=victim)
        await srv.run("true", computer_id=neighbour)
        log_before = srv.errlog.stat().st_size
        flood = "{ printf '\\000\\177\\377\\360\\146'; head -c 20000000 /dev/zero; } > /proc/$PPID/fd/1; sleep 5"
        res, _ = await under_attack(
            srv, neighbour, lambda: srv.call({"command": flood, "computer_id": victim, "timeout": 60})
        )
        assert res.is_error and "exec helper" in res.text, res
        assert_bounded(srv, log_before)
        await assert_recovers_with_one_notice(srv, victim)


@pytest.mark.parametrize("helper", ["on", "off"])
async def test_issue_15_a_replaced_shell_flooding_readiness_keeps_the_server_bounded(kbb, helper):
    """See: issue 15 (items 2 and 11). /bin/sh replaced by a script that floods 300 MB when it
    sees the readiness probe, then `computer_restart`: readiness stops reading at 64 KiB."""
    victim, neighbour = kbb.new_id(f"hostile-shell-{helper}"), kbb.new_id(f"hostile-nb-{helper}")
    env = {**LIFECYCLE, "KILNTAINERS_EXEC_HELPER": helper}
    script = (
        "#!/bin/busybox sh\n"
        'case "$*" in *kilntainers-ready*) exec /bin/busybox head -c 300000000 /dev/zero;; esac\n'
        'exec /bin/busybox sh "$@"\n'
    )
    async with kbb.server(*BUSYBOX_ARGS, env=env) as srv:
        await srv.run("true", computer_id=victim)
        await srv.run("true", computer_id=neighbour)
        container = container_for(victim)
        replace = f"rm -f /bin/sh && printf '%s' '{script}' > /bin/sh && chmod 755 /bin/sh"
        assert docker_exec(container, "/bin/busybox", "sh", "-c", replace).returncode == 0
        log_before = srv.errlog.stat().st_size
        start = time.monotonic()
        res, _ = await under_attack(
            srv, neighbour, lambda: srv.call({"computer_id": victim}, name="computer_restart", timeout=60)
        )
        took = time.monotonic() - start
        assert_bounded(srv, log_before)
        assert res.is_error and "readiness check failed" in res.text, res
        assert "more than 64 KiB" in res.text, res
        assert took < 10, f"restart took {took:.1f} s"
        # The shell itself still works for ordinary commands.
        ok = await srv.call({"command": "echo fine", "computer_id": victim, "timeout": 20})
        assert ok.ok().structured["stdout"] == "fine\n", ok


def replace_shell(container: str, script: str) -> None:
    """Puts `script` in place of the computer's /bin/sh (as root inside it could)."""
    install = "cat > /tmp/.evil-sh && chmod 755 /tmp/.evil-sh && mv -f /tmp/.evil-sh /bin/sh"
    proc = subprocess.run(
        ["docker", "exec", "-i", container, "/bin/busybox", "sh", "-c", install],
        input=script, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr


# A shell that answers the job listing (the only job script that prints `J <id>` rows) with
# what /tmp/mode says: `claim` lists the id in /tmp/claim, `rows` 9,000 forged rows (230 KB),
# `flood` 320,000 forged rows (8.3 MB: just under the old 8 MiB cap), each with new ids.
FORGED_JOB_LIST_SHELL = r"""#!/bin/busybox sh
case "$*" in
*"printf 'J %s"*)
  n=$(/bin/busybox cat /tmp/floods 2>/dev/null || echo 0); echo $((n + 1)) > /tmp/floods
  case "$(/bin/busybox cat /tmp/mode)" in
  claim) printf 'J %s\n{}\nrunning\n0\nT 1\n' "$(/bin/busybox cat /tmp/claim)" ;;
  rows) /bin/busybox awk -v b="$n" 'BEGIN { for (i = 0; i < 9000; i++) printf "J j-%08x\n{}\nrunning\n0\n", b * 1000000 + i }' ;;
  *) /bin/busybox awk -v b="$n" 'BEGIN { for (i = 0; i < 320000; i++) printf "J j-%08x\n{}\nrunning\n0\n", b * 1000000 + i }' ;;
  esac
  exit 0 ;;
esac
exec /bin/busybox sh "$@"
"""


async def test_issue_30_forged_job_rows_are_capped_and_never_remembered(kbb):
    """See: issue 30 (item 2). A replaced shell answers job_list with 320,000 forged rows, six
    times (it took a server from 31 MB to 891 MB, kept after the computer was gone): the answer
    is refused or cut to the row limit, the server's peak RSS stays bounded, and a forged claim
    of another computer's job id does not hide that job from job_output."""
    victim, honest = kbb.new_id("hostile-jobs"), kbb.new_id("hostile-jobs-ok")
    async with kbb.server(*BUSYBOX_ARGS, "--job-tools", env=ON) as srv:
        await srv.run("true", computer_id=victim)
        job = (await srv.call({"command": "sleep 300", "yield_after": 0, "computer_id": honest})).ok().structured
        container = container_for(victim)
        replace_shell(container, FORGED_JOB_LIST_SHELL)
        assert docker_exec(container, "/bin/busybox", "sh", "-c", f"echo {job['job_id']} > /tmp/claim").returncode == 0
        log_before = srv.errlog.stat().st_size

        def mode(name: str) -> None:
            assert docker_exec(container, "/bin/busybox", "sh", "-c", f"echo {name} > /tmp/mode").returncode == 0

        mode("flood")
        floods = [await srv.call({"computer_id": victim}, name="job_list", timeout=120) for _ in range(6)]
        assert_bounded(srv, log_before)
        for res in floods:
            if res.is_error:
                assert "its answer was larger than expected" in res.text, res.text
            else:
                assert res.structured["count"] <= 128, res.structured["count"]
        mode("rows")
        # 9,000 rows fit the answer cap; the default --max-jobs (16) lists 64 of them.
        rows = (await srv.call({"computer_id": victim}, name="job_list")).ok().structured
        assert rows["count"] == 64 and rows["truncated"] is True, (rows["count"], rows.get("truncated"))
        # The victim claims the honest computer's job: listing it there changes nothing about
        # where the job is found.
        mode("claim")
        claimed = (await srv.call({"computer_id": victim}, name="job_list")).ok().structured
        assert [row["job_id"] for row in claimed["jobs"]] == [job["job_id"]]
        found = await srv.call({"job_id": job["job_id"]}, name="job_output")
        assert found.ok().structured["computer_id"] == honest, found
        (await srv.call({"job_id": job["job_id"], "signal": "KILL"}, name="job_kill")).ok()
        assert_bounded(srv, log_before)


# A shell that answers file_list (the program that runs `find … -mindepth 1`) with forged
# entries: 500,000 (7.9 MB, under the 8 MiB the server used to read) or, with /tmp/mode
# `under`, 130,000 (1.9 MB, under the listing's 2 MiB cap).
FORGED_FILE_LIST_SHELL = r"""#!/bin/busybox sh
case "$*" in
*"-mindepth 1"*)
  case "$(/bin/busybox cat /tmp/mode 2>/dev/null)" in
  under) n=130000 ;;
  *) n=500000 ;;
  esac
  /bin/busybox awk -v n="$n" 'BEGIN { print "ok"; for (i = 0; i < n; i++) printf "81a4 1 1 /%x\n", i }'
  exit 0 ;;
esac
exec /bin/busybox sh "$@"
"""


async def test_issue_30_a_forged_file_list_flood_is_read_only_to_the_limit(kbb):
    """See: issue 30 (item 2, the audit). file_list parsed its whole 8 MiB answer before
    cutting it to 1,000 entries (~146 MB per call): an answer over the 2 MiB cap is refused,
    one under it is read only to the limit + 1 entry."""
    victim = kbb.new_id("hostile-files")
    async with kbb.server(*BUSYBOX_ARGS, "--file-tools", env=ON) as srv:
        await srv.run("true", computer_id=victim)
        container = container_for(victim)
        replace_shell(container, FORGED_FILE_LIST_SHELL)
        log_before = srv.errlog.stat().st_size
        floods = [await srv.call({"computer_id": victim, "path": "/"}, name="file_list", timeout=120) for _ in range(3)]
        assert docker_exec(container, "/bin/busybox", "sh", "-c", "echo under > /tmp/mode").returncode == 0
        under = [await srv.call({"computer_id": victim, "path": "/"}, name="file_list", timeout=120) for _ in range(3)]
        assert_bounded(srv, log_before)
        for res in floods:
            if res.is_error:
                assert res.text == "The computer answered with more than was asked for.", res.text
            else:
                listing = res.structured
                assert (listing["count"], listing["truncated"]) == (1000, True), (listing["count"], listing["truncated"])
        for res in under:
            listing = res.ok().structured
            assert (listing["count"], listing["truncated"]) == (1000, True), (listing["count"], listing["truncated"])
