// A page a computer serves, in headless Chromium, against a server started with
// --allow-unauthenticated-http (docs/files.md, "Ports"; issue 30, item 4): it must not reach
// another computer's port through the server's proxy route, nor the server's /mcp. Computer A
// serves the page on its port's own origin; computer B runs a server that records every
// request it gets. The page tries what a page can do without anyone's help: a no-cors POST, an
// image, a script and a form-less fetch to B's route, and a JSON POST to /mcp. B must record
// nothing from the page; a direct request (the control) is recorded.
import assert from "node:assert/strict";
import { after, before, describe, it } from "node:test";

import { Client, StreamableHTTPClientTransport } from "@modelcontextprotocol/client";

import {
  assertPrerequisites,
  containerName,
  docker,
  launchBrowser,
  removeComputers,
  startHttpServer,
  uniqueId,
  waitFor,
} from "./lib/harness.mjs";

// Records each request line in /tmp/hits, then answers 200 (BusyBox `nc -ll -e`, one process
// per connection).
const RECORDER = `#!/bin/sh
IFS= read -r first
printf '%s\\n' "$first" | tr -d '\\r' >> /tmp/hits
while IFS= read -r line; do
  line=$(printf '%s' "$line" | tr -d '\\r')
  [ -z "$line" ] && break
done
printf 'HTTP/1.1 200 OK\\r\\nContent-Type: text/plain\\r\\nContent-Length: 3\\r\\nConnection: close\\r\\n\\r\\nhit'
`;
// The page: every way to reach B's route and the server's /mcp that needs no help from them.
const ATTACK = `<!doctype html><meta charset="utf-8"><title>attack</title>
<script>
const params = new URLSearchParams(location.search);
const route = params.get("route");
const mcp = params.get("mcp");
const tries = [
  fetch(route + "no-cors-post", { method: "POST", mode: "no-cors", body: "x" }).then(() => "sent", (e) => "failed"),
  fetch(route + "cors-get").then((r) => "read " + r.status, (e) => "failed"),
  fetch(mcp, { method: "POST", headers: { "content-type": "application/json" },
    body: JSON.stringify({ jsonrpc: "2.0", id: 1, method: "initialize", params: { protocolVersion: "2025-11-25", capabilities: {}, clientInfo: { name: "page", version: "0" } } }) })
    .then((r) => "read " + r.status, (e) => "failed"),
  new Promise((resolve) => { const img = new Image(); img.onload = img.onerror = () => resolve("image"); img.src = route + "image"; }),
  new Promise((resolve) => { const s = document.createElement("script"); s.onload = s.onerror = () => resolve("script"); s.src = route + "script"; document.head.append(s); }),
];
Promise.all(tries).then((outcomes) => { window.outcomes = outcomes; });
</script>`;

let server;
let browser;
let client;
const created = [];

async function call(name, args) {
  const res = await client.callTool({ name, arguments: args });
  assert.equal(res.isError, false, JSON.stringify(res));
  return res.structuredContent;
}

async function portUrl(computer, port) {
  return waitFor(async () => {
    const res = await client.callTool({ name: "port_url", arguments: { computer_id: computer, port } });
    return res.isError ? null : res.structuredContent;
  }, 20_000, `port ${port} of ${computer}`);
}

const hits = (computer) => (docker(["exec", containerName(computer), "cat", "/tmp/hits"]) ?? "").split("\n").filter(Boolean);

describe("without authentication, a computer's page cannot reach other ports or /mcp", () => {
  before(async () => {
    assertPrerequisites();
    server = await startHttpServer({ extraArgs: ["--allow-unauthenticated-http", "--file-tools", "--job-tools"] });
    browser = await launchBrowser();
    client = new Client({ name: "kilntainers-browser-tests", version: "1.0.0" }, { capabilities: {} });
    await client.connect(new StreamableHTTPClientTransport(new URL(`${server.url}/mcp`)));
  });

  after(async () => {
    await client?.close().catch(() => {});
    removeComputers(created);
    await browser?.close();
    await server?.close();
  });

  it("B's recorder sees only the direct request", async () => {
    const a = uniqueId("page");
    const b = uniqueId("target");
    created.push(a, b);
    for (const id of [a, b]) await call("terminal_execute", { computer_id: id, command: "touch /tmp/hits" });
    await call("file_write", { computer_id: b, path: "/srv/recorder.sh", content: RECORDER, mode: "0755" });
    await call("terminal_execute", { computer_id: b, command: "busybox nc -ll -p 8082 -e /srv/recorder.sh", yield_after: 1 });
    await call("file_write", { computer_id: a, path: "/www/attack.html", content: ATTACK });
    await call("terminal_execute", { computer_id: a, command: "busybox httpd -p 8081 -h /www" });
    const page = await portUrl(a, 8081);
    const target = await portUrl(b, 8082);
    assert.deepEqual(hits(b), [], "the recorder was reached before the page ran");
    const route = target.proxy_url;
    const url = `${page.url}attack.html?route=${encodeURIComponent(route)}&mcp=${encodeURIComponent(`${server.url}/mcp`)}`;
    const res = await browser.page.goto(url);
    assert.equal(res.status(), 200);
    const outcomes = await waitFor(() => browser.page.evaluate(() => window.outcomes), 20_000, "the page's attempts");
    // Nothing the page sent reached B, and it could read neither B's route nor /mcp.
    assert.deepEqual(hits(b), [], `the page reached B: ${JSON.stringify(outcomes)}`);
    assert.equal(outcomes[1], "failed", JSON.stringify(outcomes));
    assert.equal(outcomes[2], "failed", JSON.stringify(outcomes));
    // Control: a direct request, as a person typing the address or an HTTP client makes it.
    const direct = await fetch(`${route}direct`);
    assert.equal(await direct.text(), "hit");
    assert.deepEqual(hits(b), ["GET /direct HTTP/1.1"]);
  });
});
