"""`--backend go_busybox` end to end over stdio with the official Python MCP client.

The module is obtained exactly as users get it: the server fetches the pinned PyPI wheel with
pip (here the test venv's interpreter, named by KILNTAINERS_PYTHON) into a cache directory that
every test of the run shares (XDG_CACHE_HOME=`target/tmp/xdg-cache`, or KILNTAINERS_TEST_XDG_CACHE), so the
wheel is downloaded once per run.  If it cannot be obtained the first test fails with the
server's own message; nothing is skipped.

Covered: command strings (pipes, `&&`/`||`, redirections, `2>&1`), timeout → 124, output flood,
`working_directory` escapes, unsupported syntax, temporary computers' directories removed with
the session, permanent computers found again after a restart, the lifecycle tools, and the tool
description built from the module's applet list."""

from __future__ import annotations

import base64
import hashlib
import os

import pytest

from harness import limit_notice, timeout_notice, wasm_env

pytestmark = [pytest.mark.anyio, pytest.mark.client_independent]


async def test_command_strings_and_limits(kbb):
    env = wasm_env(kbb)
    async with kbb.server("--backend", "go_busybox", "--output-limit", "10000", env=env) as srv:
        res = await srv.run("echo hi | tr a-z A-Z")
        assert res.structured["stdout"] == "HI\n", res.structured
        assert res.structured["exit_code"] == 0
        cid = res.structured["computer_id"]
        kbb.track(cid, True)
        # go-busybox has no `seq` applet (and its awk panics under TinyGo); printf makes them.
        numbers = " ".join(str(n) for n in range(1, 101))
        res = await srv.run(f"printf '%s\\n' {numbers} | sort -rn | head -3", computer_id=cid)
        assert res.structured["stdout"] == "100\n99\n98\n"
        res = await srv.run("mkdir -p a/b && echo x > a/b/f && cat a/b/f", computer_id=cid)
        assert res.structured["stdout"] == "x\n"
        res = await srv.run("cat nope 2>&1 >/dev/null; ls nope || echo fallback", computer_id=cid)
        assert "nope" in res.structured["stdout"] and res.structured["stdout"].endswith("fallback\n")
        res = await srv.run("false && echo no", computer_id=cid)
        assert res.structured["exit_code"] == 1 and res.structured["stdout"] == ""
        res = await srv.call({"args": ["sleep", "30"], "timeout": 1, "computer_id": cid})
        assert res.structured["exit_code"] == 124
        assert res.structured["stderr"] == timeout_notice(1)
        res = await srv.call({"args": ["cat"], "stdin": "y\n" * 50000, "computer_id": cid})
        assert res.structured["stderr"] == limit_notice(10000)
        res = await srv.run("echo `id`", computer_id=cid)
        assert res.structured["exit_code"] == 2
        assert res.structured["stderr"] == "kilntainers: unsupported shell syntax: `...` (command substitution)\n"
        res = await srv.call({"args": ["pwd"], "working_directory": "/../../escape", "computer_id": cid})
        assert res.structured["exit_code"] == 0
        res = await srv.run("ls /", computer_id=cid)
        assert sorted(res.structured["stdout"].split()) == ["a", "escape"]
        assert not (kbb.dir / "escape").exists()
        # Temporary computers live in a per-user private directory (issue 15), never directly in
        # the shared temp dir.
        roots = list((kbb.dir / "tmp").glob("kilntainers-wasm-*/kilntainers-wasm-*/root"))
        assert len(roots) == 1 and (roots[0] / "a" / "b" / "f").read_text() == "x\n"
        assert (roots[0].parent.parent.stat().st_mode & 0o777) == 0o700
    # The temporary computer's directory went with the session.
    assert list((kbb.dir / "tmp").glob("kilntainers-wasm-*")) == []


async def test_permanent_computer_survives_restart(kbb):
    env = wasm_env(kbb)
    home = kbb.home()
    cid = kbb.new_id("wasm-keep")
    async with kbb.server("--backend", "go_busybox", home=home, env=env) as srv:
        res = await srv.run("echo kept > note", computer_id=cid, temporary=False)
        assert res.structured["exit_code"] == 0, res.structured
    assert (home / ".mcp-sandbox-computer-vm-for-ai" / "wasm" / "go_busybox" / cid / "root" / "note").is_file()
    async with kbb.server("--backend", "go_busybox", "--lifecycle-tools", home=home, env=env) as srv:
        res = await srv.run("cat note", computer_id=cid, temporary=False)
        assert res.structured["stdout"] == "kept\n"
        listed = await srv.call({}, name="computer_list")
        ids = [c["computer_id"] for c in listed.structured["computers"]]
        assert cid in ids
        restarted = await srv.call({"computer_id": cid}, name="computer_restart")
        assert restarted.structured["state_preserved"] is True
        reset = await srv.call({"computer_id": cid}, name="computer_factory_reset")
        assert reset.structured["ok"] is True
        res = await srv.run("ls", computer_id=cid, temporary=False)
        assert res.structured["stdout"] == ""
        deleted = await srv.call({"computer_id": cid}, name="computer_delete")
        assert deleted.structured["deleted"] is True
    assert not (home / ".mcp-sandbox-computer-vm-for-ai" / "wasm" / "go_busybox" / cid).exists()


async def test_description_lists_the_module_applets(kbb):
    async with kbb.server("--backend", "go_busybox", env=wasm_env(kbb)) as srv:
        tools = await srv.list_tools()
        desc = next(t for t in tools if t["name"] == "terminal_execute")["description"]
        assert desc.startswith("Execute a command in a lightweight sandbox (WebAssembly, BusyBox style).")
        line = next(row for row in desc.splitlines() if row.startswith("Available commands: "))
        for applet in ("cat", "ls", "sort", "tr"):
            assert f" {applet}," in line or f" {applet}." in line, line


async def test_without_pip_the_error_says_how_to_provide_the_module(kbb):
    env = wasm_env(kbb)
    env["XDG_CACHE_HOME"] = str(kbb.dir / "empty-cache")
    env["KILNTAINERS_PYTHON"] = "/nonexistent/python3"
    async with kbb.server("--backend", "go_busybox", env=env) as srv:
        res = await srv.call({"command": "echo hi"})
        assert res.is_error
        text = res.content_texts[0]
        assert text.startswith(
            "go_busybox needs busybox.wasm (sha256 292555fb80479228212cf6e1bbfc611940a85e597b91a0222ce22cda0bf4e888). "
            "Automatic download with pip failed: cannot run '/nonexistent/python3 -m pip'"
        ), text
        assert text.endswith("and pass it with --go-busybox-wasm.")


async def test_port_url_says_what_this_backend_lacks_and_creates_nothing(kbb):
    async with kbb.server("--backend", "go_busybox", "--file-tools", "--lifecycle-tools", env=wasm_env(kbb)) as srv:
        res = await srv.call({"port": 8080}, name="port_url")
        assert res.is_error and res.text == "Ports are not available on the go_busybox backend."
        listed = await srv.call({}, name="computer_list")
        assert listed.structured["computers"] == [], listed


async def test_file_tools_reach_the_computer_directory_and_never_leave_it(kbb):
    """The file tools read and write the computer's host directory directly; no symlink or
    `..` leads out of it, for reads, writes, appends, listings and resources alike."""
    env = wasm_env(kbb)
    home = kbb.home()
    cid = kbb.new_id("wasm-files")
    outside = kbb.dir / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"host secret")
    async with kbb.server("--backend", "go_busybox", "--file-tools", home=home, env=env) as srv:
        res = await srv.run("echo hi > note", computer_id=cid, temporary=False)
        assert res.structured["exit_code"] == 0, res.structured
        kbb.track(cid, False)
        data = os.urandom(300_000)
        written = await srv.call(
            {"path": "/data/blob.bin", "content": base64.b64encode(data).decode(), "encoding": "base64", "computer_id": cid},
            name="file_write",
        )
        assert not written.is_error, written
        assert written.structured == {"computer_id": cid, "path": "/data/blob.bin", "size": 300_000, "bytes_written": 300_000}
        back = b""
        while True:
            page = await srv.call({"path": "/data/blob.bin", "computer_id": cid, "offset": len(back), "length": 65536}, name="file_read")
            assert not page.is_error and page.structured["encoding"] == "base64", page
            back += base64.b64decode(page.structured["content"])
            if page.structured["eof"]:
                break
        assert hashlib.sha256(back).hexdigest() == hashlib.sha256(data).hexdigest()
        note = await srv.call({"path": "/note", "computer_id": cid}, name="file_read")
        assert (note.structured["encoding"], note.structured["content"]) == ("utf-8", "hi\n")
        res = await srv.run("ls /data", computer_id=cid, temporary=False)
        assert res.structured["stdout"] == "blob.bin\n", "a command sees what file_write wrote"

        root = home / ".mcp-sandbox-computer-vm-for-ai" / "wasm" / "go_busybox" / cid / "root"
        (root / "escape").symlink_to(outside)
        (root / "leak").symlink_to(outside / "secret")
        for path in ("/escape/secret", "/leak", "/../outside/secret"):
            res = await srv.call({"path": path, "computer_id": cid}, name="file_read")
            assert res.is_error and res.text == f"Permission denied: {path} leads outside the computer.", (path, res)
            if ".." not in path:  # a URI client may resolve the dots itself
                with pytest.raises(Exception, match="leads outside the computer"):
                    await srv.session.read_resource(f"computer://{cid}{path}")
        for path, append in (("/escape/planted", False), ("/leak", False), ("/leak", True), ("/../outside/planted", False)):
            res = await srv.call({"path": path, "content": "planted", "append": append, "computer_id": cid}, name="file_write")
            assert res.is_error and res.text == f"Permission denied: {path} leads outside the computer.", (path, res)
        listed = await srv.call({"path": "/", "computer_id": cid, "depth": 3}, name="file_list")
        paths = {e["path"]: e["type"] for e in listed.structured["entries"]}
        assert paths == {
            "/data": "dir", "/data/blob.bin": "file", "/escape": "symlink", "/leak": "symlink", "/note": "file",
        }, paths
    assert sorted(p.name for p in outside.iterdir()) == ["secret"]
    assert (outside / "secret").read_bytes() == b"host secret"
