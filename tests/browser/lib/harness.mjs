// Shared helpers for the browser and Inspector tests: the real server over stdio (official MCP
// TypeScript SDK client), a loopback host page, headless Debian Chromium, Docker checks and
// cleanup. Everything started here is stopped by the returned close functions.
import { execFileSync, spawn } from "node:child_process";
import { createHash } from "node:crypto";
import { existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync } from "node:fs";
import { createServer } from "node:http";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

import { Client } from "@modelcontextprotocol/client";
import { StdioClientTransport } from "@modelcontextprotocol/client/stdio";
import { it } from "node:test";

import * as esbuild from "esbuild";
import { chromium } from "playwright-core";

export const HERE = dirname(dirname(fileURLToPath(import.meta.url)));
export const REPO_ROOT = resolve(HERE, "..", "..");
export const OUTPUT_DIR = join(HERE, "output");
export const SERVER_BIN =
  process.env.KILNTAINERS_BIN || join(REPO_ROOT, "target", "debug", "mcp-sandbox-computer-vm-for-ai");
export const SERVER_ARGS = ["--lifecycle-tools", "--image", "sandbox-busybox:full", "--shell", "/bin/sh"];
export const CHROMIUM = process.env.CHROMIUM_BIN || "/usr/bin/chromium";
// Flags verified on this machine (docs/decisions.md, "Real MCP clients"); the user-data-dir is a fresh temp dir.
export const CHROMIUM_ARGS = [
  "--headless",
  "--no-sandbox",
  "--disable-gpu",
  "--disable-quic",
  "--no-first-run",
  "--disable-background-networking",
  "--disable-component-update",
  "--disable-sync",
];
export const DASHBOARD_URI = "ui://kilntainers/computers";
// The MCP Apps default CSP for a resource declaring `_meta.ui.csp = {}` (docs/decisions.md, "Dashboard content security policy").
export const APP_CSP =
  "default-src 'none'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; " +
  "img-src 'self' data:; media-src 'self' data:; connect-src 'none'; object-src 'none'";

/**
 * A `step(name, fn)` for one sequence of dependent tests: `it`, but skipped once an earlier
 * step of the same sequence failed (later steps depend on its state).
 */
export function stepsInOrder() {
  let failed = null;
  return (name, fn) =>
    it(name, async (t) => {
      if (failed) return t.skip(`an earlier step failed: ${failed}`);
      try {
        await fn(t);
      } catch (error) {
        failed = name;
        throw error;
      }
    });
}

export function uniqueId(prefix) {
  const rand = Math.random().toString(16).slice(2, 6);
  return `${prefix}-${process.pid.toString(36)}-${rand}`;
}

export function tempDir(label) {
  return mkdtempSync(join(tmpdir(), `kilntainers-${label}-`));
}

export function assertPrerequisites() {
  const missing = [];
  if (!existsSync(SERVER_BIN)) missing.push(`server binary ${SERVER_BIN} (run cargo build)`);
  if (!existsSync(CHROMIUM)) missing.push(`${CHROMIUM} (apt-get install chromium)`);
  if (docker(["version", "--format", "{{.Server.Version}}"]) === null) missing.push("a running Docker engine");
  if (missing.length) throw new Error(`missing prerequisites: ${missing.join("; ")}`);
}

// ------------------------------------------------------------------ docker

/** Run the docker CLI; stdout trimmed, or null when it fails. */
export function docker(args) {
  try {
    return execFileSync("docker", args, { encoding: "utf8", stdio: ["ignore", "pipe", "pipe"], timeout: 60_000 }).trim();
  } catch {
    return null;
  }
}

export function containerName(id) {
  return `kilntainer-${id}`;
}

/** {id, running, startedAt} of a computer's container, or null when there is none. */
export function inspectComputer(id) {
  const out = docker(["inspect", "-f", "{{.Id}} {{.State.Running}} {{.State.StartedAt}}", containerName(id)]);
  if (!out) return null;
  const [cid, running, startedAt] = out.split(" ");
  return { id: cid, running: running === "true", startedAt };
}

/** Whether `docker ps -a` lists a container with this computer's exact name. */
export function containerListed(id) {
  const out = docker(["ps", "-a", "--filter", `name=^/?${containerName(id)}$`, "--format", "{{.Names}}"]);
  if (out === null) throw new Error("docker ps failed");
  return out.split("\n").some((n) => n.trim() === containerName(id));
}

export function removeComputers(ids) {
  for (const id of ids) docker(["rm", "-f", containerName(id)]);
}

/**
 * Removes the checkpoint images (docs/checkpoints.md) of these computers of the default
 * principal, tagged (`kilntainers-checkpoint/<id>:<name>`) or left untagged (by their label).
 * Remove the computers first: an image a container runs from is only untagged.
 */
export function removeCheckpointImages(ids) {
  for (const id of ids) {
    const images = new Set();
    for (const filter of [`reference=kilntainers-checkpoint/${id}`, `label=kilntainers.checkpoint.computer-id=${id}`]) {
      for (const image of (docker(["images", "-q", "--no-trunc", "--filter", filter]) ?? "").split("\n")) {
        if (image.trim()) images.add(image.trim());
      }
    }
    if (images.size) docker(["rmi", "-f", ...images]);
  }
}

/** The tag of a principal other than `default` in its computers' names (docs/auth.md). */
export function principalTag(principal) {
  return createHash("sha256").update(principal).digest("hex").slice(0, 16);
}

/** The container name of computer `id` of `principal`: `kilntainer-<id>.<tag>`. */
export function ownedContainerName(id, principal) {
  return `${containerName(id)}.${principalTag(principal)}`;
}

/** Names of every container labelled as made for `principal`, running or not. */
export function containersOwnedBy(principal) {
  const out = docker(["ps", "-a", "--filter", `label=kilntainers.owner=${principal}`, "--format", "{{.Names}}"]);
  if (out === null) throw new Error("docker ps failed");
  return out.split("\n").map((n) => n.trim()).filter(Boolean);
}

/** Removes every container labelled as made for one of `principals`. */
export function removeOwnedBy(principals) {
  for (const principal of principals) {
    const names = docker(["ps", "-a", "-q", "--filter", `label=kilntainers.owner=${principal}`]);
    if (names) docker(["rm", "-f", ...names.split("\n").filter(Boolean)]);
  }
}

// ------------------------------------------------------------------ the server

/**
 * Start the real server over stdio with its own HOME and connect the SDK client.
 * Returns {client, home, stderr(), close()}.
 */
export async function startServer({ args = SERVER_ARGS, env = {} } = {}) {
  const home = tempDir("home");
  const childEnv = {};
  for (const key of ["PATH", "DOCKER_HOST", "LANG", "TZ", "RUST_BACKTRACE"]) {
    if (process.env[key]) childEnv[key] = process.env[key];
  }
  Object.assign(childEnv, { HOME: home, XDG_CACHE_HOME: join(home, ".cache") }, env);
  const transport = new StdioClientTransport({
    command: SERVER_BIN,
    args,
    env: childEnv,
    cwd: home,
    stderr: "pipe",
  });
  let stderr = "";
  transport.stderr?.on("data", (chunk) => {
    stderr += chunk.toString();
  });
  const client = new Client({ name: "kilntainers-browser-tests", version: "1.0.0" }, { capabilities: {} });
  try {
    await client.connect(transport);
  } catch (error) {
    await transport.close().catch(() => {});
    rmSync(home, { recursive: true, force: true });
    throw new Error(`server did not start: ${error.message}\n${stderr}`);
  }
  const pid = transport.pid;
  return {
    client,
    home,
    pid,
    stderr: () => stderr,
    async close() {
      await client.close().catch(() => {});
      // The SDK closes stdin and then signals the child; make sure it is gone.
      await waitFor(() => !alive(pid), 5_000).catch(() => {
        if (alive(pid)) process.kill(pid, "SIGKILL");
      });
      rmSync(home, { recursive: true, force: true });
    },
  };
}

function alive(pid) {
  if (!pid) return false;
  try {
    process.kill(pid, 0);
    return true;
  } catch {
    return false;
  }
}

/**
 * A relay from the browser-side SDK Client to the Node-side SDK client. `initialize` is answered
 * with what the real server answered to the Node client's own handshake; every other request is
 * forwarded verbatim. Every forwarded request is appended to `calls`.
 */
export function makeRelay(client, calls) {
  return async (message) => {
    if (!message || typeof message !== "object" || typeof message.method !== "string") return null;
    if (message.id === undefined || message.id === null) return null; // notifications end here
    const entry = { method: message.method, params: message.params, at: Date.now() };
    if (message.method === "tools/call") {
      entry.name = message.params?.name;
      entry.arguments = message.params?.arguments;
    }
    calls.push(entry);
    try {
      let result;
      if (message.method === "initialize") {
        result = {
          protocolVersion: client.getNegotiatedProtocolVersion(),
          capabilities: client.getServerCapabilities(),
          serverInfo: client.getServerVersion(),
          instructions: client.getInstructions(),
        };
      } else {
        result = await client.request({ method: message.method, params: message.params });
      }
      entry.result = result;
      return { jsonrpc: "2.0", id: message.id, result };
    } catch (error) {
      entry.error = error.message;
      return { jsonrpc: "2.0", id: message.id, error: { code: error.code ?? -32603, message: error.message } };
    }
  };
}

// ------------------------------------------------------------------ host page

export async function bundleHost() {
  const out = await esbuild.build({
    entryPoints: [join(HERE, "host", "host-entry.mjs")],
    bundle: true,
    format: "esm",
    platform: "browser",
    target: "es2022",
    write: false,
    logLevel: "error",
  });
  return out.outputFiles[0].text;
}

/** Serve the host page, its bundle and the app HTML on 127.0.0.1 (random free port). */
export async function startHostServer({ appHtml, hostJs }) {
  const hostHtml = readFileSync(join(HERE, "host", "host.html"), "utf8");
  const server = createServer((req, res) => {
    const path = new URL(req.url, "http://127.0.0.1").pathname;
    const send = (status, type, body, extra = {}) => {
      res.writeHead(status, { "Content-Type": type, "Cache-Control": "no-store", ...extra });
      res.end(body);
    };
    if (path === "/") send(200, "text/html; charset=utf-8", hostHtml);
    else if (path === "/host.js") send(200, "text/javascript; charset=utf-8", hostJs);
    else if (path === "/app") send(200, "text/html; charset=utf-8", appHtml, { "Content-Security-Policy": APP_CSP });
    else if (path === "/favicon.ico") send(204, "image/x-icon", "");
    else send(404, "text/plain", "not found");
  });
  await new Promise((ok, fail) => {
    server.once("error", fail);
    server.listen(0, "127.0.0.1", ok);
  });
  const { port } = server.address();
  return {
    url: `http://127.0.0.1:${port}/`,
    close: () =>
      new Promise((ok) => {
        server.closeAllConnections?.();
        server.close(() => ok());
      }),
  };
}

// ------------------------------------------------------------------ browser

export async function launchBrowser({ viewport = { width: 1100, height: 900 } } = {}) {
  const userDataDir = tempDir("chromium");
  const context = await chromium.launchPersistentContext(userDataDir, {
    executablePath: CHROMIUM,
    headless: true,
    args: CHROMIUM_ARGS,
    viewport,
    deviceScaleFactor: 1,
    colorScheme: "light",
    reducedMotion: "reduce",
  });
  const page = context.pages()[0] || (await context.newPage());
  return {
    context,
    page,
    async close() {
      await context.close().catch(() => {});
      rmSync(userDataDir, { recursive: true, force: true });
    },
  };
}

// ------------------------------------------------------------------ misc

export async function waitFor(predicate, timeoutMs = 20_000, what = "condition") {
  const deadline = Date.now() + timeoutMs;
  let last;
  for (;;) {
    try {
      last = await predicate();
      if (last) return last;
    } catch (error) {
      last = error;
    }
    if (Date.now() > deadline) {
      throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}${last instanceof Error ? `: ${last.message}` : ""}`);
    }
    await new Promise((r) => setTimeout(r, 100));
  }
}

/**
 * Waits until the page's status line (`status()` gives its locator) equals `expected` (a
 * string) or matches it (a RegExp); returns the text.
 */
export function statusWaiter(status) {
  const text = async () => (await status().textContent()) ?? "";
  return async (expected, timeoutMs = 30_000) =>
    waitFor(
      async () => {
        const t = await text();
        return (typeof expected === "string" ? t === expected : expected.test(t)) ? t || true : false;
      },
      timeoutMs,
      `status ${expected} (now: ${await text().catch(() => "?")})`,
    );
}

export function ensureOutputDir() {
  mkdirSync(OUTPUT_DIR, { recursive: true });
  return OUTPUT_DIR;
}

/** Run a command; resolves {code, stdout, stderr}. Kills it after timeoutMs. */
export function run(command, args, { cwd, env, timeoutMs = 60_000 } = {}) {
  return new Promise((ok) => {
    const child = spawn(command, args, { cwd, env, stdio: ["ignore", "pipe", "pipe"] });
    let stdout = "";
    let stderr = "";
    child.stdout.on("data", (c) => (stdout += c));
    child.stderr.on("data", (c) => (stderr += c));
    const timer = setTimeout(() => child.kill("SIGKILL"), timeoutMs);
    child.on("close", (code, signal) => {
      clearTimeout(timer);
      ok({ code: code ?? (signal ? 128 : 1), stdout, stderr });
    });
  });
}

// ------------------------------------------------------------------ HTTP mode

export async function freePort() {
  const { createServer: createNetServer } = await import("node:net");
  return new Promise((ok, fail) => {
    const srv = createNetServer();
    srv.once("error", fail);
    srv.listen(0, "127.0.0.1", () => {
      const { port } = srv.address();
      srv.close(() => ok(port));
    });
  });
}

/**
 * Start the real server in HTTP mode on a free loopback port (or `port`) with its own HOME.
 * Returns {url, port, stderr(), close()}.
 */
export async function startHttpServer({ token, extraArgs = [], port: chosenPort } = {}) {
  const home = tempDir("home");
  const port = chosenPort ?? (await freePort());
  const args = ["--transport", "http", "--host", "127.0.0.1", "--port", String(port), ...SERVER_ARGS, ...extraArgs];
  if (token) args.push("--auth-token", token);
  const env = { HOME: home, XDG_CACHE_HOME: join(home, ".cache") };
  for (const key of ["PATH", "DOCKER_HOST", "LANG", "TZ"]) if (process.env[key]) env[key] = process.env[key];
  const child = spawn(SERVER_BIN, args, { cwd: home, env, stdio: ["ignore", "ignore", "pipe"] });
  let stderr = "";
  child.stderr.on("data", (c) => (stderr += c));
  let exited = false;
  child.on("exit", () => (exited = true));
  const url = `http://127.0.0.1:${port}`;
  const close = async () => {
    if (!exited) {
      child.kill("SIGTERM");
      await waitFor(() => exited, 25_000, "HTTP server exit").catch(() => child.kill("SIGKILL"));
    }
    rmSync(home, { recursive: true, force: true });
  };
  try {
    await waitFor(
      async () => {
        if (exited) throw new Error(`server exited: ${stderr}`);
        const res = await fetch(`${url}/healthz`).catch(() => null);
        return res?.ok;
      },
      20_000,
      "GET /healthz",
    );
  } catch (error) {
    await close();
    throw error;
  }
  return { url, port, stderr: () => stderr, close };
}
