//! The seam for TLS termination (docs/egress.md, "Secrets brokering in the proxy"): HTTPS to a
//! host one of the computer's secrets is bound to is not spliced but served by a
//! [`Terminator`], which answers the client's ClientHello with a leaf certificate for the host
//! (minted from the CA the server gave, `ca` on the control channel), connects to the host over
//! TLS itself (checking its certificate against Mozilla's roots and the server's extra
//! `roots`), rewrites the first request head with [`TlsJob::rewrite`]
//! ([`super::secrets::rewrite`]) and then copies both ways.
//!
//! TLS needs crates this std-only helper cannot have, so the terminator lives in another
//! binary, the broker (`broker/`), which runs this same proxy through [`super::main_with`] with
//! its terminator installed. The plain helper has none: it splices a bound host's HTTPS as any
//! other (and says `ready`, not `ready tls`).

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::unix::net::UnixStream;

/// The rewrite of a terminated connection's first request head: the head (exactly, ending
/// with its blank line) in, the head to send upstream out; `Err` is the refusal reason, to be
/// answered with a 403 inside TLS.
pub type Rewrite = Box<dyn Fn(&[u8]) -> Result<Vec<u8>, String> + Send + Sync>;

/// A computer's connection: TCP on the computers' network, or a relay's Unix stream in the
/// socket wiring ([`super::socket`]).
#[derive(Debug)]
pub enum ClientStream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl ClientStream {
    /// Puts the stream in non-blocking mode, for an event loop.
    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        match self {
            Self::Tcp(s) => s.set_nonblocking(on),
            Self::Unix(s) => s.set_nonblocking(on),
        }
    }

    pub fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        match self {
            Self::Tcp(s) => s.shutdown(how),
            Self::Unix(s) => s.shutdown(how),
        }
    }
}

impl Read for ClientStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Self::Tcp(s) => s.read(buf),
            Self::Unix(s) => s.read(buf),
        }
    }
}

impl Write for ClientStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Self::Tcp(s) => s.write(buf),
            Self::Unix(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        match self {
            Self::Tcp(s) => s.flush(),
            Self::Unix(s) => s.flush(),
        }
    }
}

/// One connection to terminate.
pub struct TlsJob {
    /// The host the client named (SNI or `CONNECT` target), normalised: a lower-case name, or
    /// an IP address without brackets.
    pub host: String,
    pub port: u16,
    /// The computer's side.
    pub client: ClientStream,
    /// Bytes already read from the client: its ClientHello, to be read again before the
    /// stream.
    pub hello: Vec<u8>,
    /// The upstream connection, connected (the policy allowed it, the address is not
    /// private unless allowed), no byte sent yet.
    pub upstream: TcpStream,
    /// The rewrite of the first request head.
    pub rewrite: Rewrite,
}

impl std::fmt::Debug for TlsJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsJob")
            .field("host", &self.host)
            .field("port", &self.port)
            .finish_non_exhaustive()
    }
}

/// What terminates TLS for bound hosts. Called from the proxy's connection threads (small
/// stacks: heavy work belongs on the terminator's own threads).
pub trait Terminator: Send + Sync {
    /// Serves one connection to its end. `Err(reason)` is a refusal the proxy reports as a
    /// `denied` event (the terminator has answered the client with a 403 inside TLS when it
    /// could): a head [`TlsJob::rewrite`] refused, an upstream certificate not trusted. A
    /// connection that merely ends (either side gone, a client that rejects the leaf
    /// certificate) is `Ok`.
    fn serve(&self, job: TlsJob) -> Result<(), String>;
    /// The CA leaf certificates are minted from (PEM certificate, PEM PKCS#8 key); replaces
    /// an earlier one. `Err` must not quote the key.
    fn set_ca(&self, cert_pem: &str, key_pem: &str) -> Result<(), String>;
    /// Extra upstream trust anchors (a PEM bundle), in addition to Mozilla's; replaces an
    /// earlier bundle.
    fn set_roots(&self, pem: &str) -> Result<(), String>;
}

/// The response a refused request gets, on plain HTTP or inside TLS.
pub fn refusal_response(dest: &str, port: u16, reason: &str) -> Vec<u8> {
    let body = format!("kilntainers: network access to {dest}:{port} was blocked: {reason}\n");
    format!(
        "HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}
