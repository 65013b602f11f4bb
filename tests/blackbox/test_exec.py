"""`terminal_execute` behaviour: result shape and text bytes (Python json.dumps of
structuredContent, six keys in order), argument decoding and coercions, every validation message
of docs/decisions.md, "terminal_execute validation" byte for byte and that validation failures create nothing, non-zero exit
codes as successful results, command vs args mode, stdin round trip, working_directory, lossy
UTF-8 decoding, the session default computer (reuse, concurrent first calls), explicit and
invalid computer ids, and parallel execs on different computers (docs/decisions.md, "Tool arguments";
docs/decisions.md, "Computer ids"; docs/decisions.md, "Acceptance checklist" items 4-6, 9-10)."""

from __future__ import annotations

import time

import anyio
import pytest

from harness import (
    BUSYBOX,
    BUSYBOX_ARGS,
    RANDOM_SLUG_RE,
    RESULT_KEYS,
    SLUG_MESSAGE,
    container_for,
    containers_for,
    inspect,
    pyjson,
    wait_gone,
)

pytestmark = pytest.mark.anyio

BOTH = "Cannot provide both 'command' and 'args'. Use 'command' for shell commands or 'args' for direct execution."
NEITHER = "Must provide either 'command' or 'args'."
TIMEOUT_MIN = "timeout must be at least 1 second."


def stdin_too_big(n: int) -> str:
    return f"stdin content exceeds the 2 MiB limit ({n} bytes). Split into smaller chunks or use a different approach."


def invalid_args(prop: str, reason: str) -> str:
    return f"Invalid arguments for tool terminal_execute: {prop}: {reason}"


def assert_error(res, message: str) -> None:
    assert res.is_error is True, res
    assert res.text == message, res
    assert len(res.raw.get("content", [])) == 1, res.raw
    assert res.structured == {"error": message}, res.raw


def assert_success_shape(res) -> None:
    assert res.is_error is False, res
    assert len(res.raw.get("content", [])) == 1, res.raw
    assert list(res.structured) == RESULT_KEYS, res.structured
    assert res.text == pyjson(res.structured), (res.text, res.structured)
    s = res.structured
    assert isinstance(s["computer_id"], str)
    assert isinstance(s["temporary"], bool)
    assert isinstance(s["stdout"], str) and isinstance(s["stderr"], str)
    assert isinstance(s["exit_code"], int) and not isinstance(s["exit_code"], bool)
    assert isinstance(s["exec_duration_ms"], int) and s["exec_duration_ms"] >= 0


# ---------------------------------------------------------------------------------------------
# result shape


async def test_result_shape_and_text_bytes(kbb):
    async with kbb.server(*BUSYBOX_ARGS) as srv:
        res = await srv.call({"command": "echo hello world"})
        assert_success_shape(res)
        s = res.structured
        assert RANDOM_SLUG_RE.match(s["computer_id"]), s["computer_id"]
        assert s["temporary"] is True
        assert s["stdout"] == "hello world\n"
        assert s["stderr"] == ""
        assert s["exit_code"] == 0
        # The text block is exactly Python's json.dumps of the same object.
        expected = (
            '{"computer_id": "%s", "temporary": true, "stdout": "hello world\\n", "stderr": "", '
            '"exit_code": 0, "exec_duration_ms": %d}' % (s["computer_id"], s["exec_duration_ms"])
        )
        assert res.text == expected
        # The computer is a container named and labelled per docs/decisions.md, "Labels and metadata"
        cid = container_for(s["computer_id"])
        assert cid, "no container for the default computer"
        info = inspect(cid)
        assert info["Name"] == f"/kilntainer-{s['computer_id']}"
        labels = info["Config"]["Labels"]
        assert labels["kilntainers"] == "true"
        assert labels["kilntainers.computer-id"] == s["computer_id"]
        assert labels["kilntainers.temporary"] == "true"
        assert labels["kilntainers.image"] == BUSYBOX


async def test_text_escaping_matches_python_json(kbb):
    """Non-ASCII as \\uXXXX (surrogate pairs above U+FFFF), '/' unescaped, control characters."""
    value = "caf\u00e9 \u65e5\u672c \U0001f600 a/b \"q\" back\\slash \t tab \x01\x1f \r\n\b\f"
    async with kbb.server(*BUSYBOX_ARGS) as srv:
        res = await srv.call({"args": ["printf", "%s", value]})
        assert_success_shape(res)
        assert res.structured["stdout"] == value
        assert res.text == pyjson(res.structured)
        assert "\\ud83d\\ude00" in res.text and "\\u00e9" in res.text and "a/b" in res.text
        assert res.text.isascii()


async def test_nonzero_exit_is_not_an_error(kbb):
    async with kbb.server(*BUSYBOX_ARGS) as srv:
        res = await srv.call({"command": "false"})
        assert_success_shape(res)
        assert res.structured["exit_code"] == 1
        res = await srv.call({"command": "echo out; echo err >&2; exit 7"})
        assert_success_shape(res)
        assert (res.structured["stdout"], res.structured["stderr"], res.structured["exit_code"]) == ("out\n", "err\n", 7)
        res = await srv.call({"args": ["sh", "-c", "exit 3"]})
        assert_success_shape(res)
        assert res.structured["exit_code"] == 3


async def test_signal_death_reports_128_plus_signal(kbb):
    async with kbb.server(*BUSYBOX_ARGS) as srv:
        res = await srv.run("kill -9 $$")
        assert res.structured["exit_code"] == 137


async def test_command_mode_uses_shell_and_args_mode_is_literal(kbb):
    async with kbb.server(*BUSYBOX_ARGS) as srv:
        res = await srv.run("printf 'b\\na\\n' | sort | head -n 1 && echo second")
        assert res.structured["stdout"] == "a\nsecond\n"
        res = (await srv.call({"args": ["echo", "$HOME", "a|b", "*", "&&", "x"]})).ok()
        assert res.structured["stdout"] == "$HOME a|b * && x\n"


async def test_exec_duration_measures_exec(kbb):
    async with kbb.server(*BUSYBOX_ARGS) as srv:
        await srv.run("true")  # create the computer first
        res = await srv.run("sleep 1")
        assert 900 <= res.structured["exec_duration_ms"] <= 10_000, res.structured


# ---------------------------------------------------------------------------------------------
# stdin, working directory, persistence, decoding


STDIN_SAMPLES = [
    "line1\nline2\n",
    "no trailing newline",
    "tabs\tand 'single' \"double\" `back` $HOME \\backslash\r\n",
    "UTF-8: caf\u00e9 \u65e5\u672c\u8a9e \U0001f600 \u00a0nbsp \u2028 sep\n\n\n",
    "\n",
]


async def test_stdin_round_trip_is_byte_exact(kbb):
    async with kbb.server(*BUSYBOX_ARGS) as srv:
        for sample in STDIN_SAMPLES:
            res = await srv.run("cat", stdin=sample)
            assert res.structured["stdout"] == sample, sample
        # stdin with args mode, and to a file then read back in a later call
        res = (await srv.call({"args": ["cat"], "stdin": STDIN_SAMPLES[3]})).ok()
        assert res.structured["stdout"] == STDIN_SAMPLES[3]
        await srv.run("cat > /tmp/from-stdin.txt", stdin=STDIN_SAMPLES[2])
        res = await srv.run("cat /tmp/from-stdin.txt")
        assert res.structured["stdout"] == STDIN_SAMPLES[2]
        res = await srv.run("wc -c < /tmp/from-stdin.txt")
        assert int(res.structured["stdout"].strip()) == len(STDIN_SAMPLES[2].encode())


async def test_absent_or_empty_stdin_is_closed(kbb):
    async with kbb.server(*BUSYBOX_ARGS) as srv:
        for extra in ({}, {"stdin": ""}, {"stdin": None}):
            res = (await srv.call({"command": "cat; echo done", "timeout": 20, **extra})).ok()
            assert (res.structured["stdout"], res.structured["exit_code"]) == ("done\n", 0), extra
            assert res.elapsed < 10


async def test_working_directory(kbb):
    async with kbb.server(*BUSYBOX_ARGS) as srv:
        res = await srv.run("pwd", working_directory="/tmp")
        assert res.structured["stdout"] == "/tmp\n"
        res = (await srv.call({"args": ["pwd"], "working_directory": "/etc"})).ok()
        assert res.structured["stdout"] == "/etc\n"
        await srv.run("mkdir -p /tmp/deep/er")
        res = await srv.run("pwd", working_directory="/tmp/deep/er")
        assert res.structured["stdout"] == "/tmp/deep/er\n"
        # default is the image WORKDIR, else / ; empty working_directory means absent
        res = await srv.run("pwd", working_directory="")
        assert res.structured["stdout"] == "/\n"


async def test_shell_state_does_not_persist_but_files_do(kbb):
    async with kbb.server(*BUSYBOX_ARGS) as srv:
        await srv.run("cd /tmp && export KBB_VAR=set && echo kept > /tmp/persist.txt")
        res = await srv.run('pwd; echo "${KBB_VAR:-unset}"; cat /tmp/persist.txt')
        assert res.structured["stdout"] == "/\nunset\nkept\n"


async def test_invalid_utf8_output_is_decoded_with_replacement(kbb):
    async with kbb.server(*BUSYBOX_ARGS) as srv:
        res = await srv.run("printf '\\377\\376abc\\303'; printf 'x\\200y' >&2")
        assert res.structured["stdout"] == b"\xff\xfeabc\xc3".decode("utf-8", "replace")
        assert res.structured["stdout"] == "\ufffd\ufffdabc\ufffd"
        assert res.structured["stderr"] == "x\ufffdy"
        assert res.text == pyjson(res.structured)
        # valid multi-byte UTF-8 survives untouched
        res = await srv.run("printf '\\303\\251\\360\\237\\230\\200'")
        assert res.structured["stdout"] == "\u00e9\U0001f600"


# ---------------------------------------------------------------------------------------------
# validation and argument decoding


VALIDATION_CASES = [
    ({"command": "echo hi", "args": ["echo", "hi"]}, BOTH),
    ({}, NEITHER),
    ({"command": ""}, NEITHER),
    ({"args": []}, NEITHER),
    ({"command": "", "args": []}, NEITHER),
    ({"stdin": "x"}, NEITHER),
    ({"command": "pwd", "working_directory": "tmp"}, "working_directory must be an absolute path, got: tmp"),
    ({"command": "pwd", "working_directory": "./x y"}, "working_directory must be an absolute path, got: ./x y"),
    ({"command": "true", "timeout": 0}, TIMEOUT_MIN),
    ({"command": "true", "timeout": -5}, TIMEOUT_MIN),
    ({"command": "true", "timeout": "0"}, TIMEOUT_MIN),
    ({"command": "cat", "stdin": "a" * (2 * 1024 * 1024 + 1)}, stdin_too_big(2 * 1024 * 1024 + 1)),
    # byte length, not characters: 1,048,577 two-byte characters = 2,097,154 bytes
    ({"command": "cat", "stdin": "\u00e9" * (1024 * 1024 + 1)}, stdin_too_big(2 * 1024 * 1024 + 2)),
    # first failure wins, in the order of the table
    ({"command": "x", "args": ["x"], "working_directory": "rel", "timeout": 0}, BOTH),
    ({"working_directory": "rel", "timeout": 0}, NEITHER),
    ({"command": "x", "working_directory": "rel", "timeout": 0}, "working_directory must be an absolute path, got: rel"),
    ({"command": "x", "timeout": 0, "stdin": "a" * (2 * 1024 * 1024 + 1)}, TIMEOUT_MIN),
    # /proc, however spelled, never reaches the runtime (runc CVE-2024-21626's path)
    ({"command": "pwd", "working_directory": "/proc/self/fd/8"},
     "working_directory must not be under /proc, got: /proc/self/fd/8"),
    ({"args": ["pwd"], "working_directory": "/tmp/../proc//1/cwd"},
     "working_directory must not be under /proc, got: /tmp/../proc//1/cwd"),
    ({"command": "pwd", "working_directory": "/./proc"}, "working_directory must not be under /proc, got: /./proc"),
    # validation runs before computer resolution: an invalid id does not win
    ({"computer_id": "NOT VALID"}, NEITHER),
    # type errors (docs/decisions.md, "Tool arguments"): first offending property in schema order wins
    ({"command": 5}, invalid_args("command", "expected a string")),
    ({"args": "echo hi"}, invalid_args("args", "expected an array of strings")),
    ({"args": ["echo", 1]}, invalid_args("args", "expected an array of strings")),
    ({"command": "true", "stdin": 5}, invalid_args("stdin", "expected a string")),
    ({"command": "true", "working_directory": ["/tmp"]}, invalid_args("working_directory", "expected a string")),
    ({"command": "true", "timeout": 1.5}, invalid_args("timeout", "expected an integer")),
    ({"command": "true", "timeout": "abc"}, invalid_args("timeout", "expected an integer")),
    ({"command": "true", "timeout": True}, invalid_args("timeout", "expected an integer")),
    ({"command": "true", "computer_id": 7}, invalid_args("computer_id", "expected a string")),
    ({"command": "true", "temporary": "maybe"}, invalid_args("temporary", "expected a boolean")),
    ({"command": "true", "temporary": 2}, invalid_args("temporary", "expected a boolean")),
    ({"command": 5, "timeout": 1.5}, invalid_args("command", "expected a string")),
    ({"timeout": 1.5, "temporary": "maybe"}, invalid_args("timeout", "expected an integer")),
]


async def test_validation_messages_are_exact_and_create_nothing(kbb):
    async with kbb.server(*BUSYBOX_ARGS) as srv:
        failures = []
        for args, message in VALIDATION_CASES:
            res = await srv.call(args)
            try:
                assert_error(res, message)
            except AssertionError:
                shown = {k: (v if not isinstance(v, str) or len(v) < 40 else f"<{len(v)} chars>") for k, v in args.items()}
                failures.append(f"{shown}: expected {message!r}, got is_error={res.is_error} text={res.text!r:.300}")
        assert srv.containers() == [], "a validation failure created a computer"
        assert not failures, "\n".join(failures)
        # the session still works and gets its default only now
        res = await srv.run("echo ok")
        assert res.structured["stdout"] == "ok\n"


async def test_explicit_nulls_mean_absent(kbb):
    async with kbb.server(*BUSYBOX_ARGS) as srv:
        res = await srv.call(
            {
                "command": "echo null-ok",
                "args": None,
                "stdin": None,
                "working_directory": None,
                "timeout": None,
                "computer_id": None,
                "temporary": None,
            }
        )
        assert_success_shape(res)
        assert res.structured["stdout"] == "null-ok\n"
        assert res.structured["temporary"] is True
        assert RANDOM_SLUG_RE.match(res.structured["computer_id"])
        res = (await srv.call({"command": None, "args": ["echo", "args-ok"]})).ok()
        assert res.structured["stdout"] == "args-ok\n"


async def test_lenient_coercions(kbb):
    async with kbb.server(*BUSYBOX_ARGS) as srv:
        for timeout in ("5", 5.0, 5):
            res = (await srv.call({"command": "echo t", "timeout": timeout})).ok()
            assert res.structured["stdout"] == "t\n", timeout
        res = await srv.call({"command": "true", "timeout": 1.5})
        assert_error(res, "Invalid arguments for tool terminal_execute: timeout: expected an integer")
        # boolean spellings, on explicit ids so that the mode is observable
        cases = [("True", True), ("false", False), ("YES", True), ("no", False), ("on", True), ("OFF", False),
                 ("1", True), ("0", False), (1, True), (0, False)]
        for i, (value, expected) in enumerate(cases):
            cid = kbb.new_id(f"coerce{i}")
            res = (await srv.call({"command": "true", "computer_id": cid, "temporary": value})).ok()
            assert res.structured["temporary"] is expected, (value, res.structured)
        # unknown properties are ignored
        res = (await srv.call({"command": "echo extra", "bogus": 1, "another": {"x": None}})).ok()
        assert res.structured["stdout"] == "extra\n"


# ---------------------------------------------------------------------------------------------
# computers: session default, explicit ids


async def test_session_default_is_reused_and_mode_of_default_wins(kbb):
    async with kbb.server(*BUSYBOX_ARGS) as srv:
        first = await srv.run("echo 1 > /tmp/mark")
        default = first.structured["computer_id"]
        assert RANDOM_SLUG_RE.match(default)
        second = await srv.run("cat /tmp/mark", temporary=False)
        assert second.structured["computer_id"] == default
        assert second.structured["temporary"] is True, "temporary=false must be ignored for the default"
        assert second.structured["stdout"] == "1\n"
        assert len(containers_for(default)) == 1
        # an explicit id does not change the default
        other = kbb.new_id("not-default")
        await srv.run("true", computer_id=other)
        third = await srv.run("cat /tmp/mark")
        assert third.structured["computer_id"] == default


async def test_concurrent_first_calls_create_one_default(kbb):
    async with kbb.server(*BUSYBOX_ARGS) as srv:
        results = [None] * 5

        async def one(i):
            results[i] = await srv.call({"command": f"echo {i}"})

        async with anyio.create_task_group() as tg:
            for i in range(5):
                tg.start_soon(one, i)
        ids = {r.ok().structured["computer_id"] for r in results}
        assert len(ids) == 1, ids
        assert [r.structured["stdout"] for r in results] == [f"{i}\n" for i in range(5)]
        (default,) = ids
        assert len(containers_for(default)) == 1
        assert len(srv.containers()) == 1


async def test_execs_on_different_computers_run_in_parallel(kbb):
    a, b = kbb.new_id("par-a"), kbb.new_id("par-b")
    async with kbb.server(*BUSYBOX_ARGS) as srv:
        await srv.run("true", computer_id=a)
        await srv.run("true", computer_id=b)
        results = {}

        async def one(cid):
            results[cid] = (await srv.call({"command": "sleep 2; echo done", "computer_id": cid})).ok()

        start = time.monotonic()
        async with anyio.create_task_group() as tg:
            tg.start_soon(one, a)
            tg.start_soon(one, b)
        elapsed = time.monotonic() - start
        assert results[a].structured["stdout"] == results[b].structured["stdout"] == "done\n"
        assert elapsed < 3.5, f"two 2 s execs on two computers took {elapsed:.2f} s (not parallel)"


async def test_execs_on_one_computer_run_one_at_a_time(kbb):
    async with kbb.server(*BUSYBOX_ARGS) as srv:
        await srv.run("true")
        # each exec appends start/end markers; serialised execs never interleave
        script = "echo start-$N >> /tmp/order; sleep 1; echo end-$N >> /tmp/order"

        async def one(n):
            (await srv.call({"command": f"N={n}; {script}"})).ok()

        async with anyio.create_task_group() as tg:
            for n in range(3):
                tg.start_soon(one, n)
        lines = (await srv.run("cat /tmp/order")).structured["stdout"].split()
        assert len(lines) == 6
        for i in range(0, 6, 2):
            assert lines[i].startswith("start-") and lines[i + 1] == "end-" + lines[i][len("start-"):], lines


async def test_explicit_id_is_trimmed_and_released(kbb):
    cid = kbb.new_id("dev-box")
    async with kbb.server(*BUSYBOX_ARGS) as srv:
        res = await srv.run("echo x > /tmp/x", computer_id=f"  {cid} ")
        assert res.structured["computer_id"] == cid
        assert res.structured["temporary"] is True
        res = await srv.run("cat /tmp/x", computer_id=cid)
        assert res.structured["computer_id"] == cid and res.structured["stdout"] == "x\n"
        res = await srv.run("cat /tmp/x", computer_id=f"\t{cid}\n")
        assert res.structured["computer_id"] == cid
        container = container_for(cid)
        assert container and inspect(container)["Name"] == f"/kilntainer-{cid}"
    # released with the session: no owner leak through the padded spelling
    assert wait_gone(cid), f"temporary computer {cid} not removed after the session ended"


INVALID_IDS = ["", "   ", "UPPER", "Upper-case", "with space", "-leading", "trailing-", "-x", "x-", "a" * 64,
               "under_score", "a_b", "dot.ted", "caf\u00e9", "slash/x"]


async def test_invalid_computer_ids_are_rejected(kbb):
    async with kbb.server(*BUSYBOX_ARGS) as srv:
        failures = []
        for bad in INVALID_IDS:
            res = await srv.call({"command": "true", "computer_id": bad})
            try:
                assert_error(res, SLUG_MESSAGE)
            except AssertionError:
                failures.append(f"{bad!r}: is_error={res.is_error} text={res.text!r:.200}")
        assert not failures, "\n".join(failures)
        assert srv.containers() == []
        # boundary: 63 characters and consecutive hyphens are valid
        long_id = kbb.new_id("x" * (63 - 8))
        assert len(long_id) == 63
        res = await srv.run("true", computer_id=long_id)
        assert res.structured["computer_id"] == long_id
        hy = kbb.new_id("a--b")
        res = await srv.run("true", computer_id=hy)
        assert res.structured["computer_id"] == hy
        assert sorted([container_for(long_id), container_for(hy)]) == srv.containers()


async def test_concurrent_calls_with_same_explicit_id_create_once(kbb):
    cid = kbb.new_id("same")
    async with kbb.server(*BUSYBOX_ARGS) as srv:
        results = []

        async def one(i):
            results.append(await srv.call({"command": f"echo {i}", "computer_id": cid}))

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(one, i)
        assert sorted(r.ok().structured["stdout"] for r in results) == [f"{i}\n" for i in range(4)]
        assert {r.structured["computer_id"] for r in results} == {cid}
        assert len(containers_for(cid)) == 1


async def test_first_omitted_id_call_may_make_a_permanent_default(kbb):
    async with kbb.server(*BUSYBOX_ARGS) as srv:
        first = await srv.run("echo keep > /root/k", temporary=False)
        default = first.structured["computer_id"]
        assert RANDOM_SLUG_RE.match(default) and first.structured["temporary"] is False
        second = await srv.run("cat /root/k")
        assert second.structured["computer_id"] == default and second.structured["temporary"] is False
        container = container_for(default)
    assert srv.returncode() == 0
    assert container_for(default) == container, "a permanent default must survive the session"
