"""File tools and file resources (docs/files.md) over stdio with the official Python MCP client
against a real Docker engine: the switch, a 5 MiB random binary file written in base64 chunks
and read back in pages with a matching SHA-256, UTF-8 text with multibyte characters cut by
page boundaries, a PNG drawn by a command coming back as image content, file_list of a tree,
every validation and file error message, resources/read of text and binary files, and a
resource read of an unknown computer creating nothing.

The same cases run with the exec helper off (scripts/test.sh runs this file again with
KILNTAINERS_EXEC_HELPER=off)."""

from __future__ import annotations

import base64
import hashlib
import os
import struct
import zlib

import pytest

from harness import BUSYBOX_ARGS, DEBIAN, container_for, docker_exec

pytestmark = pytest.mark.anyio

FILE_ARGS = [*BUSYBOX_ARGS, "--file-tools"]
FILE_TOOLS = ["file_read", "file_write", "file_list", "port_url"]
READ_FIELDS = ["computer_id", "path", "size", "offset", "length", "encoding", "content", "eof"]
MIB = 1024 * 1024


def png(width: int = 3, height: int = 2) -> bytes:
    """A small valid PNG, made here so the test does not depend on an image library."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))
    rows = b"".join(b"\x00" + b"\xff\x00\x00" * width for _ in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def templates_of(result) -> list:
    return getattr(result, "resource_templates", getattr(result, "resourceTemplates", None))


def resource_items(result) -> list[dict]:
    return [item.model_dump(by_alias=True) for item in result.contents]


async def test_switch_off_changes_nothing(kbb):
    async with kbb.server(*BUSYBOX_ARGS) as srv:
        assert [t["name"] for t in await srv.list_tools()] == ["terminal_execute"]
        assert templates_of(await srv.session.list_resource_templates()) == []
        with pytest.raises(Exception, match="tool not found"):
            await srv.call({"path": "/etc/hostname"}, name="file_read")
        assert ", file tools" not in srv.stderr()


async def test_switch_on_adds_the_file_tools_a_template_and_the_start_line(kbb):
    async with kbb.server(*FILE_ARGS, "--job-tools", "--lifecycle-tools") as srv:
        names = [t["name"] for t in await srv.list_tools()]
        # after the job tools, before the lifecycle tools
        assert names[:9] == ["terminal_execute", "job_output", "job_write", "job_kill", "job_list", *FILE_TOOLS]
        assert names[9].startswith("computer_")
        templates = templates_of(await srv.session.list_resource_templates())
        assert [(t.uriTemplate if hasattr(t, "uriTemplate") else t.uri_template, t.name) for t in templates] == [
            ("computer://{computer_id}/{+path}", "computer-file")
        ]
        assert "file_read" in srv.init["instructions"]
        assert srv.containers() == [], "listing creates nothing"
    assert ", job tools: on, file tools: on)" in srv.stderr()


async def test_environment_switch_turns_them_on(kbb):
    async with kbb.server(*BUSYBOX_ARGS, env={"ENABLE_FILE_TOOLS": "true"}) as srv:
        assert [t["name"] for t in await srv.list_tools()] == ["terminal_execute", *FILE_TOOLS]


async def test_five_mib_binary_round_trip_in_chunks_and_pages(kbb):
    data = os.urandom(5 * MIB)
    digest = hashlib.sha256(data).hexdigest()
    cid = kbb.new_id("files-bin")
    async with kbb.server(*FILE_ARGS, "--output-limit", str(2 * MIB)) as srv:
        path = "/root/deep/er/blob.bin"
        step = 2 * MIB
        for n, start in enumerate(range(0, len(data), step)):
            part = base64.b64encode(data[start:start + step]).decode()
            res = (await srv.call({"path": path, "computer_id": cid, "content": part, "encoding": "base64",
                                   "append": n > 0}, name="file_write")).ok()
            assert res.structured == {"computer_id": cid, "path": path, "size": min(start + step, len(data)),
                                      "bytes_written": len(data[start:start + step])}
        shell = await srv.run(f"sha256sum {path}", computer_id=cid)
        assert shell.structured["stdout"].split()[0] == digest
        back = bytearray()
        offset = 0
        while True:
            res = (await srv.call({"path": path, "computer_id": cid, "offset": offset}, name="file_read")).ok()
            page = res.structured
            assert list(page) == READ_FIELDS
            assert page["size"] == len(data) and page["offset"] == offset
            assert page["encoding"] == "base64"
            chunk = base64.b64decode(page["content"])
            assert len(chunk) == page["length"] <= 2 * MIB
            back += chunk
            offset += len(chunk)
            if page["eof"]:
                break
        assert hashlib.sha256(back).hexdigest() == digest

        # one call of more than the per-exec chunk: written in pieces, replaced atomically
        big = os.urandom(3 * MIB + 5)
        res = (await srv.call({"path": path, "computer_id": cid, "content": base64.b64encode(big).decode(),
                               "encoding": "base64", "mode": "0600"}, name="file_write")).ok()
        assert res.structured["size"] == len(big)
        shell = await srv.run(f"sha256sum {path}; stat -c %a {path}; ls -a /root/deep/er", computer_id=cid)
        lines = shell.structured["stdout"].split("\n")
        assert lines[0].split()[0] == hashlib.sha256(big).hexdigest()
        assert lines[1] == "600"
        assert "kilntainers-" not in shell.structured["stdout"], "no temporary file is left"


async def test_utf8_pages_never_split_a_character(kbb):
    # 30 lines (~750 bytes): every odd page length cuts characters of 2, 3 and 4 bytes, and the
    # smallest length still means some 60 calls (one exec each with the helper off).
    text = "".join(f"{n}: añb€😀 ≠ ✓\n" for n in range(30))
    async with kbb.server(*FILE_ARGS) as srv:
        res = (await srv.call({"path": "/tmp/t/u.txt", "content": text}, name="file_write")).ok()
        assert res.structured["bytes_written"] == len(text.encode())
        for length in (13, 50, 333):
            got, offset, shortened = [], 0, 0
            while True:
                page = (await srv.call({"path": "/tmp/t/u.txt", "offset": offset, "length": length},
                                       name="file_read")).ok().structured
                assert page["encoding"] == "utf-8", page
                assert 0 < page["length"] <= length
                assert len(page["content"].encode()) == page["length"]
                got.append(page["content"])
                offset += page["length"]
                if page["eof"]:
                    break
                shortened += page["length"] < length
            assert "".join(got) == text
            if length == 13:
                assert shortened > 0, "no page ended inside a character: the case is not exercised"


async def test_a_png_drawn_by_a_command_comes_back_as_an_image(kbb):
    picture = png()
    octal = "".join(f"\\{b:03o}" for b in picture)
    async with kbb.server(*FILE_ARGS) as srv:
        await srv.run(f"printf '{octal}' > /tmp/chart.png")
        res = (await srv.call({"path": "/tmp/chart.png"}, name="file_read")).ok()
        assert base64.b64decode(res.structured["content"]) == picture
        images = [c for c in res.raw["content"] if c["type"] == "image"]
        assert len(images) == 1
        assert images[0]["mimeType"] == "image/png"
        assert base64.b64decode(images[0]["data"]) == picture
        # a page of it is not an image
        part = (await srv.call({"path": "/tmp/chart.png", "length": 10}, name="file_read")).ok()
        assert [c["type"] for c in part.raw["content"]] == ["text"]


async def test_file_list_of_a_tree(kbb):
    async with kbb.server(*FILE_ARGS) as srv:
        await srv.run("mkdir -p /srv/t/a/b/c && printf 12345 > /srv/t/f.txt && printf x > /srv/t/a/g "
                      "&& ln -s f.txt /srv/t/link && mkfifo /srv/t/pipe && chmod 0750 /srv/t/a")
        one = (await srv.call({"path": "/srv/t"}, name="file_list")).ok().structured
        assert list(one) == ["count", "entries", "truncated"] or set(one) == {"entries", "count", "truncated"}
        summary = [(e["path"], e["type"], e["mode"]) for e in one["entries"]]
        assert summary == [("/srv/t/a", "dir", "0750"), ("/srv/t/f.txt", "file", "0644"),
                           ("/srv/t/link", "symlink", "0777"), ("/srv/t/pipe", "other", "0644")]
        assert one["entries"][1]["size"] == 5
        assert one["entries"][1]["modified"].endswith("Z")
        assert one["count"] == 4 and one["truncated"] is False
        deep = (await srv.call({"path": "/srv/t", "depth": 3}, name="file_list")).ok().structured
        assert [e["path"] for e in deep["entries"]] == ["/srv/t/a", "/srv/t/a/b", "/srv/t/a/b/c", "/srv/t/a/g",
                                                        "/srv/t/f.txt", "/srv/t/link", "/srv/t/pipe"]
        await srv.run("mkdir -p /srv/many && cd /srv/many && i=0; while [ $i -lt 1003 ]; do : > f$i; i=$((i+1)); done")
        many = (await srv.call({"path": "/srv/many"}, name="file_list")).ok().structured
        assert many["count"] == 1000 and many["truncated"] is True


async def test_every_error_message(kbb):
    async with kbb.server(*FILE_ARGS) as srv:
        async def error(name: str, args: dict) -> str:
            res = await srv.call(args, name=name)
            assert res.is_error, res
            return res.text

        assert await error("file_read", {"path": "etc/passwd"}) == "path must be an absolute path, got: etc/passwd"
        assert await error("file_read", {"path": "/nope/x"}) == "File not found: /nope/x"
        assert await error("file_read", {"path": "/etc"}) == "/etc is a directory; use file_list."
        assert await error("file_read", {"path": "/etc/hostname", "offset": -1}) == "offset must be 0 or more."
        assert await error("file_read", {"path": "/etc/hostname", "length": 0}) == "length must be at least 1."
        assert await error("file_list", {"path": "/nope"}) == "File not found: /nope"
        assert await error("file_list", {"path": "/", "depth": 6}) == "depth must be between 1 and 5, got: 6"
        assert await error("file_write", {"path": "/tmp/x", "content": "%%%", "encoding": "base64"}) == \
            "content is not valid base64."
        assert await error("file_write", {"path": "/tmp/x", "content": "a", "encoding": "latin-1"}) == \
            'encoding must be "utf-8" or "base64", got: latin-1'
        assert await error("file_write", {"path": "/tmp/x", "content": "a", "mode": "rwx"}) == \
            'mode must be an octal string like "0755", got: rwx'
        assert await error("file_write", {"path": "/tmp", "content": "a"}) == \
            "/tmp is a directory; give the path of a file to write."
        assert (await error("file_write", {"path": "/tmp/x"})).startswith("Invalid arguments for tool file_write: content")
        # nothing was written by the refused calls
        res = await srv.run("ls /tmp/x 2>&1 || echo none")
        assert "none" in res.structured["stdout"]
        # a file in a read-only place
        res = await srv.call({"path": "/proc/kilntainers-nope", "content": "a"}, name="file_write")
        assert res.is_error and res.text.startswith("Could not write /proc/kilntainers-nope: ")


async def test_resources_read_text_and_binary_files(kbb):
    cid = kbb.new_id("files-res")
    blob = bytes(range(256)) * 4
    async with kbb.server(*FILE_ARGS) as srv:
        await srv.call({"path": "/root/notes.md", "computer_id": cid, "content": "# Hi ✓\n"}, name="file_write")
        await srv.call({"path": "/root/data.bin", "computer_id": cid, "content": base64.b64encode(blob).decode(),
                        "encoding": "base64"}, name="file_write")
        await srv.call({"path": "/root/pic.png", "computer_id": cid, "content": base64.b64encode(png()).decode(),
                        "encoding": "base64"}, name="file_write")
        text = resource_items(await srv.session.read_resource(f"computer://{cid}/root/notes.md"))
        assert text == [{"uri": f"computer://{cid}/root/notes.md", "mimeType": "text/markdown", "text": "# Hi ✓\n",
                         "_meta": None}] or (text[0]["text"] == "# Hi ✓\n" and text[0]["mimeType"] == "text/markdown")
        binary = resource_items(await srv.session.read_resource(f"computer://{cid}/root/data.bin"))
        assert base64.b64decode(binary[0]["blob"]) == blob
        assert binary[0]["mimeType"] == "application/octet-stream"
        picture = resource_items(await srv.session.read_resource(f"computer://{cid}/root/pic.png"))
        assert picture[0]["mimeType"] == "image/png"
        with pytest.raises(Exception, match="File not found: /root/missing"):
            await srv.session.read_resource(f"computer://{cid}/root/missing")


async def test_a_resource_read_of_an_unknown_computer_creates_nothing(kbb):
    cid = kbb.new_id("files-ghost")
    async with kbb.server(*FILE_ARGS) as srv:
        with pytest.raises(Exception, match=f"Computer {cid} not found."):
            await srv.session.read_resource(f"computer://{cid}/etc/hostname")
        assert container_for(cid) is None
        assert srv.containers() == []


async def test_a_permanent_computer_is_read_after_a_server_restart(kbb):
    cid = kbb.new_id("files-perm")
    home = kbb.home()
    async with kbb.server(*FILE_ARGS, home=home) as srv:
        await srv.run("true", computer_id=cid, temporary=False)
        kbb.track(cid, temporary=False)
        (await srv.call({"path": "/root/keep.txt", "computer_id": cid, "content": "kept\n"}, name="file_write")).ok()
    async with kbb.server(*FILE_ARGS, home=home) as srv:
        items = resource_items(await srv.session.read_resource(f"computer://{cid}/root/keep.txt"))
        assert items[0]["text"] == "kept\n"
        container = container_for(cid)
        assert container and docker_exec(container, "cat", "/root/keep.txt").stdout == "kept\n"


async def test_debian_computer_with_gnu_tools(kbb):
    data = os.urandom(300_000)
    async with kbb.server("--image", DEBIAN, "--file-tools") as srv:
        res = (await srv.call({"path": "/opt/x/y.bin", "content": base64.b64encode(data).decode(),
                               "encoding": "base64", "mode": "755"}, name="file_write")).ok()
        assert res.structured["size"] == len(data)
        page = (await srv.call({"path": "/opt/x/y.bin"}, name="file_read")).ok().structured
        assert base64.b64decode(page["content"]) == data and page["eof"] is True
        listing = (await srv.call({"path": "/opt/x"}, name="file_list")).ok().structured
        assert [(e["path"], e["mode"], e["size"]) for e in listing["entries"]] == [("/opt/x/y.bin", "0755", len(data))]


async def test_files_that_report_no_size_are_counted(kbb):
    """/proc files stat as empty; their bytes are still read."""
    async with kbb.server(*FILE_ARGS) as srv:
        page = (await srv.call({"path": "/proc/version"}, name="file_read")).ok().structured
        assert page["content"].startswith("Linux version")
        assert page["size"] == page["length"] == len(page["content"].encode()) and page["eof"] is True
