"""The running limit through the job tools (issue 30, item 3), over HTTP with two principals
from a tokens file, the official Python client and real Docker. A computer that stops itself
(`kill -TERM 1`) is not started again by `job_list`, `job_output`, `job_kill` or
`terminal_execute` with `yield_after` while another of its principal's computers runs under
`--max-running-per-user 1`: each answers with the limit's message and the computer stays
stopped. The other principal's limit is its own, and once the running computer is deleted the
job tools start the stopped one again."""

from __future__ import annotations

import pytest

from harness import BUSYBOX_ARGS, apoll, containers_with_label, inspect
from test_principals import ALICE, BOB, TOKENS, bearer, remove_owned, tag, write_tokens

pytestmark = [pytest.mark.anyio, pytest.mark.client_independent]

LIMIT = "Running computer limit reached: you have 1 of 1 computers running (--max-running-per-user)"


def running_containers(principal: str) -> list[str]:
    return [c for c in containers_with_label(f"kilntainers.owner={principal}") if inspect(c)["State"]["Running"]]


async def test_issue_30_the_job_tools_start_no_computer_past_the_running_limit(kbb, tmp_path):
    """See: issue 30 (item 3). One start path, one admission: the job tools' start of a stopped
    computer is admitted like a command's."""
    tokens = tmp_path / "tokens"
    write_tokens(tokens, TOKENS)
    first, second = kbb.new_id("jobs-run-a"), kbb.new_id("jobs-run-b")
    first_container = f"kilntainer-{first}.{tag(ALICE)}"
    try:
        async with kbb.http_server(
            "--auth-tokens-file", str(tokens), "--job-tools", "--lifecycle-tools",
            "--max-running-per-user", "1", *BUSYBOX_ARGS,
        ) as srv:
            async with kbb.http_session(srv, headers=bearer(TOKENS[ALICE])) as alice, \
                    kbb.http_session(srv, headers=bearer(TOKENS[BOB])) as bob:
                started = await alice.call({"command": "sleep 300", "yield_after": 0, "computer_id": first, "temporary": False})
                job = started.ok().structured["job_id"]
                # The computer stops itself: its PID 1 ends on TERM.
                await alice.call({"command": "kill -TERM 1", "computer_id": first, "temporary": False})
                assert await apoll(lambda: not inspect(first_container)["State"]["Running"], 30)
                await alice.run("echo b", computer_id=second, temporary=False)
                attempts = [
                    ("job_list", {"computer_id": first}),
                    ("job_output", {"job_id": job}),
                    ("job_kill", {"job_id": job}),
                    ("terminal_execute", {"command": "sleep 1", "yield_after": 0, "computer_id": first, "temporary": False}),
                ]
                for name, arguments in attempts:
                    refused = await alice.call(arguments, name=name)
                    assert refused.is_error and LIMIT in (refused.text or ""), (name, refused)
                    assert len(running_containers(ALICE)) == 1, f"{name} started a second computer"
                assert inspect(first_container)["State"]["Running"] is False
                # Bob's limit is his own.
                theirs = (await bob.call({"command": "echo bob", "yield_after": 10})).ok().structured
                assert theirs["stdout"] == "bob\n"
                # Once the running one is gone, the job tools start the stopped one.
                assert not (await alice.call({"computer_id": second}, name="computer_delete")).is_error
                listed = (await alice.call({"computer_id": first}, name="job_list")).ok().structured
                assert [(j["job_id"], j["running"]) for j in listed["jobs"]] == [(job, False)]
                assert inspect(first_container)["State"]["Running"] is True
    finally:
        remove_owned(ALICE, BOB)
