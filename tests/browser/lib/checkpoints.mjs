// The dashboard's Checkpoints section (docs/checkpoints.md, "Dashboard"), shared by app mode
// (dashboard.test.mjs) and web mode (web.test.mjs): the page takes two checkpoints, rolls back
// (a first click only arms the button: a file the rollback would remove is still there), takes
// a third, which becomes a sibling, and forks; the test's own MCP client writes and reads the
// files, Docker shows the containers. Every wait is for a condition, never a fixed delay.
import assert from "node:assert/strict";

import { inspectComputer, statusWaiter, waitFor } from "./harness.mjs";

/** A note that would become an element if the page parsed it as HTML. */
export const NOTE = `<b id="pwn-note">clean</b> start & "quotes"`;

function payload(result, what) {
  assert.ok(!result.isError, `${what}: ${JSON.stringify(result)}`);
  return result.structuredContent;
}

/** `command` in the permanent computer `computerId` (created if missing); the result's payload. */
export async function runIn(client, computerId, command) {
  return payload(
    await client.callTool({ name: "terminal_execute", arguments: { computer_id: computerId, temporary: false, command } }),
    "terminal_execute",
  );
}

/** Creates the permanent computer the steps work on, with one file in it. */
export async function prepareCheckpoints(client, computerId) {
  const p = await runIn(client, computerId, "echo one > /root/one");
  assert.equal(p.exit_code, 0, JSON.stringify(p));
}

/**
 * Registers the Checkpoints steps with `step(name, fn)`. `ctx`: root() (the page or the
 * dashboard's FrameLocator), client (the test's own), computerId, toolArgs(name) (the arguments
 * of every tools/call of that name the page made), track(id) (a computer to remove afterwards),
 * screenshot(name).
 */
export function checkpointSteps(step, ctx) {
  const $ = (selector) => ctx.root().locator(selector);
  const text = async (selector) => (await $(selector).textContent()) ?? "";
  const waitStatus = statusWaiter(() => $("#status"));
  const node = (name) => $(`#ckpt-tree li[data-checkpoint="${name}"]`);
  const button = (name, act) => $(`#ckpt-tree li[data-checkpoint="${name}"] > .cnode button[data-ckpt-act="${act}"]`);
  const computerRow = (id) => $(`#list li[role="option"][data-id="${id}"]`);
  /** [name, parent or null] of every node in document order: the tree as the page shows it. */
  const shownTree = () =>
    $("#ckpt-tree li[data-checkpoint]").evaluateAll((els) =>
      els.map((e) => [e.dataset.checkpoint, e.parentElement.closest("li[data-checkpoint]")?.dataset.checkpoint ?? null]),
    );
  const current = () => $("#ckpt-tree li[aria-current=true]").evaluateAll((els) => els.map((e) => e.dataset.checkpoint));
  const cat = async (computerId, path) => (await runIn(ctx.client, computerId, `cat ${path}`));
  const id = ctx.computerId;
  const fork = `${id}-f1`;
  let third;

  step("opening the computer shows its checkpoint tree, empty", async () => {
    await computerRow(id).waitFor({ timeout: 20_000 });
    await computerRow(id).locator(".slug").click();
    await $("#checkpoints").waitFor({ state: "visible", timeout: 20_000 });
    assert.equal(await text("#ckpt-target"), id);
    await waitFor(async () => (await text("#ckpt-empty")) === "No checkpoints yet.", 20_000, "the empty tree");
    assert.deepEqual(ctx.toolArgs("checkpoint_list").at(-1), { computer_id: id });
    assert.equal(await text("#ckpt-count"), "0");
    assert.equal(await $("#fork-count").inputValue(), "1");
  });

  step("Checkpoint with a name and a note, then another: a chain, the newest current", async () => {
    await $("#ckpt-name").fill("base");
    await $("#ckpt-note").fill(NOTE);
    await $("#ckpt-take").click();
    await waitStatus(`Checkpoint base of ${id} saved.`, 60_000);
    assert.deepEqual(ctx.toolArgs("computer_checkpoint").at(-1), { computer_id: id, name: "base", note: NOTE });
    assert.equal(await $("#ckpt-name").inputValue(), "");
    assert.equal(await $("#ckpt-note").inputValue(), "");
    // A file the computer gets after base: a rollback to base removes it.
    await runIn(ctx.client, id, "echo later > /root/later");
    await $("#ckpt-name").fill("second");
    await $("#ckpt-name").press("Enter");
    await waitStatus(`Checkpoint second of ${id} saved.`, 60_000);
    assert.deepEqual(ctx.toolArgs("computer_checkpoint").at(-1), { computer_id: id, name: "second" });
    assert.deepEqual(await shownTree(), [["base", null], ["second", "base"]]);
    assert.deepEqual(await current(), ["second"]);
    assert.equal(await text("#ckpt-count"), "2");
    // What each node shows: name, note (as text), time, size, memory; against the tool's own list.
    const listed = payload(await ctx.client.callTool({ name: "checkpoint_list", arguments: { computer_id: id } }), "checkpoint_list");
    const base = listed.checkpoints.find((k) => k.checkpoint === "base");
    assert.equal(await text(`#ckpt-tree li[data-checkpoint="base"] > .cnode .note`), NOTE);
    assert.equal(await $("#pwn-note").count(), 0, "the note became an element");
    assert.equal(await node("base").locator(":scope > .cnode .slug").textContent(), "base");
    const meta = await node("base").locator(":scope > .cnode .meta").textContent();
    const when = `${base.created_at.slice(0, 10)} ${base.created_at.slice(11, 19)} UTC`;
    assert.match(meta, /^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC · (\d+(\.\d)? (B|KiB|MiB|GiB)|size unknown)$/);
    assert.ok(meta.startsWith(`${when} · `), `${meta} does not start with ${when}`);
    assert.equal(await node("base").locator(":scope > .cnode .pill").allTextContents().then((p) => p.at(-1)), "files only");
    assert.equal(base.memory, false);
    assert.deepEqual(await node("second").locator(":scope > .cnode .pill").allTextContents(), ["current", "files only"]);
    assert.equal(await $(`#ckpt-tree li[data-checkpoint="second"] > .cnode .note`).count(), 0, "second has a note");
  });

  step("one click on Rollback changes nothing: it asks to confirm, and a click elsewhere disarms it", async () => {
    const before = inspectComputer(id);
    assert.ok(before?.running, "the computer's container is not running");
    await button("base", "rollback").click();
    await waitFor(async () => (await button("base", "rollback").textContent()) === "Confirm rollback", 5_000, "Confirm rollback");
    assert.equal(await button("base", "rollback").getAttribute("aria-label"), "Confirm rollback to base");
    assert.equal(await text("#status"), `Roll back ${id} to base? Its files become the checkpoint's, and running commands end.`);
    await ctx.screenshot("checkpoints-confirm.png");
    assert.equal(ctx.toolArgs("computer_rollback").length, 0, "the first click rolled back");
    assert.equal((await cat(id, "/root/later")).stdout, "later\n");
    assert.equal(inspectComputer(id)?.id, before.id, "the container was replaced");
    // A click anywhere else disarms it.
    await $("#checkpoints-h").click();
    await waitFor(async () => (await button("base", "rollback").textContent()) === "Rollback", 5_000, "Rollback again");
    assert.equal(await text("#status"), `Checkpoint second of ${id} saved.`);
    // So does a click on another checkpoint's Rollback, which arms that one instead.
    await button("base", "rollback").click();
    await waitFor(async () => (await button("base", "rollback").textContent()) === "Confirm rollback", 5_000, "Confirm rollback");
    await button("second", "rollback").click();
    await waitFor(async () => (await button("second", "rollback").textContent()) === "Confirm rollback", 5_000, "second armed");
    assert.equal(await button("base", "rollback").textContent(), "Rollback");
    await ctx.root().locator("body").press("Escape");
    await waitFor(async () => (await button("second", "rollback").textContent()) === "Rollback", 5_000, "Escape disarms");
    assert.equal(ctx.toolArgs("computer_rollback").length, 0, "a click rolled back");
    assert.equal((await cat(id, "/root/later")).stdout, "later\n");
    assert.equal(inspectComputer(id)?.id, before.id, "the container was replaced");
  });

  step("the second click rolls back: the later file is gone, a new container, base current", async () => {
    const before = inspectComputer(id);
    await button("base", "rollback").click();
    await waitFor(async () => (await button("base", "rollback").textContent()) === "Confirm rollback", 5_000, "Confirm rollback");
    await button("base", "rollback").click();
    await waitStatus(`${id} rolled back to base.`, 60_000);
    assert.deepEqual(ctx.toolArgs("computer_rollback"), [{ computer_id: id, checkpoint: "base" }]);
    const gone = await cat(id, "/root/later");
    assert.notEqual(gone.exit_code, 0, `/root/later survived the rollback: ${JSON.stringify(gone)}`);
    assert.equal((await cat(id, "/root/one")).stdout, "one\n");
    const now = inspectComputer(id);
    assert.ok(now?.running, "no running container after the rollback");
    assert.notEqual(now.id, before.id, "the rollback kept the container");
    // Later checkpoints are kept: it is a tree.
    await waitFor(async () => JSON.stringify(await current()) === JSON.stringify(["base"]), 10_000, "base current");
    assert.deepEqual(await shownTree(), [["base", null], ["second", "base"]]);
  });

  step("a tool's error is shown in the section, and the typed name and note stay", async () => {
    await $("#ckpt-name").fill("base");
    await $("#ckpt-note").fill("again");
    await $("#ckpt-take").click();
    const message = `Checkpoint base already exists on ${id}.`;
    await waitStatus(message, 30_000);
    assert.match(await $("#status").getAttribute("class"), /\berror\b/);
    assert.equal(await $("#ckpt-error").isVisible(), true);
    assert.equal(await text("#ckpt-error"), message);
    assert.equal(await $("#ckpt-name").inputValue(), "base");
    assert.equal(await $("#ckpt-note").inputValue(), "again");
    assert.deepEqual(await shownTree(), [["base", null], ["second", "base"]]);
    await $("#ckpt-name").fill("");
    await $("#ckpt-note").fill("");
  });

  step("a checkpoint after the rollback (default name) is a sibling of second", async () => {
    await $("#ckpt-take").click();
    await waitStatus(/^Checkpoint c-[0-9a-f]{8} of [a-z0-9-]+ saved\.$/, 60_000);
    third = (await text("#status")).match(/^Checkpoint (c-[0-9a-f]{8}) of /)[1];
    assert.deepEqual(ctx.toolArgs("computer_checkpoint").at(-1), { computer_id: id });
    assert.equal(await $("#ckpt-error").isVisible(), false, "the earlier error is still shown");
    assert.deepEqual(await shownTree(), [["base", null], ["second", "base"], [third, "base"]]);
    assert.deepEqual(await current(), [third]);
    assert.equal(await text("#ckpt-count"), "3");
    await ctx.screenshot("checkpoints.png");
  });

  step("Fork (count 1) from second shows the new computer's id; the fork has second's files", async () => {
    ctx.track(fork);
    await button("second", "fork").click();
    await waitStatus(`Forked ${id} from second: ${fork}.`, 120_000);
    assert.deepEqual(ctx.toolArgs("computer_fork"), [{ computer_id: id, checkpoint: "second", count: 1 }]);
    assert.equal(await $("#fork-result").isVisible(), true);
    assert.equal(await text("#fork-result"), `New computer from second: ${fork}`);
    await computerRow(fork).waitFor({ timeout: 10_000 });
    assert.equal(await computerRow(fork).locator(".pill").textContent(), "permanent");
    assert.ok(inspectComputer(fork)?.running, "docker does not show the fork running");
    assert.equal((await cat(fork, "/root/later")).stdout, "later\n");
    // The source is unchanged: same tree, same current.
    assert.deepEqual(await shownTree(), [["base", null], ["second", "base"], [third, "base"]]);
    assert.deepEqual(await current(), [third]);
    assert.notEqual((await cat(id, "/root/later")).exit_code, 0);
  });

  step("the fork's id opens the fork, whose history starts at second", async () => {
    await $(`#fork-result button[data-select="${fork}"]`).click();
    await waitFor(async () => (await text("#ckpt-target")) === fork, 10_000, "the fork's checkpoints");
    assert.equal(await computerRow(fork).getAttribute("aria-selected"), "true");
    await waitFor(async () => JSON.stringify(await shownTree()) === JSON.stringify([["second", null]]), 20_000, "the fork's tree");
    assert.deepEqual(await current(), ["second"]);
    assert.deepEqual(ctx.toolArgs("checkpoint_list").at(-1), { computer_id: fork });
    assert.equal(await $("#fork-result").isVisible(), false, "the source's fork result is shown for the fork");
  });
}
