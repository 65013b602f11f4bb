"""A local fake of the Fly.io Machines REST API subset the `fly` backend uses, plus the one
GraphQL organization query.  Standard library only, so both the Python black-box tests (in
process, `FakeFly().start()`) and the Rust contract tests (as a child process,
`python -m fakes.fly --port-file F` from the repository root) can run it.

Written from Fly's published API documentation (the Machines and Apps resource pages, "Working
with the Machines API") and checked against Fly's official Machines OpenAPI document
(`tests/provider-definitions/fly/openapi.json`, through `fakes/definitions.py`): every request's
body and query, and every answer this fake gives, must match it strictly, or it is a violation.
Beyond the document:

* every call needs `Authorization: Bearer <token>` or `FlyV1 <macaroons>` matching one of the
  configured header values, else 401 `{"error": ...}`;
* bodies must be JSON objects with `Content-Type: application/json`; unknown or mistyped fields
  of the documented objects are rejected with 400 and recorded as *violations* (tests assert
  there are none), so a typo in our client cannot pass silently;
* `POST /v1/apps` must carry `?wait=true` (as Fly's own client sends it; the document does not
  declare it) and an `idempotency_key`; the same key and name give the first app back;
* the organization lookup must use the top-level GraphQL `organizations`, not `viewer`;
* `wait` accepts `state` in started/stopped/suspended/destroyed and `timeout` 1..60 (Fly's proxy
  clamps at 60 s; asking for more is recorded as a violation), needs `version` for `stopped`
  (its deprecated alias `instance_id` is a violation of the document), and when the state is
  not reached in time answers 408, or, for a Machine that never starts, 200 `{"ok": false}`
  as the document describes;
* `exec` answers HTTP 200 with `{stdout, stderr, exit_code, exit_signal}` even when the command
  failed; the deprecated string `cmd` field is a violation;
* faults can be injected per method and path: any status (429 with `Retry-After`, 408, 404,
  5xx, 401), a number of times;
* apps can have secrets: `GET /v1/apps/{app}/secrets` lists their names as the App Secrets
  resource does (`{"secrets": [{"name", "digest", "created_at", "updated_at"}]}`, never
  values), and, as Fly documents, every Machine of the app gets them as environment variables
  at boot (next to the Machine's own `config.env`).

Machines are backed by real local Docker containers (`docker run` with the Machine's
`init.exec` as the command, image `docker.io/library/<x>` mapped to the local image `<x>`), so
exec returns real output and the kill sweep really kills.  Root filesystems follow
`rootfs.persist`: `never` means a start after stop, and a restart, give a fresh container.
Containers are named `fakefly-<run>-<machine id>`, labelled `fakefly=<run>`, and removed by
exact name when the fake stops.

Test-only controls live under `/_fake/` (no auth): `requests`, `violations`, `inject`,
`stuck` (names that never reach `started`), `kill/<machine id>` (the Machine dies), `state`.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

from fakes import definitions
from fakes.child import QuietHandler, arguments, close, listen, serve

# Fly's official Machines API document (tests/provider-definitions/fly/openapi.json): every
# request body and query, and every answer of this fake, is checked against it.
DEFINITION = "fly/openapi.json"

# The organization query of Fly's current GraphQL schema: top-level `organizations`.
ORG_QUERY_FIELDS = ("organizations", "nodes", "slug", "type")

# Documented fields of the objects we accept (Machines resource "config object properties",
# create body parameters, MachineExecRequest).  Anything else is a violation.
CREATE_FIELDS = {"name", "region", "config", "lease_ttl", "skip_launch", "skip_service_registration", "lsvd"}
CONFIG_FIELDS = {
    "image", "auto_destroy", "checks", "dns", "env", "files", "guest", "init", "metadata", "metrics",
    "mounts", "processes", "restart", "schedule", "services", "standbys", "statics", "stop_config",
    "rootfs", "containers",
}
INIT_FIELDS = {"exec", "entrypoint", "cmd", "tty", "kernel_args", "swap_size_mb"}
GUEST_FIELDS = {"cpu_kind", "cpus", "memory_mb", "gpu_kind", "gpus", "kernel_args", "host_dedication_id", "persist_rootfs"}
ROOTFS_FIELDS = {"persist", "size_gb"}
RESTART_FIELDS = {"policy", "max_retries"}
EXEC_FIELDS = {"cmd", "command", "container", "machine", "stdin", "timeout"}
APP_FIELDS = {"name", "org_slug", "network", "enable_subdomains", "idempotency_key"}
# Query parameters Fly's own client sends that its OpenAPI document does not declare:
# `POST /v1/apps?wait=true` (superfly/fly-go, `CreateApp`).
UNDECLARED_QUERY = {("POST", "/v1/apps"): ("wait",)}
WAIT_STATES = {"started", "stopped", "suspended", "destroyed"}


class Reject(Exception):
    def __init__(self, status: int, message: str, violation: bool = False):
        super().__init__(message)
        self.status = status
        self.message = message
        self.violation = violation


def _now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _hex(n: int) -> str:
    return secrets.token_hex(n)


class Machine:
    def __init__(self, app: str, body: dict, run: str):
        self.id = _hex(7)
        self.app = app
        self.name = body.get("name") or f"fake-{_hex(3)}"
        self.region = body.get("region") or "ord"
        self.config = body["config"]
        self.state = "created"
        self.instance_id = _hex(13).upper()
        self.created_at = _now_iso()
        self.updated_at = self.created_at
        self.container = f"fakefly-{run}-{self.id}"
        self.container_exists = False

    @property
    def persist(self) -> str:
        return (self.config.get("rootfs") or {}).get("persist", "never")

    @property
    def image(self) -> str:
        image = self.config["image"]
        for prefix in ("docker.io/library/", "registry-1.docker.io/library/", "docker.io/"):
            if image.startswith(prefix):
                return image[len(prefix):]
        return image

    def view(self) -> dict:
        return {
            "id": self.id,
            "name": self.name,
            "state": self.state,
            "region": self.region,
            "instance_id": self.instance_id,
            "version": self.instance_id,
            "private_ip": "fdaa:0:0:a7b:0:0:0:2",
            "config": self.config,
            "image_ref": {"registry": "docker.io", "repository": self.image.split(":")[0], "tag": "latest"},
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "events": [],
        }


class FakeFly:
    def __init__(self, tokens: list[str] | None = None, orgs: list[dict] | None = None, docker_host: str | None = None):
        self.tokens = set(tokens if tokens is not None else ["Bearer test-token"])
        self.orgs = orgs if orgs is not None else [
            {"slug": "acme", "type": "SHARED"},
            {"slug": "personal", "type": "PERSONAL"},
        ]
        self.run = _hex(3)
        self.lock = threading.Condition()
        self.apps: dict[str, dict] = {}
        self.machines: dict[str, Machine] = {}
        self.requests: list[dict] = []
        self.violations: list[str] = []
        self.injections: list[dict] = []
        self.stuck: set[str] = set()
        self.idempotency: dict[str, dict] = {}
        self.env = dict(os.environ)
        if docker_host:
            self.env["DOCKER_HOST"] = docker_host
        self.server: ThreadingHTTPServer | None = None

    # -- lifecycle of the fake itself ---------------------------------------------------------
    def start(self, port: int = 0) -> "FakeFly":
        self.server = listen(_Handler, port, "fake-fly", fake=self)
        return self

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        close(self.server)
        self.server = None
        with self.lock:
            names = [m.container for m in self.machines.values() if m.container_exists]
            for m in self.machines.values():
                m.container_exists = False
        if names:
            self.docker("rm", "-f", *names, check=False)

    def __enter__(self) -> "FakeFly":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- helpers for tests --------------------------------------------------------------------
    def add_app(self, name: str, org: str = "personal", secrets: dict[str, str] | None = None) -> None:
        with self.lock:
            self.apps[name] = {"id": _hex(8), "name": name, "org": org, "secrets": dict(secrets or {})}

    def live_machines(self, app: str | None = None) -> list[Machine]:
        with self.lock:
            return [m for m in self.machines.values() if m.state != "destroyed" and (app is None or m.app == app)]

    def requests_matching(self, method: str, pattern: str) -> list[dict]:
        rx = re.compile(pattern)
        with self.lock:
            return [r for r in self.requests if r["method"] == method and rx.fullmatch(r["path"])]

    def inject(self, method: str, path: str, status: int, times: int = 1, headers: dict | None = None,
               body: dict | None = None) -> None:
        with self.lock:
            self.injections.append({
                "method": method, "path": path, "status": status, "times": times,
                "headers": headers or {}, "body": body if body is not None else {"error": f"injected {status}"},
            })

    def docker(self, *args: str, check: bool = True, input: bytes | None = None, timeout: float | None = 120):
        proc = subprocess.run(["docker", *args], capture_output=True, input=input, timeout=timeout, env=self.env)
        if check and proc.returncode != 0:
            raise Reject(500, f"docker {args[0]} failed: {proc.stderr.decode(errors='replace').strip()}")
        return proc

    def set_state(self, machine: Machine, state: str) -> None:
        with self.lock:
            machine.state = state
            machine.updated_at = _now_iso()
            self.lock.notify_all()

    # -- container backing --------------------------------------------------------------------
    def boot(self, machine: Machine, fresh: bool) -> None:
        """Runs (or restarts) the Machine's container; then the Machine is `started`."""
        if machine.name in self.stuck:
            self.set_state(machine, "starting")
            return
        self.set_state(machine, "starting")
        try:
            if fresh or not machine.container_exists:
                if machine.container_exists:
                    self.docker("rm", "-f", machine.container, check=False)
                    machine.container_exists = False
                argv = (machine.config.get("init") or {}).get("exec") or []
                args = ["run", "-d", "--name", machine.container, "--label", f"fakefly={self.run}"]
                # Fly injects the app's secrets into every Machine's environment at boot.
                with self.lock:
                    env = dict(machine.config.get("env") or {})
                    env.update(self.apps.get(machine.app, {}).get("secrets") or {})
                for key, value in env.items():
                    args += ["-e", f"{key}={value}"]
                if argv:
                    args += ["--entrypoint", argv[0], machine.image, *argv[1:]]
                else:
                    args += [machine.image]
                self.docker(*args)
                machine.container_exists = True
            else:
                self.docker("start", machine.container)
        except Reject:
            self.set_state(machine, "failed")
            return
        with self.lock:
            machine.instance_id = _hex(13).upper()
        self.set_state(machine, "started")

    def halt(self, machine: Machine, destroy: bool) -> None:
        if machine.container_exists:
            if destroy:
                self.docker("rm", "-f", machine.container, check=False)
                machine.container_exists = False
            else:
                self.docker("stop", "-t", "2", machine.container, check=False)
        if destroy:
            self.set_state(machine, "destroyed")
        elif machine.config.get("auto_destroy"):
            # A Machine with auto_destroy destroys itself once its main process has ended.
            self.docker("rm", "-f", machine.container, check=False)
            machine.container_exists = False
            self.set_state(machine, "destroyed")
        else:
            self.set_state(machine, "stopped")

    # -- request handling ---------------------------------------------------------------------
    def handle(self, method: str, path: str, query: dict, headers: dict, body: bytes) -> tuple[int, dict, object]:
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
        if path != "/graphql":
            self.record_violations(definitions.load(DEFINITION).check_request(
                method, path, {k: v[-1] for k, v in query.items()}, parsed,
                extra_query=UNDECLARED_QUERY.get((method, path), ())))
        with self.lock:
            self.requests.append({
                "method": method, "path": path, "query": {k: v[-1] for k, v in query.items()},
                "authorization": headers.get("authorization"), "body": parsed,
            })
            for rule in self.injections:
                if rule["times"] > 0 and rule["method"] in (method, "*") and re.fullmatch(rule["path"], path):
                    rule["times"] -= 1
                    _INJECTED.flag = True
                    return rule["status"], rule["headers"], rule["body"]
        auth = headers.get("authorization")
        if auth is None:
            raise Reject(401, "missing Authorization header")
        scheme = auth.split(" ", 1)[0]
        if scheme not in ("Bearer", "FlyV1"):
            raise Reject(401, f"unsupported authorization scheme {scheme!r}")
        if auth not in self.tokens:
            raise Reject(401, "token validation error")
        if path == "/graphql":
            return self.graphql(method, parsed)
        parts = [unquote(p) for p in path.strip("/").split("/")]
        if parts[:1] != ["v1"]:
            raise Reject(404, "not found")
        parts = parts[1:]
        if parts == ["apps"] and method == "POST":
            return self.create_app(parsed, query)
        if len(parts) == 2 and parts[0] == "apps" and method == "GET":
            return self.get_app(parts[1])
        if len(parts) == 3 and parts[0] == "apps" and parts[2] == "secrets" and method == "GET":
            return self.list_secrets(parts[1])
        if len(parts) >= 3 and parts[0] == "apps" and parts[2] == "machines":
            return self.machines_route(method, parts[1], parts[3:], query, parsed)
        raise Reject(404, "not found")

    def control(self, method: str, path: str, body: bytes) -> tuple[int, dict, object]:
        data = json.loads(body) if body else {}
        if path == "/_fake/requests":
            with self.lock:
                return 200, {}, list(self.requests)
        if path == "/_fake/violations":
            with self.lock:
                return 200, {}, list(self.violations)
        if path == "/_fake/state":
            with self.lock:
                return 200, {}, {"apps": list(self.apps), "machines": [m.view() for m in self.machines.values()]}
        if path == "/_fake/inject" and method == "POST":
            self.inject(data["method"], data["path"], data["status"], data.get("times", 1), data.get("headers"), data.get("body"))
            return 200, {}, {"ok": True}
        if path == "/_fake/stuck" and method == "POST":
            with self.lock:
                self.stuck.add(data["name"])
            return 200, {}, {"ok": True}
        if path == "/_fake/apps" and method == "POST":
            self.add_app(data["name"], data.get("org", "personal"), data.get("secrets"))
            return 200, {}, {"ok": True}
        m = re.fullmatch(r"/_fake/kill/([0-9a-f]+)", path)
        if m and method == "POST":
            machine = self.find_machine(None, m.group(1))
            self.halt(machine, destroy=False)
            return 200, {}, {"ok": True, "state": machine.state}
        raise Reject(404, "no such control")

    def record_violations(self, found: list[str]) -> None:
        """Violations of the official definition; recorded, and the request still served, so
        one test run reports all of them."""
        if found:
            with self.lock:
                self.violations.extend(f"official definition: {v}" for v in found)

    def violation(self, message: str) -> Reject:
        """A request our client should never send; recorded by the handler."""
        return Reject(400, message, violation=True)

    def check_fields(self, what: str, obj, allowed: set[str]) -> None:
        if not isinstance(obj, dict):
            raise self.violation(f"{what} must be an object")
        unknown = sorted(set(obj) - allowed)
        if unknown:
            raise self.violation(f"{what} has undocumented fields {unknown}")

    def graphql(self, method: str, body) -> tuple[int, dict, object]:
        if method != "POST":
            raise self.violation("GraphQL must be POST")
        self.check_fields("graphql body", body, {"query", "variables", "operationName"})
        query = body.get("query")
        if not isinstance(query, str) or not all(f in query for f in ORG_QUERY_FIELDS):
            raise self.violation(f"unexpected GraphQL query {query!r}")
        if "viewer" in query:
            raise self.violation("viewer { organizations } is deprecated; query the top-level organizations")
        return 200, {}, {"data": {"organizations": {"nodes": self.orgs}}}

    def create_app(self, body, query: dict) -> tuple[int, dict, object]:
        self.check_fields("app create body", body, APP_FIELDS)
        if query.get("wait", [""])[-1] != "true":
            raise self.violation("POST /v1/apps without ?wait=true (Fly's own client waits for the app)")
        name, org, key = body.get("name"), body.get("org_slug"), body.get("idempotency_key")
        if not isinstance(name, str) or not re.fullmatch(r"[a-z0-9][a-z0-9-]{1,61}[a-z0-9]", name or ""):
            raise self.violation(f"invalid app name {name!r}")
        if not isinstance(key, str) or not key:
            raise self.violation("POST /v1/apps without an idempotency_key: a retry could not be told from a conflict")
        if not isinstance(org, str) or not org:
            raise self.violation("org_slug is required")
        if org not in {o["slug"] for o in self.orgs}:
            raise Reject(404, f"organization {org} not found")
        with self.lock:
            earlier = self.idempotency.get(key)
            if earlier is not None:
                # As the definition describes: the same key and name give the first app back,
                # the same key with another name is refused.
                if earlier["name"] != name:
                    raise Reject(422, "idempotency_key was already used for another app name")
                return 201, {}, {"id": earlier["id"], "created_at": earlier["created_at"]}
            if name in self.apps:
                raise Reject(422, "app name already taken")
            app = {"id": _hex(8), "name": name, "org": org, "secrets": {}, "created_at": int(time.time() * 1000)}
            self.idempotency[key] = app
            self.apps[name] = app
        return 201, {}, {"id": app["id"], "created_at": app["created_at"]}

    def get_app(self, name: str) -> tuple[int, dict, object]:
        with self.lock:
            app = self.apps.get(name)
        if app is None:
            raise Reject(404, "app not found")
        return 200, {}, {
            "id": app["id"], "name": name, "status": "deployed",
            "organization": {"name": app["org"], "slug": app["org"]},
        }

    def list_secrets(self, name: str) -> tuple[int, dict, object]:
        with self.lock:
            app = self.apps.get(name)
            if app is None:
                raise Reject(404, "app not found")
            names = sorted(app["secrets"])
        stamp = _now_iso()
        return 200, {}, {"secrets": [
            {"name": n, "digest": _hex(8), "created_at": stamp, "updated_at": stamp} for n in names
        ]}

    def find_machine(self, app: str | None, machine_id: str) -> Machine:
        with self.lock:
            machine = self.machines.get(machine_id)
        if machine is None or (app is not None and machine.app != app) or machine.state == "destroyed":
            raise Reject(404, "machine not found")
        return machine

    def machines_route(self, method: str, app: str, rest: list[str], query: dict, body) -> tuple[int, dict, object]:
        with self.lock:
            if app not in self.apps:
                raise Reject(404, "app not found")
        q = {k: v[-1] for k, v in query.items()}
        if not rest:
            if method == "GET":
                with self.lock:
                    rows = [m for m in self.machines.values() if m.app == app
                            and (m.state != "destroyed" or q.get("include_deleted") == "true")]
                for key, value in q.items():
                    if key.startswith("metadata."):
                        rows = [m for m in rows if (m.config.get("metadata") or {}).get(key[9:]) == value]
                return 200, {}, [m.view() for m in rows]
            if method == "POST":
                return self.create_machine(app, body)
            raise Reject(405, "method not allowed")
        machine = self.find_machine(app, rest[0])
        action = rest[1] if len(rest) > 1 else None
        if action is None and method == "GET":
            return 200, {}, machine.view()
        if action is None and method == "DELETE":
            if machine.state == "started" and q.get("force") != "true":
                raise Reject(412, "unable to destroy machine, not currently stopped")
            self.halt(machine, destroy=True)
            return 200, {}, {"ok": True}
        if action == "wait" and method == "GET":
            return self.wait(machine, q)
        if action == "start" and method == "POST":
            previous = machine.state
            if previous in ("stopped", "created", "suspended", "failed"):
                self.boot(machine, fresh=machine.persist == "never")
            elif previous != "started":
                raise Reject(412, f"machine in state {previous} cannot be started")
            return 200, {}, {"previous_state": previous, "migrated": False, "new_host": ""}
        if action == "stop" and method == "POST":
            if body is not None:
                self.check_fields("stop body", body, {"signal", "timeout"})
            self.halt(machine, destroy=False)
            return 200, {}, {"ok": True}
        if action == "restart" and method == "POST":
            unknown = set(q) - {"timeout", "signal"}
            if unknown:
                raise self.violation(f"restart has undocumented query parameters {sorted(unknown)}")
            if machine.state != "started":
                raise Reject(412, f"machine in state {machine.state} cannot be restarted")
            self.boot(machine, fresh=machine.persist == "never")
            return 200, {}, {"ok": True}
        if action == "metadata" and len(rest) == 3 and method == "POST":
            self.check_fields("metadata body", body, {"value"})
            if not isinstance(body.get("value"), str):
                raise self.violation("metadata value must be a string")
            with self.lock:
                machine.config.setdefault("metadata", {})[rest[2]] = body["value"]
            return 204, {}, None
        if action == "metadata" and len(rest) == 2 and method == "GET":
            return 200, {}, machine.config.get("metadata") or {}
        if action == "exec" and method == "POST":
            return self.exec(machine, body)
        raise Reject(404, "not found")

    def create_machine(self, app: str, body) -> tuple[int, dict, object]:
        self.check_fields("machine create body", body, CREATE_FIELDS)
        config = body.get("config")
        self.check_fields("config", config, CONFIG_FIELDS)
        if not isinstance(config.get("image"), str) or not config["image"]:
            raise self.violation("config.image is required")
        if "init" in config:
            self.check_fields("config.init", config["init"], INIT_FIELDS)
            exec_argv = config["init"].get("exec")
            if exec_argv is not None and not (isinstance(exec_argv, list) and all(isinstance(a, str) for a in exec_argv)):
                raise self.violation("config.init.exec must be an array of strings")
        if "guest" in config:
            guest = config["guest"]
            self.check_fields("config.guest", guest, GUEST_FIELDS)
            if "persist_rootfs" in guest:
                raise self.violation("guest.persist_rootfs is deprecated; use rootfs.persist")
            if guest.get("cpu_kind") not in (None, "shared", "performance"):
                raise self.violation(f"invalid cpu_kind {guest.get('cpu_kind')!r}")
            for key in ("cpus", "memory_mb"):
                if key in guest and (not isinstance(guest[key], int) or guest[key] < 1):
                    raise self.violation(f"guest.{key} must be a positive integer")
            if guest.get("memory_mb", 256) % 256:
                raise self.violation("guest.memory_mb must be a multiple of 256")
        if "rootfs" in config:
            self.check_fields("config.rootfs", config["rootfs"], ROOTFS_FIELDS)
            if config["rootfs"].get("persist") not in (None, "never", "restart", "always"):
                raise self.violation("invalid rootfs.persist")
        if "restart" in config:
            self.check_fields("config.restart", config["restart"], RESTART_FIELDS)
            if config["restart"].get("policy") not in ("no", "always", "on-failure"):
                raise self.violation("invalid restart.policy")
        if "auto_destroy" in config and not isinstance(config["auto_destroy"], bool):
            raise self.violation("auto_destroy must be a boolean")
        metadata = config.get("metadata", {})
        if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise self.violation("metadata must map strings to strings")
        name = body.get("name")
        if name is not None and not isinstance(name, str):
            raise self.violation("name must be a string")
        local = Machine(app, body, self.run)
        if self.docker("image", "inspect", local.image, check=False).returncode != 0:
            raise Reject(422, f"failed to resolve image {config['image']}")
        with self.lock:
            if name and any(m.name == name and m.app == app and m.state != "destroyed" for m in self.machines.values()):
                raise Reject(409, f"a machine named {name} already exists")
            self.machines[local.id] = local
            view = local.view()
        if not body.get("skip_launch"):
            threading.Thread(target=self.boot, args=(local, True), daemon=True).start()
        return 200, {}, view

    def wait(self, machine: Machine, q: dict) -> tuple[int, dict, object]:
        unknown = set(q) - {"state", "timeout", "version", "instance_id", "from_event_id"}
        if unknown:
            raise self.violation(f"wait has undocumented query parameters {sorted(unknown)}")
        state = q.get("state", "started")
        if state not in WAIT_STATES:
            raise self.violation(f"wait state {state!r} is not one of {sorted(WAIT_STATES)}")
        try:
            timeout = int(q.get("timeout", "60"))
        except ValueError:
            raise self.violation("wait timeout must be an integer")
        if not 1 <= timeout <= 60:
            raise self.violation(f"wait timeout {timeout} outside 1..60")
        if state == "stopped" and not (q.get("version") or q.get("instance_id")):
            raise Reject(400, "version is required to wait for stopped")
        if machine.name in self.stuck:
            # Never starts; answer at once instead of holding the test for a minute, the way
            # the current definition describes a wait that ran out: 200 with `ok: false`.
            return 200, {}, {"ok": False, "state": machine.state}
        deadline = time.monotonic() + timeout
        with self.lock:
            while machine.state != state:
                left = deadline - time.monotonic()
                if left <= 0 or machine.state in ("failed",) or (machine.state == "destroyed" and state != "destroyed"):
                    return 408, {}, {"error": f"deadline_exceeded: machine is {machine.state}"}
                self.lock.wait(left)
            version = machine.instance_id
        return 200, {}, {"ok": True, "state": state, "version": version}

    def exec(self, machine: Machine, body) -> tuple[int, dict, object]:
        self.check_fields("exec body", body, EXEC_FIELDS)
        if "cmd" in body:
            raise self.violation("exec uses the deprecated string 'cmd'")
        argv = body.get("command")
        if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
            raise self.violation("exec command must be a non-empty array of strings")
        stdin = body.get("stdin")
        if stdin is not None and not isinstance(stdin, str):
            raise self.violation("exec stdin must be a string")
        timeout = body.get("timeout")
        if timeout is not None and (not isinstance(timeout, int) or timeout < 0):
            raise self.violation("exec timeout must be a non-negative integer")
        if machine.state != "started":
            raise Reject(412, f"machine is {machine.state}, not started")
        args = ["exec"] + (["-i"] if stdin is not None else []) + [machine.container, *argv]
        try:
            proc = self.docker(*args, check=False, input=stdin.encode() if stdin is not None else None,
                               timeout=timeout or None)
        except subprocess.TimeoutExpired:
            return 408, {}, {"error": "deadline_exceeded: command timed out"}
        if proc.returncode in (125,) and b"is not running" in proc.stderr:
            raise Reject(412, "machine is not running")
        code = proc.returncode
        signal_number = 0
        if code < 0:
            signal_number, code = -code, -1
        return 200, {}, {
            "stdout": proc.stdout.decode("utf-8", errors="replace"),
            "stderr": proc.stderr.decode("utf-8", errors="replace"),
            "exit_code": code,
            "exit_signal": signal_number,
        }


# Set while a request is answered by an injected fault: such answers are the test's own words,
# not the fake's, and are not checked against the definition.
_INJECTED = threading.local()


class _Handler(QuietHandler):
    fake: FakeFly

    def answer(self, method: str) -> None:
        split = urlsplit(self.path)
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length) if length else b""
        headers = {k.lower(): v for k, v in self.headers.items()}
        _INJECTED.flag = False
        try:
            status, extra, payload = self.fake.handle(method, split.path, parse_qs(split.query), headers, body)
        except Reject as reject:
            status, extra, payload = reject.status, {}, {"error": reject.message}
            if reject.violation:
                with self.fake.lock:
                    self.fake.violations.append(f"{method} {split.path}: {reject.message}")
        except Exception as error:  # a bug in the fake: report it loudly
            status, extra, payload = 500, {}, {"error": f"fake failure: {error!r}"}
            with self.fake.lock:
                self.fake.violations.append(f"fake failure on {method} {split.path}: {error!r}")
        if not split.path.startswith("/_fake/") and split.path != "/graphql" and not _INJECTED.flag:
            self.fake.record_violations(
                definitions.load(DEFINITION).check_answer(method, split.path, status, payload))
        data = b"" if payload is None else json.dumps(payload).encode()
        try:
            self.send_response(status)
            if payload is not None:
                self.send_header("Content-Type", "application/json")
            for key, value in extra.items():
                self.send_header(key, str(value))
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (timeout or cancel); nothing to tell it


def main() -> int:
    parser = arguments(__doc__, "the port")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--token", action="append", default=None,
                        help="an accepted Authorization header value, e.g. 'Bearer x' (repeatable)")
    parser.add_argument("--app", action="append", default=[], help="an app that exists from the start")
    parser.add_argument("--app-secret", action="append", default=[],
                        help="APP:NAME=VALUE, a secret of an app given with --app (repeatable)")
    parser.add_argument("--orgs", default=None, help="JSON list of {slug, type} organizations")
    options = parser.parse_args()
    fake = FakeFly(tokens=options.token, orgs=json.loads(options.orgs) if options.orgs else None)
    secrets_of: dict[str, dict[str, str]] = {}
    for entry in options.app_secret:
        app, _, pair = entry.partition(":")
        key, _, value = pair.partition("=")
        secrets_of.setdefault(app, {})[key] = value
    for app in options.app:
        fake.add_app(app, secrets=secrets_of.get(app))
    fake.start(options.port)
    return serve(fake, options.port_file, str(fake.server.server_address[1]))


if __name__ == "__main__":
    sys.exit(main())
