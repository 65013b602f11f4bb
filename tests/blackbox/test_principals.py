"""Principals with named tokens over HTTP (docs/auth.md), with the official Python client and
real Docker: a tokens file readable by others is refused; two principals each get their own
`dev-box` (container names, owner labels); each lists only its own computers; another
principal's computer answers exactly like an unknown id for exec, restart, reset and delete; a
session cannot be used with another principal's token; the quota holds under 20 concurrent
creates; the running limit holds however a stopped computer would start; SIGHUP reloads the file; audit lines name principals and never tokens."""

from __future__ import annotations

import hashlib
import signal
import subprocess

import anyio
import httpx
import pytest

from harness import BIN, BUSYBOX_ARGS, RUN_PREFIX, HttpRefused, containers_with_label, docker, inspect, poll

pytestmark = pytest.mark.anyio


def principal(name: str) -> str:
    """`name`, unique to this test process: a principal's network, computers and quotas are
    shared by every server on the engine, so tests running in parallel must not share one."""
    return f"{name}-{RUN_PREFIX}"


ALICE, BOB, CAROL = principal("alice"), principal("bob"), principal("carol")
TOKENS = {ALICE: "alice-" + "a" * 40, BOB: "bob-" + "b" * 40}
SINGLE = "single-" + "s" * 40


def tag(principal: str) -> str:
    return hashlib.sha256(principal.encode()).hexdigest()[:16]


def write_tokens(path, tokens: dict, mode: int = 0o600) -> None:
    path.write_text("# principal token\n\n" + "".join(f"{p}  {t}\n" for p, t in tokens.items()))
    path.chmod(mode)


def bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def only_defaults(listed: list[str]) -> list[str]:
    """The computers of `default` among `listed` ids (all of them, for the test to assert). The
    single user's computers of tests on other workers are `default`'s too and show in its list,
    so a test checks what it made is there or not, and that nothing listed is anyone else's."""
    for computer_id in listed:
        info = inspect(f"kilntainer-{computer_id}") or {}  # gone meanwhile: nobody's
        owner = (info.get("Config") or {}).get("Labels", {}).get("kilntainers.owner", "default")
        assert owner == "default", f"default lists {computer_id} of {owner}"
    return listed


def remove_owned(*principals: str) -> None:
    for principal in principals:
        for container in containers_with_label(f"kilntainers.owner={principal}"):
            docker("rm", "-f", container, check=False)
        # A principal's networks stay while its computers exist: removed behind the server's
        # back, they leave them to us (else the next test of this process finds them).
        networks = docker("network", "ls", "-q", "--filter", f"label=kilntainers.owner={principal}", check=False)
        for network in networks.stdout.split():
            docker("network", "rm", network, check=False)


async def test_tokens_file_readable_by_others_is_refused(kbb, tmp_path):
    tokens = tmp_path / "tokens"
    write_tokens(tokens, TOKENS, mode=0o640)
    home = kbb.home()
    proc = subprocess.run(
        [BIN, "--transport", "http", "--port", "1", "--auth-tokens-file", str(tokens), *BUSYBOX_ARGS],
        capture_output=True, text=True, timeout=60, env=kbb.env(home),
    )
    assert proc.returncode == 1, proc.stderr
    assert f"chmod 600 {tokens}" in proc.stderr
    assert TOKENS[ALICE] not in proc.stderr


async def test_two_principals_each_have_their_own_computers(kbb, tmp_path):
    tokens = tmp_path / "tokens"
    write_tokens(tokens, TOKENS)
    dev_box = kbb.new_id("dev-box")
    only_alice = kbb.new_id("alice-only")
    unknown = kbb.new_id("never-made")
    for principal in TOKENS:
        kbb.track(f"{dev_box}.{tag(principal)}", temporary=False)
        kbb.track(f"{only_alice}.{tag(principal)}", temporary=False)
    try:
        async with kbb.http_server(
            "--auth-tokens-file", str(tokens), "--auth-token", SINGLE, "--lifecycle-tools", *BUSYBOX_ARGS
        ) as srv:
            async with kbb.http_session(srv, headers=bearer(TOKENS[ALICE])) as alice, \
                    kbb.http_session(srv, headers=bearer(TOKENS[BOB])) as bob, \
                    kbb.http_session(srv, headers=bearer(SINGLE)) as default:
                for who, sess in (("alice", alice), ("bob", bob)):
                    made = await sess.call({"computer_id": dev_box, "temporary": False}, name="computer_create")
                    assert not made.is_error, made.text
                    assert made.structured["computer_id"] == dev_box
                    out = await sess.run(f"echo {who} > /owner; cat /owner", computer_id=dev_box, temporary=False)
                    assert out.structured["stdout"].strip() == who
                made = await alice.call({"computer_id": only_alice, "temporary": False}, name="computer_create")
                assert not made.is_error, made.text

                # Provider side: names and owner labels.
                for principal in TOKENS:
                    name = f"kilntainer-{dev_box}.{tag(principal)}"
                    info = inspect(name)
                    assert info, f"no container {name}"
                    labels = info["Config"]["Labels"]
                    assert labels["kilntainers.owner"] == principal
                    assert labels["kilntainers.computer-id"] == f"{dev_box}.{tag(principal)}"
                assert inspect(f"kilntainer-{dev_box}") is None

                # Each lists only its own, by the plain slug.
                def ids(result) -> list[str]:
                    return [c["computer_id"] for c in result.structured["computers"]]

                assert sorted(ids(await alice.call({}, name="computer_list"))) == sorted([dev_box, only_alice])
                assert ids(await bob.call({}, name="computer_list")) == [dev_box]
                listed = only_defaults(ids(await default.call({}, name="computer_list")))
                assert dev_box not in listed and only_alice not in listed, listed

                # Bob's own dev-box is his, with his file.
                out = await bob.run("cat /owner", computer_id=dev_box, temporary=False)
                assert out.structured["stdout"].strip() == "bob"

                # Alice's computer is exactly as unknown to bob as one that never existed.
                for tool, extra in (
                    ("computer_restart", {}),
                    ("computer_factory_reset", {}),
                    ("computer_delete", {}),
                ):
                    theirs = await bob.call({"computer_id": only_alice, **extra}, name=tool)
                    nothing = await bob.call({"computer_id": unknown, **extra}, name=tool)
                    assert theirs.is_error and nothing.is_error
                    assert theirs.text.replace(only_alice, "X") == nothing.text.replace(unknown, "X"), tool
                # terminal_execute on it makes bob a computer of his own, as for any new id.
                out = await bob.run("test -e /owner && echo seen || echo fresh", computer_id=only_alice, temporary=True)
                assert out.structured["stdout"].strip() == "fresh"
                out = await alice.run("cat /owner 2>/dev/null || echo none", computer_id=only_alice, temporary=False)
                assert out.structured["stdout"].strip() == "none"
                assert inspect(f"kilntainer-{only_alice}.{tag(ALICE)}")["State"]["Running"]

                # A session belongs to its principal: bob's token on alice's session is refused
                # as an unknown session.
                assert alice.session_id
                foreign = httpx.post(
                    srv.mcp_url,
                    headers={**bearer(TOKENS[BOB]), "Mcp-Session-Id": alice.session_id,
                             "Accept": "application/json, text/event-stream", "Content-Type": "application/json",
                             "MCP-Protocol-Version": "2025-06-18"},
                    json={"jsonrpc": "2.0", "id": 99, "method": "tools/list"},
                    timeout=30,
                )
                assert foreign.status_code == 404, foreign.text
                gone = httpx.post(
                    srv.mcp_url,
                    headers={**bearer(TOKENS[BOB]), "Mcp-Session-Id": "no-such-session",
                             "Accept": "application/json, text/event-stream", "Content-Type": "application/json",
                             "MCP-Protocol-Version": "2025-06-18"},
                    json={"jsonrpc": "2.0", "id": 99, "method": "tools/list"},
                    timeout=30,
                )
                assert (foreign.status_code, foreign.text) == (gone.status_code, gone.text)

                for sess in (alice, bob):
                    deleted = await sess.call({"computer_id": dev_box}, name="computer_delete")
                    assert not deleted.is_error, deleted.text
                assert not (await alice.call({"computer_id": only_alice}, name="computer_delete")).is_error
            log = srv.stderr()
        assert "kilntainers::audit" in log
        assert f"principal={ALICE}" in log and f"principal={BOB}" in log
        assert 'action="delete"' in log
        for secret in (*TOKENS.values(), SINGLE):
            assert secret not in log
    finally:
        remove_owned(ALICE, BOB)


async def test_quota_holds_under_twenty_concurrent_creates(kbb, tmp_path):
    tokens = tmp_path / "tokens"
    write_tokens(tokens, TOKENS)
    try:
        async with kbb.http_server(
            "--auth-tokens-file", str(tokens), "--lifecycle-tools", "--max-computers-per-user", "3", *BUSYBOX_ARGS
        ) as srv:
            async with kbb.http_session(srv, headers=bearer(TOKENS[ALICE])) as alice, \
                    kbb.http_session(srv, headers=bearer(TOKENS[BOB])) as bob:
                results: list = []

                async def create() -> None:
                    results.append(await alice.call({"temporary": True}, name="computer_create", timeout=300))

                async with anyio.create_task_group() as group:
                    for _ in range(20):
                        group.start_soon(create)
                made = [r for r in results if not r.is_error]
                refused = [r for r in results if r.is_error]
                assert len(made) == 3, [r.text for r in refused][:3]
                assert len(refused) == 17
                for r in refused:
                    assert "Computer limit reached: you have 3 of 3 computers (--max-computers-per-user)" in r.text
                assert len(containers_with_label(f"kilntainers.owner={ALICE}")) == 3
                # The limit is per principal: bob still gets his.
                out = await bob.run("echo ok")
                assert out.structured["stdout"].strip() == "ok"
                # Deleting one frees a place.
                freed = await alice.call({"computer_id": made[0].structured["computer_id"]}, name="computer_delete")
                assert not freed.is_error, freed.text
                again = await alice.call({"temporary": True}, name="computer_create")
                assert not again.is_error, again.text
    finally:
        remove_owned(ALICE, BOB)
    assert containers_with_label(f"kilntainers.owner={ALICE}") == []


async def test_running_limit_holds_for_every_way_a_stopped_computer_starts(kbb, tmp_path):
    """With `--max-running-per-user 1`, a stopped computer is not started again while another
    runs: not by a command (restart-once), computer_restart or computer_factory_reset, and it
    stays stopped; once the other is gone it restarts."""
    tokens = tmp_path / "tokens"
    write_tokens(tokens, TOKENS)
    first, second = kbb.new_id("run-a"), kbb.new_id("run-b")
    first_container = f"kilntainer-{first}.{tag(ALICE)}"
    try:
        async with kbb.http_server(
            "--auth-tokens-file", str(tokens), "--lifecycle-tools", "--max-running-per-user", "1", *BUSYBOX_ARGS
        ) as srv:
            async with kbb.http_session(srv, headers=bearer(TOKENS[ALICE])) as alice:
                await alice.run("echo a", computer_id=first, temporary=False)
                docker("stop", "-t", "1", first_container)
                await alice.run("echo b", computer_id=second, temporary=False)
                limit = "Running computer limit reached: you have 1 of 1 computers running (--max-running-per-user)"
                by_command = await alice.call({"command": "echo again", "computer_id": first, "temporary": False})
                assert by_command.is_error and limit in by_command.text, by_command.text
                for tool in ("computer_restart", "computer_factory_reset"):
                    refused = await alice.call({"computer_id": first}, name=tool)
                    assert refused.is_error and limit in refused.text, (tool, refused.text)
                assert inspect(first_container)["State"]["Running"] is False
                assert not (await alice.call({"computer_id": second}, name="computer_delete")).is_error
                restarted = await alice.call({"computer_id": first}, name="computer_restart")
                assert not restarted.is_error, restarted.text
                out = await alice.run("echo back", computer_id=first, temporary=False)
                assert out.structured["stdout"].strip() == "back"
    finally:
        remove_owned(ALICE)


async def test_sighup_reloads_the_tokens_file(kbb, tmp_path):
    tokens = tmp_path / "tokens"
    write_tokens(tokens, TOKENS)
    async with kbb.http_server("--auth-tokens-file", str(tokens), *BUSYBOX_ARGS) as srv:
        def status(token: str) -> int:
            return httpx.get(srv.mcp_url, headers=bearer(token), timeout=10).status_code

        assert status(TOKENS[ALICE]) != 401
        assert status("carol-" + "c" * 40) == 401
        write_tokens(tokens, {BOB: TOKENS[BOB], CAROL: "carol-" + "c" * 40})
        srv.signal(signal.SIGHUP)
        assert poll(lambda: status("carol-" + "c" * 40) != 401, 10, 0.05)
        assert status(TOKENS[ALICE]) == 401
        # A broken edit keeps only the tokens of lines still in the file (issue 30: carol's is
        # gone), and the server keeps running.
        tokens.write_text(f"{BOB}  {TOKENS[BOB]}\n{CAROL}\n")
        srv.signal(signal.SIGHUP)
        assert poll(lambda: "cannot reload --auth-tokens-file" in srv.stderr(), 10, 0.05)
        assert status("carol-" + "c" * 40) == 401
        assert status(TOKENS[BOB]) != 401
        assert srv.healthy()
        with pytest.raises(HttpRefused) as refused:
            async with kbb.http_session(srv, headers=bearer(TOKENS[ALICE]), init_timeout=30):
                pass
        assert refused.value.status_code == 401


async def test_stdio_rejects_principal_flags(kbb, tmp_path):
    tokens = tmp_path / "tokens"
    write_tokens(tokens, TOKENS)
    proc = subprocess.run(
        [BIN, "--auth-tokens-file", str(tokens)], capture_output=True, text=True, timeout=60,
        env=kbb.env(kbb.home()), stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 1
    assert "only valid with --transport http" in proc.stderr



def test_owner_tags_match_the_server() -> None:
    # sha256("alice")[:16], as the Rust unit test in crates/backend/src/ids.rs pins it.
    assert tag("alice") == "2bd806c97f0e00af"


async def test_computers_made_before_principals_belong_to_default(kbb, tmp_path):
    """A container labelled as the Python server (and this one before principals) labels them,
    with no owner label: `default` lists and uses it; a named principal neither sees nor
    reaches it, and the same id gets that principal a computer of its own."""
    tokens = tmp_path / "tokens"
    write_tokens(tokens, TOKENS)
    old = kbb.new_id("old-box")
    kbb.track(f"{old}.{tag(ALICE)}", temporary=True)
    kbb.python_style_container(old, BUSYBOX_ARGS[1])
    docker("exec", f"kilntainer-{old}", "sh", "-c", "echo legacy > /marker")
    async with kbb.http_server(
        "--auth-tokens-file", str(tokens), "--auth-token", SINGLE, "--lifecycle-tools", *BUSYBOX_ARGS
    ) as srv:
        async with kbb.http_session(srv, headers=bearer(SINGLE)) as default, \
                kbb.http_session(srv, headers=bearer(TOKENS[ALICE])) as alice:
            listed = (await default.call({}, name="computer_list")).structured["computers"]
            assert old in only_defaults([c["computer_id"] for c in listed]), listed
            out = await default.run("cat /marker", computer_id=old, temporary=False)
            assert out.structured["stdout"].strip() == "legacy"
            assert (await alice.call({}, name="computer_list")).structured["computers"] == []
            mine = await alice.run("cat /marker 2>/dev/null || echo fresh", computer_id=old, temporary=True)
            assert mine.structured["stdout"].strip() == "fresh"
            assert inspect(f"kilntainer-{old}")["Config"]["Labels"].get("kilntainers.owner") is None
