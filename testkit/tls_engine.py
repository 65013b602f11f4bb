"""A second Docker daemon of the test's own that serves the Engine API over verified TLS on
127.0.0.1, the way a remote engine is reached (`DOCKER_HOST=tcp://host:2376`,
`DOCKER_TLS_VERIFY=1`, `DOCKER_CERT_PATH` with `ca.pem`, `cert.pem`, `key.pem`).

The shared daemon of the machine is never touched. This one gets everything of its own, as the
test environment's rules require (docs/testing.md, "A second Docker daemon"): a data root, an exec
root, a pid file, a unix socket besides the TLS listener, a containerd namespace, and a bridge
made before it starts (`--bridge <ours> --iptables=false`; never `--bridge none`, which deletes
`docker0` and breaks the shared daemon). Certificates are made at start with openssl: a CA, a
server certificate for 127.0.0.1 and a client certificate, so the daemon refuses clients without
one. `close()` stops the daemon by its pid and removes its directories and the bridge.

    with TlsEngine(images=["sandbox-busybox:full"]) as engine:
        engine.host         # "tcp://127.0.0.1:<port>"
        engine.cert_dir     # ca.pem, cert.pem, key.pem for DOCKER_CERT_PATH
        engine.docker("ps") # the docker CLI against its unix socket
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

START_TIMEOUT = 60.0
STOP_TIMEOUT = 30.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(*argv: str, stdin: bytes | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, input=stdin, capture_output=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.decode(errors='replace').strip()}")
    return proc


def make_certificates(directory: Path, server_names: tuple[str, ...] = ("IP:127.0.0.1", "DNS:localhost")) -> None:
    """A CA (`ca.pem`, `ca-key.pem`), a server certificate (`server-cert.pem`, `server-key.pem`)
    for `server_names` and a client certificate (`cert.pem`, `key.pem`), all P-256, valid for
    two days."""
    directory.mkdir(parents=True, exist_ok=True)

    def key_and_request(key: str, request: str, subject: str) -> None:
        _run("openssl", "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", str(directory / key), "-out", str(directory / request), "-subj", subject)

    def sign(request: str, out: str, extensions: str) -> None:
        ext = directory / f"{out}.ext"
        ext.write_text(extensions)
        _run("openssl", "x509", "-req", "-in", str(directory / request), "-CA", str(directory / "ca.pem"),
             "-CAkey", str(directory / "ca-key.pem"), "-CAcreateserial", "-days", "2",
             "-out", str(directory / out), "-extfile", str(ext))

    _run("openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(directory / "ca-key.pem"), "-out", str(directory / "ca.pem"), "-days", "2",
         "-subj", "/CN=kilntainers test CA")
    key_and_request("server-key.pem", "server.csr", "/CN=localhost")
    sign("server.csr", "server-cert.pem", f"subjectAltName={','.join(server_names)}\nextendedKeyUsage=serverAuth\n")
    key_and_request("key.pem", "client.csr", "/CN=kilntainers test client")
    sign("client.csr", "cert.pem", "extendedKeyUsage=clientAuth\n")
    for path in directory.iterdir():
        if path.name.endswith("key.pem"):
            path.chmod(0o600)


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 198.19.128.0/17 (benchmarking space, so never a real host) that no route of this
    machine uses yet; the fake internets of other tests use 198.18.0.0/16."""
    routes = subprocess.run(["ip", "-4", "route", "show"], capture_output=True, text=True).stdout
    used = []
    for line in routes.splitlines():
        first = line.split(" ", 1)[0]
        try:
            used.append(ipaddress.ip_network(first, strict=False))
        except ValueError:
            continue
    candidates = [ipaddress.ip_network(f"198.19.{octet}.0/24") for octet in range(128, 255)]
    secrets.SystemRandom().shuffle(candidates)
    for net in candidates:
        if not any(net.overlaps(other) for other in used):
            return net
    raise RuntimeError("no free /24 in 198.19.128.0/17 for the second daemon's bridge")


class TlsEngine:
    def __init__(self, images: list[str] | None = None) -> None:
        self.images = list(images or [])
        self.suffix = secrets.token_hex(3)
        self.root = Path(tempfile.mkdtemp(prefix="kt-tls-engine-"))
        self.cert_dir = self.root / "certs"
        # The exec root holds containerd's socket: a short path under /run keeps it within the
        # 108-byte limit of unix socket paths.
        self.exec_root = Path(f"/run/kt-tls-{self.suffix}")
        self.bridge = f"kt-tls{self.suffix}"
        self.port = _free_port()
        self.host = f"tcp://127.0.0.1:{self.port}"
        self.socket = self.exec_root / "docker.sock"
        self.log = self.root / "dockerd.log"
        self.pid: int | None = None
        self._proc: subprocess.Popen | None = None
        self._bridge_made = False

    # -- the docker CLI against this daemon ---------------------------------------------------
    def docker(self, *args: str, stdin: bytes | None = None, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DOCKER_")}
        env["DOCKER_HOST"] = f"unix://{self.socket}"
        proc = subprocess.run(["docker", *args], input=stdin, capture_output=True, env=env, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"docker {' '.join(args)} on the TLS engine failed: {proc.stderr.decode(errors='replace')}")
        return proc

    def containers(self) -> list[str]:
        """Names of every container this daemon has, running or not."""
        out = self.docker("ps", "-a", "--format", "{{.Names}}").stdout.decode()
        return sorted(line for line in out.split() if line)

    # -- lifecycle ------------------------------------------------------------------------------
    def __enter__(self) -> "TlsEngine":
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        make_certificates(self.cert_dir)
        subnet = _free_subnet()
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self._bridge_made = True
        _run("ip", "addr", "add", f"{subnet.network_address + 1}/{subnet.prefixlen}", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        self.exec_root.mkdir(mode=0o700)
        config = self.root / "daemon.json"
        config.write_text("{}\n")  # not the shared daemon's /etc/docker/daemon.json
        namespace = f"kt-tls-{self.suffix}"
        certs = self.cert_dir
        argv = [
            "dockerd", "--config-file", str(config),
            "--data-root", str(self.root / "data"), "--exec-root", str(self.exec_root),
            "--pidfile", str(self.exec_root / "dockerd.pid"),
            "-H", f"unix://{self.socket}", "-H", self.host,
            "--tlsverify", "--tlscacert", str(certs / "ca.pem"),
            "--tlscert", str(certs / "server-cert.pem"), "--tlskey", str(certs / "server-key.pem"),
            "--bridge", self.bridge, "--iptables=false", "--ip-forward=false", "--ip-masq=false",
            "--containerd-namespace", namespace, "--containerd-plugins-namespace", f"{namespace}-plugins",
        ]
        with open(self.log, "wb") as log:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        self._proc, self.pid = proc, proc.pid
        deadline = time.monotonic() + START_TIMEOUT
        while self.docker("version", check=False, timeout=10).returncode != 0:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the TLS dockerd did not come up:\n{self.log.read_text(errors='replace')[-4000:]}")
            time.sleep(0.2)
        for image in self.images:
            saved = subprocess.run(["docker", "save", image], capture_output=True, check=True, timeout=120).stdout
            self.docker("load", stdin=saved)

    def close(self) -> None:
        if self.pid is not None:
            if self.socket.exists():
                # Everything in this daemon is the test's own.
                ids = self.docker("ps", "-aq", check=False, timeout=30).stdout.decode().split()
                if ids:
                    self.docker("rm", "-f", *ids, check=False, timeout=60)
            children = _children(self.pid)
            _stop(self.pid)
            # dockerd started its own containerd; it ends with the daemon, or is ended here.
            for child in children:
                _stop(child)
            if self._proc is not None:
                # Reaped by _stop, or by whoever waits for children in this process.
                self._proc.wait(timeout=STOP_TIMEOUT)
            self.pid = None
        for root in (self.root, self.exec_root):
            _unmount_below(root)
            shutil.rmtree(root, ignore_errors=True)
        if self._bridge_made:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
            self._bridge_made = False


def _children(pid: int) -> list[int]:
    """The children of every thread of `pid` (each thread lists only those it started)."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children.extend(int(p) for p in (task / "children").read_text().split())
        except OSError:
            continue
    return children


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _stop(pid: int) -> None:
    """SIGTERM, then SIGKILL after STOP_TIMEOUT; returns once the process is gone."""
    for sig, wait in ((signal.SIGTERM, STOP_TIMEOUT), (signal.SIGKILL, 10.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not _alive(pid):
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
            return


def _unmount_below(root: Path) -> None:
    """Unmounts whatever a daemon that died badly left mounted under `root` (deepest first)."""
    prefix = str(root) + "/"
    with open("/proc/self/mounts") as mounts:
        points = [line.split()[1] for line in mounts if line.split()[1].startswith(prefix)]
    for point in sorted(points, key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True)
