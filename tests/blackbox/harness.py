"""The harness of the black-box MCP tests: servers, sessions, computer ids and cleanup.

The server binary is started over stdio and driven with the official Python MCP client SDK
(`mcp` on PyPI: `ClientSession`, `StdioServerParameters`, `stdio_client`).  Assertions about
containers use the docker CLI.  Nothing here knows about the server's internals.  The pytest
fixtures and hooks that hand this to the tests (`kbb`, the environment check, the session-level
leak check) are in `conftest.py`; the fault suite uses both (`tests/faults/faultkit.py`).

Conventions
-----------
* Binary: env `KILNTAINERS_BIN`, default `<repo>/target/debug/mcp-sandbox-computer-vm-for-ai`.
* Every server gets its own temporary HOME (state dir isolation) unless a test passes one.
* Every server runs under a tiny Python shim that records the server's pid and exit status,
  so tests can signal exactly that process and read its exit code.
* Explicit computer ids carry a per-run prefix `t<6 hex>-`; every computer id a test creates or
  sees in a result is force-removed at teardown, and temporary computers that should have been
  removed by the server but were not are reported as leaks.
* `kbb.http_server` / `kbb.http_session` do the same over `--transport http` with the SDK's
  Streamable HTTP client (free port chosen here, readiness by polling `/healthz`).
* A session-level check asserts that no `kilntainers` container, no process started by the
  tests and no temporary directory made by the tests is left behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

import anyio
import httpx

try:  # The 2.x SDK's Streamable HTTP client takes an httpx2 client; 1.x takes httpx.
    import httpx2 as sdk_httpx
except ImportError:
    sdk_httpx = httpx

from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client

REPO = Path(__file__).resolve().parents[2]
# The helpers shared with the benchmarks live in the repository's `testkit` package, and the
# fakes of provider APIs in its `fakes` package: both are imported from the repository root.
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from testkit import procfs  # noqa: E402

BIN = os.environ.get("KILNTAINERS_BIN") or str(REPO / "target" / "debug" / "mcp-sandbox-computer-vm-for-ai")

DEBIAN = "debian:bookworm-slim"
BUSYBOX = "sandbox-busybox:full"
MINIMAL = "sandbox-busybox:minimal"
BUSYBOX_ARGS = ["--image", BUSYBOX, "--shell", "/bin/sh"]
MINIMAL_ARGS = ["--image", MINIMAL, "--shell", "/bin/sh"]

RUN_PREFIX = "t" + secrets.token_hex(3)
# Everything this test run made: computer ids seen or chosen, and server instance ids.  The
# suite-level leak check only ever looks at (and removes) containers matching these, because
# other sessions may use the same Docker daemon at the same time.
MADE: dict[str, set[str]] = {"ids": set(), "instances": set()}
STATE_DIR_NAME = ".mcp-sandbox-computer-vm-for-ai"
MIB2 = 2 * 1024 * 1024

# Exact strings from the spec (docs/decisions.md, "MCP surface", "Computer ids", "Command-line conventions").
SLUG_MESSAGE = (
    "computer_id must be 1-63 lowercase letters, numbers, or hyphens; "
    "it must start and end with a letter or number."
)
RANDOM_SLUG_RE = re.compile(
    r"^(amber|brisk|calm|clever|coral|crisp|gentle|lucky|quiet|rapid|silver|steady)-"
    r"(badger|comet|falcon|gecko|heron|lynx|otter|panda|raven|tiger|whale|wolf)-[0-9a-f]{4}$"
)
SLUG_RE = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")
RESULT_KEYS = ["computer_id", "temporary", "stdout", "stderr", "exit_code", "exec_duration_ms"]


def timeout_notice(n: int) -> str:
    return f"[kilntainers: command timed out after {n}s]"


def limit_notice(limit: int) -> str:
    return (
        f"[kilntainers: output limit exceeded ({limit} bytes). Command terminated. No output returned. "
        "Re-run with head, tail, or grep to manage output size.]"
    )


# The shim: runs the server as a child with inherited stdin/stdout/stderr, records its pid and
# exit status.  Signal dispositions are the defaults (unlike a background job of `sh`).
SHIM = r"""
import subprocess, sys
pidf, rcf = sys.argv[1], sys.argv[2]
p = subprocess.Popen(sys.argv[3:])
with open(pidf + ".tmp", "w") as f:
    f.write(str(p.pid))
import os
os.replace(pidf + ".tmp", pidf)
rc = p.wait()
with open(rcf + ".tmp", "w") as f:
    f.write(str(rc))
os.replace(rcf + ".tmp", rcf)
sys.exit(rc if rc >= 0 else 128 - rc)
"""


# ---------------------------------------------------------------------------------------------
# small utilities


def poll(predicate, timeout: float, interval: float = 0.1):
    """Call predicate until it returns a truthy value or the deadline passes; return the last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval)


def wait_exit(server, timeout: float, interval: float = 0.02) -> int | None:
    """Poll a server's recorded exit status until it exists (0 is a status, not "not yet")."""
    poll(lambda: server.returncode() is not None, timeout, interval)
    return server.returncode()


async def apoll(predicate, timeout: float, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        await anyio.sleep(interval)


def pyjson(obj: Any) -> str:
    """Python json.dumps defaults: the byte format the server's text block must have."""
    return json.dumps(obj)


def dump(model: Any) -> dict:
    """Wire-format dict of an SDK pydantic model (works for mcp 1.x and 2.x)."""
    return model.model_dump(by_alias=True, mode="json", exclude_none=True)


# ---------------------------------------------------------------------------------------------
# docker CLI helpers


def docker(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def containers_with_label(label: str) -> list[str]:
    out = docker("ps", "-aq", "--no-trunc", "--filter", f"label={label}").stdout
    return [line for line in out.split() if line]


def containers_for(computer_id: str) -> list[str]:
    """Full ids of all containers (any state) labelled with this computer id or named for it."""
    ids = set(containers_with_label(f"kilntainers.computer-id={computer_id}"))
    out = docker("ps", "-aq", "--no-trunc", "--filter", f"name=^/kilntainer-{computer_id}$").stdout
    ids.update(line for line in out.split() if line)
    return sorted(ids)


def container_for(computer_id: str) -> str | None:
    ids = containers_for(computer_id)
    assert len(ids) <= 1, f"more than one container for {computer_id}: {ids}"
    return ids[0] if ids else None


def inspect(container: str) -> dict | None:
    proc = docker("inspect", container, check=False)
    if proc.returncode != 0:
        return None
    data = json.loads(proc.stdout)
    return data[0] if data else None


def is_running(container: str) -> bool:
    info = inspect(container)
    return bool(info and info["State"]["Running"])


def wait_gone(computer_id: str, timeout: float = 10.0) -> bool:
    """Docker 20.10 removes --rm containers asynchronously: poll instead of asserting at once."""
    return bool(poll(lambda: not containers_for(computer_id), timeout, 0.2))


async def await_gone(computer_id: str, timeout: float = 10.0) -> bool:
    return bool(await apoll(lambda: not containers_for(computer_id), timeout, 0.2))


def force_remove(containers: list[str]) -> None:
    if containers:
        docker("rm", "-f", *containers, check=False)


def docker_exec(container: str, *cmd: str) -> subprocess.CompletedProcess:
    return docker("exec", container, *cmd, check=False)


def server_networks() -> set[str]:
    """Names of the networks the server made (label `kilntainers.network`)."""
    out = docker("network", "ls", "--filter", "label=kilntainers.network", "--format", "{{.Name}}", check=False)
    return set(out.stdout.split())


def all_kilntainers_containers() -> set[str]:
    return set(containers_with_label("kilntainers"))


def containers_made_by_tests() -> list[str]:
    """Containers labelled `kilntainers` that this test run made (see MADE)."""
    fmt = '{{.ID}}|{{.Label "kilntainers.computer-id"}}|{{.Label "kilntainers.instance"}}'
    out = docker("ps", "-a", "--no-trunc", "--filter", "label=kilntainers", "--format", fmt).stdout
    mine = []
    for line in out.splitlines():
        parts = line.split("|")
        if len(parts) != 3:
            continue
        cid, computer_id, instance = parts
        if (
            computer_id in MADE["ids"]
            or computer_id.startswith(RUN_PREFIX + "-")
            or (instance and instance in MADE["instances"])
        ):
            mine.append(cid)
    return sorted(mine)


def checkpoint_images(computer_ids: set[str] | None = None) -> list[str]:
    """Checkpoint images (docs/checkpoints.md) of this run's computers, or of `computer_ids`:
    each tag `kilntainers-checkpoint/<id>:<name>`, and the id of an image left without one."""
    out = docker(
        "images", "--no-trunc", "--filter", "label=kilntainers.checkpoint", "--format", "{{.ID}}|{{.Repository}}|{{.Tag}}",
        check=False,
    ).stdout
    found = []
    for line in out.splitlines():
        parts = line.split("|")
        if len(parts) != 3:
            continue
        image, repository, tag = parts
        if repository == "<none>":
            labelled = docker("image", "inspect", "--format", '{{index .Config.Labels "kilntainers.checkpoint.computer-id"}}', image, check=False)
            computer = labelled.stdout.strip()
        else:
            computer = repository.removeprefix("localhost/").removeprefix("docker.io/").removeprefix("kilntainers-checkpoint/")
        mine = computer in computer_ids if computer_ids is not None else computer.startswith(RUN_PREFIX + "-")
        if mine:
            found.append(image if repository == "<none>" else f"{repository}:{tag}")
    return sorted(set(found))


def remove_checkpoint_images(computer_ids: set[str] | None = None) -> None:
    images = checkpoint_images(computer_ids)
    if images:
        docker("rmi", "-f", *images, check=False)


def image_exists(image: str) -> bool:
    return docker("image", "inspect", image, check=False).returncode == 0


# In-container process scan used by the kill tests.  Prints "<pid> <cmdline>" for every process
# whose command line (NULs as spaces) equals one of the given argv strings exactly.  Zombies have
# an empty cmdline and never match.  Needs only sh, tr and /proc (busybox and Debian both have them).
def proc_scan_command(*argvs: str) -> str:
    cases = "|".join(f'"{a} "' for a in argvs)
    return (
        "for d in /proc/[0-9]*; do "
        "c=$(tr '\\0' ' ' < \"$d/cmdline\" 2>/dev/null); "
        f'case "$c" in {cases}) echo "${{d#/proc/}} $c";; esac; '
        "done; true"
    )


# ---------------------------------------------------------------------------------------------
# WASM backends

# XDG_CACHE_HOME shared with the Rust suite (tests/suite/wasm.rs): the go-busybox module is
# downloaded once per run.
WASM_XDG_CACHE = Path(os.environ.get("KILNTAINERS_TEST_XDG_CACHE") or REPO / "target" / "tmp" / "xdg-cache")


def wasm_env(kbb: "KBB") -> dict:
    """The environment of a `--backend go_busybox` server: the shared module cache, this
    interpreter's pip to fetch the module with, and a temp dir of the test's own (where
    temporary computers' directories go)."""
    tmp = kbb.dir / "tmp"
    tmp.mkdir(exist_ok=True)
    return {
        "XDG_CACHE_HOME": str(WASM_XDG_CACHE),
        "KILNTAINERS_PYTHON": sys.executable,
        "TMPDIR": str(tmp),
    }


# ---------------------------------------------------------------------------------------------
# results and servers


@dataclass
class ToolResult:
    structured: dict | None
    text: str | None
    is_error: bool
    raw: dict
    elapsed: float

    @property
    def content_texts(self) -> list[str]:
        return [c.get("text") for c in self.raw.get("content", []) if c.get("type") == "text"]

    def ok(self) -> "ToolResult":
        """Assert a successful terminal_execute result and return self."""
        assert not self.is_error, f"unexpected tool error: {self.text!r}"
        assert self.structured is not None, f"no structuredContent: {self.raw}"
        return self

    def __repr__(self) -> str:  # shorter failure output
        return f"ToolResult(is_error={self.is_error}, text={self.text!r:.2000})"


def _to_result(result: Any, elapsed: float) -> ToolResult:
    raw = dump(result)
    content = raw.get("content", [])
    texts = [c.get("text") for c in content if c.get("type") == "text"]
    text = texts[0] if len(texts) == 1 else None
    return ToolResult(
        structured=raw.get("structuredContent"),
        text=text,
        is_error=bool(raw.get("isError", False)),
        raw=raw,
        elapsed=elapsed,
    )


@dataclass
class Server:
    session: ClientSession
    init: dict
    home: Path
    errlog: Path
    pidfile: Path
    rcfile: Path
    kbb: "KBB"
    calls_timeout: float = 120.0

    @property
    def pid(self) -> int:
        text = poll(lambda: self.pidfile.exists() and self.pidfile.read_text().strip(), 10, 0.02)
        assert text, "the shim did not record the server pid"
        return int(text)

    def returncode(self) -> int | None:
        """Exit status of the server process recorded by the shim (negative = killed by signal)."""
        if self.rcfile.exists():
            return int(self.rcfile.read_text().strip())
        return None

    instance_id: str | None = None

    def stderr(self) -> str:
        return self.errlog.read_text(errors="replace") if self.errlog.exists() else ""

    def containers(self) -> list[str]:
        """All containers (any state) created by this server process for temporary computers,
        found by the `kilntainers.instance` label (docs/decisions.md, "Crash recovery")."""
        assert self.instance_id, "the server did not create its instance lock file"
        return sorted(containers_with_label(f"kilntainers.instance={self.instance_id}"))

    def alive(self) -> bool:
        return procfs.alive(self.pid)

    async def call(self, arguments: dict | None, name: str = "terminal_execute", timeout: float | None = None) -> ToolResult:
        start = time.monotonic()
        with anyio.fail_after(timeout or self.calls_timeout):
            result = await self.session.call_tool(name, arguments)
        res = _to_result(result, time.monotonic() - start)
        if res.structured and isinstance(res.structured.get("computer_id"), str):
            self.kbb.track(res.structured["computer_id"], temporary=res.structured.get("temporary"))
        return res

    async def run(self, command: str, **kw: Any) -> ToolResult:
        """terminal_execute with a command; asserts success (not isError)."""
        args = {"command": command, **kw}
        return (await self.call(args)).ok()

    async def list_tools(self) -> list[dict]:
        with anyio.fail_after(30):
            result = await self.session.list_tools()
        return [dump(t) for t in result.tools]


def _leaf_exceptions(group: BaseExceptionGroup) -> list[BaseException]:
    leaves: list[BaseException] = []
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            leaves.extend(_leaf_exceptions(exc))
        else:
            leaves.append(exc)
    return leaves


class KBB:
    """Per-test helper: homes, servers, computer ids, cleanup tracking."""

    def __init__(self, base: Path, name: str):
        self.dir = Path(tempfile.mkdtemp(prefix=re.sub(r"[^A-Za-z0-9_]+", "_", name)[:60] + "-", dir=base))
        self.tracked: dict[str, bool | None] = {}
        self.docker_created: list[str] = []
        self.servers: list[Server] = []
        self.errlogs: list[Path] = []
        self._n = 0
        self.networks_before = server_networks()

    # -- ids ----------------------------------------------------------------------------------
    def new_id(self, name: str) -> str:
        cid = f"{RUN_PREFIX}-{name}"
        assert SLUG_RE.match(cid), cid
        self.track(cid)
        return cid

    def track(self, computer_id: str, temporary: bool | None = None) -> None:
        MADE["ids"].add(computer_id)
        if computer_id not in self.tracked or self.tracked[computer_id] is None:
            self.tracked[computer_id] = temporary

    # -- homes --------------------------------------------------------------------------------
    def home(self) -> Path:
        self._n += 1
        h = self.dir / f"home{self._n}"
        h.mkdir()
        return h

    def instance_locks(self, home: Path) -> list[Path]:
        d = home / STATE_DIR_NAME / "instances"
        return sorted(d.glob("*.lock")) if d.is_dir() else []

    # -- servers ------------------------------------------------------------------------------
    def env(self, home: Path, extra: dict | None = None) -> dict:
        env = {"HOME": str(home), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        # KILNTAINERS_EXEC_HELPER: scripts/test.sh runs the core files again with it "off".
        for key in ("DOCKER_HOST", "DOCKER_TLS_VERIFY", "DOCKER_CERT_PATH", "RUST_LOG", "RUST_BACKTRACE", "KILNTAINERS_EXEC_HELPER"):
            if key in os.environ:
                env[key] = os.environ[key]
        # Keep the process environment of the server predictable.
        env.setdefault("XDG_CACHE_HOME", str(home / ".cache"))
        if extra:
            env.update(extra)
        return env

    @asynccontextmanager
    async def server(
        self,
        *args: str,
        home: Path | None = None,
        env: dict | None = None,
        init_timeout: float = 60.0,
        elicitation: Any = None,
    ) -> AsyncIterator[Server]:
        """A server on stdio with a client session; `elicitation` is the client's elicitation
        callback (declaring the capability), none by default."""
        home = home or self.home()
        self._n += 1
        tag = f"srv{self._n}"
        errlog = self.dir / f"{tag}.stderr"
        pidfile = self.dir / f"{tag}.pid"
        rcfile = self.dir / f"{tag}.rc"
        self.errlogs.append(errlog)
        params = StdioServerParameters(
            command=sys.executable,
            args=["-c", SHIM, str(pidfile), str(rcfile), BIN, *args],
            env=self.env(home, env),
        )
        locks_before = {p.stem for p in self.instance_locks(home)}
        try:
            with open(errlog, "a") as errf:
                async with stdio_client(params, errlog=errf) as (read, write):
                    async with ClientSession(read, write, elicitation_callback=elicitation) as session:
                        with anyio.fail_after(init_timeout):
                            init = await session.initialize()
                        srv = Server(session, dump(init), home, errlog, pidfile, rcfile, self)
                        self.servers.append(srv)
                        # The instance lock file (docs/decisions.md, "Crash recovery") names this process's instance.
                        new = await apoll(lambda: {p.stem for p in self.instance_locks(home)} - locks_before, 5, 0.02)
                        if new and len(new) == 1:
                            srv.instance_id = next(iter(new))
                            MADE["instances"].add(srv.instance_id)
                        yield srv
        except BaseExceptionGroup as group:
            # The SDK's task groups wrap the test's own exception; show it unwrapped.
            leaves = _leaf_exceptions(group)
            if len(leaves) == 1 and not isinstance(
                leaves[0], (asyncio.CancelledError, KeyboardInterrupt, SystemExit, GeneratorExit)
            ):
                raise leaves[0] from None
            raise

    # -- HTTP servers ---------------------------------------------------------------------------
    @asynccontextmanager
    async def http_server(
        self,
        *args: str,
        host: str = "127.0.0.1",
        home: Path | None = None,
        env: dict | None = None,
        ready_timeout: float = 30.0,
        stop_timeout: float = 30.0,
        expect_status: int = 0,
    ) -> AsyncIterator["HttpServer"]:
        """The binary with `--transport http --host <host> --port <free port>`, started under the
        shim; ready once `/healthz` answers.  On exit it gets SIGTERM (unless it already ended) and
        must exit 0 within `stop_timeout` (docs/decisions.md, "Exit codes and diagnostics") unless the body raised;
        a body that kills the server on purpose names the status it expects (`-signal.SIGKILL`)."""
        home = home or self.home()
        srv = None
        for attempt in range(3):
            port = free_port(host)
            self._n += 1
            tag = f"http{self._n}"
            srv = HttpServer(
                kbb=self, host=host, port=port, home=home,
                errlog=self.dir / f"{tag}.stderr", pidfile=self.dir / f"{tag}.pid", rcfile=self.dir / f"{tag}.rc",
            )
            self.errlogs.append(srv.errlog)
            locks_before = {p.stem for p in self.instance_locks(home)}
            argv = [BIN, "--transport", "http", "--host", host, "--port", str(port), *args]
            with open(srv.errlog, "w") as errf:
                srv.proc = subprocess.Popen(
                    [sys.executable, "-c", SHIM, str(srv.pidfile), str(srv.rcfile), *argv],
                    stdin=subprocess.DEVNULL, stdout=errf, stderr=errf, env=self.env(home, env),
                )
            self.servers.append(srv)  # type: ignore[arg-type]  # cleanup() only reads .pidfile
            ready = await apoll(lambda: srv.proc.poll() is not None or srv.healthy(), ready_timeout, 0.05)
            if srv.proc.poll() is not None:
                srv.proc.wait()
                if "Cannot listen on" in srv.stderr() and attempt < 2:
                    continue  # the free port was taken in between: try another one
                raise AssertionError(f"HTTP server exited at startup (status {srv.returncode()}):\n{srv.stderr()}")
            if not ready:
                srv.kill()
                raise AssertionError(f"/healthz did not answer within {ready_timeout} s:\n{srv.stderr()}")
            new = await apoll(lambda: {p.stem for p in self.instance_locks(home)} - locks_before, 5, 0.02)
            if new and len(new) == 1:
                srv.instance_id = next(iter(new))
                MADE["instances"].add(srv.instance_id)
            break
        assert srv is not None
        try:
            yield srv
        except BaseException:
            await srv.stop(stop_timeout)
            raise
        rc = await srv.stop(stop_timeout)
        assert rc == expect_status, f"HTTP server exit status after SIGTERM: {rc}\n{srv.stderr()[-4000:]}"

    @asynccontextmanager
    async def http_session(
        self,
        server: "HttpServer",
        *,
        headers: dict | None = None,
        terminate_on_close: bool = True,
        init_timeout: float = 60.0,
    ) -> AsyncIterator["HttpSession"]:
        """An MCP session over Streamable HTTP with the SDK's client.  Every HTTP response the
        SDK receives is recorded in `.responses` as (method, status, mcp-session-id sent).
        Without an `Authorization` in `headers`, the server's generated token is sent."""
        responses: list[tuple[str, int, str | None]] = []
        headers = dict(headers or {})
        if not any(name.lower() == "authorization" for name in headers):
            headers.update(server.auth())

        issued: list[str] = []
        opened = False

        async def record(response) -> None:
            request = response.request
            responses.append((request.method, response.status_code, request.headers.get("mcp-session-id")))
            if response.headers.get("mcp-session-id"):
                issued.append(response.headers["mcp-session-id"])

        client = sdk_httpx.AsyncClient(
            headers=headers,
            timeout=sdk_httpx.Timeout(30.0, read=300.0),
            event_hooks={"response": [record]},
        )
        try:
            async with client:
                async with streamable_http_client(
                    server.mcp_url, http_client=client, terminate_on_close=terminate_on_close
                ) as streams:
                    # 1.x yields (read, write, get_session_id); 2.x yields (read, write).
                    read, write = streams[0], streams[1]
                    async with ClientSession(read, write) as session:
                        with anyio.fail_after(init_timeout):
                            init = await session.initialize()
                        session_id = streams[2]() if len(streams) > 2 else (issued[0] if issued else None)
                        sess = HttpSession(
                            session, dump(init), server.home, server.errlog, server.pidfile, server.rcfile, self,
                            instance_id=server.instance_id, session_id=session_id, responses=responses,
                        )
                        opened = True
                        yield sess
        except BaseExceptionGroup as group:
            if not opened and (status := _refusal(responses)):
                raise HttpRefused(status) from None
            leaves = _leaf_exceptions(group)
            if len(leaves) == 1 and not isinstance(
                leaves[0], (asyncio.CancelledError, KeyboardInterrupt, SystemExit, GeneratorExit)
            ):
                raise leaves[0] from None
            raise
        except Exception:
            if not opened and (status := _refusal(responses)):
                raise HttpRefused(status) from None
            raise

    # -- docker ---------------------------------------------------------------------------------
    def python_style_container(self, computer_id: str, image: str, *, temporary: str = "false", start: bool = True,
                               extra_labels: dict | None = None) -> str:
        """A container labelled exactly like the Python reference 0.2.3 creates them."""
        labels = {
            "kilntainers": "true",
            "kilntainers.computer-id": computer_id,
            "kilntainers.temporary": temporary,
            "kilntainers.image": image,
        }
        labels.update(extra_labels or {})
        label_args = [a for k, v in labels.items() for a in ("--label", f"{k}={v}")]
        verb = ["run", "-d"] if start else ["create"]
        cid = docker(*verb, "--name", f"kilntainer-{computer_id}", *label_args, image, "tail", "-f", "/dev/null").stdout.strip()
        self.docker_created.append(cid)
        self.track(computer_id)
        return cid

    # -- teardown -------------------------------------------------------------------------------
    def cleanup(self, check_leaks: bool) -> list[str]:
        problems: list[str] = []
        # Servers must be gone once their context exited.
        for srv in self.servers:
            try:
                pid = int(srv.pidfile.read_text().strip())
            except (OSError, ValueError):
                continue
            if poll(lambda: not procfs.alive(pid), 5, 0.05) is False:
                problems.append(f"server pid {pid} still alive after its client closed")
                try:
                    os.kill(pid, 9)
                except OSError:
                    pass
        temporary_ids = [cid for cid, tmp in self.tracked.items() if tmp is True]
        if check_leaks and temporary_ids:
            deadline = time.monotonic() + 10
            leftovers = temporary_ids
            while leftovers and time.monotonic() < deadline:
                leftovers = [cid for cid in leftovers if containers_for(cid)]
                if leftovers:
                    time.sleep(0.2)
            if leftovers:
                states = []
                for cid in leftovers:
                    for c in containers_for(cid):
                        st = docker("ps", "-a", "--filter", f"id={c}", "--format", "{{.Status}}", check=False).stdout.strip()
                        states.append(f"{cid}: {st or 'gone'}")
                problems.append(f"temporary computers not removed by the server: {states}")
        to_remove = set(self.docker_created)
        for cid in self.tracked:
            to_remove.update(containers_for(cid))
        # The networks this test's containers are on: the only ones its cleanup may remove,
        # since tests on other workers make networks of their own meanwhile.
        own_networks: set[str] = set()
        for container in to_remove:
            info = inspect(container)
            own_networks.update(((info or {}).get("NetworkSettings") or {}).get("Networks") or {})
        force_remove(sorted(to_remove))
        # Checkpoint images of the test's computers (docs/checkpoints.md), once no container
        # runs from them; the suite's leak check fails on any left after that.
        remove_checkpoint_images(set(self.tracked))
        # The networks of principals (docs/auth.md, "Network") stay with permanent computers,
        # which tests remove behind the server's back: the networks left empty then are the
        # harness's to remove. That the server removes them itself is test_network_isolation.py's.
        made = (server_networks() & own_networks) - self.networks_before
        for network in made:
            if not docker("ps", "-aq", "--filter", f"network={network}", check=False).stdout.strip():
                docker("network", "rm", network, check=False)
        return problems


class RawServer:
    """The server driven with hand-written JSON-RPC lines, for the few tests that must control
    stdin EOF exactly (the SDK cannot close stdin while a call is in flight without abandoning
    the call, and mcp 1.x then fails on the late response).  Use as a context manager."""

    def __init__(self, kbb: "KBB", *args: str, home: Path | None = None):
        self.home = home or kbb.home()
        self.errlog = kbb.dir / f"raw{len(kbb.servers)}-{secrets.token_hex(2)}.stderr"
        kbb.errlogs.append(self.errlog)
        self._err = open(self.errlog, "w")
        self.proc = subprocess.Popen(
            [BIN, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, env=kbb.env(self.home)
        )
        self._buf = b""
        self._next_id = 0
        self.kbb = kbb

    def __enter__(self) -> "RawServer":
        result = self.request("initialize", {
            "protocolVersion": "2025-06-18",
            "capabilities": {},
            "clientInfo": {"name": "kbb-raw", "version": "0"},
        })
        assert "result" in result, result
        self.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._err.close()

    def send(self, message: dict) -> None:
        self.proc.stdin.write((json.dumps(message) + "\n").encode())
        self.proc.stdin.flush()

    def send_request(self, method: str, params: dict) -> int:
        self._next_id += 1
        self.send({"jsonrpc": "2.0", "id": self._next_id, "method": method, "params": params})
        return self._next_id

    def read_message(self, timeout: float) -> dict | None:
        import select

        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    return None
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def request(self, method: str, params: dict, timeout: float = 60) -> dict:
        rid = self.send_request(method, params)
        deadline = time.monotonic() + timeout
        while True:
            msg = self.read_message(max(0.0, deadline - time.monotonic()))
            assert msg is not None, f"no response to {method} within {timeout} s"
            if msg.get("id") == rid:
                return msg

    def call(self, arguments: dict) -> dict:
        msg = self.request("tools/call", {"name": "terminal_execute", "arguments": arguments})
        result = msg["result"]
        sc = result.get("structuredContent") or {}
        if isinstance(sc.get("computer_id"), str):
            self.kbb.track(sc["computer_id"], temporary=sc.get("temporary"))
        return result

    def close_stdin(self) -> None:
        self.proc.stdin.close()


# ---------------------------------------------------------------------------------------------
# HTTP transport


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the server refuses --port 0, docs/decisions.md, "Core options")."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class HttpServer:
    """A server started by `KBB.http_server`; `pid` is the server itself (not the shim)."""

    kbb: "KBB"
    host: str
    port: int
    home: Path
    errlog: Path
    pidfile: Path
    rcfile: Path
    proc: subprocess.Popen | None = None
    instance_id: str | None = None

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def mcp_url(self) -> str:
        return self.base_url + "/mcp"

    @property
    def pid(self) -> int:
        text = poll(lambda: self.pidfile.exists() and self.pidfile.read_text().strip(), 10, 0.02)
        assert text, "the shim did not record the server pid"
        return int(text)

    def returncode(self) -> int | None:
        if self.rcfile.exists():
            return int(self.rcfile.read_text().strip())
        return None

    def stderr(self) -> str:
        return self.errlog.read_text(errors="replace") if self.errlog.exists() else ""

    @property
    def token_file(self) -> Path:
        """Where the server writes the access token it generates when none is configured."""
        return self.home / STATE_DIR_NAME / f"http-token-{self.port}"

    @property
    def token(self) -> str | None:
        """The generated access token, or None (a token was given, or the opt-out)."""
        try:
            return self.token_file.read_text()
        except OSError:
            return None

    def auth(self) -> dict:
        """The Authorization header for the generated token ({} when there is none)."""
        token = self.token
        return {"Authorization": f"Bearer {token}"} if token else {}

    def healthy(self) -> bool:
        try:
            return httpx.get(self.base_url + "/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def containers(self) -> list[str]:
        assert self.instance_id, "the server did not create its instance lock file"
        return sorted(containers_with_label(f"kilntainers.instance={self.instance_id}"))

    def signal(self, sig: int = signal.SIGTERM) -> None:
        os.kill(self.pid, sig)

    def kill(self) -> None:
        if self.returncode() is None and procfs.alive(self.pid):
            os.kill(self.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=10)

    async def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM unless already exited; the exit status, or None (then killed) if it hung."""
        if self.proc is None:
            return None
        if self.returncode() is None and self.proc.poll() is None:
            try:
                self.signal(signal.SIGTERM)
            except OSError:
                pass
        # (an exit status of 0 is falsy: poll for "recorded", then read it)
        await apoll(lambda: self.returncode() is not None, timeout, 0.05)
        rc = self.returncode()
        if rc is None:
            self.kill()
            return None
        await apoll(lambda: self.proc.poll() is not None, 10, 0.05)
        self.proc.wait(timeout=5)
        return rc


@dataclass
class HttpSession(Server):
    """An SDK session over Streamable HTTP (`call`/`run` as for stdio servers)."""

    session_id: str | None = None
    responses: list = field(default_factory=list)


class HttpRefused(Exception):
    """The server refused the SDK's Streamable HTTP client before a session opened. Client 1.x
    raises httpx's HTTPStatusError there and 2.x an MCPError without the status; this is the one
    exception tests see from either."""

    def __init__(self, status_code: int):
        super().__init__(f"refused with HTTP {status_code}")
        self.status_code = status_code


def _refusal(responses: list[tuple[str, int, str | None]]) -> int | None:
    """The status of the first refused request in a response log, if any."""
    return next((status for _, status, _ in responses if status >= 400), None)
