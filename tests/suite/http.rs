//! The real binary over Streamable HTTP (docs/decisions.md, "HTTP transport"): routes, Host/Origin and bearer guards,
//! with raw requests; sessions with the rmcp client (separate defaults, DELETE), idle expiry,
//! the lease of a sessionless 2026-07-28 request, and SIGTERM, against the real Docker engine.

use std::time::Duration;

use reqwest::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE, HOST, ORIGIN};
use rmcp::ServiceExt;
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use serde_json::{Value, json};

use crate::common::{
    ContainerGuard, HttpServer, container_exists, enabled, eventually, execute, structured,
    unique_id,
};

const BUSYBOX: [&str; 4] = ["--image", "sandbox-busybox:full", "--shell", "/bin/sh"];
/// Accept header of Streamable HTTP POSTs.
const MCP_ACCEPT: &str = "application/json, text/event-stream";
/// The first protocol revision without sessions.
const STATELESS: &str = "2026-07-28";

fn container(id: &str) -> String {
    format!("kilntainer-{id}")
}

fn initialize_body() -> Value {
    json!({
        "jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {
            "protocolVersion": "2025-06-18",
            "capabilities": {},
            "clientInfo": {"name": "http-suite", "version": "1"}
        }
    })
}

/// The JSON-RPC message of an SSE (or JSON) response body.
fn rpc_message(body: &str) -> Value {
    if let Ok(value) = serde_json::from_str(body) {
        return value;
    }
    body.lines()
        .filter_map(|line| line.strip_prefix("data:"))
        .map(str::trim)
        .filter(|data| data.starts_with('{'))
        .find_map(|data| serde_json::from_str(data).ok())
        .unwrap_or_else(|| panic!("no JSON-RPC message in {body:?}"))
}

/// A raw Streamable HTTP session (`initialize` + `notifications/initialized`).
struct RawSession {
    http: reqwest::Client,
    url: String,
    token: String,
    id: String,
    next: u64,
}

impl RawSession {
    /// A session on `server` with its generated token.
    async fn open(server: &HttpServer) -> Self {
        let url = server.url("/mcp");
        let token = server.token();
        let http = reqwest::Client::new();
        let response = http
            .post(&url)
            .bearer_auth(&token)
            .header(CONTENT_TYPE, "application/json")
            .header(ACCEPT, MCP_ACCEPT)
            .body(initialize_body().to_string())
            .send()
            .await
            .expect("initialize");
        assert_eq!(response.status(), 200);
        let id = response
            .headers()
            .get("mcp-session-id")
            .and_then(|v| v.to_str().ok())
            .expect("Mcp-Session-Id")
            .to_owned();
        let _ = response.text().await;
        let session = Self {
            http,
            url,
            token,
            id,
            next: 2,
        };
        let status = session
            .post(json!({"jsonrpc": "2.0", "method": "notifications/initialized"}))
            .await
            .status();
        assert_eq!(status, 202);
        session
    }

    async fn post(&self, body: Value) -> reqwest::Response {
        self.http
            .post(&self.url)
            .bearer_auth(&self.token)
            .header(CONTENT_TYPE, "application/json")
            .header(ACCEPT, MCP_ACCEPT)
            .header("mcp-session-id", &self.id)
            .header("mcp-protocol-version", "2025-06-18")
            .body(body.to_string())
            .send()
            .await
            .expect("POST /mcp")
    }

    async fn call(&mut self, arguments: Value) -> Value {
        let id = self.next;
        self.next += 1;
        let response = self
            .post(json!({
                "jsonrpc": "2.0", "id": id, "method": "tools/call",
                "params": {"name": "terminal_execute", "arguments": arguments}
            }))
            .await;
        assert_eq!(response.status(), 200);
        let message = rpc_message(&response.text().await.expect("body"));
        assert_eq!(message["result"]["isError"], false, "{message}");
        message["result"]["structuredContent"].clone()
    }
}

/// One sessionless 2026-07-28 `terminal_execute` call.
async fn stateless_call(url: &str, token: &str, arguments: Value) -> Value {
    let body = json!({
        "jsonrpc": "2.0", "id": 7, "method": "tools/call",
        "params": {
            "name": "terminal_execute",
            "arguments": arguments,
            "_meta": {
                "io.modelcontextprotocol/protocolVersion": STATELESS,
                "io.modelcontextprotocol/clientCapabilities": {}
            }
        }
    });
    let response = reqwest::Client::new()
        .post(url)
        .bearer_auth(token)
        .header(CONTENT_TYPE, "application/json")
        .header(ACCEPT, MCP_ACCEPT)
        .header("mcp-protocol-version", STATELESS)
        .header("mcp-method", "tools/call")
        .header("mcp-name", "terminal_execute")
        .body(body.to_string())
        .send()
        .await
        .expect("stateless POST");
    assert_eq!(response.status(), 200);
    assert!(
        response.headers().get("mcp-session-id").is_none(),
        "a stateless request must not open a session"
    );
    let message = rpc_message(&response.text().await.expect("body"));
    assert_eq!(message["result"]["isError"], false, "{message}");
    message["result"]["structuredContent"].clone()
}

fn header<'a>(response: &'a reqwest::Response, name: &str) -> &'a str {
    response
        .headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
}

#[tokio::test]
async fn routes_guards_and_bearer_auth() {
    let server = HttpServer::start(
        "http-guards",
        &[
            "--auth-token",
            "s3cret-token",
            "--lifecycle-tools",
            "--allowed-host",
            "mcp.example.com",
        ],
    )
    .await;
    let http = reqwest::Client::new();
    let mcp = server.url("/mcp");
    let post = |url: &str| {
        http.post(url)
            .header(CONTENT_TYPE, "application/json")
            .header(ACCEPT, MCP_ACCEPT)
            .body(initialize_body().to_string())
    };

    let log = server.log();
    let banner = format!(
        "serving http://127.0.0.1:{}/mcp (backend: docker, lifecycle tools: on, allowed hosts: localhost, 127.0.0.1, ::1, mcp.example.com)",
        server.port
    );
    assert!(log.contains(&banner), "startup line missing in:\n{log}");

    // Health: never authenticated, never Host-checked.
    let health = http
        .get(server.url("/healthz"))
        .header(HOST, "evil.example")
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
    assert_eq!(header(&health, "content-type"), "application/json");
    assert_eq!(health.text().await.unwrap(), r#"{"status":"ok"}"#);

    // The descriptor, keys in order, with the dashboard resource (lifecycle tools on).
    let root = http.get(server.url("/")).send().await.unwrap();
    assert_eq!(root.status(), 200);
    assert_eq!(header(&root, "content-type"), "application/json");
    assert_eq!(
        root.text().await.unwrap(),
        r#"{"name":"mcp-sandbox-computer-vm-for-ai","mcp_endpoint":"/mcp","health":"/healthz","dashboard_resource":"ui://kilntainers/computers"}"#
    );

    // Browsers get the web dashboard with the web-mode headers.
    let page = http
        .get(server.url("/"))
        .header(ACCEPT, "text/html,application/xhtml+xml;q=0.9")
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), 200);
    assert_eq!(header(&page, "content-type"), "text/html; charset=utf-8");
    assert_eq!(
        header(&page, "content-security-policy"),
        "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    );
    assert_eq!(header(&page, "x-content-type-options"), "nosniff");
    assert_eq!(header(&page, "referrer-policy"), "no-referrer");
    assert_eq!(header(&page, "cache-control"), "no-store");
    assert!(
        page.text()
            .await
            .unwrap()
            .contains(r#"<meta name="kilntainers-mode" content="web">"#)
    );

    // Everything else is 404, including prefixes of /mcp and other methods on /.
    for path in ["/nope", "/mcpx", "/mcp/extra", "/healthz/"] {
        let response = http.get(server.url(path)).send().await.unwrap();
        assert_eq!(response.status(), 404, "{path}");
    }
    let posted_root = http.post(server.url("/")).send().await.unwrap();
    assert_eq!(posted_root.status(), 404);

    // Bearer auth on /mcp.
    for authorization in [
        None,
        Some("Basic s3cret-token"),
        Some("Bearer wrong"),
        Some("Bearer s3cret-toke"),
        Some("s3cret-token"),
    ] {
        let mut request = post(&mcp);
        if let Some(value) = authorization {
            request = request.header(AUTHORIZATION, value);
        }
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), 401, "{authorization:?}");
        assert_eq!(header(&response, "www-authenticate"), "Bearer");
        assert_eq!(header(&response, "content-type"), "application/json");
        assert_eq!(
            response.text().await.unwrap(),
            r#"{"error":"unauthorized"}"#
        );
    }
    for (url, scheme) in [(mcp.clone(), "Bearer"), (server.url("/mcp/"), "bEaReR")] {
        let response = post(&url)
            .header(AUTHORIZATION, format!("{scheme} s3cret-token"))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "{url}");
        assert!(response.headers().contains_key("mcp-session-id"));
    }

    // Host and Origin are checked before authentication, on /mcp and on GET /.
    for url in [mcp.clone(), server.url("/")] {
        let response = post(&url)
            .header(HOST, "evil.example")
            .header(AUTHORIZATION, "Bearer s3cret-token")
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 421, "{url}");
        assert_eq!(response.text().await.unwrap(), "Invalid Host header");
    }
    let unauthorized_host = post(&mcp)
        .header(HOST, "evil.example")
        .send()
        .await
        .unwrap();
    assert_eq!(unauthorized_host.status(), 421);
    for origin in [
        "http://evil.example",
        "null",
        "http://localhost.evil.example",
    ] {
        let response = post(&mcp)
            .header(ORIGIN, origin)
            .header(AUTHORIZATION, "Bearer s3cret-token")
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 403, "{origin}");
        assert_eq!(response.text().await.unwrap(), "Invalid Origin header");
    }
    let browser_root = http
        .get(server.url("/"))
        .header(ORIGIN, "https://evil.example")
        .send()
        .await
        .unwrap();
    assert_eq!(browser_root.status(), 403);
    // Allowed names pass, with any port and case, including the configured public name.
    for (host, origin) in [
        (
            format!("localhost:{}", server.port),
            "http://localhost:9999",
        ),
        ("MCP.example.com".to_owned(), "https://mcp.example.com"),
    ] {
        let response = post(&mcp)
            .header(HOST, host.as_str())
            .header(ORIGIN, origin)
            .header(AUTHORIZATION, "Bearer s3cret-token")
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "{host} {origin}");
    }
    assert!(
        !server.log().contains("s3cret-token"),
        "the token must never be logged"
    );
}

#[tokio::test]
async fn lifecycle_off_descriptor_disabled_page_and_bind_failure() {
    let server = HttpServer::start("http-plain", &["--allowed-host", "*"]).await;
    let http = reqwest::Client::new();
    let root = http.get(server.url("/")).send().await.unwrap();
    assert_eq!(
        root.text().await.unwrap(),
        r#"{"name":"mcp-sandbox-computer-vm-for-ai","mcp_endpoint":"/mcp","health":"/healthz"}"#
    );
    let page = http
        .get(server.url("/"))
        .header(ACCEPT, "text/html")
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), 200);
    let page = page.text().await.unwrap();
    assert!(page.contains("<title>Sandbox Computers</title>"));
    assert!(page.contains("The dashboard is disabled. Start the server with ENABLE_LIFECYCLE_TOOLS=true (or --lifecycle-tools) to enable it."));
    // `--allowed-host '*'` turns the Host check off, with a warning.
    let any_host = http
        .get(server.url("/"))
        .header(HOST, "evil.example")
        .send()
        .await
        .unwrap();
    assert_eq!(any_host.status(), 200);
    let log = server.log();
    assert!(
        log.contains("lifecycle tools: off, allowed hosts: *)"),
        "{log}"
    );
    assert!(
        log.contains("kilntainers: warning: --allowed-host '*'"),
        "{log}"
    );
    // Without a configured token /mcp takes the generated one (issue 15).
    let refused = http
        .post(server.url("/mcp"))
        .header(CONTENT_TYPE, "application/json")
        .header(ACCEPT, MCP_ACCEPT)
        .body(initialize_body().to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 401);
    let open = http
        .post(server.url("/mcp"))
        .bearer_auth(server.token())
        .header(CONTENT_TYPE, "application/json")
        .header(ACCEPT, MCP_ACCEPT)
        .body(initialize_body().to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(open.status(), 200);

    // A second server on the same port cannot listen.
    let mut second = HttpServer::spawn_on("http-bind", server.port, &[]);
    let status = second
        .wait_exit(Duration::from_secs(15))
        .await
        .expect("second server exits");
    assert_eq!(status.code(), Some(1));
    let expected = format!(
        "kilntainers: error: Cannot listen on 127.0.0.1:{}: ",
        server.port
    );
    assert!(second.log().contains(&expected), "{}", second.log());
}

#[tokio::test]
async fn unauthenticated_non_loopback_bind_warns() {
    // 127.0.0.2 is in the loopback range, but counts as non-loopback for the refusal rule.
    let mut server = HttpServer::spawn(
        "http-warn",
        &["--host", "127.0.0.2", "--allow-unauthenticated-http"],
    );
    server.wait_ready("127.0.0.2").await;
    let log = server.log();
    assert!(
        log.contains(
            "kilntainers: warning: serving without authentication on a non-loopback address (127.0.0.2)"
        ),
        "{log}"
    );
}

#[tokio::test]
async fn sessions_have_their_own_default_computer_and_delete_removes_it() {
    if !enabled("KILNTAINERS_IT_DOCKER") {
        return;
    }
    let mut guard = ContainerGuard {
        names: Vec::new(),
        docker_host: None,
    };
    let server = HttpServer::start("http-sessions", &BUSYBOX).await;
    let transport = || {
        StreamableHttpClientTransport::from_config(
            StreamableHttpClientTransportConfig::with_uri(server.url("/mcp"))
                .auth_header(server.token()),
        )
    };
    let first = ().serve(transport()).await.expect("first session");
    let second = ().serve(transport()).await.expect("second session");

    let a = structured(&execute(&first, json!({"command": "echo a"})).await);
    let b = structured(&execute(&second, json!({"command": "echo b"})).await);
    let (a_id, b_id) = (
        a["computer_id"].as_str().unwrap().to_owned(),
        b["computer_id"].as_str().unwrap().to_owned(),
    );
    guard.names.extend([container(&a_id), container(&b_id)]);
    assert_ne!(a_id, b_id, "two sessions shared a default computer");
    assert_eq!(a["temporary"], true);
    // Each session keeps its own default.
    let again = structured(&execute(&first, json!({"command": "echo again"})).await);
    assert_eq!(again["computer_id"].as_str(), Some(a_id.as_str()));
    assert!(container_exists(&container(&a_id)) && container_exists(&container(&b_id)));

    // The client's DELETE ends the first session and removes its temporary computer only.
    first.cancel().await.expect("close first session");
    assert!(
        eventually(Duration::from_secs(10), || !container_exists(&container(
            &a_id
        )))
        .await,
        "DELETE left the session's temporary computer behind"
    );
    assert!(container_exists(&container(&b_id)));
    second.cancel().await.expect("close second session");
    assert!(
        eventually(Duration::from_secs(10), || !container_exists(&container(
            &b_id
        )))
        .await
    );
}

#[tokio::test]
async fn abandoned_session_is_reaped_but_a_long_call_is_not() {
    if !enabled("KILNTAINERS_IT_DOCKER") {
        return;
    }
    let id = unique_id("rs-http-idle");
    let _guard = ContainerGuard {
        names: vec![container(&id)],
        docker_host: None,
    };
    let mut args = BUSYBOX.to_vec();
    args.extend(["--session-timeout", "2"]);
    let server = HttpServer::start("http-idle", &args).await;
    let mut session = RawSession::open(&server).await;

    // A call longer than the idle timeout keeps its session (docs/decisions.md, "Sessions, holders and leases").
    let long = session
        .call(json!({"command": "sleep 4; echo done", "computer_id": id}))
        .await;
    assert_eq!(long["stdout"], "done\n");
    let after = session
        .call(json!({"command": "echo still", "computer_id": id}))
        .await;
    assert_eq!(after["stdout"], "still\n");
    assert!(container_exists(&container(&id)));

    // Then the client goes silent without DELETE.
    assert!(
        eventually(Duration::from_secs(20), || !container_exists(&container(
            &id
        )))
        .await,
        "an abandoned session's computer outlived the idle timeout; log:\n{}",
        server.log()
    );
    let gone = session
        .post(json!({"jsonrpc": "2.0", "id": 99, "method": "tools/list"}))
        .await;
    assert_eq!(gone.status(), 404);
}

#[tokio::test]
async fn stateless_request_computer_is_leased_and_renewed_on_use() {
    if !enabled("KILNTAINERS_IT_DOCKER") {
        return;
    }
    let id = unique_id("rs-http-lease");
    let _guard = ContainerGuard {
        names: vec![container(&id)],
        docker_host: None,
    };
    let mut args = BUSYBOX.to_vec();
    args.extend(["--session-timeout", "3"]);
    let server = HttpServer::start("http-lease", &args).await;
    let url = server.url("/mcp");
    let token = server.token();

    let first = stateless_call(
        &url,
        &token,
        json!({"command": "echo one", "computer_id": id}),
    )
    .await;
    assert_eq!(first["stdout"], "one\n");
    assert_eq!(first["temporary"], true);
    // Used every second for longer than the lease: it stays.
    let start = std::time::Instant::now();
    while start.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let used =
            stateless_call(&url, &token, json!({"command": "true", "computer_id": id})).await;
        assert_eq!(used["exit_code"], 0);
        assert!(container_exists(&container(&id)));
    }
    // Unused: removed after the lease plus at most one reaper period.
    assert!(
        eventually(Duration::from_secs(20), || !container_exists(&container(
            &id
        )))
        .await,
        "a sessionless computer outlived its lease; log:\n{}",
        server.log()
    );
}

#[tokio::test]
async fn sigterm_with_a_live_session_removes_temporaries_and_exits_0() {
    if !enabled("KILNTAINERS_IT_DOCKER") {
        return;
    }
    let id = unique_id("rs-http-term");
    let _guard = ContainerGuard {
        names: vec![container(&id)],
        docker_host: None,
    };
    let mut server = HttpServer::start("http-term", &BUSYBOX).await;
    let mut session = RawSession::open(&server).await;
    let result = session
        .call(json!({"command": "echo up", "computer_id": id}))
        .await;
    assert_eq!(result["stdout"], "up\n");
    assert!(container_exists(&container(&id)));

    // A call in flight at SIGTERM is killed by the drain and still answered.
    let in_flight = session
        .post(json!({
            "jsonrpc": "2.0", "id": 50, "method": "tools/call",
            "params": {"name": "terminal_execute",
                       "arguments": {"command": "sleep 60", "computer_id": id}}
        }))
        .await;
    let in_flight = tokio::spawn(async move { in_flight.text().await });
    assert!(
        eventually(Duration::from_secs(10), || {
            std::process::Command::new("docker")
                .args(["top", &container(&id)])
                .output()
                .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("sleep 60"))
        })
        .await,
        "the long call never started"
    );
    server.terminate();
    let answer = tokio::time::timeout(Duration::from_secs(25), in_flight)
        .await
        .expect("the in-flight call hung")
        .expect("join")
        .expect("body");
    let message = rpc_message(&answer);
    assert_eq!(message["id"], 50, "{answer}");

    let status = server
        .wait_exit(Duration::from_secs(25))
        .await
        .expect("server exits after SIGTERM");
    assert_eq!(status.code(), Some(0), "log:\n{}", server.log());
    assert!(
        !container_exists(&container(&id)),
        "SIGTERM left a temporary computer"
    );
}
