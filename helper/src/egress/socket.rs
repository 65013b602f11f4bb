//! The proxy's Unix-socket entrance, for the socket wiring (docs/egress.md): a computer with no
//! network reaches the proxy through a relay inside it ([`super::relay`]) and a Unix socket on
//! a volume shared with the proxy. The socket carries no source address, so each connection
//! opens with an identification line, `<token> <kind>\n`: the 32-hex-digit token the server
//! registered for the computer (`token <key> <hex>` on the control channel) and which of the
//! proxy's entrances the connection stands for (`dns`, `http`, `tls`, `proxy`). After it the
//! connection is served by the same code as a TCP one, with the computer's policy key as its
//! source, and holds the same [`Slot`](super::Slot).
//!
//! Bounded against a hostile computer: the line is at most [`MAX_IDENTIFICATION`] bytes within
//! [`IDENTIFY_TIMEOUT`]; at most [`MAX_UNIDENTIFIED`] connections wait for theirs, and a new one
//! over that shuts the oldest silent one down (one whose line is already in its socket is
//! passed over), so silent connections cannot lock out the neighbours' relays (which identify
//! in their first write). A connection that fails to identify is closed with nothing written
//! and reported on stderr, at most [`MAX_COMPLAINTS_PER_MINUTE`] lines a minute.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Shutdown};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use crate::sys;

use super::{
    ACCEPT_BACKOFF, Listener, STACK, Slot, State, dns, dns_reply, handle, lock, read_head,
};

/// Longest identification line, newline included.
pub const MAX_IDENTIFICATION: usize = 64;
/// Time a connection has to identify itself.
pub const IDENTIFY_TIMEOUT: Duration = Duration::from_secs(2);
/// Connections waiting to identify, all computers together.
pub const MAX_UNIDENTIFIED: usize = 128;
/// A `dns` connection with no byte for this long is closed.
pub const DNS_IDLE_TIMEOUT: Duration = Duration::from_secs(10);
/// Lines on stderr about connections that failed to identify, per minute; the rest are
/// counted and their number said with the next line printed.
pub const MAX_COMPLAINTS_PER_MINUTE: u32 = 10;
/// Where the relay listens inside the computer, and so what an allowed name resolves to.
pub const RELAY_ADDRESS: Ipv4Addr = Ipv4Addr::LOCALHOST;

/// A computer's token: 16 random bytes, written as 32 lowercase hex digits.
#[derive(Clone, PartialEq, Eq)]
pub struct Token([u8; 16]);

impl Token {
    /// Reads exactly 32 lowercase hex digits.
    pub fn parse(hex: &str) -> Option<Self> {
        let digits = hex.as_bytes();
        if digits.len() != 32 {
            return None;
        }
        let value = |digit: u8| match digit {
            b'0'..=b'9' => Some(digit - b'0'),
            b'a'..=b'f' => Some(digit - b'a' + 10),
            _ => None,
        };
        let mut bytes = [0u8; 16];
        for (byte, pair) in bytes.iter_mut().zip(digits.chunks_exact(2)) {
            *byte = (value(pair[0])? << 4) | value(pair[1])?;
        }
        Some(Self(bytes))
    }

    /// Compares in constant time: every byte is looked at whatever the first difference.
    pub fn matches(&self, other: &Self) -> bool {
        let difference = self
            .0
            .iter()
            .zip(other.0.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        std::hint::black_box(difference) == 0
    }
}

impl std::fmt::Display for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.iter().try_for_each(|byte| write!(f, "{byte:02x}"))
    }
}

/// Never printed: a token in a log would let a reader of the log speak for the computer.
impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(…)")
    }
}

/// Which of the proxy's entrances a connection on the socket stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// DNS over TCP framing (RFC 1035 §4.2.2), any number of messages.
    Dns,
    /// Port 80: origin-form requests routed by `Host`.
    Http,
    /// Port 443: routed by the TLS SNI.
    Tls,
    /// Port 3128: `CONNECT` and absolute-form requests.
    Proxy,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Self::Dns => "dns",
            Self::Http => "http",
            Self::Tls => "tls",
            Self::Proxy => "proxy",
        }
    }

    fn parse(word: &str) -> Option<Self> {
        [Self::Dns, Self::Http, Self::Tls, Self::Proxy]
            .into_iter()
            .find(|kind| kind.as_str() == word)
    }
}

/// The line a relay opens each connection with.
pub fn identification_line(token: &Token, kind: Kind) -> String {
    format!("{token} {}\n", kind.as_str())
}

/// Reads an identification line (without its newline).
pub fn parse_identification(line: &[u8]) -> Option<(Token, Kind)> {
    let text = std::str::from_utf8(line).ok()?;
    let (token, kind) = text.split_once(' ')?;
    Some((Token::parse(token)?, Kind::parse(kind)?))
}

/// Listens on a Unix socket at `path` (a stale file there is removed first), open to every
/// uid, and serves it on a thread of its own until the process ends.
pub fn listen(state: Arc<State>, path: &Path) -> io::Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let listener = UnixListener::bind(path)?;
    // The computers' processes run as any uid; the token, not the file mode, says who is who.
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))?;
    thread::spawn(move || accept_loop(&state, &listener));
    Ok(())
}

/// Connections waiting for their identification line, oldest first, with a clone of each to
/// shut it down when it has to make room.
#[derive(Default)]
struct Unidentified {
    next: u64,
    waiting: VecDeque<(u64, UnixStream)>,
}

impl Unidentified {
    /// Adds `stream`, shutting down the oldest waiting one when full; `None` if it cannot be
    /// cloned (it is then closed unread).
    fn add(&mut self, stream: &UnixStream) -> Option<u64> {
        let clone = stream.try_clone().ok()?;
        if self.waiting.len() >= MAX_UNIDENTIFIED {
            // The oldest that is still silent makes room. One whose line is in its socket
            // already is passed over: its thread is about to take it out, but under a flood of
            // connections that thread may not have run yet, and shutting it down would cut off
            // a neighbour's relay that did nothing wrong. When every one has its line, the
            // oldest goes anyway, so the cap holds.
            let victim = self
                .waiting
                .iter()
                .position(|(_, waiting)| !line_arrived(waiting))
                .unwrap_or(0);
            if let Some((_, oldest)) = self.waiting.remove(victim) {
                complain("a connection that had not identified was shut down to make room");
                let _ = oldest.shutdown(Shutdown::Both);
            }
        }
        self.next += 1;
        self.waiting.push_back((self.next, clone));
        Some(self.next)
    }

    /// Takes `id` out; `false` if it was shut down to make room meanwhile.
    fn remove(&mut self, id: u64) -> bool {
        let before = self.waiting.len();
        self.waiting.retain(|(waiting, _)| *waiting != id);
        self.waiting.len() != before
    }
}

/// Whether a whole identification line (or as much as one may be) waits unread in `stream`.
fn line_arrived(stream: &UnixStream) -> bool {
    let mut buffer = [0u8; MAX_IDENTIFICATION];
    match sys::peek_now(stream, &mut buffer) {
        Ok(n) => n == MAX_IDENTIFICATION || buffer[..n].contains(&b'\n'),
        Err(_) => false,
    }
}

fn accept_loop(state: &Arc<State>, listener: &UnixListener) {
    let unidentified = Arc::new(Mutex::new(Unidentified::default()));
    for stream in listener.incoming() {
        let Ok(stream) = stream else {
            thread::sleep(ACCEPT_BACKOFF);
            continue;
        };
        // A relay writes its line as it connects, so under a flood of connections its line is
        // there by the time it is accepted: such a connection never waits among the
        // unidentified, and no silent neighbour can make room by shutting it down.
        let early = already_sent(&stream);
        let pending = if early.contains(&b'\n') {
            None
        } else {
            match lock(&unidentified).add(&stream) {
                Some(id) => Some(id),
                None => continue,
            }
        };
        let state = state.clone();
        let waiting = unidentified.clone();
        let spawned = thread::Builder::new()
            .stack_size(STACK)
            .spawn(move || serve(&state, stream, early, &waiting, pending));
        if spawned.is_err() {
            if let Some(id) = pending {
                lock(&unidentified).remove(id);
            }
            thread::sleep(ACCEPT_BACKOFF);
        }
    }
}

/// What a just-accepted connection has sent already, without waiting (at most
/// [`MAX_IDENTIFICATION`] bytes).
fn already_sent(stream: &UnixStream) -> Vec<u8> {
    let mut buffer = vec![0u8; MAX_IDENTIFICATION];
    let mut reader = stream;
    let read = stream
        .set_nonblocking(true)
        .and_then(|()| reader.read(&mut buffer));
    let restored = stream.set_nonblocking(false);
    match (read, restored) {
        (Ok(n), Ok(())) => {
            buffer.truncate(n);
            buffer
        }
        _ => Vec::new(),
    }
}

/// One connection on the socket: its identification (`early` = what it had sent when it was
/// accepted), then the entrance it names. `pending`: its place among the unidentified.
fn serve(
    state: &Arc<State>,
    mut stream: UnixStream,
    early: Vec<u8>,
    waiting: &Mutex<Unidentified>,
    pending: Option<u64>,
) {
    let identified = identify(&mut stream, early);
    if let Some(id) = pending
        && !lock(waiting).remove(id)
    {
        // Shut down to make room, and said so then.
        return;
    }
    let identified = identified.and_then(|(token, kind, already)| {
        let source = state
            .source_of(&token)
            .ok_or("a connection with an unknown token was closed")?;
        Ok((source, kind, already))
    });
    let (source, kind, already) = match identified {
        Ok(identified) => identified,
        Err(why) => {
            complain(why);
            let _ = stream.shutdown(Shutdown::Both);
            return;
        }
    };
    let Some(_slot) = Slot::take(state, source) else {
        // Over the cap: closed at once, as on TCP.
        let _ = stream.shutdown(Shutdown::Both);
        return;
    };
    match kind {
        Kind::Dns => answer_dns(state, stream, source, already),
        Kind::Http => handle(state, stream, source, Listener::Http, already),
        Kind::Tls => handle(state, stream, source, Listener::Tls, already),
        Kind::Proxy => handle(state, stream, source, Listener::Proxy, already),
    }
}

/// Reads the identification line; returns what it says and the bytes read after it, or why
/// the connection is refused.
fn identify(
    stream: &mut UnixStream,
    early: Vec<u8>,
) -> Result<(Token, Kind, Vec<u8>), &'static str> {
    let data = read_head(stream, early, MAX_IDENTIFICATION, IDENTIFY_TIMEOUT, |d| {
        d.contains(&b'\n')
    })
    .map_err(|_| "a connection sent no identification in time")?;
    data.iter()
        .position(|b| *b == b'\n')
        .and_then(|end| {
            let (token, kind) = parse_identification(&data[..end])?;
            Some((token, kind, data[end + 1..].to_vec()))
        })
        .ok_or("a connection sent a malformed identification, or none")
}

/// DNS over TCP framing: each message answered as [`dns_reply`] answers a UDP one, an
/// allowed name resolving to the relay's [`RELAY_ADDRESS`]. A message over [`dns::MAX_UDP`]
/// or [`DNS_IDLE_TIMEOUT`] without a byte ends the connection.
fn answer_dns(state: &State, mut stream: UnixStream, source: IpAddr, mut buffer: Vec<u8>) {
    if stream.set_read_timeout(Some(DNS_IDLE_TIMEOUT)).is_err() {
        return;
    }
    let relay = Some(IpAddr::V4(RELAY_ADDRESS));
    loop {
        if !fill(&mut stream, &mut buffer, 2) {
            break;
        }
        let len = usize::from(u16::from_be_bytes([buffer[0], buffer[1]]));
        if len > dns::MAX_UDP || !fill(&mut stream, &mut buffer, 2 + len) {
            break;
        }
        let reply = dns_reply(state, source, &buffer[2..2 + len], relay);
        buffer.drain(..2 + len);
        if let Some(reply) = reply {
            let mut framed = Vec::with_capacity(2 + reply.len());
            framed.extend_from_slice(&(reply.len() as u16).to_be_bytes());
            framed.extend_from_slice(&reply);
            if stream.write_all(&framed).is_err() {
                break;
            }
        }
    }
    let _ = stream.shutdown(Shutdown::Both);
}

/// Reads until `buffer` holds at least `want` bytes, reading no more than that; `false` at the
/// end of the stream, a timeout or an error.
fn fill(stream: &mut UnixStream, buffer: &mut Vec<u8>, want: usize) -> bool {
    let mut chunk = [0u8; dns::MAX_UDP + 2];
    while buffer.len() < want {
        let room = (want - buffer.len()).min(chunk.len());
        match stream.read(&mut chunk[..room]) {
            Ok(0) | Err(_) => return false,
            Ok(n) => buffer.extend_from_slice(&chunk[..n]),
        }
    }
    true
}

struct Complaints {
    window: Option<Instant>,
    printed: u32,
    suppressed: u64,
}

static COMPLAINTS: Mutex<Complaints> = Mutex::new(Complaints {
    window: None,
    printed: 0,
    suppressed: 0,
});

/// Says on stderr why a connection was closed unserved, within [`MAX_COMPLAINTS_PER_MINUTE`]:
/// a computer opening thousands of bad connections must not flood the server's log.
fn complain(why: &str) {
    let mut complaints = lock(&COMPLAINTS);
    let now = Instant::now();
    if complaints
        .window
        .is_none_or(|start| now.duration_since(start) >= Duration::from_secs(60))
    {
        complaints.window = Some(now);
        complaints.printed = 0;
    }
    if complaints.printed >= MAX_COMPLAINTS_PER_MINUTE {
        complaints.suppressed += 1;
        return;
    }
    complaints.printed += 1;
    let suppressed = std::mem::take(&mut complaints.suppressed);
    drop(complaints);
    if suppressed == 0 {
        eprintln!("kilntainers-helper egress-proxy: {why}");
    } else {
        eprintln!("kilntainers-helper egress-proxy: {why} ({suppressed} more not shown)");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identification_lines_round_trip_and_are_read_strictly() {
        let token = Token::parse("0123456789abcdef0123456789abcdef").unwrap();
        let line = identification_line(&token, Kind::Proxy);
        assert_eq!(line, "0123456789abcdef0123456789abcdef proxy\n");
        let (read, kind) = parse_identification(line.trim_end().as_bytes()).unwrap();
        assert!(read.matches(&token));
        assert_eq!(kind, Kind::Proxy);
        assert!(!read.matches(&Token::parse(&"0".repeat(32)).unwrap()));
        assert_eq!(format!("{token:?}"), "Token(…)");
        for bad in [
            "0123456789abcdef0123456789abcdef",
            "0123456789abcdef0123456789abcdef ",
            "0123456789abcdef0123456789abcdef ssh",
            "0123456789abcdef0123456789abcdef  dns",
            "0123456789ABCDEF0123456789abcdef dns",
            "0123456789abcdef0123456789abcde dns",
            " dns",
            "",
        ] {
            assert!(parse_identification(bad.as_bytes()).is_none(), "{bad:?}");
        }
        assert!(parse_identification(b"\xff\xfe dns").is_none());
    }

    #[test]
    fn a_new_connection_over_the_cap_shuts_the_oldest_waiting_one_down() {
        let mut waiting = Unidentified::default();
        let (ids, mut peers) = fill(&mut waiting, None);
        let (ours, _theirs) = UnixStream::pair().unwrap();
        let newest = waiting.add(&ours).unwrap();
        // The oldest sees its end at once; the second oldest is untouched.
        let mut byte = [0u8; 1];
        assert_eq!(peers[0].read(&mut byte).unwrap(), 0);
        peers[1].set_nonblocking(true).unwrap();
        assert_eq!(
            peers[1].read(&mut byte).unwrap_err().kind(),
            io::ErrorKind::WouldBlock
        );
        assert!(!waiting.remove(ids[0]), "the oldest was shut down");
        assert!(waiting.remove(ids[1]));
        assert!(waiting.remove(newest));
        assert_eq!(waiting.waiting.len(), MAX_UNIDENTIFIED - 2);
    }

    #[test]
    fn a_waiting_connection_whose_line_has_arrived_is_not_shut_down_to_make_room() {
        let mut waiting = Unidentified::default();
        let (ids, mut peers) = fill(&mut waiting, None);
        // The oldest has sent its line; its thread has not read it yet.
        let token = Token::parse("0123456789abcdef0123456789abcdef").unwrap();
        peers[0]
            .write_all(identification_line(&token, Kind::Http).as_bytes())
            .unwrap();
        let (ours, _theirs) = UnixStream::pair().unwrap();
        let newest = waiting.add(&ours).unwrap();
        // The second oldest, still silent, made room instead.
        let mut byte = [0u8; 1];
        assert_eq!(peers[1].read(&mut byte).unwrap(), 0);
        assert!(waiting.remove(ids[0]), "the one with its line stays");
        assert!(
            !waiting.remove(ids[1]),
            "the oldest silent one was shut down"
        );
        assert!(waiting.remove(newest));

        // When every one waiting has its line, the oldest goes all the same: the cap holds.
        let mut full = Unidentified::default();
        let line = identification_line(&token, Kind::Dns);
        let (ids, _peers) = fill(&mut full, Some(line.as_bytes()));
        let (ours, _theirs) = UnixStream::pair().unwrap();
        full.add(&ours).unwrap();
        assert_eq!(full.waiting.len(), MAX_UNIDENTIFIED);
        assert!(!full.remove(ids[0]));
    }

    /// Fills `waiting` to the cap; each peer has sent `line` when given. Returns the ids and
    /// the peers' ends, oldest first.
    fn fill(waiting: &mut Unidentified, line: Option<&[u8]>) -> (Vec<u64>, Vec<UnixStream>) {
        (0..MAX_UNIDENTIFIED)
            .map(|_| {
                let (ours, mut theirs) = UnixStream::pair().unwrap();
                if let Some(line) = line {
                    theirs.write_all(line).unwrap();
                }
                (waiting.add(&ours).unwrap(), theirs)
            })
            .unzip()
    }
}
