//! The server name of a TLS ClientHello (RFC 8446 §4.1.2, RFC 6066 §3), read from the first
//! bytes a client sends, which the proxy keeps and forwards unchanged once the host is allowed.
//! The hello may span several records; it is read up to [`MAX_HELLO`] bytes and no further.
//! Everything is checked: lengths against what is there, the handshake type, and the one
//! `host_name` entry.

/// Largest ClientHello read (post-quantum key shares make real ones 1.5-2 KiB; 16 KiB is one
/// full record).
pub const MAX_HELLO: usize = 16 * 1024;

/// What the bytes so far say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hello {
    /// More bytes are needed (and may come: under [`MAX_HELLO`]).
    Incomplete,
    /// A complete ClientHello with this server name (as sent, not yet normalised).
    Name(String),
    /// A complete ClientHello without a server name.
    NoName,
    /// Not a TLS ClientHello, or one that breaks the rules.
    Invalid(&'static str),
}

/// Reads the handshake message out of the first records of `data`.
pub fn parse(data: &[u8]) -> Hello {
    let mut handshake = Vec::new();
    let mut at = 0;
    loop {
        let Some(header) = data.get(at..at + 5) else {
            return incomplete(data);
        };
        if header[0] != 22 {
            return Hello::Invalid("not a TLS handshake");
        }
        if header[1] != 3 {
            return Hello::Invalid("not a TLS record version");
        }
        let len = usize::from(u16::from_be_bytes([header[3], header[4]]));
        if len == 0 || len > 16 * 1024 + 256 {
            return Hello::Invalid("bad TLS record length");
        }
        let Some(body) = data.get(at + 5..at + 5 + len) else {
            return incomplete(data);
        };
        handshake.extend_from_slice(body);
        at += 5 + len;
        if handshake.len() >= 4 {
            if handshake[0] != 1 {
                return Hello::Invalid("not a ClientHello");
            }
            let need = 4
                + (usize::from(handshake[1]) << 16
                    | usize::from(handshake[2]) << 8
                    | usize::from(handshake[3]));
            if need > MAX_HELLO {
                return Hello::Invalid("ClientHello too large");
            }
            if handshake.len() >= need {
                return client_hello(&handshake[4..need]);
            }
        }
    }
}

fn incomplete(data: &[u8]) -> Hello {
    if data.len() >= MAX_HELLO + 5 {
        Hello::Invalid("ClientHello too large")
    } else {
        Hello::Incomplete
    }
}

/// A cursor that never reads past its slice.
struct Reader<'a> {
    data: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let out = self.data.get(self.at..self.at.checked_add(n)?)?;
        self.at += n;
        Some(out)
    }
    fn u8(&mut self) -> Option<usize> {
        self.take(1).map(|b| usize::from(b[0]))
    }
    fn u16(&mut self) -> Option<usize> {
        self.take(2)
            .map(|b| usize::from(u16::from_be_bytes([b[0], b[1]])))
    }
    fn done(&self) -> bool {
        self.at == self.data.len()
    }
}

fn client_hello(body: &[u8]) -> Hello {
    let mut r = Reader { data: body, at: 0 };
    let bad = Hello::Invalid("malformed ClientHello");
    // Version, random.
    if r.take(2 + 32).is_none() {
        return bad;
    }
    let Some(session) = r.u8() else { return bad };
    if session > 32 || r.take(session).is_none() {
        return bad;
    }
    let Some(suites) = r.u16() else { return bad };
    if suites == 0 || suites % 2 != 0 || r.take(suites).is_none() {
        return bad;
    }
    let Some(compression) = r.u8() else {
        return bad;
    };
    if compression == 0 || r.take(compression).is_none() {
        return bad;
    }
    if r.done() {
        return Hello::NoName;
    }
    let Some(ext_len) = r.u16() else { return bad };
    let Some(extensions) = r.take(ext_len) else {
        return bad;
    };
    if !r.done() {
        return bad;
    }
    let mut e = Reader {
        data: extensions,
        at: 0,
    };
    let mut name = None;
    while !e.done() {
        let (Some(kind), Some(len)) = (e.u16(), e.u16()) else {
            return bad;
        };
        let Some(data) = e.take(len) else { return bad };
        if kind != 0 {
            continue;
        }
        // Two server_name extensions could tell the proxy and the upstream different names.
        if name.is_some() {
            return Hello::Invalid("two server_name extensions");
        }
        let mut s = Reader { data, at: 0 };
        let Some(list_len) = s.u16() else { return bad };
        if list_len + 2 != data.len() {
            return bad;
        }
        let mut found = None;
        while !s.done() {
            let (Some(name_type), Some(name_len)) = (s.u8(), s.u16()) else {
                return bad;
            };
            let Some(host) = s.take(name_len) else {
                return bad;
            };
            if name_type == 0 {
                if found.is_some() {
                    return Hello::Invalid("two host names in server_name");
                }
                let Ok(host) = std::str::from_utf8(host) else {
                    return Hello::Invalid("server name is not text");
                };
                if host.is_empty() || !host.bytes().all(|b| b.is_ascii_graphic()) {
                    return Hello::Invalid("server name is not a host name");
                }
                found = Some(host.to_owned());
            }
        }
        name = Some(found);
    }
    match name {
        Some(Some(host)) => Hello::Name(host),
        _ => Hello::NoName,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A minimal, well-formed ClientHello record naming `host` (or none), with `extra` bytes of
    /// padding extension to make it large.
    pub(crate) fn client_hello(host: Option<&str>, extra: usize) -> Vec<u8> {
        let mut ext = Vec::new();
        if let Some(host) = host {
            let h = host.as_bytes();
            ext.extend_from_slice(&[0, 0]);
            ext.extend_from_slice(&((h.len() + 5) as u16).to_be_bytes());
            ext.extend_from_slice(&((h.len() + 3) as u16).to_be_bytes());
            ext.push(0);
            ext.extend_from_slice(&(h.len() as u16).to_be_bytes());
            ext.extend_from_slice(h);
        }
        if extra > 0 {
            ext.extend_from_slice(&[0, 21]);
            ext.extend_from_slice(&(extra as u16).to_be_bytes());
            ext.extend(std::iter::repeat_n(0, extra));
        }
        let mut body = vec![3, 3];
        body.extend_from_slice(&[7; 32]);
        body.push(0);
        body.extend_from_slice(&[0, 2, 0x13, 0x01, 1, 0]);
        body.extend_from_slice(&(ext.len() as u16).to_be_bytes());
        body.extend_from_slice(&ext);
        let mut hs = vec![1, 0];
        hs.extend_from_slice(&(body.len() as u16).to_be_bytes());
        hs.extend_from_slice(&body);
        let mut out = Vec::new();
        for chunk in hs.chunks(16 * 1024) {
            out.extend_from_slice(&[22, 3, 1]);
            out.extend_from_slice(&(chunk.len() as u16).to_be_bytes());
            out.extend_from_slice(chunk);
        }
        out
    }

    #[test]
    fn the_server_name_is_read_and_truncation_asks_for_more() {
        let hello = client_hello(Some("Allowed.Test"), 0);
        assert_eq!(parse(&hello), Hello::Name("Allowed.Test".into()));
        for cut in 0..hello.len() {
            assert_eq!(parse(&hello[..cut]), Hello::Incomplete, "cut at {cut}");
        }
        assert_eq!(parse(&client_hello(None, 0)), Hello::NoName);
        // Split over two records.
        let big = client_hello(Some("a.test"), 2000);
        let mut split = Vec::new();
        let (head, tail) = big[5..].split_at(100);
        for part in [head, tail] {
            split.extend_from_slice(&[22, 3, 1]);
            split.extend_from_slice(&(part.len() as u16).to_be_bytes());
            split.extend_from_slice(part);
        }
        assert_eq!(parse(&split), Hello::Name("a.test".into()));
    }

    #[test]
    fn hostile_hellos_are_invalid() {
        assert!(matches!(
            parse(b"GET / HTTP/1.1\r\n\r\n"),
            Hello::Invalid(_)
        ));
        assert!(matches!(parse(&[22, 3, 1, 0, 0]), Hello::Invalid(_)));
        // A handshake claiming 16 MiB.
        assert!(matches!(
            parse(&[22, 3, 1, 0, 4, 1, 0xFF, 0xFF, 0xFF]),
            Hello::Invalid(_)
        ));
        // A length byte that points past the extension block.
        let mut hello = client_hello(Some("a.test"), 0);
        let len = hello.len();
        hello[len - 8] = 0xFF;
        assert!(matches!(parse(&hello), Hello::Invalid(_)));
        // Two server_name extensions.
        let one = client_hello(Some("a.test"), 0);
        let ext_at = one.len() - 15;
        let ext = one[ext_at..].to_vec();
        let mut two = one.clone();
        two.extend_from_slice(&ext);
        let body_len = (two.len() - 9) as u16;
        let record_len = (two.len() - 5) as u16;
        two[3..5].copy_from_slice(&record_len.to_be_bytes());
        two[7..9].copy_from_slice(&body_len.to_be_bytes());
        let ext_len_at = ext_at - 2;
        two[ext_len_at..ext_len_at + 2].copy_from_slice(&((ext.len() * 2) as u16).to_be_bytes());
        assert_eq!(parse(&two), Hello::Invalid("two server_name extensions"));
        // Endless bytes that never complete a record stop at the cap.
        let mut endless = vec![22, 3, 1, 0x40, 0x00];
        endless.extend(std::iter::repeat_n(0, MAX_HELLO + 10));
        assert!(matches!(parse(&endless), Hello::Invalid(_)));
        assert!(matches!(
            parse(&client_hello(Some("a\u{7f}b"), 0)),
            Hello::Invalid(_)
        ));
    }
}
