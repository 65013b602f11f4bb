"""A remote Docker engine reached over TLS (docs/decisions.md, "Docker and Podman", "Connection"):
`--docker-host tcp://…` or `https://…` with `DOCKER_TLS_VERIFY` and `DOCKER_CERT_PATH`, the way
every Docker client reaches one. The engine is a second dockerd of this test's own
(`testkit.tls_engine`) serving the API on 127.0.0.1 with TLS and client certificates required;
the machine's shared daemon never sees a computer of these tests.

Also: a missing certificate file is named at startup, an engine certificate from another CA is
refused with the reason, plain HTTP to a TLS engine says what to set, and plain `http://` with
`DOCKER_TLS_VERIFY` is a contradiction refused at startup.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from harness import BIN, BUSYBOX_ARGS, RUN_PREFIX, apoll, containers_for
from testkit import procfs
from testkit.tls_engine import TlsEngine, make_certificates

# One worker runs the whole file: its module fixture (a second engine, or a registry) is made
# once rather than on every worker that takes one of its tests.
pytestmark = [pytest.mark.anyio, pytest.mark.client_independent, pytest.mark.xdist_group("docker-tls-engine")]


@pytest.fixture(scope="module")
def engine():
    with TlsEngine(images=["sandbox-busybox:full"]) as tls_engine:
        yield tls_engine


def tls_env(cert_dir, verify: bool = True) -> dict:
    env = {"DOCKER_CERT_PATH": str(cert_dir)}
    if verify:
        env["DOCKER_TLS_VERIFY"] = "1"
    return env


def startup(kbb, *args: str, env: dict) -> subprocess.CompletedProcess:
    home = kbb.home()
    return subprocess.run(
        [BIN, *BUSYBOX_ARGS, *args], stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=60, env=kbb.env(home, env),
    )


async def test_commands_run_on_a_remote_engine_reached_over_verified_tls(kbb, engine):
    cid = f"{RUN_PREFIX}-tls"
    async with kbb.server(*BUSYBOX_ARGS, "--docker-host", engine.host, env=tls_env(engine.cert_dir)) as srv:
        res = await srv.call({"command": "echo over-tls; cat", "stdin": "x", "computer_id": cid})
        assert not res.is_error, res.text
        assert res.structured["stdout"] == "over-tls\nx", res.structured
        # A timeout kills through the same connection (the exec helper's attach is upgraded
        # HTTP over TLS).
        timed_out = await srv.call({"command": "sleep 30", "timeout": 1, "computer_id": cid})
        assert timed_out.structured["exit_code"] == 124, timed_out.structured
        assert engine.containers() == [f"kilntainer-{cid}"]
        # On the remote engine only.
        assert containers_for(cid) == []
        log = srv.stderr()
    assert f"endpoint={engine.host}" in log, log
    # The temporary computer is removed from the engine it was made on.
    assert await apoll(lambda: engine.containers() == [], 15), engine.containers()


async def test_an_https_docker_host_from_the_environment_uses_the_cert_path(kbb, engine):
    env = tls_env(engine.cert_dir, verify=False) | {"DOCKER_HOST": engine.host.replace("tcp://", "https://")}
    async with kbb.server(*BUSYBOX_ARGS, env=env) as srv:
        res = await srv.call({"command": "echo https"})
        assert not res.is_error, res.text
        assert res.structured["stdout"] == "https\n"
        assert len(engine.containers()) == 1
    assert await apoll(lambda: engine.containers() == [], 15), engine.containers()


@pytest.mark.parametrize("missing", ["ca.pem", "cert.pem", "key.pem"])
async def test_a_missing_certificate_file_is_named_at_startup(kbb, engine, tmp_path, missing):
    certs = tmp_path / "certs"
    shutil.copytree(engine.cert_dir, certs)
    (certs / missing).unlink()
    proc = startup(kbb, "--docker-host", engine.host, env=tls_env(certs))
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("kilntainers: error: ")]
    assert len(errors) == 1, proc.stderr
    assert str(certs / missing) in errors[0], errors
    assert "DOCKER_CERT_PATH" in errors[0], errors


async def test_plain_http_with_tls_verify_is_refused_at_startup(kbb, engine):
    proc = startup(kbb, "--docker-host", engine.host.replace("tcp://", "http://"), env=tls_env(engine.cert_dir))
    assert proc.returncode == 1, proc.stderr
    assert "kilntainers: error: " in proc.stderr
    assert "DOCKER_TLS_VERIFY" in proc.stderr and "http://" in proc.stderr, proc.stderr


async def test_an_engine_certificate_from_another_ca_is_refused_with_the_reason(kbb, engine, tmp_path):
    # A complete set of files, but none of them from the engine's CA.
    other = tmp_path / "other-ca"
    make_certificates(other)
    async with kbb.server(*BUSYBOX_ARGS, "--docker-host", engine.host, env=tls_env(other)) as srv:
        res = await srv.call({"command": "echo never"})
        assert res.is_error
        lines = res.text.splitlines()
        assert lines[0] == "Cannot connect to Docker. Is the Docker daemon running?", res.text
        detail = "\n".join(lines[1:])
        assert engine.host in detail, res.text
        assert "certificate" in detail.lower(), res.text
        assert str(other) in detail, res.text
    assert engine.containers() == []


async def test_plain_tcp_to_a_tls_engine_says_to_turn_tls_on(kbb, engine):
    async with kbb.server(*BUSYBOX_ARGS, "--docker-host", engine.host) as srv:
        res = await srv.call({"command": "echo never"})
        assert res.is_error
        assert res.text.startswith("Cannot connect to Docker. Is the Docker daemon running?\n"), res.text
        assert "DOCKER_TLS_VERIFY" in res.text, res.text
    assert engine.containers() == []


async def test_tls_engine_fixture_leaves_nothing_behind():
    """The fixture's own promise, checked with a daemon started and closed here."""
    with TlsEngine() as tls_engine:
        bridge, root, exec_root, pid = tls_engine.bridge, tls_engine.root, tls_engine.exec_root, tls_engine.pid
        assert json.loads(tls_engine.docker("version", "--format", "{{json .Server.Version}}").stdout)
    assert subprocess.run(["ip", "link", "show", bridge], capture_output=True).returncode != 0
    assert not root.exists() and not exec_root.exists()
    assert pid and not procfs.alive(pid)
    # Its containerd (started by the daemon, configured under the exec root) is gone too.
    assert not [p for p in Path("/proc").glob("[0-9]*") if str(exec_root) in _cmdline(p)]


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
