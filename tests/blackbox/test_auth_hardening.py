"""Authentication hardening over HTTP (docs/auth.md), with real HTTP clients against the real
binary: a tokens-file reload that fails still revokes the tokens whose lines are gone, and stops
accepting the file's tokens when the file cannot be read; tokens shorter than 16 bytes are
refused; refused requests are logged with a capped, escaped path, at a bounded rate.
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import time

import httpx
import pytest

from harness import BIN, BUSYBOX_ARGS, free_port, poll
from test_principals import principal

pytestmark = pytest.mark.anyio

ALICE = "alice-" + "a" * 40
BOB = "bob-" + "b" * 40
CAROL = "carol-" + "c" * 40


def write_tokens(path, lines: list[str], mode: int = 0o600) -> None:
    path.write_text("".join(line + "\n" for line in lines))
    path.chmod(mode)


def status(srv, token: str) -> int:
    return httpx.get(srv.mcp_url, headers={"Authorization": f"Bearer {token}"}, timeout=10).status_code


def reload(srv, failures_before: int) -> None:
    """SIGHUP, then wait until the server has logged one more failed reload."""
    srv.signal(signal.SIGHUP)
    assert poll(lambda: srv.stderr().count("cannot reload --auth-tokens-file") > failures_before, 10, 0.05), srv.stderr()


# ---------------------------------------------------------------------------------------------
# a failed reload revokes (issue 30)


async def test_issue_30_a_failed_reload_still_revokes_removed_lines(kbb, tmp_path):
    """A broken edit keeps only the tokens whose lines are still in the file; a file that cannot
    be read (gone, or opened to others) stops every token of the file; a good edit restores."""
    # See: issue 30
    tokens = tmp_path / "tokens"
    alice, bob, carol = principal("alice"), principal("bob"), principal("carol")
    write_tokens(tokens, [f"{alice} {ALICE}", f"{bob} {BOB}"])
    async with kbb.http_server("--auth-tokens-file", str(tokens), *BUSYBOX_ARGS) as srv:
        assert status(srv, ALICE) != 401 and status(srv, BOB) != 401
        # alice's line removed, and a line that breaks the file (one field).
        write_tokens(tokens, [f"{bob} {BOB}", carol])
        reload(srv, 0)
        assert status(srv, ALICE) == 401, "a token removed from the file still works after a failed reload"
        assert status(srv, BOB) != 401, "a token still in the file stopped working"
        assert status(srv, CAROL) == 401
        log = srv.stderr()
        line = next(row for row in log.splitlines() if "cannot reload --auth-tokens-file" in row)
        assert "line 2" in line and "kept=1" in line and "revoked=1" in line, line
        for secret in (ALICE, BOB):
            assert secret not in log

        # The file opened to others: its lines may have leaked, so none is accepted.
        tokens.chmod(0o644)
        reload(srv, 1)
        assert status(srv, BOB) == 401
        # Fixed: the file's set again.
        write_tokens(tokens, [f"{bob} {BOB}", f"{carol} {CAROL}"])
        srv.signal(signal.SIGHUP)
        assert poll(lambda: status(srv, CAROL) != 401, 10, 0.05)
        assert status(srv, BOB) != 401
        # The file gone: nothing of it is accepted.
        tokens.unlink()
        reload(srv, 2)
        assert status(srv, BOB) == 401 and status(srv, CAROL) == 401
        assert srv.healthy()


async def test_issue_30_tokens_shorter_than_16_bytes_are_refused(kbb, tmp_path):
    # See: issue 30
    tokens = tmp_path / "tokens"
    short = "fifteen-bytes-x"
    assert len(short) == 15
    alice, bob, carol = principal("alice"), principal("bob"), principal("carol")
    write_tokens(tokens, [f"{alice} {ALICE}", f"{bob} {short}"])
    proc = subprocess.run(
        [BIN, "--transport", "http", "--port", str(free_port()), "--auth-tokens-file", str(tokens), *BUSYBOX_ARGS],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60, env=kbb.env(kbb.home()),
    )
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert "line 2" in proc.stderr and "at least 16 bytes" in proc.stderr, proc.stderr
    assert short not in proc.stderr
    # Sixteen bytes are enough.
    write_tokens(tokens, [f"{alice} {ALICE}", f"{bob} {short}y"])
    async with kbb.http_server("--auth-tokens-file", str(tokens), *BUSYBOX_ARGS) as srv:
        assert status(srv, short + "y") != 401
        # A reload that brings a short token keeps the others and not that one.
        write_tokens(tokens, [f"{alice} {ALICE}", f"{bob} {short}y", f"{carol} {short}"])
        reload(srv, 0)
        assert status(srv, short) == 401
        assert status(srv, ALICE) != 401


# ---------------------------------------------------------------------------------------------
# refusal log lines (issue 30)

TOKEN = "single-" + "s" * 40
# docs/auth.md, "Audit": the longest path written, and the refusal lines' rate.
MAX_LOGGED_PATH = 256
REFUSAL_LINES_BURST = 20
REFUSAL_LINES_PER_SECOND = 10


def refusal_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "request refused" in line]


def raw_request(srv, target: bytes) -> bytes:
    """One HTTP/1.1 request with exactly these request-target bytes; the status line back."""
    with socket.create_connection((srv.host, srv.port), timeout=10) as conn:
        conn.sendall(b"GET " + target + b" HTTP/1.1\r\nHost: 127.0.0.1:" + str(srv.port).encode()
                     + b"\r\nConnection: close\r\n\r\n")
        return conn.makefile("rb").readline()


async def test_issue_30_refused_paths_are_logged_capped_escaped_and_rate_limited(kbb):
    # See: issue 30
    async with kbb.http_server("--auth-token", TOKEN, "--file-tools", *BUSYBOX_ARGS) as srv:
        start = len(srv.stderr())
        long_path = "/computers/x/ports/80/" + "a" * 50_000
        with httpx.Client(timeout=10) as client:
            assert client.get(srv.base_url + long_path).status_code == 401
            assert poll(lambda: refusal_lines(srv.stderr()[start:]), 10, 0.05)
            line = refusal_lines(srv.stderr()[start:])[0]
            assert len(line) <= MAX_LOGGED_PATH + 400, f"a {len(long_path)}-byte path logged as {len(line)} bytes"
            assert "a" * (MAX_LOGGED_PATH + 1) not in line
            assert re.search(r"50022 bytes", line), line
            # An accepted request's audit line is capped the same way.
            accepted = client.get(srv.base_url + long_path, headers={"Authorization": f"Bearer {TOKEN}"})
            assert accepted.status_code != 401

            def audit_lines() -> list[str]:
                rows = srv.stderr()[start:].splitlines()
                return [row for row in rows if "principal=default" in row and "path=" in row]

            assert poll(audit_lines, 10, 0.05)
            assert all(len(row) <= MAX_LOGGED_PATH + 400 for row in audit_lines()), [len(r) for r in audit_lines()]

        # Bytes a terminal would act on never reach the log as they are.
        for target in (b"/computers/x/ports/80/\xe2\x80\xaeevil", b"/computers/x/ports/80/\x1b[2Jx", b"/computers/x/ports/80/%0Afake"):
            raw_request(srv, target)
        text = srv.stderr()[start:]
        assert "\u202e" not in text and "\x1b" not in text, "a control or bidi character reached the log"
        assert not any(row.startswith("fake") for row in text.splitlines()), "a path forged a log line"

        # A flood of refusals: lines at the configured rate, and a count of those left out.
        flood_start = len(srv.stderr())
        sent = 500
        t0 = time.monotonic()
        with httpx.Client(timeout=10) as client:
            for _ in range(sent):
                assert client.get(srv.base_url + "/computers/x/ports/80/").status_code == 401
        elapsed = time.monotonic() - t0
        assert poll(lambda: refusal_lines(srv.stderr()[flood_start:]), 10, 0.05)
        written = refusal_lines(srv.stderr()[flood_start:])
        bound = REFUSAL_LINES_BURST + REFUSAL_LINES_PER_SECOND * elapsed + 2
        assert len(written) <= bound, f"{len(written)} refusal lines for {sent} refusals in {elapsed:.1f} s"

        # Every refusal is written or counted: once the rate lets a line through again, it says
        # how many were left out since the last one written.
        probes = 0

        def accounted() -> bool:
            nonlocal probes
            httpx.get(srv.base_url + "/computers/x/ports/80/", timeout=10)
            probes += 1
            text = srv.stderr()[flood_start:]
            counted = sum(int(n) for n in re.findall(r"suppressed=(\d+)", text))
            return counted + len(refusal_lines(text)) == sent + probes

        assert poll(accounted, 10, 0.2), "the refusal lines left out are not all counted"
        assert srv.healthy()
