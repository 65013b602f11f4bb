"""The person's egress tools behind the dashboard (docs/egress.md, "Dashboard"; issue 33, item 5),
with the official Python client and a real Docker engine: listed for the app alone
(`_meta.ui.visibility: ["app"]`) and only with the dashboard and a policy both on; a rule
outside the server's bounds refused with a message naming it; a rule within them reaching the
proxy at once (the next request goes through), kept across a server restart, and removed again;
an ask-to-allow question held for a watching dashboard and answered there; another principal's
computer refused exactly like an unknown one."""

from __future__ import annotations

import time

import anyio
import pytest

from egress_net import ALLOW_REFUSAL, RAW, SHARED_NETWORKS, VIA_PROXY, proxy_args
from harness import BUSYBOX_ARGS
from test_principals import ALICE, BOB, bearer, remove_owned, tag, write_tokens

pytestmark = [pytest.mark.anyio, SHARED_NETWORKS]

PERSON_TOOLS = ["computer_network_allow", "computer_network_remove", "computer_network_questions",
                "computer_network_answer"]


def blocked(host: str, reason: str, port: int = 80) -> str:
    return f"[kilntainers: network access to {host}:{port} was blocked: {reason}]\n"


async def test_issue_33_the_persons_tools_are_for_the_app_with_the_dashboard_and_a_policy(kbb):
    # See: issue 33
    policy = ["--egress", "allowlist", "--egress-allow", "allowed.test"]
    async with kbb.server(*BUSYBOX_ARGS, "--lifecycle-tools", *policy) as srv:
        tools = {t["name"]: t for t in await srv.list_tools()}
        for name in PERSON_TOOLS:
            assert tools[name]["_meta"]["ui"]["visibility"] == ["app"], tools[name]
        # What the model reads stays visible to it.
        assert "app" in tools["computer_dashboard"]["_meta"]["ui"]["visibility"]
        assert tools["computer_network"].get("_meta", {}).get("ui", {}).get("visibility") in (None, ["model", "app"])
    for args in ((*BUSYBOX_ARGS, *policy), (*BUSYBOX_ARGS, "--lifecycle-tools")):
        async with kbb.server(*args) as srv:
            names = {t["name"] for t in await srv.list_tools()}
            assert not names & set(PERSON_TOOLS), (args, names)
            with pytest.raises(Exception, match="tool not found"):
                await srv.session.call_tool("computer_network_allow", {"computer_id": "x", "pattern": "other.test"})


async def test_issue_33_a_persons_rule_stays_in_bounds_reaches_the_proxy_and_survives_a_restart(kbb, fake_internet):
    # See: issue 33
    home = kbb.home()
    args = [*BUSYBOX_ARGS, "--lifecycle-tools", "--egress", "allowlist", "--egress-allow", "allowed.test",
            "--egress-allow", "other.test", "--egress-deny", "other.test:8080", *proxy_args(fake_internet)]
    other = VIA_PROXY.format(host="other.test")
    async with kbb.server(*args, home=home) as srv:
        made = await srv.call({"temporary": False, "egress": {"allow": ["allowed.test"]}}, name="computer_create")
        cid = made.ok().structured["computer_id"]
        res = await srv.run(other, computer_id=cid, temporary=False)
        assert "hello-from-other.test" not in res.structured["stdout"], res
        assert res.structured["stderr"].endswith(blocked("other.test", ALLOW_REFUSAL)), res

        # Outside the server's bounds, or denied by its rules: refused, naming the pattern.
        outside = await srv.call({"computer_id": cid, "pattern": "third.test"}, name="computer_network_allow")
        assert outside.is_error
        assert outside.text.startswith("'third.test' is outside what this server allows (--egress allowlist: "
                                       "allowed.test, other.test)"), outside
        denied = await srv.call({"computer_id": cid, "pattern": "other.test:8080"}, name="computer_network_allow")
        assert denied.is_error
        assert denied.text == ("'other.test:8080' is denied by this server's rule 'other.test:8080'; "
                               "a person cannot allow it."), denied
        already = await srv.call({"computer_id": cid, "pattern": "allowed.test:443"}, name="computer_network_allow")
        assert already.is_error
        assert already.text == f"'allowed.test:443' is already allowed for computer '{cid}' (by 'allowed.test').", already
        bad = await srv.call({"computer_id": cid, "pattern": "a..test"}, name="computer_network_allow")
        assert bad.is_error and bad.text.startswith("pattern: invalid pattern 'a..test': "), bad

        added = await srv.call({"computer_id": cid, "pattern": "other.test"}, name="computer_network_allow")
        shown = added.ok().structured
        assert (shown["allow"], shown["added"]) == (["allowed.test", "other.test"], ["other.test"]), shown
        # The proxy has it at once: the next request goes through.
        res = await srv.run(other, computer_id=cid, temporary=False)
        assert "hello-from-other.test" in res.structured["stdout"], res

    async with kbb.server(*args, home=home) as srv:
        shown = (await srv.call({"computer_id": cid}, name="computer_network")).structured
        assert shown["added"] == ["other.test"], shown
        # Ignoring proxy settings too: the proxy's DNS now answers the added name.
        res = await srv.run(RAW.format(host="other.test", target="other.test"), computer_id=cid, temporary=False)
        assert "hello-from-other.test" in res.structured["stdout"], res
        # Only what a person added can be removed.
        fixed = await srv.call({"computer_id": cid, "pattern": "allowed.test"}, name="computer_network_remove")
        assert fixed.is_error
        assert fixed.text == (f"'allowed.test' is not a rule a person added for computer '{cid}'; "
                              "only those can be removed here."), fixed
        removed = await srv.call({"computer_id": cid, "pattern": "other.test"}, name="computer_network_remove")
        shown = removed.ok().structured
        assert (shown["allow"], shown["added"]) == (["allowed.test"], []), shown
        res = await srv.run(other, computer_id=cid, temporary=False)
        assert "hello-from-other.test" not in res.structured["stdout"], res
        assert res.structured["stderr"].endswith(blocked("other.test", ALLOW_REFUSAL)), res
        await srv.call({"computer_id": cid}, name="computer_delete")


async def test_issue_33_a_question_waits_for_a_watching_dashboard_and_is_answered_there(kbb, fake_internet):
    # See: issue 33
    args = [*BUSYBOX_ARGS, "--lifecycle-tools", "--egress", "allowlist", "--egress-allow", "allowed.test",
            "--egress-ask", *proxy_args(fake_internet)]
    # This client cannot be asked (no elicitation): only the dashboard can answer.
    async with kbb.server(*args) as srv:
        made = await srv.call({"temporary": False}, name="computer_create")
        cid = made.ok().structured["computer_id"]
        # Nobody watches: refused at once, as before.
        res = await srv.run(VIA_PROXY.format(host="other.test"), computer_id=cid, temporary=False)
        assert "hello-from-other.test" not in res.structured["stdout"], res
        assert "no way to ask the user" in res.structured["stderr"], res

        watching = await srv.call({"computer_id": cid}, name="computer_network_questions")
        assert watching.ok().structured == {"computer_id": cid, "questions": []}
        results: dict = {}

        async def command() -> None:
            results["res"] = await srv.run(VIA_PROXY.format(host="other.test"), computer_id=cid, temporary=False)

        async def open_question() -> list:
            shown = await srv.call({"computer_id": cid}, name="computer_network_questions")
            return shown.ok().structured["questions"]

        async with anyio.create_task_group() as tg:
            tg.start_soon(command)
            deadline = time.monotonic() + 30
            while not (questions := await open_question()) and time.monotonic() < deadline:
                await anyio.sleep(0.2)
            assert questions, "no question reached the dashboard"
            (question,) = questions
            assert (question["host"], question["port"]) == ("other.test", 80), question
            qid = question["question_id"]
            wrong = await srv.call({"computer_id": cid, "question_id": qid, "choice": "maybe"},
                                   name="computer_network_answer")
            assert wrong.is_error and "choice must be" in wrong.text, wrong
            answered = await srv.call({"computer_id": cid, "question_id": qid, "choice": "allow once"},
                                      name="computer_network_answer")
            assert answered.ok().structured["choice"] == "allow once"
        res = results["res"]
        assert "hello-from-other.test" in res.structured["stdout"], res
        # The first answer won; a second one finds no question.
        again = await srv.call({"computer_id": cid, "question_id": qid, "choice": "deny"},
                               name="computer_network_answer")
        assert again.is_error
        assert again.text == (f"There is no pending question {qid} for computer '{cid}': "
                              "it was answered, withdrawn or timed out."), again
        assert (await open_question()) == []
        await srv.call({"computer_id": cid}, name="computer_delete")


async def test_issue_33_another_principals_computer_is_refused_like_an_unknown_one(kbb, tmp_path):
    # See: issue 33
    tokens_file = tmp_path / "tokens"
    tokens = {ALICE: "alice-token-" + "a" * 32, BOB: "bob-token-" + "b" * 32}
    write_tokens(tokens_file, tokens)
    theirs = kbb.new_id("net-alice")
    unknown = kbb.new_id("net-never")
    kbb.track(f"{theirs}.{tag(ALICE)}", temporary=False)
    try:
        async with kbb.http_server("--auth-tokens-file", str(tokens_file), "--lifecycle-tools", *BUSYBOX_ARGS,
                                   "--egress", "allowlist", "--egress-allow", "allowed.test", "--egress-ask") as srv:
            async with kbb.http_session(srv, headers=bearer(tokens[ALICE])) as alice, \
                    kbb.http_session(srv, headers=bearer(tokens[BOB])) as bob:
                (await alice.call({"computer_id": theirs, "temporary": False}, name="computer_create")).ok()
                mine = await alice.call({"computer_id": theirs, "pattern": "other.test"},
                                        name="computer_network_allow")
                assert not mine.is_error, mine
                for tool, extra in (
                    ("computer_network", {}),
                    ("computer_network_allow", {"pattern": "other.test"}),
                    ("computer_network_remove", {"pattern": "other.test"}),
                    ("computer_network_questions", {}),
                    ("computer_network_answer", {"question_id": 1, "choice": "deny"}),
                ):
                    foreign = await bob.call({"computer_id": theirs, **extra}, name=tool)
                    nothing = await bob.call({"computer_id": unknown, **extra}, name=tool)
                    assert foreign.is_error and nothing.is_error, (tool, foreign, nothing)
                    assert foreign.text.replace(theirs, "X") == nothing.text.replace(unknown, "X"), tool
                # Alice's rule is untouched.
                shown = (await alice.call({"computer_id": theirs}, name="computer_network")).structured
                assert shown["added"] == ["other.test"], shown
                await alice.call({"computer_id": theirs}, name="computer_delete")
    finally:
        remove_owned(ALICE, BOB)
