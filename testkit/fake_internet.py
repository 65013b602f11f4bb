"""The egress tests' fake internet (docs/egress.md; spec egress §8): a Docker network outside the
private ranges (198.18.0.0/15) with `allowed.test` and `other.test` web servers made from the
local BusyBox image, and the hosts that need more than BusyBox: a DNS logger that records every
query it receives, and a TLS host whose certificate comes from a test CA made for the run. Those
two listen on the host's own address on the test network (its gateway), so the egress proxy
reaches them over its upstream network like any other host there; each stops with its `with`
block. Also the bytes of a TLS ClientHello naming a chosen SNI, for computers whose only tools
are `printf` and `nc`.

Used by the black-box egress tests, fault scenario 13 and bench/egress.py."""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import os
import secrets
import socket
import ssl
import struct
import subprocess
import tempfile
import threading
from contextlib import contextmanager

CA_NAME = "Kilntainers Fake Internet Test CA"

QTYPES = {1: "A", 28: "AAAA", 16: "TXT", 5: "CNAME", 15: "MX", 33: "SRV", 65: "HTTPS", 255: "ANY"}


def gateway_of(network: str, env: dict | None = None) -> str:
    """The host's address on a Docker network (its IPAM gateway)."""
    out = subprocess.run(["docker", "network", "inspect", network], capture_output=True, text=True, check=True,
                         env=env).stdout
    config = json.loads(out)[0]["IPAM"]["Config"][0]
    # A network made with only --subnet records no gateway; the engine gives the bridge the
    # subnet's first address.
    return config.get("Gateway") or str(next(ipaddress.ip_network(config["Subnet"]).hosts()))


@contextmanager
def fake_internet_on(env: dict | None, image: str):
    """A test network outside the private ranges (198.18.0.0/15) with two web servers made from
    the local busybox image: `allowed.test` at .10 and `other.test` at .11. Removed after."""
    name = f"kbb-egress-{secrets.token_hex(4)}"
    subnet = None
    for _ in range(8):
        octet = secrets.randbelow(256)
        proc = subprocess.run(
            ["docker", "network", "create", "--subnet", f"198.18.{octet}.0/24", name],
            capture_output=True, text=True, env=env,
        )
        if proc.returncode == 0:
            subnet = octet
            break
    assert subnet is not None, proc.stderr
    hosts = {"allowed.test": f"198.18.{subnet}.10", "other.test": f"198.18.{subnet}.11"}
    made = []
    try:
        for host, ip in hosts.items():
            box = f"{name}-{host.split('.')[0]}"
            subprocess.run(
                ["docker", "run", "-d", "--name", box, "--network", name, "--ip", ip, image, "sh", "-c",
                 f"mkdir -p /www && echo hello-from-{host} > /www/index.html && exec httpd -f -p 80 -h /www"],
                check=True, capture_output=True, env=env,
            )
            made.append(box)
        yield {"network": name, "hosts": hosts}
    finally:
        for box in made:
            subprocess.run(["docker", "rm", "-f", box], capture_output=True, env=env)
        # A failed test may leave its server's proxy joined to this network (as its upstream).
        proxies = subprocess.run(
            ["docker", "ps", "-aq", "--filter", f"network={name}", "--filter", "label=kilntainers.egress-proxy"],
            capture_output=True, text=True, env=env,
        ).stdout.split()
        if proxies:
            subprocess.run(["docker", "rm", "-f", *proxies], capture_output=True, env=env)
        subprocess.run(["docker", "network", "rm", name], capture_output=True, env=env)


def _question(packet: bytes) -> tuple[str, int, int] | None:
    """(name, qtype, end of the question) of a DNS query, or None when it does not parse."""
    if len(packet) < 12:
        return None
    pos, labels = 12, []
    while pos < len(packet):
        size = packet[pos]
        if size == 0:
            pos += 1
            break
        if size & 0xC0 or pos + 1 + size > len(packet):
            return None
        labels.append(packet[pos + 1:pos + 1 + size].decode("ascii", "replace"))
        pos += 1 + size
    if pos + 4 > len(packet):
        return None
    (qtype,) = struct.unpack("!H", packet[pos:pos + 2])
    return ".".join(labels).lower(), qtype, pos + 4


class DnsLogger:
    """A UDP DNS server on (address, 53) that records `(name, type)` for every query, answers
    an A record for the names in `answers` and NXDOMAIN (empty, for other types) otherwise."""

    def __init__(self, address: str, answers: dict[str, str]):
        self.address = address
        self.answers = {k.lower(): v for k, v in answers.items()}
        self.queries: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind((address, 53))
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def seen(self) -> list[tuple[str, str]]:
        with self._lock:
            return list(self.queries)

    def _serve(self) -> None:
        while True:
            try:
                packet, peer = self._sock.recvfrom(4096)
            except OSError:
                return
            if self._stopping:
                return
            parsed = _question(packet)
            if parsed is None:
                continue
            name, qtype, end = parsed
            with self._lock:
                self.queries.append((name, QTYPES.get(qtype, str(qtype))))
            ip = self.answers.get(name)
            flags = 0x8180 if ip else 0x8183  # response, recursion desired+available; NXDOMAIN
            if ip and qtype != 1:
                flags, ip = 0x8180, None  # the name exists, without a record of that type
            header = packet[:2] + struct.pack("!HHHHH", flags, 1, 1 if ip else 0, 0, 0)
            answer = b""
            if ip:
                answer = b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 5, 4) + socket.inet_aton(ip)
            try:
                self._sock.sendto(header + packet[12:end] + answer, peer)
            except OSError:
                return

    def __enter__(self) -> DnsLogger:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        # close() alone would leave the port bound while the thread sits in recvfrom (the
        # kernel keeps the socket for that call), and a later logger of the same process on an
        # address of the same number could not bind it. shutdown() wakes the thread (Linux
        # says ENOTCONN for an unconnected UDP socket, and wakes it all the same).
        self._stopping = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._thread.join(timeout=5)
        self._sock.close()


def _test_pki(names: list[str]) -> tuple[bytes, bytes, bytes]:
    """(CA certificate, host certificate, host key), PEM, for `names`; made fresh per run."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = dt.datetime.now(dt.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CA_NAME)])
    ca = (
        x509.CertificateBuilder().subject_name(ca_subject).issuer_name(ca_subject)
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca_subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    key_pem = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return ca.public_bytes(pem), cert.public_bytes(pem), key_pem


class TlsHost:
    """An HTTPS server on (address, 443) with a certificate for `names` from a fresh test CA.
    TLS 1.2 at most, so the certificate (naming the CA) travels in clear and a computer with
    only `nc` can see whose server answered. Every request is answered `hello-from-<SNI>`;
    `snis` records the SNI of each completed handshake."""

    def __init__(self, address: str, names: list[str]):
        self.address = address
        self.ca_pem, cert_pem, key_pem = _test_pki(names)
        self.snis: list[str | None] = []
        self._dir = tempfile.mkdtemp(prefix="kfake-tls-")
        cert_file, key_file = os.path.join(self._dir, "cert.pem"), os.path.join(self._dir, "key.pem")
        with open(cert_file, "wb") as f:
            f.write(cert_pem)
        with open(key_file, "wb") as f:
            f.write(key_pem)
        self._ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._ctx.maximum_version = ssl.TLSVersion.TLSv1_2
        # BusyBox wget's own TLS client offers only suites below OpenSSL's default security
        # level; this host exists to be reached, not to be strong.
        self._ctx.set_ciphers("ALL:@SECLEVEL=0")
        self._ctx.load_cert_chain(cert_file, key_file)
        self._ctx.sni_callback = self._note_sni
        self._listener = socket.create_server((address, 443))
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._lock = threading.Lock()

    def _note_sni(self, sock, name, _ctx) -> None:
        sock.kilntainers_sni = name

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(10)
        try:
            with self._ctx.wrap_socket(conn, server_side=True) as tls:
                sni = getattr(tls, "kilntainers_sni", None)
                with self._lock:
                    self.snis.append(sni)
                head = b""
                while b"\r\n\r\n" not in head and len(head) < 16384:
                    chunk = tls.recv(4096)
                    if not chunk:
                        return
                    head += chunk
                body = f"hello-from-{sni}\n".encode()
                tls.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        except (OSError, ssl.SSLError):
            pass
        finally:
            conn.close()

    def __enter__(self) -> TlsHost:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        # As HeaderHost's: shutdown() first, or the port stays bound for the rest of the process.
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        self._thread.join(timeout=5)
        for name in os.listdir(self._dir):
            os.unlink(os.path.join(self._dir, name))
        os.rmdir(self._dir)


@contextmanager
def tls_host(address: str, names: list[str]):
    with TlsHost(address, names) as host:
        yield host


def client_hello(sni: str) -> bytes:
    """A TLS 1.2 ClientHello naming `sni`, with the suites and extensions a current OpenSSL
    server needs to answer it with its certificate."""
    name = sni.encode()

    def ext(kind: int, data: bytes) -> bytes:
        return struct.pack("!HH", kind, len(data)) + data

    server_name = struct.pack("!HBH", len(name) + 3, 0, len(name)) + name
    extensions = b"".join([
        ext(0x0000, server_name),
        ext(0x000A, struct.pack("!HHH", 4, 0x001D, 0x0017)),  # groups: x25519, secp256r1
        ext(0x000B, b"\x01\x00"),  # point formats: uncompressed
        ext(0x000D, struct.pack("!HHHH", 6, 0x0403, 0x0804, 0x0401)),  # signature algorithms
        ext(0xFF01, b"\x00"),  # renegotiation info
    ])
    suites = struct.pack("!HHHH", 6, 0xC02B, 0xC02F, 0xC030)
    body = b"\x03\x03" + os.urandom(32) + b"\x00" + suites + b"\x01\x00" + struct.pack("!H", len(extensions)) + extensions
    handshake = b"\x01" + len(body).to_bytes(3, "big") + body
    return b"\x16\x03\x01" + struct.pack("!H", len(handshake)) + handshake


def printf_octal(data: bytes) -> str:
    """`data` as a `printf` format of octal escapes (BusyBox and dash both understand them)."""
    return "".join(f"\\{b:03o}" for b in data)


class HeaderHost:
    """A web server that records what reaches it, for the secrets tests (docs/secrets.md): plain
    HTTP on (address, 80) and HTTPS on (address, 443) with a certificate for `names` from a fresh
    test CA (`ca_pem`, for `--egress-upstream-ca`). Every request is answered `200 seen-by-<Host>`
    and the connection closed; `requests` holds one dict per request: scheme, sni, host (the
    Host header), line (the request line), headers (list of (name, value)) and body (bytes,
    what Content-Length announced, at most 1 MiB)."""

    def __init__(self, address: str, names: list[str]):
        self.address = address
        self.ca_pem, cert_pem, key_pem = _test_pki(names)
        self._requests: list[dict] = []
        self._lock = threading.Lock()
        self._dir = tempfile.mkdtemp(prefix="kfake-headers-")
        self.ca_file = os.path.join(self._dir, "ca.pem")
        cert_file, key_file = os.path.join(self._dir, "cert.pem"), os.path.join(self._dir, "key.pem")
        for path, data in ((self.ca_file, self.ca_pem), (cert_file, cert_pem), (key_file, key_pem)):
            with open(path, "wb") as f:
                f.write(data)
        self._ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._ctx.load_cert_chain(cert_file, key_file)
        self._ctx.sni_callback = lambda sock, name, _ctx: setattr(sock, "kilntainers_sni", name)
        self._listeners = [(socket.create_server((address, 80)), False), (socket.create_server((address, 443)), True)]
        self._threads = [threading.Thread(target=self._accept, args=(sock, tls), daemon=True)
                         for sock, tls in self._listeners]

    @property
    def requests(self) -> list[dict]:
        with self._lock:
            return list(self._requests)

    def all_bytes(self) -> bytes:
        """Everything every request carried, heads and bodies."""
        return b"".join(r["raw"] for r in self.requests)

    def _accept(self, listener: socket.socket, tls: bool) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn, tls), daemon=True).start()

    def _serve(self, conn: socket.socket, tls: bool) -> None:
        conn.settimeout(10)
        try:
            stream = self._ctx.wrap_socket(conn, server_side=True) if tls else conn
            with stream:
                head = b""
                while b"\r\n\r\n" not in head and len(head) < 1 << 20:
                    chunk = stream.recv(65536)
                    if not chunk:
                        break
                    head += chunk
                head, _, body = head.partition(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                headers = [tuple(part.strip() for part in line.split(":", 1)) for line in lines[1:] if ":" in line]
                length = next((int(v) for k, v in headers if k.lower() == "content-length" and v.isdigit()), 0)
                while len(body) < min(length, 1 << 20):
                    chunk = stream.recv(65536)
                    if not chunk:
                        break
                    body += chunk
                host = next((v for k, v in headers if k.lower() == "host"), "")
                with self._lock:
                    self._requests.append({
                        "scheme": "https" if tls else "http",
                        "sni": getattr(stream, "kilntainers_sni", None),
                        "host": host.split(":")[0],
                        "line": lines[0],
                        "headers": headers,
                        "body": body,
                        "raw": head + b"\r\n\r\n" + body,
                    })
                reply = f"seen-by-{host}\n".encode()
                stream.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n"
                               b"Content-Length: %d\r\n\r\n" % len(reply) + reply)
        except (OSError, ssl.SSLError, ValueError):
            pass

    def __enter__(self) -> HeaderHost:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        for sock, _ in self._listeners:
            # Wakes the thread blocked in accept(); a bare close() would leave the listener
            # bound (the kernel keeps it for that call) until the process ends.
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        for thread in self._threads:
            thread.join(timeout=5)
        for name in os.listdir(self._dir):
            os.unlink(os.path.join(self._dir, name))
        os.rmdir(self._dir)
