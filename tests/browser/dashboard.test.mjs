// The dashboard (MCP App) in headless Debian Chromium, hosted by the real ext-apps AppBridge,
// talking to the real server over stdio (docs/decisions.md, "Dashboard", "Real MCP clients").
import assert from "node:assert/strict";
import { join } from "node:path";
import { after, before, describe, it } from "node:test";

import {
  DASHBOARD_URI,
  OUTPUT_DIR,
  SERVER_ARGS,
  assertPrerequisites,
  bundleHost,
  containerListed,
  ensureOutputDir,
  inspectComputer,
  launchBrowser,
  makeRelay,
  removeCheckpointImages,
  removeComputers,
  startHostServer,
  startServer,
  statusWaiter,
  uniqueId,
  waitFor,
  stepsInOrder,
} from "./lib/harness.mjs";
import { checkpointSteps, prepareCheckpoints } from "./lib/checkpoints.mjs";
import { fileSteps, prepareFiles } from "./lib/files.mjs";
import { HOSTILE, TICK, jobSteps, startJob } from "./lib/jobs.mjs";
import { fakeInternet, networkServerArgs, networkSteps, prepareNetwork } from "./lib/network.mjs";

const ID = uniqueId("dash");
const TEMP_ID = uniqueId("dash-tmp");
const created = new Set([ID, TEMP_ID]);
const calls = [];
let server;
let host;
let browser;
let page;
let app; // FrameLocator of the dashboard iframe
let appHtml;
let readResult;

const HOST_CONTEXT = {
  theme: "light",
  displayMode: "inline",
  availableDisplayModes: ["inline", "fullscreen"],
  platform: "web",
  locale: "en-US",
  containerDimensions: { maxHeight: 6000 },
};

/** Steps of this file depend on each other's state. */
const step = stepsInOrder();

const toolCalls = (name) => calls.filter((c) => c.method === "tools/call" && (!name || c.name === name));
const status = () => app.locator("#status");
const row = (id) => app.locator(`li[role="option"][data-id="${id}"]`);
const rowButton = (id, act) => row(id).locator(`button[data-act="${act}"]`);

async function text(locator) {
  return (await locator.textContent()) ?? "";
}

const waitStatus = statusWaiter(status);

async function runCommand(command) {
  const before = toolCalls("terminal_execute").length;
  await app.locator("#command").fill(command);
  await app.locator("#command").press("Control+Enter");
  await waitFor(() => toolCalls("terminal_execute").length > before, 10_000, "terminal_execute call");
  await waitStatus(/^Command finished with exit \d+\.$|^\[error\]|failed|not found/i, 60_000);
  return text(app.locator("#output"));
}

/** Wait until the host has sized the iframe to the dashboard's content (size-changed applied). */
async function settleFrame(hostPage = page, frame = app) {
  let previous = -1;
  await waitFor(
    async () => {
      const content = await frame.locator("html").evaluate((el) => {
        const prev = el.style.height;
        el.style.height = "max-content";
        const h = Math.ceil(el.getBoundingClientRect().height);
        el.style.height = prev;
        return h;
      });
      const height = await hostPage.locator("#app").evaluate((el) => el.clientHeight);
      const stable = content === previous && Math.abs(height - content) <= 1;
      previous = content;
      return stable;
    },
    5_000,
    "the iframe to fit its content",
  );
}

async function screenshot(name, { settle = true } = {}) {
  if (settle) await settleFrame();
  const path = join(OUTPUT_DIR, name);
  await page.screenshot({ path, fullPage: true });
  return path;
}

describe("dashboard in headless Chromium via the ext-apps AppBridge", () => {
  before(async () => {
    assertPrerequisites();
    ensureOutputDir();
    removeComputers([...created]);
    server = await startServer();
    const read = await server.client.readResource({ uri: DASHBOARD_URI });
    appHtml = read.contents?.[0]?.text;
    assert.equal(typeof appHtml, "string", "resources/read returned no text");
    readResult = read;
    const hostJs = await bundleHost();
    host = await startHostServer({ appHtml, hostJs });
    browser = await launchBrowser();
    page = browser.page;
    page.on("pageerror", (e) => console.error(`[host page error] ${e.message}`));
    page.on("console", (m) => {
      if (m.type() === "error") console.error(`[browser console] ${m.text()}`);
    });
    await page.exposeFunction("__mcpRelay", makeRelay(server.client, calls));
    await page.goto(host.url);
    await page.waitForFunction(() => window.__host !== undefined);
    await page.evaluate(
      (opts) => window.__host.start(opts),
      { appUrl: "/app", hostContext: HOST_CONTEXT, toolName: "computer_dashboard" },
    );
    app = page.frameLocator("#app");
  });

  after(async () => {
    // Cleanup runs even when a step failed.
    removeComputers([...created]);
    await browser?.close();
    await host?.close();
    await server?.close();
  });

  it("advertises the MCP Apps extension and the resource metadata", () => {
    const caps = server.client.getServerCapabilities();
    assert.deepEqual(caps?.extensions?.["io.modelcontextprotocol/ui"], { mimeTypes: ["text/html;profile=mcp-app"] });
    const [content] = readResult.contents;
    assert.equal(readResult.contents.length, 1);
    assert.equal(content.uri, DASHBOARD_URI);
    assert.equal(content.mimeType, "text/html;profile=mcp-app");
    assert.deepEqual(content._meta, { ui: { csp: {}, prefersBorder: true } });
  });

  it("served resource is self-contained and carries the app mode", () => {
    for (const forbidden of ["<script src", "<link", "@import", "url(http"]) {
      assert.ok(!appHtml.includes(forbidden), `resource contains ${forbidden}`);
    }
    assert.match(appHtml, /<meta name="kilntainers-mode" content="app">/);
    assert.ok(Buffer.byteLength(appHtml) < 128 * 1024, `resource is ${Buffer.byteLength(appHtml)} bytes`);
  });

  step("completes the ui/initialize handshake and shows Connected", async () => {
    // `Connected`, possibly already replaced by the count from the tool-result.
    await waitStatus(/^(Connected|\d+ computers?)$/, 20_000);
    const fromApp = await page.evaluate(() => window.__host.fromApp());
    assert.equal(fromApp[0], "ui/initialize", `first message from the app: ${fromApp[0]}`);
    assert.equal(fromApp[1], "ui/notifications/initialized", `second message from the app: ${fromApp[1]}`);
    const info = await page.evaluate(() => window.__host.appInfo());
    assert.equal(info?.name, "sandbox-computer-dashboard");
    const caps = await page.evaluate(() => window.__host.appCapabilities());
    assert.deepEqual(caps?.availableDisplayModes, ["inline", "fullscreen"]);
    const events = await page.evaluate(() => window.__host.events());
    assert.ok(events.some((e) => e.kind === "initialized"), "AppBridge never saw ui/notifications/initialized");
  });

  step("renders the computer_dashboard tool-result without an extra computer_list call", async () => {
    await waitStatus(/^\d+ computers?$/, 10_000);
    // Longer than the dashboard's own grace period before it would list on its own.
    await new Promise((r) => setTimeout(r, 2_500));
    assert.equal(toolCalls("computer_dashboard").length, 1, "the host called computer_dashboard once");
    assert.equal(toolCalls("computer_list").length, 0, "the app made an extra computer_list call");
    const empty = app.locator("#empty");
    const rows = await app.locator('li[role="option"]').count();
    if (rows === 0) assert.equal(await text(empty), "No computers yet. Create a temporary workspace or a permanent computer above.");
    assert.equal(await text(app.locator("#count")), String(rows));
    const sizes = (await page.evaluate(() => window.__host.events())).filter((e) => e.kind === "size-changed");
    assert.ok(sizes.length >= 1, "no ui/notifications/size-changed received");
    assert.ok(sizes.every((s) => s.data.height > 100 && s.data.width > 100), JSON.stringify(sizes));
  });

  step("Refresh issues computer_list {}", async () => {
    await app.getByRole("button", { name: "Refresh", exact: true }).click();
    await waitStatus(/^\d+ computers?$/);
    const list = toolCalls("computer_list");
    assert.equal(list.length, 1);
    assert.deepEqual(list[0].arguments, {});
  });

  step("shows a server error inline (create with an invalid id)", async () => {
    await app.locator("#new-id").fill("Bad_ID");
    assert.equal(await app.locator("#id-hint").isVisible(), true, "client-side slug hint not shown");
    await app.getByRole("button", { name: "Create computer" }).click();
    await waitStatus(/computer_id must be 1-63 lowercase letters, numbers, or hyphens/);
    assert.match(await app.locator("#status").getAttribute("class"), /\berror\b/);
    assert.equal(await app.locator("#new-id").getAttribute("aria-invalid"), "true");
    await screenshot("dashboard-error.png");
    const create = toolCalls("computer_create").at(-1);
    assert.deepEqual(create.arguments, { temporary: true, computer_id: "Bad_ID" });
    assert.ok(!containerListed("bad_id") && !containerListed("Bad_ID"));
  });

  step("creates a temporary computer with computer_create {temporary:true, computer_id}", async () => {
    await app.locator("#new-id").fill(TEMP_ID);
    assert.equal(await app.getByLabel("Temporary").isChecked(), true, "Temporary is not checked by default");
    await app.locator("#new-id").press("Enter");
    await waitStatus(`Computer ${TEMP_ID} is ready.`, 60_000);
    assert.deepEqual(toolCalls("computer_create").at(-1).arguments, { temporary: true, computer_id: TEMP_ID });
    assert.equal(await text(row(TEMP_ID).locator(".pill")), "temporary");
    assert.equal(await app.locator("#new-id").inputValue(), "");
    assert.ok(inspectComputer(TEMP_ID)?.running);
  });

  step("creates a permanent computer with computer_create {temporary:false, computer_id}", async () => {
    await app.locator("#new-id").fill(ID);
    assert.equal(await app.locator("#id-hint").isVisible(), false);
    await app.getByLabel("Temporary").uncheck();
    await app.getByRole("button", { name: "Create computer" }).click();
    await waitStatus(`Computer ${ID} is ready.`, 60_000);
    const create = toolCalls("computer_create").at(-1);
    assert.deepEqual(create.arguments, { temporary: false, computer_id: ID });
    await row(ID).waitFor();
    assert.equal(await text(row(ID).locator(".pill")), "permanent");
    assert.equal(await row(ID).getAttribute("aria-selected"), "true", "new computer is not the terminal target");
    const c = inspectComputer(ID);
    assert.ok(c?.running, "docker does not show the new container running");
    const meta = await text(row(ID).locator(".meta"));
    assert.match(meta, /^docker · running · sandbox-busybox:full · /);
    assert.equal(await rowButton(ID, "restart").getAttribute("aria-label"), `Restart ${ID}`);
  });

  step("has no Jobs section without --job-tools", async () => {
    // The host does not pass tools/list on, so the page asks job_list once; the server refuses it.
    await waitFor(() => toolCalls("job_list").some((c) => c.error), 10_000, "the refused job_list");
    // Once, for the first computer opened (the temporary one), not again for this one.
    assert.deepEqual(toolCalls("job_list").map((c) => c.arguments), [{ computer_id: TEMP_ID }]);
    assert.match(toolCalls("job_list")[0].error, /tool not found/);
    assert.equal(await app.locator("#jobs").isVisible(), false);
    assert.equal(await app.locator("#jobs").getAttribute("hidden"), "");
    assert.equal(await text(status()), `Computer ${ID} is ready.`);
  });

  step("has no Files or Open a port section without --file-tools", async () => {
    // As for jobs: the first file_list, for the first computer opened, is refused as unknown.
    await waitFor(() => toolCalls("file_list").some((c) => c.error), 10_000, "the refused file_list");
    assert.deepEqual(toolCalls("file_list").map((c) => c.arguments), [{ computer_id: TEMP_ID, path: "/root", depth: 1 }]);
    assert.match(toolCalls("file_list")[0].error, /tool not found/);
    assert.equal(await app.locator("#files").isVisible(), false);
    assert.equal(await app.locator("#files").getAttribute("hidden"), "");
    assert.equal(await app.locator("#ports").isVisible(), false);
  });

  step("has no Checkpoints section without --checkpoint-tools", async () => {
    // As for jobs: the first checkpoint_list, for the first computer opened, is refused as unknown.
    await waitFor(() => toolCalls("checkpoint_list").some((c) => c.error), 10_000, "the refused checkpoint_list");
    assert.deepEqual(toolCalls("checkpoint_list").map((c) => c.arguments), [{ computer_id: TEMP_ID }]);
    assert.match(toolCalls("checkpoint_list")[0].error, /tool not found/);
    assert.equal(await app.locator("#checkpoints").isVisible(), false);
    assert.equal(await app.locator("#checkpoints").getAttribute("hidden"), "");
  });

  step("has no Network section and no countdown without an egress policy or --idle-stop", async () => {
    // As for jobs: the first computer_network, for the first computer opened, is refused as unknown.
    await waitFor(() => toolCalls("computer_network").some((c) => c.error), 10_000, "the refused computer_network");
    assert.deepEqual(toolCalls("computer_network").map((c) => c.arguments), [{ computer_id: TEMP_ID }]);
    assert.match(toolCalls("computer_network")[0].error, /tool not found/);
    assert.equal(toolCalls().filter((c) => /^computer_network_/.test(c.name)).length, 0);
    assert.equal(await app.locator("#network").isVisible(), false);
    assert.equal(await app.locator("#network").getAttribute("hidden"), "");
    assert.equal(await app.locator("#list .idle-stop").count(), 0);
  });

  step("moves the selection with the arrow keys in the listbox", async () => {
    const ids = await app.locator('li[role="option"]').evaluateAll((els) => els.map((e) => e.dataset.id));
    assert.ok(ids.length >= 2, `only ${ids.length} rows`);
    const i = ids.indexOf(ID);
    const forward = i < ids.length - 1 ? "ArrowDown" : "ArrowUp";
    const neighbour = ids[forward === "ArrowDown" ? i + 1 : i - 1];
    await row(ID).focus();
    await page.keyboard.press(forward);
    await waitFor(async () => (await row(neighbour).getAttribute("aria-selected")) === "true", 5_000, "selection moved");
    assert.equal(await row(ID).getAttribute("aria-selected"), "false");
    assert.equal(await row(neighbour).evaluate((el) => el === document.activeElement), true, "focus did not follow");
    assert.equal(await app.locator("#select").inputValue(), neighbour);
    assert.match(await text(app.locator("#target")), new RegExp(`^${neighbour} · `));
    await page.keyboard.press("Home");
    await waitFor(async () => (await row(ids[0]).getAttribute("aria-selected")) === "true", 5_000, "Home");
    await page.keyboard.press("End");
    await waitFor(async () => (await row(ids.at(-1)).getAttribute("aria-selected")) === "true", 5_000, "End");
    // Back to our permanent computer with the mouse.
    await row(ID).locator(".slug").click();
    await waitFor(async () => (await row(ID).getAttribute("aria-selected")) === "true", 5_000, "click selects");
    assert.equal(await app.locator("#select").inputValue(), ID);
  });

  step("runs a command with terminal_execute and prints the transcript", async () => {
    const output = await runCommand("echo hello-from-dashboard");
    assert.match(output, /\$ echo hello-from-dashboard\nhello-from-dashboard\n\[exit 0 · \d+ ms\]/);
    assert.equal(await text(status()), "Command finished with exit 0.");
    const call = toolCalls("terminal_execute").at(-1);
    assert.deepEqual(call.arguments, { computer_id: ID, temporary: false, command: "echo hello-from-dashboard" });
    // A failing command: error-styled status, exit code in the transcript.
    const out2 = await runCommand("echo oops >&2; exit 3");
    assert.match(out2, /\$ echo oops >&2; exit 3\noops\n\[exit 3 · \d+ ms\]/);
    assert.match(await app.locator("#status").getAttribute("class"), /\berror\b/);
  });

  step("takes light, dark and narrow screenshots", async () => {
    await runCommand("uname -a && pwd && ls / | head -5");
    await page.setViewportSize({ width: 1100, height: 900 });
    await screenshot("dashboard-light.png");

    await page.evaluate(() => window.__host.setHostContext({ theme: "dark" }));
    await waitFor(
      () => app.locator("html").evaluate((el) => getComputedStyle(el).colorScheme === "dark"),
      5_000,
      "dark color-scheme",
    );
    await screenshot("dashboard-dark.png");
    await page.evaluate(() => window.__host.setHostContext({ theme: "light" }));

    await page.evaluate(() => document.body.classList.add("narrow"));
    await page.setViewportSize({ width: 360, height: 800 });
    await waitFor(
      async () => {
        const last = (await page.evaluate(() => window.__host.events())).filter((e) => e.kind === "size-changed").at(-1);
        return last?.data.width <= 360;
      },
      5_000,
      "a size-changed for the narrow layout",
    );
    const stacked = await app.locator(".panels").evaluate((el) => getComputedStyle(el).gridTemplateColumns.split(" ").length);
    assert.equal(stacked, 1, "panels are not stacked below 640 px");
    const overflow = await app.locator("html").evaluate((el) => el.scrollWidth - el.clientWidth);
    assert.ok(overflow <= 0, `horizontal overflow of ${overflow}px at 360 px`);
    await screenshot("dashboard-narrow.png");
    await page.evaluate(() => document.body.classList.remove("narrow"));
    await page.setViewportSize({ width: 1100, height: 900 });
  });

  step("applies host style variables from host-context-changed", async () => {
    await page.evaluate(() =>
      window.__host.setHostContext({ styles: { variables: { "--color-ring-primary": "rgb(200, 0, 100)" } } }),
    );
    await waitFor(
      () => app.locator("html").evaluate((el) => getComputedStyle(el).getPropertyValue("--color-ring-primary").trim() === "rgb(200, 0, 100)"),
      5_000,
      "host variable applied",
    );
  });

  step("requests fullscreen when the host offers it", async () => {
    const button = app.locator("#fullscreen");
    assert.equal(await button.isVisible(), true, "fullscreen button hidden although the host offers fullscreen");
    await button.click();
    await waitFor(() => app.locator("html").evaluate((el) => el.classList.contains("fs")), 5_000, "fullscreen layout");
    const events = await page.evaluate(() => window.__host.events());
    assert.ok(events.some((e) => e.kind === "request-display-mode" && e.data === "fullscreen"));
    await screenshot("dashboard-fullscreen.png", { settle: false });
    await button.click();
    await waitFor(() => app.locator("html").evaluate((el) => !el.classList.contains("fs")), 5_000, "inline layout");
  });

  step("restarts with computer_restart {computer_id} (docker StartedAt changes)", async () => {
    const before = inspectComputer(ID);
    assert.ok(before, "container missing before restart");
    await rowButton(ID, "restart").click();
    await waitStatus(`${ID} restarted.`, 60_000);
    assert.deepEqual(toolCalls("computer_restart").at(-1).arguments, { computer_id: ID });
    const afterRestart = inspectComputer(ID);
    assert.ok(afterRestart?.running, "container not running after restart");
    assert.notEqual(afterRestart.startedAt, before.startedAt, "StartedAt did not change");
    assert.equal(afterRestart.id, before.id, "restart replaced the container");
  });

  step("Escape or the 5 s timeout cancels a pending destructive confirmation", async () => {
    const deletes = toolCalls("computer_delete").length;
    await rowButton(ID, "delete").click();
    await waitFor(async () => (await text(rowButton(ID, "delete"))) === "Confirm delete", 5_000, "Confirm delete");
    assert.equal(await text(status()), `Permanently delete ${ID}? This cannot be undone.`);
    await page.keyboard.press("Escape");
    await waitFor(async () => (await text(rowButton(ID, "delete"))) === "Delete", 5_000, "Delete restored");
    assert.equal(toolCalls("computer_delete").length, deletes, "Escape still deleted");
    // Without a second click the confirmation reverts after 5 s.
    const resets = toolCalls("computer_factory_reset").length;
    await rowButton(ID, "reset").click();
    await waitFor(async () => (await text(rowButton(ID, "reset"))) === "Confirm reset", 5_000, "Confirm reset");
    const shown = Date.now();
    await waitFor(async () => (await text(rowButton(ID, "reset"))) === "Reset", 8_000, "Reset restored");
    assert.ok(Date.now() - shown >= 4_500, `reverted after ${Date.now() - shown} ms`);
    assert.equal(toolCalls("computer_factory_reset").length, resets, "the timeout reset the computer");
  });

  step("factory-resets with the two-click confirmation (file gone, new sandbox id)", async () => {
    const out = await runCommand("echo keep > /root/dash-marker && cat /root/dash-marker");
    assert.match(out, /keep\n\[exit 0 · \d+ ms\]/);
    const before = inspectComputer(ID);
    await rowButton(ID, "reset").click();
    await waitFor(async () => (await text(rowButton(ID, "reset"))) === "Confirm reset", 5_000, "Confirm reset");
    assert.equal(await text(status()), `Factory reset ${ID}? All files and changes in this computer will be erased.`);
    assert.equal(await rowButton(ID, "reset").getAttribute("aria-label"), `Confirm reset ${ID}`);
    assert.equal(toolCalls("computer_factory_reset").length, 0, "first click already reset");
    await screenshot("dashboard-confirm-reset.png");
    await rowButton(ID, "reset").click();
    await waitStatus(`${ID} reset.`, 60_000);
    assert.deepEqual(toolCalls("computer_factory_reset").at(-1).arguments, { computer_id: ID });
    const afterReset = inspectComputer(ID);
    assert.ok(afterReset, "container missing after reset");
    assert.notEqual(afterReset.id, before.id, "factory reset kept the same container id");
    const resetResult = toolCalls("computer_factory_reset").at(-1).result?.structuredContent;
    assert.ok(afterReset.id.startsWith(resetResult?.sandbox_id ?? "?"), `sandbox_id ${resetResult?.sandbox_id} vs ${afterReset.id}`);
    assert.match(await text(row(ID).locator(".meta")), new RegExp(`· ${resetResult.sandbox_id}$`));
    const gone = await runCommand("cat /root/dash-marker");
    assert.match(gone, /\$ cat \/root\/dash-marker\n[^\n]*No such file[^\n]*\n\[exit 1 · \d+ ms\]/);
  });

  step("deletes with the two-click confirmation (container gone)", async () => {
    await rowButton(ID, "delete").click();
    await waitFor(async () => (await text(rowButton(ID, "delete"))) === "Confirm delete", 5_000, "Confirm delete");
    await rowButton(ID, "delete").click();
    await waitStatus(`${ID} deleted.`, 60_000);
    assert.deepEqual(toolCalls("computer_delete").at(-1).arguments, { computer_id: ID });
    await waitFor(async () => (await row(ID).count()) === 0, 10_000, "row removed");
    await waitFor(() => !containerListed(ID), 15_000, "container gone from docker ps -a");
    assert.equal(await text(app.locator("#target")), "Select a computer");
  });

  step("Clear output restores the empty transcript", async () => {
    await app.getByRole("button", { name: "Clear output" }).click();
    assert.equal(await text(app.locator("#output")), "Choose a computer, enter a command, and run it.");
  });

  step("validates locally before calling tools", async () => {
    const before = toolCalls("terminal_execute").length;
    await app.locator("#command").fill("echo nothing");
    await app.getByRole("button", { name: "Run command" }).click();
    await waitStatus("Select a target computer first.", 5_000);
    assert.equal(toolCalls("terminal_execute").length, before);
  });

  step("sent ui/notifications/size-changed after renders", async () => {
    const sizes = (await page.evaluate(() => window.__host.events())).filter((e) => e.kind === "size-changed");
    assert.ok(sizes.length >= 2, `only ${sizes.length} size-changed notifications`);
  });

  step("never showed Jobs nor asked job_list again without --job-tools", async () => {
    assert.equal(toolCalls("job_list").length, 1);
    assert.equal(toolCalls("job_output").length, 0);
    assert.equal(await app.locator("#jobs").isVisible(), false);
  });

  step("never showed Files nor asked a file tool again without --file-tools", async () => {
    assert.equal(toolCalls("file_list").length, 1);
    assert.deepEqual(toolCalls().filter((c) => /^(file_(read|write)|port_url)$/.test(c.name)), []);
    assert.equal(await app.locator("#files").isVisible(), false);
    assert.equal(await app.locator("#ports").isVisible(), false);
  });

  step("never showed Network nor asked an egress tool again without an egress policy", async () => {
    assert.equal(toolCalls("computer_network").length, 1);
    assert.equal(toolCalls().filter((c) => /^computer_network_/.test(c.name)).length, 0);
    assert.equal(await app.locator("#network").isVisible(), false);
  });

  step("never showed Checkpoints nor asked a checkpoint tool again without --checkpoint-tools", async () => {
    const checkpointCalls = toolCalls().filter((c) => /^(computer_(checkpoint|rollback|fork)|checkpoint_(list|delete))$/.test(c.name));
    assert.deepEqual(checkpointCalls.map((c) => c.name), ["checkpoint_list"]);
    assert.equal(await app.locator("#checkpoints").isVisible(), false);
  });
});

describe("jobs of a computer in the dashboard (app mode, --job-tools)", () => {
  const JOBS_ID = uniqueId("dash-jobs");
  const jobCalls = [];
  const ids = {};
  let jobServer;
  let jobHost;
  let jobBrowser;
  let jobPage;
  let frame;

  const jobStep = stepsInOrder();

  before(async () => {
    assertPrerequisites();
    ensureOutputDir();
    removeComputers([JOBS_ID]);
    jobServer = await startServer({ args: [...SERVER_ARGS, "--job-tools"] });
    ids.tick = (await startJob(jobServer.client, JOBS_ID, TICK)).job_id;
    ids.hostile = (await startJob(jobServer.client, JOBS_ID, HOSTILE)).job_id;
    const read = await jobServer.client.readResource({ uri: DASHBOARD_URI });
    jobHost = await startHostServer({ appHtml: read.contents[0].text, hostJs: await bundleHost() });
    // Tall enough for the whole app: a full-page capture of a taller page repaints the frame partly.
    jobBrowser = await launchBrowser({ viewport: { width: 1100, height: 1300 } });
    jobPage = jobBrowser.page;
    jobPage.on("pageerror", (e) => console.error(`[host page error] ${e.message}`));
    await jobPage.exposeFunction("__mcpRelay", makeRelay(jobServer.client, jobCalls));
    await jobPage.goto(jobHost.url);
    await jobPage.waitForFunction(() => window.__host !== undefined);
    await jobPage.evaluate((opts) => window.__host.start(opts), {
      appUrl: "/app",
      hostContext: HOST_CONTEXT,
      toolName: "computer_dashboard",
    });
    frame = jobPage.frameLocator("#app");
    await waitFor(async () => /^\d+ computers?$/.test((await frame.locator("#status").textContent()) ?? ""), 20_000, "the inventory");
  });

  after(async () => {
    removeComputers([JOBS_ID]);
    await jobBrowser?.close();
    await jobHost?.close();
    await jobServer?.close();
  });

  jobSteps(jobStep, {
    root: () => frame,
    client: { callTool: (req) => jobServer.client.callTool(req) },
    computerId: JOBS_ID,
    tick: () => ids.tick,
    hostile: () => ids.hostile,
    toolArgs: (name) => jobCalls.filter((c) => c.method === "tools/call" && c.name === name).map((c) => c.arguments),
    screenshot: async (name) => {
      await settleFrame(jobPage, frame);
      await jobPage.screenshot({ path: join(OUTPUT_DIR, `dashboard-${name}`), fullPage: true });
    },
  });
});

describe("files and ports of a computer in the dashboard (app mode, --file-tools)", () => {
  const FILES_ID = uniqueId("dash-files");
  const fileCalls = [];
  let fileServer;
  let fileHost;
  let fileBrowser;
  let filePage;
  let frame;

  const fileStep = stepsInOrder();

  before(async () => {
    assertPrerequisites();
    ensureOutputDir();
    removeComputers([FILES_ID]);
    fileServer = await startServer({ args: [...SERVER_ARGS, "--file-tools"] });
    await prepareFiles(fileServer.client, FILES_ID);
    const read = await fileServer.client.readResource({ uri: DASHBOARD_URI });
    fileHost = await startHostServer({ appHtml: read.contents[0].text, hostJs: await bundleHost() });
    fileBrowser = await launchBrowser({ viewport: { width: 1100, height: 1600 } });
    filePage = fileBrowser.page;
    filePage.on("pageerror", (e) => console.error(`[host page error] ${e.message}`));
    await filePage.exposeFunction("__mcpRelay", makeRelay(fileServer.client, fileCalls));
    await filePage.goto(fileHost.url);
    await filePage.waitForFunction(() => window.__host !== undefined);
    await filePage.evaluate((opts) => window.__host.start(opts), {
      appUrl: "/app",
      hostContext: HOST_CONTEXT,
      toolName: "computer_dashboard",
    });
    frame = filePage.frameLocator("#app");
    await waitFor(async () => /^\d+ computers?$/.test((await frame.locator("#status").textContent()) ?? ""), 20_000, "the inventory");
  });

  after(async () => {
    removeComputers([FILES_ID]);
    await fileBrowser?.close();
    await fileHost?.close();
    await fileServer?.close();
  });

  fileSteps(fileStep, {
    root: () => frame,
    client: { callTool: (req) => fileServer.client.callTool(req, undefined, { timeout: 120_000 }) },
    computerId: FILES_ID,
    web: false,
    page: () => filePage,
    toolArgs: (name) => fileCalls.filter((c) => c.method === "tools/call" && c.name === name).map((c) => c.arguments),
    screenshot: async (name) => {
      await settleFrame(filePage, frame);
      await filePage.screenshot({ path: join(OUTPUT_DIR, `dashboard-${name}`), fullPage: true });
    },
  });
});

describe("checkpoints of a computer in the dashboard (app mode, --checkpoint-tools)", () => {
  const CKPT_ID = uniqueId("dash-ckpt");
  const made = new Set([CKPT_ID]);
  const ckptCalls = [];
  let ckptServer;
  let ckptHost;
  let ckptBrowser;
  let ckptPage;
  let frame;

  const ckptStep = stepsInOrder();

  before(async () => {
    assertPrerequisites();
    ensureOutputDir();
    removeComputers([...made]);
    ckptServer = await startServer({ args: [...SERVER_ARGS, "--checkpoint-tools"] });
    await prepareCheckpoints(ckptServer.client, CKPT_ID);
    const read = await ckptServer.client.readResource({ uri: DASHBOARD_URI });
    ckptHost = await startHostServer({ appHtml: read.contents[0].text, hostJs: await bundleHost() });
    ckptBrowser = await launchBrowser({ viewport: { width: 1100, height: 1300 } });
    ckptPage = ckptBrowser.page;
    ckptPage.on("pageerror", (e) => console.error(`[host page error] ${e.message}`));
    await ckptPage.exposeFunction("__mcpRelay", makeRelay(ckptServer.client, ckptCalls));
    await ckptPage.goto(ckptHost.url);
    await ckptPage.waitForFunction(() => window.__host !== undefined);
    await ckptPage.evaluate((opts) => window.__host.start(opts), {
      appUrl: "/app",
      hostContext: HOST_CONTEXT,
      toolName: "computer_dashboard",
    });
    frame = ckptPage.frameLocator("#app");
    await waitFor(async () => /^\d+ computers?$/.test((await frame.locator("#status").textContent()) ?? ""), 20_000, "the inventory");
  });

  after(async () => {
    removeComputers([...made]);
    removeCheckpointImages([...made]);
    await ckptBrowser?.close();
    await ckptHost?.close();
    await ckptServer?.close();
  });

  checkpointSteps(ckptStep, {
    root: () => frame,
    client: { callTool: (req) => ckptServer.client.callTool(req, undefined, { timeout: 120_000 }) },
    computerId: CKPT_ID,
    track: (id) => made.add(id),
    toolArgs: (name) => ckptCalls.filter((c) => c.method === "tools/call" && c.name === name).map((c) => c.arguments),
    screenshot: async (name) => {
      await settleFrame(ckptPage, frame);
      await ckptPage.screenshot({ path: join(OUTPUT_DIR, `dashboard-${name}`), fullPage: true });
    },
  });
});

describe("network and idle-stop countdown of a computer in the dashboard (app mode, egress policy, --idle-stop)", () => {
  const NET_ID = uniqueId("dash-net");
  const made = new Set([NET_ID]);
  const netCalls = [];
  let internet;
  let netServer;
  let netHost;
  let netBrowser;
  let netPage;
  let frame;

  const netStep = stepsInOrder();

  before(async () => {
    assertPrerequisites();
    ensureOutputDir();
    removeComputers([...made]);
    internet = fakeInternet();
    netServer = await startServer({ args: [...SERVER_ARGS, ...networkServerArgs(internet)] });
    await prepareNetwork(netServer.client, NET_ID);
    const read = await netServer.client.readResource({ uri: DASHBOARD_URI });
    netHost = await startHostServer({ appHtml: read.contents[0].text, hostJs: await bundleHost() });
    netBrowser = await launchBrowser({ viewport: { width: 1100, height: 1300 } });
    netPage = netBrowser.page;
    netPage.on("pageerror", (e) => console.error(`[host page error] ${e.message}`));
    await netPage.exposeFunction("__mcpRelay", makeRelay(netServer.client, netCalls));
    await netPage.goto(netHost.url);
    await netPage.waitForFunction(() => window.__host !== undefined);
    await netPage.evaluate((opts) => window.__host.start(opts), {
      appUrl: "/app",
      hostContext: HOST_CONTEXT,
      toolName: "computer_dashboard",
    });
    frame = netPage.frameLocator("#app");
    await waitFor(async () => /^\d+ computers?$/.test((await frame.locator("#status").textContent()) ?? ""), 20_000, "the inventory");
  });

  after(async () => {
    // Deleted through the server, so that it removes its egress network's proxy with the last one.
    for (const id of made) await netServer?.client.callTool({ name: "computer_delete", arguments: { computer_id: id } }).catch(() => {});
    removeComputers([...made]);
    await netBrowser?.close();
    await netHost?.close();
    await netServer?.close();
    internet?.close();
  });

  networkSteps(netStep, {
    root: () => frame,
    client: { callTool: (req) => netServer.client.callTool(req, undefined, { timeout: 120_000 }) },
    computerId: NET_ID,
    track: (id) => made.add(id),
    toolArgs: (name) => netCalls.filter((c) => c.method === "tools/call" && c.name === name).map((c) => c.arguments),
    screenshot: async (name) => {
      await settleFrame(netPage, frame);
      await netPage.screenshot({ path: join(OUTPUT_DIR, `dashboard-${name}`), fullPage: true });
    },
  });
});
