//! `kilntainers-helper egress-relay SOCKET [--resolv-conf]`: the computer's end of the socket
//! wiring (docs/egress.md). A computer with no network runs it on its loopback, where it stands
//! in for the proxy: DNS on UDP and TCP 53, and the proxy's ports 80, 443 and 3128. Each TCP
//! connection is carried to the proxy's Unix socket ([`super::socket`]) after an
//! identification line with the computer's token (from [`TOKEN_VARIABLE`]) and the entrance it
//! came in by; each UDP query goes as one framed message on a `dns` connection of its own, and
//! the reply comes back as a datagram. The relay decides nothing: the proxy does, and an
//! allowed name resolves to 127.0.0.1, so even a program that ignores proxy settings reaches
//! an allowed host through it.
//!
//! The server starts it at every start of a computer and after its own restart, so a second
//! instance finds the proxy port taken and exits 0 ([`Started::AlreadyRunning`]). Bounded:
//! [`MAX_RELAYED`] TCP connections and [`MAX_QUERIES`] UDP queries at once, over that closed or
//! dropped; small thread stacks; an accept error backs off instead of spinning.

use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use super::socket::{self, Kind, RELAY_ADDRESS, Token};
use super::{ACCEPT_BACKOFF, Ports, STACK, dns, splice};

/// The environment variable holding the computer's token.
pub const TOKEN_VARIABLE: &str = "KILNTAINERS_EGRESS_TOKEN";
/// TCP connections relayed at once; a new one over that is closed.
pub const MAX_RELAYED: usize = 512;
/// UDP queries in flight at once; a datagram over that is dropped (the client asks again).
pub const MAX_QUERIES: usize = 64;
/// How long one UDP query waits for the proxy's answer: about what a resolver client waits.
const QUERY_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a refused connect to the proxy's socket is tried again.
const CONNECT_PATIENCE: Duration = Duration::from_secs(2);
/// Largest framed answer taken from the proxy (its answers are a question and one address).
const MAX_ANSWER: usize = 4096;
/// What `--resolv-conf` writes: the relay is the only resolver, and every name is absolute.
const RESOLV_CONF: &str = "nameserver 127.0.0.1\noptions ndots:0\n";

/// Where the relay listens by default: the computer's loopback, on the proxy's own ports.
pub fn default_ports() -> Ports {
    Ports {
        bind: IpAddr::V4(RELAY_ADDRESS),
        ..Ports::default()
    }
}

/// What the relay needs to carry a connection.
pub struct Relay {
    socket: PathBuf,
    token: Token,
    relayed: Arc<AtomicUsize>,
    queries: Arc<AtomicUsize>,
}

impl Relay {
    pub fn new(socket: PathBuf, token: Token) -> Arc<Self> {
        Arc::new(Self {
            socket,
            token,
            relayed: Arc::new(AtomicUsize::new(0)),
            queries: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// Opens a connection to the proxy, identified as `kind`.
    fn open(&self, kind: Kind) -> io::Result<UnixStream> {
        let mut stream = patiently(CONNECT_PATIENCE, || UnixStream::connect(&self.socket))?;
        stream.write_all(socket::identification_line(&self.token, kind).as_bytes())?;
        Ok(stream)
    }
}

/// `connect()`, tried again while it is refused, for up to `patience`: a neighbour flooding the
/// proxy's socket can fill its listen backlog, and a connect that failed has sent nothing, so
/// trying again is safe. Any other error is returned at once.
fn patiently<T>(patience: Duration, mut connect: impl FnMut() -> io::Result<T>) -> io::Result<T> {
    let deadline = Instant::now() + patience;
    let mut pause = Duration::from_millis(2);
    loop {
        match connect() {
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::ConnectionRefused
                        | io::ErrorKind::WouldBlock
                        | io::ErrorKind::Interrupted
                ) && Instant::now() + pause < deadline =>
            {
                thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(100));
            }
            done => return done,
        }
    }
}

/// One of a bounded number of things in flight; given back on drop.
struct InFlight(Arc<AtomicUsize>);

impl InFlight {
    fn take(counter: &Arc<AtomicUsize>, max: usize) -> Option<Self> {
        if counter.fetch_add(1, Ordering::SeqCst) >= max {
            counter.fetch_sub(1, Ordering::SeqCst);
            return None;
        }
        Some(Self(counter.clone()))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// How [`start`] went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Started {
    Serving,
    /// The proxy port is taken: a relay already runs here.
    AlreadyRunning,
}

/// Binds the listeners (the proxy port first: taken means a relay already runs) and serves each
/// on a thread of its own. A port other than the proxy's that cannot be bound (a program of the
/// computer's own may hold it) is a warning, and the rest are served.
pub fn start(relay: &Arc<Relay>, ports: &Ports) -> io::Result<Started> {
    let proxy = match TcpListener::bind(SocketAddr::new(ports.bind, ports.proxy)) {
        Ok(listener) => listener,
        Err(e) if e.kind() == io::ErrorKind::AddrInUse => return Ok(Started::AlreadyRunning),
        Err(e) => return Err(e),
    };
    let mut listeners = vec![(proxy, Kind::Proxy)];
    for (port, kind) in [
        (ports.dns, Kind::Dns),
        (ports.http, Kind::Http),
        (ports.https, Kind::Tls),
    ] {
        match TcpListener::bind(SocketAddr::new(ports.bind, port)) {
            Ok(listener) => listeners.push((listener, kind)),
            Err(e) => eprintln!("egress-relay: cannot listen on TCP port {port}: {e}"),
        }
    }
    let udp = UdpSocket::bind(SocketAddr::new(ports.bind, ports.dns))
        .inspect_err(|e| eprintln!("egress-relay: cannot listen on UDP port {}: {e}", ports.dns))
        .ok();
    serve(relay, udp, listeners);
    Ok(Started::Serving)
}

/// Serves bound listeners, each on a thread of its own: `udp` for DNS queries, and TCP
/// listeners with the entrance each stands for.
pub(super) fn serve(
    relay: &Arc<Relay>,
    udp: Option<UdpSocket>,
    listeners: Vec<(TcpListener, Kind)>,
) {
    if let Some(udp) = udp {
        let relay = relay.clone();
        thread::spawn(move || relay_queries(&relay, &udp));
    }
    for (listener, kind) in listeners {
        let relay = relay.clone();
        thread::spawn(move || relay_connections(&relay, &listener, kind));
    }
}

fn relay_connections(relay: &Arc<Relay>, listener: &TcpListener, kind: Kind) {
    for client in listener.incoming() {
        let Ok(client) = client else {
            thread::sleep(ACCEPT_BACKOFF);
            continue;
        };
        let Some(in_flight) = InFlight::take(&relay.relayed, MAX_RELAYED) else {
            // Over the cap: closed at once.
            continue;
        };
        let _ = client.set_nodelay(true);
        let relay = relay.clone();
        let spawned = thread::Builder::new().stack_size(STACK).spawn(move || {
            let _in_flight = in_flight;
            relay_connection(&relay, client, kind);
        });
        if spawned.is_err() {
            thread::sleep(ACCEPT_BACKOFF);
        }
    }
}

/// Carries one connection both ways; without the proxy it is just closed.
fn relay_connection(relay: &Relay, mut client: TcpStream, kind: Kind) {
    if let Ok(upstream) = relay.open(kind) {
        splice(&mut client, upstream, &[]);
    }
}

fn relay_queries(relay: &Arc<Relay>, udp: &UdpSocket) {
    // One byte more than a query may have, to tell an over-long one from a full one.
    let mut buffer = [0u8; dns::MAX_UDP + 1];
    loop {
        let Ok((len, from)) = udp.recv_from(&mut buffer) else {
            thread::sleep(ACCEPT_BACKOFF);
            continue;
        };
        if len > dns::MAX_UDP {
            continue;
        }
        let Some(in_flight) = InFlight::take(&relay.queries, MAX_QUERIES) else {
            continue;
        };
        let Ok(reply_to) = udp.try_clone() else {
            thread::sleep(ACCEPT_BACKOFF);
            continue;
        };
        let query = buffer[..len].to_vec();
        let relay = relay.clone();
        let spawned = thread::Builder::new().stack_size(STACK).spawn(move || {
            let _in_flight = in_flight;
            if let Ok(answer) = ask(&relay, &query) {
                let _ = reply_to.send_to(&answer, from);
            }
        });
        if spawned.is_err() {
            thread::sleep(ACCEPT_BACKOFF);
        }
    }
}

/// Sends one DNS query to the proxy as a framed message and returns its answer.
fn ask(relay: &Relay, query: &[u8]) -> io::Result<Vec<u8>> {
    let mut stream = relay.open(Kind::Dns)?;
    stream.set_read_timeout(Some(QUERY_TIMEOUT))?;
    stream.set_write_timeout(Some(QUERY_TIMEOUT))?;
    let mut framed = Vec::with_capacity(2 + query.len());
    framed.extend_from_slice(&(query.len() as u16).to_be_bytes());
    framed.extend_from_slice(query);
    stream.write_all(&framed)?;
    let mut length = [0u8; 2];
    stream.read_exact(&mut length)?;
    let length = usize::from(u16::from_be_bytes(length));
    if length > MAX_ANSWER {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "answer too long",
        ));
    }
    let mut answer = vec![0u8; length];
    stream.read_exact(&mut answer)?;
    Ok(answer)
}

/// `egress-relay SOCKET [--resolv-conf]`, the token in [`TOKEN_VARIABLE`]: serves forever, or
/// exits 0 at once when a relay already runs, 2 on bad arguments, 1 when it cannot listen.
pub fn main(args: impl Iterator<Item = String>) -> i32 {
    let usage = || {
        eprintln!(
            "usage: {TOKEN_VARIABLE}=<32 hex digits> kilntainers-helper egress-relay SOCKET [--resolv-conf] [--background]"
        );
        2
    };
    let mut socket_path = None;
    let mut resolv_conf = false;
    let mut background = false;
    for arg in args {
        match arg.as_str() {
            "--resolv-conf" => resolv_conf = true,
            "--background" => background = true,
            _ if arg.starts_with('-') || socket_path.is_some() => return usage(),
            _ => socket_path = Some(PathBuf::from(arg)),
        }
    }
    let Some(socket_path) = socket_path else {
        return usage();
    };
    let token = std::env::var(TOKEN_VARIABLE)
        .ok()
        .and_then(|hex| Token::parse(&hex.trim().to_ascii_lowercase()));
    let Some(token) = token else {
        eprintln!("egress-relay: {TOKEN_VARIABLE} must hold the computer's token, 32 hex digits");
        return 2;
    };
    if background {
        return in_background(&socket_path, resolv_conf);
    }
    let relay = Relay::new(socket_path, token);
    match run(&relay, &default_ports(), resolv_conf) {
        Some(code) => code,
        None => loop {
            thread::park();
        },
    }
}

/// Starts the relay; `None` while it serves (on its own threads), else the exit status.
pub(super) fn run(relay: &Arc<Relay>, ports: &Ports, resolv_conf: bool) -> Option<i32> {
    match start(relay, ports) {
        Ok(Started::AlreadyRunning) => {
            eprintln!("egress-relay: already running");
            Some(0)
        }
        Ok(Started::Serving) => {
            if resolv_conf && let Err(e) = std::fs::write("/etc/resolv.conf", RESOLV_CONF) {
                eprintln!("egress-relay: warning: cannot write /etc/resolv.conf: {e}");
            }
            None
        }
        Err(e) => {
            eprintln!("egress-relay: cannot listen: {e}");
            Some(1)
        }
    }
}

/// How long `--background` waits for the relay it started to listen.
const BACKGROUND_START: Duration = Duration::from_secs(10);

/// `--background`: starts this relay again in the foreground as a child with no standard
/// streams (so the engine's exec that ran this ends with it), and returns once the child
/// listens on the proxy port, or with the child's status when it ends first (0 when a relay
/// runs already). The token goes to the child in the environment it inherits.
fn in_background(socket_path: &std::path::Path, resolv_conf: bool) -> i32 {
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => {
            eprintln!("egress-relay: cannot find its own binary: {e}");
            return 1;
        }
    };
    let mut command = std::process::Command::new(exe);
    command.arg("egress-relay").arg(socket_path);
    if resolv_conf {
        command.arg("--resolv-conf");
    }
    command
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let mut child = match command.spawn() {
        Ok(child) => child,
        Err(e) => {
            eprintln!("egress-relay: cannot start: {e}");
            return 1;
        }
    };
    let proxy_port = SocketAddr::new(IpAddr::V4(RELAY_ADDRESS), default_ports().proxy);
    let deadline = std::time::Instant::now() + BACKGROUND_START;
    while std::time::Instant::now() < deadline {
        match child.try_wait() {
            Ok(Some(status)) => return status.code().unwrap_or(1),
            Ok(None) => {}
            Err(e) => {
                eprintln!("egress-relay: cannot watch the relay it started: {e}");
                return 1;
            }
        }
        if TcpStream::connect_timeout(&proxy_port, Duration::from_millis(200)).is_ok() {
            return 0;
        }
        thread::sleep(Duration::from_millis(10));
    }
    eprintln!(
        "egress-relay: not listening after {} s",
        BACKGROUND_START.as_secs()
    );
    1
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused() -> io::Error {
        io::Error::from(io::ErrorKind::ConnectionRefused)
    }

    #[test]
    fn a_refused_connect_is_tried_again_and_other_errors_are_not() {
        // Refused three times (a full backlog), then accepted.
        let mut calls = 0;
        let connected = patiently(Duration::from_secs(10), || {
            calls += 1;
            if calls <= 3 {
                Err(refused())
            } else {
                Ok(calls)
            }
        });
        assert_eq!(connected.unwrap(), 4);

        // No socket file at all is no reason to wait.
        let mut calls = 0;
        let missing = patiently(Duration::from_secs(10), || -> io::Result<()> {
            calls += 1;
            Err(io::Error::from(io::ErrorKind::NotFound))
        });
        assert_eq!(missing.unwrap_err().kind(), io::ErrorKind::NotFound);
        assert_eq!(calls, 1);

        // Refused for good: given up once the patience is spent, with the refusal.
        let mut calls = 0;
        let given_up = patiently(Duration::from_millis(50), || -> io::Result<()> {
            calls += 1;
            Err(refused())
        });
        assert_eq!(
            given_up.unwrap_err().kind(),
            io::ErrorKind::ConnectionRefused
        );
        assert!(calls > 1, "tried {calls} times");
    }
}
