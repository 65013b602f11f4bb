"""A local fake of the Kubernetes API server, for the `kubernetes` backend's tests (issue 37;
docs/kubernetes.md). Standard library only (plus `jsonschema`/`PyYAML` through
`definitions.py`), like the other fakes, so Python tests run it in process
(`FakeKubernetes().start()`) and Rust suites as a child (`python -m fakes.kubernetes
--port-file F`). No real cluster has been reached from this project: this fake and the
published definitions are what the backend is checked against, and the docs say so.

Written from Kubernetes' published definitions, not from our client (the copies and their
sources are in `tests/provider-definitions/kubernetes/`):

* core v1 and authorization v1 follow the OpenAPI v3 documents of release 1.35: every request
  (path, query parameters, body) is checked with `definitions.py` against them, strictly, and
  every JSON answer against the schema its operation documents; what does not match is a
  *violation* (tests require none). Served: `GET /version`, `GET /api/v1/namespaces/{ns}`,
  Pods and PersistentVolumeClaims (create, get, list with `labelSelector` and `watch`, delete;
  a Pod's JSON merge patch may change only its labels and annotations, as for a running Pod,
  and its content type must be one the definition declares for PATCH),
  `POST /apis/authorization.k8s.io/v1/selfsubjectaccessreviews`, and networking v1
  NetworkPolicies (create, get, list, delete; stored, never enforced: the fake has no network
  plugin, so a Pod's traffic is not filtered); failures are `Status` objects
  (`NotFound`, `AlreadyExists`, `Forbidden`, `Invalid`) with the right codes;
* the agent-sandbox CRDs (`agents.x-k8s.io/v1beta1` `Sandbox`; `extensions.agents.x-k8s.io`
  `SandboxTemplate`, `SandboxClaim`, `SandboxWarmPool`) are served when `crds=True`, with their
  discovery documents; a request body is checked against the CRD's `openAPIV3Schema` (unknown
  fields are violations, as under `fieldValidation=Strict`). A Sandbox is backed by a Pod of its
  name (or of its `agents.x-k8s.io/pod-name` annotation) made from `spec.podTemplate`, and PVCs
  `<template>-<sandbox>` (with the template's labels and annotations) from its
  `volumeClaimTemplates`; `operatingMode: Suspended` (merge patch) removes the Pod and keeps the
  PVCs, `Running` makes it again; deleting the Sandbox removes both. A SandboxClaim gets a
  Sandbox of its name from the pod template of its warm pool's SandboxTemplate, whose Pod is
  named `<pool>-<random>` as a Pod adopted from a warm pool keeps its name (the annotation says
  which), with the claim's `additionalPodMetadata`; `status.sandbox.name` names it, and
  deleting the claim deletes its Sandbox. A claim whose warm pool or template is missing stays
  unbound. `shutdownTime` is stored, not acted on;
* `pods/exec` and `pods/portforward` speak the channel protocol over WebSocket (RFC 6455):
  subprotocols `v5.channel.k8s.io` (with the CLOSE message `[255, stream]`) and
  `v4.channel.k8s.io`, chosen in the client's order from one `Sec-WebSocket-Protocol` header;
  binary messages whose first byte is the stream (0 stdin, 1 stdout, 2 stderr, 3 status, 4
  resize); a one-byte message per output stream on connect; the end is a `metav1.Status` on
  stream 3 (`Success`, or `Failure`/`NonZeroExitCode` with an `ExitCode` cause) and a close.
  Port-forward: for the i-th port of `ports`, data on stream 2i and errors on 2i+1, each
  opened by the port number (two bytes, little-endian).

The server sets `TCP_NODELAY` on every connection, as Go's network stack does by default: a
WebSocket's small frames are then not held back by the client's delayed acknowledgement.

Pods are real local Docker containers (`fakek8s-<run>-<namespace>-<pod>`, labelled
`fakek8s=<run>`), so commands really run; a PVC is a Docker volume. Images can be mapped to
local ones (`images`). Everything the fake made is removed by exact name when it stops.

Test-only controls are methods (`requests_matching`, `violations`, `deny`), and over HTTP under
`/_fake/` (no auth): `requests`, `violations`.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import json
import os
import re
import secrets
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from http.server import ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from fakes import definitions
from fakes.child import QuietHandler, arguments, close, listen, serve

CORE = "kubernetes/openapi/api__v1_openapi.json"
AUTHORIZATION = "kubernetes/openapi/apis__authorization.k8s.io__v1_openapi.json"
NETWORKING = "kubernetes/openapi/apis__networking.k8s.io__v1_openapi.json"
CRD_FILES = {
    "sandboxes": "kubernetes/agent-sandbox/crds/agents.x-k8s.io_sandboxes.yaml",
    "sandboxtemplates": "kubernetes/agent-sandbox/crds/extensions.agents.x-k8s.io_sandboxtemplates.yaml",
    "sandboxclaims": "kubernetes/agent-sandbox/crds/extensions.agents.x-k8s.io_sandboxclaims.yaml",
    "sandboxwarmpools": "kubernetes/agent-sandbox/crds/extensions.agents.x-k8s.io_sandboxwarmpools.yaml",
}
CRD_VERSION = "v1beta1"
WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
EXEC_PROTOCOLS = ("v5.channel.k8s.io", "v4.channel.k8s.io")
MAX_FRAME = 16 * 1024 * 1024
STDIN, STDOUT, STDERR, STATUS, RESIZE, CLOSE = 0, 1, 2, 3, 4, 255


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Reject(Exception):
    """An API error: answered as a `metav1.Status`."""

    def __init__(self, code: int, reason: str, message: str, violation: bool = False):
        super().__init__(message)
        self.code, self.reason, self.message, self.violation = code, reason, message, violation


def status(code: int, reason: str, message: str, details: dict | None = None) -> dict:
    out = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
           "reason": reason, "code": code}
    if details:
        out["details"] = details
    return out


# -- CRDs as OpenAPI documents ------------------------------------------------------------------

_LIST_QUERY = ["allowWatchBookmarks", "continue", "fieldSelector", "labelSelector", "limit", "resourceVersion",
               "resourceVersionMatch", "sendInitialEvents", "timeoutSeconds", "watch", "pretty"]
_WRITE_QUERY = ["dryRun", "fieldManager", "fieldValidation", "pretty"]


def _query(names: list[str]) -> list[dict]:
    return [{"name": n, "in": "query", "schema": {"type": "string"}} for n in names]


def crd_definition(plural: str) -> tuple[definitions.Definition, dict]:
    """The CRD of `plural` as an OpenAPI document the checker reads (its collection and item
    paths, the served version's `openAPIV3Schema` as the body), and a few facts about it."""
    import yaml

    crd = yaml.safe_load((definitions.ROOT / CRD_FILES[plural]).read_text())
    spec = crd["spec"]
    version = next(v for v in spec["versions"] if v["name"] == CRD_VERSION)
    schema = version["schema"]["openAPIV3Schema"]
    group = spec["group"]
    base = f"/apis/{group}/{CRD_VERSION}/namespaces/{{namespace}}/{plural}"
    body = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Object"}}}}
    patch = {"content": {"*/*": {"schema": {"type": "object"}}}}
    document = {
        "openapi": "3.0.0",
        "paths": {
            base: {"get": {"parameters": _query(_LIST_QUERY)},
                   "post": {"parameters": _query(_WRITE_QUERY), "requestBody": body}},
            base + "/{name}": {"get": {"parameters": _query(["pretty", "resourceVersion"])},
                               "delete": {"parameters": _query(["dryRun", "gracePeriodSeconds",
                                                                "propagationPolicy", "pretty"])},
                               "patch": {"parameters": _query(_WRITE_QUERY + ["force"]), "requestBody": patch}},
            base + "/{name}/status": {"get": {"parameters": _query(["pretty"])}},
        },
        "components": {"schemas": {"Object": schema}},
    }
    facts = {"group": group, "kind": spec["names"]["kind"], "plural": plural,
             "shortNames": spec["names"].get("shortNames", [])}
    return definitions.Definition(CRD_FILES[plural], document), facts


# -- WebSocket (RFC 6455), server side ----------------------------------------------------------

class WebSocket:
    """Frames on an upgraded connection: binary messages out, unmasking of the client's frames,
    ping/pong and close. One writer lock; `receive` from one thread."""

    def __init__(self, rfile, sock: socket.socket):
        self.rfile, self.sock = rfile, sock
        self.lock = threading.Lock()
        self.closed = False

    def send(self, payload: bytes, opcode: int = 0x2) -> None:
        header = bytes([0x80 | opcode])
        n = len(payload)
        if n < 126:
            header += bytes([n])
        elif n < 1 << 16:
            header += bytes([126]) + struct.pack("!H", n)
        else:
            header += bytes([127]) + struct.pack("!Q", n)
        with self.lock:
            if self.closed and opcode != 0x8:
                return
            try:
                self.sock.sendall(header + payload)
            except OSError:
                self.closed = True

    def close(self, code: int = 1000) -> None:
        if not self.closed:
            self.send(struct.pack("!H", code), opcode=0x8)
            self.closed = True

    def _read(self, n: int) -> bytes:
        try:
            data = self.rfile.read(n)
        except ValueError:
            # The handler closed the connection (its exec ended) while a reader thread still
            # waited here: the end of the stream, not something the client sent.
            raise EOFError from None
        if len(data) < n:
            raise EOFError
        return data

    def receive(self) -> tuple[int, bytes] | None:
        """The next whole message (opcode, payload); None once the client closed. A frame that
        breaks the protocol (unmasked, oversized) raises `ValueError`."""
        try:
            return self._receive()
        except (EOFError, OSError):
            return None

    def _receive(self) -> tuple[int, bytes] | None:
        message, first_opcode = b"", None
        while True:
            b0, b1 = self._read(2)
            fin, opcode = b0 & 0x80, b0 & 0x0F
            if not b1 & 0x80:
                raise ValueError("client frame not masked")
            n = b1 & 0x7F
            if n == 126:
                (n,) = struct.unpack("!H", self._read(2))
            elif n == 127:
                (n,) = struct.unpack("!Q", self._read(8))
            if n > MAX_FRAME:
                raise ValueError("frame too large")
            mask = self._read(4)
            payload = bytes(b ^ mask[i % 4] for i, b in enumerate(self._read(n)))
            if opcode == 0x8:
                self.close()
                return None
            if opcode == 0x9:
                self.send(payload, opcode=0xA)
                continue
            if opcode == 0xA:
                continue
            if opcode != 0x0:
                first_opcode = opcode
            message += payload
            if fin:
                return first_opcode or 0x2, message


def accept_key(key: str) -> str:
    return base64.b64encode(hashlib.sha1((key + WS_GUID).encode()).digest()).decode()


# -- the fake ---------------------------------------------------------------------------------

class FakeKubernetes:
    def __init__(self, namespaces=("default",), tokens=("test-token",), crds: bool = True,
                 images: dict[str, str] | None = None, docker_host: str | None = None):
        self.namespaces = set(namespaces)
        self.tokens = set(tokens)
        self.crds = crds
        self.images = dict(images or {})
        self.run = secrets.token_hex(3)
        self.lock = threading.Condition()
        self.objects: dict[tuple[str, str, str], dict] = {}  # (plural, namespace, name) -> object
        self.events: list[tuple[int, str, str, str, dict]] = []  # (rv, plural, namespace, type, object)
        self.version = 1
        self.requests: list[dict] = []
        self.violation_list: list[str] = []
        self.denied: set[str] = set()  # "verb resource[/subresource]" the caller may not do
        self.volumes: set[str] = set()
        self.env = dict(os.environ)
        if docker_host:
            self.env["DOCKER_HOST"] = docker_host
        self.crd_defs = {plural: crd_definition(plural) for plural in CRD_FILES} if crds else {}
        self.server: ThreadingHTTPServer | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self, port: int = 0) -> FakeKubernetes:
        self.server = listen(_Handler, port, "fake-kubernetes", fake=self)
        return self

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        close(self.server)
        self.server = None
        names = self.docker("ps", "-aq", "--filter", f"label=fakek8s={self.run}", check=False).stdout.split()
        if names:
            self.docker("rm", "-f", *[n.decode() for n in names], check=False)
        with self.lock:
            volumes, self.volumes = sorted(self.volumes), set()
        if volumes:
            self.docker("volume", "rm", "-f", *volumes, check=False)

    def __enter__(self) -> FakeKubernetes:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- for tests ------------------------------------------------------------------------------
    def deny(self, verb: str, resource: str) -> None:
        """SelfSubjectAccessReviews for `verb` on `resource` (e.g. `create pods/exec`) answer
        not allowed, and so do the requests themselves (403)."""
        with self.lock:
            self.denied.add(f"{verb} {resource}")

    def violations(self) -> list[str]:
        with self.lock:
            return list(self.violation_list)

    def requests_matching(self, method: str, pattern: str) -> list[dict]:
        rx = re.compile(pattern)
        with self.lock:
            return [r for r in self.requests if r["method"] == method and rx.fullmatch(r["path"])]

    def container(self, namespace: str, pod: str) -> str:
        return f"fakek8s-{self.run}-{namespace}-{pod}"

    def docker(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        proc = subprocess.run(["docker", *args], capture_output=True, timeout=timeout, env=self.env)
        if check and proc.returncode != 0:
            raise Reject(500, "InternalError", f"docker {args[0]} failed: {proc.stderr.decode(errors='replace').strip()}")
        return proc

    def note_violations(self, found: list[str]) -> None:
        if found:
            with self.lock:
                self.violation_list.extend(found)

    # -- the object store -----------------------------------------------------------------------
    def _bump(self, plural: str, namespace: str, kind: str, obj: dict) -> None:
        """Under the lock: a new resourceVersion for `obj`, an event for watchers."""
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        self.events.append((self.version, plural, namespace, kind, json.loads(json.dumps(obj))))
        del self.events[:-2000]
        self.lock.notify_all()

    def put(self, plural: str, namespace: str, obj: dict, kind: str) -> dict:
        with self.lock:
            self.objects[(plural, namespace, obj["metadata"]["name"])] = obj
            self._bump(plural, namespace, kind, obj)
            return json.loads(json.dumps(obj))

    def get(self, plural: str, namespace: str, name: str) -> dict | None:
        with self.lock:
            obj = self.objects.get((plural, namespace, name))
            return json.loads(json.dumps(obj)) if obj else None

    def remove(self, plural: str, namespace: str, name: str) -> dict | None:
        with self.lock:
            obj = self.objects.pop((plural, namespace, name), None)
            if obj is not None:
                self._bump(plural, namespace, "DELETED", obj)
            return obj

    def listed(self, plural: str, namespace: str, selector: str | None) -> list[dict]:
        with self.lock:
            return [json.loads(json.dumps(o)) for (p, ns, _), o in sorted(self.objects.items())
                    if p == plural and ns == namespace and matches(o, selector)]

    # -- Pods backed by containers --------------------------------------------------------------
    def boot_pod(self, namespace: str, pod: dict) -> None:
        """Runs the Pod's first container as a Docker container; the Pod is then Running."""
        spec = pod["spec"]
        main = spec["containers"][0]
        name = self.container(namespace, pod["metadata"]["name"])
        args = ["run", "-d", "--name", name, "--label", f"fakek8s={self.run}", "--hostname", pod["metadata"]["name"]]
        for env in main.get("env") or []:
            args += ["-e", f"{env['name']}={env.get('value', '')}"]
        if main.get("workingDir"):
            args += ["-w", main["workingDir"]]
        user = (main.get("securityContext") or {}).get("runAsUser", (spec.get("securityContext") or {}).get("runAsUser"))
        if user is not None:
            args += ["--user", str(user)]
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in spec.get("volumes") or []
                  if v.get("persistentVolumeClaim")}
        for mount in main.get("volumeMounts") or []:
            claim = claims.get(mount["name"])
            if claim is None:
                continue
            if self.get("persistentvolumeclaims", namespace, claim) is None:
                raise Reject(422, "Invalid", f'persistentvolumeclaim "{claim}" not found')
            volume = self.volume(namespace, claim)
            args += ["-v", f"{volume}:{mount['mountPath']}"]
        if main.get("command"):
            args += ["--entrypoint", main["command"][0]]
        args.append(self.images.get(main["image"], main["image"]))
        args += list(main.get("command") or [])[1:] + list(main.get("args") or [])
        self.docker(*args)
        ip = self.docker("inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}", name)
        ip = ip.stdout.decode().strip()
        now = _now()
        pod["status"] = {
            "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": "127.0.0.1", "startTime": now,
            "conditions": [{"type": t, "status": "True", "lastTransitionTime": now}
                           for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")],
            "containerStatuses": [{"name": main["name"], "ready": True, "restartCount": 0, "started": True,
                                   "image": main["image"], "imageID": "", "state": {"running": {"startedAt": now}}}],
        }

    def volume(self, namespace: str, claim: str) -> str:
        volume = f"fakek8s-{self.run}-{namespace}-{claim}"
        with self.lock:
            self.volumes.add(volume)
        return volume

    def create_pod(self, namespace: str, pod: dict) -> dict:
        self.fill_metadata(pod, namespace)
        pod.setdefault("apiVersion", "v1")
        pod.setdefault("kind", "Pod")
        name = pod["metadata"]["name"]
        with self.lock:
            if ("pods", namespace, name) in self.objects:
                raise Reject(409, "AlreadyExists", f'pods "{name}" already exists')
        pod["status"] = {"phase": "Pending"}
        self.put("pods", namespace, pod, "ADDED")
        try:
            self.boot_pod(namespace, pod)
        except Reject:
            self.remove("pods", namespace, name)
            raise
        return self.put("pods", namespace, pod, "MODIFIED")

    def patch_pod(self, namespace: str, name: str, patch: dict) -> dict:
        """A JSON merge patch of a Pod (the warm pool's hand-over). As on a real API server, a
        running Pod's labels and annotations may change and nothing else of what this backend
        sets; the result must still be a Pod of the published definition."""
        obj = self.get("pods", namespace, name)
        if obj is None:
            raise Reject(404, "NotFound", f'pods "{name}" not found')
        merged = merge_patch(obj, patch)
        kept = ("labels", "annotations")
        before = {k: v for k, v in obj.items() if k != "metadata"}
        after = {k: v for k, v in merged.items() if k != "metadata"}
        meta_before = {k: v for k, v in obj["metadata"].items() if k not in kept}
        meta_after = {k: v for k, v in merged["metadata"].items() if k not in kept}
        if before != after or meta_before != meta_after:
            raise Reject(422, "Invalid", f'Pod "{name}" is invalid: the fake lets a patch change only labels and '
                                         "annotations")
        core = definitions.load(CORE)
        self.note_violations(core.errors(core.document["components"]["schemas"]["io.k8s.api.core.v1.Pod"], merged,
                                         "PATCH pods result"))
        return self.put("pods", namespace, merged, "MODIFIED")

    def delete_pod(self, namespace: str, name: str) -> dict | None:
        obj = self.remove("pods", namespace, name)
        if obj is not None:
            self.docker("rm", "-f", self.container(namespace, name), check=False)
        return obj

    def fill_metadata(self, obj: dict, namespace: str) -> None:
        meta = obj.setdefault("metadata", {})
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise Reject(422, "Invalid", "metadata.name: Required value: name or generateName is required")
            meta["name"] = meta["generateName"] + secrets.token_hex(3)[:5]
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", meta["name"]) or len(meta["name"]) > 63:
            raise Reject(422, "Invalid", f'metadata.name: Invalid value: "{meta["name"]}": a lowercase RFC 1123 label must '
                                         "consist of lower case alphanumeric characters or '-'")
        meta["namespace"] = namespace
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = _now()

    # -- Sandboxes (agent-sandbox) --------------------------------------------------------------
    def sandbox_pod(self, namespace: str, sandbox: dict) -> None:
        """Makes the Sandbox's PVCs (once) and, in Running mode, its Pod; sets its status."""
        name = sandbox["metadata"]["name"]
        spec = sandbox["spec"]
        template = spec["podTemplate"]
        for vct in spec.get("volumeClaimTemplates") or []:
            claim = f"{vct['metadata']['name']}-{name}"
            if self.get("persistentvolumeclaims", namespace, claim) is None:
                vct_meta = vct.get("metadata") or {}
                pvc = {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                       "metadata": {"name": claim, "labels": dict(vct_meta.get("labels") or {}),
                                    "annotations": dict(vct_meta.get("annotations") or {})},
                       "spec": vct.get("spec") or {}}
                self.fill_metadata(pvc, namespace)
                pvc["status"] = {"phase": "Bound"}
                self.put("persistentvolumeclaims", namespace, pvc, "ADDED")
        pod_spec = json.loads(json.dumps(template["spec"]))
        for vct in spec.get("volumeClaimTemplates") or []:
            volumes = pod_spec.setdefault("volumes", [])
            if not any(v["name"] == vct["metadata"]["name"] for v in volumes):
                volumes.append({"name": vct["metadata"]["name"],
                                "persistentVolumeClaim": {"claimName": f"{vct['metadata']['name']}-{name}"}})
        now = _now()
        pod_name = (sandbox["metadata"].get("annotations") or {}).get("agents.x-k8s.io/pod-name", name)
        if spec.get("operatingMode", "Running") == "Running":
            if self.get("pods", namespace, pod_name) is None:
                meta = template.get("metadata") or {}
                pod = {"apiVersion": "v1", "kind": "Pod",
                       "metadata": {"name": pod_name, "labels": dict(meta.get("labels") or {}),
                                    "annotations": dict(meta.get("annotations") or {})},
                       "spec": pod_spec}
                self.create_pod(namespace, pod)
            ip = (self.get("pods", namespace, pod_name) or {}).get("status", {}).get("podIP")
            sandbox["status"] = {"conditions": [{"type": "Ready", "status": "True", "reason": "DependenciesReady",
                                                 "message": "", "lastTransitionTime": now,
                                                 "observedGeneration": 1}],
                                 "podIPs": [ip] if ip else [], "selector": f"agents.x-k8s.io/sandbox-name={name}"}
        else:
            self.delete_pod(namespace, pod_name)
            sandbox["status"] = {"conditions": [
                {"type": "Ready", "status": "False", "reason": "SandboxSuspended", "message": "", "lastTransitionTime": now,
                 "observedGeneration": 1},
                {"type": "Suspended", "status": "True", "reason": "PodTerminated", "message": "",
                 "lastTransitionTime": now, "observedGeneration": 1}]}

    def claim_sandbox(self, namespace: str, claim: dict) -> None:
        """Binds a new claim to a Sandbox of its name made from its warm pool's template."""
        name = claim["metadata"]["name"]
        pool_name = claim["spec"]["warmPoolRef"]["name"]
        pool = self.get("sandboxwarmpools", namespace, pool_name)
        template = pool and self.get("sandboxtemplates", namespace, pool["spec"]["sandboxTemplateRef"]["name"])
        if template is None:
            return
        pod_template = json.loads(json.dumps(template["spec"]["podTemplate"]))
        extra = claim["spec"].get("additionalPodMetadata") or {}
        meta = pod_template.setdefault("metadata", {})
        for key in ("labels", "annotations"):
            meta[key] = {**(meta.get(key) or {}), **(extra.get(key) or {})}
        sandbox = {"apiVersion": f"agents.x-k8s.io/{CRD_VERSION}", "kind": "Sandbox",
                   "metadata": {"name": name,
                                "annotations": {"agents.x-k8s.io/pod-name": f"{pool_name}-{secrets.token_hex(3)[:5]}"},
                                "labels": {"agents.x-k8s.io/launch-type": "warm"}},
                   "spec": {"podTemplate": pod_template, "operatingMode": "Running"}}
        self.fill_metadata(sandbox, namespace)
        sandbox["metadata"]["generation"] = 1
        self.sandbox_pod(namespace, sandbox)
        self.put("sandboxes", namespace, sandbox, "ADDED")
        claim["status"] = {"sandbox": {"name": name}}

    def delete_sandbox(self, namespace: str, name: str) -> dict | None:
        """Deletes a Sandbox with its Pod and PVCs (the controller's cascade)."""
        obj = self.get("sandboxes", namespace, name)
        if obj is None:
            return None
        pod_name = (obj["metadata"].get("annotations") or {}).get("agents.x-k8s.io/pod-name", name)
        self.delete_pod(namespace, pod_name)
        for vct in obj["spec"].get("volumeClaimTemplates") or []:
            claim = f"{vct['metadata']['name']}-{name}"
            if self.remove("persistentvolumeclaims", namespace, claim) is not None:
                self.docker("volume", "rm", "-f", f"fakek8s-{self.run}-{namespace}-{claim}", check=False)
        return self.remove("sandboxes", namespace, name)

    # -- requests -------------------------------------------------------------------------------
    def authorized(self, headers: dict) -> bool:
        auth = headers.get("authorization", "")
        return auth.startswith("Bearer ") and auth[7:] in self.tokens

    def check_denied(self, verb: str, resource: str) -> None:
        with self.lock:
            if f"{verb} {resource}" in self.denied:
                raise Reject(403, "Forbidden", f'{resource} is forbidden: User "fake" cannot {verb} resource '
                                               f'"{resource}" in this namespace')

    def handle(self, method: str, path: str, query: dict, headers: dict, body: bytes):
        """(status, payload) of one plain (non-upgrade) request; may return a generator of
        watch events instead of a payload."""
        if path == "/version":
            return 200, {"major": "1", "minor": "35", "gitVersion": "v1.35.0-fake", "gitCommit": "", "gitTreeState": "",
                         "buildDate": "", "goVersion": "", "compiler": "", "platform": "linux/amd64"}
        if path == "/apis" and method == "GET":
            groups = []
            if self.crds:
                for group in sorted({facts["group"] for _, facts in self.crd_defs.values()}):
                    gv = {"groupVersion": f"{group}/{CRD_VERSION}", "version": CRD_VERSION}
                    groups.append({"name": group, "versions": [gv], "preferredVersion": gv})
            return 200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}
        m = re.fullmatch(r"/apis/([^/]+)/([^/]+)", path)
        if m and method == "GET":
            resources = [{"name": plural, "singularName": "", "namespaced": True, "kind": facts["kind"],
                          "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"],
                          "shortNames": facts["shortNames"]}
                         for plural, (_, facts) in self.crd_defs.items()
                         if facts["group"] == m.group(1) and m.group(2) == CRD_VERSION]
            if not resources:
                raise Reject(404, "NotFound", "the server could not find the requested resource")
            return 200, {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": f"{m.group(1)}/{m.group(2)}",
                         "resources": resources}
        payload = json.loads(body) if body else None
        if path == "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews" and method == "POST":
            self.note_violations(definitions.load(AUTHORIZATION).check_request(method, path, query, payload))
            attrs = (payload or {}).get("spec", {}).get("resourceAttributes") or {}
            resource = attrs.get("resource", "") + (f"/{attrs['subresource']}" if attrs.get("subresource") else "")
            with self.lock:
                allowed = f"{attrs.get('verb')} {resource}" not in self.denied
            answer = dict(payload or {})
            answer["status"] = {"allowed": allowed} if allowed else {"allowed": False, "reason": "denied by the fake"}
            answer.setdefault("metadata", {})
            return 201, answer
        m = re.fullmatch(r"/api/v1/namespaces/([^/]+)", path)
        if m and method == "GET":
            if m.group(1) not in self.namespaces:
                raise Reject(404, "NotFound", f'namespaces "{m.group(1)}" not found')
            return 200, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": m.group(1)},
                         "status": {"phase": "Active"}}
        m = re.fullmatch(r"/api/v1/namespaces/([^/]+)/(pods|persistentvolumeclaims)(?:/([^/]+))?", path)
        if m:
            content_type = (headers.get("content-type") or "").split(";")[0].strip() or None
            self.note_violations(definitions.load(CORE).check_request(method, path, query, payload,
                                                                      content_type=content_type))
            return self.core(method, m.group(1), m.group(2), m.group(3), query, payload)
        m = re.fullmatch(r"/apis/networking.k8s.io/v1/namespaces/([^/]+)/(networkpolicies)(?:/([^/]+))?", path)
        if m:
            self.note_violations(definitions.load(NETWORKING).check_request(method, path, query, payload))
            return self.networking(method, m.group(1), m.group(2), m.group(3), query, payload)
        m = re.fullmatch(r"/apis/([^/]+)/([^/]+)/namespaces/([^/]+)/([^/]+)(?:/([^/]+))?", path)
        if m and self.crds and m.group(4) in self.crd_defs and m.group(2) == CRD_VERSION:
            definition, facts = self.crd_defs[m.group(4)]
            if facts["group"] == m.group(1):
                self.note_violations(definition.check_request(method, path, query, payload if method == "POST" else None))
                return self.custom(method, m.group(3), m.group(4), m.group(5), query, payload, facts)
        raise Reject(404, "NotFound", "the server could not find the requested resource")

    def core(self, method, namespace, plural, name, query, payload):
        if namespace not in self.namespaces:
            raise Reject(404, "NotFound", f'namespaces "{namespace}" not found')
        verb = {"GET": "get" if name else "list", "POST": "create", "DELETE": "delete"}.get(method, method.lower())
        if query.get("watch", [""])[0] in ("true", "1"):
            verb = "watch"
        self.check_denied(verb, plural)
        if name is None and method == "GET":
            return self.list_or_watch(plural, namespace, query, "PodList" if plural == "pods" else "PersistentVolumeClaimList")
        if name is None and method == "POST":
            if plural == "pods":
                return 201, self.create_pod(namespace, payload)
            self.fill_metadata(payload, namespace)
            with self.lock:
                if ("persistentvolumeclaims", namespace, payload["metadata"]["name"]) in self.objects:
                    raise Reject(409, "AlreadyExists", f'persistentvolumeclaims "{payload["metadata"]["name"]}" already exists')
            payload.setdefault("apiVersion", "v1")
            payload.setdefault("kind", "PersistentVolumeClaim")
            payload["status"] = {"phase": "Bound"}
            return 201, self.put(plural, namespace, payload, "ADDED")
        if method == "GET":
            obj = self.get(plural, namespace, name)
            if obj is None:
                raise Reject(404, "NotFound", f'{plural} "{name}" not found')
            return 200, obj
        if method == "PATCH" and plural == "pods":
            return 200, self.patch_pod(namespace, name, payload or {})
        if method == "DELETE":
            if plural == "pods":
                obj = self.delete_pod(namespace, name)
            else:
                obj = self.remove(plural, namespace, name)
                if obj is not None:
                    volume = f"fakek8s-{self.run}-{namespace}-{name}"
                    self.docker("volume", "rm", "-f", volume, check=False)
            if obj is None:
                raise Reject(404, "NotFound", f'{plural} "{name}" not found')
            return 200, obj
        raise Reject(405, "MethodNotAllowed", f"{method} is not supported here")

    def networking(self, method, namespace, plural, name, query, payload):
        """NetworkPolicies: stored and listed, never enforced (the fake has no network plugin)."""
        if namespace not in self.namespaces:
            raise Reject(404, "NotFound", f'namespaces "{namespace}" not found')
        verb = {"GET": "get" if name else "list", "POST": "create", "DELETE": "delete"}.get(method, method.lower())
        self.check_denied(verb, plural)
        if name is None and method == "GET":
            return self.list_or_watch(plural, namespace, query, "NetworkPolicyList", api_version="networking.k8s.io/v1")
        if name is None and method == "POST":
            self.fill_metadata(payload, namespace)
            with self.lock:
                if (plural, namespace, payload["metadata"]["name"]) in self.objects:
                    raise Reject(409, "AlreadyExists",
                                 f'networkpolicies.networking.k8s.io "{payload["metadata"]["name"]}" already exists')
            payload.setdefault("apiVersion", "networking.k8s.io/v1")
            payload.setdefault("kind", "NetworkPolicy")
            payload["metadata"]["generation"] = 1
            return 201, self.put(plural, namespace, payload, "ADDED")
        obj = self.get(plural, namespace, name) if name else None
        if obj is None:
            raise Reject(404, "NotFound", f'networkpolicies.networking.k8s.io "{name}" not found')
        if method == "GET":
            return 200, obj
        if method == "DELETE":
            self.remove(plural, namespace, name)
            # The published definition answers a NetworkPolicy's DELETE with a Status.
            return 200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                         "details": {"name": name, "group": "networking.k8s.io", "kind": plural,
                                     "uid": obj["metadata"]["uid"]}}
        raise Reject(405, "MethodNotAllowed", f"{method} is not supported here")

    def custom(self, method, namespace, plural, name, query, payload, facts):
        if namespace not in self.namespaces:
            raise Reject(404, "NotFound", f'namespaces "{namespace}" not found')
        resource = f"{plural}.{facts['group']}"
        verb = {"GET": "get" if name else "list", "POST": "create", "DELETE": "delete", "PATCH": "patch"}[method]
        self.check_denied(verb, plural)
        if name is None and method == "GET":
            return self.list_or_watch(plural, namespace, query, facts["kind"] + "List",
                                      api_version=f"{facts['group']}/{CRD_VERSION}")
        if name is None and method == "POST":
            self.fill_metadata(payload, namespace)
            with self.lock:
                if (plural, namespace, payload["metadata"]["name"]) in self.objects:
                    raise Reject(409, "AlreadyExists", f'{resource} "{payload["metadata"]["name"]}" already exists')
            payload["metadata"]["generation"] = 1
            if plural == "sandboxes":
                payload["spec"].setdefault("operatingMode", "Running")
                self.sandbox_pod(namespace, payload)
            if plural == "sandboxclaims":
                self.claim_sandbox(namespace, payload)
            return 201, self.put(plural, namespace, payload, "ADDED")
        obj = self.get(plural, namespace, name)
        if obj is None:
            raise Reject(404, "NotFound", f'{resource} "{name}" not found')
        if method == "GET":
            return 200, obj
        if method == "PATCH":
            merged = merge_patch(obj, payload or {})
            self.note_violations(self.crd_defs[plural][0].errors(
                self.crd_defs[plural][0].document["components"]["schemas"]["Object"], merged, f"PATCH {plural} result"))
            merged["metadata"]["generation"] = obj["metadata"].get("generation", 1) + 1
            if plural == "sandboxes":
                self.sandbox_pod(namespace, merged)
            return 200, self.put(plural, namespace, merged, "MODIFIED")
        if method == "DELETE":
            if plural == "sandboxes":
                self.delete_sandbox(namespace, name)
            if plural == "sandboxclaims":
                bound = (obj.get("status") or {}).get("sandbox", {}).get("name")
                if bound:
                    self.delete_sandbox(namespace, bound)
            self.remove(plural, namespace, name)
            return 200, obj
        raise Reject(405, "MethodNotAllowed", f"{method} is not supported here")

    def list_or_watch(self, plural, namespace, query, kind, api_version="v1"):
        selector = query.get("labelSelector", [None])[0]
        if query.get("watch", [""])[0] not in ("true", "1"):
            with self.lock:
                version = self.version
            return 200, {"apiVersion": api_version, "kind": kind, "metadata": {"resourceVersion": str(version)},
                         "items": self.listed(plural, namespace, selector)}
        since = int(query.get("resourceVersion", ["0"])[0] or 0)
        timeout = min(float(query.get("timeoutSeconds", ["60"])[0]), 300.0)

        def events():
            deadline = time.monotonic() + timeout
            start = since
            if since == 0:
                with self.lock:
                    start = self.version
                for obj in self.listed(plural, namespace, selector):
                    yield {"type": "ADDED", "object": obj}
            while time.monotonic() < deadline:
                with self.lock:
                    fresh = [e for e in self.events if e[0] > start and e[1] == plural and e[2] == namespace]
                    if not fresh:
                        self.lock.wait(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
                        continue
                for version, _, _, kind_of_event, obj in fresh:
                    start = version
                    if matches(obj, selector):
                        yield {"type": kind_of_event, "object": obj}

        return 200, events()

    # -- exec and port-forward ------------------------------------------------------------------
    def exec(self, ws: WebSocket, protocol: str, namespace: str, pod: str, query: dict) -> None:
        command = query.get("command") or []
        use_stdin = query.get("stdin", ["false"])[0] in ("true", "1")
        container = self.container(namespace, pod)
        argv = ["docker", "exec"] + (["-i"] if use_stdin else []) + [container, *command]
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE if use_stdin else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=self.env)
        for stream in (STDOUT, STDERR, STATUS):
            ws.send(bytes([stream]))

        def pump(source, stream: int) -> None:
            while True:
                chunk = source.read1(65536)
                if not chunk:
                    return
                ws.send(bytes([stream]) + chunk)

        pumps = [threading.Thread(target=pump, args=(proc.stdout, STDOUT), daemon=True),
                 threading.Thread(target=pump, args=(proc.stderr, STDERR), daemon=True)]
        for t in pumps:
            t.start()

        def read_client() -> None:
            while True:
                try:
                    message = ws.receive()
                except ValueError as error:
                    self.note_violations([f"exec {pod}: {error}"])
                    message = None
                if message is None:
                    break
                opcode, data = message
                if opcode != 0x2:
                    self.note_violations([f"exec {pod}: a text message; the channel protocol is binary"])
                    continue
                if not data:
                    continue
                stream, data = data[0], data[1:]
                if stream == STDIN and use_stdin and proc.stdin:
                    try:
                        proc.stdin.write(data)
                        proc.stdin.flush()
                    except (BrokenPipeError, ValueError):
                        pass
                elif stream == CLOSE and data[:1] == bytes([STDIN]):
                    if protocol != "v5.channel.k8s.io":
                        self.note_violations([f"exec {pod}: CLOSE on {protocol}, which has none"])
                    if proc.stdin:
                        try:
                            proc.stdin.close()
                        except OSError:
                            pass
                elif stream == RESIZE:
                    pass
            if proc.stdin:
                try:
                    proc.stdin.close()
                except OSError:
                    pass

        threading.Thread(target=read_client, daemon=True).start()
        code = proc.wait()
        for t in pumps:
            t.join(timeout=10)
        if code == 0:
            result = {"metadata": {}, "status": "Success"}
        else:
            result = {"metadata": {}, "status": "Failure", "message": f"command terminated with non-zero exit code: "
                      f"error executing command [{' '.join(command)}], exit code {code}",
                      "reason": "NonZeroExitCode",
                      "details": {"causes": [{"reason": "ExitCode", "message": str(code)}]}}
        ws.send(bytes([STATUS]) + json.dumps(result).encode())
        ws.close()

    def portforward(self, ws: WebSocket, namespace: str, pod: str, query: dict) -> None:
        ports = [int(p) for value in query.get("ports", []) for p in value.split(",") if p]
        obj = self.get("pods", namespace, pod)
        ip = (obj or {}).get("status", {}).get("podIP")
        sockets: dict[int, socket.socket] = {}
        for i, port in enumerate(ports):
            for stream in (2 * i, 2 * i + 1):
                ws.send(bytes([stream]) + struct.pack("<H", port))
            try:
                sockets[i] = socket.create_connection((ip, port), timeout=5)
            except OSError as error:
                ws.send(bytes([2 * i + 1]) + f"error forwarding port {port} to pod {pod}: {error}".encode())
                continue
            sockets[i].settimeout(None)

            def pump(i: int = i) -> None:
                while True:
                    try:
                        chunk = sockets[i].recv(65536)
                    except OSError:
                        chunk = b""
                    if not chunk:
                        ws.close()
                        return
                    ws.send(bytes([2 * i]) + chunk)

            threading.Thread(target=pump, daemon=True).start()
        while True:
            try:
                message = ws.receive()
            except ValueError:
                message = None
            if message is None:
                break
            _, data = message
            if len(data) < 1:
                continue
            stream, data = data[0], data[1:]
            index = stream // 2
            if stream % 2 == 0 and index in sockets and data:
                try:
                    sockets[index].sendall(data)
                except OSError:
                    break
        for s in sockets.values():
            s.close()


def matches(obj: dict, selector: str | None) -> bool:
    """Equality-based label selectors (`a=b,c!=d,e`), as the server's clients send them."""
    if not selector:
        return True
    labels = obj.get("metadata", {}).get("labels") or {}
    for term in selector.split(","):
        term = term.strip()
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k) == v:
                return False
        elif "=" in term:
            k, v = term.split("==", 1) if "==" in term else term.split("=", 1)
            if labels.get(k) != v:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def merge_patch(target, patch):
    """RFC 7386."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


class _Handler(QuietHandler):
    fake: FakeKubernetes

    def setup(self):
        super().setup()
        # A WebSocket carries many small frames each way (a command, its output, credit); with
        # Nagle's algorithm on, the second of two small writes waits for the peer's delayed
        # acknowledgement (40 ms), which a real API server, written in Go, never adds.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def do_PATCH(self):
        self.answer("PATCH")

    def answer(self, method: str) -> None:
        fake = self.fake
        split = urlsplit(self.path)
        path, query = split.path, parse_qs(split.query)
        headers = {k.lower(): v for k, v in self.headers.items()}
        length = int(headers.get("content-length") or 0)
        body = self.rfile.read(length) if length else b""
        with fake.lock:
            fake.requests.append({"method": method, "path": path, "query": query,
                                  "body": body.decode(errors="replace")})
        if path.startswith("/_fake/"):
            payload = {"requests": fake.requests, "violations": fake.violation_list}.get(path[7:])
            # An empty list is an answer too: `[]` means no violations.
            return self.reply(200 if payload is not None else 404, payload if payload is not None else {})
        if not fake.authorized(headers):
            return self.reply(401, status(401, "Unauthorized", "Unauthorized"))
        stream = re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)/(exec|portforward)", path)
        if stream:
            return self.upgrade(method, path, query, headers, *stream.groups())
        try:
            code, payload = fake.handle(method, path, query, headers, body)
        except Reject as reject:
            code, payload = reject.code, status(reject.code, reject.reason, reject.message)
        except (ValueError, KeyError, TypeError) as error:
            code, payload = 400, status(400, "BadRequest", f"the fake could not read the request: {error!r}")
            fake.note_violations([f"{method} {path}: {error!r}"])
        if hasattr(payload, "__next__"):
            return self.stream_events(payload)
        if isinstance(payload, dict) and payload.get("kind") != "Status":
            if path.startswith("/api/v1/"):
                fake.note_violations(definitions.load(CORE).check_answer(method, path, code, payload))
            elif path.startswith("/apis/networking.k8s.io/v1/"):
                fake.note_violations(definitions.load(NETWORKING).check_answer(method, path, code, payload))
        return self.reply(code, payload)

    def reply(self, code: int, payload) -> None:
        data = json.dumps(payload).encode()
        try:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def stream_events(self, events) -> None:
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for event in events:
                line = json.dumps(event).encode() + b"\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        self.close_connection = True

    def upgrade(self, method, path, query, headers, namespace, pod, kind) -> None:
        fake = self.fake
        fake.note_violations(definitions.load(CORE).check_request(method, path, query, None))
        try:
            if namespace not in fake.namespaces or fake.get("pods", namespace, pod) is None:
                raise Reject(404, "NotFound", f'pods "{pod}" not found')
            fake.check_denied("create", f"pods/{kind}")
        except Reject as reject:
            return self.reply(reject.code, status(reject.code, reject.reason, reject.message))
        if headers.get("upgrade", "").lower() != "websocket" or "sec-websocket-key" not in headers:
            return self.reply(400, status(400, "BadRequest", "Upgrade request required"))
        offered = [p.strip() for p in headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
        known = EXEC_PROTOCOLS if kind == "exec" else ("v4.channel.k8s.io", "portforward.k8s.io")
        chosen = next((p for p in offered if p in known), None)
        if chosen is None:
            return self.reply(400, status(400, "BadRequest", f"none of the offered subprotocols {offered} is supported"))
        self.send_response(101, "Switching Protocols")
        self.send_header("Upgrade", "websocket")
        self.send_header("Connection", "Upgrade")
        self.send_header("Sec-WebSocket-Accept", accept_key(headers["sec-websocket-key"]))
        self.send_header("Sec-WebSocket-Protocol", chosen)
        self.end_headers()
        self.wfile.flush()
        ws = WebSocket(self.rfile, self.connection)
        if kind == "exec":
            fake.exec(ws, chosen, namespace, pod, query)
        else:
            fake.portforward(ws, namespace, pod, query)
        self.close_connection = True


def main() -> int:
    parser = arguments(__doc__, "the port")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--token", action="append", default=None, help="an accepted bearer token (repeatable)")
    parser.add_argument("--namespace", action="append", default=None, help="a namespace that exists (repeatable)")
    parser.add_argument("--no-crds", action="store_true", help="serve no agent-sandbox CRDs (pod mode only)")
    parser.add_argument("--image", action="append", default=[], help="NAME=LOCAL: run image NAME as LOCAL")
    options = parser.parse_args()
    fake = FakeKubernetes(namespaces=options.namespace or ["default"], tokens=options.token or ["test-token"],
                          crds=not options.no_crds, images=dict(i.split("=", 1) for i in options.image))
    fake.start(options.port)
    return serve(fake, options.port_file, str(fake.server.server_address[1]))


if __name__ == "__main__":
    sys.exit(main())
