"""The Kubernetes fake itself (fakes/kubernetes.py; issue 37), before a backend uses it: what it
serves must be what the published definitions and the channel protocol say, or a backend tested
against it would be tested against a fiction. Driven here by a plain HTTP client and a minimal
WebSocket client written from RFC 6455, with real containers behind the Pods.

The fake is the only Kubernetes this project has: no real cluster has been reached."""

from __future__ import annotations

import base64
import json
import os
import socket
import struct
import subprocess
import urllib.error
import urllib.request

import pytest

from fakes.kubernetes import FakeKubernetes
from harness import BUSYBOX

# The fake itself, through its HTTP API: no MCP client involved.
pytestmark = pytest.mark.client_independent

TOKEN = "test-token"


@pytest.fixture
def fake():
    with FakeKubernetes(namespaces=["default", "team"]) as k8s:
        yield k8s
    left = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=fakek8s={k8s.run}"], capture_output=True,
                          text=True).stdout.split()
    assert left == [], "the fake left containers behind"
    volumes = subprocess.run(["docker", "volume", "ls", "-q", "--filter", f"name=fakek8s-{k8s.run}"],
                             capture_output=True, text=True).stdout.split()
    assert volumes == [], "the fake left volumes behind"


def call(fake, method: str, path: str, body=None, token: str = TOKEN, content_type="application/json"):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(fake.url + path, data=data, method=method)
    req.add_header("Authorization", f"Bearer {token}")
    if data is not None:
        req.add_header("Content-Type", content_type)
    try:
        with urllib.request.urlopen(req, timeout=60) as res:
            return res.status, json.loads(res.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"null")


def pod(name: str, labels: dict | None = None, command=None, volumes=None, mounts=None) -> dict:
    container = {"name": "main", "image": BUSYBOX,
                 "command": command or ["sh", "-c", "trap 'exit 0' TERM; while :; do sleep 1; done"]}
    if mounts:
        container["volumeMounts"] = mounts
    spec = {"containers": [container], "automountServiceAccountToken": False}
    if volumes:
        spec["volumes"] = volumes
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels or {}}, "spec": spec}


class Channel:
    """A WebSocket client of the channel protocol: masked binary frames, first byte the stream."""

    def __init__(self, fake, path: str, protocols: str):
        host, port = fake.url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET {path} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                           f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
                           f"Sec-WebSocket-Protocol: {protocols}\r\nAuthorization: Bearer {TOKEN}\r\n\r\n").encode())
        head = b""
        while b"\r\n\r\n" not in head:
            head += self.sock.recv(1)
        self.head = head.decode()
        self.buffer = b""

    def protocol(self) -> str | None:
        for line in self.head.split("\r\n"):
            if line.lower().startswith("sec-websocket-protocol:"):
                return line.split(":", 1)[1].strip()
        return None

    def send(self, data: bytes) -> None:
        mask = os.urandom(4)
        n = len(data)
        header = bytes([0x82]) + (bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + struct.pack("!H", n))
        self.sock.sendall(header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data)))

    def _read(self, n: int) -> bytes:
        while len(self.buffer) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise EOFError
            self.buffer += chunk
        out, self.buffer = self.buffer[:n], self.buffer[n:]
        return out

    def messages(self):
        """(opcode, payload) until the server's close frame."""
        while True:
            b0, b1 = self._read(2)
            assert not b1 & 0x80, "a server frame must not be masked"
            n = b1 & 0x7F
            if n == 126:
                (n,) = struct.unpack("!H", self._read(2))
            elif n == 127:
                (n,) = struct.unpack("!Q", self._read(8))
            payload = self._read(n)
            if b0 & 0x0F == 0x8:
                return
            yield b0 & 0x0F, payload


def exec_path(name: str, *command: str, stdin: bool = False) -> str:
    query = "&".join(f"command={urllib.request.quote(c)}" for c in command)
    return f"/api/v1/namespaces/default/pods/{name}/exec?{query}&stdout=true&stderr=true" + ("&stdin=true" if stdin else "")


def run_exec(fake, name: str, *command: str, stdin: bytes | None = None, protocols="v5.channel.k8s.io, v4.channel.k8s.io"):
    ch = Channel(fake, exec_path(name, *command, stdin=stdin is not None), protocols)
    assert " 101 " in ch.head.split("\r\n")[0], ch.head
    if stdin is not None:
        ch.send(b"\x00" + stdin)
        ch.send(bytes([255, 0]))
    out = {1: b"", 2: b""}
    result = None
    for opcode, payload in ch.messages():
        assert opcode == 0x2, "channel messages are binary"
        if len(payload) == 1:
            continue  # the stream's opening message
        if payload[0] == 3:
            result = json.loads(payload[1:])
        else:
            out[payload[0]] += payload[1:]
    return ch.protocol(), out[1], out[2], result


def test_pods_follow_the_definition_and_run_commands_over_the_channel_protocol(fake):
    # See: issue 37 (a fake API server ... serves the exec and port-forward channel protocols)
    assert call(fake, "GET", "/api/v1/namespaces/default", token="wrong")[0] == 401
    assert call(fake, "GET", "/api/v1/namespaces/nowhere")[1]["reason"] == "NotFound"
    code, made = call(fake, "POST", "/api/v1/namespaces/default/pods", pod("p1", {"kilntainers.owner": "alice"}))
    assert code == 201 and made["status"]["phase"] == "Running" and made["status"]["podIP"], made
    code, again = call(fake, "POST", "/api/v1/namespaces/default/pods", pod("p1"))
    assert (code, again["reason"]) == (409, "AlreadyExists"), again
    call(fake, "POST", "/api/v1/namespaces/default/pods", pod("p2", {"kilntainers.owner": "bob"}))
    listed = call(fake, "GET", "/api/v1/namespaces/default/pods?labelSelector=kilntainers.owner%3Dalice")[1]
    assert [p["metadata"]["name"] for p in listed["items"]] == ["p1"], listed

    protocol, out, err, result = run_exec(fake, "p1", "sh", "-c", "cat; echo err >&2", stdin=b"hello")
    assert (protocol, out, err, result["status"]) == ("v5.channel.k8s.io", b"hello", b"err\n", "Success")
    protocol, _, _, result = run_exec(fake, "p1", "sh", "-c", "exit 3", protocols="v4.channel.k8s.io")
    assert protocol == "v4.channel.k8s.io"
    assert (result["status"], result["reason"]) == ("Failure", "NonZeroExitCode"), result
    assert result["details"]["causes"] == [{"reason": "ExitCode", "message": "3"}]

    assert call(fake, "DELETE", "/api/v1/namespaces/default/pods/p2")[0] == 200
    assert call(fake, "GET", "/api/v1/namespaces/default/pods/p2")[0] == 404
    assert fake.violations() == []


def test_port_forward_reaches_a_port_of_the_pod(fake):
    server = ["sh", "-c", "mkdir -p /www && echo forwarded > /www/index.html && exec httpd -f -p 8080 -h /www"]
    call(fake, "POST", "/api/v1/namespaces/default/pods", pod("web", command=server))
    ch = Channel(fake, "/api/v1/namespaces/default/pods/web/portforward?ports=8080", "v4.channel.k8s.io")
    messages = ch.messages()
    # Each of the port's two streams opens with the port number, little-endian.
    opening = sorted([next(messages)[1], next(messages)[1]])
    assert opening == [b"\x00" + struct.pack("<H", 8080), b"\x01" + struct.pack("<H", 8080)], opening
    ch.send(b"\x00GET / HTTP/1.0\r\n\r\n")
    body = b""
    for _, payload in messages:
        assert payload[0] == 0, payload
        body += payload[1:]
    assert b"forwarded" in body, body
    assert fake.violations() == []


def test_access_reviews_and_denials(fake):
    review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
              "spec": {"resourceAttributes": {"namespace": "default", "verb": "create", "resource": "pods",
                                              "subresource": "exec"}}}
    code, answer = call(fake, "POST", "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews", review)
    assert code == 201 and answer["status"]["allowed"] is True, answer
    fake.deny("create", "pods/exec")
    assert call(fake, "POST", "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews", review)[1]["status"]["allowed"] is False
    call(fake, "POST", "/api/v1/namespaces/default/pods", pod("p"))
    ch = Channel(fake, exec_path("p", "true"), "v5.channel.k8s.io")
    assert " 403 " in ch.head.split("\r\n")[0], ch.head
    assert fake.violations() == []


def test_a_body_the_definition_does_not_allow_is_a_violation(fake):
    bad = pod("strict")
    bad["spec"]["containers"][0]["imageName"] = "typo"
    call(fake, "POST", "/api/v1/namespaces/default/pods", bad)
    assert any("imageName" in v and "not declared" in v for v in fake.violations()), fake.violations()


def test_a_sandbox_is_a_pod_with_claims_that_survive_suspension(fake):
    # See: issue 37 (typed resources for the agent-sandbox CRDs)
    apis = call(fake, "GET", "/apis/agents.x-k8s.io/v1beta1")[1]
    assert [r["kind"] for r in apis["resources"]] == ["Sandbox"], apis
    template = pod("ignored", {"kilntainers.computer": "box"}, mounts=[{"name": "home", "mountPath": "/home/user"}])
    sandbox = {"apiVersion": "agents.x-k8s.io/v1beta1", "kind": "Sandbox", "metadata": {"name": "box"},
               "spec": {"podTemplate": {"metadata": {"labels": {"kilntainers.computer": "box"}},
                                        "spec": template["spec"]},
                        "volumeClaimTemplates": [{"metadata": {"name": "home"},
                                                  "spec": {"accessModes": ["ReadWriteOnce"],
                                                           "resources": {"requests": {"storage": "1Gi"}}}}]}}
    base = "/apis/agents.x-k8s.io/v1beta1/namespaces/default/sandboxes"
    code, made = call(fake, "POST", base, sandbox)
    assert code == 201 and made["status"]["conditions"][0]["status"] == "True", made
    assert call(fake, "GET", "/api/v1/namespaces/default/persistentvolumeclaims/home-box")[0] == 200
    assert run_exec(fake, "box", "sh", "-c", "echo kept > /home/user/f")[3]["status"] == "Success"

    suspend = {"spec": {"operatingMode": "Suspended"}}
    code, suspended = call(fake, "PATCH", f"{base}/box", suspend, content_type="application/merge-patch+json")
    assert code == 200 and call(fake, "GET", "/api/v1/namespaces/default/pods/box")[0] == 404, suspended
    call(fake, "PATCH", f"{base}/box", {"spec": {"operatingMode": "Running"}}, content_type="application/merge-patch+json")
    assert run_exec(fake, "box", "cat", "/home/user/f")[1] == b"kept\n"

    assert call(fake, "DELETE", f"{base}/box")[0] == 200
    assert call(fake, "GET", "/api/v1/namespaces/default/persistentvolumeclaims/home-box")[0] == 404
    assert call(fake, "GET", "/api/v1/namespaces/default/pods/box")[0] == 404
    assert fake.violations() == []
