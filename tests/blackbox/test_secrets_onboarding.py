"""Secrets onboarding (docs/secrets-onboarding.md; issue 34): `secret_request` sends the
official client a URL-mode elicitation pointing at a one-time page of the server; the person
(here the elicitation callback, acting as a browser) opens it and posts the value. The model's
result says the secret is set and never holds the value; the page takes one value; a foreign
Origin is refused; a client without URL elicitation gets the page's address; the store keeps
values encrypted; no value reaches the server's log."""

from __future__ import annotations

import os
import stat
import subprocess
from urllib.parse import urlsplit

import httpx
import mcp.types as types
import pytest

from harness import BIN, BUSYBOX_ARGS

pytestmark = pytest.mark.anyio

VALUE = "ghp_onboarding-test-value-7f3a9c"
ARGS = [*BUSYBOX_ARGS, "--secret-tools"]
REQUEST = {
    "name": "GITHUB_TOKEN",
    "hosts": ["api.github.com"],
    "reason": "to open a <pull request> & comment",
}


def origin_of(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


class Browser:
    """The elicitation callback: opens the page the server points at and does `act` there,
    then answers the elicitation with `action`."""

    def __init__(self, act, action: str = "accept"):
        self.act = act
        self.action = action
        self.asked: list[dict] = []
        self.pages: list[tuple[int, str]] = []

    async def __call__(self, context, params):
        asked = params.model_dump(by_alias=True, exclude_none=True)
        self.asked.append(asked)
        assert asked.get("mode") == "url", asked
        async with httpx.AsyncClient(timeout=10) as client:
            page = await client.get(asked["url"])
            self.pages.append((page.status_code, page.text))
            await self.act(client, asked["url"])
        return types.ElicitResult(action=self.action)


async def post(client: httpx.AsyncClient, url: str, value: str, origin: str | None = None) -> httpx.Response:
    headers = {"Origin": origin or origin_of(url)}
    return await client.post(url, data={"value": value}, headers=headers)


async def test_issue_34_the_person_enters_a_secret_on_the_page_and_the_model_never_sees_it(kbb):
    # See: issue 34
    answers: list[httpx.Response] = []

    async def enter(client, url):
        answers.append(await post(client, url, VALUE))

    browser = Browser(enter)
    async with kbb.server(*ARGS, elicitation=browser) as srv:
        tools = [t["name"] for t in await srv.list_tools()]
        assert "secret_request" in tools
        res = await srv.call(REQUEST, name="secret_request", timeout=60)
        assert not res.is_error, res
        assert res.structured["status"] == "set", res
        assert res.structured["message"].startswith("secret GITHUB_TOKEN is set for api.github.com"), res
        assert VALUE not in str(res.raw)
        (asked,) = browser.asked
        url = asked["url"]
        assert "/secrets/enter/" in url and url.startswith("http://127.0.0.1:")
        assert len(url.rsplit("/", 1)[1]) >= 32
        assert "GITHUB_TOKEN" in asked["message"] and "api.github.com" in asked["message"]
        status, html = browser.pages[0]
        assert status == 200
        assert 'type="password"' in html
        assert "to open a &lt;pull request&gt; &amp; comment" in html
        assert answers[0].status_code == 200, answers[0].text
        assert VALUE not in answers[0].text
        # A second use is refused, and the page says so.
        async with httpx.AsyncClient(timeout=10) as client:
            again = await post(client, url, "another-value")
            assert again.status_code == 410, again.text
            assert (await client.get(url)).status_code == 410
            assert (await client.get(url.rsplit("/", 1)[0] + "/" + "0" * 48)).status_code == 404
        log = srv.stderr()
    assert VALUE not in log and "another-value" not in log
    assert "secret set" in log and "GITHUB_TOKEN" in log


async def test_issue_34_a_foreign_origin_is_refused_and_a_decline_withdraws_the_page(kbb):
    # See: issue 34
    answers: list[httpx.Response] = []

    async def forge(client, url):
        answers.append(await post(client, url, VALUE, origin="http://evil.example"))

    browser = Browser(forge, action="decline")
    async with kbb.server(*ARGS, elicitation=browser) as srv:
        res = await srv.call(REQUEST, name="secret_request", timeout=60)
        assert res.structured["status"] == "declined", res
        assert answers[0].status_code == 403
        url = browser.asked[0]["url"]
        async with httpx.AsyncClient(timeout=10) as client:
            assert (await post(client, url, VALUE)).status_code == 410
        log = srv.stderr()
    assert VALUE not in log


async def test_issue_34_bad_arguments_are_tool_errors_naming_them(kbb):
    # See: issue 34
    async with kbb.server(*ARGS) as srv:
        for arguments, named in [
            ({**REQUEST, "name": "github-token"}, "name: "),
            ({**REQUEST, "hosts": ["not a host"]}, "hosts: "),
            ({**REQUEST, "header": "X-Key without slot"}, "header: "),
        ]:
            res = await srv.call(arguments, name="secret_request", timeout=30)
            assert res.is_error and res.text.startswith(named), res


async def test_issue_34_without_url_elicitation_the_result_gives_the_page_and_the_store_keeps_it(kbb):
    # See: issue 34
    home = kbb.home()
    store = home / "secrets.store"
    async with kbb.server(*ARGS, "--secrets-store", str(store), home=home) as srv:
        res = await srv.call(REQUEST, name="secret_request", timeout=30)
        assert not res.is_error, res
        assert res.structured["status"] == "waiting", res
        url = res.structured["url"]
        assert url in res.structured["message"]
        async with httpx.AsyncClient(timeout=10) as client:
            assert (await post(client, url, VALUE)).status_code == 200
            assert (await post(client, url, VALUE)).status_code == 410
        log = srv.stderr()
    assert VALUE not in log
    key = store.with_name(store.name + ".key")
    for path in (store, key):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
    assert len(key.read_bytes()) == 32
    assert VALUE.encode() not in store.read_bytes()
    assert b"GITHUB_TOKEN" not in store.read_bytes()
    # The next start reads it back with its key.
    async with kbb.server(*ARGS, "--secrets-store", str(store), home=home) as srv:
        assert "secret_request" in [t["name"] for t in await srv.list_tools()]
    # A key others can read is refused at startup, before anything else.
    os.chmod(key, 0o640)
    proc = subprocess.run(
        [BIN, *ARGS, "--secrets-store", str(store)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=kbb.env(home),
        timeout=30,
    )
    assert proc.returncode == 1, proc
    assert "chmod 600" in proc.stderr and VALUE not in proc.stderr, proc.stderr


async def test_issue_34_over_http_the_page_needs_no_token_and_keeps_the_host_and_origin_checks(kbb):
    # See: issue 34
    async with kbb.http_server(*ARGS) as srv:
        async with kbb.http_session(srv) as session:
            res = await session.call(REQUEST, name="secret_request", timeout=30)
            assert res.structured["status"] == "waiting", res
            url = res.structured["url"]
            assert url.startswith(f"{srv.base_url}/secrets/enter/"), url
            # No Authorization header: the page's id is its capability.
            async with httpx.AsyncClient(timeout=10) as client:
                assert (await client.get(url, headers={"Host": "evil.example"})).status_code == 421
                assert (await client.get(url)).status_code == 200
                assert (await post(client, url, VALUE, origin="http://evil.example")).status_code == 403
                assert (await post(client, url, VALUE)).status_code == 200
                assert (await post(client, url, VALUE)).status_code == 410
        log = srv.stderr()
    assert VALUE not in log
    assert "secret set" in log
