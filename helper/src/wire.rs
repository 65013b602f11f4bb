//! The framed protocol between the server and the helper, over the helper's stdin (server →
//! helper, [`Request`]) and stdout (helper → server, [`Event`]).
//!
//! A frame is a 4-byte big-endian payload length, then the payload: one tag byte and the
//! message's fields. Integers are big-endian; byte strings and strings are a `u32` length and
//! the bytes; an optional string is a presence byte and the string; a list is a `u32` count and
//! the items. Commands are told apart by a `u32` id the server picks, so many run at once over
//! one stream.
//!
//! Flow control is by credit: the helper sends a command's output only while that command has
//! credit left ([`WINDOW`] to start with) and the server returns credit as it consumes output.
//! A command whose output is not being read blocks on its own pipe, as it would under Docker
//! exec, and cannot crowd out the others.

use std::fmt;

/// Bumped on any incompatible change; the helper's file name carries a hash of its bytes, so a
/// server never talks to a helper built from other sources.
pub const PROTOCOL_VERSION: u32 = 1;
/// Largest payload either side accepts. A `Start` carries the whole command string, which the
/// kernel limits to a few MiB anyway.
pub const MAX_PAYLOAD: usize = 8 * 1024 * 1024;
/// Largest output or stdin chunk put in one frame.
pub const CHUNK: usize = 64 * 1024;
/// Output credit a command starts with, in bytes (stdout and stderr together).
pub const WINDOW: u32 = 1024 * 1024;
/// Largest event payload the server accepts: an `Output` frame (tag, id, length prefix) around
/// one [`CHUNK`], with room to spare. No event is larger, so a longer frame is a protocol
/// violation, refused before its bytes are buffered.
pub const MAX_EVENT_PAYLOAD: usize = CHUNK + 64;

/// Server → helper.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// First message on a connection; the helper answers [`Event::Hello`].
    Hello {
        version: u32,
    },
    Start(Start),
    /// Bytes for a command's stdin (only after a `Start` with `stdin: true`).
    Stdin {
        id: u32,
        data: Vec<u8>,
    },
    /// End of a command's stdin: the helper closes the pipe.
    CloseStdin {
        id: u32,
    },
    /// The server consumed `bytes` of this command's output.
    Credit {
        id: u32,
        bytes: u32,
    },
    /// Kill every process of every command started with `tag` in its environment, then the
    /// stragglers found by `tag` under /proc; answered by [`Event::Killed`] with this `id`
    /// (a fresh id, not a command's).
    Kill {
        id: u32,
        tag: String,
    },
    Ping {
        id: u32,
    },
}

/// One command to start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Start {
    pub id: u32,
    pub argv: Vec<String>,
    pub working_dir: Option<String>,
    /// `NAME=value` entries added to the helper's own environment (the container's).
    pub env: Vec<String>,
    /// Whether [`Request::Stdin`] frames follow; without it the command's stdin is /dev/null.
    pub stdin: bool,
}

/// Helper → server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Hello {
        version: u32,
        pid: u32,
    },
    Output {
        id: u32,
        stream: OutputStream,
        data: Vec<u8>,
    },
    /// The command ended: its exit status, or 128 + signal. A command that could not start
    /// ends the way Docker exec reports it: the runtime's message on stdout, then code 126.
    Exited {
        id: u32,
        code: i64,
    },
    Killed {
        id: u32,
    },
    Pong {
        id: u32,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputStream {
    Stdout,
    Stderr,
}

/// A frame that does not follow this protocol. The connection cannot be trusted after it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WireError(pub String);

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "helper protocol error: {}", self.0)
    }
}

impl std::error::Error for WireError {}

mod tag {
    pub const HELLO: u8 = 1;
    pub const START: u8 = 2;
    pub const STDIN: u8 = 3;
    pub const CLOSE_STDIN: u8 = 4;
    pub const CREDIT: u8 = 5;
    pub const KILL: u8 = 6;
    pub const PING: u8 = 7;

    pub const EV_HELLO: u8 = 101;
    pub const EV_STDOUT: u8 = 102;
    pub const EV_STDERR: u8 = 103;
    pub const EV_EXITED: u8 = 104;
    pub const EV_KILLED: u8 = 105;
    pub const EV_PONG: u8 = 106;
}

/// Appends one frame: reserves the length prefix, lets `body` write the payload, patches the
/// length in.
fn frame(out: &mut Vec<u8>, tag: u8, body: impl FnOnce(&mut Vec<u8>)) {
    let start = out.len();
    out.extend_from_slice(&[0; 4]);
    out.push(tag);
    body(out);
    let len = (out.len() - start - 4) as u32;
    out[start..start + 4].copy_from_slice(&len.to_be_bytes());
}

fn put_u32(out: &mut Vec<u8>, value: u32) {
    out.extend_from_slice(&value.to_be_bytes());
}

fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    put_u32(out, bytes.len() as u32);
    out.extend_from_slice(bytes);
}

impl Request {
    pub fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Request::Hello { version } => frame(out, tag::HELLO, |o| put_u32(o, *version)),
            Request::Start(start) => frame(out, tag::START, |o| {
                put_u32(o, start.id);
                put_u32(o, start.argv.len() as u32);
                for arg in &start.argv {
                    put_bytes(o, arg.as_bytes());
                }
                match &start.working_dir {
                    Some(dir) => {
                        o.push(1);
                        put_bytes(o, dir.as_bytes());
                    }
                    None => o.push(0),
                }
                put_u32(o, start.env.len() as u32);
                for entry in &start.env {
                    put_bytes(o, entry.as_bytes());
                }
                o.push(u8::from(start.stdin));
            }),
            Request::Stdin { id, data } => frame(out, tag::STDIN, |o| {
                put_u32(o, *id);
                put_bytes(o, data);
            }),
            Request::CloseStdin { id } => frame(out, tag::CLOSE_STDIN, |o| put_u32(o, *id)),
            Request::Credit { id, bytes } => frame(out, tag::CREDIT, |o| {
                put_u32(o, *id);
                put_u32(o, *bytes);
            }),
            Request::Kill { id, tag: exec_tag } => frame(out, tag::KILL, |o| {
                put_u32(o, *id);
                put_bytes(o, exec_tag.as_bytes());
            }),
            Request::Ping { id } => frame(out, tag::PING, |o| put_u32(o, *id)),
        }
    }

    pub fn decode(payload: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(payload)?;
        let request = match r.tag {
            tag::HELLO => Request::Hello { version: r.u32()? },
            tag::START => {
                let id = r.u32()?;
                let argv = r.list(Reader::string)?;
                let working_dir = match r.u8()? {
                    0 => None,
                    _ => Some(r.string()?),
                };
                let env = r.list(Reader::string)?;
                let stdin = r.u8()? != 0;
                Request::Start(Start {
                    id,
                    argv,
                    working_dir,
                    env,
                    stdin,
                })
            }
            tag::STDIN => Request::Stdin {
                id: r.u32()?,
                data: r.bytes()?.to_vec(),
            },
            tag::CLOSE_STDIN => Request::CloseStdin { id: r.u32()? },
            tag::CREDIT => Request::Credit {
                id: r.u32()?,
                bytes: r.u32()?,
            },
            tag::KILL => Request::Kill {
                id: r.u32()?,
                tag: r.string()?,
            },
            tag::PING => Request::Ping { id: r.u32()? },
            other => return Err(WireError(format!("unknown request tag {other}"))),
        };
        r.finish()?;
        Ok(request)
    }
}

impl Event {
    pub fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Event::Hello { version, pid } => frame(out, tag::EV_HELLO, |o| {
                put_u32(o, *version);
                put_u32(o, *pid);
            }),
            Event::Output { id, stream, data } => {
                let t = match stream {
                    OutputStream::Stdout => tag::EV_STDOUT,
                    OutputStream::Stderr => tag::EV_STDERR,
                };
                frame(out, t, |o| {
                    put_u32(o, *id);
                    put_bytes(o, data);
                });
            }
            Event::Exited { id, code } => frame(out, tag::EV_EXITED, |o| {
                put_u32(o, *id);
                o.extend_from_slice(&code.to_be_bytes());
            }),
            Event::Killed { id } => frame(out, tag::EV_KILLED, |o| put_u32(o, *id)),
            Event::Pong { id } => frame(out, tag::EV_PONG, |o| put_u32(o, *id)),
        }
    }

    pub fn decode(payload: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(payload)?;
        let event = match r.tag {
            tag::EV_HELLO => Event::Hello {
                version: r.u32()?,
                pid: r.u32()?,
            },
            tag::EV_STDOUT | tag::EV_STDERR => Event::Output {
                stream: if r.tag == tag::EV_STDOUT {
                    OutputStream::Stdout
                } else {
                    OutputStream::Stderr
                },
                id: r.u32()?,
                data: r.bytes()?.to_vec(),
            },
            tag::EV_EXITED => Event::Exited {
                id: r.u32()?,
                code: r.i64()?,
            },
            tag::EV_KILLED => Event::Killed { id: r.u32()? },
            tag::EV_PONG => Event::Pong { id: r.u32()? },
            other => return Err(WireError(format!("unknown event tag {other}"))),
        };
        r.finish()?;
        Ok(event)
    }
}

/// Splits complete frames off the front of a byte buffer that grows as data arrives.
#[derive(Debug)]
pub struct FrameBuffer {
    buf: Vec<u8>,
    /// Bytes of `buf` already handed out; compacted lazily.
    consumed: usize,
    /// Largest payload accepted; a longer length prefix is an error before anything is kept.
    limit: usize,
}

impl Default for FrameBuffer {
    fn default() -> Self {
        Self::with_limit(MAX_PAYLOAD)
    }
}

impl FrameBuffer {
    /// A buffer that refuses payloads longer than `limit` (at most [`MAX_PAYLOAD`]).
    pub fn with_limit(limit: usize) -> Self {
        Self {
            buf: Vec::new(),
            consumed: 0,
            limit: limit.min(MAX_PAYLOAD),
        }
    }

    pub fn extend(&mut self, bytes: &[u8]) {
        if self.consumed > 0 && self.consumed == self.buf.len() {
            self.buf.clear();
            self.consumed = 0;
        }
        self.buf.extend_from_slice(bytes);
    }

    /// The next complete payload, if one has fully arrived.
    pub fn next_payload(&mut self) -> Result<Option<Vec<u8>>, WireError> {
        let pending = &self.buf[self.consumed..];
        let Some(len) = pending.get(..4) else {
            return Ok(None);
        };
        let len = u32::from_be_bytes([len[0], len[1], len[2], len[3]]) as usize;
        check_len(len, self.limit)?;
        let Some(payload) = pending.get(4..4 + len) else {
            return Ok(None);
        };
        let payload = payload.to_vec();
        self.consumed += 4 + len;
        if self.consumed > 64 * 1024 {
            self.buf.drain(..self.consumed);
            self.consumed = 0;
        }
        Ok(Some(payload))
    }

    /// Bytes received that are not yet part of a complete frame.
    pub fn pending(&self) -> usize {
        self.buf.len() - self.consumed
    }
}

/// Reads one payload from a blocking reader: `Ok(None)` on a clean end between frames.
pub fn read_payload(reader: &mut impl std::io::Read) -> Result<Option<Vec<u8>>, WireError> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match reader.read(&mut len[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(WireError("stream ended inside a frame header".into())),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(WireError(format!("read failed: {e}"))),
        }
    }
    let len = u32::from_be_bytes(len) as usize;
    check_len(len, MAX_PAYLOAD)?;
    let mut payload = vec![0; len];
    reader
        .read_exact(&mut payload)
        .map_err(|e| WireError(format!("stream ended inside a frame: {e}")))?;
    Ok(Some(payload))
}

fn check_len(len: usize, limit: usize) -> Result<(), WireError> {
    if len == 0 || len > limit {
        return Err(WireError(format!("frame length {len} out of range")));
    }
    Ok(())
}

/// Field reader over one payload; every read is bounds-checked.
struct Reader<'a> {
    tag: u8,
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    fn new(payload: &'a [u8]) -> Result<Self, WireError> {
        match payload.split_first() {
            Some((tag, rest)) => Ok(Self { tag: *tag, rest }),
            None => Err(WireError("empty frame".into())),
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if self.rest.len() < n {
            return Err(WireError(format!(
                "frame with tag {} is truncated",
                self.tag
            )));
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32, WireError> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn i64(&mut self) -> Result<i64, WireError> {
        let mut b = [0u8; 8];
        b.copy_from_slice(self.take(8)?);
        Ok(i64::from_be_bytes(b))
    }

    fn bytes(&mut self) -> Result<&'a [u8], WireError> {
        let len = self.u32()? as usize;
        self.take(len)
    }

    fn string(&mut self) -> Result<String, WireError> {
        String::from_utf8(self.bytes()?.to_vec()).map_err(|_| {
            WireError(format!(
                "frame with tag {} has a non-UTF-8 string",
                self.tag
            ))
        })
    }

    fn list<T>(
        &mut self,
        item: fn(&mut Self) -> Result<T, WireError>,
    ) -> Result<Vec<T>, WireError> {
        let count = self.u32()? as usize;
        // Each item takes at least 4 bytes, which bounds a hostile count.
        if count > self.rest.len() / 4 {
            return Err(WireError(format!(
                "frame with tag {} has a bad list length",
                self.tag
            )));
        }
        (0..count).map(|_| item(self)).collect()
    }

    fn finish(self) -> Result<(), WireError> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(WireError(format!(
                "frame with tag {} has trailing bytes",
                self.tag
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip_request(request: Request) {
        let mut out = Vec::new();
        request.encode(&mut out);
        let mut buffer = FrameBuffer::default();
        // Byte by byte: frames must come out whole however the stream is split.
        let mut decoded = Vec::new();
        for byte in &out {
            buffer.extend(std::slice::from_ref(byte));
            while let Some(payload) = buffer.next_payload().unwrap() {
                decoded.push(Request::decode(&payload).unwrap());
            }
        }
        assert_eq!(decoded, vec![request]);
        assert_eq!(buffer.pending(), 0);
    }

    #[test]
    fn requests_round_trip() {
        round_trip_request(Request::Hello { version: 7 });
        round_trip_request(Request::Start(Start {
            id: 3,
            argv: vec!["/bin/sh".into(), "-c".into(), "echo 'ü' | cat".into()],
            working_dir: Some("/var/tmp".into()),
            env: vec!["KILNTAINERS_EXEC_ID=x".into()],
            stdin: true,
        }));
        round_trip_request(Request::Start(Start {
            id: 4,
            argv: vec![],
            working_dir: None,
            env: vec![],
            stdin: false,
        }));
        round_trip_request(Request::Stdin {
            id: 3,
            data: (0..=255).collect(),
        });
        round_trip_request(Request::CloseStdin { id: 3 });
        round_trip_request(Request::Credit {
            id: 3,
            bytes: 65536,
        });
        round_trip_request(Request::Kill {
            id: 9,
            tag: "KILNTAINERS_EXEC_ID=y".into(),
        });
        round_trip_request(Request::Ping { id: 1 });
    }

    #[test]
    fn events_round_trip_through_a_blocking_reader() {
        let events = vec![
            Event::Hello {
                version: 1,
                pid: 42,
            },
            Event::Output {
                id: 1,
                stream: OutputStream::Stderr,
                data: b"\0\xff".to_vec(),
            },
            Event::Exited { id: 1, code: -1 },
            Event::Exited { id: 2, code: 137 },
            Event::Killed { id: 5 },
            Event::Pong { id: 6 },
        ];
        let mut out = Vec::new();
        for event in &events {
            event.encode(&mut out);
        }
        let mut reader = out.as_slice();
        let mut decoded = Vec::new();
        while let Some(payload) = read_payload(&mut reader).unwrap() {
            decoded.push(Event::decode(&payload).unwrap());
        }
        assert_eq!(decoded, events);
    }

    #[test]
    fn malformed_frames_are_errors() {
        assert!(Request::decode(&[]).is_err());
        assert!(Request::decode(&[99]).is_err());
        assert!(Request::decode(&[tag::PING, 0, 0]).is_err(), "truncated");
        assert!(
            Request::decode(&[tag::PING, 0, 0, 0, 1, 0]).is_err(),
            "trailing"
        );
        // A list count larger than the frame could hold.
        assert!(Request::decode(&[tag::START, 0, 0, 0, 1, 0xff, 0xff, 0xff, 0xff]).is_err());
        let mut buffer = FrameBuffer::default();
        buffer.extend(&u32::MAX.to_be_bytes());
        assert!(buffer.next_payload().is_err(), "oversized frame");
        // The server's buffer refuses an event longer than an output chunk from its header,
        // before a byte of the payload is kept.
        let mut events = FrameBuffer::with_limit(MAX_EVENT_PAYLOAD);
        events.extend(&((MAX_EVENT_PAYLOAD + 1) as u32).to_be_bytes());
        assert!(events.next_payload().is_err(), "event longer than a chunk");
        let mut largest = Vec::new();
        Event::Output {
            id: u32::MAX,
            stream: OutputStream::Stderr,
            data: vec![0; CHUNK],
        }
        .encode(&mut largest);
        events.buf.clear();
        events.extend(&largest);
        assert!(
            events.next_payload().unwrap().is_some(),
            "a full chunk fits"
        );
        let mut partial: &[u8] = &[0, 0, 0, 5, tag::PING];
        assert!(read_payload(&mut partial).is_err(), "ends inside a frame");
    }
}
