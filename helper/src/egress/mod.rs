//! `kilntainers-helper egress-proxy`: the egress proxy of docs/egress.md, run in a sidecar
//! container that is the only peer of the computers on their internal network. It is their DNS
//! server ([`dns`]: allowed names resolve to the proxy itself, every other name is NXDOMAIN and
//! no query leaves), their HTTP(S) proxy (`CONNECT` and absolute-form requests, [`http`]) and,
//! for clients that ignore proxy settings, the server behind every allowed name on ports 80
//! (routed by `Host`) and 443 (routed by TLS SNI, [`sni`]). Each connection is decided once
//! ([`policy`]), resolved by the proxy itself, checked against the private-address rule, and
//! then spliced byte for byte; [`Route`] is the one seam where TLS is terminated instead, for
//! the hosts a computer's secrets are bound to, when the proxy has a [`tls::Terminator`] (the
//! broker binary; [`secrets`] says what is rewritten).
//!
//! In the socket wiring (for Podman and gVisor, where computers have no network) the proxy
//! also listens on a Unix socket shared with the computers ([`socket`]); a relay inside each
//! computer ([`relay`]) carries its loopback connections there, identified by a per-computer
//! token instead of a source address.
//!
//! The server talks to it over stdin/stdout (through the engine, so it works with a remote
//! engine and from a container): one line per message, [`control`]. The proxy keeps enforcing
//! the last policies it got when the server goes away, and refuses questions while no server
//! is attached.
//!
//! Bounded against a hostile computer: [`MAX_CONNECTIONS`] connections in all and
//! [`MAX_PER_SOURCE`] per computer, each with a small thread stack and buffers, a head of at
//! most [`http::MAX_HEAD`] / [`sni::MAX_HELLO`] bytes read within [`HANDSHAKE_TIMEOUT`] (and
//! at most [`secrets::MAX_REWRITTEN`] once secrets are put in), and [`IDLE_TIMEOUT`] on a quiet
//! tunnel.

pub mod base64;
pub mod control;
pub mod dns;
pub mod http;
pub mod policy;
pub mod relay;
pub mod secrets;
pub mod sni;
pub mod socket;
pub mod tls;

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use policy::{Decision, Dest, Policy};
use secrets::Secret;
use tls::{ClientStream, Terminator, TlsJob};

/// Connections held at once, all computers together: beyond this a new one is closed at once.
/// Each costs one thread with a [`STACK`] stack and two [`SPLICE_BUFFER`] buffers, so this
/// bounds the proxy's memory at about 1024 × 100 KiB.
pub const MAX_CONNECTIONS: usize = 1024;
/// Connections one computer may hold, so one hostile computer cannot starve the others.
pub const MAX_PER_SOURCE: usize = 256;
/// Time a client has to send its request head or ClientHello.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// A tunnel with no byte either way for this long is closed.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(600);
/// Time to connect upstream.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a connection to an unknown host waits for the person's answer (docs/egress.md,
/// "Ask-to-allow").
pub const ASK_TIMEOUT: Duration = Duration::from_secs(60);
/// Stack of a connection thread: it holds only small buffers on the heap.
const STACK: usize = 64 * 1024;
/// One direction's copy buffer.
const SPLICE_BUFFER: usize = 16 * 1024;
/// Questions open at once (all computers); more are refused.
const MAX_QUESTIONS: usize = 64;
/// Pause of an accept loop after a failed accept or thread start (EMFILE and friends), so it
/// backs off instead of spinning.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// Where the proxy listens (and, on the computer's loopback, the relay: [`relay`]).
#[derive(Debug, Clone)]
pub struct Ports {
    pub bind: IpAddr,
    pub dns: u16,
    pub http: u16,
    pub https: u16,
    pub proxy: u16,
}

impl Default for Ports {
    fn default() -> Self {
        Self {
            bind: IpAddr::from([0, 0, 0, 0]),
            dns: 53,
            http: 80,
            https: 443,
            proxy: 3128,
        }
    }
}

/// How the proxy resolves names upstream.
#[derive(Debug, Clone, Default)]
pub struct Upstream {
    /// `--egress-dns`, else the first nameserver of /etc/resolv.conf.
    pub dns: Option<SocketAddr>,
    /// `--egress-resolve`.
    pub fixed: HashMap<String, IpAddr>,
    /// Ports connected to instead of the requested one, for tests (`host:port` → port).
    pub port_map: HashMap<u16, u16>,
}

/// An answer to a question.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    Once,
    Computer,
    Deny,
    /// Declined or cancelled: deny this connection only.
    Decline,
    /// Refused by the server with this reason (no one could be asked, too many questions, no
    /// answer in time, a remembered deny).
    Refuse(String),
}

#[derive(Default)]
struct Questions {
    next: u64,
    /// Open questions: (source, host, port) → id; the answer once given.
    open: HashMap<(IpAddr, String, u16), u64>,
    answers: HashMap<u64, Answer>,
}

/// Everything the threads share.
pub struct State {
    policies: Mutex<HashMap<IpAddr, Policy>>,
    /// The socket wiring's per-computer tokens, by the computer's policy key
    /// ([`socket`]).
    tokens: Mutex<HashMap<IpAddr, socket::Token>>,
    /// The proxy's own address on the computers' network, given in DNS answers.
    address: Mutex<Option<IpAddr>>,
    upstream: Upstream,
    connections: AtomicUsize,
    per_source: Mutex<HashMap<IpAddr, usize>>,
    events: Mutex<Box<dyn Write + Send>>,
    /// Whether a server reads the events (stdin still open).
    attached: AtomicBool,
    questions: Mutex<Questions>,
    answered: Condvar,
    /// Each computer's secrets, by policy key, sorted by name.
    secrets: Mutex<HashMap<IpAddr, Vec<Arc<Secret>>>>,
    /// What terminates TLS for bound hosts (the broker's); `None` in the plain helper.
    terminator: Option<Box<dyn Terminator>>,
    /// Whether the terminator has a CA to mint leaf certificates from.
    ca_ready: AtomicBool,
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl State {
    pub fn new(upstream: Upstream, events: Box<dyn Write + Send>) -> Arc<Self> {
        Self::with_terminator(upstream, events, None)
    }

    /// A state whose bound hosts' HTTPS is terminated by `terminator` once a CA is given.
    pub fn with_terminator(
        upstream: Upstream,
        events: Box<dyn Write + Send>,
        terminator: Option<Box<dyn Terminator>>,
    ) -> Arc<Self> {
        Arc::new(Self {
            policies: Mutex::new(HashMap::new()),
            tokens: Mutex::new(HashMap::new()),
            address: Mutex::new(None),
            upstream,
            connections: AtomicUsize::new(0),
            per_source: Mutex::new(HashMap::new()),
            events: Mutex::new(events),
            attached: AtomicBool::new(true),
            questions: Mutex::new(Questions::default()),
            answered: Condvar::new(),
            secrets: Mutex::new(HashMap::new()),
            terminator,
            ca_ready: AtomicBool::new(false),
        })
    }

    /// Gives the computer whose policy key is `source` a secret, replacing one of the same
    /// name; `Err` past [`secrets::MAX_SECRETS`].
    pub fn set_secret(&self, source: IpAddr, secret: Secret) -> Result<(), String> {
        let mut all = lock(&self.secrets);
        let list = all.entry(source).or_default();
        match list.iter().position(|s| s.name() == secret.name()) {
            Some(i) => list[i] = Arc::new(secret),
            None if list.len() >= secrets::MAX_SECRETS => {
                return Err(format!(
                    "{source} has {} secrets already",
                    secrets::MAX_SECRETS
                ));
            }
            None => {
                list.push(Arc::new(secret));
                list.sort_by(|a, b| a.name().cmp(b.name()));
            }
        }
        Ok(())
    }

    pub fn remove_secret(&self, source: IpAddr, name: &str) {
        let mut all = lock(&self.secrets);
        if let Some(list) = all.get_mut(&source) {
            list.retain(|s| s.name() != name);
            if list.is_empty() {
                all.remove(&source);
            }
        }
    }

    pub fn forget_secrets(&self, source: IpAddr) {
        lock(&self.secrets).remove(&source);
    }

    /// The computer's secrets now, sorted by name (a connection keeps the ones it started
    /// with).
    fn secrets_of(&self, source: IpAddr) -> Vec<Arc<Secret>> {
        lock(&self.secrets)
            .get(&source)
            .cloned()
            .unwrap_or_default()
    }

    /// Hands the CA to the terminator; `Err` without one.
    pub fn set_ca(&self, cert_pem: &str, key_pem: &str) -> Result<(), String> {
        let terminator = self
            .terminator
            .as_deref()
            .ok_or("this proxy does not terminate TLS")?;
        terminator.set_ca(cert_pem, key_pem)?;
        self.ca_ready.store(true, Ordering::SeqCst);
        Ok(())
    }

    /// Hands extra upstream roots to the terminator; `Err` without one.
    pub fn set_roots(&self, pem: &str) -> Result<(), String> {
        self.terminator
            .as_deref()
            .ok_or("this proxy does not terminate TLS")?
            .set_roots(pem)
    }

    /// Whether TLS to a bound host is terminated: a terminator with a CA.
    fn can_terminate(&self) -> bool {
        self.terminator.is_some() && self.ca_ready.load(Ordering::SeqCst)
    }

    pub fn set_policy(&self, source: IpAddr, policy: Option<Policy>) {
        let mut policies = lock(&self.policies);
        match policy {
            Some(p) => policies.insert(source, p),
            None => policies.remove(&source),
        };
    }

    /// Registers (`Some`, replacing an older one) or drops the token of the computer whose
    /// policy key is `source`.
    pub fn set_token(&self, source: IpAddr, token: Option<socket::Token>) {
        let mut tokens = lock(&self.tokens);
        match token {
            Some(t) => tokens.insert(source, t),
            None => tokens.remove(&source),
        };
    }

    /// The policy key of the computer holding `token`. Every registered token is compared,
    /// each in constant time, so the time taken says nothing about how close a guess was.
    fn source_of(&self, token: &socket::Token) -> Option<IpAddr> {
        let tokens = lock(&self.tokens);
        let mut found = None;
        for (source, known) in tokens.iter() {
            if known.matches(token) {
                found = Some(*source);
            }
        }
        found
    }

    pub fn set_address(&self, address: IpAddr) {
        *lock(&self.address) = Some(address);
    }

    pub fn detach(&self) {
        self.attached.store(false, Ordering::SeqCst);
        // Questions waiting now can never be answered.
        self.answered.notify_all();
    }

    fn policy(&self, source: IpAddr) -> Option<Policy> {
        lock(&self.policies).get(&source).cloned()
    }

    fn emit(&self, line: &str) {
        let mut out = lock(&self.events);
        let _ = out.write_all(line.as_bytes());
        let _ = out.write_all(b"\n");
        let _ = out.flush();
    }

    /// Reports a refusal to the server: `denied <source> <host> <port> <reason>`.
    fn denied(&self, source: IpAddr, dest: &str, port: u16, reason: &str) {
        self.emit(&control::denied_line(source, dest, port, reason));
    }

    pub fn answer(&self, id: u64, answer: Answer) {
        let mut q = lock(&self.questions);
        // An answer to no open question (it timed out, or was never asked) is dropped, and
        // those of finished questions go with the next answer, so answers cannot pile up.
        if !q.open.values().any(|open| *open == id) {
            return;
        }
        q.answers.insert(id, answer);
        let open: std::collections::HashSet<u64> = q.open.values().copied().collect();
        q.answers.retain(|id, _| open.contains(id));
        drop(q);
        self.answered.notify_all();
    }

    /// Asks the server, and waits for the person's answer; `Err` is the refusal reason.
    fn ask(&self, source: IpAddr, host: &str, port: u16) -> Result<(), String> {
        if !self.attached.load(Ordering::SeqCst) {
            return Err("no way to ask the user (the server is not attached)".to_owned());
        }
        let key = (source, host.to_owned(), port);
        let mut q = lock(&self.questions);
        let id = match q.open.get(&key) {
            // Concurrent connections to the same host wait on one question.
            Some(id) => *id,
            None => {
                if q.open.len() >= MAX_QUESTIONS {
                    return Err("too many questions are open".to_owned());
                }
                q.next += 1;
                let id = q.next;
                q.open.insert(key.clone(), id);
                drop(q);
                self.emit(&control::ask_line(id, source, host, port));
                q = lock(&self.questions);
                id
            }
        };
        let deadline = Instant::now() + ASK_TIMEOUT;
        loop {
            if let Some(answer) = q.answers.get(&id).cloned() {
                q.open.remove(&key);
                return match answer {
                    Answer::Once | Answer::Computer => Ok(()),
                    Answer::Deny | Answer::Decline => Err("the user declined".to_owned()),
                    Answer::Refuse(reason) => Err(reason),
                };
            }
            let now = Instant::now();
            if now >= deadline || !self.attached.load(Ordering::SeqCst) {
                q.open.remove(&key);
                return Err(format!(
                    "no answer from the user in {} s",
                    ASK_TIMEOUT.as_secs()
                ));
            }
            q = self
                .answered
                .wait_timeout(q, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

/// A slot among the connection caps; released on drop.
struct Slot {
    state: Arc<State>,
    source: IpAddr,
}

impl Slot {
    fn take(state: &Arc<State>, source: IpAddr) -> Option<Self> {
        if state.connections.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
            state.connections.fetch_sub(1, Ordering::SeqCst);
            return None;
        }
        let mut per = lock(&state.per_source);
        let count = per.entry(source).or_insert(0);
        if *count >= MAX_PER_SOURCE {
            drop(per);
            state.connections.fetch_sub(1, Ordering::SeqCst);
            return None;
        }
        *count += 1;
        Some(Self {
            state: state.clone(),
            source,
        })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut per = lock(&self.state.per_source);
        if let Some(count) = per.get_mut(&self.source) {
            *count -= 1;
            if *count == 0 {
                per.remove(&self.source);
            }
        }
        self.state.connections.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Which listener a connection arrived on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Listener {
    /// The proxy port: `CONNECT` or absolute-form requests.
    Proxy,
    /// Port 80 of an allowed name: origin-form, routed by `Host`.
    Http,
    /// Port 443 of an allowed name: routed by the ClientHello's SNI.
    Tls,
}

/// What happens to an allowed TLS connection (docs/egress.md, "Secrets brokering in the proxy").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    /// Byte for byte.
    Splice,
    /// Served by the terminator: a host one of the computer's secrets is bound to, and a
    /// proxy that can terminate. A host no secret is bound to is never intercepted.
    Terminate,
}

fn route_for(state: &State, secrets: &[Arc<Secret>], dest: &Dest, port: u16) -> Route {
    if state.can_terminate() && secrets.iter().any(|s| s.bound_to(dest, port)) {
        Route::Terminate
    } else {
        Route::Splice
    }
}

/// Binds every listener and serves until the process ends.
pub fn serve(state: Arc<State>, ports: &Ports) -> io::Result<()> {
    let udp = UdpSocket::bind(SocketAddr::new(ports.bind, ports.dns))?;
    let listeners = [
        (
            TcpListener::bind(SocketAddr::new(ports.bind, ports.proxy))?,
            Listener::Proxy,
        ),
        (
            TcpListener::bind(SocketAddr::new(ports.bind, ports.http))?,
            Listener::Http,
        ),
        (
            TcpListener::bind(SocketAddr::new(ports.bind, ports.https))?,
            Listener::Tls,
        ),
    ];
    spawn_all(state, udp, listeners);
    Ok(())
}

fn spawn_all(state: Arc<State>, udp: UdpSocket, listeners: [(TcpListener, Listener); 3]) {
    let dns_state = state.clone();
    thread::spawn(move || serve_dns(&dns_state, &udp));
    for (listener, kind) in listeners {
        let state = state.clone();
        thread::spawn(move || accept_loop(&state, &listener, kind));
    }
}

fn accept_loop(state: &Arc<State>, listener: &TcpListener, kind: Listener) {
    for stream in listener.incoming() {
        let Ok(stream) = stream else {
            thread::sleep(ACCEPT_BACKOFF);
            continue;
        };
        let Ok(peer) = stream.peer_addr() else {
            continue;
        };
        let source = canonical_ip(peer.ip());
        let Some(slot) = Slot::take(state, source) else {
            // Over the cap: closed at once, nothing read.
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let state = state.clone();
        let spawned = thread::Builder::new().stack_size(STACK).spawn(move || {
            let _slot = slot;
            handle(&state, stream, source, kind, Vec::new());
        });
        if spawned.is_err() {
            thread::sleep(ACCEPT_BACKOFF);
        }
    }
}

/// IPv4-mapped IPv6 sources are their IPv4 address (policies are keyed by that).
fn canonical_ip(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

fn serve_dns(state: &Arc<State>, socket: &UdpSocket) {
    let mut buffer = [0u8; dns::MAX_UDP];
    loop {
        let Ok((len, from)) = socket.recv_from(&mut buffer) else {
            continue;
        };
        let msg = &buffer[..len];
        let own = *lock(&state.address);
        let reply = dns_reply(state, canonical_ip(from.ip()), msg, own);
        if let Some(reply) = reply {
            let _ = socket.send_to(&reply, from);
        }
    }
}

/// The answer to one DNS message from `source`; never asks anyone upstream. An allowed name
/// resolves to `own`, where the computer reaches the proxy (the proxy's address on the
/// computers' network, or the relay's loopback address in the socket wiring); without one,
/// every name is NXDOMAIN.
fn dns_reply(state: &State, source: IpAddr, msg: &[u8], own: Option<IpAddr>) -> Option<Vec<u8>> {
    let query = match dns::parse_query(msg) {
        Ok(query) => query,
        Err(dns::DnsError::NotAQuery) => {
            return dns::message_id(msg).map(|id| dns::bare_answer(id, dns::RCODE_NOTIMP));
        }
        Err(_) => return dns::message_id(msg).map(|id| dns::bare_answer(id, dns::RCODE_FORMERR)),
    };
    let allowed = state.policy(source).zip(own).filter(|(policy, _)| {
        query.qclass == 1 && is_canonical_name(&query.name) && policy.name_may_resolve(&query.name)
    });
    Some(match allowed {
        Some((_, own)) => dns::answer(msg, &query, dns::RCODE_OK, &[own]),
        None => dns::answer(msg, &query, dns::RCODE_NXDOMAIN, &[]),
    })
}

fn is_canonical_name(name: &str) -> bool {
    policy::Rule::parse(name).is_some() && !name.contains(['*', ':', '/', '['])
}

/// A computer's connection as the handlers see it: a TCP stream on the computers' network, or
/// a Unix stream from a relay in the socket wiring ([`socket`]). Also the upstream side of the
/// relay's splice.
pub(crate) trait Stream: Read + Write + Send + Sized + 'static {
    fn try_clone(&self) -> io::Result<Self>;
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()>;
    fn shutdown(&self, how: Shutdown) -> io::Result<()>;
    /// The stream as a terminator takes it.
    fn into_client(self) -> ClientStream;
}

macro_rules! impl_stream {
    ($type:ty, $variant:ident) => {
        impl Stream for $type {
            fn try_clone(&self) -> io::Result<Self> {
                <$type>::try_clone(self)
            }
            fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
                <$type>::set_read_timeout(self, timeout)
            }
            fn shutdown(&self, how: Shutdown) -> io::Result<()> {
                <$type>::shutdown(self, how)
            }
            fn into_client(self) -> ClientStream {
                ClientStream::$variant(self)
            }
        }
    };
}

impl_stream!(TcpStream, Tcp);
impl_stream!(UnixStream, Unix);

/// Reads until `complete` says the bytes so far are enough (or the cap, or `timeout` from
/// now).
fn read_head(
    stream: &mut impl Stream,
    mut data: Vec<u8>,
    cap: usize,
    timeout: Duration,
    mut complete: impl FnMut(&[u8]) -> bool,
) -> io::Result<Vec<u8>> {
    if !data.is_empty() && complete(&data) {
        return Ok(data);
    }
    let deadline = Instant::now() + timeout;
    let mut chunk = [0u8; 2048];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "handshake timeout"));
        }
        stream.set_read_timeout(Some(left))?;
        let room = cap.saturating_sub(data.len()).min(chunk.len());
        if room == 0 {
            return Ok(data);
        }
        let n = stream.read(&mut chunk[..room])?;
        if n == 0 {
            return Ok(data);
        }
        data.extend_from_slice(&chunk[..n]);
        if complete(&data) {
            return Ok(data);
        }
    }
}

/// One connection from a computer, from its first byte to its end; `already` is what was
/// read from it before (after a relay's identification line).
fn handle(
    state: &Arc<State>,
    mut client: impl Stream,
    source: IpAddr,
    kind: Listener,
    already: Vec<u8>,
) {
    let outcome = match kind {
        Listener::Tls => handle_tls(state, &mut client, source, already),
        Listener::Http | Listener::Proxy => handle_http(state, &mut client, source, kind, already),
    };
    if let Err((dest, port, reason)) = outcome {
        state.denied(source, &dest, port, &reason);
        if kind != Listener::Tls {
            let _ = client.write_all(&tls::refusal_response(&dest, port, &reason));
        }
    }
    let _ = client.shutdown(Shutdown::Both);
}

type Refused = (String, u16, String);

fn handle_tls(
    state: &Arc<State>,
    client: &mut impl Stream,
    source: IpAddr,
    already: Vec<u8>,
) -> Result<(), Refused> {
    let unknown = |reason: &str| ("(unknown)".to_owned(), 443, reason.to_owned());
    let hello = read_head(
        client,
        already,
        sni::MAX_HELLO + 5,
        HANDSHAKE_TIMEOUT,
        |d| sni::parse(d) != sni::Hello::Incomplete,
    )
    .map_err(|_| unknown("no TLS ClientHello in time"))?;
    let name = match sni::parse(&hello) {
        sni::Hello::Name(name) => name,
        sni::Hello::NoName => return Err(unknown("TLS without a server name (SNI)")),
        sni::Hello::Incomplete | sni::Hello::Invalid(_) => {
            return Err(unknown("not a TLS ClientHello"));
        }
    };
    let dest =
        destination(&name).ok_or_else(|| (name.clone(), 443, "not a host name".to_owned()))?;
    let upstream = admit(state, source, &dest, 443)?;
    let secrets = state.secrets_of(source);
    match route_for(state, &secrets, &dest, 443) {
        Route::Terminate => terminate(state, client, source, &dest, 443, hello, upstream, secrets),
        Route::Splice => splice(client, upstream, &hello),
    }
    Ok(())
}

/// Hands an admitted TLS connection to the terminator; its refusals are reported here (the
/// client had its 403 inside TLS, so nothing more is written to it).
#[allow(clippy::too_many_arguments)]
fn terminate(
    state: &Arc<State>,
    client: &mut impl Stream,
    source: IpAddr,
    dest: &Dest,
    port: u16,
    hello: Vec<u8>,
    upstream: TcpStream,
    secrets: Vec<Arc<Secret>>,
) {
    let (Some(terminator), Ok(clone)) = (state.terminator.as_deref(), client.try_clone()) else {
        return;
    };
    let host = match dest {
        Dest::Name(name) => name.clone(),
        Dest::Ip(ip) => ip.to_string(),
    };
    let target = dest.clone();
    let job = TlsJob {
        host,
        port,
        client: clone.into_client(),
        hello,
        upstream,
        rewrite: Box::new(move |head| rewrite_in_tls(head, &secrets, &target, port)),
    };
    if let Err(reason) = terminator.serve(job) {
        state.denied(source, &dest.to_string(), port, &reason);
    }
}

/// The rewrite of the first request inside a terminated TLS session: an origin-form request
/// whose `Host` names the host the TLS session is for, then [`secrets::rewrite`].
fn rewrite_in_tls(
    head: &[u8],
    secrets: &[Arc<Secret>],
    dest: &Dest,
    port: u16,
) -> Result<Vec<u8>, String> {
    let parsed = match http::parse(head, port) {
        Ok(parsed) => parsed,
        Err(http::HeadError::TooLarge) => return Err("request head too large".to_owned()),
        Err(_) => return Err("not an HTTP/1 request inside TLS".to_owned()),
    };
    if parsed.connect || parsed.origin_line.is_some() || parsed.len != head.len() {
        return Err("not an origin-form HTTP/1 request inside TLS".to_owned());
    }
    if destination(&parsed.host).as_ref() != Some(dest) || parsed.port != port {
        return Err(format!(
            "the Host header names {}, not the TLS server name",
            parsed.host
        ));
    }
    secrets::rewrite(head, secrets, dest, port)
}

fn handle_http(
    state: &Arc<State>,
    client: &mut impl Stream,
    source: IpAddr,
    kind: Listener,
    already: Vec<u8>,
) -> Result<(), Refused> {
    let default_port = 80;
    let data = read_head(client, already, http::MAX_HEAD, HANDSHAKE_TIMEOUT, |d| {
        !matches!(
            http::parse(d, default_port),
            Err(http::HeadError::Incomplete)
        )
    })
    .map_err(|_| {
        (
            "(unknown)".to_owned(),
            default_port,
            "no request in time".to_owned(),
        )
    })?;
    let head = match http::parse(&data, default_port) {
        Ok(head) => head,
        Err(http::HeadError::Mismatch { target, host }) => {
            return Err(split_target(
                target,
                format!("the Host header names {host}, not the target"),
            ));
        }
        Err(http::HeadError::TooLarge) => {
            return Err((
                "(unknown)".to_owned(),
                default_port,
                "request head too large".to_owned(),
            ));
        }
        Err(_) => {
            return Err((
                "(unknown)".to_owned(),
                default_port,
                "not an HTTP request".to_owned(),
            ));
        }
    };
    if kind == Listener::Http && (head.connect || head.origin_line.is_some()) {
        return Err((
            head.host,
            head.port,
            "a proxy request on port 80".to_owned(),
        ));
    }
    if kind == Listener::Proxy && !head.connect && head.origin_line.is_none() {
        return Err((head.host, head.port, "not a proxy request".to_owned()));
    }
    let dest = destination(&head.host)
        .ok_or_else(|| (head.host.clone(), head.port, "not a host name".to_owned()))?;
    let shown = dest.to_string();
    let secrets = state.secrets_of(source);
    if head.connect {
        if !secrets.is_empty() {
            secrets::check(&data[..head.len], &secrets, &dest, head.port)
                .map_err(|reason| (shown.clone(), head.port, reason))?;
        }
        let upstream = admit(state, source, &dest, head.port)?;
        let _ = client.write_all(b"HTTP/1.1 200 Connection established\r\n\r\n");
        // The tunnel's first bytes must name the same host (SNI or Host) when they name one.
        let inner = read_head(
            client,
            data[head.len..].to_vec(),
            sni::MAX_HELLO + 5,
            HANDSHAKE_TIMEOUT,
            |d| tunnel_first_bytes(d).is_some(),
        )
        .unwrap_or_default();
        if let Some(Some(named)) = tunnel_first_bytes(&inner)
            && destination(&named).as_ref() != Some(&dest)
        {
            return Err((
                shown,
                head.port,
                format!("the tunnel names {named}, not the CONNECT target"),
            ));
        }
        let hello = inner.first() == Some(&22)
            && matches!(sni::parse(&inner), sni::Hello::Name(_) | sni::Hello::NoName);
        if hello && route_for(state, &secrets, &dest, head.port) == Route::Terminate {
            terminate(
                state, client, source, &dest, head.port, inner, upstream, secrets,
            );
            return Ok(());
        }
        let mut first = inner;
        // Plain HTTP in the tunnel: its first head is read like a proxy request's.
        if !secrets.is_empty()
            && !hello
            && let Ok(inside) = http::parse(&first, head.port)
        {
            let mut rewritten = secrets::rewrite(&first[..inside.len], &secrets, &dest, head.port)
                .map_err(|reason| (shown.clone(), head.port, reason))?;
            rewritten.extend_from_slice(&first[inside.len..]);
            first = rewritten;
        }
        splice(client, upstream, &first);
        return Ok(());
    }
    let mut first = Vec::with_capacity(data.len());
    match &head.origin_line {
        Some(line) => {
            first.extend_from_slice(line.as_bytes());
            first.extend_from_slice(b"\r\n");
            first.extend_from_slice(&data[head.line_end..]);
        }
        None => first.extend_from_slice(&data),
    }
    // A computer with secrets has every plain-HTTP head rewritten (and so checked), bound
    // host or not; refused before anything is connected.
    if !secrets.is_empty() {
        let head_len = first.len() - (data.len() - head.len);
        let mut rewritten = secrets::rewrite(&first[..head_len], &secrets, &dest, head.port)
            .map_err(|reason| (shown.clone(), head.port, reason))?;
        rewritten.extend_from_slice(&first[head_len..]);
        first = rewritten;
    }
    let upstream = admit(state, source, &dest, head.port)?;
    splice(client, upstream, &first);
    Ok(())
}

fn split_target(target: String, reason: String) -> Refused {
    match http::split_authority(&target, Some(0)) {
        Some((host, port)) => (host, port, reason),
        None => (target, 0, reason),
    }
}

/// What the first bytes inside a tunnel name: `Some(Some(name))` a TLS SNI or HTTP `Host`,
/// `Some(None)` nothing to compare (another protocol, or no name), `None` not decided yet.
fn tunnel_first_bytes(data: &[u8]) -> Option<Option<String>> {
    if data.is_empty() {
        return None;
    }
    if data.first() == Some(&22) {
        return match sni::parse(data) {
            sni::Hello::Incomplete => None,
            sni::Hello::Name(name) => Some(Some(name)),
            _ => Some(None),
        };
    }
    if data.first().is_some_and(u8::is_ascii_uppercase) {
        return match http::parse(data, 80) {
            Err(http::HeadError::Incomplete) => None,
            Ok(head) => Some(Some(head.host)),
            Err(http::HeadError::Mismatch { host, .. }) => Some(Some(host)),
            Err(_) => Some(None),
        };
    }
    Some(None)
}

/// A name or IP literal as the policy compares it.
fn destination(host: &str) -> Option<Dest> {
    let host = host.trim_end_matches('.');
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    if let Ok(ip) = bare.parse::<IpAddr>() {
        return Some(Dest::Ip(canonical_ip(ip)));
    }
    let lower = host.to_ascii_lowercase();
    is_canonical_name(&lower).then_some(Dest::Name(lower))
}

/// Decides, asks when the policy says so, resolves and connects; `Err` is the refusal.
fn admit(state: &Arc<State>, source: IpAddr, dest: &Dest, port: u16) -> Result<TcpStream, Refused> {
    let shown = dest.to_string();
    let refuse = |reason: String| (shown.clone(), port, reason);
    let policy = state
        .policy(source)
        .ok_or_else(|| refuse("this address has no policy".to_owned()))?;
    match policy.decide(dest, port) {
        Decision::Allow => {}
        Decision::Refuse(reason) => return Err(refuse(reason)),
        Decision::Ask => state.ask(source, &shown, port).map_err(refuse)?,
    }
    let addresses = match dest {
        Dest::Ip(ip) => vec![*ip],
        Dest::Name(name) => resolve(state, name).map_err(refuse)?,
    };
    let usable: Vec<IpAddr> = addresses
        .iter()
        .copied()
        .filter(|ip| policy.allow_private || !policy::is_private(*ip))
        .collect();
    if usable.is_empty() {
        return Err(refuse(if addresses.is_empty() {
            "the name does not resolve".to_owned()
        } else {
            "private address".to_owned()
        }));
    }
    let mut last = String::new();
    for ip in usable {
        let connect_port = state.upstream.port_map.get(&port).copied().unwrap_or(port);
        match TcpStream::connect_timeout(&SocketAddr::new(ip, connect_port), CONNECT_TIMEOUT) {
            Ok(stream) => {
                let _ = stream.set_nodelay(true);
                return Ok(stream);
            }
            Err(e) => last = e.to_string(),
        }
    }
    Err(refuse(format!("cannot connect: {last}")))
}

fn resolve(state: &State, name: &str) -> Result<Vec<IpAddr>, String> {
    if let Some(ip) = state.upstream.fixed.get(name) {
        return Ok(vec![*ip]);
    }
    let server = state
        .upstream
        .dns
        .or_else(|| {
            std::fs::read_to_string("/etc/resolv.conf")
                .ok()
                .and_then(|t| dns::nameserver_from_resolv_conf(&t))
        })
        .ok_or("no resolver configured")?;
    let mut all = dns::resolve(server, name, dns::TYPE_A)?;
    if all.is_empty() {
        all = dns::resolve(server, name, dns::TYPE_AAAA)?;
    }
    Ok(all)
}

/// Copies both ways until both sides end or the tunnel idles; `first` (already read from the
/// client) goes upstream first. Each side's end of input is passed on as a half-close.
fn splice(client: &mut impl Stream, mut upstream: impl Stream, first: &[u8]) {
    if upstream.write_all(first).is_err() {
        return;
    }
    let (Ok(mut client_read), Ok(mut upstream_write)) = (client.try_clone(), upstream.try_clone())
    else {
        return;
    };
    let _ = client_read.set_read_timeout(Some(IDLE_TIMEOUT));
    let _ = upstream.set_read_timeout(Some(IDLE_TIMEOUT));
    let up = thread::Builder::new().stack_size(STACK).spawn(move || {
        copy(&mut client_read, &mut upstream_write);
        let _ = upstream_write.shutdown(Shutdown::Write);
    });
    copy(&mut upstream, client);
    let _ = client.shutdown(Shutdown::Write);
    if let Ok(up) = up {
        let _ = up.join();
    }
}

fn copy(from: &mut impl Read, to: &mut impl Write) {
    let mut buffer = vec![0u8; SPLICE_BUFFER];
    loop {
        match from.read(&mut buffer) {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                if to.write_all(&buffer[..n]).is_err() {
                    return;
                }
            }
        }
    }
}

/// `egress-proxy [--dns ADDR] [--resolve HOST=IP]… [--address IP] [--socket PATH]`: serves on
/// the default ports, or with `--socket` on that Unix socket only ([`socket`]), and reads
/// control lines from stdin until it closes, then keeps enforcing. A socket-wired proxy's only
/// network is the upstream one, shared with whatever else runs there: it listens on none of
/// its ports, so nothing there can use it or take up its connections.
pub fn main(args: impl Iterator<Item = String>) -> i32 {
    main_with(args, None)
}

/// [`main`] with a terminator for bound hosts' HTTPS (the broker's); says `ready tls` instead
/// of `ready` when it has one.
pub fn main_with(
    args: impl Iterator<Item = String>,
    terminator: Option<Box<dyn Terminator>>,
) -> i32 {
    let mut upstream = Upstream::default();
    let mut address = None;
    let mut socket_path = None;
    let mut args = args.peekable();
    while let Some(arg) = args.next() {
        let value = args.next();
        let ok = match (arg.as_str(), value) {
            ("--dns", Some(v)) => v.parse().map(|a| upstream.dns = Some(a)).is_ok(),
            ("--resolve", Some(v)) => v
                .split_once('=')
                .and_then(|(h, ip)| Some((h.to_owned(), ip.parse::<IpAddr>().ok()?)))
                .map(|(h, ip)| upstream.fixed.insert(h, ip))
                .is_some(),
            ("--address", Some(v)) => v.parse().map(|a| address = Some(a)).is_ok(),
            ("--socket", Some(v)) => {
                socket_path = Some(std::path::PathBuf::from(v));
                true
            }
            _ => false,
        };
        if !ok {
            eprintln!(
                "usage: kilntainers-helper egress-proxy [--dns ADDR:PORT] [--resolve HOST=IP]… [--address IP] [--socket PATH]"
            );
            return 2;
        }
    }
    let tls = terminator.is_some();
    let state = State::with_terminator(upstream, Box::new(io::stdout()), terminator);
    if let Some(address) = address {
        state.set_address(address);
    }
    let listening = match &socket_path {
        Some(path) => socket::listen(state.clone(), path)
            .map_err(|e| format!("cannot listen on {}: {e}", path.display())),
        None => serve(state.clone(), &Ports::default()).map_err(|e| format!("cannot listen: {e}")),
    };
    if let Err(why) = listening {
        eprintln!("kilntainers-helper egress-proxy: {why}");
        return 1;
    }
    state.emit(if tls { "ready tls" } else { "ready" });
    control::read(&state, io::stdin().lock());
    state.detach();
    // The server went away: keep enforcing the last policies until the container is removed.
    loop {
        thread::park();
    }
}

#[cfg(test)]
mod tests;
