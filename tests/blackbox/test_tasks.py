"""The MCP Tasks extension (docs/tasks.md; issue 36) with a raw JSON-RPC client over
Streamable HTTP that follows the extension's text (`io.modelcontextprotocol/tasks`, protocol
2026-07-28): every request is sessionless and carries its protocol version and capabilities in
`_meta`, `Mcp-Method` and `Mcp-Name` headers as the text asks (the task id for `tasks/*`).

Cases: `server/discover` advertises the extension and `initialize` stays as it was; a long
command becomes a task polled to completion whose result equals an undeclared call's; a quick
command gets its plain result and leaves no job behind; an undeclared request is unchanged and
its `tasks/get` refused; the output limit and the timeout read as terminal_execute's;
`tasks/cancel` leaves no process in the computer; after a SIGKILL of the server a new process
answers `tasks/get`; another principal's id is refused exactly like an unknown one; and a task
expires with its files. The official Python SDK (1.x and 2.3) has no client for the extension,
so there is no case with it."""

from __future__ import annotations

import itertools
import json
import signal
import time

import httpx
import pytest

from harness import (
    BUSYBOX_ARGS, apoll, container_for, docker_exec, limit_notice, proc_scan_command, pyjson, timeout_notice,
)
from test_principals import ALICE, BOB, bearer, remove_owned, tag, write_tokens

pytestmark = pytest.mark.anyio

EXTENSION = "io.modelcontextprotocol/tasks"
PROTOCOL = "2026-07-28"
UNKNOWN = ("Failed to retrieve task: no task with this id exists for this caller; it may have "
           "expired, and an expired task's result is removed.")
# A quick first answer, so the tests need not wait the default 5 seconds.
FAST = ["--task-after", "1"]
ids = itertools.count(1)


def messages(response: httpx.Response) -> list[dict]:
    """The JSON-RPC messages of a POST answer: a JSON body or an SSE stream."""
    if response.headers.get("content-type", "").startswith("application/json"):
        return [response.json()]
    return [json.loads(line[5:]) for line in response.text.splitlines()
            if line.startswith("data:") and line[5:].strip()]


class Raw:
    """One caller: each method is one sessionless 2026-07-28 POST, with the per-request
    capabilities in `_meta` (the extension declared unless `declare=False`)."""

    def __init__(self, srv, auth: dict | None = None, declare: bool = True):
        self.url = srv.mcp_url
        self.auth = srv.auth() if auth is None else auth
        self.declare = declare

    async def send(self, method: str, params: dict) -> dict:
        capabilities = {"extensions": {EXTENSION: {}}} if self.declare else {}
        params = {**params, "_meta": {
            "io.modelcontextprotocol/protocolVersion": PROTOCOL,
            "io.modelcontextprotocol/clientCapabilities": capabilities,
            "io.modelcontextprotocol/clientInfo": {"name": "tasks-by-the-text", "version": "1"},
        }}
        headers = {**self.auth, "Content-Type": "application/json",
                   "Accept": "application/json, text/event-stream",
                   "MCP-Protocol-Version": PROTOCOL, "Mcp-Method": method}
        # The extension: tasks/* carry the task id as Mcp-Name; tools/call names the tool.
        name = params.get("taskId") or params.get("name")
        if name:
            headers["Mcp-Name"] = name
        request_id = next(ids)
        body = {"jsonrpc": "2.0", "id": request_id, "method": method, "params": params}
        async with httpx.AsyncClient(timeout=120) as client:
            response = await client.post(self.url, headers=headers, json=body)
        # rmcp answers a request its gate refuses (-32021) with HTTP 400 and the error as JSON.
        assert response.status_code in (200, 400), (response.status_code, response.text)
        (answer,) = [m for m in messages(response) if m.get("id") == request_id]
        assert response.status_code == 200 or "error" in answer, answer
        return answer

    async def execute(self, **arguments) -> dict:
        return await self.send("tools/call", {"name": "terminal_execute", "arguments": arguments})

    async def get(self, task_id: str) -> dict:
        return await self.send("tasks/get", {"taskId": task_id})

    async def cancel(self, task_id: str) -> dict:
        return await self.send("tasks/cancel", {"taskId": task_id})

    async def until_terminal(self, task_id: str, limit: float = 60) -> tuple[dict, list[dict]]:
        """Polls `tasks/get` at the suggested interval until the task is terminal: the last
        answer's result and every `working` one before it."""
        working: list[dict] = []
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            result = (await self.get(task_id))["result"]
            assert result["resultType"] == "complete", result
            assert result["taskId"] == task_id
            if result["status"] != "working":
                return result, working
            working.append(result)
            await apoll(lambda: False, result["pollIntervalMs"] / 1000, 0.05)
        raise AssertionError(f"task {task_id} still working after {limit} s: {working[-1:]}")


def task_of(answer: dict) -> dict:
    result = answer["result"]
    assert result.get("resultType") == "task", answer
    return result


def job_dirs(computer_id: str) -> list[str]:
    """The job directories inside the computer (none: no job and no task kept)."""
    listed = docker_exec(container_for(computer_id), "sh", "-c", "ls -A /.kilntainers/jobs 2>/dev/null")
    return listed.stdout.split()


def without_duration(result: dict) -> dict:
    structured = dict(result["structuredContent"])
    assert isinstance(structured.pop("exec_duration_ms"), int)
    return structured


async def test_issue_36_discover_advertises_tasks_and_initialize_is_unchanged(kbb):
    # See: issue 36
    async with kbb.http_server(*BUSYBOX_ARGS) as srv:
        found = (await Raw(srv).send("server/discover", {}))["result"]
        assert found["capabilities"]["extensions"][EXTENSION] == {}, found
        assert PROTOCOL in found["supportedVersions"]
        # The extension defines no advertisement for `initialize`: a session sees what it saw.
        async with kbb.http_session(srv) as session:
            assert "extensions" not in session.init["capabilities"], session.init


async def test_issue_36_a_long_command_becomes_a_task_polled_to_its_full_result(kbb):
    # See: issue 36
    cid = kbb.new_id("task-long")
    kbb.track(cid, temporary=False)
    command = "for i in 1 2 3; do echo line$i; sleep 1; done; echo oops >&2; exit 3"
    async with kbb.http_server(*BUSYBOX_ARGS, *FAST) as srv:
        raw = Raw(srv)
        task = task_of(await raw.execute(command=command, computer_id=cid, temporary=False))
        assert task["status"] == "working"
        assert task["ttlMs"] == 3_600_000 and task["pollIntervalMs"] == 1000
        assert task["createdAt"].endswith("Z") and task["lastUpdatedAt"].endswith("Z")
        assert task["taskId"].count(".") == 3, task
        done, working = await raw.until_terminal(task["taskId"])
        assert working, "never seen working"
        assert any((w.get("statusMessage") or "").startswith("line") for w in working), working
        assert done["status"] == "completed", done
        result = done["result"]
        assert result["isError"] is False
        assert result["structuredContent"]["stdout"] == "line1\nline2\nline3\n"
        assert result["content"] == [{"type": "text", "text": pyjson(result["structuredContent"])}]
        # Exactly what terminal_execute answers for the whole command, but for its duration.
        plain = (await Raw(srv, declare=False).execute(command=command, computer_id=cid, temporary=False))["result"]
        assert "resultType" not in plain or plain["resultType"] == "complete", plain
        assert without_duration(result) == without_duration(plain) == {
            "computer_id": cid, "temporary": False, "stdout": "line1\nline2\nline3\n", "stderr": "oops\n",
            "exit_code": 3,
        }
        # Three one-second sleeps; a job records its end to the second.
        assert result["structuredContent"]["exec_duration_ms"] >= 2000
        # The result stays until the task expires.
        again = (await raw.get(task["taskId"]))["result"]
        assert again["status"] == "completed" and again["result"] == result


async def test_issue_36_a_quick_command_is_answered_as_usual_and_leaves_no_job(kbb):
    # See: issue 36
    cid = kbb.new_id("task-quick")
    kbb.track(cid, temporary=False)
    async with kbb.http_server(*BUSYBOX_ARGS, *FAST) as srv:
        answer = await Raw(srv).execute(command="echo hi", computer_id=cid, temporary=False)
        result = answer["result"]
        assert result.get("resultType", "complete") == "complete", result
        assert without_duration(result) == {
            "computer_id": cid, "temporary": False, "stdout": "hi\n", "stderr": "", "exit_code": 0,
        }
        assert job_dirs(cid) == []


async def test_issue_36_an_undeclared_request_is_unchanged_and_cannot_poll(kbb):
    # See: issue 36
    cid = kbb.new_id("task-undeclared")
    kbb.track(cid, temporary=False)
    async with kbb.http_server(*BUSYBOX_ARGS, *FAST) as srv:
        plain = Raw(srv, declare=False)
        started = time.monotonic()
        result = (await plain.execute(command="sleep 2; echo late", computer_id=cid, temporary=False))["result"]
        assert time.monotonic() - started >= 2
        assert result.get("resultType", "complete") == "complete", result
        assert result["structuredContent"]["stdout"] == "late\n"
        assert job_dirs(cid) == []
        # tasks/* from a request without the declaration: -32021 naming the extension.
        task = task_of(await Raw(srv).execute(command="sleep 3", computer_id=cid, temporary=False))
        refused = await plain.get(task["taskId"])
        assert refused["error"]["code"] == -32021, refused
        assert refused["error"]["data"]["requiredCapabilities"]["extensions"] == {EXTENSION: {}}
        await Raw(srv).until_terminal(task["taskId"])


async def test_issue_36_output_limit_and_timeout_read_as_terminal_executes(kbb):
    # See: issue 36
    cid = kbb.new_id("task-limits")
    kbb.track(cid, temporary=False)
    async with kbb.http_server(*BUSYBOX_ARGS, *FAST, "--output-limit", "1000") as srv:
        raw, plain = Raw(srv), Raw(srv, declare=False)
        cases = [
            ({"command": "sleep 2; head -c 5000 /dev/zero | tr '\\0' x"}, "", limit_notice(1000), 1),
            ({"command": "echo before; sleep 30", "timeout": 3}, "", timeout_notice(3), 124),
        ]
        for arguments, stdout, stderr, code in cases:
            arguments = {**arguments, "computer_id": cid, "temporary": False}
            task = task_of(await raw.execute(**arguments))
            done, _ = await raw.until_terminal(task["taskId"])
            assert done["status"] == "completed", done
            expected = {"computer_id": cid, "temporary": False, "stdout": stdout, "stderr": stderr, "exit_code": code}
            assert without_duration(done["result"]) == expected
            assert without_duration((await plain.execute(**arguments))["result"]) == expected


async def test_issue_36_cancel_kills_the_command_and_leaves_no_process(kbb):
    # See: issue 36
    cid = kbb.new_id("task-cancel")
    kbb.track(cid, temporary=False)
    async with kbb.http_server(*BUSYBOX_ARGS, *FAST) as srv:
        raw = Raw(srv)
        task = task_of(await raw.execute(command="sleep 3141 & sleep 3142; wait", computer_id=cid, temporary=False))
        container = container_for(cid)
        scan = proc_scan_command("sleep 3141", "sleep 3142")

        def sleepers() -> str:
            return docker_exec(container, "sh", "-c", scan).stdout

        assert "sleep 3141" in sleepers() and "sleep 3142" in sleepers()
        ack = await raw.cancel(task["taskId"])
        assert ack["result"] == {"resultType": "complete"}, ack
        assert await apoll(lambda: sleepers() == "", 15, 0.2), sleepers()
        got = (await raw.get(task["taskId"]))["result"]
        assert got["status"] == "cancelled" and "result" not in got, got


async def test_issue_36_a_new_server_process_answers_for_a_task_after_a_sigkill(kbb):
    # See: issue 36
    cid = kbb.new_id("task-durable")
    kbb.track(cid, temporary=False)
    home = kbb.home()
    async with kbb.http_server(*BUSYBOX_ARGS, *FAST, home=home, expect_status=-signal.SIGKILL) as first:
        task = task_of(await Raw(first).execute(command="sleep 4; echo survived", computer_id=cid, temporary=False))
        first.kill()
    async with kbb.http_server(*BUSYBOX_ARGS, *FAST, home=home) as second:
        done, _ = await Raw(second).until_terminal(task["taskId"])
        assert done["status"] == "completed", done
        assert without_duration(done["result"]) == {
            "computer_id": cid, "temporary": False, "stdout": "survived\n", "stderr": "", "exit_code": 0,
        }


async def test_issue_36_another_principals_id_is_refused_like_an_unknown_or_expired_one(kbb, tmp_path):
    # See: issue 36
    tokens = tmp_path / "tokens"
    principals = {ALICE: "alice-" + "a" * 40, BOB: "bob-" + "b" * 40}
    write_tokens(tokens, principals)
    cid = kbb.new_id("task-owner")
    try:
        async with kbb.http_server("--auth-tokens-file", str(tokens), *BUSYBOX_ARGS, *FAST, "--task-ttl", "4s") as srv:
            alice, bob = Raw(srv, bearer(principals[ALICE])), Raw(srv, bearer(principals[BOB]))
            task = task_of(await alice.execute(command="sleep 2; echo mine", computer_id=cid, temporary=False))
            kbb.track(f"{cid}.{tag(ALICE)}", temporary=False)
            secret = task["taskId"].rsplit(".", 1)[1]
            unknown = f"t1.{cid}.j-00000000.{secret}"
            answers = [await bob.get(task["taskId"]), await bob.cancel(task["taskId"]),
                       await alice.get(unknown), await alice.cancel(unknown),
                       await alice.get("not-a-task-id")]
            for answer in answers:
                assert answer["error"] == {"code": -32602, "message": UNKNOWN}, answer
            # Bob's attempts changed nothing for Alice.
            done, _ = await alice.until_terminal(task["taskId"])
            assert done["status"] == "completed"
            assert done["result"]["structuredContent"]["stdout"] == "mine\n"
            # Once expired (4 s after creation), Alice herself gets the same answer.
            expired = await apoll_answer(lambda: alice.get(task["taskId"]), 20)
            assert expired["error"] == {"code": -32602, "message": UNKNOWN}, expired
    finally:
        remove_owned(ALICE, BOB)


async def apoll_answer(ask, limit: float) -> dict:
    """Asks until the answer is an error, at most `limit` seconds; the last answer."""
    deadline = time.monotonic() + limit
    while True:
        answer = await ask()
        if "error" in answer or time.monotonic() >= deadline:
            return answer
        await apoll(lambda: False, 0.5, 0.05)


async def test_issue_36_an_expired_task_is_gone_with_its_files_and_its_command(kbb):
    # See: issue 36
    cid = kbb.new_id("task-ttl")
    kbb.track(cid, temporary=False)
    async with kbb.http_server(*BUSYBOX_ARGS, *FAST, "--task-ttl", "3s") as srv:
        raw = Raw(srv)
        finished = task_of(await raw.execute(command="sleep 1.5; echo soon", computer_id=cid, temporary=False))
        assert finished["ttlMs"] == 3000
        outliving = task_of(await raw.execute(command="sleep 2718", computer_id=cid, temporary=False))
        done, _ = await raw.until_terminal(finished["taskId"])
        assert done["status"] == "completed"
        assert len(job_dirs(cid)) == 2
        for task in (finished, outliving):
            expired = await apoll_answer(lambda t=task: raw.get(t["taskId"]), 20)
            assert expired["error"] == {"code": -32602, "message": UNKNOWN}, expired
        # The command that outlived its task was ended at the time to live, and nothing of
        # either task is left in the computer.
        assert docker_exec(container_for(cid), "sh", "-c", proc_scan_command("sleep 2718")).stdout == ""
        assert job_dirs(cid) == []
