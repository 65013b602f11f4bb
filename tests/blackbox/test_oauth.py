"""OAuth 2.1 resource server (docs/auth.md): `--transport http --oauth-issuer URL` against a real
authorization server on loopback (oidc-provider, tests/oauth/issuer.mjs, driven by
testkit/oauth.py), with tokens from real authorization-code + PKCE flows.

* the protected-resource metadata (RFC 9728) and the 401 challenge that points to it
* a token accepted: terminal_execute as `alice`, with each signing algorithm, with the
  issuer's OpenID-only discovery document, with scopes as `scp`, after a key rotation
* tokens refused with 401 `invalid_token` (audience, expiry, nbf, signature, issuer, forgery,
  `alg: none`, HS256 key confusion, garbage) or 403 `insufficient_scope`
* principals: each sees only its own computers; another's id answers exactly like an unknown
  one; both can have `dev-box`; container names and `kilntainers.owner` labels
* an http:// issuer off loopback is refused at startup, before any request
* the official SDK's own OAuth client (`OAuthClientProvider`) finds its way from the 401 alone

Computers of a principal other than `default` are `<id>.<16 hex of sha256(principal)>` on the
engine (label `kilntainers.computer-id` and name), which the harness's per-id teardown does not
know: the tests track those keys themselves (`track_scoped`) and delete permanent ones in the test.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import socket
import subprocess
import time
import uuid

import anyio
import httpx
import pytest

from harness import (
    BIN,
    BUSYBOX,
    BUSYBOX_ARGS,
    RUN_PREFIX,
    HttpRefused,
    HttpSession,
    apoll,
    containers_with_label,
    dump,
    free_port,
    inspect,
    is_running,
    sdk_httpx,
)
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from test_principals import ALICE, BOB
from testkit import mcp_http
from testkit import oauth
from testkit.oauth import alg_none, async_issuer, decode, hs256_key_confusion, tampered, with_claims

pytestmark = pytest.mark.anyio

# The exit status of a refused --oauth-issuer: 2 as docs/auth.md says (docs/decisions.md,
# "Exit codes and diagnostics" gives 1 to configuration errors and 2 to parser errors).
ISSUER_REFUSED_STATUS = 1
PRM_PATH = "/.well-known/oauth-protected-resource/mcp"
PRM_ROOT_PATH = "/.well-known/oauth-protected-resource"


# ---------------------------------------------------------------------------------------------
# helpers


def owner_tag(principal: str) -> str:
    return hashlib.sha256(principal.encode()).hexdigest()[:16]


def scoped(computer_id: str, principal: str) -> str:
    """The engine-side key of `principal`'s computer `computer_id` (label and container name)."""
    return computer_id if principal == "default" else f"{computer_id}.{owner_tag(principal)}"


def track_scoped(kbb, computer_id: str, *principals: str, temporary: bool | None = None) -> None:
    """Teardown removes these principals' containers for the id (and, for temporary=True,
    checks that the server removed them itself)."""
    for principal in principals:
        kbb.track(scoped(computer_id, principal), temporary=temporary)


def oauth_principal(iss: oauth.Issuer, value: str) -> str:
    """The principal of an OAuth token whose principal claim is `value` (docs/auth.md)."""
    return f"{iss.issuer.rstrip('/')}#{value}"


def owned_container(computer_id: str, principal: str) -> str | None:
    """The one container (any state) of `principal`'s computer `computer_id`, or None."""
    found = containers_with_label(f"kilntainers.computer-id={scoped(computer_id, principal)}")
    assert len(found) <= 1, f"more than one container for {principal}'s {computer_id}: {found}"
    return found[0] if found else None


def bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


async def token(iss: oauth.Issuer, method: str, *args, **kwargs) -> str:
    """An `Issuer` token method, off the event loop (it runs a whole HTTP flow)."""
    return await anyio.to_thread.run_sync(functools.partial(getattr(iss, method), *args, **kwargs))


_PARAM = re.compile(r'\s*([A-Za-z0-9_-]+)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^\s",]+))\s*(,|$)')


def parse_challenge(value: str | None) -> tuple[str, dict]:
    """(scheme, auth-params) of one `WWW-Authenticate` challenge (RFC 9110 section 11.6.1)."""
    assert value, "no WWW-Authenticate header"
    scheme, _, rest = value.strip().partition(" ")
    params: dict[str, str] = {}
    pos = 0
    while pos < len(rest):
        m = _PARAM.match(rest, pos)
        assert m, f"malformed WWW-Authenticate: {value!r}"
        key = m.group(1).lower()
        assert key not in params, f"duplicate {key} in {value!r}"
        params[key] = re.sub(r"\\(.)", r"\1", m.group(2)) if m.group(2) is not None else m.group(3)
        pos = m.end()
    return scheme, params


def initialize(srv, headers: dict | None = None, url: str | None = None) -> httpx.Response:
    body = mcp_http.initialize_body(client_name="kbb-oauth-raw")
    return mcp_http.post(url or srv.mcp_url, body, headers)


def delete_session(srv, response: httpx.Response, headers: dict) -> None:
    """Ends a session opened by a raw initialize (so its server-side state goes at once)."""
    session_id = response.headers.get("mcp-session-id")
    if session_id:
        httpx.delete(srv.mcp_url, headers={"Mcp-Session-Id": session_id, **headers}, timeout=30)


def assert_accepted(srv, tok: str, what: str) -> None:
    response = initialize(srv, bearer(tok))
    assert response.status_code == 200, (what, response.status_code, response.headers.get("www-authenticate"))
    delete_session(srv, response, bearer(tok))


def assert_refused(srv, tok: str, what: str, *, status: int = 401, error: str = "invalid_token",
                   scope: str | None = None) -> dict:
    """The refusal of an initialize with this token: status and challenge; returns the params."""
    response = initialize(srv, bearer(tok))
    assert response.status_code == status, (what, response.status_code, response.text)
    scheme, params = parse_challenge(response.headers.get("www-authenticate"))
    assert scheme.lower() == "bearer", (what, scheme)
    assert params.get("error") == error, (what, params)
    assert params.get("resource_metadata") == srv.base_url + PRM_PATH, (what, params)
    if error == "invalid_token":
        assert params.get("error_description"), (what, params)
    if scope is not None:
        assert params.get("scope") == scope, (what, params)
    # The refusal never echoes the token (in part or whole).
    signature = tok.rsplit(".", 1)[-1]
    for text in (response.text, response.headers.get("www-authenticate", "")):
        assert tok not in text and (len(signature) < 16 or signature not in text), (what, text)
    return params


# ---------------------------------------------------------------------------------------------
# (a) metadata and the challenge


@pytest.mark.parametrize("required", [None, "mcp:tools"], ids=["no-scope", "required-scope"])
async def test_resource_metadata_and_401_challenge(kbb, required):
    async with async_issuer() as iss:
        args = ["--oauth-issuer", iss.issuer, *(["--oauth-required-scope", required] if required else [])]
        async with kbb.http_server(*BUSYBOX_ARGS, *args) as srv:
            for path in (PRM_PATH, PRM_ROOT_PATH):
                response = httpx.get(srv.base_url + path, timeout=30)  # no credentials needed
                assert response.status_code == 200, (path, response.status_code, response.text)
                assert response.headers.get("content-type", "").startswith("application/json"), path
                document = response.json()
                expected = {
                    "resource": srv.mcp_url,
                    "authorization_servers": [iss.issuer],
                    "bearer_methods_supported": ["header"],
                }
                assert {k: document.get(k) for k in expected} == expected, (path, document)
                # (without a required scope the list may be empty or absent)
                assert document.get("scopes_supported", []) == (required.split() if required else []), document

            # No token: 401 with a challenge that names the metadata, and the scope to ask for
            # (RFC 6750 section 3.1: and no error code).
            response = initialize(srv)
            assert response.status_code == 401, response.status_code
            scheme, params = parse_challenge(response.headers.get("www-authenticate"))
            assert scheme.lower() == "bearer"
            assert params.get("resource_metadata") == srv.base_url + PRM_PATH, params
            assert params.get("scope") == required, params
            assert "error" not in params, params
            # Another scheme: refused, pointing to the metadata as well.
            response = initialize(srv, {"Authorization": "Basic YWxpY2U6c2VjcmV0"})
            assert response.status_code == 401, response.status_code
            scheme, params = parse_challenge(response.headers.get("www-authenticate"))
            assert scheme.lower() == "bearer" and params.get("resource_metadata") == srv.base_url + PRM_PATH, params
            # A GET (the SSE stream) is refused the same way.
            get = httpx.get(srv.mcp_url, headers={"Accept": "text/event-stream"}, timeout=30)
            assert get.status_code == 401 and "resource_metadata=" in get.headers.get("www-authenticate", "")
            # Tokens travel in the header only (bearer_methods_supported).
            good = await token(iss, "token", "alice", srv.mcp_url)
            query = initialize(srv, {}, url=f"{srv.mcp_url}?access_token={good}")
            assert query.status_code == 401, query.status_code
            # /healthz stays open.
            assert httpx.get(srv.base_url + "/healthz", timeout=30).status_code == 200


# ---------------------------------------------------------------------------------------------
# (b) tokens accepted


async def test_real_token_runs_a_command_as_its_subject(kbb):
    async with async_issuer() as iss:
        async with kbb.http_server(*BUSYBOX_ARGS, "--oauth-issuer", iss.issuer) as srv:
            tok = await token(iss, "token", "alice", srv.mcp_url)
            header, claims = decode(tok)
            assert (header["typ"], claims["sub"], claims["aud"], claims["iss"]) == ("at+jwt", "alice", srv.mcp_url, iss.issuer)
            async with kbb.http_session(srv, headers=bearer(tok)) as sess:
                result = (await sess.run("echo hi")).structured
                assert result["stdout"] == "hi\n" and result["exit_code"] == 0
                cid = result["computer_id"]
                assert "." not in cid, "a client saw the owner tag"
                alice = oauth_principal(iss, "alice")
                track_scoped(kbb, cid, alice, temporary=True)
                container = owned_container(cid, alice)
                assert container and is_running(container)
                info = inspect(container)
                assert info["Config"]["Labels"].get("kilntainers.owner") == alice, info["Config"]["Labels"]
                assert info["Name"] == f"/kilntainer-{cid}.{owner_tag(alice)}"
                assert all(status < 400 for method, status, _ in sess.responses if method == "POST"), sess.responses
        assert await apoll(lambda: owned_container(cid, alice) is None, 15, 0.2), "alice's temporary computer outlived her session"


@pytest.mark.parametrize("alg", ["RS256", "PS256", "ES256", "EdDSA"])
async def test_each_signing_algorithm_is_accepted(kbb, alg):
    async with async_issuer(alg=alg) as iss:
        async with kbb.http_server(*BUSYBOX_ARGS, "--oauth-issuer", iss.issuer) as srv:
            tok = await token(iss, "token", "alice", srv.mcp_url)
            assert decode(tok)[0]["alg"] == alg
            assert_accepted(srv, tok, alg)
            assert_refused(srv, tampered(tok), f"tampered {alg}")


async def test_openid_configuration_is_the_fallback_discovery_document(kbb):
    async with async_issuer(discovery="oidc") as iss:
        assert httpx.get(iss.issuer + "/.well-known/oauth-authorization-server", timeout=10).status_code == 404
        async with kbb.http_server(*BUSYBOX_ARGS, "--oauth-issuer", iss.issuer) as srv:
            assert_accepted(srv, await token(iss, "token", "alice", srv.mcp_url), "openid-configuration only")


async def test_required_scopes_from_scope_or_scp(kbb):
    async with async_issuer() as iss:
        required = "mcp:tools mcp:read"
        async with kbb.http_server(*BUSYBOX_ARGS, "--oauth-issuer", iss.issuer, "--oauth-required-scope", required) as srv:
            url = srv.mcp_url
            assert_accepted(srv, await token(iss, "token", "alice", url, scope="openid mcp:read mcp:tools"), "scope")
            assert_accepted(srv, await token(iss, "scp_token", "alice", url, scope="mcp:tools mcp:read"), "scp")
            for scope in ("mcp:tools", "mcp:read", "openid"):
                for method in ("token", "scp_token"):
                    tok = await token(iss, method, "alice", url, scope=scope)
                    params = assert_refused(srv, tok, f"{method} {scope}", status=403, error="insufficient_scope")
                    assert sorted(params["scope"].split()) == sorted(required.split()), params


async def test_expiry_leeway_accepts_a_token_just_expired(kbb):
    async with async_issuer() as iss:
        async with kbb.http_server(*BUSYBOX_ARGS, "--oauth-issuer", iss.issuer) as srv:
            tok = await token(iss, "within_leeway_token", "alice", srv.mcp_url)
            assert decode(tok)[1]["exp"] < decode(await token(iss, "token", "alice", srv.mcp_url))[1]["iat"]
            assert_accepted(srv, tok, "expired 5 s ago, within the 30 s leeway")


async def test_rotated_keys_are_fetched_again(kbb):
    async with async_issuer() as iss:
        async with kbb.http_server(*BUSYBOX_ARGS, "--oauth-issuer", iss.issuer) as srv:
            old = await token(iss, "token", "alice", srv.mcp_url)
            assert_accepted(srv, old, "before the rotation")  # the server now holds the first JWKS
            kids = await anyio.to_thread.run_sync(iss.rotate_keys)
            new = await token(iss, "token", "alice", srv.mcp_url)
            assert decode(new)[0]["kid"] in kids and decode(old)[0]["kid"] not in kids

            # An unknown kid makes the server fetch the JWKS again (allowing for a refetch
            # rate limit of up to a minute).
            def new_accepted() -> bool:
                return initialize(srv, bearer(new)).status_code == 200

            assert await apoll(new_accepted, 90, 1.0), "a token signed with a rotated-in key is still refused"
            # The key that left the JWKS verifies nothing any more.
            assert_refused(srv, old, "signed with a key no longer in the JWKS")


async def test_principal_claim_names_the_owner(kbb):
    async with async_issuer() as iss:
        args = ["--oauth-issuer", iss.issuer, "--oauth-principal-claim", "email"]
        async with kbb.http_server(*BUSYBOX_ARGS, *args) as srv:
            tok = await token(iss, "token", "alice", srv.mcp_url)
            async with kbb.http_session(srv, headers=bearer(tok)) as sess:
                cid = (await sess.run("true")).structured["computer_id"]
                principal = oauth_principal(iss, "alice@example.test")
                track_scoped(kbb, cid, principal, temporary=True)
                container = owned_container(cid, principal)
                assert container, "no container named for the email claim's principal"
                assert inspect(container)["Config"]["Labels"].get("kilntainers.owner") == principal


# ---------------------------------------------------------------------------------------------
# (c) tokens refused


async def test_invalid_tokens_are_refused_with_invalid_token(kbb):
    async with async_issuer() as iss, async_issuer() as other:
        args = ["--oauth-issuer", iss.issuer, "--oauth-required-scope", "mcp:tools"]
        async with kbb.http_server(*BUSYBOX_ARGS, *args) as srv:
            url = srv.mcp_url
            good = await token(iss, "token", "alice", url)
            assert_accepted(srv, good, "the control token")
            pem = await anyio.to_thread.run_sync(iss.rsa_public_pem)
            forged = await token(iss, "forged_token", "alice", url)
            assert decode(forged)[1]["iss"] == iss.issuer and decode(forged)[0]["kid"] == decode(good)[0]["kid"]
            cases = {
                "wrong audience": await token(iss, "token", "alice", "http://127.0.0.1:1/other"),
                "audience of another path": await token(iss, "token", "alice", srv.base_url + "/other"),
                "expired": await token(iss, "expired_token", "alice", url),
                "not yet valid": await token(iss, "not_yet_valid_token", "alice", url),
                "no exp": await token(iss, "no_exp_token", "alice", url),
                "bad signature": tampered(good),
                "claims changed after signing": with_claims(good, sub="bob"),
                "other issuer (its own keys and kids)": await token(other, "token", "alice", url),
                "another iss, signed with the right key": await token(iss, "other_iss_token", "alice", url),
                "forged: this issuer's iss and kid, another key": forged,
                "alg none": alg_none(good),
                "HS256 keyed with the RSA public key": hs256_key_confusion(good, pem),
                "not a JWT": "not-a-jwt",
                "two parts": ".".join(good.split(".")[:2]),
            }
            for what, tok in cases.items():
                assert_refused(srv, tok, what)
            # Through the SDK as well: refused before any session opens.
            with pytest.raises(HttpRefused) as refused:
                async with kbb.http_session(srv, headers=bearer(cases["expired"]), init_timeout=30):
                    pass
            assert refused.value.status_code == 401
            # Nothing above made a computer.
            assert srv.containers() == []


async def test_issue_30_times_written_as_strings_are_refused(kbb):
    """CVE-2026-25537: jsonwebtoken before 10.3 read an `nbf` (or `exp`) that is a JSON string as
    absent, so a token not valid for years passed. Both are refused now, and nothing is created."""
    # See: issue 30
    async with async_issuer() as iss:
        async with kbb.http_server(*BUSYBOX_ARGS, "--oauth-issuer", iss.issuer) as srv:
            string_nbf = await token(iss, "string_nbf_token", "alice", srv.mcp_url)
            claims = decode(string_nbf)[1]
            assert isinstance(claims["nbf"], str) and int(claims["nbf"]) > claims["iat"] + 200, claims
            string_exp = await token(iss, "string_exp_token", "alice", srv.mcp_url)
            claims = decode(string_exp)[1]
            assert isinstance(claims["exp"], str) and int(claims["exp"]) < time.time() - 200, claims
            assert_accepted(srv, await token(iss, "token", "alice", srv.mcp_url), "the control token")
            for what, tok, why in (
                ("nbf in the future, as a string", string_nbf, "the access token's nbf claim is not a number"),
                ("exp in the past, as a string", string_exp, "the access token has no usable exp claim"),
            ):
                params = assert_refused(srv, tok, what)
                assert params["error_description"] == why, (what, params)
            assert srv.containers() == []


async def test_missing_scope_is_403_insufficient_scope(kbb):
    async with async_issuer() as iss:
        args = ["--oauth-issuer", iss.issuer, "--oauth-required-scope", "mcp:tools"]
        async with kbb.http_server(*BUSYBOX_ARGS, *args) as srv:
            openid_only = await token(iss, "token", "alice", srv.mcp_url, scope="openid")
            assert "scope" not in decode(openid_only)[1], "oidc-provider puts no resource scope in this token"
            assert_refused(srv, openid_only, "openid only", status=403, error="insufficient_scope", scope="mcp:tools")
            other_scope = await token(iss, "token", "alice", srv.mcp_url, scope="mcp:read")
            assert_refused(srv, other_scope, "mcp:read only", status=403, error="insufficient_scope", scope="mcp:tools")


async def test_audience_flag_sets_the_resource(kbb):
    async with async_issuer() as iss:
        port = free_port()
        audience = f"http://127.0.0.1:{port}/public/mcp"  # e.g. the URL a proxy publishes
        args = ["--oauth-issuer", iss.issuer, "--oauth-audience", audience]
        async with kbb.http_server(*BUSYBOX_ARGS, *args) as srv:
            # The metadata URL of the challenge is the audience's (RFC 9728 section 3.1), and this
            # server answers its path too.
            challenge = parse_challenge(initialize(srv).headers.get("www-authenticate"))[1]
            published = f"http://127.0.0.1:{port}/.well-known/oauth-protected-resource/public/mcp"
            assert challenge.get("resource_metadata") == published, challenge
            for path in (PRM_ROOT_PATH, "/.well-known/oauth-protected-resource/public/mcp"):
                document = httpx.get(srv.base_url + path, timeout=30).json()
                assert document["resource"] == audience, (path, document)
            assert_accepted(srv, await token(iss, "token", "alice", audience), "the configured audience")
            refused = initialize(srv, bearer(await token(iss, "token", "alice", srv.mcp_url)))
            assert refused.status_code == 401, "a token for the default audience passed a server with --oauth-audience"
            assert parse_challenge(refused.headers.get("www-authenticate"))[1].get("error") == "invalid_token"


# ---------------------------------------------------------------------------------------------
# (d) principals


async def test_principals_see_and_reach_only_their_own_computers(kbb):
    dev = kbb.new_id("dev-box")
    only = kbb.new_id("alice-only")
    nope = kbb.new_id("nope")
    async with async_issuer() as iss:
        owner = {name: oauth_principal(iss, name) for name in ("alice", "bob")}
        track_scoped(kbb, dev, owner["alice"], owner["bob"])
        track_scoped(kbb, only, owner["alice"])
        track_scoped(kbb, only, owner["bob"], temporary=True)  # bob's own, made by his terminal_execute below
        track_scoped(kbb, nope, owner["bob"], temporary=True)
        async with kbb.http_server(*BUSYBOX_ARGS, "--lifecycle-tools", "--oauth-issuer", iss.issuer) as srv:
            alice_token = await token(iss, "token", "alice", srv.mcp_url)
            bob_token = await token(iss, "token", "bob", srv.mcp_url)
            async with kbb.http_session(srv, headers=bearer(alice_token)) as alice, \
                    kbb.http_session(srv, headers=bearer(bob_token)) as bob:
                # Both have a permanent dev-box: two containers, each named and labelled for its owner.
                made = {}
                for name, sess in (("alice", alice), ("bob", bob)):
                    created = await sess.call({"computer_id": dev, "temporary": False}, name="computer_create")
                    assert not created.is_error, (name, created.text)
                    assert created.structured["computer_id"] == dev, created.structured
                    made[name] = created.structured["sandbox_id"]
                    await sess.run(f"echo {name} > /root/who", computer_id=dev, temporary=False)
                assert made["alice"] != made["bob"]
                for name, sess in (("alice", alice), ("bob", bob)):
                    who = await sess.run("cat /root/who", computer_id=dev, temporary=False)
                    assert who.structured["stdout"] == f"{name}\n", (name, who.structured)
                    container = owned_container(dev, owner[name])
                    assert container and container.startswith(made[name])
                    info = inspect(container)
                    assert info["Name"] == f"/kilntainer-{dev}.{owner_tag(owner[name])}", info["Name"]
                    labels = info["Config"]["Labels"]
                    assert labels.get("kilntainers.owner") == owner[name], labels
                    assert labels.get("kilntainers.temporary") == "false" and labels.get("kilntainers.image") == BUSYBOX
                assert owned_container(dev, "default") is None, "a principal's computer took the bare name"

                # alice-only exists for alice alone.
                created = await alice.call({"computer_id": only, "temporary": False}, name="computer_create")
                assert not created.is_error, created.text
                await alice.run("echo secret > /root/secret", computer_id=only, temporary=False)
                alice_container = owned_container(only, owner["alice"])
                started = inspect(alice_container)["State"]["StartedAt"]

                listed = {}
                for name, sess in (("alice", alice), ("bob", bob)):
                    rows = (await sess.call({}, name="computer_list")).structured["computers"]
                    listed[name] = {row["computer_id"] for row in rows}
                    assert all("." not in row["computer_id"] for row in rows), rows
                    for row in rows:  # every row listed is the caller's own
                        container = owned_container(row["computer_id"], owner[name])
                        assert container and container.startswith(row["sandbox_id"]), (name, row)
                assert {dev, only} <= listed["alice"], listed
                assert dev in listed["bob"] and only not in listed["bob"], listed

                # bob on alice's id gets exactly what he gets for an id that never existed.
                for tool in ("computer_restart", "computer_factory_reset", "computer_delete"):
                    theirs = await bob.call({"computer_id": only}, name=tool)
                    never = await bob.call({"computer_id": nope}, name=tool)
                    assert theirs.is_error and never.is_error, (tool, theirs, never)
                    assert theirs.raw == json.loads(json.dumps(never.raw).replace(nope, only)), (tool, theirs.raw, never.raw)
                assert owned_container(only, owner["alice"]) == alice_container
                assert inspect(alice_container)["State"]["StartedAt"] == started, "bob's calls restarted alice's computer"

                # terminal_execute on alice's id makes bob a computer of his own, as for any new id.
                theirs = await bob.call({"command": "cat /root/secret", "computer_id": only})
                never = await bob.call({"command": "cat /root/secret", "computer_id": nope})
                for res in (theirs, never):
                    assert not res.is_error and res.structured["exit_code"] != 0 and res.structured["stdout"] == ""
                    res.structured.pop("exec_duration_ms")
                assert theirs.structured == {**never.structured, "computer_id": only}
                assert owned_container(only, owner["bob"]) not in (None, alice_container)
                mine = await alice.run("cat /root/secret", computer_id=only, temporary=False)
                assert mine.structured["stdout"] == "secret\n"
                assert is_running(alice_container) and inspect(alice_container)["State"]["StartedAt"] == started

                # A session belongs to its principal: bob's token on alice's session id is refused
                # like an unknown session.
                tools_list = {"jsonrpc": "2.0", "id": 7, "method": "tools/list"}
                crossed = mcp_http.post(srv.mcp_url, tools_list, {"Mcp-Session-Id": alice.session_id, **bearer(bob_token)})
                assert crossed.status_code == 404, (crossed.status_code, crossed.text)
                unknown = mcp_http.post(srv.mcp_url, tools_list, {"Mcp-Session-Id": str(uuid.uuid4()), **bearer(bob_token)})
                assert (crossed.status_code, crossed.text) == (unknown.status_code, unknown.text)

                # Each deletes its own permanent computers (the test's teardown cannot name them).
                for sess, cid in ((alice, dev), (alice, only), (bob, dev)):
                    deleted = await sess.call({"computer_id": cid}, name="computer_delete")
                    assert deleted.structured == {"ok": True, "computer_id": cid, "deleted": True}, deleted.text
                assert owned_container(dev, owner["alice"]) is None and owned_container(dev, owner["bob"]) is None
                assert owned_container(only, owner["alice"]) is None


async def test_default_principal_keeps_the_bare_container_name(kbb):
    cid = kbb.new_id("dev-box")
    async with kbb.server(*BUSYBOX_ARGS) as srv:  # stdio: the `default` principal
        await srv.run("true", computer_id=cid, temporary=False)
        container = owned_container(cid, "default")
        assert container, "default's computer is not labelled with its bare id"
        info = inspect(container)
        assert info["Name"] == f"/kilntainer-{cid}"
        assert info["Config"]["Labels"].get("kilntainers.owner") == "default", info["Config"]["Labels"]


# ---------------------------------------------------------------------------------------------
# (e) startup validation


@pytest.mark.parametrize("issuer_url", ["http://example.com", "http://0.0.0.0:{port}"], ids=["example.com", "0.0.0.0"])
@pytest.mark.parametrize("source", ["flag", "env"])
def test_plain_http_issuer_off_loopback_is_refused_at_startup(kbb, issuer_url, source):
    # A listener stands in for the issuer: 0.0.0.0 connects to this machine, and every proxy
    # variable points here, so a request made despite the refusal would land here.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.setblocking(False)
        trap = f"http://127.0.0.1:{listener.getsockname()[1]}"
        issuer_url = issuer_url.format(port=listener.getsockname()[1])
        env = {name: trap for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")}
        args = [BIN, "--transport", "http", "--host", "127.0.0.1", "--port", str(free_port()), *BUSYBOX_ARGS]
        if source == "flag":
            args += ["--oauth-issuer", issuer_url]
        else:
            env["KILNTAINERS_OAUTH_ISSUER"] = issuer_url
        home = kbb.home()
        proc = subprocess.run(args, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30,
                              env=kbb.env(home, env))
        assert proc.returncode == ISSUER_REFUSED_STATUS, (proc.returncode, proc.stderr)
        assert "--oauth-issuer" in proc.stderr, proc.stderr
        assert proc.stdout == ""
        assert kbb.instance_locks(home) == [], "a refused start left an instance lock"
        try:
            conn, _ = listener.accept()
            conn.close()
            pytest.fail("the server made a request before refusing its issuer")
        except BlockingIOError:
            pass


# ---------------------------------------------------------------------------------------------
# the SDK's own OAuth client


class MemoryTokenStorage:
    def __init__(self):
        self.tokens = None
        self.client_info = None

    async def get_tokens(self):
        return self.tokens

    async def set_tokens(self, tokens) -> None:
        self.tokens = tokens

    async def get_client_info(self):
        return self.client_info

    async def set_client_info(self, client_info) -> None:
        self.client_info = client_info


def sdk_oauth_provider(server_url: str, user: str):
    """The SDK's OAuthClientProvider, registering itself dynamically; its browser step is
    testkit's login as `user`. The 1.x callback returns (code, state), 2.x an
    AuthorizationCodeResult (with the RFC 9207 `iss`, which 2.x checks)."""
    from mcp.client.auth import OAuthClientProvider
    from mcp.shared.auth import OAuthClientMetadata

    try:
        from mcp.shared.auth import AuthorizationCodeResult
    except ImportError:  # mcp 1.x
        AuthorizationCodeResult = None

    redirect: dict = {}

    async def redirect_handler(authorization_url: str) -> None:
        redirect.clear()
        redirect.update(await anyio.to_thread.run_sync(oauth.complete_authorization, authorization_url, user))

    async def callback_handler():
        assert "code" in redirect, f"the authorization failed: {redirect}"
        if AuthorizationCodeResult is not None:
            return AuthorizationCodeResult(code=redirect["code"], state=redirect.get("state"), iss=redirect.get("iss"))
        return redirect["code"], redirect.get("state")

    storage = MemoryTokenStorage()
    metadata = OAuthClientMetadata(
        client_name="kbb-sdk-oauth",
        redirect_uris=[oauth.REDIRECT_URI],
        token_endpoint_auth_method="none",
        grant_types=["authorization_code", "refresh_token"],
        response_types=["code"],
    )
    provider = OAuthClientProvider(
        server_url=server_url,
        client_metadata=metadata,
        storage=storage,
        redirect_handler=redirect_handler,
        callback_handler=callback_handler,
    )
    return provider, storage


async def test_sdk_oauth_client_discovers_registers_and_calls(kbb):
    async with async_issuer() as iss:
        args = ["--oauth-issuer", iss.issuer, "--oauth-required-scope", "mcp:tools"]
        async with kbb.http_server(*BUSYBOX_ARGS, *args) as srv:
            provider, storage = sdk_oauth_provider(srv.mcp_url, "dave")
            seen: list[tuple[str, str, int]] = []

            async def record(response) -> None:
                seen.append((response.request.method, str(response.request.url), response.status_code))

            client = sdk_httpx.AsyncClient(auth=provider, timeout=sdk_httpx.Timeout(30.0, read=300.0),
                                           event_hooks={"response": [record]})
            async with client:
                async with streamable_http_client(srv.mcp_url, http_client=client) as streams:
                    async with ClientSession(streams[0], streams[1]) as session:
                        with anyio.fail_after(120):
                            init = await session.initialize()
                        sess = HttpSession(session, dump(init), srv.home, srv.errlog, srv.pidfile, srv.rcfile, kbb,
                                           instance_id=srv.instance_id)
                        result = (await sess.run("echo hi")).structured
                        assert result["stdout"] == "hi\n"
                        dave = oauth_principal(iss, "dave")
                        track_scoped(kbb, result["computer_id"], dave, temporary=True)
                        container = owned_container(result["computer_id"], dave)
                        assert container and inspect(container)["Config"]["Labels"].get("kilntainers.owner") == dave

            # The SDK found everything from the 401 alone and registered itself.
            assert storage.client_info is not None and storage.client_info.client_id not in (
                oauth.CLIENT_ID, None), storage.client_info
            claims = decode(storage.tokens.access_token)[1]
            assert (claims["sub"], claims["aud"], claims["iss"]) == ("dave", srv.mcp_url, iss.issuer), claims
            assert "mcp:tools" in claims["scope"].split(), claims
            urls = [url for _, url, _ in seen]
            assert srv.base_url + PRM_PATH in urls, seen
            assert any(status == 401 and url.startswith(srv.mcp_url) for _, url, status in seen), seen
            assert iss.issuer + "/reg" in urls and iss.issuer + "/token" in urls, seen


# ---------------------------------------------------------------------------------------------
# issue 30: tokens-file and OAuth principals are kept apart; names with invisible characters;
# a principal claim users can choose


def write_tokens_file(path, lines: dict) -> None:
    path.write_text("".join(f"{name} {secret}\n" for name, secret in lines.items()))
    path.chmod(0o600)


async def test_issue_30_oauth_subject_does_not_own_the_tokens_file_principals_computers(kbb, tmp_path):
    """A tokens-file principal `bob` and an OAuth token whose `sub` is `bob` are two principals:
    OAuth bob neither lists nor reaches tokens-file bob's permanent computer, and his own
    computer of the same slug is filed under `<issuer>#bob` (owner label and tag)."""
    # See: issue 30
    bob_secret = "bob-" + "b" * 40
    tokens = tmp_path / "tokens"
    write_tokens_file(tokens, {BOB: bob_secret})
    dev = kbb.new_id("dev-box")
    track_scoped(kbb, dev, BOB)
    async with async_issuer() as iss:
        # The OAuth subject is the tokens-file name, exactly.
        oauth_bob = oauth_principal(iss, BOB)
        track_scoped(kbb, dev, oauth_bob, temporary=True)
        args = ["--lifecycle-tools", "--oauth-issuer", iss.issuer, "--auth-tokens-file", str(tokens)]
        async with kbb.http_server(*BUSYBOX_ARGS, *args) as srv:
            oauth_token = await token(iss, "token", BOB, srv.mcp_url)
            assert decode(oauth_token)[1]["sub"] == BOB
            async with kbb.http_session(srv, headers=bearer(bob_secret)) as file_bob, \
                    kbb.http_session(srv, headers=bearer(oauth_token)) as token_bob:
                made = await file_bob.call({"computer_id": dev, "temporary": False}, name="computer_create")
                assert not made.is_error, made.text
                await file_bob.run("echo file-bob > /root/who", computer_id=dev, temporary=False)
                file_container = owned_container(dev, BOB)
                assert file_container and inspect(file_container)["Config"]["Labels"]["kilntainers.owner"] == BOB

                listed = (await token_bob.call({}, name="computer_list")).structured["computers"]
                assert dev not in [row["computer_id"] for row in listed], listed
                for tool in ("computer_restart", "computer_delete"):
                    refused = await token_bob.call({"computer_id": dev}, name=tool)
                    assert refused.is_error and f"Computer '{dev}' was not found." in refused.text, (tool, refused.text)
                mine = await token_bob.run("cat /root/who 2>/dev/null || echo fresh", computer_id=dev)
                assert mine.structured["stdout"] == "fresh\n", mine.structured
                container = owned_container(dev, oauth_bob)
                assert container and container != file_container
                info = inspect(container)
                assert info["Config"]["Labels"]["kilntainers.owner"] == oauth_bob, info["Config"]["Labels"]
                assert info["Name"] == f"/kilntainer-{dev}.{owner_tag(oauth_bob)}"

                # Tokens-file bob's computer is untouched and still his.
                still = await file_bob.run("cat /root/who", computer_id=dev, temporary=False)
                assert still.structured["stdout"] == "file-bob\n"
                deleted = await file_bob.call({"computer_id": dev}, name="computer_delete")
                assert not deleted.is_error, deleted.text
            log = srv.stderr()
        assert f"principal={oauth_bob}" in log, "the audit log does not name the OAuth principal"


async def test_issue_30_sub_default_is_not_the_default_principal(kbb):
    """`default` owns the single token's computers; an OAuth subject `default` is its issuer's
    `default`, with none of them."""
    # See: issue 30
    single = "single-" + "s" * 40
    old = kbb.new_id("legacy")
    async with async_issuer() as iss:
        track_scoped(kbb, old, oauth_principal(iss, "default"), temporary=True)
        args = ["--lifecycle-tools", "--oauth-issuer", iss.issuer, "--auth-token", single]
        async with kbb.http_server(*BUSYBOX_ARGS, *args) as srv:
            async with kbb.http_session(srv, headers=bearer(single)) as default:
                made = await default.call({"computer_id": old, "temporary": False}, name="computer_create")
                assert not made.is_error, made.text
                try:
                    tok = await token(iss, "token", "default", srv.mcp_url)
                    async with kbb.http_session(srv, headers=bearer(tok)) as other:
                        listed = (await other.call({}, name="computer_list")).structured["computers"]
                        assert old not in [row["computer_id"] for row in listed], listed
                        refused = await other.call({"computer_id": old}, name="computer_delete")
                        assert refused.is_error and "was not found" in refused.text, refused.text
                finally:
                    assert not (await default.call({"computer_id": old}, name="computer_delete")).is_error


async def test_issue_30_invisible_format_characters_are_refused_in_principal_names(kbb, tmp_path):
    """U+200B and the other Unicode format characters (general category Cf) make two names look
    the same: a tokens-file line with one is refused at startup (naming the line and the
    character), and an OAuth token whose principal claim has one is refused with 401."""
    # See: issue 30
    tokens = tmp_path / "tokens"
    for invisible in ("\u200b", "\u202e", "\u2060", "\ufeff"):
        tokens.write_text(f"{ALICE} {'a' * 40}\nbo{invisible}b-{RUN_PREFIX} {'b' * 40}\n")
        tokens.chmod(0o600)
        proc = subprocess.run(
            [BIN, "--transport", "http", "--port", str(free_port()), "--auth-tokens-file", str(tokens), *BUSYBOX_ARGS],
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60, env=kbb.env(kbb.home()),
        )
        assert proc.returncode == 1, (hex(ord(invisible)), proc.returncode, proc.stderr)
        assert "line 2" in proc.stderr and f"U+{ord(invisible):04X}" in proc.stderr, proc.stderr
    async with async_issuer() as iss:
        async with kbb.http_server(*BUSYBOX_ARGS, "--oauth-issuer", iss.issuer) as srv:
            assert_accepted(srv, await token(iss, "token", "bob", srv.mcp_url), "plain bob")
            hidden = await token(iss, "token", "bo\u200bb", srv.mcp_url)
            assert decode(hidden)[1]["sub"] == "bo\u200bb"
            params = assert_refused(srv, hidden, "a zero-width space in sub")
            assert params["error_description"] == "the access token's principal is not a valid name", params
            assert srv.containers() == []


@pytest.mark.parametrize("claim", ["email", "preferred_username", "sub"])
async def test_issue_30_a_principal_claim_users_can_choose_is_warned_about(kbb, claim):
    # See: issue 30
    async with async_issuer() as iss:
        async with kbb.http_server(*BUSYBOX_ARGS, "--oauth-issuer", iss.issuer, "--oauth-principal-claim", claim) as srv:
            log = srv.stderr()
    warning = f"kilntainers: warning: --oauth-principal-claim {claim}:"
    if claim == "sub":
        assert "--oauth-principal-claim" not in log, log
    else:
        assert warning in log, log
        assert "sub" in log.split(warning, 1)[1].splitlines()[0]


# ---------------------------------------------------------------------------------------------
# issue 30: the dashboard's sign-in relay registers and redeems only for this listener's page


def relay_post(srv, path: str, origin: str | None, body: dict | None = None, **headers) -> httpx.Response:
    """A POST as a browser's fetch() sends it from a page at `origin` to this server."""
    sent = {"Content-Type": "application/json", **headers}
    if origin is not None:
        sent["Origin"] = origin
    return httpx.post(srv.base_url + path, headers=sent, json=body or {}, timeout=30)


async def test_issue_30_sign_in_relay_serves_only_the_listeners_own_origin(kbb):
    """A page on another port of an allowed host (another local service, a computer's forwarded
    port) cannot have the relay register a client redirecting to itself, nor redeem a code for
    it: only the origin the dashboard is served from is a redirect URI. The relay is also
    rate-limited: a burst of registrations gets 429 with Retry-After beyond its allowance."""
    # See: issue 30
    async with async_issuer() as iss:
        args = ["--lifecycle-tools", "--oauth-issuer", iss.issuer, "--oauth-required-scope", "mcp:tools"]
        async with kbb.http_server(*BUSYBOX_ARGS, *args) as srv:
            own = srv.base_url
            other_port = free_port()
            grant = {"client_id": "x", "code": "not-a-code", "code_verifier": "v" * 43}
            for origin, why in (
                (f"http://127.0.0.1:{other_port}", "another port of an allowed host"),
                (f"http://localhost:{other_port}", "another port of another allowed name"),
                (f"https://127.0.0.1:{srv.port}", "another scheme"),
                (f"http://localhost:{srv.port}", "another host than the request's"),
            ):
                for path, body in (("/dashboard/oauth/register", None), ("/dashboard/oauth/token", grant)):
                    response = relay_post(srv, path, origin, body)
                    assert response.status_code in (400, 403), (why, path, response.status_code, response.text)
                    assert "client_id" not in response.json() and "access_token" not in response.json(), response.text
            # A browser says when a request is not from the same origin; such a request is refused.
            cross = relay_post(srv, "/dashboard/oauth/register", own, **{"Sec-Fetch-Site": "same-site"})
            assert cross.status_code == 403, (cross.status_code, cross.text)

            # The page itself registers (redirect URI: its own address).
            page = relay_post(srv, "/dashboard/oauth/register", own, **{"Sec-Fetch-Site": "same-origin"})
            assert page.status_code == 200, page.text
            assert page.json()["redirect_uri"] == own + "/"

            # A burst of registrations is cut off, with a Retry-After.
            answers = [relay_post(srv, "/dashboard/oauth/register", own) for _ in range(40)]
            codes = [a.status_code for a in answers]
            assert 429 in codes, codes
            assert codes.count(200) < 20, codes
            limited = next(a for a in answers if a.status_code == 429)
            assert int(limited.headers["retry-after"]) >= 1, limited.headers
            assert limited.json()["error"] == "temporarily_unavailable", limited.text
            # The issuer saw only the registrations let through.
            log = srv.stderr()
            assert log.count("registered a dashboard client") == 1 + codes.count(200), codes
