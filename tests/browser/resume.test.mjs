// A tool call whose connection is cut while its command runs, with the TypeScript SDK's own
// reconnect (GET /mcp with Last-Event-ID after the server's announced retry delay): the
// command ends before the client comes back, and the answer must still reach it (issue 30,
// item 16; docs/decisions.md, "Streamable HTTP service"). Both SDK lines: @modelcontextprotocol/sdk
// 1.x and @modelcontextprotocol/client 2.x. The connection is cut by a TCP relay in front of the
// server, as a dropped network would. Needs Docker, not Chromium.
import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { createServer, connect } from "node:net";
import { after, before, describe, it } from "node:test";

import { Client as ClientV1 } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport as TransportV1 } from "@modelcontextprotocol/sdk/client/streamableHttp.js";
import { Client as ClientV2, StreamableHTTPClientTransport as TransportV2 } from "@modelcontextprotocol/client";

import { containerName, docker, removeComputers, startHttpServer, uniqueId, waitFor } from "./lib/harness.mjs";

const TOKEN = randomBytes(12).toString("hex");
// Ends only once the test says so (a file appears), so that its connection can be cut first.
const WAIT_FOR_GO = "while [ ! -e /tmp/go ]; do sleep 0.05; done; echo answer-after-reconnect";
const created = [];
let server;

/** A TCP relay to `port` whose open connections can all be cut at once. */
async function cuttingRelay(port) {
  const sockets = new Set();
  let fromClient = "";
  const relay = createServer((client) => {
    const upstream = connect(port, "127.0.0.1");
    for (const s of [client, upstream]) {
      sockets.add(s);
      s.on("close", () => sockets.delete(s));
      s.on("error", () => {});
    }
    client.on("data", (chunk) => {
      fromClient += chunk.toString("latin1");
      upstream.write(chunk);
    });
    upstream.on("data", (chunk) => client.write(chunk));
    client.on("end", () => upstream.end());
    upstream.on("end", () => client.end());
  });
  await new Promise((resolve) => relay.listen(0, "127.0.0.1", resolve));
  return {
    url: `http://127.0.0.1:${relay.address().port}/mcp`,
    sent: () => fromClient,
    cut: () => {
      for (const s of sockets) s.destroy();
    },
    close: () => {
      for (const s of sockets) s.destroy();
      return new Promise((resolve) => relay.close(resolve));
    },
  };
}

/** `callTool` with a 40 s request timeout: its options are the third argument in 1.x, the second in 2.x. */
const callV1 = (client, params) => client.callTool(params, undefined, { timeout: 40_000 });
const callV2 = (client, params) => client.callTool(params, { timeout: 40_000 });

async function callThroughACut(Client, Transport, callTool) {
  const computer = uniqueId("resume");
  created.push(computer);
  const relay = await cuttingRelay(server.port);
  const client = new Client({ name: "kilntainers-resume-test", version: "1.0.0" }, { capabilities: {} });
  try {
    await client.connect(
      new Transport(new URL(relay.url), { requestInit: { headers: { Authorization: `Bearer ${TOKEN}` } } }),
    );
    const made = await client.callTool({ name: "terminal_execute", arguments: { computer_id: computer, command: "true" } });
    assert.equal(made.isError, false, JSON.stringify(made));
    const pending = callTool(client, {
      name: "terminal_execute",
      arguments: { computer_id: computer, command: WAIT_FOR_GO },
    });
    pending.catch(() => {});
    await waitFor(() => relay.sent().includes("answer-after-reconnect"), 20_000, "the call to reach the server");
    await waitFor(
      () => (docker(["exec", containerName(computer), "ps"]) ?? "").includes("sleep"),
      20_000,
      "the command to run",
    );
    relay.cut();
    assert.notEqual(docker(["exec", containerName(computer), "touch", "/tmp/go"]), null);
    const result = await pending;
    assert.equal(result.isError, false, JSON.stringify(result));
    assert.equal(result.structuredContent.stdout, "answer-after-reconnect\n");
  } finally {
    await client.close().catch(() => {});
    await relay.close();
  }
}

describe("a tool call's answer survives a cut connection (Last-Event-ID)", () => {
  before(async () => {
    server = await startHttpServer({ token: TOKEN });
  });

  after(async () => {
    removeComputers(created);
    await server?.close();
  });

  it("with @modelcontextprotocol/sdk 1.x", async () => {
    await callThroughACut(ClientV1, TransportV1, callV1);
  });

  it("with @modelcontextprotocol/client 2.x", async () => {
    await callThroughACut(ClientV2, TransportV2, callV2);
  });
});
