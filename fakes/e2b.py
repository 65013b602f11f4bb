"""A local fake of the E2B control-plane REST API and of envd's process service, for the `e2b`
backend's contract tests.  Standard library only, so the Python black-box tests (in process,
`FakeE2B().start()`) and the Rust contract tests (child process, `python -m fakes.e2b
--port-file F` from the repository root) can both run it.

Written from E2B's published definitions, not from our client:

* the control plane follows the OpenAPI document (`spec/openapi.yml`: `NewSandbox`, `Sandbox`,
  `ListedSandbox`, `SandboxDetail`, `ConnectSandbox`, `Error`, the `/sandboxes`,
  `/v2/sandboxes`, `/sandboxes/{sandboxID}[/connect|/timeout|/pause|/resume]` paths): every call
  needs `X-API-Key` (401 `{code, message}` otherwise; a bearer `Authorization` header is
  recorded as a violation, E2B deprecates it); unknown or mistyped body fields are rejected with
  400 and recorded as *violations* (tests assert there are none); `timeout` omitted on create is
  a violation (E2B would give the sandbox 15 s); the deprecated `GET /sandboxes` and
  `POST .../resume` are violations; `GET /v2/sandboxes` takes `metadata` (a URL-encoded
  `k=v&k=v` query whose keys and values are URL-encoded themselves), `state` (comma-separated,
  `explode: false`), `limit` (1..100) and `nextToken`, and pages with the `X-Next-Token` header;
  sandboxes expire at their timeout (paused ones do not); `connect` resumes a paused sandbox
  (201) or extends a running one's lifetime, never shortening it (200);
  `POST /sandboxes/{sandboxID}/snapshots` (`SandboxSnapshotRequest` → 201 `SnapshotInfo`)
  commits the sandbox's container (`docker commit --pause`: the filesystem only) into a snapshot
  template `<id>:default` that `POST /sandboxes` takes as `templateID` (with or without the tag);
  `GET /snapshots` lists them (`sandboxID`, `name`, `limit`, `nextToken`); `DELETE
  /templates/{templateID}` deletes one (204; the image goes once no container runs from it);
* envd follows `process.proto` (package `process`, service `Process`) over the Connect
  protocol with the JSON codec: `Start` is server-streaming (`application/connect+json`, one
  request envelope `[flags][u32 BE length][JSON]`, answer envelopes of `{event: {start|data|end|
  keepalive}}` and a final end-of-stream envelope with flag 0x02 and `{}` or `{error: {code,
  message}}`); `SendInput`, `CloseStdin`, `SendSignal` are unary `application/json`.  Answers use
  proto3-JSON: lowerCamelCase, bytes as base64, default values omitted — an exit code of 0 is
  *not sent*, `exited: false` is not sent.  Requests must carry `Connect-Protocol-Version: 1`,
  the sandbox's `X-Access-Token`, and name the sandbox by `E2b-Sandbox-Id` (or a
  `49983-<id>.<domain>` Host); unknown fields are violations.  Our own contract also wants
  `Connect-Timeout-Ms` on `Start`; its absence is a violation too.  A missing working
  directory or executable is a `Start` error, as envd's `exec.Cmd` would report it.

Sandboxes are real local Docker containers (template `base` = `sandbox-busybox:full` unless
configured), so commands return real output, signals really kill, and pause really freezes
(`docker pause`).  Containers are named `fakee2b-<run>-<sandbox id>`, labelled `fakee2b=<run>`,
and removed by exact name when the fake stops.

Test-only controls live under `/_fake/` on the API port (no auth): `requests`, `violations`,
`state`, `inject` (any status for a method + path regex, a number of times), `kill/<id>` (the
sandbox disappears, as if it died), `expire/<id>` (its lifetime ends now).
"""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import socket
import stat as statmod
import struct
import subprocess
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

from fakes import definitions
from fakes.child import QuietHandler, arguments, close, listen, serve

# E2B's official definitions (tests/provider-definitions/e2b/): every control-plane request and
# answer is checked against the OpenAPI document, and envd's `/files` against envd.yaml.
API_DEFINITION = "e2b/openapi.yml"
ENVD_DEFINITION = "e2b/envd/envd.yaml"
# envd's Connect services: requests and answers (proto3-JSON) against the official .proto files.
PROCESS_PROTO = "e2b/envd/process/process.proto"
FILESYSTEM_PROTO = "e2b/envd/filesystem/filesystem.proto"

ENVD_PORT = 49983
# The envd release the fake claims by default: the oldest one with everything it serves
# (`stdin` on Start: 0.3.0, the default user: 0.4.0, CloseStdin: 0.5.2). `--envd-version`
# makes it claim, and behave like, an older one.
ENVD_VERSION = "0.5.2"
NEW_SANDBOX_FIELDS = {"templateID", "timeout", "autoPause", "secure", "allow_internet_access", "network",
                      "metadata", "envVars", "mcp"}
START_FIELDS = {"process", "pty", "tag", "stdin"}
# filesystem.proto: the request fields of each unary call this fake serves.
FS_FIELDS = {"Stat": {"path"}, "ListDir": {"path", "depth"}, "MakeDir": {"path"},
             "Move": {"source", "destination"}, "Remove": {"path"}}
# envd.yaml: the query parameters of GET and POST /files.
FILES_PARAMS = {"path", "username", "signature", "signature_expiration"}
# Runs inside the container for the filesystem service: `info` prints one entry as
# `<raw mode hex>|<size>|<mtime>|<owner>|<group>|<target raw mode hex>|<target>|<path>` from
# lstat, with the symlink's resolved target (when it exists) as envd's entryInfo reports it.
FS_SCRIPT = r"""
info() {
  l=$(stat -c '%f|%s|%Y|%U|%G' -- "$1" 2>/dev/null) || return 0
  t=; tf=
  if [ -L "$1" ] && [ -e "$1" ]; then t=$(readlink -f -- "$1"); tf=$(stat -L -c '%f' -- "$1"); fi
  printf '%s|%s|%s|%s\n' "$l" "$tf" "$t" "$1"
}
op=$1; shift
case $op in
stat)
  if [ ! -e "$1" ] && [ ! -L "$1" ]; then echo missing; exit 0; fi
  echo ok; info "$1";;
list)
  if [ ! -e "$1" ]; then echo missing; exit 0; fi
  if [ ! -d "$1" ]; then echo notdir; exit 0; fi
  echo ok
  find "$1" -mindepth 1 -maxdepth "$2" 2>/dev/null | while IFS= read -r p; do info "$p"; done;;
mkdir)
  if [ -d "$1" ]; then echo exists; exit 0; fi
  if [ -e "$1" ] || [ -L "$1" ]; then echo notdir; exit 0; fi
  mkdir -p -- "$1" 2>/dev/null || { echo failed; exit 0; }
  echo ok; info "$1";;
move)
  if [ ! -e "$1" ] && [ ! -L "$1" ]; then echo missing; exit 0; fi
  if [ -d "$2" ] && [ ! -L "$2" ]; then echo isdir; exit 0; fi
  mkdir -p -- "$(dirname -- "$2")" 2>/dev/null
  if [ -L "$2" ]; then rm -f -- "$2"; fi
  mv -f -T -- "$1" "$2" 2>/dev/null || { echo failed; exit 0; }
  echo ok; info "$2";;
remove)
  rm -rf -- "$1" 2>/dev/null || { echo failed; exit 0; }
  echo ok;;
download)
  if [ -d "$1" ]; then exit 3; fi
  if [ ! -e "$1" ]; then exit 2; fi
  exec cat -- "$1";;
upload)
  mkdir -p -- "$(dirname -- "$1")" 2>/dev/null || exit 4
  if [ -d "$1" ]; then exit 3; fi
  cat > "$1" 2>/dev/null || exit 5;;
esac
"""
PROCESS_FIELDS = {"cmd", "args", "envs", "cwd"}
SIGNALS = {"SIGNAL_SIGTERM": 15, "SIGNAL_SIGKILL": 9, 15: 15, 9: 9}
LIST_PARAMS = {"metadata", "state", "limit", "nextToken"}
SNAPSHOT_LIST_PARAMS = {"sandboxID", "name", "limit", "nextToken"}
STATES = {"running", "paused"}
KEEP_ALIVE = "trap 'exit 0' TERM INT HUP; while :; do sleep 3600 & wait $!; done"
# How the fake starts a command inside the container: it reports the pid (or why the command
# cannot start, like envd's exec.Cmd.Start would), then becomes the command.
LAUNCHER = (
    'if [ -n "$1" ]; then cd -- "$1" 2>/dev/null || { echo "E2BFAKE chdir $1: no such file or directory"; exit 0; }; fi; '
    'case "$2" in */*) [ -x "$2" ] ;; *) command -v -- "$2" >/dev/null 2>&1 ;; esac '
    '|| { echo "E2BFAKE exec: \\"$2\\": executable file not found in $PATH"; exit 0; }; '
    'echo "E2BFAKE pid $$"; shift; exec "$@"'
)


class Reject(Exception):
    def __init__(self, status: int, message: str, violation: bool = False, connect_code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.violation = violation
        self.connect_code = connect_code


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def envelope(flags: int, payload: dict) -> bytes:
    data = json.dumps(payload, separators=(",", ":")).encode()
    return struct.pack(">BI", flags, len(data)) + data


class Process:
    def __init__(self, popen: subprocess.Popen, pid: int, has_stdin: bool):
        self.popen = popen
        self.pid = pid
        self.has_stdin = has_stdin
        self.lock = threading.Lock()


class Sandbox:
    def __init__(self, body: dict, image: str, run: str, domain: str | None, envd_version: str):
        self.id = "i" + secrets.token_hex(10)
        self.envd_version = envd_version
        self.template = body["templateID"]
        self.image = image
        self.metadata = dict(body.get("metadata") or {})
        self.env_vars = dict(body.get("envVars") or {})
        self.secure = bool(body.get("secure"))
        self.internet = body.get("allow_internet_access", True)
        # `SandboxNetworkConfig` as sent (egress rules); E2B enforces it, this fake only keeps
        # it and shows it in the sandbox's detail, as E2B's `GET /sandboxes/{id}` does.
        self.network = body.get("network")
        self.token = secrets.token_hex(16) if self.secure else None
        self.started = time.time()
        self.end = self.started + body["timeout"]
        self.state = "running"
        self.domain = domain
        self.container = f"fakee2b-{run}-{self.id}"
        self.processes: dict[int, Process] = {}

    def sandbox_view(self) -> dict:
        view = {"templateID": self.template, "sandboxID": self.id, "clientID": "6532622b",
                "envdVersion": self.envd_version, "domain": self.domain}
        if self.token is not None:
            view["envdAccessToken"] = self.token
        return view

    def listed_view(self) -> dict:
        return {"templateID": self.template, "alias": self.template, "sandboxID": self.id, "clientID": "6532622b",
                "startedAt": _iso(self.started), "endAt": _iso(self.end), "cpuCount": 2, "memoryMB": 512,
                "diskSizeMB": 1024, "metadata": dict(self.metadata), "state": self.state,
                "envdVersion": self.envd_version}


class FakeE2B:
    def __init__(self, api_keys: list[str] | None = None, templates: dict | None = None, page_size: int = 100,
                 pause: bool = True, domain: str | None = None, keepalive: float = 0.5,
                 envd_version: str = ENVD_VERSION):
        self.api_keys = set(api_keys if api_keys is not None else ["e2b_test_key"])
        self.templates = templates if templates is not None else {"base": "sandbox-busybox:full"}
        self.page_size = page_size
        self.pause_supported = pause
        self.domain = domain
        self.keepalive = keepalive
        self.envd_version = envd_version
        self.envd = tuple(int(p) for p in envd_version.split("."))
        self.run = secrets.token_hex(3)
        self.lock = threading.RLock()
        self.sandboxes: dict[str, Sandbox] = {}
        self.requests: list[dict] = []
        self.violations: list[str] = []
        self.injections: list[dict] = []
        self.servers: list[ThreadingHTTPServer] = []
        self.stopping = threading.Event()
        # Snapshot templates: template id -> {"image", "sandbox", "names"}.
        self.snapshots: dict[str, dict] = {}
        # Images of deleted snapshots that a container still ran from; removed at the end.
        self.leftover_images: list[str] = []

    # -- lifecycle of the fake itself ---------------------------------------------------------
    def start(self, api_port: int = 0, envd_port: int = 0) -> "FakeE2B":
        for plane, port in (("api", api_port), ("envd", envd_port)):
            self.servers.append(listen(_Handler, port, f"fake-e2b-{plane}", fake=self, plane=plane))
        threading.Thread(target=self._expire_loop, name="fake-e2b-expiry", daemon=True).start()
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.servers[0].server_address[1]}"

    @property
    def envd_url(self) -> str:
        return f"http://127.0.0.1:{self.servers[1].server_address[1]}"

    def stop(self) -> None:
        self.stopping.set()
        for server in self.servers:
            close(server)
        self.servers = []
        with self.lock:
            names = [s.container for s in self.sandboxes.values()]
            self.sandboxes.clear()
        if names:
            self.docker("rm", "-f", *names, check=False)
        with self.lock:
            images = [s["image"] for s in self.snapshots.values()] + self.leftover_images
            self.snapshots.clear()
            self.leftover_images = []
        if images:
            self.docker("rmi", "-f", *images, check=False)

    def __enter__(self) -> "FakeE2B":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- helpers for tests --------------------------------------------------------------------
    def live(self) -> list[Sandbox]:
        with self.lock:
            return list(self.sandboxes.values())

    def by_computer(self, computer_id: str) -> Sandbox | None:
        rows = [s for s in self.live() if s.metadata.get("kilntainers-computer-id") == computer_id]
        assert len(rows) <= 1, rows
        return rows[0] if rows else None

    def requests_matching(self, method: str, pattern: str) -> list[dict]:
        rx = re.compile(pattern)
        with self.lock:
            return [r for r in self.requests if r["method"] == method and rx.fullmatch(r["path"])]

    def inject(self, method: str, path: str, status: int, times: int = 1, headers: dict | None = None,
               body: dict | None = None) -> None:
        with self.lock:
            self.injections.append({"method": method, "path": path, "status": status, "times": times,
                                    "headers": headers or {},
                                    "body": body if body is not None else {"code": status, "message": f"injected {status}"}})

    def docker(self, *args: str, check: bool = True, input: bytes | None = None, timeout: float | None = 120):
        proc = subprocess.run(["docker", *args], capture_output=True, input=input, timeout=timeout)
        if check and proc.returncode != 0:
            raise Reject(500, f"docker {args[0]} failed: {proc.stderr.decode(errors='replace').strip()}")
        return proc

    def destroy(self, sandbox: Sandbox) -> None:
        with self.lock:
            self.sandboxes.pop(sandbox.id, None)
        self.docker("rm", "-f", sandbox.container, check=False)

    def _expire_loop(self) -> None:
        while not self.stopping.wait(0.2):
            now = time.time()
            for sandbox in self.live():
                if sandbox.state == "running" and sandbox.end <= now:
                    self.destroy(sandbox)

    def record_violations(self, found: list[str]) -> None:
        """Violations of the official definitions; recorded, and the request still served, so
        one test run reports all of them."""
        if found:
            with self.lock:
                self.violations.extend(f"official definition: {v}" for v in found)

    def violation(self, message: str) -> Reject:
        return Reject(400, message, violation=True)

    # -- control plane ------------------------------------------------------------------------
    def handle_api(self, method: str, path: str, query: dict, headers: dict, body: bytes):
        if path.startswith("/_fake/"):
            return self.control(method, path, body)
        parsed = None
        if body:
            if (headers.get("content-type") or "").split(";")[0].strip() != "application/json":
                raise self.violation("request body must be application/json")
            try:
                parsed = json.loads(body)
            except ValueError:
                raise self.violation("request body is not JSON")
        self.record_violations(definitions.load(API_DEFINITION).check_request(
            method, path, {k: v[-1] for k, v in query.items()}, parsed))
        with self.lock:
            self.requests.append({"plane": "api", "method": method, "path": path,
                                  "query": {k: v[-1] for k, v in query.items()},
                                  "api_key": headers.get("x-api-key"), "body": parsed})
            for rule in self.injections:
                if rule["times"] > 0 and rule["method"] in (method, "*") and re.fullmatch(rule["path"], path):
                    rule["times"] -= 1
                    _INJECTED.flag = True
                    return rule["status"], rule["headers"], rule["body"]
        if "authorization" in headers:
            raise self.violation("bearer access tokens are deprecated; use X-API-Key")
        if headers.get("x-api-key") not in self.api_keys:
            raise Reject(401, "Invalid API key, it must start with 'e2b_'")
        parts = [unquote(p) for p in path.strip("/").split("/")]
        if parts == ["v2", "sandboxes"] and method == "GET":
            return self.list_sandboxes(query)
        if parts == ["sandboxes"] and method == "GET":
            raise self.violation("GET /sandboxes is deprecated; use GET /v2/sandboxes")
        if parts == ["sandboxes"] and method == "POST":
            return self.create(parsed)
        if parts == ["snapshots"] and method == "GET":
            return self.list_snapshots(query)
        if len(parts) == 2 and parts[0] == "templates" and method == "DELETE":
            return self.delete_template(parts[1])
        if len(parts) >= 2 and parts[0] == "sandboxes":
            with self.lock:
                sandbox = self.sandboxes.get(parts[1])
            if sandbox is None:
                raise Reject(404, f"sandbox \"{parts[1]}\" doesn't exist or you don't have access to it")
            action = parts[2] if len(parts) > 2 else None
            return self.sandbox_route(method, sandbox, action, parsed)
        raise Reject(404, "not found")

    def control(self, method: str, path: str, body: bytes):
        data = json.loads(body) if body else {}
        if path == "/_fake/requests":
            with self.lock:
                return 200, {}, list(self.requests)
        if path == "/_fake/violations":
            with self.lock:
                return 200, {}, list(self.violations)
        if path == "/_fake/state":
            with self.lock:
                snapshots = {t: dict(v) for t, v in self.snapshots.items()}
            return 200, {}, {"sandboxes": [dict(s.listed_view(), container=s.container) for s in self.live()],
                             "snapshots": snapshots}
        if path == "/_fake/inject" and method == "POST":
            self.inject(data["method"], data["path"], data["status"], data.get("times", 1), data.get("headers"),
                        data.get("body"))
            return 200, {}, {"ok": True}
        m = re.fullmatch(r"/_fake/(kill|expire)/(\w+)", path)
        if m and method == "POST":
            with self.lock:
                sandbox = self.sandboxes.get(m.group(2))
            if sandbox is None:
                raise Reject(404, "no such sandbox")
            if m.group(1) == "kill":
                self.destroy(sandbox)
            else:
                sandbox.end = time.time()
            return 200, {}, {"ok": True}
        raise Reject(404, "no such control")

    def check_fields(self, what: str, body, allowed: set) -> None:
        if not isinstance(body, dict):
            raise self.violation(f"{what} must be a JSON object")
        unknown = set(body) - allowed
        if unknown:
            raise self.violation(f"{what} has undocumented fields {sorted(unknown)}")

    def check_string_map(self, what: str, value) -> None:
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            raise self.violation(f"{what} must map strings to strings")

    def create(self, body):
        self.check_fields("NewSandbox", body, NEW_SANDBOX_FIELDS)
        if not isinstance(body.get("templateID"), str) or not body["templateID"]:
            raise self.violation("templateID is required")
        if "timeout" not in body:
            raise self.violation("timeout omitted: the sandbox would live 15 s")
        if not isinstance(body["timeout"], int) or isinstance(body["timeout"], bool) or body["timeout"] < 0:
            raise self.violation("timeout must be a non-negative integer")
        for key in ("autoPause", "secure", "allow_internet_access"):
            if key in body and not isinstance(body[key], bool):
                raise self.violation(f"{key} must be a boolean")
        for key in ("metadata", "envVars"):
            if key in body:
                self.check_string_map(key, body[key])
        image = self.template_image(body["templateID"])
        if image is None:
            raise Reject(404, f"template '{body['templateID']}' not found")
        sandbox = Sandbox(body, image, self.run, self.domain, self.envd_version)
        args = ["run", "-d", "--name", sandbox.container, "--label", f"fakee2b={self.run}"]
        for key, value in sandbox.env_vars.items():
            args += ["-e", f"{key}={value}"]
        if not sandbox.internet:
            args += ["--network", "none"]
        args += ["--entrypoint", "/bin/sh", image, "-c", KEEP_ALIVE]
        self.docker(*args)
        # The lifetime starts when the sandbox is up, as E2B answers only then.
        sandbox.started = time.time()
        sandbox.end = sandbox.started + body["timeout"]
        with self.lock:
            self.sandboxes[sandbox.id] = sandbox
        return 201, {}, sandbox.sandbox_view()

    def template_image(self, template_id: str) -> str | None:
        """The image of a template, or of a snapshot template named with or without its tag."""
        if template_id in self.templates:
            return self.templates[template_id]
        key = self.snapshot_key(template_id)
        with self.lock:
            return self.snapshots[key]["image"] if key else None

    def snapshot_key(self, reference: str) -> str | None:
        """The snapshot template a reference names: its id or one of its names, with or without
        the tag (and a name with or without the team namespace)."""
        bare = reference.rsplit(":", 1)[0]
        with self.lock:
            if bare in self.snapshots:
                return bare
            for key, snapshot in self.snapshots.items():
                for name in snapshot["names"]:
                    alias = name.rsplit(":", 1)[0]
                    if bare in (alias, alias.split("/", 1)[-1]):
                        return key
        return None

    def snapshot(self, sandbox: Sandbox, body):
        self.check_fields("SandboxSnapshotRequest", body if body is not None else {}, {"name"})
        if body is None:
            raise self.violation("POST /sandboxes/{sandboxID}/snapshots requires a body")
        name = body.get("name")
        if name is not None and (not isinstance(name, str) or not name):
            raise self.violation("name must be a non-empty string")
        template_id = "snap" + secrets.token_hex(8)
        image = f"fakee2b-snapshot-{self.run}:{template_id}"
        self.docker("commit", "--pause=true", sandbox.container, image)
        names = [f"fake-team/{name}:default"] if name else []
        with self.lock:
            self.snapshots[template_id] = {"image": image, "sandbox": sandbox.id, "names": names}
        return 201, {}, self.snapshot_info(template_id)

    def snapshot_info(self, template_id: str) -> dict:
        names = self.snapshots[template_id]["names"]
        return {"snapshotID": names[0] if names else f"{template_id}:default", "names": list(names)}

    def list_snapshots(self, query: dict):
        unknown = set(query) - SNAPSHOT_LIST_PARAMS
        if unknown:
            raise self.violation(f"GET /snapshots has undocumented parameters {sorted(unknown)}")
        q = {k: v[-1] for k, v in query.items()}
        with self.lock:
            rows = sorted(self.snapshots)
            if "sandboxID" in q:
                rows = [t for t in rows if self.snapshots[t]["sandbox"] == q["sandboxID"]]
        if "name" in q:
            key = self.snapshot_key(q["name"])
            rows = [t for t in rows if t == key]
        with self.lock:
            infos = [self.snapshot_info(t) for t in rows if t in self.snapshots]
        limit = int(q.get("limit", 100))
        offset = int(base64.urlsafe_b64decode(q["nextToken"].encode()).decode()) if "nextToken" in q else 0
        headers = {}
        if offset + limit < len(infos):
            headers["X-Next-Token"] = base64.urlsafe_b64encode(str(offset + limit).encode()).decode()
        return 200, headers, infos[offset:offset + limit]

    def delete_template(self, template_id: str):
        key = self.snapshot_key(template_id)
        with self.lock:
            snapshot = self.snapshots.pop(key, None) if key else None
        if snapshot is None:
            # Base templates are not ours to delete; an unknown one is simply not there.
            raise Reject(404, f"template '{template_id}' not found")
        if self.docker("rmi", snapshot["image"], check=False).returncode != 0:
            with self.lock:
                self.leftover_images.append(snapshot["image"])
        return 204, {}, None

    def list_sandboxes(self, query: dict):
        unknown = set(query) - LIST_PARAMS
        if unknown:
            raise self.violation(f"GET /v2/sandboxes has undocumented parameters {sorted(unknown)}")
        q = {k: v[-1] for k, v in query.items()}
        wanted = {}
        if "metadata" in q:
            for pair in q["metadata"].split("&"):
                if "=" not in pair:
                    raise self.violation(f"metadata filter {q['metadata']!r} is not k=v&k=v")
                key, value = pair.split("=", 1)
                wanted[unquote(key)] = unquote(value)
        states = STATES
        if "state" in q:
            states = set(q["state"].split(","))
            if not states <= STATES:
                raise self.violation(f"state {q['state']!r} is not a comma-separated list of {sorted(STATES)}")
        limit = 100
        if "limit" in q:
            try:
                limit = int(q["limit"])
            except ValueError:
                raise self.violation("limit must be an integer")
            if not 1 <= limit <= 100:
                raise self.violation(f"limit {limit} outside 1..100")
        rows = sorted(self.live(), key=lambda s: s.id)
        rows = [s for s in rows if s.state in states and all(s.metadata.get(k) == v for k, v in wanted.items())]
        offset = 0
        if "nextToken" in q:
            try:
                offset = int(base64.urlsafe_b64decode(q["nextToken"].encode()).decode())
            except ValueError:
                raise self.violation("nextToken was not one we issued")
        size = min(limit, self.page_size)
        page = rows[offset:offset + size]
        headers = {}
        if offset + size < len(rows):
            headers["X-Next-Token"] = base64.urlsafe_b64encode(str(offset + size).encode()).decode()
        return 200, headers, [s.listed_view() for s in page]

    def sandbox_route(self, method: str, sandbox: Sandbox, action: str | None, body):
        if action is None and method == "GET":
            detail = sandbox.listed_view()
            if sandbox.network is not None:
                detail["network"] = sandbox.network
            return 200, {}, detail
        if action is None and method == "DELETE":
            self.destroy(sandbox)
            return 204, {}, None
        if action in ("connect", "timeout") and method == "POST":
            self.check_fields(f"{action} body", body if body is not None else {}, {"timeout"})
            timeout = (body or {}).get("timeout")
            if not isinstance(timeout, int) or isinstance(timeout, bool) or timeout < 0:
                raise self.violation(f"{action} needs a non-negative integer timeout")
            if action == "timeout":
                sandbox.end = time.time() + timeout
                return 204, {}, None
            if sandbox.state == "paused":
                self.docker("unpause", sandbox.container)
                sandbox.state = "running"
                sandbox.end = time.time() + timeout
                return 201, {}, sandbox.sandbox_view()
            sandbox.end = max(sandbox.end, time.time() + timeout)
            return 200, {}, sandbox.sandbox_view()
        if action == "pause" and method == "POST":
            if not self.pause_supported:
                raise Reject(501, "pausing is not supported by this service")
            if sandbox.state == "paused":
                raise Reject(409, f"sandbox {sandbox.id} is already paused")
            self.docker("pause", sandbox.container)
            sandbox.state = "paused"
            return 204, {}, None
        if action == "snapshots" and method == "POST":
            return self.snapshot(sandbox, body)
        if action == "resume" and method == "POST":
            raise self.violation("POST /sandboxes/{id}/resume is deprecated; use connect")
        raise Reject(404, "not found")

    # -- envd ---------------------------------------------------------------------------------
    def envd_sandbox(self, headers: dict, connect: bool = True) -> Sandbox:
        sandbox_id = headers.get("e2b-sandbox-id")
        if sandbox_id is None:
            m = re.match(rf"{ENVD_PORT}-(\w+)\.", headers.get("host") or "")
            sandbox_id = m.group(1) if m else None
        elif headers.get("e2b-sandbox-port") not in (None, str(ENVD_PORT)):
            raise Reject(502, f"port {headers.get('e2b-sandbox-port')} is not envd")
        if sandbox_id is None:
            raise Reject(400, "no sandbox named by E2b-Sandbox-Id or Host", violation=True)
        with self.lock:
            sandbox = self.sandboxes.get(sandbox_id)
        if sandbox is None or sandbox.state != "running":
            # What E2B's sandbox proxy answers for a sandbox it cannot route to.
            raise Reject(502, f"The sandbox {sandbox_id} was not found")
        if connect and headers.get("connect-protocol-version") != "1":
            raise Reject(400, "Connect-Protocol-Version: 1 is required", violation=True)
        if sandbox.token is not None and headers.get("x-access-token") != sandbox.token:
            raise Reject(401, "invalid access token", connect_code="unauthenticated")
        auth = headers.get("authorization") or ""
        if self.envd < (0, 4, 0) and not auth.startswith("Basic "):
            # envd before 0.4.0 has no default user: the official SDK names one.
            raise Reject(401, "envd < 0.4.0: name the user in Authorization: Basic <user>:", violation=True)
        return sandbox

    def process(self, sandbox: Sandbox, selector) -> Process:
        self.check_fields("ProcessSelector", selector, {"pid", "tag"})
        pid = selector.get("pid")
        if not isinstance(pid, int) or isinstance(pid, bool):
            raise self.violation("process.pid must be a number")
        with self.lock:
            process = sandbox.processes.get(pid)
        if process is None:
            raise Reject(404, f"process with pid {pid} not found", connect_code="not_found")
        return process

    def unary_request(self, name: str, headers: dict, body: bytes):
        """The sandbox and JSON body of a unary Connect call (process or filesystem service)."""
        sandbox = self.envd_sandbox(headers)
        if (headers.get("content-type") or "").split(";")[0].strip() != "application/json":
            raise self.violation(f"{name} is unary: Content-Type must be application/json")
        try:
            return sandbox, json.loads(body or b"null")
        except ValueError:
            raise self.violation(f"{name} body is not JSON")

    def unary(self, name: str, headers: dict, body: bytes):
        sandbox, req = self.unary_request(name, headers, body)
        self.record_violations(definitions.proto(PROCESS_PROTO).check_request(f"Process/{name}", req))
        with self.lock:
            self.requests.append({"plane": "envd", "method": "POST", "path": f"/process.Process/{name}",
                                  "sandbox": sandbox.id, "body": req})
        if name == "SendInput":
            self.check_fields("SendInputRequest", req, {"process", "input"})
            process = self.process(sandbox, req.get("process"))
            data = req.get("input")
            self.check_fields("ProcessInput", data, {"stdin", "pty"})
            if "stdin" not in data:
                raise self.violation("input.stdin is missing")
            try:
                raw = base64.b64decode(data["stdin"], validate=True)
            except (ValueError, TypeError):
                raise self.violation("input.stdin is not base64")
            if not process.has_stdin or process.popen.stdin is None or process.popen.stdin.closed:
                raise Reject(400, "stdin is not enabled or already closed", connect_code="failed_precondition")
            with process.lock:
                try:
                    process.popen.stdin.write(raw)
                    process.popen.stdin.flush()
                except (BrokenPipeError, ValueError):
                    pass
            return 200, {}, {}
        if name == "CloseStdin" and self.envd < (0, 5, 2):
            raise Reject(404, "CloseStdin is not implemented by envd before 0.5.2", violation=True,
                         connect_code="unimplemented")
        if name == "CloseStdin":
            self.check_fields("CloseStdinRequest", req, {"process"})
            process = self.process(sandbox, req.get("process"))
            with process.lock:
                if process.popen.stdin is not None and not process.popen.stdin.closed:
                    try:
                        process.popen.stdin.close()
                    except BrokenPipeError:
                        pass
            return 200, {}, {}
        if name == "SendSignal":
            self.check_fields("SendSignalRequest", req, {"process", "signal"})
            process = self.process(sandbox, req.get("process"))
            number = SIGNALS.get(req.get("signal"))
            if number is None:
                raise self.violation(f"signal {req.get('signal')!r} is not a Signal enum value")
            self.docker("exec", sandbox.container, "kill", f"-{number}", str(process.pid), check=False)
            return 200, {}, {}
        raise Reject(404, f"procedure {name} is not implemented by this fake", connect_code="unimplemented")

    # -- envd files: filesystem.proto (Connect, unary JSON) and envd.yaml's /files ----------
    def fs_run(self, sandbox: Sandbox, *args: str, input: bytes | None = None):
        argv = ["exec"] + (["-i"] if input is not None else []) + [sandbox.container, "/bin/sh", "-c", FS_SCRIPT,
                                                                   "fs", *args]
        return self.docker(*argv, check=False, input=input)

    @staticmethod
    def go_mode(raw: int) -> str:
        """Go's FileMode.String() of a raw st_mode, as envd puts it in `permissions`."""
        kind = statmod.S_IFMT(raw)
        letters = ""
        letters += "d" if kind == statmod.S_IFDIR else ""
        letters += "L" if kind == statmod.S_IFLNK else ""
        letters += "D" if kind in (statmod.S_IFBLK, statmod.S_IFCHR) else ""
        letters += "p" if kind == statmod.S_IFIFO else ""
        letters += "S" if kind == statmod.S_IFSOCK else ""
        letters += "u" if raw & statmod.S_ISUID else ""
        letters += "g" if raw & statmod.S_ISGID else ""
        letters += "c" if kind == statmod.S_IFCHR else ""
        letters += "t" if raw & statmod.S_ISVTX else ""
        rwx = "".join(c if raw & (1 << (8 - i)) else "-" for i, c in enumerate("rwxrwxrwx"))
        return (letters or "-") + rwx

    def entry_info(self, line: str) -> dict:
        """proto3-JSON EntryInfo as envd's entryInfo builds it (lstat; a symlink's type and mode
        are its target's, unspecified when it dangles), defaults omitted, int64 as a string."""
        raw_hex, size, mtime, owner, group, target_raw, target, path = line.split("|", 7)
        raw = int(raw_hex, 16)
        link = statmod.S_ISLNK(raw)
        kind_raw = (int(target_raw, 16) if target_raw else None) if link else raw
        entry = {"name": os.path.basename(path.rstrip("/")) or "/", "path": path,
                 "permissions": self.go_mode(raw), "owner": owner, "group": group,
                 "modifiedTime": _iso(int(mtime))}
        if kind_raw is not None and statmod.S_ISREG(kind_raw):
            entry["type"] = "FILE_TYPE_FILE"
        elif kind_raw is not None and statmod.S_ISDIR(kind_raw):
            entry["type"] = "FILE_TYPE_DIRECTORY"
        if int(size):
            entry["size"] = size
        if kind_raw is not None and kind_raw & 0o777:
            entry["mode"] = kind_raw & 0o777
        if link and target:
            entry["symlinkTarget"] = target
        return entry

    def fs_answer(self, proc) -> tuple[str, list[dict]]:
        lines = proc.stdout.decode(errors="replace").split("\n")
        status = lines[0].strip()
        return status, [self.entry_info(line) for line in lines[1:] if line]

    def fs_path(self, what: str, value) -> str:
        if not isinstance(value, str):
            raise self.violation(f"{what} must be a string")
        if not value.startswith("/"):
            # envd would resolve it against the user's home; our contract is absolute paths.
            raise self.violation(f"{what} {value!r} is not absolute (our contract)")
        return value

    def filesystem(self, name: str, headers: dict, body: bytes):
        sandbox, req = self.unary_request(name, headers, body)
        self.record_violations(definitions.proto(FILESYSTEM_PROTO).check_request(f"Filesystem/{name}", req))
        if name not in FS_FIELDS:
            raise Reject(404, f"procedure {name} is not implemented by this fake", connect_code="unimplemented")
        self.check_fields(f"{name}Request", req, FS_FIELDS[name])
        with self.lock:
            self.requests.append({"plane": "envd", "method": "POST", "path": f"/filesystem.Filesystem/{name}",
                                  "sandbox": sandbox.id, "body": req})
        if name == "Move":
            source = self.fs_path("source", req.get("source"))
            destination = self.fs_path("destination", req.get("destination"))
            status, entries = self.fs_answer(self.fs_run(sandbox, "move", source, destination))
            if status == "missing":
                raise Reject(500, f"error renaming: rename {source} {destination}: no such file or directory",
                             connect_code="internal")
            if status != "ok" or not entries:
                raise Reject(500, f"error renaming: rename {source} {destination}: {status}",
                             connect_code="internal")
            return 200, {}, {"entry": entries[0]}
        path = self.fs_path("path", req.get("path"))
        if name == "Stat":
            status, entries = self.fs_answer(self.fs_run(sandbox, "stat", path))
            if status == "missing" or not entries:
                raise Reject(404, f"file not found: lstat {path}: no such file or directory", connect_code="not_found")
            return 200, {}, {"entry": entries[0]}
        if name == "ListDir":
            depth = req.get("depth", 0)
            if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
                raise self.violation("depth must be a uint32")
            status, entries = self.fs_answer(self.fs_run(sandbox, "list", path, str(depth or 1)))
            if status == "missing":
                raise Reject(404, f"directory not found: lstat {path}: no such file or directory",
                             connect_code="not_found")
            if status == "notdir":
                raise Reject(400, f"path is not a directory: {path}", connect_code="invalid_argument")
            # envd sorts directories first, then by name, case-insensitively.
            entries.sort(key=lambda e: (e.get("type") != "FILE_TYPE_DIRECTORY", e["name"].lower()))
            return 200, {}, {"entries": entries}
        if name == "MakeDir":
            status, entries = self.fs_answer(self.fs_run(sandbox, "mkdir", path))
            if status == "exists":
                raise Reject(409, f"directory already exists: {path}", connect_code="already_exists")
            if status == "notdir":
                raise Reject(400, f"path already exists but it is not a directory: {path}",
                             connect_code="invalid_argument")
            if status != "ok" or not entries:
                raise Reject(500, f"error creating directory {path}", connect_code="internal")
            return 200, {}, {"entry": entries[0]}
        status, _ = self.fs_answer(self.fs_run(sandbox, "remove", path))
        if status != "ok":
            raise Reject(500, f"error removing file or directory: {path}", connect_code="internal")
        return 200, {}, {}

    def files_query(self, query: dict) -> str:
        unknown = set(query) - FILES_PARAMS
        if unknown:
            raise self.violation(f"/files has undocumented parameters {sorted(unknown)}")
        if "path" not in query:
            raise self.violation("/files without a path (our contract: always an absolute path)")
        path = self.fs_path("path", query["path"][-1])
        username = query.get("username", [None])[-1]
        if username is not None and username != "root":
            raise Reject(401, f"error looking up user '{username}': user: unknown user {username}")
        return path

    def files(self, method: str, headers: dict, query: dict, body: bytes):
        """envd.yaml `/files`: GET downloads (http.ServeContent, so one `Range` is honoured), POST
        uploads `multipart/form-data` with a `file` part, creating the parent directories."""
        sandbox = self.envd_sandbox(headers, connect=False)
        self.record_violations(definitions.load(ENVD_DEFINITION).check_request(
            method, "/files", {k: v[-1] for k, v in query.items()}, None))
        path = self.files_query(query)
        record = {"plane": "envd", "method": method, "path": "/files", "sandbox": sandbox.id,
                  "query": {k: v[-1] for k, v in query.items()}, "headers": {"range": headers.get("range")}}
        if method == "GET":
            with self.lock:
                self.requests.append(record)
            proc = self.fs_run(sandbox, "download", path)
            if proc.returncode == 2:
                raise Reject(404, f"path '{path}' does not exist")
            if proc.returncode == 3:
                raise Reject(400, f"path '{path}' is a directory")
            if proc.returncode != 0:
                raise Reject(500, f"error opening file '{path}': {proc.stderr.decode(errors='replace').strip()}")
            data = proc.stdout
            m = re.fullmatch(r"bytes=(\d+)-(\d*)", headers.get("range") or "")
            if m is None:
                return 200, {"Content-Type": "application/octet-stream", "Accept-Ranges": "bytes"}, data
            start = int(m.group(1))
            end = min(int(m.group(2)) if m.group(2) else len(data) - 1, len(data) - 1)
            if start >= len(data):
                return 416, {"Content-Range": f"bytes */{len(data)}"}, {"code": 416, "message": "invalid range"}
            return 206, {"Content-Type": "application/octet-stream",
                         "Content-Range": f"bytes {start}-{end}/{len(data)}"}, data[start:end + 1]
        content_type = headers.get("content-type") or ""
        m = re.fullmatch(r"multipart/form-data;\s*boundary=\"?([^\";]+)\"?", content_type.strip())
        if m is None:
            raise self.violation(f"POST /files needs multipart/form-data with a boundary, got {content_type!r}")
        parts = self.multipart(body, m.group(1).encode())
        if len(parts) != 1 or parts[0][0] != "file":
            raise self.violation(f"POST /files needs exactly one part named 'file', got {[p[0] for p in parts]}")
        data = parts[0][1]
        record["size"] = len(data)
        with self.lock:
            self.requests.append(record)
        proc = self.fs_run(sandbox, "upload", path, input=data)
        if proc.returncode == 3:
            raise Reject(400, f"path is a directory: {path}")
        if proc.returncode == 4:
            raise Reject(500, f"error ensuring directories: mkdir {os.path.dirname(path)}: not a directory")
        if proc.returncode != 0:
            raise Reject(500, f"error opening file: open {path}: permission denied or read-only")
        return 200, {}, [{"path": path, "name": os.path.basename(path), "type": "file"}]

    def multipart(self, body: bytes, boundary: bytes) -> list[tuple[str, bytes]]:
        delimiter = b"--" + boundary
        if not body.startswith(delimiter):
            raise self.violation("multipart body does not start with its boundary")
        parts = []
        for chunk in body.split(b"\r\n" + delimiter)[0:]:
            chunk = chunk[len(delimiter):] if chunk.startswith(delimiter) else chunk
            if chunk.startswith(b"--"):
                break
            if not chunk.startswith(b"\r\n") or b"\r\n\r\n" not in chunk:
                raise self.violation("multipart part without headers")
            head, data = chunk[2:].split(b"\r\n\r\n", 1)
            name = re.search(rb'name="([^"]*)"', head)
            if name is None or b"content-disposition: form-data" not in head.lower():
                raise self.violation("multipart part without a form-data name")
            parts.append((name.group(1).decode(errors="replace"), data))
        else:
            raise self.violation("multipart body does not end with the closing boundary")
        return parts

    def process_start(self, handler: "_Handler", headers: dict, body: bytes) -> None:
        """Serves process.Process/Start as a Connect server stream."""
        sandbox = self.envd_sandbox(headers)
        if (headers.get("content-type") or "") != "application/connect+json":
            raise self.violation("Start is server-streaming: Content-Type must be application/connect+json")
        deadline_ms = headers.get("connect-timeout-ms")
        if deadline_ms is None or not deadline_ms.isdigit() or len(deadline_ms) > 10:
            raise self.violation("Start needs a Connect-Timeout-Ms header (our contract)")
        if len(body) < 5:
            raise self.violation("Start body is not an envelope")
        flags, length = struct.unpack(">BI", body[:5])
        if flags != 0 or length != len(body) - 5:
            raise self.violation(f"bad request envelope (flags {flags}, length {length}, body {len(body) - 5})")
        try:
            req = json.loads(body[5:])
        except ValueError:
            raise self.violation("Start envelope is not JSON")
        self.record_violations(definitions.proto(PROCESS_PROTO).check_request("Process/Start", req))
        self.check_fields("StartRequest", req, START_FIELDS)
        if "stdin" in req and self.envd < (0, 3, 0):
            raise self.violation("StartRequest.stdin does not exist before envd 0.3.0")
        config = req.get("process")
        self.check_fields("ProcessConfig", config, PROCESS_FIELDS)
        if not isinstance(config.get("cmd"), str) or not config["cmd"]:
            raise self.violation("process.cmd must be a non-empty string")
        args = config.get("args", [])
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise self.violation("process.args must be an array of strings")
        envs = config.get("envs", {})
        self.check_string_map("process.envs", envs)
        cwd = config.get("cwd")
        if cwd is not None and not isinstance(cwd, str):
            raise self.violation("process.cwd must be a string")
        if "pty" in req:
            raise Reject(400, "pty is not supported by this fake", connect_code="unimplemented")
        has_stdin = req.get("stdin", False)
        if not isinstance(has_stdin, bool):
            raise self.violation("stdin must be a boolean")
        with self.lock:
            self.requests.append({"plane": "envd", "method": "POST", "path": "/process.Process/Start",
                                  "sandbox": sandbox.id, "body": req,
                                  "headers": {k: headers.get(k) for k in ("connect-timeout-ms", "keepalive-ping-interval",
                                                                          "e2b-sandbox-id", "e2b-sandbox-port", "authorization")}})
        argv = ["docker", "exec"] + (["-i"] if has_stdin else [])
        for key, value in envs.items():
            argv += ["-e", f"{key}={value}"]
        argv += [sandbox.container, "/bin/sh", "-c", LAUNCHER, "sh", cwd or "", config["cmd"], *args]
        # Unbuffered, so reading the launcher's first line cannot swallow the command's output.
        popen = subprocess.Popen(argv, stdin=subprocess.PIPE if has_stdin else subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)
        first = popen.stdout.readline().decode(errors="replace").strip()
        stream = _Stream(handler)
        stream.begin()
        if not first.startswith("E2BFAKE pid "):
            popen.wait()
            message = first[len("E2BFAKE "):] if first.startswith("E2BFAKE ") else (first or popen.stderr.read().decode(errors="replace").strip())
            stream.send(envelope(2, {"error": {"code": "internal", "message": f"error starting process: {message}"}}))
            stream.finish()
            return
        pid = int(first.split()[-1])
        process = Process(popen, pid, has_stdin)
        with self.lock:
            sandbox.processes[pid] = process
        deadline = time.monotonic() + int(deadline_ms) / 1000
        try:
            self.check_event({"event": {"start": {"pid": pid}}})
            stream.send(envelope(0, {"event": {"start": {"pid": pid}}}))
            done = threading.Event()

            def pump(pipe, name):
                while True:
                    chunk = os.read(pipe.fileno(), 32768)
                    if not chunk:
                        return
                    stream.send(envelope(0, {"event": {"data": {name: base64.b64encode(chunk).decode()}}}))

            pumps = [threading.Thread(target=pump, args=(popen.stdout, "stdout"), daemon=True),
                     threading.Thread(target=pump, args=(popen.stderr, "stderr"), daemon=True)]
            for t in pumps:
                t.start()
            timed_out = False
            while True:
                try:
                    popen.wait(timeout=self.keepalive)
                    break
                except subprocess.TimeoutExpired:
                    pass
                if time.monotonic() >= deadline:
                    timed_out = True
                    self.docker("exec", sandbox.container, "kill", "-9", str(pid), check=False)
                    popen.wait()
                    break
                stream.send(envelope(0, {"event": {"keepalive": {}}}))
            for t in pumps:
                t.join()
            done.set()
            with self.lock:
                gone = sandbox.id not in self.sandboxes
            if gone:
                # The sandbox died under the command: the connection just breaks, no end event.
                stream.abort()
                return
            if timed_out:
                stream.send(envelope(2, {"error": {"code": "deadline_exceeded", "message": "the operation timed out"}}))
            else:
                self.check_event({"event": {"end": self.end_event(popen.returncode)}})
                stream.send(envelope(0, {"event": {"end": self.end_event(popen.returncode)}}))
                stream.send(envelope(2, {}))
            stream.finish()
        except (BrokenPipeError, ConnectionResetError):
            # The client went away; like envd, leave the process to whoever kills it.
            threading.Thread(target=popen.wait, daemon=True).start()
        finally:
            threading.Thread(target=self._forget, args=(sandbox, process), daemon=True).start()

    def check_event(self, message: dict) -> None:
        """A `StartResponse` this fake streams, against process.proto."""
        self.record_violations(definitions.proto(PROCESS_PROTO).check_answer("Process/Start", message))

    def _forget(self, sandbox: Sandbox, process: Process) -> None:
        process.popen.wait()
        with self.lock:
            sandbox.processes.pop(process.pid, None)

    @staticmethod
    def end_event(code: int) -> dict:
        """proto3-JSON of EndEvent as Go's os/exec reports it: defaults omitted."""
        names = {1: "hangup", 2: "interrupt", 9: "killed", 15: "terminated"}
        if code > 128 and code - 128 in names:
            # docker exec reports a signalled process as 128+n; envd would see the signal.
            return {"exitCode": -1, "status": f"signal: {names[code - 128]}"}
        event = {"exited": True, "status": f"exit status {code}"}
        if code != 0:
            event["exitCode"] = code
        return event


class _Stream:
    """A chunked HTTP/1.1 response carrying Connect envelopes, written from several threads."""

    def __init__(self, handler: "_Handler"):
        self.handler = handler
        self.lock = threading.Lock()
        self.broken = False

    def begin(self) -> None:
        h = self.handler
        h.send_response(200)
        h.send_header("Content-Type", "application/connect+json")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        h.wfile.flush()

    def send(self, data: bytes) -> None:
        """Writes one chunk; once the client has gone, output is dropped (the process keeps
        running until someone kills it, and its pipes keep being drained so it never blocks)."""
        with self.lock:
            if self.broken:
                return
            try:
                self.handler.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.handler.wfile.flush()
            except (BrokenPipeError, ConnectionResetError, OSError):
                self.broken = True

    def abort(self) -> None:
        with self.lock:
            self.broken = True
            self.handler.close_connection = True
            try:
                self.handler.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def finish(self) -> None:
        self.send(b"")


# Set while a request is answered by an injected fault: such answers are the test's own words,
# not the fake's, and are not checked against the definition.
_INJECTED = threading.local()


class _Handler(QuietHandler):
    fake: FakeE2B
    plane: str

    def answer(self, method: str) -> None:
        split = urlsplit(self.path)
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length) if length else b""
        headers = {k.lower(): v for k, v in self.headers.items()}
        fake = self.fake
        connect_error = False
        _INJECTED.flag = False
        try:
            if self.plane == "api":
                status, extra, payload = fake.handle_api(method, split.path, parse_qs(split.query), headers, body)
            elif split.path == "/files" and method in ("GET", "POST"):
                status, extra, payload = fake.files(method, headers, parse_qs(split.query), body)
            else:
                connect_error = True
                fs = re.fullmatch(r"/filesystem\.Filesystem/(\w+)", split.path)
                m = re.fullmatch(r"/process\.Process/(\w+)", split.path)
                if method == "POST" and fs:
                    status, extra, payload = fake.filesystem(fs.group(1), headers, body)
                elif method != "POST" or not m:
                    raise Reject(404, f"{method} {split.path} is not an envd procedure", violation=True)
                elif m.group(1) == "Start":
                    fake.process_start(self, headers, body)
                    return
                else:
                    status, extra, payload = fake.unary(m.group(1), headers, body)
        except Reject as reject:
            status, extra = reject.status, {}
            if connect_error and reject.connect_code:
                payload = {"code": reject.connect_code, "message": reject.message}
            elif connect_error and reject.status != 502:
                payload = {"code": "invalid_argument", "message": reject.message}
            else:
                payload = {"code": reject.status, "message": reject.message}
            if reject.violation:
                with fake.lock:
                    fake.violations.append(f"{self.plane} {method} {split.path}: {reject.message}")
        except Exception as error:  # a bug in the fake: report it loudly
            status, extra, payload = 500, {}, {"code": 500, "message": f"fake failure: {error!r}"}
            with fake.lock:
                fake.violations.append(f"fake failure on {method} {split.path}: {error!r}")
        if self.plane == "api" and not split.path.startswith("/_fake/") and not _INJECTED.flag:
            fake.record_violations(definitions.load(API_DEFINITION).check_answer(method, split.path, status, payload))
        elif self.plane == "envd" and split.path == "/files" and not isinstance(payload, bytes):
            fake.record_violations(definitions.load(ENVD_DEFINITION).check_answer(method, split.path, status, payload))
        elif self.plane == "envd" and status == 200 and isinstance(payload, dict):
            rpc = re.fullmatch(r"/(?:process|filesystem)\.(\w+/\w+)", split.path)
            if rpc:
                path = PROCESS_PROTO if split.path.startswith("/process.") else FILESYSTEM_PROTO
                fake.record_violations(definitions.proto(path).check_answer(rpc.group(1), payload))
        raw = isinstance(payload, bytes)
        data = b"" if payload is None else payload if raw else json.dumps(payload).encode()
        try:
            self.send_response(status)
            if payload is not None and not raw:
                self.send_header("Content-Type", "application/json")
            for key, value in extra.items():
                self.send_header(key, str(value))
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass


def main() -> int:
    parser = arguments(__doc__, '{"api": port, "envd": port}')
    parser.add_argument("--api-key", action="append", default=None, help="an accepted X-API-Key (repeatable)")
    parser.add_argument("--template", action="append", default=[], help="NAME=IMAGE (repeatable)")
    parser.add_argument("--page-size", type=int, default=100)
    parser.add_argument("--no-pause", action="store_true", help="answer 501 to pause, as some services do")
    parser.add_argument("--envd-version", default=ENVD_VERSION,
                        help="the envd release sandboxes claim and behave like (below 0.3.0, 0.4.0, 0.5.2)")
    options = parser.parse_args()
    templates = dict(t.split("=", 1) for t in options.template) or None
    fake = FakeE2B(api_keys=options.api_key, templates=templates, page_size=options.page_size,
                   pause=not options.no_pause, envd_version=options.envd_version)
    fake.start()
    ports = {"api": fake.servers[0].server_address[1], "envd": fake.servers[1].server_address[1]}
    return serve(fake, options.port_file, json.dumps(ports))


if __name__ == "__main__":
    sys.exit(main())
