"""A minimal Docker Engine API client over the unix socket (no SDK): what the benchmarks use
to count, poll and remove containers, and to measure the engine's own cost (the floor)."""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
from typing import Any
from urllib.parse import quote

API = "/v1.41"


class EngineError(RuntimeError):
    pass


def socket_path() -> str:
    """The engine's socket from DOCKER_HOST (unix:// only), else the default one."""
    host = os.environ.get("DOCKER_HOST", "")
    if host.startswith("unix://"):
        return host[len("unix://") :]
    if host:
        raise EngineError(f"DOCKER_HOST={host!r}: only unix sockets are supported here")
    return "/var/run/docker.sock"


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("docker", timeout=timeout)
        self._unix_path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        s.connect(self._unix_path)
        self.sock = s


class Engine:
    """One keep-alive connection per thread, like an SDK's pool."""

    def __init__(self, path: str | None = None, timeout: float = 120) -> None:
        self.path = path or socket_path()
        self.timeout = timeout
        self._local = threading.local()

    def _conn(self) -> UnixHTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = UnixHTTPConnection(self.path, timeout=self.timeout)
        return conn

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def request(self, method: str, path: str, body: Any = None, raw: tuple[str, bytes] | None = None) -> tuple[int, Any]:
        """(status, payload): JSON payloads decoded, anything else as bytes. `raw` sends
        (content type, bytes) instead of a JSON body (a tar for the archive endpoint)."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        if raw is not None:
            headers, data = {"Content-Type": raw[0]}, raw[1]
        for attempt in (0, 1):
            conn = self._conn()
            try:
                conn.request(method, API + path, body=data, headers=headers)
            except OSError:
                # A keep-alive connection the engine closed: the request never left, so
                # sending it again on a new connection is safe, POSTs included.
                self.close()
                if attempt:
                    raise
                continue
            try:
                resp = conn.getresponse()
                raw = resp.read()
            except (http.client.HTTPException, OSError):
                self.close()
                raise
            break
        ctype = resp.getheader("Content-Type", "") or ""
        payload: Any = raw
        if raw and ctype.startswith("application/json"):
            payload = json.loads(raw)
        return resp.status, payload

    def ok(
        self, method: str, path: str, body: Any = None, expect: tuple[int, ...] = (200, 201, 204),
        raw: tuple[str, bytes] | None = None,
    ) -> Any:
        status, payload = self.request(method, path, body, raw)
        if status not in expect:
            raise EngineError(f"engine {method} {path}: HTTP {status}: {payload!r}"[:400])
        return payload

    def version(self) -> dict[str, Any]:
        return self.ok("GET", "/version")

    def image_present(self, image: str) -> bool:
        status, _ = self.request("GET", f"/images/{image}/json")
        return status == 200

    def list_containers(self, label: str) -> list[dict[str, Any]]:
        """All containers (running or not) carrying `label` (`key` or `key=value`)."""
        filters = quote(json.dumps({"label": [label]}))
        return self.ok("GET", f"/containers/json?all=1&filters={filters}")

    def present_names(self, label: str = "kilntainers.computer-id") -> set[str]:
        names: set[str] = set()
        for c in self.list_containers(label):
            names.update(n.lstrip("/") for n in c.get("Names") or [])
        return names

    def force_remove(self, ident: str) -> None:
        self.ok("DELETE", f"/containers/{ident}?force=true", expect=(200, 204, 404))
