// The dashboard's Files and Open a port sections (docs/files.md), shared by app mode
// (dashboard.test.mjs) and web mode (web.test.mjs): the test's own MCP client puts files into a
// computer, the page lists, downloads and uploads them with the file tools, and opens ports with
// port_url. Every wait is for a condition, never a fixed delay.
import assert from "node:assert/strict";
import { createHash, randomBytes } from "node:crypto";
import { readFileSync } from "node:fs";

import { statusWaiter, waitFor } from "./harness.mjs";

const MIB = 1024 * 1024;
/** UTF-8 with multibyte characters, so text is checked byte for byte. */
export const TEXT = "héllo wörld — files\n";
/** Larger than one 1 MiB file_read page, so the download is read in two pages. */
export const BINARY = randomBytes(MIB + MIB / 2 + 7);
/** Where httpd serves from in the "real port" step. */
const INDEX_HTML = "<h1>served from the computer</h1>\n";

const sha256 = (bytes) => createHash("sha256").update(bytes).digest("hex");

function payload(result, what) {
  assert.ok(!result.isError, `${what}: ${JSON.stringify(result).slice(0, 500)}`);
  return result.structuredContent;
}

async function call(client, name, args) {
  return payload(await client.callTool({ name, arguments: args }), name);
}

/** Creates the permanent computer and the files the page is shown. */
export async function prepareFiles(client, computerId) {
  await call(client, "computer_create", { computer_id: computerId, temporary: false });
  const write = (path, content, encoding = "utf-8") =>
    call(client, "file_write", { computer_id: computerId, path, content, encoding });
  await write("/root/hello.txt", TEXT);
  await write("/root/data.bin", BINARY.toString("base64"), "base64");
  await write("/root/sub/inner.txt", "inside\n");
  await write("/root/gone.txt", "removed before it is downloaded\n");
  await write("/root/www/index.html", INDEX_HTML);
}

/** The whole file as the test's own client reads it (file_read paged to eof). */
async function readBack(client, computerId, path) {
  const parts = [];
  let offset = 0;
  for (;;) {
    const p = await call(client, "file_read", { computer_id: computerId, path, offset });
    parts.push(Buffer.from(p.content, p.encoding === "base64" ? "base64" : "utf8"));
    offset += p.length;
    if (p.eof) return Buffer.concat(parts);
    assert.ok(p.length > 0, `file_read of ${path} returned nothing before eof`);
  }
}

/**
 * Registers the file and port steps with `step(name, fn)`. `ctx`: root() (the page or the
 * dashboard's FrameLocator), client, computerId, toolArgs(name) (the arguments of every
 * tools/call of that name the page made), web (web mode: downloads are real downloads, and
 * port_url adds proxy_url), page() (the Playwright page, for downloads), serverUrl and token
 * (web mode), screenshot(name).
 */
export function fileSteps(step, ctx) {
  const $ = (selector) => ctx.root().locator(selector);
  const text = async (selector) => (await $(selector).textContent()) ?? "";
  const fileRow = (name) =>
    $("#file-rows tr").filter({ has: ctx.root().locator("td.name", { hasText: new RegExp(`^${name.replace(/\./g, "\\.")}/?$`) }) });
  const cells = (name) => fileRow(name).locator("td").allTextContents();
  const button = (name) => ctx.root().getByRole("button", { name, exact: true });
  const waitStatus = statusWaiter(() => $("#status"));
  const statusIsError = async () => /\berror\b/.test((await $("#status").getAttribute("class")) ?? "");
  const writes = () => ctx.toolArgs("file_write");

  async function upload(name, buffer) {
    await $("#file-upload").setInputFiles({ name, mimeType: "application/octet-stream", buffer });
    await waitFor(async () => !(await $("#upload").isDisabled()), 5_000, "Upload enabled");
    await button("Upload").click();
  }

  step("opening the computer lists /root: name, type, size, modified", async () => {
    const computerRow = $(`#list li[role="option"][data-id="${ctx.computerId}"]`);
    await computerRow.waitFor({ timeout: 20_000 });
    await computerRow.locator(".slug").click();
    await $("#files").waitFor({ state: "visible", timeout: 20_000 });
    assert.equal(await $("#ports").isVisible(), true, "Open a port is not shown with the file tools");
    await fileRow("hello.txt").waitFor({ timeout: 20_000 });
    assert.deepEqual(ctx.toolArgs("file_list")[0], { computer_id: ctx.computerId, path: "/root", depth: 1 });
    assert.equal(await text("#files-target"), ctx.computerId);
    assert.equal(await text("#files-dir"), "/root");
    const [name, type, size, modified] = await cells("hello.txt");
    assert.deepEqual([name, type, size], ["hello.txt", "file", `${Buffer.byteLength(TEXT)} B`]);
    assert.match(modified, /^\d{4}-\d\d-\d\d \d\d:\d\d$/);
    assert.deepEqual((await cells("data.bin")).slice(0, 3), ["data.bin", "file", "1.5 MiB"]);
    assert.equal(await fileRow("data.bin").locator("td").nth(2).getAttribute("title"), `${BINARY.length} bytes`);
    // Directories first, then files in path order.
    const names = await $("#file-rows td.name").allTextContents();
    assert.deepEqual(names, ["sub/", "www/", "data.bin", "gone.txt", "hello.txt"]);
    assert.deepEqual((await cells("sub")).slice(0, 3), ["sub/", "directory", "—"]);
    assert.equal(await text("#file-count"), "5");
    assert.equal(await $("#files-truncated").isVisible(), false);
    await ctx.screenshot("files-root.png");
  });

  step("goes into a directory, up to the parent and back", async () => {
    await button("Open directory sub").click();
    await waitStatus("1 entry in /root/sub");
    assert.equal(await text("#files-dir"), "/root/sub");
    assert.deepEqual(await $("#file-rows td.name").allTextContents(), ["inner.txt"]);
    assert.deepEqual(ctx.toolArgs("file_list").at(-1), { computer_id: ctx.computerId, path: "/root/sub", depth: 1 });
    await button("Up to the parent directory").click();
    await waitStatus("5 entries in /root");
    await button("Up to the parent directory").click();
    await waitStatus(/^\d+ entries in \/$/);
    assert.equal(await text("#files-dir"), "/");
    assert.deepEqual(ctx.toolArgs("file_list").at(-1), { computer_id: ctx.computerId, path: "/", depth: 1 });
    assert.equal(await $("#files-up").isDisabled(), true, "Up is offered at /");
    assert.deepEqual((await cells("root")).slice(0, 2), ["root/", "directory"]);
    await button("Open directory root").click();
    await waitStatus("5 entries in /root");
    assert.equal(await $("#files-up").isDisabled(), false);
  });

  step("a directory with more than 1,000 entries says it is truncated", async () => {
    const made = await call(ctx.client, "terminal_execute", {
      computer_id: ctx.computerId,
      temporary: false,
      command: "mkdir /root/many && cd /root/many && touch $(seq 1 1001)",
    });
    assert.equal(made.exit_code, 0, JSON.stringify(made));
    await button("Refresh files").click();
    await waitStatus("6 entries in /root");
    assert.equal(await $("#files-truncated").isVisible(), false);
    await button("Open directory many").click();
    await waitStatus("1000 entries in /root/many (more not shown)");
    assert.equal(await $("#files-truncated").isVisible(), true);
    assert.equal(await text("#file-count"), "1000+");
    assert.equal(await $("#file-rows tr").count(), 1000);
    await button("Up to the parent directory").click();
    await waitStatus("6 entries in /root");
    assert.equal(await $("#files-truncated").isVisible(), false);
  });

  step("downloads a text file and a two-page binary file byte for byte", async () => {
    const reads = ctx.toolArgs("file_read").length;
    if (ctx.web) {
      const [text1] = await Promise.all([ctx.page().waitForEvent("download"), button("Download hello.txt").click()]);
      assert.equal(text1.suggestedFilename(), "hello.txt");
      assert.deepEqual(readFileSync(await text1.path()), Buffer.from(TEXT));
      await waitStatus(`Downloaded /root/hello.txt (${Buffer.byteLength(TEXT)} B).`);
      const [bin] = await Promise.all([ctx.page().waitForEvent("download"), button("Download data.bin").click()]);
      assert.equal(bin.suggestedFilename(), "data.bin");
      const got = readFileSync(await bin.path());
      assert.equal(got.length, BINARY.length);
      assert.equal(sha256(got), sha256(BINARY), "the downloaded bytes differ");
      await waitStatus("Downloaded /root/data.bin (1.5 MiB).");
      assert.equal(await $("#file-view").isVisible(), false);
    } else {
      // A sandboxed iframe without allow-downloads: the page shows what it read.
      await button("Download hello.txt").click();
      await waitStatus(`Read /root/hello.txt (${Buffer.byteLength(TEXT)} B).`);
      assert.equal(await $("#file-view").isVisible(), true);
      assert.equal(await text("#file-view-title"), "/root/hello.txt");
      assert.equal(await text("#file-preview"), TEXT);
      await button("Download data.bin").click();
      await waitStatus("Read /root/data.bin (1.5 MiB).");
      assert.equal(await text("#file-preview"), "Binary file: no preview.");
      assert.equal(await $("#file-save").getAttribute("download"), "data.bin");
      assert.match((await $("#file-save").getAttribute("href")) ?? "", /^blob:/);
      await ctx.screenshot("files-preview.png");
      await button("Close the file view").click();
      assert.equal(await $("#file-view").isVisible(), false);
    }
    const args = ctx.toolArgs("file_read").slice(reads);
    const page = (path, offset) => ({ computer_id: ctx.computerId, path, offset, length: MIB });
    assert.deepEqual(args, [page("/root/hello.txt", 0), page("/root/data.bin", 0), page("/root/data.bin", MIB)]);
  });

  step("shows the tools' errors: a file gone since the listing, an upload onto a directory", async () => {
    await call(ctx.client, "terminal_execute", { computer_id: ctx.computerId, temporary: false, command: "rm /root/gone.txt" });
    await button("Download gone.txt").click();
    await waitStatus("File not found: /root/gone.txt");
    assert.ok(await statusIsError(), "the error is not shown as an error");
    const before = writes().length;
    await upload("sub", Buffer.from("not a directory\n"));
    await waitStatus("/root/sub is a directory; give the path of a file to write.");
    assert.ok(await statusIsError());
    assert.equal(writes().length, before + 1);
  });

  step("uploads a file: file_write with base64, listed, read back the same", async () => {
    const bytes = Buffer.from([...Array(256).keys()]); // every byte value: base64, not text
    const before = writes().length;
    await upload("upload.bin", bytes);
    await waitStatus("Uploaded /root/upload.bin (256 B).");
    assert.deepEqual(writes().slice(before), [
      { computer_id: ctx.computerId, path: "/root/upload.bin", content: bytes.toString("base64"), encoding: "base64" },
    ]);
    await fileRow("upload.bin").waitFor({ timeout: 10_000 });
    assert.deepEqual((await cells("upload.bin")).slice(0, 3), ["upload.bin", "file", "256 B"]);
    assert.deepEqual(await readBack(ctx.client, ctx.computerId, "/root/upload.bin"), bytes);
    assert.equal(await $("#file-upload").inputValue(), "", "the file input was not cleared");
  });

  step("replacing an existing file takes a second click", async () => {
    const before = writes().length;
    await upload("upload.bin", Buffer.from("replaced\n"));
    await waitStatus("Replace /root/upload.bin? The file in the computer will be overwritten.");
    assert.equal(await text("#upload"), "Confirm replace");
    assert.equal(writes().length, before, "the first click already wrote");
    await button("Confirm replace").click();
    await waitStatus("Uploaded /root/upload.bin (9 B).");
    assert.equal(writes().length, before + 1);
    assert.equal((await readBack(ctx.client, ctx.computerId, "/root/upload.bin")).toString(), "replaced\n");
    assert.equal(await text("#upload"), "Upload");
  });

  step("a large upload goes in chunks: the first replaces, the rest append", async () => {
    // 4 MiB per call: what fits the HTTP endpoint's 8 MiB request body as base64.
    const chunk = 4 * MIB;
    const bytes = randomBytes(chunk + MIB + 3);
    const before = writes().length;
    await upload("big.bin", bytes);
    await waitStatus(/^Uploaded \/root\/big\.bin \(/, 120_000);
    const args = writes().slice(before);
    assert.equal(args.length, 2, `${args.length} file_write calls`);
    assert.equal(args[0].append, undefined, "the first call appends");
    assert.equal(args[1].append, true, "the second call does not append");
    assert.deepEqual(args.map((a) => Buffer.from(a.content, "base64").length), [chunk, bytes.length - chunk]);
    const sum = await call(ctx.client, "terminal_execute", {
      computer_id: ctx.computerId,
      temporary: false,
      command: "wc -c < /root/big.bin; sha256sum /root/big.bin",
    });
    assert.equal(sum.stdout, `${bytes.length}\n${sha256(bytes)}  /root/big.bin\n`);
    await fileRow("big.bin").waitFor({ timeout: 10_000 });
  });

  step("Open port refuses an out-of-range port before calling port_url", async () => {
    const before = ctx.toolArgs("port_url").length;
    await $("#port").fill("70000");
    await button("Open port").click();
    await waitStatus("Enter a port from 1 to 65535.");
    assert.equal(await $("#port").getAttribute("aria-invalid"), "true");
    assert.equal(ctx.toolArgs("port_url").length, before);
  });

  step("Open port on a port nothing listens on shows the server's message", async () => {
    await $("#port").fill("8080");
    assert.equal(await $("#port").getAttribute("aria-invalid"), null);
    await $("#port").press("Enter");
    await waitStatus(new RegExp(`^Nothing accepts connections on port 8080 in computer '${ctx.computerId}' \\(.+\\)\\. Start a server listening on that port first\\.$`));
    assert.ok(await statusIsError());
    assert.deepEqual(ctx.toolArgs("port_url").at(-1), { computer_id: ctx.computerId, port: 8080 });
    assert.equal(await $("#port-links").isVisible(), false);
  });

  step("Open port on a real server shows a link that reaches it", async () => {
    // Without -f BusyBox httpd listens, then detaches: listening once the command returns.
    const started = await call(ctx.client, "terminal_execute", {
      computer_id: ctx.computerId,
      temporary: false,
      command: "busybox httpd -p 8080 -h /root/www",
    });
    assert.equal(started.exit_code, 0, JSON.stringify(started));
    await button("Open port").click();
    await waitStatus(`Port 8080 of ${ctx.computerId} is open.`);
    const links = $("#port-links a");
    const href = await links.first().getAttribute("href");
    assert.equal(await links.first().textContent(), href);
    assert.equal(await links.first().getAttribute("target"), "_blank");
    assert.equal(await links.first().getAttribute("rel"), "noopener noreferrer");
    if (ctx.web) {
      // HTTP mode: the port's own origin on the server's listener, its key in the host name
      // (docs/files.md, "Ports"); Chromium resolves *.localhost to loopback itself.
      assert.match(href, /^http:\/\/p8080-[0-9a-f]{32}\.localhost:\d+\/$/);
      const portPage = await ctx.page().context().newPage();
      try {
        const res = await portPage.goto(href);
        assert.equal(res.status(), 200);
        assert.equal(await res.text(), INDEX_HTML);
        const policy = res.headers()["content-security-policy"] ?? "";
        assert.match(policy, /^sandbox /, policy);
        assert.equal(res.headers()["referrer-policy"], "no-referrer");
        // The page's origin is the port's, not the server's: /mcp there is the computer's
        // (BusyBox httpd answers a POST with 501), and the dashboard's origin is another one.
        const seen = await portPage.evaluate(async () => {
          const mcp = await fetch("/mcp", { method: "POST", headers: { "content-type": "application/json" }, body: "{}" });
          return { origin: location.origin, status: mcp.status, body: await mcp.text() };
        });
        assert.notEqual(seen.origin, new URL(ctx.serverUrl).origin);
        assert.equal(seen.status, 501, JSON.stringify(seen));
        assert.match(seen.body, /501 Not Implemented/);
        // Reading the server's /mcp from the port's page is a cross-origin request the server
        // refuses (its Origin is not an allowed host) and the browser would not let it read.
        const crossOrigin = await portPage.evaluate(async (url) => {
          try {
            await fetch(url, { method: "POST", headers: { "content-type": "application/json" }, body: "{}" });
            return "read";
          } catch {
            return "refused";
          }
        }, `${ctx.serverUrl}/mcp`);
        assert.equal(crossOrigin, "refused");
      } finally {
        await portPage.close();
      }
      // The server's own route too, which needs the bearer token.
      assert.equal(await links.count(), 2);
      const proxy = await links.nth(1).getAttribute("href");
      assert.equal(proxy, `${ctx.serverUrl}/computers/${ctx.computerId}/ports/8080/`);
      const viaProxy = await fetch(proxy, { headers: { Authorization: `Bearer ${ctx.token}` } });
      assert.equal(viaProxy.status, 200);
      assert.equal(await viaProxy.text(), INDEX_HTML);
      assert.match(viaProxy.headers.get("content-security-policy") ?? "", /^sandbox /);
    } else {
      // Over stdio: a loopback forwarder.
      assert.match(href, /^http:\/\/127\.0\.0\.1:\d+\/$/);
      const res = await fetch(href);
      assert.equal(res.status, 200);
      assert.equal(await res.text(), INDEX_HTML);
      assert.equal(await links.count(), 1, "a proxy link over stdio");
    }
    assert.equal(await $("#port-links .warn").count(), 0, "a warning for a loopback URL");
    await ctx.screenshot("files-port.png");
  });
}
