//! `kilntainers-helper connect <port>`: one TCP connection to a port on the computer's own
//! loopback, carried over this process's stdin and stdout (docs/files.md, "Ports"). The server
//! uses it for a computer without a network, and for servers that listen on `127.0.0.1` only,
//! which the container's network address does not reach.
//!
//! Protocol: on success one byte [`CONNECTED`] on stdout, then the connection's bytes; on
//! failure a line on stderr and exit status 1. Stdin's end half-closes the connection; the
//! process exits once the peer has closed its side too.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};

/// The byte that tells the server the connection is open.
pub const CONNECTED: u8 = b'K';

const BUFFER: usize = 32 * 1024;

pub fn connect(port: Option<&str>) -> i32 {
    let Some(port) = port.and_then(|p| p.parse::<u16>().ok()).filter(|p| *p > 0) else {
        eprintln!("usage: kilntainers-helper connect <port 1-65535>");
        return 2;
    };
    let stream = match TcpStream::connect(("127.0.0.1", port))
        .or_else(|first| TcpStream::connect(("::1", port)).map_err(|_| first))
    {
        Ok(stream) => stream,
        Err(error) => {
            eprintln!("port {port}: {error}");
            return 1;
        }
    };
    let mut stdout = io::stdout();
    if stdout
        .write_all(&[CONNECTED])
        .and_then(|()| stdout.flush())
        .is_err()
    {
        return 1;
    }
    let Ok(mut from_peer) = stream.try_clone() else {
        return 1;
    };
    let downstream = std::thread::spawn(move || {
        let _ = pump(&mut from_peer, &mut stdout.lock());
    });
    let mut to_peer = stream;
    let _ = pump(&mut io::stdin().lock(), &mut to_peer);
    let _ = to_peer.shutdown(Shutdown::Write);
    let _ = downstream.join();
    0
}

/// Copies until the reader ends or the writer fails. Each chunk is flushed at once (std's
/// stdout holds bytes back until a newline otherwise).
fn pump(from: &mut impl Read, to: &mut impl Write) -> io::Result<()> {
    let mut buffer = vec![0u8; BUFFER];
    loop {
        let n = match from.read(&mut buffer) {
            Ok(0) => return Ok(()),
            Ok(n) => n,
            Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
            Err(error) => return Err(error),
        };
        to.write_all(&buffer[..n])?;
        to.flush()?;
    }
}
