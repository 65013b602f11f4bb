// The web dashboard's OAuth sign-in (docs/auth.md, "Web dashboard sign-in"): the real server in
// HTTP mode with --oauth-issuer naming the local test issuer (tests/oauth/issuer.mjs,
// oidc-provider), headless Debian Chromium signing in through the issuer's own login form, and
// two principals who each see only their own computers.
//
// Subjects carry a suffix unique to this run (alice-<hex>), and principals their issuer's URL
// (<issuer>#alice-<hex>), so that removing every container labelled kilntainers.owner=<principal>
// at the end touches nothing of another run.
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { createHash, randomBytes } from "node:crypto";
import { existsSync } from "node:fs";
import { createServer } from "node:http";
import { join } from "node:path";
import { createInterface } from "node:readline";
import { after, before, describe } from "node:test";

import { Client, StreamableHTTPClientTransport } from "@modelcontextprotocol/client";

import {
  OUTPUT_DIR,
  REPO_ROOT,
  assertPrerequisites,
  containersOwnedBy,
  docker,
  ensureOutputDir,
  freePort,
  launchBrowser,
  ownedContainerName,
  removeOwnedBy,
  startHttpServer,
  statusWaiter,
  stepsInOrder,
  uniqueId,
  waitFor,
} from "./lib/harness.mjs";

const OAUTH_DIR = join(REPO_ROOT, "tests", "oauth");
// The page's policy is the same with OAuth on: the server relays what the page would fetch.
const WEB_CSP =
  "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";
// Where the page keeps things (src/dashboard/index.html).
const TOKEN_KEY = "kilntainers-access-token";
const CLIENT_KEY = "kilntainers-oauth-client ";
const SCOPE = "mcp:tools";
const CONNECTED = /^(Connected|\d+ computers?)$/;
const RUN = randomBytes(3).toString("hex");
const ALICE = `alice-${RUN}`;
const BOB = `bob-${RUN}`;
const CAROL = `carol-${RUN}`;
const NAMES = [ALICE, BOB, CAROL];
/** The principal of a token of `issuer` whose subject is `name` (docs/auth.md, "Who is calling"). */
const principal = (issuer, name) => `${issuer.issuer}#${name}`;

/**
 * tests/oauth/issuer.mjs on a free loopback port: resolves {issuer, close()} once it printed its
 * one JSON line. It stops at EOF on its stdin, which close() gives it. Node has been seen, rarely
 * and only under CI load, to hang at startup printing nothing (a normal start takes about half a
 * second): such a start is killed and tried again, up to three times (testkit/oauth.py does the
 * same); an issuer that exits is an error at once.
 */
async function startIssuer() {
  if (!existsSync(join(OAUTH_DIR, "node_modules", "oidc-provider"))) {
    throw new Error("missing prerequisite: the OAuth test issuer's packages (npm ci in tests/oauth; scripts/browser-test.sh does it)");
  }
  const hangs = [];
  for (let attempt = 0; attempt < 3; attempt++) {
    const started = await startIssuerOnce(20_000);
    if (started.issuer) return started;
    hangs.push(started.hung);
  }
  throw new Error(`the issuer hung at startup 3 times:\n${hangs.join("\n")}`);
}

/** One start: {issuer, close()} when ready, {hung} when nothing was printed within `ms`. */
async function startIssuerOnce(ms) {
  const child = spawn(process.execPath, [join(OAUTH_DIR, "issuer.mjs"), "0"], { stdio: ["pipe", "pipe", "pipe"] });
  let stderr = "";
  child.stderr.on("data", (c) => (stderr += c));
  let exited = false;
  child.on("exit", () => (exited = true));
  let timer;
  const line = await new Promise((ok, fail) => {
    createInterface({ input: child.stdout }).once("line", ok);
    child.once("exit", (code) => fail(new Error(`the issuer exited (${code}): ${stderr}`)));
    timer = setTimeout(() => ok(null), ms);
  }).finally(() => clearTimeout(timer));
  if (line === null) {
    child.kill("SIGKILL");
    return { hung: `no ready line within ${ms} ms: ${stderr}` };
  }
  return {
    issuer: JSON.parse(line).issuer,
    async close() {
      if (exited) return;
      child.stdin.end();
      await waitFor(() => exited, 10_000, "the issuer to exit").catch(() => child.kill("SIGKILL"));
    },
  };
}

/** Every request a page makes (navigations and redirects included), in order. */
function record(page) {
  const seen = [];
  page.on("request", (r) => seen.push({ url: r.url(), method: r.method(), headers: r.headers(), body: r.postData() }));
  page.on("pageerror", (e) => console.error(`[page error] ${e.message}`));
  return seen;
}

const payload = (jwt) => JSON.parse(Buffer.from(jwt.split(".")[1], "base64url").toString());
const storedToken = (page) => page.evaluate((key) => sessionStorage.getItem(key), TOKEN_KEY);
const statusText = async (page) => (await page.locator("#status").textContent()) ?? "";

/**
 * Clicks the page's "Sign in", answers the issuer's login form as `principal` when it asks
 * (it does not when this browser is still signed in there), and waits until the page is back,
 * has redeemed the code and is connected. Returns whether the login form was answered.
 */
async function signInAs(page, seen, serverUrl, principal) {
  const from = seen.length;
  await page.getByRole("button", { name: "Sign in", exact: true }).click();
  let typed = false;
  const signedIn = waitFor(
    async () => {
      const url = new URL(page.url());
      if (url.pathname.startsWith("/interaction/") && !typed) {
        const login = page.locator('input[name="login"]');
        if ((await login.count()) === 0) return false;
        await login.fill(principal);
        typed = true;
        await page.getByRole("button", { name: "Sign in" }).click();
        return false;
      }
      const back = seen.slice(from).some((r) => r.url.startsWith(`${serverUrl}/?`) && new URL(r.url).searchParams.has("code"));
      return back && url.origin === serverUrl && CONNECTED.test(await statusText(page));
    },
    30_000,
    `the dashboard to be signed in as ${principal}`,
  );
  await signedIn.catch(async (error) => {
    const where = page.url();
    const shown = where.startsWith(serverUrl) ? await statusText(page) : (await page.locator("body").textContent().catch(() => "")).slice(0, 500);
    throw new Error(`${error.message} (at ${where}: ${shown})`);
  });
  return typed;
}

/** Waits until the page has listed its computers (the silent first listing keeps "Connected"). */
async function listed(page, count) {
  await waitFor(
    async () => (await page.locator("#count").textContent()) === String(count) && !(await page.locator("#empty").textContent()).startsWith("Loading"),
    20_000,
    `${count} computers listed`,
  );
}

/** The issuer's query parameters of the page's last authorization request since `from`. */
function authorizationRequest(seen, issuer, from = 0) {
  const request = seen.slice(from).filter((r) => r.url.startsWith(`${issuer}/auth?`)).at(-1);
  assert.ok(request, "no authorization request");
  return new URL(request.url).searchParams;
}

const posts = (seen, path) => seen.filter((r) => r.method === "POST" && new URL(r.url).pathname === path);

/** An MCP client of the server acting with `token`. */
async function mcpClient(serverUrl, token) {
  const client = new Client({ name: "kilntainers-browser-tests", version: "1.0.0" }, { capabilities: {} });
  await client.connect(
    new StreamableHTTPClientTransport(new URL(`${serverUrl}/mcp`), {
      requestInit: { headers: { Authorization: `Bearer ${token}` } },
    }),
  );
  return client;
}

const resultText = (result) => (result.content ?? []).map((c) => c.text ?? "").join("\n");

/**
 * A properly signed access token for `principal` that expired five minutes ago: the issuer's
 * `kilntainers-test-expired` client, through a new page of `context` (still signed in at the
 * issuer), its code read from the redirect to the native-app callback nobody serves.
 */
async function expiredToken(context, issuer, resource, principal) {
  const verifier = randomBytes(32).toString("base64url");
  const redirect = "http://127.0.0.1/callback";
  const auth = new URL(`${issuer}/auth`);
  for (const [key, value] of Object.entries({
    response_type: "code",
    client_id: "kilntainers-test-expired",
    redirect_uri: redirect,
    code_challenge: createHash("sha256").update(verifier).digest("base64url"),
    code_challenge_method: "S256",
    state: randomBytes(8).toString("hex"),
    resource,
    scope: SCOPE,
    login_hint: principal,
  })) {
    auth.searchParams.set(key, value);
  }
  const page = await context.newPage();
  try {
    const callback = page.waitForRequest((r) => r.url().startsWith(`${redirect}?`), { timeout: 20_000 });
    page.goto(auth.href).catch(() => {}); // the navigation ends at the callback, which fails
    const code = new URL((await callback).url()).searchParams.get("code");
    assert.ok(code, "the issuer gave no code");
    const res = await fetch(`${issuer}/token`, {
      method: "POST",
      body: new URLSearchParams({
        grant_type: "authorization_code",
        code,
        redirect_uri: redirect,
        client_id: "kilntainers-test-expired",
        code_verifier: verifier,
        resource,
      }),
    });
    const answer = await res.json();
    assert.ok(answer.access_token, JSON.stringify(answer));
    assert.ok(payload(answer.access_token).exp < Date.now() / 1000, "the token has not expired");
    return answer.access_token;
  } finally {
    await page.close();
  }
}

describe("web dashboard sign-in with OAuth (dynamic client registration)", () => {
  const ALICE_ID = uniqueId("oauth-alice");
  const step = stepsInOrder();
  let issuer;
  let server;
  let alice;
  let bob;
  let aliceSeen;
  let bobSeen;
  let aliceToken;
  let aliceContainer;

  before(async () => {
    assertPrerequisites();
    ensureOutputDir();
    issuer = await startIssuer();
    server = await startHttpServer({ extraArgs: ["--oauth-issuer", issuer.issuer, "--oauth-required-scope", SCOPE] });
    alice = await launchBrowser({ viewport: { width: 1100, height: 900 } });
    aliceSeen = record(alice.page);
  });

  after(async () => {
    await alice?.close();
    await bob?.close();
    await server?.close();
    await issuer?.close();
    if (issuer) removeOwnedBy(NAMES.map((name) => principal(issuer, name)));
  });

  step("GET / keeps the page's policy and offers sign-in after the OAuth 401", async () => {
    const page = alice.page;
    const res = await page.goto(`${server.url}/`);
    assert.equal(res.status(), 200);
    assert.equal(res.headers()["content-security-policy"], WEB_CSP);
    await waitFor(() => page.locator("#signin").isVisible(), 15_000, "the sign-in button");
    await statusWaiter(() => page.locator("#status"))("Sign in to use this server.", 10_000);
    await waitFor(async () => /^with 127\.0\.0\.1:\d+, or enter an access token below$/.test(await page.locator("#signin-hint").textContent()), 10_000, "the issuer in the hint");
    // The token field stays, for any token the server takes.
    assert.equal(await page.getByLabel("Access token").isVisible(), true);
    assert.equal(await page.locator("#account").isVisible(), false);
    const gets = aliceSeen.filter((r) => r.method === "GET").map((r) => new URL(r.url).pathname);
    assert.ok(gets.includes("/.well-known/oauth-protected-resource/mcp"), "no protected-resource metadata read");
    assert.ok(gets.includes("/dashboard/oauth"), "no sign-in endpoints read");
    // Nothing but this origin was fetched: the issuer only sees navigations.
    assert.deepEqual(aliceSeen.filter((r) => !r.url.startsWith(`${server.url}/`)), []);
    await page.screenshot({ path: join(OUTPUT_DIR, "oauth-sign-in.png"), fullPage: true });
  });

  step("signs in as alice at the issuer: registration, PKCE S256, state, resource and scope", async () => {
    const page = alice.page;
    const typed = await signInAs(page, aliceSeen, server.url, ALICE);
    assert.equal(typed, true, "the issuer's login form was not shown");
    // One public client registered through the server, for this page's address.
    const registrations = posts(aliceSeen, "/dashboard/oauth/register");
    assert.equal(registrations.length, 1);
    const clientId = await page.evaluate((key) => localStorage.getItem(key), CLIENT_KEY + issuer.issuer);
    assert.ok(clientId, "the registered client is not remembered");
    const q = authorizationRequest(aliceSeen, issuer.issuer);
    assert.equal(q.get("response_type"), "code");
    assert.equal(q.get("client_id"), clientId);
    assert.equal(q.get("redirect_uri"), `${server.url}/`);
    assert.equal(q.get("code_challenge_method"), "S256");
    assert.equal(q.get("resource"), `${server.url}/mcp`);
    assert.equal(q.get("scope"), SCOPE);
    assert.ok((q.get("state") ?? "").length >= 20, "no state");
    // The answer came back with the same state and the issuer's iss, and left the address bar.
    const answer = aliceSeen.find((r) => r.url.startsWith(`${server.url}/?`) && r.url.includes("code="));
    const back = new URL(answer.url).searchParams;
    assert.equal(back.get("state"), q.get("state"));
    assert.equal(back.get("iss"), issuer.issuer);
    assert.equal(new URL(page.url()).search, "", "the code stayed in the address bar");
    // The code was redeemed through the server with the verifier behind the challenge.
    const exchanges = posts(aliceSeen, "/dashboard/oauth/token");
    assert.equal(exchanges.length, 1);
    const sent = JSON.parse(exchanges[0].body);
    assert.equal(sent.client_id, clientId);
    assert.equal(sent.code, back.get("code"));
    assert.equal(createHash("sha256").update(sent.code_verifier).digest("base64url"), q.get("code_challenge"));
    // The access token is the issuer's, for this server, and the bearer of every /mcp request.
    aliceToken = await storedToken(page);
    const claims = payload(aliceToken);
    assert.equal(claims.sub, ALICE);
    assert.equal(claims.aud, `${server.url}/mcp`);
    assert.equal(claims.iss, issuer.issuer);
    assert.match(claims.scope, /(^| )mcp:tools( |$)/);
    const init = aliceSeen.filter((r) => new URL(r.url).pathname === "/mcp" && r.body?.includes('"initialize"')).at(-1);
    assert.equal(init.headers.authorization, `Bearer ${aliceToken}`);
    assert.equal(await page.locator("#who").textContent(), `Signed in as ${principal(issuer, ALICE)}`);
    assert.equal(await page.locator("#account").isVisible(), true);
    assert.equal(await page.locator("#auth").isVisible(), false);
  });

  step("alice creates a permanent computer and sees it listed", async () => {
    const page = alice.page;
    const waitStatus = statusWaiter(() => page.locator("#status"));
    await page.locator("#new-id").fill(ALICE_ID);
    await page.locator("#temporary").uncheck();
    await page.getByRole("button", { name: "Create computer" }).click();
    await waitStatus(`Computer ${ALICE_ID} is ready.`, 90_000);
    assert.equal(await page.locator(`li[data-id="${ALICE_ID}"] .pill`).textContent(), "permanent");
    // Provider-side the computer carries alice's tag and owner label (docs/auth.md).
    assert.deepEqual(containersOwnedBy(principal(issuer, ALICE)), [ownedContainerName(ALICE_ID, principal(issuer, ALICE))]);
    aliceContainer = docker(["inspect", "-f", "{{.Id}}", ownedContainerName(ALICE_ID, principal(issuer, ALICE))]);
    await page.locator("#command").fill("echo alice-secret > /root/secret && cat /root/secret");
    await page.getByRole("button", { name: "Run command" }).click();
    await waitStatus("Command finished with exit 0.", 60_000);
    assert.match((await page.locator("#output").textContent()) ?? "", /\nalice-secret\n\[exit 0 · \d+ ms\]/);
    await page.screenshot({ path: join(OUTPUT_DIR, "oauth-signed-in.png"), fullPage: true });
  });

  step("bob, in a second browser, signs in and sees none of alice's computers", async () => {
    bob = await launchBrowser({ viewport: { width: 1100, height: 900 } });
    bobSeen = record(bob.page);
    await bob.page.goto(`${server.url}/`);
    await waitFor(() => bob.page.locator("#signin").isVisible(), 15_000, "bob's sign-in button");
    assert.equal(await signInAs(bob.page, bobSeen, server.url, BOB), true);
    await listed(bob.page, 0);
    assert.equal(await bob.page.locator("li[data-id]").count(), 0);
    assert.equal(await bob.page.locator("#who").textContent(), `Signed in as ${principal(issuer, BOB)}`);
    assert.equal(payload(await storedToken(bob.page)).sub, BOB);
  });

  step("alice's computer id is not found for bob, and typed by bob it names his own computer", async () => {
    const client = await mcpClient(server.url, await storedToken(bob.page));
    try {
      const restart = await client.callTool({ name: "computer_restart", arguments: { computer_id: ALICE_ID } });
      assert.equal(restart.isError, true);
      assert.match(resultText(restart), new RegExp(`Computer '${ALICE_ID}' was not found\\.`));
      const list = await client.callTool({ name: "computer_list", arguments: {} });
      assert.ok(!resultText(list).includes(ALICE_ID), "bob's computer_list names alice's computer");
    } finally {
      await client.close().catch(() => {});
    }
    const page = bob.page;
    const waitStatus = statusWaiter(() => page.locator("#status"));
    await page.locator("#new-id").fill(ALICE_ID);
    await page.getByRole("button", { name: "Create computer" }).click();
    await waitStatus(`Computer ${ALICE_ID} is ready.`, 90_000);
    assert.equal(await page.locator("li[data-id]").count(), 1);
    assert.deepEqual(containersOwnedBy(principal(issuer, BOB)), [ownedContainerName(ALICE_ID, principal(issuer, BOB))]);
    await page.locator("#command").fill("cat /root/secret");
    await page.getByRole("button", { name: "Run command" }).click();
    await waitStatus("Command finished with exit 1.", 60_000);
    assert.doesNotMatch((await page.locator("#output").textContent()) ?? "", /alice-secret/);
    // Alice's computer is untouched: the same container.
    assert.equal(docker(["inspect", "-f", "{{.Id}}", ownedContainerName(ALICE_ID, principal(issuer, ALICE))]), aliceContainer);
  });

  step("alice still sees only her own computer", async () => {
    const page = alice.page;
    const waitStatus = statusWaiter(() => page.locator("#status"));
    await page.getByRole("button", { name: "Refresh", exact: true }).click();
    await waitStatus("1 computer", 20_000);
    assert.deepEqual(await page.locator("li[data-id]").evaluateAll((rows) => rows.map((r) => r.dataset.id)), [ALICE_ID]);
    await page.locator(`li[data-id="${ALICE_ID}"]`).click();
    await page.locator("#command").fill("cat /root/secret");
    await page.getByRole("button", { name: "Run command" }).click();
    await waitStatus("Command finished with exit 0.", 60_000);
    assert.match((await page.locator("#output").textContent()) ?? "", /\nalice-secret\n\[exit 0 · \d+ ms\]/);
  });

  step("a token that expires later shows the sign-in again, which reuses the registered client", async () => {
    const page = alice.page;
    const expired = await expiredToken(alice.context, issuer.issuer, `${server.url}/mcp`, ALICE);
    // The page's next /mcp request carries a real, expired token of alice's.
    const mcp = `${server.url}/mcp`;
    await page.route(mcp, (route) =>
      route.continue({ headers: { ...route.request().headers(), authorization: `Bearer ${expired}` } }),
    );
    try {
      await page.getByRole("button", { name: "Refresh", exact: true }).click();
      await statusWaiter(() => page.locator("#status"))("Signed out: the access token has expired.", 20_000);
    } finally {
      await page.unroute(mcp);
    }
    assert.equal(await page.locator("#signin").isVisible(), true);
    assert.equal(await page.locator("#account").isVisible(), false);
    assert.equal(await storedToken(page), null, "the refused token is still kept");
    await signInAs(page, aliceSeen, server.url, ALICE);
    assert.equal(posts(aliceSeen, "/dashboard/oauth/register").length, 1, "registered a second client");
    assert.equal(await page.locator("#who").textContent(), `Signed in as ${principal(issuer, ALICE)}`);
    await listed(page, 1);
    aliceToken = await storedToken(page);
    assert.equal(payload(aliceToken).sub, ALICE);
  });

  step("a page on another port of the same host cannot use the sign-in relay", async () => {
    // See: issue 30. What a computer's page behind a port_url forwarder, or any other local
    // service, could do from the user's browser: POSTs the browser sends without a preflight.
    const attackerPort = await freePort();
    const attacker = createServer((_req, res) => {
      res.setHeader("content-type", "text/html");
      res.end(`<!doctype html><title>loading</title><script>
        (async () => {
          const body = JSON.stringify({ client_id: "x", code: "y", code_verifier: "v".repeat(43) });
          for (const path of ["/dashboard/oauth/register", "/dashboard/oauth/token"]) {
            await fetch(${JSON.stringify(server.url)} + path, { method: "POST", mode: "no-cors", body }).catch(() => {});
          }
          document.title = "done";
        })();
      </script>`);
    });
    await new Promise((ok) => attacker.listen(attackerPort, "127.0.0.1", ok));
    const page = await alice.context.newPage();
    const statuses = [];
    page.on("response", (r) => {
      if (new URL(r.url()).pathname.startsWith("/dashboard/oauth/")) statuses.push([new URL(r.url()).pathname, r.status()]);
    });
    try {
      await page.goto(`http://127.0.0.1:${attackerPort}/`);
      await waitFor(async () => (await page.title()) === "done", 15_000, "the other page's requests");
      await waitFor(() => statuses.length === 2, 5_000, "both responses");
    } finally {
      await page.close();
      attacker.closeAllConnections();
      await new Promise((ok) => attacker.close(ok));
    }
    assert.deepEqual(statuses, [["/dashboard/oauth/register", 403], ["/dashboard/oauth/token", 403]]);
    assert.ok(!server.stderr().includes(`redirect_uri=http://127.0.0.1:${attackerPort}/`), "a client was registered for the other page");
  });

  step("Sign out forgets the token, ends the session and keeps the permanent computer", async () => {
    const page = alice.page;
    const from = aliceSeen.length;
    await page.getByRole("button", { name: "Sign out" }).click();
    await statusWaiter(() => page.locator("#status"))("Signed out.", 10_000);
    assert.equal(await storedToken(page), null);
    assert.equal(await page.locator("#signin").isVisible(), true);
    assert.equal(await page.locator("#account").isVisible(), false);
    assert.equal(await page.locator("li[data-id]").count(), 0, "alice's list is still shown");
    await waitFor(
      () => aliceSeen.slice(from).some((r) => r.method === "DELETE" && r.headers.authorization === `Bearer ${aliceToken}`),
      10_000,
      "DELETE /mcp with alice's token",
    );
    assert.deepEqual(containersOwnedBy(principal(issuer, ALICE)), [ownedContainerName(ALICE_ID, principal(issuer, ALICE))]);
  });
});

describe("web dashboard sign-in with a pre-registered client (--oauth-dashboard-client-id)", () => {
  const step = stepsInOrder();
  let issuer;
  let server;
  let carol;
  let seen;
  let clientId;

  before(async () => {
    assertPrerequisites();
    issuer = await startIssuer();
    // The operator's part: a public client whose redirect URI is the dashboard's address.
    const port = await freePort();
    const res = await fetch(`${issuer.issuer}/reg`, {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({
        client_name: "pre-registered dashboard",
        redirect_uris: [`http://127.0.0.1:${port}/`],
        grant_types: ["authorization_code"],
        response_types: ["code"],
        token_endpoint_auth_method: "none",
        scope: SCOPE,
      }),
    });
    clientId = (await res.json()).client_id;
    assert.ok(clientId, `registration answered ${res.status}`);
    // `=` form: the issuer's ids are nanoids, whose alphabet has `-`; one that starts with it
    // would be read by clap as the next flag (this failed a CI run, about 1 start in 64).
    server = await startHttpServer({
      port,
      extraArgs: ["--oauth-issuer", issuer.issuer, "--oauth-required-scope", SCOPE, `--oauth-dashboard-client-id=${clientId}`],
    });
    carol = await launchBrowser({ viewport: { width: 1100, height: 900 } });
    seen = record(carol.page);
  });

  after(async () => {
    await carol?.close();
    await server?.close();
    await issuer?.close();
    if (issuer) removeOwnedBy(NAMES.map((name) => principal(issuer, name)));
  });

  step("the sign-in routes name the client, refuse what is not the page's, and pass on the issuer's refusals", async () => {
    const endpoints = await fetch(`${server.url}/dashboard/oauth`);
    assert.equal(endpoints.status, 200);
    assert.equal(endpoints.headers.get("cache-control"), "no-store");
    const document = await endpoints.json();
    assert.equal(document.client_id, clientId);
    assert.equal(document.issuer, issuer.issuer);
    assert.equal(document.authorization_endpoint, `${issuer.issuer}/auth`);
    const token = (origin, body) =>
      fetch(`${server.url}/dashboard/oauth/token`, {
        method: "POST",
        headers: { "Content-Type": "application/json", ...(origin ? { Origin: origin } : {}) },
        body: JSON.stringify(body),
      });
    const grant = { client_id: clientId, code: "not-a-code", code_verifier: randomBytes(32).toString("base64url") };
    const noOrigin = await token(null, grant);
    assert.equal(noOrigin.status, 400);
    assert.equal((await noOrigin.json()).error, "invalid_request");
    assert.equal((await token("http://elsewhere.example", grant)).status, 403);
    const shortVerifier = await token(server.url, { ...grant, code_verifier: "short" });
    assert.equal(shortVerifier.status, 400);
    assert.equal((await shortVerifier.json()).error, "invalid_request");
    const refused = await token(server.url, grant);
    assert.equal(refused.status, 400);
    assert.equal((await refused.json()).error, "invalid_grant");
    assert.equal((await fetch(`${server.url}/dashboard/oauth/token`)).status, 404);
  });

  step("an answer that no sign-in of this tab started is refused, and leaves the address bar", async () => {
    const page = carol.page;
    await page.goto(`${server.url}/?code=forged&state=forged`);
    await statusWaiter(() => page.locator("#status"))(
      "Sign-in failed: the answer does not belong to a sign-in started in this tab. Sign in again.",
      15_000,
    );
    assert.equal(new URL(page.url()).search, "");
    assert.equal(posts(seen, "/dashboard/oauth/token").length, 0);
    assert.equal(await page.locator("#signin").isVisible(), true);
  });

  step("an error answer of the issuer is shown and nothing is redeemed", async () => {
    const page = carol.page;
    // The issuer refuses at once (as for a user who denies consent), with this sign-in's state.
    const auth = `${issuer.issuer}/auth?**`;
    await page.route(auth, (route) => {
      const q = new URL(route.request().url()).searchParams;
      const answer = new URL(`${server.url}/`);
      answer.search = new URLSearchParams({ error: "access_denied", state: q.get("state"), iss: issuer.issuer }).toString();
      return route.fulfill({ status: 303, headers: { Location: answer.href } });
    });
    try {
      await page.getByRole("button", { name: "Sign in", exact: true }).click();
      await statusWaiter(() => page.locator("#status"))("Sign-in failed: the authorization server answered access_denied.", 15_000);
    } finally {
      await page.unroute(auth);
    }
    assert.equal(new URL(page.url()).search, "");
    assert.equal(posts(seen, "/dashboard/oauth/token").length, 0);
    assert.equal(await storedToken(page), null);
    assert.equal(await page.locator("#signin").isVisible(), true);
  });

  step("signs in as carol with the named client, registering none", async () => {
    const page = carol.page;
    assert.equal(await signInAs(page, seen, server.url, CAROL), true);
    const q = authorizationRequest(seen, issuer.issuer);
    assert.equal(q.get("client_id"), clientId);
    assert.equal(q.get("scope"), SCOPE);
    assert.equal(posts(seen, "/dashboard/oauth/register").length, 0);
    assert.equal(await page.evaluate((key) => localStorage.getItem(key), CLIENT_KEY + issuer.issuer), null);
    await listed(page, 0);
    assert.equal(await page.locator("#who").textContent(), `Signed in as ${principal(issuer, CAROL)}`);
  });
});
