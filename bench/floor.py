"""The floor: what the Docker Engine API itself costs for the work a server does (create,
start, exec, remove), measured with a raw client over the unix socket in the same run as the
servers; and a poller that sees containers disappear."""

from __future__ import annotations

import socket
import threading
import time
from urllib.parse import quote

from bench.common import ECHO, ECHO_OUT, IMAGE, SHELL, BenchError, perf
from testkit import procfs
from testkit.engine import API, Engine


class FloorEngine(Engine):
    """The shared Engine client plus the raw calls the floor times."""

    def exec_start_raw(self, exec_id: str) -> tuple[bytes, bytes]:
        """POST /exec/{id}/start, hijacked: read the multiplexed stream to EOF."""
        body = b'{"Detach":false,"Tty":false}'
        head = (
            f"POST {API}/exec/{exec_id}/start HTTP/1.1\r\nHost: docker\r\n"
            "Content-Type: application/json\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(60)
        try:
            s.connect(self.path)
            s.sendall(head + body)
            buf = b""
            while b"\r\n\r\n" not in buf:
                chunk = s.recv(65536)
                if not chunk:
                    raise BenchError("engine closed the exec stream before the response head")
                buf += chunk
            status_line, rest = buf.split(b"\r\n\r\n", 1)
            status = int(status_line.split(b" ", 2)[1])
            if status not in (101, 200):
                raise BenchError(f"exec start: HTTP {status}: {buf[:300]!r}")
            chunks = [rest]
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
        finally:
            s.close()
        stream = b"".join(chunks)
        out, err = bytearray(), bytearray()
        i = 0
        while i + 8 <= len(stream):
            kind, size = stream[i], int.from_bytes(stream[i + 4 : i + 8], "big")
            (out if kind == 1 else err).extend(stream[i + 8 : i + 8 + size])
            i += 8 + size
        return bytes(out), bytes(err)

    def exec_echo(self, container: str) -> dict[str, float]:
        """The raw exec round trip a server makes: create, start (attached) to EOF, inspect."""
        t0 = perf()
        created = self.ok(
            "POST",
            f"/containers/{container}/exec",
            {"AttachStdout": True, "AttachStderr": True, "Tty": False, "Cmd": [SHELL, "-c", ECHO["command"]]},
        )
        t1 = perf()
        out, _ = self.exec_start_raw(created["Id"])
        t2 = perf()
        while True:
            info = self.ok("GET", f"/exec/{created['Id']}/json")
            if not info.get("Running"):
                break
            time.sleep(0.001)
        t3 = perf()
        if out.decode() != ECHO_OUT or info.get("ExitCode") != 0:
            raise BenchError(f"floor exec: unexpected output {out!r} / exit {info.get('ExitCode')}")
        return {"create": t1 - t0, "start": t2 - t1, "inspect": t3 - t2, "total": t3 - t0}

    def create_start(self, name: str, labels: dict[str, str]) -> tuple[str, dict[str, float]]:
        """A bare create + start, configured like the servers' temporary computers."""
        body = {
            "Image": IMAGE,
            "Cmd": ["tail", "-f", "/dev/null"],
            "Labels": labels,
            "HostConfig": {"AutoRemove": True},
        }
        t0 = perf()
        created = self.ok("POST", f"/containers/create?name={quote(name)}", body)
        t1 = perf()
        self.ok("POST", f"/containers/{created['Id']}/start")
        t2 = perf()
        return created["Id"], {"create": t1 - t0, "start": t2 - t1, "total": t2 - t0}


    def timed_remove(self, ident: str) -> float:
        t0 = perf()
        self.force_remove(ident)
        return perf() - t0


def shim_for(container_id: str) -> int | None:
    """The containerd shim that runs `container_id`."""
    return procfs.pid_with_cmdline(b"containerd-shim", container_id.encode())


class GonePoller(threading.Thread):
    """Polls the engine until none of `names` exists; records when each disappeared."""

    def __init__(self, engine: Engine, names: list[str], t0: float, timeout: float, interval: float = 0.02,
                 quiet: float | None = None) -> None:
        super().__init__(daemon=True)
        self.engine = engine
        self.names = list(names)
        self.t0 = t0
        self.timeout = timeout
        self.interval = interval
        # Give up early once the servers have exited and nothing has vanished for `quiet` s:
        # what is still there then is left behind (nothing of the server is left to remove it).
        self.quiet = quiet
        self.exited = threading.Event()
        self.gone: dict[str, float] = {}
        self.error: BaseException | None = None

    def _settled(self) -> bool:
        if self.quiet is None or not self.exited.is_set():
            return False
        last = max([self._t_exited, *self.gone.values()])
        return perf() - self.t0 - last > self.quiet

    def run(self) -> None:
        pending = set(self.names)
        try:
            while pending and perf() - self.t0 < self.timeout and not self._settled():
                if len(pending) == 1:
                    (name,) = pending
                    status, _ = self.engine.request("GET", f"/containers/{name}/json")
                    present = set() if status == 404 else {name}
                else:
                    present = self.engine.present_names()
                t = perf() - self.t0
                for name in list(pending):
                    if name not in present:
                        self.gone[name] = t
                        pending.discard(name)
                if pending:
                    time.sleep(self.interval)
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            self.error = e
        finally:
            self.engine.close()

    def servers_exited(self) -> None:
        self._t_exited = perf() - self.t0
        self.exited.set()

    def finish(self) -> dict[str, float]:
        self.join(self.timeout + 30)
        if self.error:
            raise BenchError(f"polling the engine failed: {self.error}")
        return self.gone


