"""Limits and kills: the fixed 2 MiB stdin limit (exactly 2 MiB accepted, one byte more
rejected), timeouts (exit 124, fixed notice, prompt return, the whole process tree in the
container killed, including backgrounded and setsid children; `--timeout` default; string
timeout), the output limit (`--output-limit 1024`: strictly-greater rule on combined
stdout+stderr, exact notice, output at the limit intact, flooding producers killed, server
memory bounded), and the minimal image whose lack of `tr`/`grep` breaks the kill sweep but not
the result (docs/decisions.md, "terminal_execute validation"; docs/decisions.md, "Execution model"; docs/decisions.md, "Acceptance checklist" items 5, 7, 8)."""

from __future__ import annotations

import time

import pytest

from harness import (
    BUSYBOX_ARGS,
    MIB2,
    MINIMAL_ARGS,
    limit_notice,
    proc_scan_command,
    timeout_notice,
)

pytestmark = pytest.mark.anyio

# Generous bound for "returns promptly" on a 2-core machine (spec: ~1-2 s).
TIMEOUT_RETURN_BOUND = 3.0


def assert_timeout_result(res, seconds: int) -> None:
    res.ok()
    assert res.structured["stdout"] == ""
    assert res.structured["stderr"] == timeout_notice(seconds)
    assert res.structured["exit_code"] == 124


def assert_limit_result(res, limit: int) -> None:
    res.ok()
    assert res.structured["stdout"] == ""
    assert res.structured["stderr"] == limit_notice(limit)
    assert res.structured["exit_code"] == 1


async def scan(srv, *argvs: str, **kw) -> str:
    res = await srv.run(proc_scan_command(*argvs), **kw)
    return res.structured["stdout"]


# ---------------------------------------------------------------------------------------------
# stdin limit


async def test_stdin_exactly_2mib_is_accepted(kbb):
    async with kbb.server(*BUSYBOX_ARGS) as srv:
        res = await srv.run("wc -c", stdin="a" * MIB2)
        assert int(res.structured["stdout"].strip()) == MIB2
        # the limit counts UTF-8 bytes: 1,048,576 two-byte characters = exactly 2 MiB
        res = await srv.run("wc -c", stdin="\u00e9" * (MIB2 // 2))
        assert int(res.structured["stdout"].strip()) == MIB2
        # and content arrives intact
        payload = ("0123456789abcdef" * (MIB2 // 16))
        res = await srv.run("md5sum", stdin=payload)
        import hashlib

        assert res.structured["stdout"].split()[0] == hashlib.md5(payload.encode()).hexdigest()


async def test_stdin_one_byte_over_2mib_is_rejected_and_creates_nothing(kbb):
    async with kbb.server(*BUSYBOX_ARGS, "--output-limit", "10000000") as srv:
        msg = (
            f"stdin content exceeds the 2 MiB limit ({MIB2 + 1} bytes). "
            "Split into smaller chunks or use a different approach."
        )
        res = await srv.call({"command": "wc -c", "stdin": "a" * (MIB2 + 1)})
        assert res.is_error and res.text == msg and res.structured == {"error": msg}
        # independent of --output-limit (set high above)
        assert srv.containers() == []


# ---------------------------------------------------------------------------------------------
# timeouts


async def test_timeout_kills_command_and_returns_promptly(kbb):
    async with kbb.server(*BUSYBOX_ARGS) as srv:
        await srv.run("true")  # create the computer outside the measurement
        # positive control: the scanner does see a matching process (once the background shell
        # has exec'd sleep: on a loaded machine the first scan can come before that)
        seen = (
            "sleep 398 & i=0; while [ $i -lt 200 ]; do "
            f'out=$({proc_scan_command("sleep 398")}); [ -n "$out" ] && break; i=$((i+1)); sleep 0.05; '
            'done; echo "$out"; kill $!'
        )
        res = await srv.run(seen)
        assert "sleep 398" in res.structured["stdout"], "process scan does not work in this image"

        res = await srv.call({"command": "echo partial; sleep 61", "timeout": 1})
        assert_timeout_result(res, 1)
        assert res.elapsed <= TIMEOUT_RETURN_BOUND, f"timeout result took {res.elapsed:.2f} s"
        assert await scan(srv, "sleep 61") == "", "the timed-out sleep is still running"


@pytest.mark.parametrize(
    "command,leftovers",
    [
        ("sleep 301 & sleep 62", ["sleep 301", "sleep 62"]),
        ("sleep 302 & sleep 303 & wait", ["sleep 302", "sleep 303"]),
        ("setsid sleep 304 & sleep 63", ["sleep 304", "sleep 63"]),
        ("(sleep 305; echo never) | cat", ["sleep 305", "cat"]),
        # Escapes that drop the exec tag from their environment (issue 15, item 7).
        ("setsid env -i sh -c 'sleep 306' & sleep 64", ["sleep 306", "sh -c sleep 306", "sleep 64"]),
        ("(env -i sleep 307 &); sleep 65", ["sleep 307", "sleep 65"]),
        ("sh -c 'exec env -i sleep 308' & sleep 66", ["sleep 308", "sleep 66"]),
        ("(setsid env -i sh -c 'env -i sleep 309 & sleep 310' &); sleep 67",
         ["sleep 309", "sleep 310", "sleep 67"]),
        ("(KILNTAINERS_EXEC_ID=forged setsid sleep 313 &); sleep 69", ["sleep 313", "sleep 69"]),
    ],
)
async def test_timeout_kills_background_children(kbb, command, leftovers):
    async with kbb.server(*BUSYBOX_ARGS) as srv:
        await srv.run("true")
        res = await srv.call({"command": command, "timeout": 1})
        assert_timeout_result(res, 1)
        assert res.elapsed <= TIMEOUT_RETURN_BOUND, f"timeout result took {res.elapsed:.2f} s"
        assert await scan(srv, *leftovers) == "", f"processes of {command!r} survived the timeout"


async def test_timeout_spares_untagged_processes_of_earlier_commands(kbb):
    # The widened sweep takes untagged orphans started during the timed-out command only: a
    # daemon an earlier command started (and detached from its tag) keeps running.
    async with kbb.server(*BUSYBOX_ARGS) as srv:
        await srv.run("setsid env -i sleep 311 >/dev/null 2>&1 &")
        started = ""
        deadline = time.monotonic() + 10
        while not started and time.monotonic() < deadline:
            started = await scan(srv, "sleep 311")
        assert started, "the earlier command's daemon did not start"
        res = await srv.call({"command": "setsid env -i sleep 312 & sleep 68", "timeout": 1})
        assert_timeout_result(res, 1)
        assert await scan(srv, "sleep 312", "sleep 68") == ""
        assert await scan(srv, "sleep 311") != "", "a daemon of an earlier command was killed"


async def test_timeout_in_args_mode(kbb):
    async with kbb.server(*BUSYBOX_ARGS) as srv:
        await srv.run("true")
        res = await srv.call({"args": ["sleep", "64"], "timeout": "1"})
        assert_timeout_result(res, 1)
        assert res.elapsed <= TIMEOUT_RETURN_BOUND
        assert await scan(srv, "sleep 64") == ""


async def test_server_default_timeout_and_string_override(kbb):
    async with kbb.server(*BUSYBOX_ARGS, "--timeout", "1") as srv:
        await srv.run("true")
        res = await srv.call({"command": "sleep 65"})
        assert_timeout_result(res, 1)
        assert res.elapsed <= TIMEOUT_RETURN_BOUND
        res = await srv.call({"command": "sleep 66", "timeout": "2"})
        assert_timeout_result(res, 2)
        assert 1.5 <= res.elapsed <= TIMEOUT_RETURN_BOUND + 1
        # a command shorter than the timeout is unaffected
        res = await srv.run("echo fine")
        assert res.structured["stdout"] == "fine\n" and res.structured["exit_code"] == 0
        assert await scan(srv, "sleep 65", "sleep 66") == ""


async def test_timeout_on_default_debian_image(kbb):
    """Default configuration (bash, coreutils) kills the tree too."""
    async with kbb.server() as srv:
        res = await srv.run("echo $BASH_VERSION")
        assert res.structured["stdout"].strip(), "default shell is not bash"
        res = await srv.call({"command": "sleep 306 & sleep 67", "timeout": 1})
        assert_timeout_result(res, 1)
        assert res.elapsed <= TIMEOUT_RETURN_BOUND
        assert await scan(srv, "sleep 306", "sleep 67") == ""


async def test_minimal_image_works_and_timeout_still_returns(kbb):
    """sandbox-busybox:minimal has only sh, sleep, cat, echo: the keep-alive works, and when the
    kill sweep cannot run (no tr/grep) the fixed timeout result is still returned."""
    async with kbb.server(*MINIMAL_ARGS) as srv:
        res = await srv.run("echo hi")
        assert res.structured["stdout"] == "hi\n"
        res = await srv.run("cat", stdin="round\ntrip\n")
        assert res.structured["stdout"] == "round\ntrip\n"
        res = await srv.call({"command": "sleep 68", "timeout": 1})
        assert_timeout_result(res, 1)
        assert res.elapsed <= TIMEOUT_RETURN_BOUND + 2
        res = await srv.run("echo still usable")
        assert res.structured["stdout"] == "still usable\n"


# ---------------------------------------------------------------------------------------------
# output limit


async def test_output_limit_boundaries(kbb):
    async with kbb.server(*BUSYBOX_ARGS, "--output-limit", "1024") as srv:
        res = await srv.run("head -c 2048 /dev/zero | tr '\\0' a")
        assert_limit_result(res, 1024)

        res = await srv.run("head -c 1024 /dev/zero | tr '\\0' b")
        assert res.structured["stdout"] == "b" * 1024 and res.structured["exit_code"] == 0
        assert res.structured["stderr"] == ""

        res = await srv.run("head -c 1025 /dev/zero | tr '\\0' c")
        assert_limit_result(res, 1024)

        # stdout and stderr are counted together
        res = await srv.run("head -c 1000 /dev/zero | tr '\\0' o; head -c 24 /dev/zero | tr '\\0' e >&2")
        assert res.structured["stdout"] == "o" * 1000 and res.structured["stderr"] == "e" * 24
        assert res.structured["exit_code"] == 0
        res = await srv.run("head -c 1000 /dev/zero | tr '\\0' o; head -c 25 /dev/zero | tr '\\0' e >&2")
        assert_limit_result(res, 1024)

        # raw bytes are counted, not characters: 512 two-byte characters = 1024 bytes, intact
        res = await srv.call({"args": ["printf", "%s", "\u00e9" * 512]})
        assert res.ok().structured["stdout"] == "\u00e9" * 512
        res = await srv.call({"args": ["printf", "%s", "\u00e9" * 513]})
        assert_limit_result(res, 1024)

        # a non-zero exit with output under the limit is reported normally
        res = await srv.run("echo small; exit 5")
        assert (res.structured["stdout"], res.structured["exit_code"]) == ("small\n", 5)


@pytest.mark.parametrize(
    "command,procs",
    [
        ("yes | head -c 100000000", ["yes", "head -c 100000000"]),
        ("yes", ["yes"]),
        ("yes > /dev/stderr", ["yes"]),
        ("cat /dev/zero", ["cat /dev/zero"]),
    ],
)
async def test_output_flood_is_cut_and_producer_killed(kbb, command, procs):
    async with kbb.server(*BUSYBOX_ARGS, "--output-limit", "1024") as srv:
        await srv.run("true")
        res = await srv.call({"command": command, "timeout": 60})
        assert_limit_result(res, 1024)
        assert res.elapsed < 10, f"flood took {res.elapsed:.2f} s to be cut"
        assert await scan(srv, *procs) == "", f"producer of {command!r} still running"


async def test_flood_keeps_server_memory_bounded(kbb):
    """Default limit (2 MiB): a command writing 1 GB is cut; the server does not buffer it."""

    def rss_kib(pid: int) -> int:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    async with kbb.server(*BUSYBOX_ARGS) as srv:
        await srv.run("true")
        before = rss_kib(srv.pid)
        start = time.monotonic()
        res = await srv.call({"command": "head -c 1000000000 /dev/zero", "timeout": 120})
        assert_limit_result(res, 2097152)
        assert time.monotonic() - start < 30
        after = rss_kib(srv.pid)
        assert after - before < 64 * 1024, f"server RSS grew from {before} KiB to {after} KiB"
        assert await scan(srv, "head -c 1000000000 /dev/zero") == ""
