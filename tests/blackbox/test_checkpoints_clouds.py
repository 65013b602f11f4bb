"""Checkpoints, rollback and fork (docs/checkpoints.md, "E2B and Modal") over stdio with the
official Python MCP client against the local fakes of E2B (`fakes/e2b.py`) and Modal
(`fake-modal`), whose sandboxes are local containers and whose snapshots are `docker commit`s.
These show the server drives our reading of the providers' published definitions correctly, not
that the services agree.

Covered on each: a tree of binary files, symlinks, modes and a deleted file rolled back
byte-exact under the same computer id (a new sandbox), the records found by a second server
process of the same user, two forks each independent of the other and of the source, delete of
a checkpoint a fork still uses keeping its snapshot, computer_delete leaving no snapshot on the
provider, and a temporary computer's snapshots removed with it at the session's end or, after a
SIGKILL, by the next server's crash GC."""

from __future__ import annotations

import json
import os
import signal
import urllib.request

import pytest

from fakes.e2b import FakeE2B
from harness import apoll, docker, wait_exit
from test_checkpoints import CHANGE_TREE, MAKE_TREE, call_ok, run, tree_hash
from test_modal_fake import ARGS as MODAL_ARGS
from test_modal_fake import FAKE_BIN, FakeModal, modal_env

pytestmark = [pytest.mark.anyio, pytest.mark.client_independent]

E2B_KEY = "e2b_test_key"
TOOLS = ("--checkpoint-tools", "--lifecycle-tools")


class Cloud:
    """One provider's fake: how to start a server against it and what it holds."""

    def __init__(self, kind: str, args: list[str], env: dict | None, snapshots):
        self.kind = kind
        self.args = [*args, *TOOLS]
        self.env = env
        # The provider's snapshots now: E2B's snapshot templates, Modal's snapshot images.
        self.snapshots = snapshots


@pytest.fixture(params=["e2b", "modal"])
def cloud(request, tmp_path):
    if request.param == "e2b":
        with FakeE2B(api_keys=[E2B_KEY]) as fake:
            args = ["--backend", "e2b", "--e2b-api-url", fake.url, "--e2b-envd-url", fake.envd_url,
                    "--shell", "/bin/sh", "--e2b-api-key", E2B_KEY]
            yield Cloud("e2b", args, None, lambda: sorted(fake.snapshots))
            assert fake.violations == [], fake.violations
        return
    if not FAKE_BIN.exists():
        pytest.fail(f"{FAKE_BIN} is missing: build with cargo build --all-features")
    fake = FakeModal(tmp_path)
    repository = f"fake-modal-snapshot-{fake.label}"
    try:
        yield Cloud("modal", list(MODAL_ARGS), modal_env(fake),
                    lambda: docker("images", "-q", repository).stdout.split())
    finally:
        fake.close()
    assert docker("images", "-q", repository).stdout.split() == [], "fake-modal left snapshot images"


async def sandbox_id(srv, cid: str) -> str:
    listed = await call_ok(srv, "computer_list", {})
    return next(c["sandbox_id"] for c in listed["computers"] if c["computer_id"] == cid)


async def test_rollback_byte_exact_forks_independent_and_nothing_left(kbb, cloud):
    cid = kbb.new_id(f"cp{cloud.kind}")
    home = kbb.home()
    async with kbb.server(*cloud.args, home=home, env=cloud.env) as srv:
        await run(srv, MAKE_TREE, cid)
        original = await tree_hash(srv, cid)
        first = await call_ok(srv, "computer_checkpoint", {"computer_id": cid, "name": "base", "note": "n"})
        assert first["checkpoint"] == "base" and first["parent"] is None
        assert first["memory"] is False and first["size_bytes"] is None and first["note"] == "n"
        assert len(cloud.snapshots()) == 1
        await run(srv, CHANGE_TREE, cid)
        changed = await tree_hash(srv, cid)
        assert changed != original
        before = await sandbox_id(srv, cid)
        rolled = await call_ok(srv, "computer_rollback", {"computer_id": cid, "checkpoint": "base"})
        assert rolled["computer_id"] == cid and rolled["memory"] is False
        assert await sandbox_id(srv, cid) != before, "a rollback makes a new sandbox"
        assert await tree_hash(srv, cid) == original
        await call_ok(srv, "computer_checkpoint", {"computer_id": cid, "name": "again"})
    # A second server process of the same user reads the same records.
    async with kbb.server(*cloud.args, home=home, env=cloud.env) as srv:
        listed = await call_ok(srv, "checkpoint_list", {"computer_id": cid})
        assert listed["current"] == "again"
        assert [(c["checkpoint"], c["parent"]) for c in listed["checkpoints"]] == [("base", None), ("again", "base")]
        forked = await call_ok(srv, "computer_fork", {"computer_id": cid, "checkpoint": "base", "count": 2})
        forks = forked["computers"]
        assert forks == [f"{cid}-f1", f"{cid}-f2"]
        for fork in forks:
            kbb.track(fork)
        for n, fork in enumerate(forks):
            await run(srv, f"echo {n} > /work/mine", fork)
        await run(srv, "rm -r /work/sub", cid)
        for n, fork in enumerate(forks):
            assert (await run(srv, "cat /work/mine", fork)).structured["stdout"] == f"{n}\n"
        await run(srv, "rm /work/mine", forks[0])
        assert await tree_hash(srv, forks[0]) == original
        assert (await run(srv, "test -e /work/sub", cid)).structured["exit_code"] == 1
        fork_list = await call_ok(srv, "checkpoint_list", {"computer_id": forks[1]})
        assert fork_list["current"] == "base" and [c["checkpoint"] for c in fork_list["checkpoints"]] == ["base"]
        # The forks still use base's snapshot: deleting it on the source keeps it.
        await call_ok(srv, "checkpoint_delete", {"computer_id": cid, "checkpoint": "base"})
        assert len(cloud.snapshots()) == 2
        await call_ok(srv, "computer_delete", {"computer_id": cid})
        assert len(cloud.snapshots()) == 1
        for fork in forks:
            await call_ok(srv, "computer_delete", {"computer_id": fork})
        assert cloud.snapshots() == [], "every snapshot is deleted with the last computer using it"


async def test_temporary_computers_take_their_snapshots_with_them(kbb, cloud):
    """The end of a session removes its temporary computer's snapshots; a server killed with
    SIGKILL cannot, and the next server on the same home removes them by crash GC."""
    home = kbb.home()
    async with kbb.server(*cloud.args, home=home, env=cloud.env) as srv:
        cid = (await srv.run("echo a > /a")).structured["computer_id"]
        kbb.track(cid, temporary=True)
        await call_ok(srv, "computer_checkpoint", {"computer_id": cid, "name": "t1"})
        assert len(cloud.snapshots()) == 1
    assert await apoll(lambda: cloud.snapshots() == [], 20, 0.2), "the session's end removes them"
    async with kbb.server(*cloud.args, home=home, env=cloud.env) as srv:
        cid = (await srv.run("echo b > /b")).structured["computer_id"]
        kbb.track(cid, temporary=True)
        await call_ok(srv, "computer_checkpoint", {"computer_id": cid, "name": "t2"})
        os.kill(srv.pid, signal.SIGKILL)
        assert wait_exit(srv, 10) == -signal.SIGKILL
    assert len(cloud.snapshots()) == 1
    async with kbb.server(*cloud.args, home=home, env=cloud.env):
        assert await apoll(lambda: cloud.snapshots() == [], 30, 0.2), "crash GC removes them"


def test_the_e2b_fake_serves_named_snapshots_as_the_definition_says():
    """Beyond what the server sends (an unnamed snapshot): a named one answers with its
    namespaced name as `snapshotID`, is listed by source sandbox and by name, starts a sandbox,
    and is deleted by its name; every request and answer passes the official definition."""
    with FakeE2B(api_keys=[E2B_KEY]) as fake:
        def call(method: str, path: str, body: dict | None = None):
            data = None if body is None else json.dumps(body).encode()
            request = urllib.request.Request(f"{fake.url}{path}", data=data, method=method,
                                             headers={"X-API-Key": E2B_KEY, "Content-Type": "application/json"})
            with urllib.request.urlopen(request) as answer:
                text = answer.read()
                return answer.status, json.loads(text) if text else None

        _, sandbox = call("POST", "/sandboxes", {"templateID": "base", "timeout": 60})
        status, info = call("POST", f"/sandboxes/{sandbox['sandboxID']}/snapshots", {"name": "mine"})
        assert status == 201 and info == {"snapshotID": "fake-team/mine:default", "names": ["fake-team/mine:default"]}
        assert call("GET", f"/snapshots?sandboxID={sandbox['sandboxID']}")[1] == [info]
        assert call("GET", "/snapshots?name=mine")[1] == [info]
        assert call("GET", "/snapshots?sandboxID=other")[1] == []
        status, made = call("POST", "/sandboxes", {"templateID": info["snapshotID"], "timeout": 60})
        assert status == 201 and made["templateID"] == info["snapshotID"]
        assert call("DELETE", "/templates/mine")[0] == 204
        assert call("GET", "/snapshots")[1] == []
        assert fake.violations == [], fake.violations
