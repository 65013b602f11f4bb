// The dashboard's Network section (docs/egress.md, "Dashboard") and idle-stop countdown
// (docs/idle-stop.md), shared by app mode (dashboard.test.mjs) and web mode (web.test.mjs).
// The server runs with an egress policy and ask-to-allow against a fake internet made here (the
// approach of tests/blackbox/egress_net.py: a Docker network outside the private ranges with
// two BusyBox web servers); the test's own MCP client makes the requests in the computer, so
// what the proxy lets through is checked by what the computer receives, not only by the page.
import assert from "node:assert/strict";
import { randomBytes, randomInt } from "node:crypto";

import { docker, statusWaiter, waitFor } from "./harness.mjs";

export const IMAGE = "sandbox-busybox:full";
export const ALLOW_REFUSAL = "not in this computer's allow-list";
export const DECLINED = "the user declined";
export const DECLINED_EARLIER = "the user declined (remembered for 10 minutes)";
export const IDLE_STOP = "2m";

/**
 * A test network in 198.18.0.0/15 with `allowed.test` and `other.test` web servers, and the
 * server options that route an egress proxy to it. `close()` removes all of it (and a proxy a
 * failed run left joined to it).
 */
export function fakeInternet() {
  const name = `kbt-egress-${randomBytes(4).toString("hex")}`;
  let octet = null;
  for (let i = 0; i < 8 && octet === null; i++) {
    const candidate = randomInt(256);
    if (docker(["network", "create", "--subnet", `198.18.${candidate}.0/24`, name]) !== null) octet = candidate;
  }
  if (octet === null) throw new Error("could not make the fake internet's network");
  const hosts = { "allowed.test": `198.18.${octet}.10`, "other.test": `198.18.${octet}.11` };
  const boxes = [];
  const close = () => {
    for (const box of boxes) docker(["rm", "-f", box]);
    const proxies = docker(["ps", "-aq", "--filter", `network=${name}`, "--filter", "label=kilntainers.egress-proxy"]);
    if (proxies) docker(["rm", "-f", ...proxies.split(/\s+/)]);
    docker(["network", "rm", name]);
  };
  for (const [host, ip] of Object.entries(hosts)) {
    const box = `${name}-${host.split(".")[0]}`;
    const made = docker(["run", "-d", "--name", box, "--network", name, "--ip", ip, IMAGE, "sh", "-c",
      `mkdir -p /www && echo hello-from-${host} > /www/index.html && exec httpd -f -p 80 -h /www`]);
    if (made === null) {
      close();
      throw new Error(`could not start ${host} on the fake internet`);
    }
    boxes.push(box);
  }
  const args = ["--egress-upstream-network", name];
  for (const [host, ip] of Object.entries(hosts)) args.push("--egress-resolve", `${host}=${ip}`);
  return { name, hosts, args, close };
}

/** The server options of the Network describes: a policy with ask-to-allow, and idle stop. */
export function networkServerArgs(net) {
  return ["--egress", "allowlist", "--egress-allow", "allowed.test", "--egress-allow", "other.test",
    "--egress-deny", "other.test:8080", "--egress-ask", "--idle-stop", IDLE_STOP, ...net.args];
}

// A request through the proxy's port, as a program honouring http_proxy makes it.
const viaProxy = (host, port = 80) =>
  `p=\${http_proxy#http://}; printf 'GET http://${host}:${port}/ HTTP/1.0\\r\\nHost: ${host}\\r\\n\\r\\n' | nc -w 5 \${p%:*} \${p##*:}`;
const blocked = (host, port, reason) => `[kilntainers: network access to ${host}:${port} was blocked: ${reason}]`;

function payload(result, what) {
  assert.ok(!result.isError, `${what}: ${JSON.stringify(result)}`);
  return result.structuredContent;
}

/** Makes the permanent computer the steps work on, narrowed to allowed.test at creation. */
export async function prepareNetwork(client, computerId) {
  payload(
    await client.callTool({ name: "computer_create", arguments: { computer_id: computerId, temporary: false, egress: { allow: ["allowed.test"] } } }),
    "computer_create",
  );
}

/**
 * Registers the Network and countdown steps with `step(name, fn)`. `ctx`: root() (the page or
 * the dashboard's FrameLocator), client (the test's own), computerId, toolArgs(name),
 * track(id), screenshot(name).
 */
export function networkSteps(step, ctx) {
  const $ = (selector) => ctx.root().locator(selector);
  const text = async (selector) => (await $(selector).textContent()) ?? "";
  const waitStatus = statusWaiter(() => $("#status"));
  const id = ctx.computerId;
  const run = async (command) =>
    payload(await ctx.client.callTool({ name: "terminal_execute", arguments: { computer_id: id, temporary: false, command } }), "terminal_execute");
  const rules = (list) => $(`#${list} li`).evaluateAll((els) => els.map((e) => e.dataset.rule ?? `(${e.textContent})`));
  const deniedRow = (host, port) => $(`#net-denied-rows tr[data-host="${host}"][data-port="${port}"]`);
  const cells = async (host, port) => deniedRow(host, port).locator("td").evaluateAll((tds) => tds.map((td) => td.textContent));
  /** The reasons of the log's rows for `host:port` (one row per distinct reason). */
  const reasons = (host, port) => deniedRow(host, port).evaluateAll((trs) => trs.map((tr) => tr.lastElementChild.textContent));
  const question = () => $("#net-questions li.question");
  /** Runs `command` in the computer while the page answers the question it raises with `label`. */
  const answeredFromPage = async (command, label) => {
    const running = run(command);
    await question().waitFor({ timeout: 30_000 });
    assert.match(await text("#net-questions li.question .grow"), /^Wants to reach other\.test:80 · asked \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC$/);
    const before = ctx.toolArgs("computer_network_answer").length;
    await question().getByRole("button", { name: label, exact: true }).click();
    await waitFor(() => ctx.toolArgs("computer_network_answer").length > before, 10_000, "the answer");
    const answer = ctx.toolArgs("computer_network_answer").at(-1);
    assert.equal(answer.computer_id, id);
    assert.equal(answer.choice, label.toLowerCase());
    assert.ok(Number.isInteger(answer.question_id), JSON.stringify(answer));
    const result = await running;
    await question().waitFor({ state: "detached", timeout: 10_000 });
    return result;
  };

  step("opening the computer shows its Network section: the policy, no refusals yet", async () => {
    const computerRow = $(`#list li[role="option"][data-id="${id}"]`);
    await computerRow.waitFor({ timeout: 20_000 });
    await computerRow.locator(".slug").click();
    await $("#network").waitFor({ state: "visible", timeout: 20_000 });
    assert.equal(await text("#net-target"), id);
    await waitFor(async () => (await text("#net-mode")) === "allowlist", 20_000, "the policy");
    assert.deepEqual(await rules("net-allow-list"), ["allowed.test"]);
    assert.deepEqual(await rules("net-deny-list"), ["other.test:8080"]);
    assert.deepEqual(await rules("net-secrets"), ["(None.)"]);
    assert.equal(await text("#net-denied-empty"), "No refused connections.");
    assert.equal(await $("#net-questions-box").isVisible(), false);
    assert.deepEqual(ctx.toolArgs("computer_network").at(-1), { computer_id: id });
  });

  step("a refused request in the computer shows in the log without reloading", async () => {
    const res = await run(viaProxy("other.test", 8080));
    assert.ok(res.stderr.includes(blocked("other.test", 8080, "denied by rule other.test:8080")), JSON.stringify(res));
    await deniedRow("other.test", 8080).waitFor({ timeout: 20_000 });
    const [host, port, count, first, last, reason] = await cells("other.test", 8080);
    assert.deepEqual([host, port, count, reason], ["other.test", "8080", "1", "denied by rule other.test:8080"]);
    assert.match(first, /^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC$/);
    assert.equal(last, first);
    await run(viaProxy("other.test", 8080));
    await waitFor(async () => (await cells("other.test", 8080))[2] === "2", 20_000, "the count to reach 2");
  });

  step("a pending question is answered from the dashboard: Allow once lets that request through", async () => {
    const res = await answeredFromPage(viaProxy("other.test"), "Allow once");
    assert.match(res.stdout, /hello-from-other\.test/, JSON.stringify(res));
    // Once only: the rules did not change.
    assert.deepEqual(await rules("net-allow-list"), ["allowed.test"]);
  });

  step("Deny from the dashboard refuses the request, and the log says why", async () => {
    const res = await answeredFromPage(viaProxy("other.test"), "Deny");
    assert.doesNotMatch(res.stdout, /hello-from-other/);
    assert.ok(res.stderr.includes(blocked("other.test", 80, DECLINED)), JSON.stringify(res));
    await waitFor(async () => (await reasons("other.test", 80)).includes(DECLINED), 20_000, "the declined request in the log");
  });

  step("a rule outside the server's bounds shows the server's message", async () => {
    await $("#net-pattern").fill("other.test:8080");
    await $("#net-allow").click();
    await waitFor(async () => (await $("#net-error").isVisible()), 20_000, "the error");
    assert.equal(await text("#net-error"), "'other.test:8080' is denied by this server's rule 'other.test:8080'; a person cannot allow it.");
    assert.deepEqual(ctx.toolArgs("computer_network_allow").at(-1), { computer_id: id, pattern: "other.test:8080" });
    assert.equal(await $("#net-pattern").inputValue(), "other.test:8080");
    assert.deepEqual(await rules("net-allow-list"), ["allowed.test"]);
  });

  step("adding an allow rule lets the next request through the proxy", async () => {
    await $("#net-pattern").fill("other.test");
    await $("#net-pattern").press("Enter");
    await waitStatus(`Allowed other.test for ${id}.`, 20_000);
    assert.equal(await $("#net-error").isVisible(), false);
    assert.deepEqual(await rules("net-allow-list"), ["allowed.test", "other.test"]);
    assert.equal(await text('#net-allow-list li[data-rule="other.test"] .pill'), "added");
    // The person denied it minutes ago; the rule wins, and nobody is asked.
    const res = await run(viaProxy("other.test"));
    assert.match(res.stdout, /hello-from-other\.test/, JSON.stringify(res));
    assert.equal(await question().count(), 0);
    await ctx.screenshot?.("network.png");
  });

  step("removing it restores the refusal", async () => {
    await $('#net-allow-list button[data-net-remove="other.test"]').click();
    await waitStatus(`Removed other.test from ${id}.`, 20_000);
    assert.deepEqual(ctx.toolArgs("computer_network_remove").at(-1), { computer_id: id, pattern: "other.test" });
    assert.deepEqual(await rules("net-allow-list"), ["allowed.test"]);
    // The proxy asks again, and the person's deny is still remembered.
    const res = await run(viaProxy("other.test"));
    assert.doesNotMatch(res.stdout, /hello-from-other/);
    assert.ok(res.stderr.includes(blocked("other.test", 80, DECLINED_EARLIER)), JSON.stringify(res));
    await waitFor(async () => (await reasons("other.test", 80)).includes(DECLINED_EARLIER), 20_000, "the new reason in the log");
    assert.deepEqual(await reasons("other.test", 80), [DECLINED, DECLINED_EARLIER]);
  });

  step("a permanent computer shows its idle-stop countdown, which decreases", async () => {
    const countdown = $(`#list li[data-id="${id}"] .idle-stop`);
    // The list shows idle_stop_at as computer_list last gave it: refresh after the last use.
    await $("#refresh").click();
    await waitStatus(/^\d+ computers?$/, 20_000);
    await countdown.waitFor({ timeout: 10_000 });
    const seconds = async () => {
      const m = /^idle stop in (?:(\d+)m )?(\d+)s$/.exec(await countdown.textContent());
      assert.ok(m, `countdown text: ${await countdown.textContent()}`);
      return Number(m[1] ?? 0) * 60 + Number(m[2]);
    };
    const first = await seconds();
    assert.ok(first > 0 && first <= 120, `first ${first}`);
    await waitFor(async () => (await seconds()) < first, 5_000, "the countdown to decrease");
    const at = Date.parse(await countdown.getAttribute("data-idle-stop-at"));
    assert.ok(Number.isFinite(at) && at > Date.now(), "idle_stop_at is not in the future");
  });

  step("a temporary computer shows no countdown", async () => {
    await $("#new-id").fill("");
    await $("#temporary").check();
    await $("#create").click();
    await waitStatus(/^Computer [a-z0-9-]+ is ready\.$/, 60_000);
    const temp = /^Computer ([a-z0-9-]+) is ready\.$/.exec(await text("#status"))[1];
    ctx.track(temp);
    const row = $(`#list li[data-id="${temp}"]`);
    await row.waitFor({ timeout: 10_000 });
    assert.equal(await text(`#list li[data-id="${temp}"] .pill`), "temporary");
    assert.equal(await row.locator(".idle-stop").count(), 0);
    assert.equal(await $(`#list li[data-id="${id}"] .idle-stop`).count(), 1);
  });
}
