"""Container registries for pull tests on machines that reach no registry.

`Registry` runs Debian's `docker-registry` (the CNCF distribution registry, installed by
scripts/setup-test-env.sh) on 127.0.0.1 with its storage in a temporary directory; `push()`
builds an image locally and pushes it there with the docker CLI, as anyone publishing an image
would. Engines treat 127.0.0.0/8 as an insecure registry by default (Podman only with a
registries.conf entry, which `PodmanService` writes), so `127.0.0.1:<port>/<repo>:<tag>` pulls
over plain HTTP.

`SilentRegistry` accepts connections and never answers: a registry that hangs.

`PodmanService` is a Podman API service of the test's own (`podman system service` on a socket
in a temporary directory) whose registries.conf marks one registry insecure; Podman is
daemonless, so it shares the images and containers of the machine's service without touching
that service's configuration.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

REGISTRY_BIN = "docker-registry"
START_TIMEOUT = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _wait_until(predicate, timeout: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not come up within {timeout} s:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.1)


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(b"GET /v2/ HTTP/1.0\r\n\r\n")
            return s.recv(12).startswith(b"HTTP/1.")
    except OSError:
        return False


class Registry:
    """`with Registry() as reg: image = reg.push("kiln/pull", "v1", fresh_layer_bytes=1 << 20)`"""

    def __init__(self) -> None:
        if shutil.which(REGISTRY_BIN) is None:
            raise RuntimeError(f"{REGISTRY_BIN} is not installed (scripts/setup-test-env.sh installs Debian's package)")
        self.dir = Path(tempfile.mkdtemp(prefix="kt-registry-"))
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log = self.dir / "registry.log"
        self.pushed: list[str] = []
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> "Registry":
        config = self.dir / "config.yml"
        config.write_text(
            "version: 0.1\n"
            "log:\n  level: warn\n  accesslog:\n    disabled: false\n"
            f"storage:\n  filesystem:\n    rootdirectory: {self.dir / 'storage'}\n"
            f"http:\n  addr: {self.address}\n"
        )
        with open(self.log, "wb") as log:
            self._proc = subprocess.Popen(
                [REGISTRY_BIN, "serve", str(config)], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                start_new_session=True,
            )
        try:
            _wait_until(lambda: self._proc.poll() is not None or _answers(self.port), START_TIMEOUT, "docker-registry", self.log)
            if self._proc.poll() is not None:
                raise RuntimeError(f"docker-registry exited:\n{self.log.read_text(errors='replace')}")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for image in self.pushed:
            subprocess.run(["docker", "rmi", "-f", image], capture_output=True)
        if self._proc is not None:
            _stop(self._proc)
        shutil.rmtree(self.dir, ignore_errors=True)

    def push(self, repository: str, tag: str, base: str = "sandbox-busybox:full", fresh_layer_bytes: int = 0) -> str:
        """Builds `base` plus, with `fresh_layer_bytes`, a layer of that many random bytes at
        `/kiln-pull-fresh-layer` (which no engine has yet, so a pull really downloads and
        extracts something), pushes it as `<registry>/<repository>:<tag>` and removes it from
        the local engine again. Returns the image reference."""
        image = f"{self.address}/{repository}:{tag}"
        context = Path(tempfile.mkdtemp(prefix="build-", dir=self.dir))
        lines = [f"FROM {base}"]
        if fresh_layer_bytes:
            (context / "fresh").write_bytes(os.urandom(fresh_layer_bytes))
            lines.append("COPY fresh /kiln-pull-fresh-layer")
        (context / "Dockerfile").write_text("\n".join(lines) + "\n")
        env = dict(os.environ, DOCKER_BUILDKIT="0")
        for argv in (["docker", "build", "-q", "-t", image, str(context)], ["docker", "push", image]):
            proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(argv)} failed: {proc.stderr}")
        self.pushed.append(image)
        subprocess.run(["docker", "rmi", image], capture_output=True, check=True)
        return image

    def requests(self) -> list[str]:
        """The registry's access log as `METHOD /path` lines."""
        text = self.log.read_text(errors="replace")
        return re.findall(r'"((?:GET|HEAD|PUT|POST|PATCH|DELETE) [^ "]+)', text)


class SilentRegistry:
    """Accepts TCP connections on 127.0.0.1 and never answers: a registry that hangs."""

    def __init__(self) -> None:
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self.accepted = 0
        self._held: list[socket.socket] = []
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self.accepted += 1
            self._held.append(conn)

    def __enter__(self) -> "SilentRegistry":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._closed.set()
        # shutdown() wakes the accept() blocked in the thread; close() alone does not.
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        self._thread.join(timeout=5)
        for conn in self._held:
            conn.close()


class PodmanService:
    """`with PodmanService(insecure=[reg.address]) as podman: podman.host` — a `unix://` address."""

    def __init__(self, insecure: list[str]) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kt-podman-"))
        self.socket = self.dir / "podman.sock"
        self.host = f"unix://{self.socket}"
        self.log = self.dir / "service.log"
        registries = self.dir / "registries.conf"
        registries.write_text(
            'unqualified-search-registries = []\n'
            + "".join(f'\n[[registry]]\nlocation = "{address}"\ninsecure = true\n' for address in insecure)
        )
        self.env = dict(os.environ, CONTAINERS_REGISTRIES_CONF=str(registries))
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> "PodmanService":
        with open(self.log, "wb") as log:
            self._proc = subprocess.Popen(
                ["podman", "system", "service", "--time=0", self.host], stdin=subprocess.DEVNULL,
                stdout=log, stderr=log, env=self.env, start_new_session=True,
            )
        try:
            _wait_until(lambda: self._proc.poll() is not None or self._pings(), START_TIMEOUT, "podman service", self.log)
            if self._proc.poll() is not None:
                raise RuntimeError(f"podman service exited:\n{self.log.read_text(errors='replace')}")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            _stop(self._proc)
        shutil.rmtree(self.dir, ignore_errors=True)

    def _pings(self) -> bool:
        if not self.socket.exists():
            return False
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(1)
                s.connect(str(self.socket))
                s.sendall(b"GET /_ping HTTP/1.0\r\n\r\n")
                return s.recv(12).startswith(b"HTTP/1.")
        except OSError:
            return False

    def podman(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(["podman", *args], capture_output=True, text=True, env=self.env, timeout=120)
        if check and proc.returncode != 0:
            raise AssertionError(f"podman {' '.join(args)} failed: {proc.stderr}")
        return proc

    def image_exists(self, image: str) -> bool:
        return self.podman("image", "exists", image, check=False).returncode == 0
