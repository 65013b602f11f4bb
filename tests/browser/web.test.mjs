// The dashboard in web mode: GET / of the real server in HTTP mode, talking Streamable HTTP to
// /mcp from headless Debian Chromium (docs/decisions.md, "Dashboard web mode").
import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { after, before, describe, it } from "node:test";

import { join } from "node:path";

import { Client, StreamableHTTPClientTransport } from "@modelcontextprotocol/client";

import {
  OUTPUT_DIR,
  assertPrerequisites,
  containerName,
  docker,
  ensureOutputDir,
  containerListed,
  launchBrowser,
  removeCheckpointImages,
  removeComputers,
  startHttpServer,
  statusWaiter,
  uniqueId,
  waitFor,
  stepsInOrder,
} from "./lib/harness.mjs";
import { checkpointSteps, prepareCheckpoints } from "./lib/checkpoints.mjs";
import { fileSteps, prepareFiles } from "./lib/files.mjs";
import { HOSTILE, TICK, jobSteps, startJob } from "./lib/jobs.mjs";
import { fakeInternet, networkServerArgs, networkSteps, prepareNetwork } from "./lib/network.mjs";

const TOKEN = randomBytes(12).toString("hex");
const created = new Set();
const requests = []; // every /mcp request the page made: {method, headers, body}
const elsewhere = []; // the paths of every other request the page made
let server;
let browser;
let page;

/** Steps of this file depend on each other's state. */
const step = stepsInOrder();

const text = async (selector) => (await page.locator(selector).textContent()) ?? "";
const waitStatus = statusWaiter(() => page.locator("#status"));
const mcpRequests = (pred = () => true) => requests.filter(pred);
const rpc = (r) => {
  try {
    return JSON.parse(r.body || "null");
  } catch {
    return null;
  }
};

describe("dashboard in web mode over Streamable HTTP", () => {
  before(async () => {
    assertPrerequisites();
    ensureOutputDir();
    server = await startHttpServer({ token: TOKEN });
    browser = await launchBrowser({ viewport: { width: 1100, height: 900 } });
    page = browser.page;
    page.on("pageerror", (e) => console.error(`[page error] ${e.message}`));
    page.on("request", (req) => {
      if (new URL(req.url()).pathname === "/mcp") {
        requests.push({ method: req.method(), headers: req.headers(), body: req.postData() });
      } else {
        elsewhere.push(new URL(req.url()).pathname);
      }
    });
  });

  after(async () => {
    removeComputers([...created]);
    await browser?.close();
    await server?.close();
  });

  step("GET / serves the dashboard in web mode", async () => {
    const res = await page.goto(`${server.url}/`);
    assert.equal(res.status(), 200);
    const headers = res.headers();
    assert.equal(
      headers["content-security-policy"],
      "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    );
    assert.equal(headers["x-content-type-options"], "nosniff");
    assert.equal(headers["referrer-policy"], "no-referrer");
    assert.equal(headers["cache-control"], "no-store");
    assert.match(await page.content(), /<meta name="kilntainers-mode" content="web">/);
    assert.equal(await page.locator("#fullscreen").isVisible(), false);
  });

  step("401 shows the access token prompt", async () => {
    await waitFor(() => page.locator("#auth").isVisible(), 10_000, "token prompt");
    assert.equal(await page.getByLabel("Access token").getAttribute("type"), "password");
    assert.match(await text("#status"), /access token/i);
    const init = mcpRequests((r) => rpc(r)?.method === "initialize");
    assert.equal(init.length, 1);
    assert.equal(init[0].headers.authorization, undefined);
    // Without --oauth-issuer the 401 offers no sign-in, and the page asks nothing else
    // (docs/auth.md, "Web dashboard sign-in"); the server has no sign-in routes.
    assert.equal(await page.locator("#signin").isVisible(), false);
    assert.equal(await page.locator("#account").isVisible(), false);
    assert.deepEqual(elsewhere, ["/"]);
    assert.equal((await fetch(`${server.url}/dashboard/oauth`)).status, 404);
    await page.screenshot({ path: join(OUTPUT_DIR, "web-token-prompt.png"), fullPage: true });
  });

  step("connects with the token: initialize, session header, protocol header", async () => {
    await page.getByLabel("Access token").fill(TOKEN);
    await page.getByRole("button", { name: "Connect" }).click();
    await waitStatus(/^(Connected|\d+ computers?)$/, 15_000);
    assert.equal(await page.locator("#auth").isVisible(), false);
    const init = mcpRequests((r) => rpc(r)?.method === "initialize").at(-1);
    assert.equal(init.headers.authorization, `Bearer ${TOKEN}`);
    assert.equal(rpc(init).params.protocolVersion, "2025-11-25");
    assert.equal(rpc(init).params.clientInfo.name, "sandbox-computer-dashboard-web");
    assert.equal(init.headers["mcp-session-id"], undefined);
    assert.match(init.headers.accept, /application\/json/);
    assert.match(init.headers.accept, /text\/event-stream/);
    // Silent refresh after connecting: a computer_list with both session headers.
    await waitFor(() => mcpRequests((r) => rpc(r)?.params?.name === "computer_list").length > 0, 10_000, "computer_list");
    const list = mcpRequests((r) => rpc(r)?.params?.name === "computer_list")[0];
    assert.ok(list.headers["mcp-session-id"], "no Mcp-Session-Id on requests after initialize");
    assert.equal(list.headers["mcp-protocol-version"], "2025-11-25");
    const notified = mcpRequests((r) => rpc(r)?.method === "notifications/initialized");
    assert.equal(notified.length, 1);
    // No --warm-pool: no pool in the header.
    assert.equal(await page.locator("#pool").isVisible(), false);
  });

  step("creates a temporary computer and runs a command in it", async () => {
    await page.getByRole("button", { name: "Create computer" }).click();
    await waitStatus(/^Computer [a-z0-9-]+ is ready\.$/, 60_000);
    const id = (await text("#status")).match(/^Computer ([a-z0-9-]+) is ready\.$/)[1];
    created.add(id);
    assert.ok(containerListed(id));
    assert.equal(await page.locator(`li[data-id="${id}"] .pill`).textContent(), "temporary");
    // The subtitle names what this server runs (its backend), not a fixed list of providers.
    assert.equal(await text("#subtitle"), "Containers, one lifecycle.");
    await page.locator("#command").fill("echo hello-from-web");
    await page.getByRole("button", { name: "Run command" }).click();
    await waitStatus("Command finished with exit 0.", 60_000);
    assert.match(await text("#output"), /\$ echo hello-from-web\nhello-from-web\n\[exit 0 · \d+ ms\]/);
    await page.emulateMedia({ colorScheme: "dark" });
    await page.screenshot({ path: join(OUTPUT_DIR, "web-dark.png"), fullPage: true });
    await page.emulateMedia({ colorScheme: "light" });
  });

  step("has no Jobs section without --job-tools (tools/list says so)", async () => {
    const lists = mcpRequests((r) => rpc(r)?.method === "tools/list");
    assert.equal(lists.length, 1, "the page did not ask tools/list once");
    assert.ok(lists[0].headers["mcp-session-id"], "tools/list before the session existed");
    assert.equal(await page.locator("#jobs").isVisible(), false);
    assert.equal(await page.locator("#jobs").getAttribute("hidden"), "");
    assert.equal(mcpRequests((r) => /^job_/.test(rpc(r)?.params?.name ?? "")).length, 0, "the page called a job tool");
  });

  step("has no Files or Open a port section without --file-tools (tools/list says so)", async () => {
    assert.equal(await page.locator("#files").isVisible(), false);
    assert.equal(await page.locator("#files").getAttribute("hidden"), "");
    assert.equal(await page.locator("#ports").isVisible(), false);
    const fileCalls = mcpRequests((r) => /^(file_(list|read|write)|port_url)$/.test(rpc(r)?.params?.name ?? ""));
    assert.equal(fileCalls.length, 0, "the page called a file tool");
  });

  step("has no Checkpoints section without --checkpoint-tools (tools/list says so)", async () => {
    assert.equal(await page.locator("#checkpoints").isVisible(), false);
    assert.equal(await page.locator("#checkpoints").getAttribute("hidden"), "");
    const checkpointCalls = mcpRequests((r) => /^(computer_(checkpoint|rollback|fork)|checkpoint_(list|delete))$/.test(rpc(r)?.params?.name ?? ""));
    assert.equal(checkpointCalls.length, 0, "the page called a checkpoint tool");
  });

  step("has no Network section and no countdown without an egress policy or --idle-stop (tools/list says so)", async () => {
    assert.equal(await page.locator("#network").isVisible(), false);
    assert.equal(await page.locator("#network").getAttribute("hidden"), "");
    assert.equal(await page.locator("#list .idle-stop").count(), 0);
    const networkCalls = mcpRequests((r) => /^computer_network/.test(rpc(r)?.params?.name ?? ""));
    assert.equal(networkCalls.length, 0, "the page called an egress tool");
  });

  step("creates a second computer, runs a command in it and deletes it (container gone)", async () => {
    await page.getByRole("button", { name: "Create computer" }).click();
    await waitStatus(/^Computer [a-z0-9-]+ is ready\.$/, 60_000);
    const id = (await text("#status")).match(/^Computer ([a-z0-9-]+) is ready\.$/)[1];
    assert.ok(!created.has(id), "the second create returned the first computer");
    assert.ok(containerListed(id));
    await page.locator("#command").fill("echo second-$((6*7))");
    await page.getByRole("button", { name: "Run command" }).click();
    await waitStatus("Command finished with exit 0.", 60_000);
    assert.match(await text("#output"), /\nsecond-42\n\[exit 0 · \d+ ms\]/);
    const del = page.locator(`li[role="option"][data-id="${id}"] button[data-act="delete"]`);
    await del.click();
    await waitFor(async () => ((await del.textContent()) ?? "") === "Confirm delete", 5_000, "Confirm delete");
    await del.click();
    await waitStatus(`${id} deleted.`, 60_000);
    await waitFor(async () => (await page.locator(`li[role="option"][data-id="${id}"]`).count()) === 0, 10_000, "row removed");
    await waitFor(() => !containerListed(id), 15_000, "container gone from docker ps -a");
  });

  step("re-initializes transparently after Session not found", async () => {
    const sid = mcpRequests((r) => r.headers["mcp-session-id"]).at(-1).headers["mcp-session-id"];
    const del = await fetch(`${server.url}/mcp`, {
      method: "DELETE",
      headers: { "Mcp-Session-Id": sid, Authorization: `Bearer ${TOKEN}` },
    });
    assert.ok(del.ok, `DELETE /mcp answered ${del.status}`);
    const before = mcpRequests((r) => rpc(r)?.method === "initialize").length;
    await page.getByRole("button", { name: "Refresh", exact: true }).click();
    await waitStatus(/^\d+ computers?$/, 20_000);
    assert.equal(mcpRequests((r) => rpc(r)?.method === "initialize").length, before + 1, "no re-initialize");
    const last = mcpRequests((r) => rpc(r)?.params?.name === "computer_list").at(-1);
    assert.notEqual(last.headers["mcp-session-id"], sid, "still using the deleted session");
    // The old session owned the temporary computer: ending it removed the computer.
    for (const id of created) await waitFor(() => !containerListed(id), 20_000, `${id} removed with its session`);
  });

  step("sends DELETE /mcp with the session id on pagehide", async () => {
    const sid = mcpRequests((r) => r.headers["mcp-session-id"]).at(-1).headers["mcp-session-id"];
    await page.goto("about:blank");
    // Playwright does not report keepalive requests of an unloading document, so the proof is
    // the server's: within seconds (the idle timeout is 300 s) the session answers 404, which
    // only a DELETE carrying this session id and the bearer token can cause.
    await waitFor(
      async () => {
        const res = await fetch(`${server.url}/mcp`, {
          method: "POST",
          headers: {
            "Content-Type": "application/json",
            Accept: "application/json, text/event-stream",
            "Mcp-Session-Id": sid,
            "MCP-Protocol-Version": "2025-11-25",
            Authorization: `Bearer ${TOKEN}`,
          },
          body: JSON.stringify({ jsonrpc: "2.0", id: 1, method: "tools/list", params: {} }),
        });
        await res.text();
        return res.status === 404;
      },
      10_000,
      "the session to be gone",
    );
  });

  // See: issue 15 (the server prints such a link for its generated token).
  step("a link with #token= connects without the prompt and leaves the address bar", async () => {
    await page.goto(`${server.url}/`);
    await page.evaluate(() => sessionStorage.clear());
    await page.goto("about:blank");
    const before = requests.length;
    await page.goto(`${server.url}/#token=${TOKEN}`);
    await waitStatus(/^(Connected|\d+ computers?)$/, 15_000);
    assert.equal(await page.locator("#auth").isVisible(), false);
    assert.equal(new URL(page.url()).hash, "", "the token stayed in the address bar");
    const init = requests.slice(before).filter((r) => rpc(r)?.method === "initialize");
    assert.equal(init.length, 1);
    assert.equal(init[0].headers.authorization, `Bearer ${TOKEN}`);
  });
});

describe("jobs of a computer in the web dashboard (--job-tools)", () => {
  const JOBS_ID = uniqueId("web-jobs");
  const pageRequests = [];
  const ids = {};
  let jobServer;
  let client;
  let jobBrowser;
  let jobPage;

  const jobStep = stepsInOrder();

  before(async () => {
    assertPrerequisites();
    ensureOutputDir();
    removeComputers([JOBS_ID]);
    jobServer = await startHttpServer({ token: TOKEN, extraArgs: ["--job-tools"] });
    // The test's own session: it starts the jobs the page then follows in a session of its own.
    client = new Client({ name: "kilntainers-browser-tests", version: "1.0.0" }, { capabilities: {} });
    await client.connect(
      new StreamableHTTPClientTransport(new URL(`${jobServer.url}/mcp`), {
        requestInit: { headers: { Authorization: `Bearer ${TOKEN}` } },
      }),
    );
    ids.tick = (await startJob(client, JOBS_ID, TICK)).job_id;
    ids.hostile = (await startJob(client, JOBS_ID, HOSTILE)).job_id;
    jobBrowser = await launchBrowser({ viewport: { width: 1100, height: 900 } });
    jobPage = jobBrowser.page;
    jobPage.on("pageerror", (e) => console.error(`[page error] ${e.message}`));
    jobPage.on("request", (req) => {
      if (new URL(req.url()).pathname === "/mcp") pageRequests.push(rpc({ body: req.postData() }));
    });
    await jobPage.goto(`${jobServer.url}/#token=${TOKEN}`);
    await waitFor(async () => /^(Connected|\d+ computers?)$/.test((await jobPage.locator("#status").textContent()) ?? ""), 20_000, "connected");
  });

  after(async () => {
    removeComputers([JOBS_ID]);
    await jobBrowser?.close();
    await client?.close().catch(() => {});
    await jobServer?.close();
  });

  jobStep("learns the job tools from tools/list", () => {
    assert.equal(pageRequests.filter((m) => m?.method === "tools/list").length, 1);
  });

  jobSteps(jobStep, {
    root: () => jobPage,
    get client() {
      return client;
    },
    computerId: JOBS_ID,
    tick: () => ids.tick,
    hostile: () => ids.hostile,
    toolArgs: (name) =>
      pageRequests.filter((m) => m?.method === "tools/call" && m.params?.name === name).map((m) => m.params.arguments),
    screenshot: (name) => jobPage.screenshot({ path: join(OUTPUT_DIR, `web-${name}`), fullPage: true }),
  });
});

describe("files and ports of a computer in the web dashboard (--file-tools)", () => {
  const FILES_ID = uniqueId("web-files");
  const pageRequests = [];
  let fileServer;
  let client;
  let fileBrowser;
  let filePage;

  const fileStep = stepsInOrder();

  before(async () => {
    assertPrerequisites();
    ensureOutputDir();
    removeComputers([FILES_ID]);
    fileServer = await startHttpServer({ token: TOKEN, extraArgs: ["--file-tools"] });
    // The test's own session: it puts files into the computer the page then browses.
    client = new Client({ name: "kilntainers-browser-tests", version: "1.0.0" }, { capabilities: {} });
    await client.connect(
      new StreamableHTTPClientTransport(new URL(`${fileServer.url}/mcp`), {
        requestInit: { headers: { Authorization: `Bearer ${TOKEN}` } },
      }),
    );
    await prepareFiles(client, FILES_ID);
    fileBrowser = await launchBrowser({ viewport: { width: 1100, height: 900 } });
    filePage = fileBrowser.page;
    filePage.on("pageerror", (e) => console.error(`[page error] ${e.message}`));
    filePage.on("request", (req) => {
      if (new URL(req.url()).pathname === "/mcp") pageRequests.push(rpc({ body: req.postData() }));
    });
    await filePage.goto(`${fileServer.url}/#token=${TOKEN}`);
    await waitFor(async () => /^(Connected|\d+ computers?)$/.test((await filePage.locator("#status").textContent()) ?? ""), 20_000, "connected");
  });

  after(async () => {
    removeComputers([FILES_ID]);
    await fileBrowser?.close();
    await client?.close().catch(() => {});
    await fileServer?.close();
  });

  fileStep("learns the file tools from tools/list and lists nothing before a computer is opened", async () => {
    await waitFor(() => pageRequests.some((m) => m?.method === "tools/list"), 10_000, "tools/list");
    assert.equal(pageRequests.filter((m) => m?.method === "tools/list").length, 1);
    assert.equal(pageRequests.filter((m) => m?.params?.name === "file_list").length, 0);
    assert.equal(await filePage.locator("#files").isVisible(), false);
  });

  fileSteps(fileStep, {
    root: () => filePage,
    client: { callTool: (req) => client.callTool(req, undefined, { timeout: 120_000 }) },
    computerId: FILES_ID,
    web: true,
    page: () => filePage,
    get serverUrl() {
      return fileServer.url;
    },
    token: TOKEN,
    toolArgs: (name) =>
      pageRequests.filter((m) => m?.method === "tools/call" && m.params?.name === name).map((m) => m.params.arguments),
    screenshot: (name) => filePage.screenshot({ path: join(OUTPUT_DIR, `web-${name}`), fullPage: true }),
  });
});

describe("checkpoints of a computer in the web dashboard (--checkpoint-tools)", () => {
  const CKPT_ID = uniqueId("web-ckpt");
  const made = new Set([CKPT_ID]);
  const pageRequests = [];
  let ckptServer;
  let client;
  let ckptBrowser;
  let ckptPage;

  const ckptStep = stepsInOrder();

  before(async () => {
    assertPrerequisites();
    ensureOutputDir();
    removeComputers([...made]);
    ckptServer = await startHttpServer({ token: TOKEN, extraArgs: ["--checkpoint-tools"] });
    // The test's own session: it writes and reads the files of the computer the page works on.
    client = new Client({ name: "kilntainers-browser-tests", version: "1.0.0" }, { capabilities: {} });
    await client.connect(
      new StreamableHTTPClientTransport(new URL(`${ckptServer.url}/mcp`), {
        requestInit: { headers: { Authorization: `Bearer ${TOKEN}` } },
      }),
    );
    await prepareCheckpoints(client, CKPT_ID);
    ckptBrowser = await launchBrowser({ viewport: { width: 1100, height: 1300 } });
    ckptPage = ckptBrowser.page;
    ckptPage.on("pageerror", (e) => console.error(`[page error] ${e.message}`));
    ckptPage.on("request", (req) => {
      if (new URL(req.url()).pathname === "/mcp") pageRequests.push(rpc({ body: req.postData() }));
    });
    await ckptPage.goto(`${ckptServer.url}/#token=${TOKEN}`);
    await waitFor(async () => /^(Connected|\d+ computers?)$/.test((await ckptPage.locator("#status").textContent()) ?? ""), 20_000, "connected");
  });

  after(async () => {
    removeComputers([...made]);
    removeCheckpointImages([...made]);
    await ckptBrowser?.close();
    await client?.close().catch(() => {});
    await ckptServer?.close();
  });

  ckptStep("learns the checkpoint tools from tools/list and lists nothing before a computer is opened", async () => {
    await waitFor(() => pageRequests.some((m) => m?.method === "tools/list"), 10_000, "tools/list");
    assert.equal(pageRequests.filter((m) => m?.method === "tools/list").length, 1);
    assert.equal(pageRequests.filter((m) => m?.params?.name === "checkpoint_list").length, 0);
    assert.equal(await ckptPage.locator("#checkpoints").isVisible(), false);
  });

  checkpointSteps(ckptStep, {
    root: () => ckptPage,
    client: { callTool: (req) => client.callTool(req, undefined, { timeout: 120_000 }) },
    computerId: CKPT_ID,
    track: (id) => made.add(id),
    toolArgs: (name) =>
      pageRequests.filter((m) => m?.method === "tools/call" && m.params?.name === name).map((m) => m.params.arguments),
    screenshot: (name) => ckptPage.screenshot({ path: join(OUTPUT_DIR, `web-${name}`), fullPage: true }),
  });
});

describe("network and idle-stop countdown of a computer in the web dashboard (egress policy, --idle-stop)", () => {
  const NET_ID = uniqueId("web-net");
  const made = new Set([NET_ID]);
  const pageRequests = [];
  let internet;
  let netServer;
  let netBrowser;
  let netPage;
  let client;

  const netStep = stepsInOrder();

  before(async () => {
    assertPrerequisites();
    ensureOutputDir();
    removeComputers([...made]);
    internet = fakeInternet();
    netServer = await startHttpServer({ token: TOKEN, extraArgs: networkServerArgs(internet) });
    // The test's own session: it makes the requests in the computer the page watches.
    client = new Client({ name: "kilntainers-browser-tests", version: "1.0.0" }, { capabilities: {} });
    await client.connect(
      new StreamableHTTPClientTransport(new URL(`${netServer.url}/mcp`), {
        requestInit: { headers: { Authorization: `Bearer ${TOKEN}` } },
      }),
    );
    await prepareNetwork(client, NET_ID);
    netBrowser = await launchBrowser({ viewport: { width: 1100, height: 1300 } });
    netPage = netBrowser.page;
    netPage.on("pageerror", (e) => console.error(`[page error] ${e.message}`));
    netPage.on("request", (req) => {
      if (new URL(req.url()).pathname === "/mcp") pageRequests.push(rpc({ body: req.postData() }));
    });
    await netPage.goto(`${netServer.url}/#token=${TOKEN}`);
    await waitFor(async () => /^(Connected|\d+ computers?)$/.test((await netPage.locator("#status").textContent()) ?? ""), 20_000, "connected");
  });

  after(async () => {
    // Deleted through the server, so that it removes its egress network's proxy with the last one.
    for (const id of made) await client?.callTool({ name: "computer_delete", arguments: { computer_id: id } }).catch(() => {});
    removeComputers([...made]);
    await netBrowser?.close();
    await client?.close().catch(() => {});
    await netServer?.close();
    internet?.close();
  });

  netStep("learns the egress tools from tools/list and asks nothing before a computer is opened", async () => {
    await waitFor(() => pageRequests.some((m) => m?.method === "tools/list"), 10_000, "tools/list");
    assert.equal(pageRequests.filter((m) => /^computer_network/.test(m?.params?.name ?? "")).length, 0);
    assert.equal(await netPage.locator("#network").isVisible(), false);
  });

  networkSteps(netStep, {
    root: () => netPage,
    client: { callTool: (req) => client.callTool(req, undefined, { timeout: 120_000 }) },
    computerId: NET_ID,
    track: (id) => made.add(id),
    toolArgs: (name) =>
      pageRequests.filter((m) => m?.method === "tools/call" && m.params?.name === name).map((m) => m.params.arguments),
    screenshot: (name) => netPage.screenshot({ path: join(OUTPUT_DIR, `web-${name}`), fullPage: true }),
  });
});

describe("dashboard header with a warm pool", () => {
  let poolServer;
  let poolBrowser;
  const ids = [];

  before(async () => {
    poolServer = await startHttpServer({ token: TOKEN, extraArgs: ["--warm-pool", "1"] });
    poolBrowser = await launchBrowser({ viewport: { width: 1100, height: 900 } });
    await poolBrowser.page.goto(`${poolServer.url}/#token=${TOKEN}`);
  });

  after(async () => {
    removeComputers(ids);
    await poolBrowser?.close();
    await poolServer?.close();
  });

  it("shows the pool's size, never a spare as a computer, and hands a spare out", async () => {
    const p = poolBrowser.page;
    const badge = p.locator("#pool");
    // The spare is made in the background: refresh until the header shows it ready.
    await waitFor(
      async () => {
        if (await p.getByRole("button", { name: "Refresh" }).isEnabled()) {
          await p.getByRole("button", { name: "Refresh" }).click();
        }
        return (await badge.isVisible()) && (await badge.textContent()) === "Warm pool: 1/1 ready";
      },
      60_000,
      "the pool badge",
    );
    // The engine may hold other computers of `default` (it is shared); every one listed must
    // be a computer's container, never a spare's (a spare is named kilntainers-spare-…).
    const listed = async () => p.locator("li[data-id]").evaluateAll((items) => items.map((li) => li.dataset.id));
    const before = await listed();
    for (const listedId of before) {
      assert.ok(docker(["inspect", "-f", "{{.Name}}", containerName(listedId)]), `${listedId} is listed but is no computer`);
    }
    assert.ok(docker(["ps", "-q", "--filter", "name=^kilntainers-spare-"]), "the ready spare has no container");
    await p.getByRole("button", { name: "Create computer" }).click();
    const status = statusWaiter(() => p.locator("#status"));
    await status(/^Computer [a-z0-9-]+ is ready\.$/, 60_000);
    const id = ((await p.locator("#status").textContent()) ?? "").match(/^Computer ([a-z0-9-]+) is ready\.$/)[1];
    ids.push(id);
    assert.ok(!before.includes(id), `the new computer ${id} was listed before it was made`);
    assert.ok((await listed()).includes(id), `the new computer ${id} is not listed`);
    assert.match((await badge.textContent()) ?? "", /^Warm pool: [01]\/1 ready$/);
    await p.screenshot({ path: join(OUTPUT_DIR, "web-warm-pool.png"), fullPage: true });
  });
});
