//! The broker in process, end to end on loopback: the proxy's state with the terminator and a
//! test CA, fed by control lines; a TLS upstream with its own test CA standing in for the
//! internet (given to the proxy with `roots`, or not); clients speaking rustls through the
//! proxy's Unix-socket entrance (the socket wiring, so no fixed ports are needed).

use std::io::{self, Read, Write};
use std::net::{IpAddr, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use kilntainers_helper::egress::base64;
use kilntainers_helper::egress::socket::{self, Kind, Token};
use kilntainers_helper::egress::{Ports, State, Upstream, control, serve};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use rustls::{ClientConfig, ClientConnection, RootCertStore, ServerConfig, ServerConnection};

use super::terminator::{RustlsTerminator, pipe};

const COMPUTER: &str = "10.0.0.5";
const TOKEN: &str = "00112233445566778899aabbccddeeff";
const API: &str = "kts_0123456789abcdef0123456789abcdef";
const OTHER: &str = "kts_ffeeddccbbaa99887766554433221100";
const VALUE: &str = "real-value-42";

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

struct TestCa {
    issuer: Issuer<'static, KeyPair>,
    cert: CertificateDer<'static>,
    pem: String,
    key_pem: String,
}

fn test_ca(name: &str) -> TestCa {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let key = KeyPair::generate().unwrap();
    let cert = params.self_signed(&key).unwrap();
    TestCa {
        pem: cert.pem(),
        key_pem: key.serialize_pem(),
        cert: cert.der().clone(),
        issuer: Issuer::new(params, key),
    }
}

fn leaf(ca: &TestCa, hosts: &[&str]) -> (CertificateDer<'static>, PrivateKeyDer<'static>) {
    let hosts: Vec<String> = hosts.iter().map(|h| (*h).to_owned()).collect();
    let params = CertificateParams::new(hosts).unwrap();
    let key = KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, &ca.issuer).unwrap();
    (
        cert.der().clone(),
        PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
    )
}

/// The internet: a TLS server for api.bound.test and other.test that records each request
/// head and answers `200` with `hello`.
struct Internet {
    port: u16,
    cert: CertificateDer<'static>,
    heads: Arc<Mutex<Vec<String>>>,
}

fn internet(ca: &TestCa) -> Internet {
    let (cert, key) = leaf(ca, &["api.bound.test", "other.test"]);
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![cert.clone()], key)
        .unwrap();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let config = Arc::new(config);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let heads = Arc::new(Mutex::new(Vec::new()));
    let seen = heads.clone();
    thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { continue };
            let config = config.clone();
            let seen = seen.clone();
            thread::spawn(move || {
                let Ok(conn) = ServerConnection::new(config) else {
                    return;
                };
                let mut tls = rustls::StreamOwned::new(conn, stream);
                let head = read_head(&mut tls);
                seen.lock().unwrap().push(head);
                let _ = tls.write_all(
                    b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello",
                );
                tls.conn.send_close_notify();
                let _ = tls.flush();
            });
        }
    });
    Internet { port, cert, heads }
}

fn read_head(stream: &mut impl Read) -> String {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match stream.read(&mut byte) {
            Ok(1) => head.push(byte[0]),
            _ => break,
        }
    }
    String::from_utf8_lossy(&head).into_owned()
}

#[derive(Clone, Default)]
struct Events(Arc<Mutex<Vec<u8>>>);

impl Write for Events {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Events {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }

    fn wait_for(&self, prefix: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(line) = self.text().lines().find(|l| l.starts_with(prefix)) {
                return line.to_owned();
            }
            assert!(
                Instant::now() < deadline,
                "no {prefix:?} in {}",
                self.text()
            );
            thread::sleep(Duration::from_millis(10));
        }
    }
}

struct Proxy {
    state: Arc<State>,
    socket: PathBuf,
    events: Events,
    internet: Internet,
    proxy_ca: TestCa,
    internet_ca: TestCa,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.socket);
    }
}

fn b64(text: &str) -> String {
    base64::encode(text.as_bytes())
}

/// A proxy with the terminator; `trust_internet` gives it the internet's CA as `roots`.
fn start(trust_internet: bool) -> Proxy {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let internet_ca = test_ca("internet test CA");
    let proxy_ca = test_ca("proxy test CA");
    let internet = internet(&internet_ca);
    let loopback = IpAddr::from([127, 0, 0, 1]);
    let events = Events::default();
    let state = State::with_terminator(
        Upstream {
            dns: None,
            fixed: [
                ("api.bound.test".to_owned(), loopback),
                ("other.test".to_owned(), loopback),
            ]
            .into(),
            port_map: [(443, internet.port)].into(),
        },
        Box::new(events.clone()),
        Some(Box::new(RustlsTerminator::new().unwrap())),
    );
    let mut lines = vec![
        format!("token {COMPUTER} {TOKEN}"),
        format!("ca {} {}", b64(&proxy_ca.pem), b64(&proxy_ca.key_pem)),
    ];
    // The socket's computer, and loopback for the TCP entrances.
    for computer in [COMPUTER, "127.0.0.1"] {
        lines.extend([
            format!(
                "policy {computer} allowlist ask=0 private=1 allow=api.bound.test,other.test deny="
            ),
            format!(
                "secret {computer} API_TOKEN {API} api.bound.test {} {}",
                b64("Authorization: Bearer {}"),
                b64(VALUE)
            ),
            format!(
                "secret {computer} OTHER_TOKEN {OTHER} other.test:8443 {} {}",
                b64("X-Key: {}"),
                b64("other-value")
            ),
        ]);
    }
    if trust_internet {
        lines.push(format!("roots {}", b64(&internet_ca.pem)));
    }
    control::read(&state, format!("{}\n", lines.join("\n")).as_bytes());
    let socket = std::env::temp_dir().join(format!(
        "kilntainers-broker-test-{}-{}.sock",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::SeqCst)
    ));
    socket::listen(state.clone(), &socket).unwrap();
    Proxy {
        state,
        socket,
        events,
        internet,
        proxy_ca,
        internet_ca,
    }
}

impl Proxy {
    fn connect(&self, kind: Kind) -> UnixStream {
        let mut stream = UnixStream::connect(&self.socket).unwrap();
        let token = Token::parse(TOKEN).unwrap();
        stream
            .write_all(socket::identification_line(&token, kind).as_bytes())
            .unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        stream
    }
}

fn client_config(trusting: &TestCa) -> Arc<ClientConfig> {
    let mut roots = RootCertStore::empty();
    roots.add(trusting.cert.clone()).unwrap();
    let mut config = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Arc::new(config)
}

/// One HTTPS request over `stream`, to `host`, trusting `ca`: the response, and the
/// certificate the client was shown.
fn https<S: Read + Write>(
    stream: S,
    host: &str,
    ca: &TestCa,
    request: &str,
) -> (String, CertificateDer<'static>) {
    let name = ServerName::try_from(host.to_owned()).unwrap();
    let conn = ClientConnection::new(client_config(ca), name).unwrap();
    let mut tls = rustls::StreamOwned::new(conn, stream);
    tls.write_all(request.as_bytes()).unwrap();
    let mut response = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        match tls.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => response.extend_from_slice(&chunk[..n]),
        }
    }
    assert_eq!(tls.conn.alpn_protocol(), Some(&b"http/1.1"[..]));
    let shown = tls.conn.peer_certificates().unwrap()[0].clone();
    (String::from_utf8_lossy(&response).into_owned(), shown)
}

#[test]
fn https_to_a_bound_host_is_terminated_and_the_value_put_in() {
    let proxy = start(true);
    let request = format!(
        "GET /v1/me HTTP/1.1\r\nHost: api.bound.test\r\nAuthorization: Bearer {API}\r\nConnection: keep-alive\r\n\r\n"
    );
    let (response, shown) = https(
        proxy.connect(Kind::Tls),
        "api.bound.test",
        &proxy.proxy_ca,
        &request,
    );
    assert!(response.starts_with("HTTP/1.1 200 OK"), "{response}");
    assert!(response.ends_with("hello"), "{response}");
    assert_ne!(shown, proxy.internet.cert, "the proxy's own leaf");
    let heads = proxy.internet.heads.lock().unwrap().clone();
    assert_eq!(
        heads,
        vec![format!(
            "GET /v1/me HTTP/1.1\r\nHost: api.bound.test\r\nAuthorization: Bearer {VALUE}\r\nConnection: close\r\n\r\n"
        )]
    );
    // The same through CONNECT; the template's header is added when none is sent.
    let mut tunnel = proxy.connect(Kind::Proxy);
    tunnel
        .write_all(b"CONNECT api.bound.test:443 HTTP/1.1\r\nHost: api.bound.test:443\r\n\r\n")
        .unwrap();
    assert_eq!(
        read_head(&mut tunnel),
        "HTTP/1.1 200 Connection established\r\n\r\n"
    );
    let (response, _) = https(
        tunnel,
        "api.bound.test",
        &proxy.proxy_ca,
        "POST /x?k=kts_0123456789abcdef0123456789abcdef HTTP/1.1\r\nHost: api.bound.test\r\nContent-Length: 0\r\n\r\n",
    );
    assert!(response.ends_with("hello"), "{response}");
    let heads = proxy.internet.heads.lock().unwrap().clone();
    assert_eq!(
        heads[1],
        format!(
            "POST /x?k={API} HTTP/1.1\r\nHost: api.bound.test\r\nContent-Length: 0\r\nAuthorization: Bearer {VALUE}\r\nConnection: close\r\n\r\n"
        )
    );
    assert!(
        !proxy.events.text().contains("denied"),
        "{}",
        proxy.events.text()
    );
    assert!(!proxy.events.text().contains(VALUE));
}

#[test]
fn a_host_no_secret_is_bound_to_is_spliced() {
    let proxy = start(true);
    let (response, shown) = https(
        proxy.connect(Kind::Tls),
        "other.test",
        &proxy.internet_ca,
        "GET / HTTP/1.1\r\nHost: other.test\r\n\r\n",
    );
    assert!(response.ends_with("hello"), "{response}");
    assert_eq!(shown, proxy.internet.cert, "the upstream's own certificate");
    // Untouched: no Connection: close, no value.
    assert_eq!(
        proxy.internet.heads.lock().unwrap()[0],
        "GET / HTTP/1.1\r\nHost: other.test\r\n\r\n"
    );
}

#[test]
fn refusals_inside_tls_are_a_403_and_a_denied_event() {
    let proxy = start(true);
    // Another secret's placeholder, to a host it is not bound to.
    let (response, _) = https(
        proxy.connect(Kind::Tls),
        "api.bound.test",
        &proxy.proxy_ca,
        &format!("GET / HTTP/1.1\r\nHost: api.bound.test\r\nX-Key: {OTHER}\r\n\r\n"),
    );
    let reason = "carries the secret OTHER_TOKEN to a host it is not bound to";
    assert!(response.starts_with("HTTP/1.1 403 Forbidden"), "{response}");
    assert!(response.contains(reason), "{response}");
    assert_eq!(
        proxy.events.wait_for("denied"),
        format!("denied {COMPUTER} api.bound.test 443 {reason}")
    );
    // A Host other than the TLS server name.
    let (response, _) = https(
        proxy.connect(Kind::Tls),
        "api.bound.test",
        &proxy.proxy_ca,
        "GET / HTTP/1.1\r\nHost: other.test\r\n\r\n",
    );
    assert!(
        response.contains("the Host header names other.test, not the TLS server name"),
        "{response}"
    );
    // Connected (the policy allowed it), but not one byte of a request went upstream.
    let heads = proxy.internet.heads.lock().unwrap().clone();
    assert!(heads.iter().all(String::is_empty), "{heads:?}");
}

#[test]
fn an_untrusted_upstream_is_refused() {
    let proxy = start(false);
    let (response, _) = https(
        proxy.connect(Kind::Tls),
        "api.bound.test",
        &proxy.proxy_ca,
        &format!("GET / HTTP/1.1\r\nHost: api.bound.test\r\nAuthorization: Bearer {API}\r\n\r\n"),
    );
    assert!(response.starts_with("HTTP/1.1 403 Forbidden"), "{response}");
    assert!(
        response.contains("upstream certificate for api.bound.test is not trusted"),
        "{response}"
    );
    let line = proxy.events.wait_for("denied");
    assert!(
        line.starts_with(&format!(
            "denied {COMPUTER} api.bound.test 443 upstream certificate for api.bound.test is not trusted: "
        )),
        "{line}"
    );
    assert!(!proxy.events.text().contains(VALUE));
}

/// Ports free a moment ago (the proxy binds fixed ports; a clash fails the test loudly).
fn free_ports() -> Ports {
    let tcp = || TcpListener::bind("127.0.0.1:0").unwrap();
    let (p, h, t) = (tcp(), tcp(), tcp());
    let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    Ports {
        bind: IpAddr::from([127, 0, 0, 1]),
        dns: udp.local_addr().unwrap().port(),
        http: h.local_addr().unwrap().port(),
        https: t.local_addr().unwrap().port(),
        proxy: p.local_addr().unwrap().port(),
    }
}

#[test]
fn the_tcp_entrances_terminate_too() {
    let proxy = start(true);
    let ports = free_ports();
    serve(proxy.state.clone(), &ports).unwrap();
    let tcp = |port: u16| {
        let stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        stream
    };
    let request = "GET / HTTP/1.1\r\nHost: api.bound.test\r\n\r\n";
    let (response, _) = https(tcp(ports.https), "api.bound.test", &proxy.proxy_ca, request);
    assert!(response.ends_with("hello"), "{response}");
    let mut tunnel = tcp(ports.proxy);
    tunnel
        .write_all(b"CONNECT api.bound.test:443 HTTP/1.1\r\n\r\n")
        .unwrap();
    read_head(&mut tunnel);
    let (response, _) = https(tunnel, "api.bound.test", &proxy.proxy_ca, request);
    assert!(response.ends_with("hello"), "{response}");
    let heads = proxy.internet.heads.lock().unwrap().clone();
    let expected = format!(
        "GET / HTTP/1.1\r\nHost: api.bound.test\r\nAuthorization: Bearer {VALUE}\r\nConnection: close\r\n\r\n"
    );
    assert_eq!(heads, [expected.clone(), expected]);
}

/// What the copy reads reaches the other side while the sender keeps its end open. A TLS stream
/// keeps records back when its socket is full (as the `BufWriter` here keeps everything) until
/// the next write or a flush; a client waiting for the answer sends no next write, so without
/// a flush per write a request body stalled a few records short of its end.
#[test]
fn the_copy_delivers_what_it_read_while_the_sender_keeps_its_end_open() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let (mut sender, from) = tokio::io::duplex(64 * 1024);
        let (to, mut receiver) = tokio::io::duplex(64 * 1024);
        let copy = tokio::spawn(pipe(from, tokio::io::BufWriter::new(to)));
        let body = b"the last records of a request body";
        sender.write_all(body).await.unwrap();
        let mut got = [0u8; 34];
        tokio::time::timeout(Duration::from_secs(10), receiver.read_exact(&mut got))
            .await
            .expect("the copy kept back what it had read")
            .unwrap();
        assert_eq!(&got, body);
        drop(sender);
        copy.await.unwrap();
    });
}
