"""The resident exec helper (docs/exec-helper.md) as an MCP client sees it.

Which path ran a command is read inside the computer: under the helper a command's parent is
`/.kilntainers/helper-<hash> serve`; under plain Docker exec its parent pid is 0.  The rest of
the black-box suite runs once with the helper on (the default) and its core files once more
with KILNTAINERS_EXEC_HELPER=off (scripts/test.sh), so every behaviour is checked on both paths.
"""

from __future__ import annotations

import pytest

from harness import BUSYBOX, BUSYBOX_ARGS, DEBIAN, MINIMAL_ARGS, docker_exec, poll

pytestmark = pytest.mark.anyio

ON = {"KILNTAINERS_EXEC_HELPER": "on"}
OFF = {"KILNTAINERS_EXEC_HELPER": "off"}
PARENT = "tr '\\0' ' ' < /proc/$PPID/cmdline"


async def parent_of(srv, **kw) -> str:
    return (await srv.run(PARENT, **kw)).structured["stdout"]


async def test_helper_runs_commands_on_busybox_and_debian_images(kbb):
    for args in (BUSYBOX_ARGS, ["--image", DEBIAN]):
        async with kbb.server(*args, env=ON) as srv:
            parent = await parent_of(srv)
            assert parent.startswith("/.kilntainers/helper-") and parent.endswith(" serve "), parent
            # Same results as Docker exec: stdout, stderr, code, stdin, working directory.
            res = await srv.run("cat; pwd; echo err >&2; exit 5", stdin="in\n", working_directory="/tmp")
            s = res.structured
            assert (s["stdout"], s["stderr"], s["exit_code"]) == ("in\n/tmp\n", "err\n", 5)


async def test_start_failures_read_like_docker_exec_on_both_paths(kbb):
    """Args mode with a missing program or directory: Docker exec answers 126 with the runtime's
    message on stdout; the helper says the same, so results do not depend on the path."""
    results = {}
    for name, env in (("on", ON), ("off", OFF)):
        async with kbb.server(*BUSYBOX_ARGS, env=env) as srv:
            missing = (await srv.call({"args": ["nosuchcmd"]})).ok().structured
            bad_dir = (await srv.call({"args": ["pwd"], "working_directory": "/nonexistent"})).ok().structured
            results[name] = [(r["stdout"], r["exit_code"]) for r in (missing, bad_dir)]
    assert results["on"] == results["off"], results
    (missing_out, missing_code), (dir_out, dir_code) = results["on"]
    assert missing_code == dir_code == 126
    assert 'exec: "nosuchcmd": executable file not found in $PATH' in missing_out
    assert 'chdir to cwd ("/nonexistent")' in dir_out and "no such file or directory" in dir_out


async def test_exec_helper_off_uses_docker_exec(kbb):
    async with kbb.server(*BUSYBOX_ARGS, "--exec-helper", "off") as srv:
        assert (await srv.run("echo $PPID")).structured["stdout"] == "0\n"
    async with kbb.server(*BUSYBOX_ARGS, env=OFF) as srv:
        assert (await srv.run("echo $PPID")).structured["stdout"] == "0\n"


async def test_helper_killed_mid_command_fails_that_call_then_recovers(kbb):
    async with kbb.server(*BUSYBOX_ARGS, env=ON) as srv:
        first = (await srv.run("echo $PPID")).structured["stdout"]
        res = await srv.call({"command": "kill -9 $PPID; sleep 1000"})
        assert res.is_error, res.raw
        assert "exec helper" in res.text and "interrupted" in res.text, res.text
        # The next call gets a new helper; the orphaned sleep was killed by the sweep.
        second = (await srv.run("echo $PPID")).structured["stdout"]
        assert second not in ("0\n", first), (first, second)
        left = await srv.run(
            "for d in /proc/[0-9]*; do tr '\\0' ' ' < $d/cmdline 2>/dev/null; echo; done | grep -c '^sleep 1000 $' || true"
        )
        assert left.structured["stdout"].strip() == "0"


async def test_read_only_computer_falls_back_and_says_why_once(kbb):
    async with kbb.server(*BUSYBOX_ARGS, "--docker-run-flag=--read-only", env=ON) as srv:
        for _ in range(3):
            res = await srv.run("echo $PPID; cat", stdin="data")
            assert res.structured["stdout"] == "0\ndata"
        res = await srv.call({"command": "sleep 1000", "timeout": 1})
        assert res.ok().structured["exit_code"] == 124
        log = srv.stderr()
        assert log.count("exec helper cannot run here") == 1, log
        assert "read-only" in log, log


async def test_minimal_image_runs_through_the_helper(kbb):
    """That image has only sh, sleep, cat and echo: the static helper needs nothing from it."""
    async with kbb.server(*MINIMAL_ARGS, env=ON) as srv:
        res = await srv.run("echo $PPID; cat", stdin="x")
        parent, rest = res.structured["stdout"].split("\n", 1)
        assert int(parent) > 0 and rest == "x", res.structured


async def test_reference_computer_gets_the_helper_and_keeps_nothing_after_the_server(kbb):
    """A computer made by the Python reference (tail -f /dev/null keep-alive) gets the helper by
    upload on first use; when the server goes, so does the helper process."""
    cid = kbb.new_id("pyref-helper")
    container = kbb.python_style_container(cid, BUSYBOX, temporary="false", start=True)
    helpers = "for d in /proc/[0-9]*; do tr '\\0' ' ' < $d/cmdline 2>/dev/null; echo; done | grep -c '^/.kilntainers/helper-' || true"
    async with kbb.server(*BUSYBOX_ARGS, env=ON) as srv:
        parent = await parent_of(srv, computer_id=cid, temporary=False)
        assert parent.startswith("/.kilntainers/helper-"), parent
        assert docker_exec(container, "sh", "-c", helpers).stdout == "1\n"
    # The helper sees its stdin close and exits (it kills nothing: no command was running).
    gone = poll(lambda: docker_exec(container, "sh", "-c", helpers).stdout == "0\n", 10)
    assert gone, docker_exec(container, "sh", "-c", helpers).stdout
    assert docker_exec(container, "sh", "-c", "echo still-usable").stdout == "still-usable\n"
