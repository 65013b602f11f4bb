// The MCP Inspector CLI (a real, independent MCP client) against the real server over stdio
// with lifecycle tools enabled by environment variable (docs/decisions.md, "Real MCP clients").
import assert from "node:assert/strict";
import { rmSync } from "node:fs";
import { join } from "node:path";
import { after, before, describe, it } from "node:test";

import { HERE, SERVER_BIN, assertPrerequisites, run, tempDir } from "./lib/harness.mjs";

const INSPECTOR = join(HERE, "node_modules", "@modelcontextprotocol", "inspector", "cli", "build", "cli.js");
const TOOLS = [
  "terminal_execute",
  "computer_dashboard",
  "computer_list",
  "computer_create",
  "computer_restart",
  "computer_factory_reset",
  "computer_delete",
];
let home;

async function inspector(...methodArgs) {
  const args = [
    INSPECTOR,
    "--cli",
    "-e",
    "ENABLE_LIFECYCLE_TOOLS=true",
    "-e",
    `HOME=${home}`,
    SERVER_BIN,
    "--image",
    "sandbox-busybox:full",
    "--shell",
    "/bin/sh",
    ...methodArgs,
  ];
  const res = await run(process.execPath, args, { cwd: HERE, env: { ...process.env, HOME: home }, timeoutMs: 90_000 });
  assert.equal(res.code, 0, `inspector exited ${res.code}\nstdout: ${res.stdout}\nstderr: ${res.stderr}`);
  return JSON.parse(res.stdout);
}

describe("MCP Inspector CLI 0.15.0", () => {
  before(() => {
    assertPrerequisites();
    home = tempDir("inspector-home");
  });
  after(() => rmSync(home, { recursive: true, force: true }));

  it("tools/list shows the seven tools in order", async () => {
    const out = await inspector("--method", "tools/list");
    assert.deepEqual(out.tools.map((t) => t.name), TOOLS);
    const dashboard = out.tools.find((t) => t.name === "computer_dashboard");
    assert.equal(dashboard._meta?.ui?.resourceUri, "ui://kilntainers/computers");
    assert.equal(dashboard._meta?.["ui/resourceUri"], "ui://kilntainers/computers");
  });

  it("resources/list shows the one dashboard resource", async () => {
    const out = await inspector("--method", "resources/list");
    assert.equal(out.resources.length, 1);
    const [res] = out.resources;
    assert.equal(res.uri, "ui://kilntainers/computers");
    assert.equal(res.mimeType, "text/html;profile=mcp-app");
    assert.deepEqual(res._meta, { ui: { csp: {}, prefersBorder: true } });
  });

  it("tools/call computer_list succeeds", async () => {
    const out = await inspector("--method", "tools/call", "--tool-name", "computer_list");
    assert.notEqual(out.isError, true, JSON.stringify(out));
    const payload = JSON.parse(out.content[0].text);
    assert.ok(Array.isArray(payload.computers));
    assert.equal(payload.count, payload.computers.length);
    assert.deepEqual(out.structuredContent, payload);
  });
});
