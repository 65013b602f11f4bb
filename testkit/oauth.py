"""A local OAuth 2.1 authorization server for tests (tests/oauth/issuer.mjs, oidc-provider on
127.0.0.1) and a client that gets real JWT access tokens from it.

    with issuer() as iss:                               # or: async with async_issuer() as iss
        token = iss.token("alice", "http://127.0.0.1:8080/mcp")
        decode(token)  # -> (header, payload), unverified

`Issuer.token` is a real authorization-code flow with PKCE (S256) over HTTP: the authorization
endpoint with `resource=` and `login_hint=<user>`, the issuer's login and consent interaction
(automatic, see issuer.mjs), the code from the redirect's Location, the token endpoint with the
code_verifier and `resource=`. The issuer's `aud` is exactly the `resource` given.

Tokens a resource server must refuse:
* another resource (wrong `aud`): `iss.token(user, "http://127.0.0.1:1/other")`
* expired / not yet valid / without exp (properly signed): `iss.expired_token(...)`,
  `iss.not_yet_valid_token(...)`, `iss.no_exp_token(...)`
* the same times written as JSON strings (CVE-2026-25537): `iss.string_nbf_token(...)` (nbf in
  the future), `iss.string_exp_token(...)` (exp in the past)
* a bad signature: `tampered(token)` flips bits in the signature of a real token
* another issuer: `with issuer() as other: other.token(...)` (its own `iss`, keys and kids)
* the right key but another `iss`: `iss.other_iss_token(...)`
* a forgery: `iss.forged_token(...)` claims `iss` = this issuer, with a kid this issuer also
  uses, signed by another instance's key
* `alg_none(token)`, `hs256_key_confusion(token, iss.rsa_public_pem())`: classic JWS attacks
* without a scope: `iss.token(user, resource, scope="openid")` or `scope="mcp:read"`
Tokens it should accept besides `token`: exp 5 s ago (inside a 30 s leeway),
`iss.within_leeway_token(...)`; the scopes as an `scp` array, `iss.scp_token(...)`.

`iss.rotate_keys()` replaces the signing keys (new kids), so a server that cached the JWKS
must fetch it again for the next token.

Standard library and httpx only. Needs node (>= 20) and `npm ci` in tests/oauth (done by
scripts/setup-test-env.sh).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import os
import secrets
import select
import shutil
import subprocess
import threading
import time
from collections import deque
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import AsyncIterator, Iterator
from urllib.parse import parse_qs, urlencode, urljoin, urlsplit

import httpx

REPO = Path(__file__).resolve().parents[1]
OAUTH_DIR = REPO / "tests" / "oauth"
ISSUER_JS = OAUTH_DIR / "issuer.mjs"

CLIENT_ID = "kilntainers-test"
EXPIRED_CLIENT_ID = "kilntainers-test-expired"
NOT_YET_VALID_CLIENT_ID = "kilntainers-test-not-yet-valid"
WITHIN_LEEWAY_CLIENT_ID = "kilntainers-test-within-leeway"
SCP_CLIENT_ID = "kilntainers-test-scp"
OTHER_ISS_CLIENT_ID = "kilntainers-test-other-iss"
NO_EXP_CLIENT_ID = "kilntainers-test-no-exp"
STRING_NBF_CLIENT_ID = "kilntainers-test-string-nbf"
STRING_EXP_CLIENT_ID = "kilntainers-test-string-exp"
REDIRECT_URI = "http://127.0.0.1/callback"
DEFAULT_SCOPE = "mcp:tools"


class OAuthError(Exception):
    """The issuer refused a step of the flow (the message has its answer)."""


# ---------------------------------------------------------------------------------------------
# JWT pieces (no verification: the server under test does that)


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def b64url_decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def decode(token: str) -> tuple[dict, dict]:
    """(header, payload) of a compact JWS, unverified."""
    header, payload, _ = token.split(".")
    return json.loads(b64url_decode(header)), json.loads(b64url_decode(payload))


def tampered(token: str) -> str:
    """The token with bits flipped in the middle of its signature (header and payload intact)."""
    header, payload, signature = token.split(".")
    sig = bytearray(b64url_decode(signature))
    mid = len(sig) // 2
    for i in range(mid, min(mid + 4, len(sig))):
        sig[i] ^= 0x5A
    return f"{header}.{payload}.{b64url(bytes(sig))}"


def with_claims(token: str, **claims) -> str:
    """The token with payload claims changed (a value of None removes the claim) and its original
    signature, which then no longer matches."""
    header, _, signature = token.split(".")
    payload = decode(token)[1]
    for key, value in claims.items():
        if value is None:
            payload.pop(key, None)
        else:
            payload[key] = value
    return f"{header}.{b64url(json.dumps(payload).encode())}.{signature}"


def alg_none(token: str) -> str:
    """The token's payload unsigned: header {"alg": "none", "typ": "at+jwt"}, empty signature."""
    payload = token.split(".")[1]
    return f"{b64url(json.dumps({'alg': 'none', 'typ': 'at+jwt'}).encode())}.{payload}."


def hs256_key_confusion(token: str, public_pem: str) -> str:
    """The token's payload re-signed with HS256 keyed by the issuer's RSA public key in PEM (what
    a verifier that takes the algorithm from the token would accept), keeping the kid."""
    header = decode(token)[0]
    header = {"alg": "HS256", "typ": header.get("typ", "at+jwt"), "kid": header.get("kid")}
    signing_input = f"{b64url(json.dumps(header).encode())}.{token.split('.')[1]}"
    mac = hmac.new(public_pem.encode(), signing_input.encode(), hashlib.sha256).digest()
    return f"{signing_input}.{b64url(mac)}"


def pkce_pair() -> tuple[str, str]:
    """(code_verifier, S256 code_challenge)."""
    verifier = secrets.token_urlsafe(48)
    return verifier, b64url(hashlib.sha256(verifier.encode()).digest())


# ---------------------------------------------------------------------------------------------
# the issuer process


def _node() -> str:
    node = os.environ.get("KILNTAINERS_NODE") or shutil.which("node")
    if not node:
        raise RuntimeError("node (>= 20) is needed for the OAuth test issuer")
    if not (OAUTH_DIR / "node_modules" / "oidc-provider").is_dir():
        raise RuntimeError(f"{OAUTH_DIR}/node_modules is missing: run scripts/setup-test-env.sh (or npm ci there)")
    return node


def complete_authorization(url: str, user: str | None = None, redirect_uri: str = REDIRECT_URI) -> dict:
    """Follows an authorization request URL through the issuer's login and consent (as `user`:
    added as `login_hint` when given) to the redirect to `redirect_uri`, and returns that
    redirect's query parameters (`code`, `state`, `iss`, or `error`...). For clients that build
    the URL themselves, like the SDK's OAuthClientProvider."""
    if user is not None:
        url += ("&" if "?" in url else "?") + urlencode({"login_hint": user})
    # A fresh cookie jar per flow: no session of an earlier user is reused.
    with httpx.Client(follow_redirects=False, timeout=30) as client:
        for _ in range(10):
            response = client.get(url)
            location = response.headers.get("location")
            if response.status_code not in (302, 303) or not location:
                raise OAuthError(f"authorization flow stopped at {url}: HTTP {response.status_code} "
                                 f"{response.text[:500]}")
            url = urljoin(str(response.url), location)
            if url.startswith(redirect_uri + "?"):
                return {k: v[0] for k, v in parse_qs(urlsplit(url).query).items()}
    raise OAuthError(f"too many redirects in the authorization flow (last {url})")


class IssuerHung(RuntimeError):
    """The issuer process is alive but printed no ready line in time."""


class Issuer:
    """A running tests/oauth/issuer.mjs. Use `issuer()` / `async_issuer()` to get one.

    Node has been seen, rarely and only under CI load, to hang at startup with its main thread
    parked on a futex and nothing printed (normal startup takes about half a second). Such a
    start is killed and tried again, up to `attempts` times; an issuer that exits is an error at
    once. Each hang's diagnostics (every thread's state and wait channel) go into the error."""

    def __init__(self, *, port: int = 0, alg: str = "RS256", discovery: str = "both", forge_iss: str | None = None,
                 kid_prefix: str | None = None, ready_timeout: float = 20.0, attempts: int = 3):
        argv = [_node(), str(ISSUER_JS), str(port), "--alg", alg, "--discovery", discovery]
        if forge_iss:
            argv += ["--forge-iss", forge_iss]
        if kid_prefix:
            argv += ["--kid-prefix", kid_prefix]
        self.alg = alg
        hangs: list[str] = []
        for _ in range(attempts):
            try:
                ready = self._start(argv, ready_timeout)
                break
            except IssuerHung as hung:
                hangs.append(str(hung))
        else:
            raise RuntimeError(f"the OAuth issuer hung at startup {attempts} times:\n" + "\n\n".join(hangs))
        self.issuer: str = ready["issuer"]
        self.jwks_uri: str = ready["jwks_uri"]
        self.kid_prefix: str = ready["kid_prefix"]
        self._metadata: dict | None = None

    def _start(self, argv: list[str], ready_timeout: float) -> dict:
        self._log: deque[str] = deque(maxlen=200)
        # stdin stays open: its EOF (our close, or our death) stops the issuer.
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     cwd=OAUTH_DIR)
        threading.Thread(target=self._drain_stderr, args=(self.proc, self._log), daemon=True).start()
        try:
            return self._read_ready_line(ready_timeout)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _drain_stderr(proc: subprocess.Popen, log: deque) -> None:
        for line in iter(proc.stderr.readline, b""):
            log.append(line.decode(errors="replace").rstrip("\n"))

    def _threads(self) -> str:
        """`tid state wchan` of every thread of the issuer, for a hang's report."""
        rows = []
        for task in sorted(Path(f"/proc/{self.proc.pid}/task").glob("*")):
            try:
                state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
                rows.append(f"{task.name} {state} {(task / 'wchan').read_text()}")
            except OSError:
                continue
        return ", ".join(rows) or "?"

    def _read_ready_line(self, timeout: float) -> dict:
        fd = self.proc.stdout.fileno()
        buf = b""
        deadline = time.monotonic() + timeout
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise IssuerHung(f"no ready line within {timeout} s (threads: {self._threads()}; "
                                 f"stdout so far {buf!r}):\n{self.stderr()}")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 4096)
                if not chunk:
                    self.proc.wait(timeout=5)
                    raise RuntimeError(f"the OAuth issuer exited ({self.proc.returncode}):\n{self.stderr()}")
                buf += chunk
        return json.loads(buf.split(b"\n", 1)[0])

    def stderr(self) -> str:
        return "\n".join(self._log)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass

    # -- the issuer's documents -------------------------------------------------------------------
    def metadata(self) -> dict:
        """The authorization server metadata (from /.well-known/openid-configuration)."""
        if self._metadata is None:
            response = httpx.get(self.issuer + "/.well-known/openid-configuration", timeout=10)
            response.raise_for_status()
            self._metadata = response.json()
        return self._metadata

    def jwks(self) -> dict:
        response = httpx.get(self.jwks_uri, timeout=10)
        response.raise_for_status()
        return response.json()

    def rsa_public_pem(self) -> str:
        response = httpx.get(self.issuer + "/-/rsa-public-key.pem", timeout=10)
        response.raise_for_status()
        return response.text

    def rotate_keys(self) -> list[str]:
        """New signing keys (new kids; the old ones leave the JWKS). Returns the new kids."""
        response = httpx.post(self.issuer + "/-/rotate-keys", timeout=30)
        response.raise_for_status()
        return response.json()["kids"]

    # -- tokens -----------------------------------------------------------------------------------
    def authorize(self, user: str, resource: str | None, scope: str = DEFAULT_SCOPE, *, client_id: str = CLIENT_ID,
                  redirect_uri: str = REDIRECT_URI, extra: dict | None = None) -> tuple[str, str]:
        """Runs the authorization request and the login/consent interaction as `user`.
        Returns (code, code_verifier)."""
        verifier, challenge = pkce_pair()
        state = secrets.token_urlsafe(16)
        params = {
            "response_type": "code",
            "client_id": client_id,
            "redirect_uri": redirect_uri,
            "scope": scope,
            "state": state,
            "code_challenge": challenge,
            "code_challenge_method": "S256",
            "login_hint": user,
            **({"resource": resource} if resource else {}),
            **(extra or {}),
        }
        url = f"{self.metadata()['authorization_endpoint']}?{urlencode(params)}"
        query = complete_authorization(url, redirect_uri=redirect_uri)
        if "error" in query:
            raise OAuthError(f"authorization error: {query}")
        if query.get("state") != state:
            raise OAuthError(f"state mismatch in the redirect: {query}")
        return query["code"], verifier

    def token_response(self, user: str, resource: str | None, scope: str = DEFAULT_SCOPE, *,
                       client_id: str = CLIENT_ID) -> dict:
        """The token endpoint's whole answer for a fresh authorization-code + PKCE flow."""
        code, verifier = self.authorize(user, resource, scope, client_id=client_id)
        form = {
            "grant_type": "authorization_code",
            "code": code,
            "redirect_uri": REDIRECT_URI,
            "client_id": client_id,
            "code_verifier": verifier,
            **({"resource": resource} if resource else {}),
        }
        response = httpx.post(self.metadata()["token_endpoint"], data=form, timeout=30)
        if response.status_code != 200:
            raise OAuthError(f"token endpoint: HTTP {response.status_code} {response.text[:500]}")
        return response.json()

    def token(self, user: str, resource: str, scope: str = DEFAULT_SCOPE, *, client_id: str = CLIENT_ID) -> str:
        """A JWT access token for `user` (its `sub`) with `aud` = `resource` and the resource scopes
        of `scope` (space separated) in its `scope` claim."""
        return self.token_response(user, resource, scope, client_id=client_id)["access_token"]

    def expired_token(self, user: str, resource: str, scope: str = DEFAULT_SCOPE) -> str:
        """Properly signed, `exp` 5 minutes before it was issued."""
        return self.token(user, resource, scope, client_id=EXPIRED_CLIENT_ID)

    def not_yet_valid_token(self, user: str, resource: str, scope: str = DEFAULT_SCOPE) -> str:
        """Properly signed, `nbf` 5 minutes after it was issued."""
        return self.token(user, resource, scope, client_id=NOT_YET_VALID_CLIENT_ID)

    def within_leeway_token(self, user: str, resource: str, scope: str = DEFAULT_SCOPE) -> str:
        """Properly signed, `exp` 5 seconds before it was issued (valid with 30 s leeway)."""
        return self.token(user, resource, scope, client_id=WITHIN_LEEWAY_CLIENT_ID)

    def no_exp_token(self, user: str, resource: str, scope: str = DEFAULT_SCOPE) -> str:
        """Properly signed, without an `exp` claim."""
        return self.token(user, resource, scope, client_id=NO_EXP_CLIENT_ID)

    def string_nbf_token(self, user: str, resource: str, scope: str = DEFAULT_SCOPE) -> str:
        """Properly signed, `nbf` 5 minutes after it was issued, as a JSON string ("1767...")."""
        return self.token(user, resource, scope, client_id=STRING_NBF_CLIENT_ID)

    def string_exp_token(self, user: str, resource: str, scope: str = DEFAULT_SCOPE) -> str:
        """Properly signed, `exp` 5 minutes before it was issued, as a JSON string."""
        return self.token(user, resource, scope, client_id=STRING_EXP_CLIENT_ID)

    def other_iss_token(self, user: str, resource: str, scope: str = DEFAULT_SCOPE) -> str:
        """Signed with this issuer's key, but `iss` is the issuer URL with `/other` appended."""
        return self.token(user, resource, scope, client_id=OTHER_ISS_CLIENT_ID)

    def scp_token(self, user: str, resource: str, scope: str = DEFAULT_SCOPE) -> str:
        """The scopes as an `scp` array (as some issuers send them) instead of a `scope` string."""
        return self.token(user, resource, scope, client_id=SCP_CLIENT_ID)

    def forged_token(self, user: str, resource: str, scope: str = DEFAULT_SCOPE) -> str:
        """`iss` = this issuer and a kid this issuer has, but signed by another instance's key."""
        with issuer(alg=self.alg, forge_iss=self.issuer, kid_prefix=self.kid_prefix) as forger:
            return forger.token(user, resource, scope)


@contextmanager
def issuer(**options) -> Iterator[Issuer]:
    """A running issuer for the block (options: port, alg, discovery, forge_iss, kid_prefix,
    ready_timeout, attempts)."""
    iss = Issuer(**options)
    try:
        yield iss
    finally:
        iss.close()


@asynccontextmanager
async def async_issuer(**options) -> AsyncIterator[Issuer]:
    """`issuer()` for async code: start and stop run in a thread. Its token methods block (a
    second or less); call them through `asyncio.to_thread` where the event loop must not wait."""
    iss = await asyncio.to_thread(Issuer, **options)
    try:
        yield iss
    finally:
        await asyncio.to_thread(iss.close)


def other_issuer_token(user: str, resource: str, scope: str = DEFAULT_SCOPE, **options) -> tuple[str, str]:
    """(token, its issuer) from a second, short-lived issuer instance."""
    with issuer(**options) as other:
        return other.token(user, resource, scope), other.issuer


if __name__ == "__main__":  # a smoke test: python -m testkit.oauth [RESOURCE]
    import sys

    resource = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8080/mcp"
    with issuer() as iss:
        print("issuer", iss.issuer)
        for name, tok in [
            ("alice", iss.token("alice", resource)),
            ("bob openid only", iss.token("bob", resource, scope="openid")),
            ("expired", iss.expired_token("alice", resource)),
        ]:
            header, payload = decode(tok)
            print(name, json.dumps(header), json.dumps(payload))
