"""Authentication hardening over HTTP (docs/auth.md), with real HTTP clients against the real
binary: a tokens-file reload that fails still revokes the tokens whose lines are gone, and stops
accepting the file's tokens when the file cannot be read; tokens shorter than 16 bytes are
refused.
"""

from __future__ import annotations

import signal
import subprocess

import httpx
import pytest

from conftest import BIN, BUSYBOX_ARGS, free_port, poll

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
    write_tokens(tokens, [f"alice {ALICE}", f"bob {BOB}"])
    async with kbb.http_server("--auth-tokens-file", str(tokens), *BUSYBOX_ARGS) as srv:
        assert status(srv, ALICE) != 401 and status(srv, BOB) != 401
        # alice's line removed, and a line that breaks the file (one field).
        write_tokens(tokens, [f"bob {BOB}", "carol"])
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
        write_tokens(tokens, [f"bob {BOB}", f"carol {CAROL}"])
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
    write_tokens(tokens, [f"alice {ALICE}", f"bob {short}"])
    proc = subprocess.run(
        [BIN, "--transport", "http", "--port", str(free_port()), "--auth-tokens-file", str(tokens), *BUSYBOX_ARGS],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60, env=kbb.env(kbb.home()),
    )
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert "line 2" in proc.stderr and "at least 16 bytes" in proc.stderr, proc.stderr
    assert short not in proc.stderr
    # Sixteen bytes are enough.
    write_tokens(tokens, [f"alice {ALICE}", f"bob {short}y"])
    async with kbb.http_server("--auth-tokens-file", str(tokens), *BUSYBOX_ARGS) as srv:
        assert status(srv, short + "y") != 401
        # A reload that brings a short token keeps the others and not that one.
        write_tokens(tokens, [f"alice {ALICE}", f"bob {short}y", f"carol {short}"])
        reload(srv, 0)
        assert status(srv, short) == 401
        assert status(srv, ALICE) != 401

