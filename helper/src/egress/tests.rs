//! The proxy end to end on loopback: a policy, an upstream server standing in for the
//! internet, and hostile clients. Loopback upstreams need `allow_private`, except in the test
//! of the private-address rule itself.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket};
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
    assert!(
        p.events.lines().iter().all(|l| !l.starts_with("denied")),
        "{:?}",
        p.events.lines()
    );
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
        let reply = dns_reply(&state, source, &query).unwrap();
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
