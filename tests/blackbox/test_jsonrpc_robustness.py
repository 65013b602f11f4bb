"""Raw JSON-RPC lines on stdio: every request whose id can be read gets exactly one response with
that id, whatever else is wrong with it (issue 15, item 9).  Lone UTF-16 surrogate escapes are
replaced by U+FFFD, numbers outside the f64 range are invalid params, lines that are not JSON
get -32700 with id null, malformed requests -32600, a non-object `arguments` -32602, batches
-32600, and an over-long line is refused without being held in memory while the next line is
still served.  The lines are written by hand because an SDK client cannot send any of this."""

from __future__ import annotations

import json
import random
import time

import anyio
import httpx
import pytest

from harness import BUSYBOX_ARGS, RawServer

pytestmark = pytest.mark.anyio

# The server's line limit (src/transport/screen.rs MAX_LINE_BYTES).
LINE_LIMIT = 16 * 1024 * 1024
MIB = 1024 * 1024
# How long one answer may take: validation errors are answered at once, and a real exec in a
# busybox container takes well under this even on a loaded machine.
ANSWER_DEADLINE = 20.0


class Lines(RawServer):
    """RawServer plus raw bytes and a strict "exactly one answer, in order" reader."""

    def __exit__(self, *exc) -> None:
        # Close stdin first so the server removes its temporary computer and exits by itself.
        if self.proc.poll() is None:
            self.close_stdin()
            try:
                self.proc.wait(timeout=15)
            except Exception:
                pass
        super().__exit__(*exc)

    def send_line(self, line: str | bytes) -> None:
        # surrogatepass: a lone surrogate written raw becomes invalid UTF-8, which is a case too.
        data = line.encode("utf-8", "surrogatepass") if isinstance(line, str) else line
        self.proc.stdin.write(data + b"\n")
        self.proc.stdin.flush()

    def answer(self, timeout: float = ANSWER_DEADLINE) -> dict:
        msg = self.read_message(timeout)
        assert msg is not None, f"no answer within {timeout} s; server stderr tail: {self.stderr_tail()}"
        return msg

    def exchange(self, line: str | bytes) -> dict:
        self.send_line(line)
        return self.answer()

    def assert_quiet_then_ping(self) -> None:
        """Nothing else is pending: a ping right now is answered next (no stray duplicates)."""
        self._next_id += 1
        pid = f"ping-{self._next_id}"
        self.send({"jsonrpc": "2.0", "id": pid, "method": "ping"})
        msg = self.answer()
        assert msg.get("id") == pid and "result" in msg, f"expected the ping's answer next, got {msg}"

    def stderr_tail(self) -> str:
        self._err.flush()
        return self.errlog.read_text(errors="replace")[-2000:]

    def rss_kib(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        raise AssertionError("no VmRSS line")


def call_line(rid, arguments_json: str, name: str = "terminal_execute") -> str:
    return (
        f'{{"jsonrpc":"2.0","id":{json.dumps(rid)},"method":"tools/call",'
        f'"params":{{"name":{json.dumps(name)},"arguments":{arguments_json}}}}}'
    )


def error_of(msg: dict, rid, code: int) -> str:
    assert msg.get("jsonrpc") == "2.0", msg
    assert "id" in msg and msg["id"] == rid, f"expected id {rid!r}: {msg}"
    assert "error" in msg and "result" not in msg, msg
    assert msg["error"]["code"] == code, msg
    return msg["error"]["message"]


def test_issue_15_lone_surrogates_are_replaced_not_dropped(kbb):
    # See: issue 15
    with Lines(kbb, *BUSYBOX_ARGS) as raw:
        cases = {
            "high": r"\ud800",
            "low": r"\udc00",
            "reversed pair": r"\udc00\ud800",
            "high then text": r"\ud83dx",
        }
        for n, (label, escaped) in enumerate(cases.items(), start=1):
            msg = raw.exchange(call_line(n, f'{{"command":"printf %s \\"{escaped}\\""}}'))
            assert msg.get("id") == n and "result" in msg, f"{label}: {msg}"
            result = msg["result"]
            assert result.get("isError") is not True, f"{label}: {result}"
            structured = result["structuredContent"]
            kbb.track(structured["computer_id"], temporary=structured.get("temporary"))
            expected = "\ufffd" * escaped.count("\\u") if label != "high then text" else "\ufffdx"
            assert structured["stdout"] == expected, f"{label}: {structured}"
        # A whole pair is left alone.
        msg = raw.exchange(call_line(9, r'{"command":"printf %s \"\ud83d\ude00\""}'))
        assert msg["result"]["structuredContent"]["stdout"] == "\U0001F600", msg
        raw.assert_quiet_then_ping()


@pytest.mark.parametrize("number", ["1e400", "-1e400", "1" + "0" * 400])
def test_issue_15_out_of_range_number_is_invalid_params_with_the_id(kbb, number):
    # See: issue 15
    with Lines(kbb) as raw:
        msg = raw.exchange(call_line(11, f'{{"command":"true","timeout":{number}}}'))
        message = error_of(msg, 11, -32602)
        assert "outside the range" in message, msg
        raw.assert_quiet_then_ping()


@pytest.mark.parametrize(
    "line, rid, code",
    [
        pytest.param("this is not json", None, -32700, id="garbage"),
        pytest.param('{"jsonrpc":"2.0","id":3,"method":"ping"', None, -32700, id="truncated"),
        pytest.param('{"jsonrpc":"2.0","id":7}', 7, -32600, id="no-method"),
        pytest.param('{"jsonrpc":"2.0","id":"m","method":42}', "m", -32600, id="method-not-string"),
        pytest.param('{"id":4,"method":"ping"}', 4, -32600, id="no-jsonrpc"),
        pytest.param('{"jsonrpc":"2.0","id":[1],"method":"ping"}', None, -32600, id="id-not-scalar"),
        pytest.param('"just a string"', None, -32600, id="not-an-object"),
        pytest.param(
            '[{"jsonrpc":"2.0","id":1,"method":"ping"},{"jsonrpc":"2.0","id":2,"method":"ping"}]',
            None, -32600, id="batch",
        ),
        pytest.param(
            '{"jsonrpc":"2.0","id":8,"method":"tools/call","params":{"name":"terminal_execute","arguments":"echo hi"}}',
            8, -32602, id="arguments-string",
        ),
        pytest.param(
            '{"jsonrpc":"2.0","id":10,"method":"tools/call","params":{"name":"terminal_execute","arguments":[1]}}',
            10, -32602, id="arguments-array",
        ),
        pytest.param('{"jsonrpc":"2.0","id":12,"method":"tools/call","params":{"arguments":{}}}', 12, -32602,
                     id="no-tool-name"),
        pytest.param('{"jsonrpc":"2.0","id":13,"method":"tools/list","params":"x"}', 13, -32602,
                     id="params-string"),
    ],
)
def test_issue_15_malformed_lines_get_one_error_with_the_readable_id(kbb, line, rid, code):
    # See: issue 15
    with Lines(kbb) as raw:
        error_of(raw.exchange(line), rid, code)
        raw.assert_quiet_then_ping()


def test_issue_15_unknown_method_is_still_method_not_found(kbb):
    # See: issue 15 (the -32602 mapping must not swallow genuine unknown methods)
    with Lines(kbb) as raw:
        error_of(raw.exchange('{"jsonrpc":"2.0","id":21,"method":"no/such/method","params":{}}'), 21, -32601)
        raw.assert_quiet_then_ping()


def test_issue_15_over_long_line_is_refused_and_not_held(kbb):
    # See: issue 15
    with Lines(kbb) as raw:
        raw.assert_quiet_then_ping()
        before = raw.rss_kib()
        filler = "a" * (20 * MIB)
        big = call_line("big-1", json.dumps({"command": "true", "stdin": filler}))
        assert len(big) > LINE_LIMIT
        message = error_of(raw.exchange(big), "big-1", -32600)
        assert "16 MiB" in message, message
        # A long line whose id comes after the cut gets id null.
        late_id = '{"jsonrpc":"2.0","params":{"pad":"' + "b" * (20 * MIB) + '"},"id":5,"method":"ping"}'
        error_of(raw.exchange(late_id), None, -32600)
        # ...unless it ends the line, as the official Python SDK writes it.
        last_id = '{"method":"ping","params":{"pad":"' + "b" * (20 * MIB) + '"},"jsonrpc":"2.0","id":6}'
        error_of(raw.exchange(last_id), 6, -32600)
        # A line without any newline inside 40 MiB: still skipped as it arrives.
        error_of(raw.exchange(b"c" * (40 * MIB)), None, -32600)
        raw.assert_quiet_then_ping()
        after = raw.rss_kib()
        # 80 MiB went through; measured growth is under 1 MiB (the line buffer is released).
        assert after - before < 8 * 1024, f"RSS grew from {before} KiB to {after} KiB"
        # A request just under the limit is still served.
        near = call_line(31, json.dumps({"command": "true", "computer_id": "NOT A SLUG", "pad": "d" * (LINE_LIMIT - 200)}))
        assert len(near) < LINE_LIMIT
        msg = raw.exchange(near)
        assert msg.get("id") == 31 and msg["result"].get("isError") is True, str(msg)[:500]


# Fuzz: random tool calls whose arguments always fail validation (an invalid computer_id of a
# random type), so no computer is needed; everything else about them is random.
FUZZ_CALLS = 500
FUZZ_SEED = 15


def _random_text(rng: random.Random) -> str:
    pieces = []
    for _ in range(rng.randint(0, 12)):
        kind = rng.random()
        if kind < 0.25:
            pieces.append(chr(rng.randint(0xD800, 0xDFFF)))  # a lone surrogate (escaped by dumps)
        elif kind < 0.4:
            pieces.append(chr(rng.choice([0x1F600, 0x10FFFF, 0x10000])))  # a real pair
        elif kind < 0.55:
            pieces.append(chr(rng.randint(0, 0x1F)))
        elif kind < 0.7:
            pieces.append(rng.choice(['"', "\\", "\n", "\u2028", "'", "$(", "`"]))
        else:
            pieces.append(chr(rng.randint(0x20, 0xFFFF)) if rng.random() < 0.5 else "echo")
    return "".join(pieces)


HUGE = ["1e400", "-1e400", "1" + "0" * 330, "1e-400", "-0", "9223372036854775808", "1.5e308", "-1.0e309"]


def _random_value(rng: random.Random, depth: int = 0) -> str:
    """JSON text of a random value (text, because 1e400 has no Python float)."""
    kind = rng.randrange(8 if depth < 2 else 6)
    if kind == 0:
        return json.dumps(_random_text(rng), ensure_ascii=rng.random() < 0.8)
    if kind == 1:
        return rng.choice(HUGE)
    if kind == 2:
        return str(rng.randint(-(2**70), 2**70))
    if kind == 3:
        return repr(rng.uniform(-1e6, 1e6))
    if kind == 4:
        return rng.choice(["true", "false", "null"])
    if kind == 5:
        return str(rng.randint(-5, 100000))
    if kind == 6:
        return "[" + ",".join(_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))) + "]"
    members = ",".join(
        f"{json.dumps(_random_text(rng))}:{_random_value(rng, depth + 1)}" for _ in range(rng.randint(0, 3))
    )
    return "{" + members + "}"


def _invalid_computer_id(rng: random.Random) -> str:
    choice = rng.randrange(4)
    if choice == 0:
        return json.dumps("BAD " + _random_text(rng))
    if choice == 1:
        return rng.choice(HUGE[:3] + ["12", "true", "[]", "{}"])
    if choice == 2:
        return json.dumps("-" + _random_text(rng) + "\ud800")
    return json.dumps("x" * 64 + _random_text(rng))


def _fuzz_line(rng: random.Random, rid: int) -> str:
    properties = [f'"computer_id":{_invalid_computer_id(rng)}']
    for name in ["command", "timeout", "stdin", "working_directory", "args", "env", _random_text(rng)]:
        if rng.random() < 0.6:
            properties.append(f"{json.dumps(name)}:{_random_value(rng)}")
    rng.shuffle(properties)
    return call_line(rid, "{" + ",".join(properties) + "}")


def test_issue_15_fuzzed_calls_each_get_exactly_one_answer(kbb):
    # See: issue 15
    rng = random.Random(FUZZ_SEED)
    with Lines(kbb) as raw:
        started = time.monotonic()
        for rid in range(1000, 1000 + FUZZ_CALLS):
            line = _fuzz_line(rng, rid)
            msg = raw.exchange(line)
            assert msg.get("id") == rid, f"call {rid} got {msg}\nline: {line}"
            if "result" in msg:
                assert msg["result"].get("isError") is True, f"call {rid} needed no computer: {msg}\nline: {line}"
            else:
                assert msg["error"]["code"] == -32602, f"call {rid}: {msg}\nline: {line}"
        raw.assert_quiet_then_ping()
        took = time.monotonic() - started
        assert took < 120, f"{FUZZ_CALLS} fuzzed calls took {took:.1f} s"


# ---------------------------------------------------------------------------------------------
# The same screen on Streamable HTTP.

HTTP_TOKEN = "kbb-screen-token"


def _messages(response) -> list[dict]:
    """JSON-RPC messages of a POST response, whether a JSON body or an SSE stream."""
    ctype = response.headers.get("content-type", "")
    if ctype.startswith("application/json"):
        return [response.json()]
    if ctype.startswith("text/event-stream"):
        out = []
        for line in response.text.splitlines():
            if line.startswith("data:") and line[5:].strip():
                out.append(json.loads(line[5:]))
        return out
    return []


async def test_issue_15_http_gets_the_same_answers(kbb):
    # See: issue 15
    async with kbb.http_server(*BUSYBOX_ARGS, env={"KILNTAINERS_AUTH_TOKEN": HTTP_TOKEN}) as srv:
        base = {
            "Content-Type": "application/json",
            "Accept": "application/json, text/event-stream",
            "Authorization": f"Bearer {HTTP_TOKEN}",
        }
        async with httpx.AsyncClient(timeout=60) as client:
            init = await client.post(srv.mcp_url, headers=base, json={
                "jsonrpc": "2.0", "id": 1, "method": "initialize",
                "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                           "clientInfo": {"name": "kbb-screen", "version": "0"}},
            })
            assert init.status_code == 200, init.text
            headers = {**base, "Mcp-Session-Id": init.headers["mcp-session-id"],
                       "MCP-Protocol-Version": "2025-11-25"}
            done = await client.post(srv.mcp_url, headers=headers,
                                     content=b'{"jsonrpc":"2.0","method":"notifications/initialized"}')
            assert done.status_code == 202, done.text

            async def post(line: str):
                response = await client.post(srv.mcp_url, headers=headers, content=line.encode())
                return response, [m for m in _messages(response) if "id" in m]

            response, answers = await post(call_line(2, r'{"command":"printf %s \"\ud800\""}'))
            assert response.status_code == 200 and len(answers) == 1, (response.status_code, response.text)
            result = answers[0]["result"]
            kbb.track(result["structuredContent"]["computer_id"], temporary=True)
            assert result["structuredContent"]["stdout"] == "\ufffd", result

            for line, rid, code, status in [
                (call_line(3, '{"command":"true","timeout":1e400}'), 3, -32602, 200),
                (call_line(4, '"echo hi"'), 4, -32602, 200),
                ('{"jsonrpc":"2.0","id":5}', 5, -32600, 200),
                ("not json at all", None, -32700, 400),
            ]:
                response = await client.post(srv.mcp_url, headers=headers, content=line.encode())
                assert response.status_code == status, (line, response.status_code, response.text)
                found = _messages(response)
                assert len(found) == 1, (line, response.text)
                error_of(found[0], rid, code)


async def test_an_over_long_call_from_the_python_sdk_gets_its_error_not_a_hang(kbb):
    """The SDK writes `id` last; the refusal must still carry it, or the call waits forever."""
    async with kbb.server(*BUSYBOX_ARGS) as srv:
        with anyio.fail_after(60):
            with pytest.raises(Exception, match="16 MiB"):
                await srv.session.call_tool("terminal_execute", {"command": "true", "stdin": "x" * (17 * MIB)})
            res = await srv.run("echo still here")
        assert res.structured["stdout"] == "still here\n"
