"""Ask-to-allow (docs/egress.md, "Ask-to-allow"; issue 33, item 4): with `--egress-ask`, a
connection to a host no rule covers is held while the person is asked through the official
client's elicitation callback, on the fake internet of egress_net.py. Each answer, a client
without elicitation, a host a deny rule matches, and concurrent connections to one host."""

from __future__ import annotations

import json
import subprocess
import time

import anyio
import httpx
import mcp.types as types
import pytest

from egress_net import RAW, SHARED_NETWORKS, VIA_PROXY, proxy_args
from harness import BUSYBOX_ARGS, container_for, dump

pytestmark = [pytest.mark.anyio, SHARED_NETWORKS]

CHOICES = ["allow once", "allow for this computer", "deny"]
DECLINED = "the user declined"
DECLINED_EARLIER = "the user declined (remembered for 10 minutes)"
NO_ELICITATION = "no way to ask the user (the client does not support elicitation)"
NO_ANSWER = "no answer from the user in 60 s"
TOO_MANY = "too many questions are open for this session (at most 3)"


def ask_args(net, *extra: str) -> list[str]:
    return [*BUSYBOX_ARGS, "--egress", "allowlist", "--egress-allow", "allowed.test", "--egress-ask",
            *proxy_args(net), *extra]


def blocked(host: str, reason: str, port: int = 80) -> str:
    return f"[kilntainers: network access to {host}:{port} was blocked: {reason}]"


class Person:
    """The elicitation callback: answers from a script, in order (`action`, `choice`), records
    every question; with `before`, awaits it before each answer."""

    def __init__(self, *answers: tuple[str, str | None], before=None):
        self.answers = list(answers)
        self.asked: list[dict] = []
        self.before = before

    async def __call__(self, context, params):
        self.asked.append(params.model_dump(by_alias=True, exclude_none=True))
        if self.before is not None:
            await self.before()
        assert self.answers, f"asked more often than expected: {self.asked}"
        action, choice = self.answers.pop(0)
        return types.ElicitResult(action=action, content={"choice": choice} if choice else None)


def question_of(asked: dict) -> tuple[str, dict]:
    return asked["message"], asked["requestedSchema"]


async def test_issue_33_allow_once_lets_one_connection_through_and_asks_again(kbb, fake_internet):
    # See: issue 33
    person = Person(("accept", "allow once"), ("accept", "allow once"))
    async with kbb.server(*ask_args(fake_internet), elicitation=person) as srv:
        res = await srv.run(VIA_PROXY.format(host="other.test"))
        assert "hello-from-other.test" in res.structured["stdout"], res
        assert "[kilntainers:" not in res.structured["stderr"], res
        cid = res.structured["computer_id"]
        (asked,) = person.asked
        message, schema = question_of(asked)
        assert message == f"The computer `{cid}` wants to reach `other.test:80`."
        assert asked.get("mode", "form") == "form"
        assert list(schema["properties"]) == ["choice"] and schema["required"] == ["choice"]
        assert schema["properties"]["choice"]["enum"] == CHOICES
        # The next connection is asked about again, here ignoring proxy settings.
        res = await srv.run(RAW.format(host="other.test", target="other.test"))
        assert "hello-from-other.test" in res.structured["stdout"], res
        assert len(person.asked) == 2
        # Allowed hosts are never asked about.
        res = await srv.run(RAW.format(host="allowed.test", target="allowed.test"))
        assert "hello-from-allowed.test" in res.structured["stdout"], res
        assert len(person.asked) == 2
        # The policy did not change.
        shown = (await srv.call({}, name="computer_network")).structured
        assert shown["allow"] == ["allowed.test"], shown


async def test_issue_33_allow_for_this_computer_is_kept_across_a_server_restart(kbb, fake_internet):
    # See: issue 33
    cid = kbb.new_id("ask-keep")
    home = kbb.home()
    args = ask_args(fake_internet, "--lifecycle-tools")
    person = Person(("accept", "allow for this computer"))
    async with kbb.server(*args, home=home, elicitation=person) as srv:
        res = await srv.run(VIA_PROXY.format(host="other.test"), computer_id=cid, temporary=False)
        assert "hello-from-other.test" in res.structured["stdout"], res
        res = await srv.run(RAW.format(host="other.test", target="other.test"), computer_id=cid, temporary=False)
        assert "hello-from-other.test" in res.structured["stdout"], res
        assert len(person.asked) == 1
        shown = (await srv.call({"computer_id": cid}, name="computer_network")).structured
        assert shown["allow"] == ["allowed.test", "other.test:80"], shown
    nobody = Person()
    async with kbb.server(*args, home=home, elicitation=nobody) as srv:
        res = await srv.run(VIA_PROXY.format(host="other.test"), computer_id=cid, temporary=False)
        assert "hello-from-other.test" in res.structured["stdout"], res
        # And after the computer restarts (a new address at the proxy).
        (await srv.call({"computer_id": cid}, name="computer_restart")).ok()
        res = await srv.run(VIA_PROXY.format(host="other.test"), computer_id=cid, temporary=False)
        assert "hello-from-other.test" in res.structured["stdout"], res
        assert nobody.asked == []
        # The label is unchanged: what was added is the server's record, not the computer's.
        labels = subprocess.run(
            ["docker", "inspect", "--format", "{{index .Config.Labels \"kilntainers.egress\"}}", container_for(cid)],
            capture_output=True, text=True, check=True,
        ).stdout
        assert "other.test" not in labels
        await srv.call({"computer_id": cid}, name="computer_delete")
    grants = home / ".mcp-sandbox-computer-vm-for-ai" / "egress-grants"
    assert not any(grants.iterdir()), "the deleted computer's grants were kept"


async def test_issue_33_deny_is_remembered_for_the_computer(kbb, fake_internet):
    # See: issue 33
    person = Person(("accept", "deny"))
    async with kbb.server(*ask_args(fake_internet), elicitation=person) as srv:
        res = await srv.run(VIA_PROXY.format(host="other.test"))
        assert "hello-from" not in res.structured["stdout"], res
        assert res.structured["stderr"].endswith(blocked("other.test", DECLINED) + "\n"), res
        # Within 10 minutes: refused without asking.
        started = time.monotonic()
        res = await srv.run(VIA_PROXY.format(host="other.test"))
        assert res.structured["stderr"].endswith(blocked("other.test", DECLINED_EARLIER) + "\n"), res
        assert time.monotonic() - started < 30
        assert len(person.asked) == 1
        # The answer itself never reaches the model: only the reason line.
        assert "deny" not in res.structured["stdout"] + res.structured["stderr"]


async def test_issue_33_decline_and_cancel_refuse_that_connection_only(kbb, fake_internet):
    # See: issue 33
    person = Person(("decline", None), ("cancel", None), ("accept", "allow once"))
    async with kbb.server(*ask_args(fake_internet), elicitation=person) as srv:
        for _ in range(2):
            res = await srv.run(VIA_PROXY.format(host="other.test"))
            assert "hello-from" not in res.structured["stdout"], res
            assert res.structured["stderr"].endswith(blocked("other.test", DECLINED) + "\n"), res
        res = await srv.run(VIA_PROXY.format(host="other.test"))
        assert "hello-from-other.test" in res.structured["stdout"], res
        assert len(person.asked) == 3


async def test_issue_33_no_answer_refuses_after_the_hold_and_asks_again(kbb, fake_internet):
    # See: issue 33. The connection is held 60 s; the command waits for it.
    cid = kbb.new_id("ask-silent")

    async def after_the_refusal():
        # The person answers only once the computer has been refused (bounded): the late
        # answer is to a question that no longer exists.
        deadline = time.monotonic() + 90
        while "was blocked" not in computer_file(container_for(cid), "/tmp/out"):
            assert time.monotonic() < deadline, "the held connection was never refused"
            await anyio.sleep(0.5)

    silent = Person(("accept", "allow once"), ("accept", "allow once"), before=after_the_refusal)
    async with kbb.server(*ask_args(fake_internet), elicitation=silent) as srv:
        await srv.run("true", computer_id=cid)
        slow = VIA_PROXY.format(host="other.test").replace("nc -w 5", "nc -w 90")
        res = (await srv.call({"command": f"{slow} > /tmp/out; cat /tmp/out", "computer_id": cid, "timeout": 120},
                              timeout=150)).ok()
        assert "hello-from" not in res.structured["stdout"], res
        assert res.structured["stderr"].endswith(blocked("other.test", NO_ANSWER) + "\n"), res
        assert res.elapsed >= 55, res.elapsed
        silent.before = None
        res = await srv.run(VIA_PROXY.format(host="other.test"), computer_id=cid)
        assert "hello-from-other.test" in res.structured["stdout"], res
        assert len(silent.asked) == 2


def computer_file(container: str, path: str) -> str:
    return subprocess.run(["docker", "exec", container, "cat", path], capture_output=True, text=True).stdout


async def test_issue_33_a_client_without_elicitation_is_refused_at_once(kbb, fake_internet):
    # See: issue 33
    async with kbb.server(*ask_args(fake_internet)) as srv:
        res = await srv.run(VIA_PROXY.format(host="other.test"))
        assert "hello-from" not in res.structured["stdout"], res
        assert res.structured["stderr"].endswith(blocked("other.test", NO_ELICITATION) + "\n"), res
        assert res.elapsed < 30, res.elapsed


async def test_issue_33_a_host_a_deny_rule_matches_is_never_asked_about(kbb, fake_internet):
    # See: issue 33
    person = Person()
    async with kbb.server(*ask_args(fake_internet, "--egress-deny", "other.test"), elicitation=person) as srv:
        res = await srv.run(VIA_PROXY.format(host="other.test"))
        assert res.structured["stderr"].endswith(blocked("other.test", "denied by rule other.test") + "\n"), res
        res = await srv.call({"command": "nslookup other.test"})
        assert "NXDOMAIN" in res.structured["stdout"] + res.structured["stderr"], res
        assert person.asked == []


def held_proxy_connections(container: str) -> int:
    """Connections from the computer to port 3128 (the proxy) still open at the proxy's end,
    from its /proc/net/tcp: remote port 0C38, state established or (nc having sent its request
    and shut its side) FIN-WAIT-1/2."""
    out = subprocess.run(["docker", "exec", container, "cat", "/proc/net/tcp"],
                         capture_output=True, text=True).stdout
    rows = [line.split() for line in out.splitlines()[1:]]
    return sum(1 for row in rows if len(row) > 3 and row[2].endswith(":0C38") and row[3] in ("01", "04", "05"))


async def test_issue_33_concurrent_connections_to_one_host_wait_on_one_question(kbb, fake_internet):
    # See: issue 33
    cid = kbb.new_id("ask-many")

    async def all_three_held():
        # Answer only once the three connections are all waiting (bounded).
        deadline = time.monotonic() + 30
        while held_proxy_connections(container_for(cid)) < 3:
            assert time.monotonic() < deadline, "the three connections were never held together"
            await anyio.sleep(0.1)

    person = Person(("accept", "allow once"), before=all_three_held)
    async with kbb.server(*ask_args(fake_internet), elicitation=person) as srv:
        await srv.run("true", computer_id=cid)
        one = VIA_PROXY.format(host="other.test")
        res = await srv.run(f"for i in 1 2 3; do ( {one} > /tmp/out$i ) & done; wait; cat /tmp/out1 /tmp/out2 /tmp/out3",
                            computer_id=cid)
        assert res.structured["stdout"].count("hello-from-other.test") == 3, res
        assert len(person.asked) == 1, person.asked


async def test_issue_33_at_most_three_questions_are_open_per_session(kbb, fake_internet):
    # See: issue 33
    cid = kbb.new_id("ask-four")
    hosts = [f"h{i}.test" for i in range(1, 5)]
    resolve = [arg for host in hosts for arg in ("--egress-resolve", f"{host}={fake_internet['hosts']['other.test']}")]

    async def fourth_refused():
        # Answer only once the fourth question has been refused (bounded).
        deadline = time.monotonic() + 30
        while TOO_MANY not in "".join(computer_file(container_for(cid), f"/tmp/{h}") for h in hosts):
            assert time.monotonic() < deadline, "no question was refused as one too many"
            await anyio.sleep(0.1)

    person = Person(*[("accept", "allow once")] * 3, before=fourth_refused)
    async with kbb.server(*ask_args(fake_internet, *resolve), elicitation=person) as srv:
        await srv.run("true", computer_id=cid)
        each = " ".join(f"( {VIA_PROXY.format(host=h)} > /tmp/{h} ) &" for h in hosts)
        res = await srv.run(f"{each} wait; cat /tmp/h*.test", computer_id=cid)
        assert res.structured["stdout"].count("hello-from-other.test") == 3, res
        assert res.structured["stderr"].count(f"was blocked: {TOO_MANY}]") == 1, res
        assert len(person.asked) == 3


def rpc_messages(response) -> list[dict]:
    """JSON-RPC messages of a POST response, a JSON body or an SSE stream."""
    if response.headers.get("content-type", "").startswith("application/json"):
        return [response.json()]
    return [json.loads(line[5:]) for line in response.text.splitlines()
            if line.startswith("data:") and line[5:].strip()]


async def test_issue_33_a_2026_07_28_request_without_elicitation_is_refused_with_the_reason(kbb, fake_internet):
    # See: issue 33. A sessionless request carries its capabilities in `_meta`; without
    # `elicitation` the question is refused at once.
    cid = kbb.new_id("ask-modern")
    async with kbb.http_server(*ask_args(fake_internet)) as srv:
        body = modern_call({"command": VIA_PROXY.format(host="other.test"), "computer_id": cid}, {})
        headers = {**srv.auth(), "Content-Type": "application/json",
                   "Accept": "application/json, text/event-stream", "mcp-protocol-version": "2026-07-28",
                   "mcp-method": "tools/call", "mcp-name": "terminal_execute"}
        started = time.monotonic()
        async with httpx.AsyncClient(timeout=90) as client:
            response = await client.post(srv.mcp_url, headers=headers, json=body)
        assert response.status_code == 200, response.text
        (answer,) = [m for m in rpc_messages(response) if m.get("id") == 7]
        result = answer["result"]["structuredContent"]
        assert "hello-from" not in result["stdout"], result
        assert result["stderr"].endswith(blocked("other.test", NO_ELICITATION) + "\n"), result
        assert time.monotonic() - started < 30


def modern_call(arguments: dict, capabilities: dict, **params) -> dict:
    """A sessionless 2026-07-28 `terminal_execute` request body."""
    return {
        "jsonrpc": "2.0", "id": 7, "method": "tools/call",
        "params": {
            "name": "terminal_execute", "arguments": arguments, **params,
            "_meta": {
                "io.modelcontextprotocol/protocolVersion": "2026-07-28",
                "io.modelcontextprotocol/clientCapabilities": capabilities,
            },
        },
    }


async def call_by_hand(srv, arguments: dict, person: Person) -> dict:
    """The input_required rounds driven by hand, as the protocol has them: each question is
    answered by `person` and the call retried with `inputResponses` and `requestState`."""
    headers = {**srv.auth(), "Content-Type": "application/json",
               "Accept": "application/json, text/event-stream", "mcp-protocol-version": "2026-07-28",
               "mcp-method": "tools/call", "mcp-name": "terminal_execute"}
    extra: dict = {}
    async with httpx.AsyncClient(timeout=120) as client:
        for _ in range(5):
            body = modern_call(arguments, {"elicitation": {"form": {}}}, **extra)
            response = await client.post(srv.mcp_url, headers=headers, json=body)
            assert response.status_code == 200, response.text
            (answer,) = [m for m in rpc_messages(response) if m.get("id") == 7]
            result = answer["result"]
            if result.get("resultType") != "input_required":
                return result
            ((key, request),) = result["inputRequests"].items()
            assert request["method"] == "elicitation/create", request
            params = types.ElicitRequestFormParams.model_validate(request["params"])
            reply = await person(None, params)
            extra = {"inputResponses": {key: reply.model_dump(by_alias=True, exclude_none=True)},
                     "requestState": result["requestState"]}
    raise AssertionError("more input_required rounds than expected")


async def test_issue_33_a_2026_07_28_call_is_answered_input_required_and_goes_on(kbb, fake_internet):
    # See: issue 33. The call is answered with the question (`resultType: "input_required"`),
    # the client's retry carries the person's answer, and the call goes on: by hand with client
    # 1.x, through the 2.x client's own input_required loop with 2.x.
    cid = kbb.new_id("ask-mrtr")
    person = Person(("accept", "allow once"), ("accept", "deny"))
    arguments = {"command": VIA_PROXY.format(host="other.test"), "computer_id": cid}
    async with kbb.http_server(*ask_args(fake_internet)) as srv:
        try:
            import httpx2
            from mcp.client.client import Client
            from mcp.client.streamable_http import streamable_http_client
        except ImportError:  # client 1.x
            results = [await call_by_hand(srv, arguments, person) for _ in range(2)]
        else:
            results = []
            async with httpx2.AsyncClient(headers=srv.auth(), timeout=120) as http:
                transport = streamable_http_client(srv.mcp_url, http_client=http)
                async with Client(transport, mode="2026-07-28", elicitation_callback=person) as client:
                    for _ in range(2):
                        with anyio.fail_after(120):
                            results.append(dump(await client.call_tool("terminal_execute", arguments)))
        allowed, denied = (r["structuredContent"] for r in results)
        assert "hello-from-other.test" in allowed["stdout"], allowed
        assert denied["stderr"].endswith(blocked("other.test", DECLINED) + "\n"), denied
        assert [a["message"] for a in person.asked] == [f"The computer `{cid}` wants to reach `other.test:80`."] * 2
