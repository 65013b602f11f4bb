// The dashboard's Jobs section, shared by app mode (dashboard.test.mjs) and web mode
// (web.test.mjs): the test's own MCP client starts the jobs, the page lists them, follows one
// job's output live and stops it. Every wait is for a condition, never a fixed delay.
import assert from "node:assert/strict";

import { waitFor } from "./harness.mjs";

/** Prints a numbered tick every 0.3 s until it is stopped. */
export const TICK = "i=0; while :; do echo tick $i; i=$((i+1)); sleep 0.3; done";
/** Command and output that would become elements if the page parsed them as HTML. */
export const HOSTILE = `echo '<b id="pwn">hostile</b>'; echo '<img id="pwn-img" src=x onerror=alert(1)>' >&2`;

function payload(result, what) {
  assert.ok(!result.isError, `${what}: ${JSON.stringify(result)}`);
  return result.structuredContent;
}

/** Starts `command` as a job on `computerId` (created permanent if missing); its result. */
export async function startJob(client, computerId, command) {
  const p = payload(
    await client.callTool({
      name: "terminal_execute",
      arguments: { computer_id: computerId, temporary: false, command, yield_after: 0 },
    }),
    "terminal_execute",
  );
  assert.match(p.job_id, /^j-[0-9a-f]{8}$/);
  return p;
}

/** The job as `job_list` shows it to the test's own client. */
export async function listedJob(client, computerId, jobId) {
  const p = payload(await client.callTool({ name: "job_list", arguments: { computer_id: computerId } }), "job_list");
  return p.jobs.find((j) => j.job_id === jobId);
}

/**
 * Registers the Jobs steps with `step(name, fn)`. `ctx`: root() (the page or the dashboard's
 * FrameLocator), client, computerId, tick() and hostile() (the started jobs' ids), toolArgs(name)
 * (the arguments of every tools/call of that name the page made), screenshot(name).
 */
export function jobSteps(step, ctx) {
  const $ = (selector) => ctx.root().locator(selector);
  const text = async (selector) => (await $(selector).textContent()) ?? "";
  const jobRow = (id) => $(`#job-list li[role="option"][data-job="${id}"]`);
  const computerRow = () => $(`#list li[role="option"][data-id="${ctx.computerId}"]`);

  step("opening the computer shows its jobs: state, command, runtime", async () => {
    await computerRow().waitFor({ timeout: 20_000 });
    await computerRow().locator(".slug").click();
    await $("#jobs").waitFor({ state: "visible", timeout: 20_000 });
    assert.equal(await text("#jobs-target"), ctx.computerId);
    assert.deepEqual(ctx.toolArgs("job_list").at(-1), { computer_id: ctx.computerId });
    const row = jobRow(ctx.tick());
    await row.waitFor({ timeout: 10_000 });
    assert.equal(await row.getAttribute("data-running"), "true");
    assert.equal(await row.locator(".pill").textContent(), "running");
    assert.equal(await row.locator(".cmdline").textContent(), TICK);
    assert.match(await row.locator(".meta").textContent(), new RegExp(`^${ctx.tick()} · running for \\d+ (s|min \\d+ s)$`));
    assert.equal(await ctx.root().getByRole("button", { name: `Stop ${ctx.tick()}` }).isVisible(), true);
    // Newest first: the hostile job was started after the ticking one.
    const order = await $("#job-list li[role=option]").evaluateAll((els) => els.map((e) => e.dataset.job));
    assert.deepEqual(order.slice(0, 2), [ctx.hostile(), ctx.tick()]);
    assert.equal(await text("#job-count"), String(order.length));
  });

  step("text from the computer stays text (command and output)", async () => {
    const row = jobRow(ctx.hostile());
    assert.equal(await row.locator(".cmdline").textContent(), HOSTILE);
    await row.click();
    await waitFor(async () => /\[exit 0\]\n$/.test(await text("#job-output")), 20_000, "the hostile job's output and exit");
    const out = await text("#job-output");
    assert.ok(out.includes('<b id="pwn">hostile</b>\n'), out);
    assert.ok(out.includes('<img id="pwn-img" src=x onerror=alert(1)>\n'), out);
    assert.equal(await $("#pwn").count(), 0, "the command's output became an element");
    assert.equal(await $("#pwn-img").count(), 0, "the command's stderr became an element");
    assert.equal(await $("#job-output b, #job-output img, #job-list b").count(), 0);
    assert.equal(await row.getAttribute("data-running"), "false");
    assert.equal(await row.locator(".pill").textContent(), "exit 0");
  });

  step("selecting a running job follows its output live with explicit since offsets", async () => {
    const before = ctx.toolArgs("job_output").length;
    await jobRow(ctx.tick()).click();
    assert.equal(await jobRow(ctx.tick()).getAttribute("aria-selected"), "true");
    assert.equal(await text("#job-title"), `Output of ${ctx.tick()}`);
    await waitFor(async () => (await text("#job-output")).startsWith("tick 0\n"), 20_000, "tick 0");
    const early = await text("#job-output");
    const last = Number(early.trim().split("\n").at(-1).slice(5));
    await waitFor(async () => (await text("#job-output")).includes(`\ntick ${last + 2}\n`), 20_000, `tick ${last + 2}`);
    const later = await text("#job-output");
    assert.ok(later.length > early.length && later.startsWith(early), "the output did not grow by appending");
    assert.match(later, /^(tick \d+\n)+$/, `unexpected output: ${JSON.stringify(later)}`);
    const ticks = later.trim().split("\n").map((l) => Number(l.slice(5)));
    assert.deepEqual(ticks, ticks.map((_, i) => i), "ticks lost or repeated");
    assert.equal(await text("#job-state"), "running");
    const reads = ctx.toolArgs("job_output").slice(before).filter((a) => a.job_id === ctx.tick());
    assert.ok(reads.length >= 2, `${reads.length} job_output calls`);
    assert.deepEqual(reads[0], { job_id: ctx.tick(), since: 0, wait: 5 });
    for (let i = 1; i < reads.length; i++) {
      assert.equal(typeof reads[i].since, "number", JSON.stringify(reads[i]));
      assert.ok(reads[i].since >= reads[i - 1].since, "since went backwards");
    }
    assert.ok(reads.at(-1).since > 0);
    await ctx.screenshot("jobs-following.png");
  });

  step("Stop calls job_kill, the job ends and polling stops", async () => {
    const row = jobRow(ctx.tick());
    await ctx.root().getByRole("button", { name: `Stop ${ctx.tick()}` }).click();
    await waitFor(async () => (await row.getAttribute("data-running")) === "false", 30_000, "the row to show the job ended");
    assert.deepEqual(ctx.toolArgs("job_kill").at(-1), { job_id: ctx.tick() });
    assert.match(await row.locator(".pill").textContent(), /^(exit \d+|ended)$/);
    assert.equal(await row.locator("button").count(), 0, "Stop is still offered");
    const ran = new RegExp(`^${ctx.tick()} · ran \\d+ (s|min \\d+ s)$`);
    await waitFor(async () => ran.test(await row.locator(".meta").textContent()), 10_000, "the job's runtime");
    await waitFor(async () => /\n\[(exit \d+|ended)\]\n$/.test(await text("#job-output")), 20_000, "the end line in the output");
    assert.match(await text("#job-state"), /^ended( · exit \d+)?$/);
    assert.match(await text("#status"), new RegExp(`^Stopped ${ctx.tick()}`));
    const listed = await listedJob(ctx.client, ctx.computerId, ctx.tick());
    assert.equal(listed.running, false, JSON.stringify(listed));
    assert.ok(listed.ended_at, JSON.stringify(listed));
    // Absence of further reads can only be shown over time: longer than two poll intervals.
    const reads = ctx.toolArgs("job_output").length;
    await new Promise((r) => setTimeout(r, 2_500));
    assert.equal(ctx.toolArgs("job_output").length, reads, "the page still polls an ended job");
    await ctx.screenshot("jobs-stopped.png");
  });
}
