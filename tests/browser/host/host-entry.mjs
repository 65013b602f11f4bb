// Browser side of the test host: the real ext-apps AppBridge plays the MCP Apps host for the
// dashboard iframe, backed by the real MCP TypeScript SDK Client. The Client's transport hands
// every JSON-RPC message to the Node test process (a Playwright binding), which forwards it to
// the real server over stdio through its own SDK client; nothing here answers on the server's
// behalf.
import { AppBridge, PostMessageTransport } from "@modelcontextprotocol/ext-apps/app-bridge";
import { Client } from "@modelcontextprotocol/client";

class NodeRelayTransport {
  constructor(relay) {
    this.relay = relay;
    this.onmessage = undefined;
    this.onerror = undefined;
    this.onclose = undefined;
  }
  async start() {}
  async send(message) {
    // Do not hold the sender while the server works: deliver the reply when it arrives.
    this.relay(message).then(
      (reply) => {
        if (reply) this.onmessage?.(reply);
      },
      (error) => this.onerror?.(error instanceof Error ? error : new Error(String(error))),
    );
  }
  async close() {
    this.onclose?.();
  }
}

const HOST_INFO = { name: "kilntainers-browser-test-host", version: "1.0.0" };
const events = [];
const fromApp = [];
let bridge;
let client;
let iframe;
let hostContext;
let dashboardResult;

function record(kind, data) {
  events.push({ kind, data, at: Date.now() });
}

window.addEventListener("message", (event) => {
  if (iframe && event.source === iframe.contentWindow && event.data && typeof event.data === "object") {
    fromApp.push(event.data.method ? event.data.method : `response:${event.data.id}`);
  }
});

async function start({ appUrl, hostContext: initialContext, toolName }) {
  client = new Client(HOST_INFO, { capabilities: {} });
  await client.connect(new NodeRelayTransport((m) => window.__mcpRelay(m)));
  record("client-connected", client.getServerVersion());

  const { tools } = await client.listTools();
  const tool = tools.find((t) => t.name === toolName);
  if (!tool) throw new Error(`tool ${toolName} not listed`);
  // The "model" calls computer_dashboard; the host then shows the app and hands it the result.
  dashboardResult = await client.callTool({ name: toolName, arguments: {} });
  hostContext = { ...initialContext, toolInfo: { id: 1, tool } };

  iframe = document.createElement("iframe");
  iframe.setAttribute("sandbox", "allow-scripts");
  iframe.setAttribute("title", "Sandbox Computer Dashboard");
  iframe.id = "app";
  document.getElementById("frame").appendChild(iframe);

  bridge = new AppBridge(client, HOST_INFO, { serverTools: {}, serverResources: {}, logging: {} }, { hostContext });
  bridge.oninitialized = () => {
    record("initialized", bridge.getAppVersion());
    bridge.sendToolInput({ arguments: {} });
    bridge.sendToolResult(dashboardResult);
  };
  bridge.onsizechange = (params) => {
    record("size-changed", params);
    if (typeof params.height === "number") iframe.style.height = `${params.height}px`;
  };
  bridge.onrequestdisplaymode = async ({ mode }) => {
    record("request-display-mode", mode);
    const next = (hostContext.availableDisplayModes || []).includes(mode) ? mode : hostContext.displayMode;
    document.body.classList.toggle("fullscreen", next === "fullscreen");
    hostContext = { ...hostContext, displayMode: next };
    bridge.setHostContext(hostContext);
    return { mode: next };
  };
  await bridge.connect(new PostMessageTransport(iframe.contentWindow, iframe.contentWindow));
  iframe.src = appUrl;
  return true;
}

function setHostContext(patch) {
  hostContext = { ...hostContext, ...patch };
  bridge.setHostContext(hostContext);
  if (patch.theme) document.documentElement.dataset.theme = patch.theme;
}

window.__host = {
  start,
  setHostContext,
  events: () => events,
  fromApp: () => fromApp,
  appCapabilities: () => bridge?.getAppCapabilities(),
  appInfo: () => bridge?.getAppVersion(),
};
