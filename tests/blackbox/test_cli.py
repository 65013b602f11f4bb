"""Command line: startup validation messages (`kilntainers: error: <message>`, exit 1) for
docs/decisions.md, "Startup validation" rows 1-3, 5-8, 13-16; parser usage errors exit 2; `--version`/`--help`; defaults passed
explicitly in stdio mode are accepted; `--docker-run-flag` translation (`--pids-limit=256`,
`--tmpfs /scratch:size=10m`), `--no-network`, `--flag=value` form (docs/decisions.md, "Core options";
docs/decisions.md, "Docker run flags"; docs/decisions.md, "Acceptance checklist" item 22)."""

from __future__ import annotations

import re
import subprocess

import pytest

from harness import BIN, BUSYBOX, BUSYBOX_ARGS, REPO, container_for, inspect

pytestmark = pytest.mark.anyio


def run_cli(kbb, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    home = kbb.home()
    return subprocess.run(
        [BIN, *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=kbb.env(home),
    )


def error_lines(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("kilntainers: error: ")]


BOTH_TOOL_FLAGS = (
    "Cannot use both --tool-instruction-override and --extended-tool-instruction. Use override to replace "
    "the description entirely, or extended to append to the backend default."
)

STARTUP_ERRORS = [
    # row 1-3: HTTP-only flags in stdio mode (compared with the default value)
    (["--host", "0.0.0.0"], "--host is only valid with --transport http. In stdio mode, there is no HTTP server to bind."),
    (["--host", "localhost"], "--host is only valid with --transport http. In stdio mode, there is no HTTP server to bind."),
    (["--port", "9000"], "--port is only valid with --transport http. In stdio mode, there is no HTTP server to bind."),
    (
        ["--session-timeout", "10"],
        "--session-timeout is only valid with --transport http. In stdio mode, the session lives as long as the process.",
    ),
    # order: row 1 before row 2
    (["--port", "9000", "--host", "0.0.0.0"], "--host is only valid with --transport http. In stdio mode, there is no HTTP server to bind."),
    # row 5
    (["--tool-instruction-override", "a", "--extended-tool-instruction", "b"], BOTH_TOOL_FLAGS),
    # row 6-8
    (["--timeout", "0"], "--timeout must be at least 1 second."),
    (["--output-limit", "0"], "--output-limit must be at least 1 byte."),
    (["--transport", "http", "--session-timeout", "0"], "--session-timeout must be at least 1 second."),
    # row 5 comes before row 6
    (["--timeout", "0", "--tool-instruction-override", "a", "--extended-tool-instruction", "b"], BOTH_TOOL_FLAGS),
    # row 13
    (
        ["--engine", "lxc"],
        "--engine must be 'docker' or 'podman'; got 'lxc'. Other engines can be used through --docker-host "
        "with a Docker-compatible API socket.",
    ),
    # row 14
    (["--cpu", "abc"], "--cpu must be a positive number like \"1.5\"; got 'abc'."),
    (["--memory", "12zz"], "--memory must be a size like \"512m\" or \"2g\"; got '12zz'."),
    (["--memory", "lots"], "--memory must be a size like \"512m\" or \"2g\"; got 'lots'."),
    # row 16
    (
        ["--no-network", "--docker-run-flag", "--network=host"],
        "--docker-run-flag '--network=host' conflicts with --no-network.",
    ),
]


@pytest.mark.parametrize("args,message", STARTUP_ERRORS, ids=[" ".join(a) for a, _ in STARTUP_ERRORS])
def test_startup_error_messages(kbb, args, message):
    proc = run_cli(kbb, *args)
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert error_lines(proc) == [f"kilntainers: error: {message}"], proc.stderr
    assert proc.stdout == "", "stdout carries only MCP traffic"


@pytest.mark.parametrize("flag", ["--bogus-flag", "--memory-reservation=1g", "-p 8080:80"])
def test_unsupported_docker_run_flag(kbb, flag):
    proc = run_cli(kbb, *BUSYBOX_ARGS, "--docker-run-flag", flag)
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    lines = error_lines(proc)
    assert len(lines) == 1, proc.stderr
    token = flag.split("=")[0].split(" ")[0]
    m = re.fullmatch(
        r"kilntainers: error: Unsupported --docker-run-flag '([^']+)'\. Supported flags: (.+)\.", lines[0]
    )
    assert m, lines[0]
    assert m.group(1) in (flag, token), lines[0]
    supported = m.group(2)
    for name in ("--pids-limit", "--tmpfs", "--cap-add", "--read-only", "--ulimit"):
        assert name in supported, supported
    for name in ("--rm", "--name", "--entrypoint"):
        assert not re.search(rf"(^|[ ,/]){re.escape(name)}([ ,=/]|$)", supported), supported


@pytest.mark.parametrize("flag", ["--rm", "--name=x", "--entrypoint=/bin/sh", "-d", "--detach", "-i", "-t", "--restart=always"])
def test_managed_docker_run_flags_are_rejected(kbb, flag):
    """docs/decisions.md, "Docker run flags": flags the product manages are rejected at startup; docs/decisions.md, "Startup validation" row 15
    allows either the `Unsupported ...` or the `Invalid ...: <reason>.` form."""
    proc = run_cli(kbb, *BUSYBOX_ARGS, "--docker-run-flag", flag)
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    lines = error_lines(proc)
    assert len(lines) == 1, proc.stderr
    assert re.fullmatch(
        r"kilntainers: error: (Unsupported --docker-run-flag '[^']+'\. Supported flags: .+\."
        r"|Invalid --docker-run-flag '[^']+': .+\.)",
        lines[0],
    ), lines[0]
    assert f"'{flag}'" in lines[0] or f"'{flag.split('=')[0]}'" in lines[0], lines[0]


@pytest.mark.parametrize("value", ["--pids-limit=abc", "--ulimit nofile", "--tmpfs"])
def test_malformed_docker_run_flag(kbb, value):
    proc = run_cli(kbb, *BUSYBOX_ARGS, "--docker-run-flag", value)
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    lines = error_lines(proc)
    assert len(lines) == 1, proc.stderr
    assert re.fullmatch(r"kilntainers: error: Invalid --docker-run-flag '[^']+': .+\.", lines[0]), lines[0]


def test_docker_run_flag_reserved_label_is_rejected(kbb):
    proc = run_cli(kbb, *BUSYBOX_ARGS, "--docker-run-flag", "--label kilntainers.computer-id=x")
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert len(error_lines(proc)) == 1, proc.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["--backend", "nope"],
        ["--transport", "ftp"],
        ["--fly-cpu-kind", "gigantic"],
        ["--no-such-flag"],
        ["--timeout", "abc"],
        ["--port", "http"],
    ],
    ids=lambda a: " ".join(a),
)
def test_usage_errors_exit_2(kbb, args):
    proc = run_cli(kbb, *args)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert proc.stdout == ""


def test_version_and_help(kbb):
    version = re.search(r'^version\s*=\s*"([^"]+)"', (REPO / "Cargo.toml").read_text(), re.M).group(1)
    proc = run_cli(kbb, "--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"mcp-sandbox-computer-vm-for-ai {version}"
    proc = run_cli(kbb, "--help")
    assert proc.returncode == 0
    assert "MCP server providing isolated Linux sandboxes for LLM agent shell execution." in proc.stdout
    positions = [proc.stdout.lower().find(group) for group in (
        "core options", "tool description", "docker backend options", "e2b backend options",
        "fly backend options", "modal backend options", "wasm backend options")]
    assert all(p >= 0 for p in positions) and positions == sorted(positions), positions


async def test_explicit_http_defaults_are_accepted_in_stdio(kbb):
    async with kbb.server(*BUSYBOX_ARGS, "--host", "127.0.0.1", "--port", "8435", "--session-timeout", "300") as srv:
        tools = await srv.list_tools()
        assert [t["name"] for t in tools] == ["terminal_execute"]
    assert srv.returncode() == 0


async def test_docker_run_flag_pids_limit(kbb):
    async with kbb.server(*BUSYBOX_ARGS, "--docker-run-flag", "--pids-limit=256") as srv:
        cid = (await srv.run("true")).structured["computer_id"]
        assert inspect(container_for(cid))["HostConfig"]["PidsLimit"] == 256


async def test_docker_run_flag_tmpfs_mounts(kbb):
    async with kbb.server(
        "--image=" + BUSYBOX, "--shell=/bin/sh", "--docker-run-flag", "--tmpfs /scratch:size=10m"
    ) as srv:
        res = await srv.run("grep ' /scratch ' /proc/mounts")
        line = res.structured["stdout"].strip()
        assert line.startswith("tmpfs /scratch tmpfs "), res.structured
        assert "size=10240k" in line, line
        res = await srv.run("echo data > /scratch/f && cat /scratch/f")
        assert res.structured["stdout"] == "data\n"


async def test_no_network(kbb):
    async with kbb.server(*BUSYBOX_ARGS, "--no-network") as srv:
        cid = (await srv.run("true")).structured["computer_id"]
        assert inspect(container_for(cid))["HostConfig"]["NetworkMode"] == "none"
        res = await srv.run("cat /proc/net/dev | grep -c ':' ")
        assert res.structured["stdout"].strip() == "1", "only the loopback interface should exist"


# ---------------------------------------------------------------------------------------------
# Secrets on the command line (issue 15): a flag is readable by every local user in
# /proc/<pid>/cmdline, so it is warned about; `…-file` variants and the env keep it out of sight.

SECRET_FLAGS = [
    ("--auth-token", "KILNTAINERS_AUTH_TOKEN", "--auth-token-file"),
    ("--fly-token", "FLY_API_TOKEN", "--fly-token-file"),
    ("--e2b-api-key", "E2B_API_KEY", "--e2b-api-key-file"),
    ("--modal-token-secret", "MODAL_TOKEN_SECRET", "--modal-token-secret-file"),
]


def warning_lines(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("kilntainers: warning: ")]


# See: issue 15
@pytest.mark.parametrize("flag,env,file_flag", SECRET_FLAGS, ids=[f for f, _, _ in SECRET_FLAGS])
def test_issue_15_secret_flags_warn_but_env_and_files_do_not(kbb, tmp_path, flag, env, file_flag):
    proc = run_cli(kbb, *BUSYBOX_ARGS, flag, "s3cret-value")
    assert proc.returncode == 0, proc.stderr
    assert warning_lines(proc) == [
        f"kilntainers: warning: {flag} on the command line is visible to other local users; use {env} or {file_flag}"
    ], proc.stderr
    assert "s3cret-value" not in proc.stderr
    home = kbb.home()
    proc = subprocess.run([BIN, *BUSYBOX_ARGS], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=30, env=kbb.env(home, {env: "s3cret-value"}))
    assert proc.returncode == 0 and warning_lines(proc) == [], proc.stderr
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-value\n")
    proc = run_cli(kbb, *BUSYBOX_ARGS, file_flag, str(token_file))
    assert proc.returncode == 0 and warning_lines(proc) == [], proc.stderr


def _secret_file_cases():
    # (backend args, file flag, value flag): each file flag is read where its value is used.
    return [
        (["--transport", "http"], "--auth-token-file", "--auth-token"),
        (["--backend", "fly"], "--fly-token-file", "--fly-token"),
        (["--backend", "e2b"], "--e2b-api-key-file", "--e2b-api-key"),
        (["--backend", "modal"], "--modal-token-secret-file", "--modal-token-secret"),
    ]


# See: issue 15
@pytest.mark.parametrize("backend,file_flag,flag", _secret_file_cases(), ids=[c[1] for c in _secret_file_cases()])
def test_issue_15_bad_secret_files_stop_the_server(kbb, tmp_path, backend, file_flag, flag):
    missing = tmp_path / "missing"
    proc = run_cli(kbb, *backend, file_flag, str(missing))
    assert proc.returncode == 1, proc.stderr
    assert error_lines(proc) == [
        f"kilntainers: error: Cannot read {file_flag} '{missing}': No such file or directory (os error 2)."
    ], proc.stderr
    empty = tmp_path / "empty"
    empty.write_text("\n")
    proc = run_cli(kbb, *backend, file_flag, str(empty))
    assert proc.returncode == 1
    assert error_lines(proc) == [f"kilntainers: error: {file_flag} '{empty}' is empty."], proc.stderr
    good = tmp_path / "good"
    good.write_text("value\n")
    proc = run_cli(kbb, *backend, flag, "value", file_flag, str(good))
    assert proc.returncode == 1
    assert error_lines(proc) == [
        f"kilntainers: error: {flag} and {file_flag} were both given; use only one of them."
    ], proc.stderr


# See: issue 15
async def test_issue_15_the_bearer_token_can_come_from_a_file(kbb, tmp_path):
    import httpx

    token = "token-from-a-file-0123456789"
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    body = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "kbb", "version": "0"}}}
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    # The env variant of --auth-token-file.
    async with kbb.http_server(*BUSYBOX_ARGS, env={"KILNTAINERS_AUTH_TOKEN_FILE": str(token_file)}) as srv:
        url = srv.mcp_url
        assert httpx.post(url, json=body, headers=headers, timeout=30).status_code == 401
        authed = httpx.post(url, json=body, headers={**headers, "Authorization": f"Bearer {token}"}, timeout=30)
        assert authed.status_code == 200, authed.text
        assert token not in srv.stderr() and warning_lines_text(srv.stderr()) == []


def warning_lines_text(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("kilntainers: warning: ")]


# See: issue 15
def test_issue_15_help_lists_the_file_variants_in_their_groups(kbb):
    text = run_cli(kbb, "--help").stdout
    groups = {}
    current = None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            current = line[:-1].lower()
        elif current and line.strip().startswith("--"):
            groups.setdefault(current, []).append(line.split()[0].rstrip(","))
    assert "--auth-token-file" in groups["core options"], groups
    assert "--fly-token-file" in groups["fly backend options"], groups
    assert "--e2b-api-key-file" in groups["e2b backend options"], groups
    assert "--modal-token-secret-file" in groups["modal backend options"], groups
