//! The proxy end to end on loopback: a policy, an upstream server standing in for the
//! internet, and hostile clients. Loopback upstreams need `allow_private`, except in the test
//! of the private-address rule itself.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use super::*;

#[derive(Clone, Default)]
struct Events(Arc<Mutex<Vec<u8>>>);

impl Write for Events {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        lock(&self.0).extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Events {
    fn lines(&self) -> Vec<String> {
        String::from_utf8_lossy(&lock(&self.0))
            .lines()
            .map(str::to_owned)
            .collect()
    }

    fn wait_for(&self, prefix: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(line) = self.lines().into_iter().find(|l| l.starts_with(prefix)) {
                return line;
            }
            assert!(
                Instant::now() < deadline,
                "no event {prefix:?} in {:?}",
                self.lines()
            );
            thread::sleep(Duration::from_millis(10));
        }
    }

    /// Asserts that no refusal was reported.
    fn assert_none_denied(&self) {
        let lines = self.lines();
        assert!(lines.iter().all(|l| !l.starts_with("denied")), "{lines:?}");
    }
}

struct Proxy {
    state: Arc<State>,
    events: Events,
    proxy: u16,
    http: u16,
    https: u16,
    dns: u16,
}

/// An upstream that answers every connection with `pong:` and the first bytes it got.
fn upstream() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            thread::spawn(move || {
                let mut buf = [0u8; 4096];
                let n = stream.read(&mut buf).unwrap_or(0);
                let _ = stream.write_all(b"pong:");
                let _ = stream.write_all(&buf[..n]);
            });
        }
    });
    port
}

fn start(policy_line: &str, allow_private_resolve: bool) -> Proxy {
    let up = upstream();
    let mut fixed = HashMap::new();
    fixed.insert("allowed.test".to_owned(), IpAddr::from([127, 0, 0, 1]));
    fixed.insert("other.test".to_owned(), IpAddr::from([127, 0, 0, 1]));
    let _ = allow_private_resolve;
    let mut port_map = HashMap::new();
    port_map.insert(443, up);
    port_map.insert(80, up);
    port_map.insert(5432, up);
    let events = Events::default();
    let state = State::new(
        Upstream {
            dns: None,
            fixed,
            port_map,
        },
        Box::new(events.clone()),
    );
    let Some(control::Message::Policy(ip, policy)) = control::parse(policy_line) else {
        panic!("bad policy line");
    };
    state.set_policy(ip, Some(policy));
    state.set_address(IpAddr::from([172, 30, 0, 2]));
    let tcp = || TcpListener::bind("127.0.0.1:0").unwrap();
    let (p, h, t) = (tcp(), tcp(), tcp());
    let udp = UdpSocket::bind("127.0.0.1:0").unwrap();
    let ports = (
        p.local_addr().unwrap().port(),
        h.local_addr().unwrap().port(),
        t.local_addr().unwrap().port(),
        udp.local_addr().unwrap().port(),
    );
    spawn_all(
        state.clone(),
        udp,
        [
            (p, Listener::Proxy),
            (h, Listener::Http),
            (t, Listener::Tls),
        ],
    );
    Proxy {
        state,
        events,
        proxy: ports.0,
        http: ports.1,
        https: ports.2,
        dns: ports.3,
    }
}

const ALLOW: &str =
    "policy 127.0.0.1 allowlist ask=0 private=1 allow=allowed.test,allowed.test:5432 deny=";

fn exchange(port: u16, send: &[u8]) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(send).unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

#[test]
fn allowed_hosts_are_spliced_through_every_entrance() {
    let p = start(ALLOW, true);
    let hello = sni::tests::client_hello(Some("allowed.test"), 0);
    // CONNECT, then TLS naming the same host.
    let mut connect =
        b"CONNECT allowed.test:443 HTTP/1.1\r\nHost: allowed.test:443\r\n\r\n".to_vec();
    connect.extend_from_slice(&hello);
    let out = exchange(p.proxy, &connect);
    assert!(
        out.starts_with("HTTP/1.1 200 Connection established\r\n\r\npong:"),
        "{out:?}"
    );
    // Plain HTTP through the proxy, rewritten to origin form.
    let out = exchange(
        p.proxy,
        b"GET http://allowed.test/x HTTP/1.1\r\nHost: allowed.test\r\n\r\n",
    );
    assert_eq!(out, "pong:GET /x HTTP/1.1\r\nHost: allowed.test\r\n\r\n");
    // Port 80 by Host, port 443 by SNI (clients that ignore the proxy settings).
    let out = exchange(p.http, b"GET / HTTP/1.1\r\nHost: Allowed.Test\r\n\r\n");
    assert!(out.starts_with("pong:GET / HTTP/1.1"), "{out:?}");
    let out = exchange(p.https, &hello);
    assert!(out.starts_with("pong:\x16\x03\x01"), "{out:?}");
    // Another protocol on an explicitly allowed port.
    let out = exchange(
        p.proxy,
        b"CONNECT allowed.test:5432 HTTP/1.1\r\n\r\n\0\0\0\x08",
    );
    assert!(out.ends_with("pong:\0\0\0\x08"), "{out:?}");
    p.events.assert_none_denied();
}

#[test]
fn other_hosts_mismatches_and_ip_literals_are_refused_with_a_reason() {
    let p = start(ALLOW, true);
    let out = exchange(p.proxy, b"CONNECT other.test:443 HTTP/1.1\r\n\r\n");
    assert!(out.starts_with("HTTP/1.1 403"), "{out:?}");
    assert!(out.contains(
        "network access to other.test:443 was blocked: not in this computer's allow-list"
    ));
    p.events
        .wait_for("denied 127.0.0.1 other.test 443 not in this computer's allow-list");
    // SNI naming another host inside an allowed CONNECT.
    let mut mismatch = b"CONNECT allowed.test:443 HTTP/1.1\r\n\r\n".to_vec();
    mismatch.extend_from_slice(&sni::tests::client_hello(Some("other.test"), 0));
    let out = exchange(p.proxy, &mismatch);
    assert!(!out.contains("pong"), "{out:?}");
    p.events
        .wait_for("denied 127.0.0.1 allowed.test 443 the tunnel names other.test");
    // Host header naming another host than the absolute target.
    let out = exchange(
        p.proxy,
        b"GET http://allowed.test/ HTTP/1.1\r\nHost: other.test\r\n\r\n",
    );
    assert!(out.starts_with("HTTP/1.1 403"), "{out:?}");
    // SNI for another host on 443.
    let out = exchange(p.https, &sni::tests::client_hello(Some("other.test"), 0));
    assert!(!out.contains("pong"));
    // An IP literal is not a name rule's business.
    let out = exchange(p.proxy, b"CONNECT 127.0.0.1:443 HTTP/1.1\r\n\r\n");
    assert!(out.contains("127.0.0.1:443 was blocked"), "{out:?}");
    // A source without a policy.
    p.state.set_policy(IpAddr::from([127, 0, 0, 1]), None);
    let out = exchange(p.proxy, b"CONNECT allowed.test:443 HTTP/1.1\r\n\r\n");
    assert!(out.contains("this address has no policy"), "{out:?}");
}

#[test]
fn private_addresses_are_refused_after_resolution() {
    let p = start(
        "policy 127.0.0.1 allowlist ask=0 private=0 allow=allowed.test deny=",
        false,
    );
    let out = exchange(p.proxy, b"CONNECT allowed.test:443 HTTP/1.1\r\n\r\n");
    assert!(out.contains("was blocked: private address"), "{out:?}");
    let out = exchange(p.https, &sni::tests::client_hello(Some("allowed.test"), 0));
    assert!(!out.contains("pong"), "{out:?}");
    p.events
        .wait_for("denied 127.0.0.1 allowed.test 443 private address");
}

#[test]
fn dns_answers_allowed_names_with_the_proxy_and_nothing_else() {
    let p = start(ALLOW, true);
    let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let ask = |name: &str, qtype: u16| {
        let q = dns::build_query(0x4242, name, qtype).unwrap();
        socket.send_to(&q, ("127.0.0.1", p.dns)).unwrap();
        let mut buf = [0u8; 512];
        let (n, _) = socket.recv_from(&mut buf).unwrap();
        buf[..n].to_vec()
    };
    let a = ask("allowed.test", dns::TYPE_A);
    assert_eq!(a[3] & 0xF, dns::RCODE_OK);
    assert_eq!(
        dns::parse_answer(&a, 0x4242, "allowed.test", dns::TYPE_A).unwrap(),
        vec![IpAddr::from([172, 30, 0, 2])]
    );
    for (name, qtype) in [
        ("other.test", dns::TYPE_A),
        ("other.test", dns::TYPE_AAAA),
        ("x.other.test", 16),
        ("allowed.test.evil", 255),
    ] {
        let answer = ask(name, qtype);
        assert_eq!(answer[3] & 0xF, dns::RCODE_NXDOMAIN, "{name}");
    }
    // Garbage gets FORMERR or nothing, never a crash.
    socket
        .send_to(&[0x12, 0x34, 0, 0, 0, 1], ("127.0.0.1", p.dns))
        .unwrap();
    let mut buf = [0u8; 512];
    let (n, _) = socket.recv_from(&mut buf).unwrap();
    assert_eq!((n, buf[3] & 0xF), (12, dns::RCODE_FORMERR));
}

#[test]
fn hostile_clients_are_capped() {
    let p = start(ALLOW, true);
    // A head that never ends: read up to the cap, then refused.
    let mut s = TcpStream::connect(("127.0.0.1", p.proxy)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let _ = s.write_all(b"GET http://allowed.test/ HTTP/1.1\r\nX: ");
    let chunk = vec![b'a'; 64 * 1024];
    for _ in 0..16 {
        if s.write_all(&chunk).is_err() {
            break;
        }
    }
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let out = String::from_utf8_lossy(&out);
    assert!(
        out.is_empty() || out.contains("request head too large"),
        "{out:?}"
    );
    p.events
        .wait_for("denied 127.0.0.1 (unknown) 80 request head too large");
    // Idle connections beyond the per-computer cap are closed at once.
    let mut held = Vec::new();
    for _ in 0..MAX_PER_SOURCE + 20 {
        held.push(TcpStream::connect(("127.0.0.1", p.proxy)).unwrap());
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while p.state.connections.load(Ordering::SeqCst) < MAX_PER_SOURCE {
        assert!(Instant::now() < deadline);
        thread::sleep(Duration::from_millis(10));
    }
    assert!(p.state.connections.load(Ordering::SeqCst) <= MAX_PER_SOURCE);
    let mut last = held.pop().unwrap();
    last.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert_eq!(last.read(&mut [0u8; 16]).unwrap_or(0), 0);
    drop(held);
    let deadline = Instant::now() + Duration::from_secs(20);
    while p.state.connections.load(Ordering::SeqCst) > 0 {
        assert!(Instant::now() < deadline, "slots not released");
        thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn unknown_hosts_are_asked_about_once_and_wait_for_the_answer() {
    let p = start(
        "policy 127.0.0.1 allowlist ask=1 private=1 allow=allowed.test deny=*.denied.test",
        true,
    );
    let proxy = p.proxy;
    let first =
        thread::spawn(move || exchange(proxy, b"CONNECT other.test:443 HTTP/1.1\r\n\r\nhi"));
    let second =
        thread::spawn(move || exchange(proxy, b"CONNECT other.test:443 HTTP/1.1\r\n\r\nho"));
    let question = p.events.wait_for("ask ");
    assert_eq!(question, "ask 1 127.0.0.1 other.test 443");
    thread::sleep(Duration::from_millis(100));
    assert_eq!(
        p.events
            .lines()
            .iter()
            .filter(|l| l.starts_with("ask"))
            .count(),
        1
    );
    p.state.answer(1, Answer::Once);
    for handle in [first, second] {
        assert!(handle.join().unwrap().contains("pong:h"));
    }
    // A denied host is never asked about.
    let out = exchange(p.proxy, b"CONNECT x.denied.test:443 HTTP/1.1\r\n\r\n");
    assert!(out.contains("denied by rule *.denied.test"), "{out:?}");
    // Declined, and no server attached.
    let proxy = p.proxy;
    let third = thread::spawn(move || exchange(proxy, b"CONNECT third.test:443 HTTP/1.1\r\n\r\n"));
    p.events.wait_for("ask 2 ");
    p.state.answer(2, Answer::Decline);
    assert!(third.join().unwrap().contains("the user declined"));
    // The server's own refusal is the reason; an answer to no open question is dropped.
    p.state.answer(40, Answer::Once);
    let fifth = thread::spawn(move || exchange(proxy, b"CONNECT fifth.test:443 HTTP/1.1\r\n\r\n"));
    p.events.wait_for("ask 3 ");
    p.state
        .answer(3, Answer::Refuse("too many questions are open".to_owned()));
    assert!(
        fifth
            .join()
            .unwrap()
            .contains("too many questions are open")
    );
    p.state.detach();
    let out = exchange(p.proxy, b"CONNECT fourth.test:443 HTTP/1.1\r\n\r\n");
    assert!(out.contains("no way to ask the user"), "{out:?}");
}

/// Every (name, type) a DNS logger was asked.
type Queries = Arc<Mutex<Vec<(String, u16)>>>;

/// A resolver that records every query it gets and answers each A question with `198.18.0.7`.
fn dns_logger() -> (SocketAddr, Queries) {
    let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
    let addr = socket.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    thread::spawn(move || {
        let mut buf = [0u8; 512];
        while let Ok((n, from)) = socket.recv_from(&mut buf) {
            let Ok(query) = dns::parse_query(&buf[..n]) else {
                continue;
            };
            lock(&log).push((query.name.clone(), query.qtype));
            let answer = dns::answer(
                &buf[..n],
                &query,
                dns::RCODE_OK,
                &[IpAddr::from([198, 18, 0, 7])],
            );
            let _ = socket.send_to(&answer, from);
        }
    });
    (addr, seen)
}

#[test]
fn no_query_for_a_name_the_policy_does_not_allow_ever_reaches_the_resolver() {
    // See: issue 33
    let (resolver, seen) = dns_logger();
    let events = Events::default();
    let state = State::new(
        Upstream {
            dns: Some(resolver),
            ..Upstream::default()
        },
        Box::new(events.clone()),
    );
    let Some(control::Message::Policy(ip, policy)) =
        control::parse("policy 127.0.0.1 allowlist ask=0 private=0 allow=allowed.test deny=")
    else {
        panic!("bad policy line");
    };
    state.set_policy(ip, Some(policy));
    state.set_address(IpAddr::from([172, 30, 0, 2]));
    let source = IpAddr::from([127, 0, 0, 1]);
    // The computer's own DNS queries, allowed or not, of every type, are answered by the proxy.
    for (name, qtype) in [
        ("other.test", dns::TYPE_A),
        ("other.test", dns::TYPE_AAAA),
        ("secret-data.other.test", 16),
        ("other.test", 255),
        ("allowed.test", dns::TYPE_A),
    ] {
        let query = dns::build_query(7, name, qtype).unwrap();
        let reply = dns_reply(&state, source, &query, Some(IpAddr::from([172, 30, 0, 2]))).unwrap();
        let expected = if name == "allowed.test" {
            dns::RCODE_OK
        } else {
            dns::RCODE_NXDOMAIN
        };
        assert_eq!(reply[3] & 0xF, expected, "{name} {qtype}");
    }
    // Connections: the refused name is never looked up; the allowed one is (and its public
    // address is then dialled, here refused as unreachable rather than as private).
    assert!(
        matches!(admit(&state, source, &Dest::Name("other.test".into()), 443), Err((_, _, reason)) if reason.contains("allow-list"))
    );
    let allowed = admit(&state, source, &Dest::Name("allowed.test".into()), 9);
    assert!(matches!(allowed, Err((_, _, reason)) if reason.contains("allow-list")));
    let _ = admit(&state, source, &Dest::Name("allowed.test".into()), 443);
    let seen = lock(&seen).clone();
    assert!(
        seen.iter().all(|(name, _)| name == "allowed.test"),
        "{seen:?}"
    );
    assert_eq!(
        seen.first().map(|(n, t)| (n.as_str(), *t)),
        Some(("allowed.test", dns::TYPE_A))
    );
}

// The socket wiring: the same proxy reached over its Unix socket, directly and through the
// relay, with the computer named by its token.

const KEY: &str = "fd00:6b69::5";
const TOKEN: &str = "00112233445566778899aabbccddeeff";
const SOCKET_ALLOW: &str =
    "policy fd00:6b69::5 allowlist ask=0 private=1 allow=allowed.test,allowed.test:5432 deny=";

/// A directory of the test's own, removed on drop.
struct TempDir(std::path::PathBuf);

impl TempDir {
    fn new() -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let path = std::env::temp_dir().join(format!(
            "kilntainers-egress-test-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::create_dir_all(&path).unwrap();
        Self(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

struct SocketProxy {
    proxy: Proxy,
    path: std::path::PathBuf,
    _dir: TempDir,
}

/// The proxy of [`start`], also listening on a Unix socket, with [`TOKEN`] registered for
/// [`KEY`].
fn start_socket(policy_line: &str) -> SocketProxy {
    let proxy = start(policy_line, true);
    let dir = TempDir::new();
    let path = dir.0.join("egress.sock");
    // A stale file from an earlier proxy is replaced.
    std::fs::write(&path, b"stale").unwrap();
    control::read(&proxy.state, format!("token {KEY} {TOKEN}\n").as_bytes());
    socket::listen(proxy.state.clone(), &path).unwrap();
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
        0o666
    );
    SocketProxy {
        proxy,
        path,
        _dir: dir,
    }
}

fn line(token: &str, kind: &str) -> Vec<u8> {
    format!("{token} {kind}\n").into_bytes()
}

/// Sends `send` on a new socket connection and reads until the proxy closes it (which it may
/// do before all was sent: a refused connection is closed after its first line).
fn socket_exchange(path: &std::path::Path, send: &[&[u8]]) -> String {
    let mut s = UnixStream::connect(path).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    for piece in send {
        // The proxy may have closed a refused connection before the rest is written.
        if s.write_all(piece).is_err() {
            break;
        }
    }
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

#[test]
fn socket_connections_are_served_as_the_computer_their_token_names() {
    let p = start_socket(SOCKET_ALLOW);
    // The identification line and the request in one write, and in two.
    let mut request = line(TOKEN, "http");
    request.extend_from_slice(b"GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n");
    let out = socket_exchange(&p.path, &[&request]);
    assert!(out.starts_with("pong:GET / HTTP/1.1"), "{out:?}");
    let out = socket_exchange(
        &p.path,
        &[
            &line(TOKEN, "proxy"),
            b"GET http://allowed.test/x HTTP/1.1\r\nHost: allowed.test\r\n\r\n",
        ],
    );
    assert_eq!(out, "pong:GET /x HTTP/1.1\r\nHost: allowed.test\r\n\r\n");
    let hello = sni::tests::client_hello(Some("allowed.test"), 0);
    let mut connect = b"CONNECT allowed.test:443 HTTP/1.1\r\n\r\n".to_vec();
    connect.extend_from_slice(&hello);
    let out = socket_exchange(&p.path, &[&line(TOKEN, "proxy"), &connect]);
    assert!(
        out.starts_with("HTTP/1.1 200 Connection established\r\n\r\npong:"),
        "{out:?}"
    );
    let out = socket_exchange(&p.path, &[&line(TOKEN, "tls"), &hello]);
    assert!(out.starts_with("pong:\x16\x03\x01"), "{out:?}");
    p.proxy.events.assert_none_denied();
    // A refusal names the computer by its policy key.
    let out = socket_exchange(
        &p.path,
        &[
            &line(TOKEN, "http"),
            b"GET / HTTP/1.1\r\nHost: other.test\r\n\r\n",
        ],
    );
    assert!(out.starts_with("HTTP/1.1 403 Forbidden"), "{out:?}");
    assert!(
        out.contains("network access to other.test:80 was blocked"),
        "{out:?}"
    );
    p.proxy
        .events
        .wait_for("denied fd00:6b69::5 other.test 80 not in this computer's allow-list");
}

#[test]
fn socket_connections_without_a_known_token_get_nothing() {
    let p = start_socket(SOCKET_ALLOW);
    let request: &[u8] = b"GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n";
    let unknown = "ffeeddccbbaa99887766554433221100";
    for first in [
        line(unknown, "http"),
        line(TOKEN, "ssh"),
        line(&TOKEN.to_uppercase(), "http"),
        b"hello\n".to_vec(),
        vec![b'a'; 200],
    ] {
        let out = socket_exchange(&p.path, &[&first, request]);
        assert_eq!(out, "", "{:?}", String::from_utf8_lossy(&first));
    }
    // Forgetting the computer drops its token with its policy.
    control::read(&p.proxy.state, format!("forget {KEY}\n").as_bytes());
    let out = socket_exchange(&p.path, &[&line(TOKEN, "http"), request]);
    assert_eq!(out, "");
    p.proxy.events.assert_none_denied();
}

/// One DNS-over-TCP message: its length, then it.
fn framed(message: &[u8]) -> Vec<u8> {
    let mut out = (message.len() as u16).to_be_bytes().to_vec();
    out.extend_from_slice(message);
    out
}

fn read_framed(stream: &mut impl Read) -> Vec<u8> {
    let mut length = [0u8; 2];
    stream.read_exact(&mut length).unwrap();
    let mut message = vec![0u8; usize::from(u16::from_be_bytes(length))];
    stream.read_exact(&mut message).unwrap();
    message
}

#[test]
fn dns_over_the_socket_answers_allowed_names_with_the_relay_address() {
    let p = start_socket(SOCKET_ALLOW);
    let mut s = UnixStream::connect(&p.path).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    // Two messages in one write, right behind the identification line.
    let mut send = line(TOKEN, "dns");
    send.extend(framed(
        &dns::build_query(1, "allowed.test", dns::TYPE_A).unwrap(),
    ));
    send.extend(framed(
        &dns::build_query(2, "other.test", dns::TYPE_A).unwrap(),
    ));
    s.write_all(&send).unwrap();
    let allowed = read_framed(&mut s);
    assert_eq!(
        dns::parse_answer(&allowed, 1, "allowed.test", dns::TYPE_A).unwrap(),
        vec![IpAddr::from([127, 0, 0, 1])]
    );
    let other = read_framed(&mut s);
    assert_eq!(other[3] & 0xF, dns::RCODE_NXDOMAIN);
    // A message longer than a query may be ends the connection.
    s.write_all(&((dns::MAX_UDP + 1) as u16).to_be_bytes())
        .unwrap();
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    assert!(rest.is_empty(), "{rest:?}");
}

#[test]
fn silent_socket_connections_cannot_lock_out_an_identified_one() {
    let p = start_socket(SOCKET_ALLOW);
    let mut silent: Vec<UnixStream> = (0..=socket::MAX_UNIDENTIFIED)
        .map(|_| UnixStream::connect(&p.path).unwrap())
        .collect();
    let first = &mut silent[0];
    first
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    assert_eq!(first.read(&mut [0u8; 16]).unwrap_or(0), 0);
    let out = socket_exchange(
        &p.path,
        &[
            &line(TOKEN, "http"),
            b"GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n",
        ],
    );
    assert!(out.starts_with("pong:GET / HTTP/1.1"), "{out:?}");
}

struct RelayPorts {
    proxy: u16,
    http: u16,
    dns: u16,
    udp: u16,
}

/// A relay on ephemeral loopback ports, carrying to the proxy socket at `path`.
fn start_relay(path: &std::path::Path, token: &str) -> RelayPorts {
    let relay = relay::Relay::new(path.to_owned(), socket::Token::parse(token).unwrap());
    let tcp = || TcpListener::bind("127.0.0.1:0").unwrap();
    let (p, h, d) = (tcp(), tcp(), tcp());
    let udp = UdpSocket::bind("127.0.0.1:0").unwrap();
    let ports = RelayPorts {
        proxy: p.local_addr().unwrap().port(),
        http: h.local_addr().unwrap().port(),
        dns: d.local_addr().unwrap().port(),
        udp: udp.local_addr().unwrap().port(),
    };
    relay::serve(
        &relay,
        Some(udp),
        vec![
            (p, socket::Kind::Proxy),
            (h, socket::Kind::Http),
            (d, socket::Kind::Dns),
        ],
    );
    ports
}

#[test]
fn the_relay_carries_a_computers_loopback_to_the_proxy_socket() {
    let p = start_socket(SOCKET_ALLOW);
    let r = start_relay(&p.path, TOKEN);
    // A program ignoring proxy settings, and one using them.
    let out = exchange(r.http, b"GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n");
    assert!(out.starts_with("pong:GET / HTTP/1.1"), "{out:?}");
    let out = exchange(r.proxy, b"CONNECT other.test:443 HTTP/1.1\r\n\r\n");
    assert!(out.starts_with("HTTP/1.1 403"), "{out:?}");
    p.proxy
        .events
        .wait_for("denied fd00:6b69::5 other.test 443 not in this computer's allow-list");
    // DNS over UDP and over TCP: an allowed name is the relay itself.
    let udp = UdpSocket::bind("127.0.0.1:0").unwrap();
    udp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let ask = |name: &str| {
        let query = dns::build_query(0x77, name, dns::TYPE_A).unwrap();
        udp.send_to(&query, ("127.0.0.1", r.udp)).unwrap();
        let mut buf = [0u8; 512];
        let (n, _) = udp.recv_from(&mut buf).unwrap();
        buf[..n].to_vec()
    };
    assert_eq!(
        dns::parse_answer(&ask("allowed.test"), 0x77, "allowed.test", dns::TYPE_A).unwrap(),
        vec![IpAddr::from([127, 0, 0, 1])]
    );
    assert_eq!(ask("other.test")[3] & 0xF, dns::RCODE_NXDOMAIN);
    let mut tcp = TcpStream::connect(("127.0.0.1", r.dns)).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    tcp.write_all(&framed(
        &dns::build_query(9, "allowed.test", dns::TYPE_A).unwrap(),
    ))
    .unwrap();
    assert_eq!(
        dns::parse_answer(&read_framed(&mut tcp), 9, "allowed.test", dns::TYPE_A).unwrap(),
        vec![IpAddr::from([127, 0, 0, 1])]
    );
}

#[test]
fn a_relay_without_a_proxy_closes_and_a_second_relay_leaves_the_first_running() {
    let p = start_socket(SOCKET_ALLOW);
    let r = start_relay(&p.path, TOKEN);
    let second = relay::Relay::new(p.path.clone(), socket::Token::parse(TOKEN).unwrap());
    let ports = Ports {
        bind: IpAddr::from([127, 0, 0, 1]),
        dns: 0,
        http: 0,
        https: 0,
        proxy: r.proxy,
    };
    assert_eq!(relay::run(&second, &ports, false), Some(0));
    let out = exchange(
        r.proxy,
        b"GET http://allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\n\r\n",
    );
    assert!(out.starts_with("pong:GET / HTTP/1.1"), "{out:?}");
    // A relay whose socket is gone just closes what it accepts.
    let dir = TempDir::new();
    let nowhere = start_relay(&dir.0.join("missing.sock"), TOKEN);
    assert_eq!(
        exchange(
            nowhere.http,
            b"GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n"
        ),
        ""
    );
}

const PLACEHOLDER: &str = "kts_0123456789abcdef0123456789abcdef";

/// Gives the loopback computer the secret TOKEN, bound to allowed.test.
fn give_secret(p: &Proxy) {
    let line = format!(
        "secret 127.0.0.1 TOKEN {PLACEHOLDER} allowed.test {} {}\n",
        base64::encode(b"Authorization: Bearer {}"),
        base64::encode(b"the-value")
    );
    control::read(&p.state, line.as_bytes());
}

#[test]
fn plain_http_heads_get_the_value_for_bound_hosts_only() {
    let p = start(
        "policy 127.0.0.1 allowlist ask=0 private=1 allow=allowed.test,other.test deny=",
        true,
    );
    give_secret(&p);
    // Through the proxy and on port 80: the header carries the value, the body does not.
    let out = exchange(
        p.proxy,
        format!(
            "POST http://allowed.test/x HTTP/1.1\r\nHost: allowed.test\r\nX-T: {PLACEHOLDER}\r\nContent-Length: 36\r\n\r\n{PLACEHOLDER}"
        )
        .as_bytes(),
    );
    assert_eq!(
        out,
        format!(
            "pong:POST /x HTTP/1.1\r\nHost: allowed.test\r\nX-T: the-value\r\nContent-Length: 36\r\nConnection: close\r\n\r\n{PLACEHOLDER}"
        )
    );
    let out = exchange(p.http, b"GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n");
    assert_eq!(
        out,
        "pong:GET / HTTP/1.1\r\nHost: allowed.test\r\nAuthorization: Bearer the-value\r\nConnection: close\r\n\r\n"
    );
    // Another host: checked and closed after one request, nothing put in.
    let out = exchange(
        p.http,
        b"GET / HTTP/1.1\r\nHost: other.test\r\nConnection: keep-alive\r\n\r\n",
    );
    assert_eq!(
        out,
        "pong:GET / HTTP/1.1\r\nHost: other.test\r\nConnection: close\r\n\r\n"
    );
    p.events.assert_none_denied();
    // The placeholder to a host it is not bound to: refused before anything is connected.
    let reason = "carries the secret TOKEN to a host it is not bound to";
    for (port, request) in [
        (
            p.http,
            format!("GET / HTTP/1.1\r\nHost: other.test\r\nCookie: t={PLACEHOLDER}\r\n\r\n"),
        ),
        (
            p.proxy,
            format!("GET http://other.test/?t={PLACEHOLDER} HTTP/1.1\r\nHost: other.test\r\n\r\n"),
        ),
        (
            p.proxy,
            format!(
                "CONNECT other.test:443 HTTP/1.1\r\nProxy-Authorization: {PLACEHOLDER}\r\n\r\n"
            ),
        ),
    ] {
        let out = exchange(port, request.as_bytes());
        assert!(out.starts_with("HTTP/1.1 403"), "{out:?}");
        assert!(out.contains(reason), "{out:?}");
    }
    p.events
        .wait_for(&format!("denied 127.0.0.1 other.test 80 {reason}"));
    p.events
        .wait_for(&format!("denied 127.0.0.1 other.test 443 {reason}"));
    // Plain HTTP inside a CONNECT tunnel is read like a proxy request.
    let out = exchange(
        p.proxy,
        format!(
            "CONNECT allowed.test:80 HTTP/1.1\r\n\r\nGET / HTTP/1.1\r\nHost: allowed.test\r\nX-T: {PLACEHOLDER}\r\n\r\n"
        )
        .as_bytes(),
    );
    assert!(
        out.ends_with("pong:GET / HTTP/1.1\r\nHost: allowed.test\r\nX-T: the-value\r\nConnection: close\r\n\r\n"),
        "{out:?}"
    );
    // HTTPS is spliced by a proxy that cannot terminate TLS, bound host or not.
    let hello = sni::tests::client_hello(Some("allowed.test"), 0);
    assert!(exchange(p.https, &hello).starts_with("pong:\x16\x03\x01"));
    // Forgotten: nothing is put in any more, and nothing refused.
    control::read(&p.state, "unsecret 127.0.0.1 TOKEN\n".as_bytes());
    let out = exchange(
        p.http,
        format!("GET / HTTP/1.1\r\nHost: other.test\r\nX: {PLACEHOLDER}\r\n\r\n").as_bytes(),
    );
    assert!(out.starts_with("pong:"), "{out:?}");
    let lines = p.events.lines();
    assert!(lines.iter().all(|l| !l.contains("the-value")), "{lines:?}");
}
