//! The head of an HTTP/1 request a computer sends to the proxy, read strictly: the request line
//! (a `CONNECT host:port`, an absolute-form `http://host[:port]/…` of a proxy request, or an
//! origin-form path of a request that reached port 80 by DNS) and the `Host` header, which must
//! name the same host as the target. Bounded by [`MAX_HEAD`]; bytes after the head are the
//! body or the tunnelled stream and are passed on untouched.

/// Largest request head read; a longer one is refused (a hostile computer's "1 GB of headers"
/// costs the proxy this much per connection, no more).
pub const MAX_HEAD: usize = 16 * 1024;
/// Most header lines.
const MAX_HEADERS: usize = 100;

/// What the head asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head {
    /// `CONNECT`: the rest of the stream is the tunnel.
    pub connect: bool,
    /// Host as written (brackets kept off an IPv6 literal), not yet normalised.
    pub host: String,
    pub port: u16,
    /// Bytes of the head, including the blank line.
    pub len: usize,
    /// For a proxy request in absolute form: the request line rewritten to origin form, to
    /// send upstream in place of the original line.
    pub origin_line: Option<String>,
    /// Where the request line ends (after its CRLF).
    pub line_end: usize,
}

/// Why a head was refused; `Display`-like text for the denial line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeadError {
    Incomplete,
    TooLarge,
    Malformed(&'static str),
    /// The `Host` header names another host than the target.
    Mismatch {
        target: String,
        host: String,
    },
}

/// Parses a head from the bytes read so far. `default_port` is the port of the listener
/// for origin-form requests (80).
pub fn parse(data: &[u8], default_port: u16) -> Result<Head, HeadError> {
    let Some(end) = find(data, b"\r\n\r\n") else {
        return Err(if data.len() >= MAX_HEAD {
            HeadError::TooLarge
        } else {
            HeadError::Incomplete
        });
    };
    let len = end + 4;
    if len > MAX_HEAD {
        return Err(HeadError::TooLarge);
    }
    let text = std::str::from_utf8(&data[..end]).map_err(|_| HeadError::Malformed("not text"))?;
    let mut lines = text.split("\r\n");
    let line = lines.next().unwrap_or_default();
    let line_end = line.len() + 2;
    let mut words = line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (words.next(), words.next(), words.next(), words.next())
    else {
        return Err(HeadError::Malformed("bad request line"));
    };
    if method.is_empty() || !method.bytes().all(|b| b.is_ascii_uppercase()) {
        return Err(HeadError::Malformed("bad method"));
    }
    if version != "HTTP/1.1" && version != "HTTP/1.0" {
        return Err(HeadError::Malformed("not HTTP/1"));
    }
    let mut host_header = None;
    let mut count = 0;
    for header in lines {
        count += 1;
        if count > MAX_HEADERS {
            return Err(HeadError::TooLarge);
        }
        let Some((name, value)) = header.split_once(':') else {
            return Err(HeadError::Malformed("bad header line"));
        };
        if name.is_empty() || name.bytes().any(|b| !b.is_ascii_graphic()) {
            return Err(HeadError::Malformed("bad header name"));
        }
        if header.bytes().any(|b| b.is_ascii_control() && b != b'\t') {
            return Err(HeadError::Malformed("control byte in a header"));
        }
        if name.eq_ignore_ascii_case("host") {
            // Two Host headers could route by one and be served by the other.
            if host_header.is_some() {
                return Err(HeadError::Malformed("two Host headers"));
            }
            host_header = Some(value.trim().to_owned());
        }
    }
    let (connect, authority, origin_line) = if method == "CONNECT" {
        (true, target, None)
    } else if let Some(rest) = target.strip_prefix("http://") {
        let (authority, path) = match rest.find(['/', '?']) {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/"),
        };
        let path = if path.starts_with('?') {
            format!("/{path}")
        } else {
            path.to_owned()
        };
        (false, authority, Some(format!("{method} {path} {version}")))
    } else if target.starts_with('/') {
        match host_header.as_deref() {
            Some(host) => (false, host, None),
            None => return Err(HeadError::Malformed("no Host header")),
        }
    } else {
        return Err(HeadError::Malformed("unsupported request target"));
    };
    if authority.contains('@') {
        return Err(HeadError::Malformed("credentials in the request target"));
    }
    let default = if connect { None } else { Some(default_port) };
    let (host, port) = split_authority(authority, default).ok_or(HeadError::Malformed(
        "bad host or port in the request target",
    ))?;
    if let Some(header) = &host_header {
        let (h, p) =
            split_authority(header, Some(port)).ok_or(HeadError::Malformed("bad Host header"))?;
        if !h.eq_ignore_ascii_case(&host) || p != port {
            return Err(HeadError::Mismatch {
                target: format!("{host}:{port}"),
                host: header.clone(),
            });
        }
    } else if !connect && version == "HTTP/1.1" {
        return Err(HeadError::Malformed("no Host header"));
    }
    Ok(Head {
        connect,
        host,
        port,
        len,
        origin_line,
        line_end,
    })
}

/// `host[:port]` or `[v6][:port]`; the port is required when `default` is `None`.
pub fn split_authority(text: &str, default: Option<u16>) -> Option<(String, u16)> {
    let (host, port) = if let Some(rest) = text.strip_prefix('[') {
        let (host, after) = rest.split_once(']')?;
        match after {
            "" => (host, None),
            _ => (host, Some(after.strip_prefix(':')?)),
        }
    } else {
        match text.rsplit_once(':') {
            Some((host, port)) if !host.contains(':') => (host, Some(port)),
            Some(_) => return None,
            None => (text, None),
        }
    };
    let port = match port {
        Some(p) if !p.is_empty() && p.len() <= 5 && p.bytes().all(|b| b.is_ascii_digit()) => {
            p.parse::<u16>().ok().filter(|p| *p > 0)?
        }
        Some(_) => return None,
        None => default?,
    };
    if host.is_empty() || host.bytes().any(|b| !b.is_ascii_graphic() || b == b'/') {
        return None;
    }
    Some((host.trim_end_matches('.').to_owned(), port))
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_proxy_and_origin_requests_name_their_host() {
        let h = parse(
            b"CONNECT allowed.test:443 HTTP/1.1\r\nHost: allowed.test:443\r\n\r\nxx",
            80,
        )
        .unwrap();
        assert_eq!(
            (h.connect, h.host.as_str(), h.port, h.len),
            (true, "allowed.test", 443, 61)
        );
        let h = parse(
            b"GET http://Allowed.test/x?y HTTP/1.1\r\nHost: allowed.test\r\n\r\n",
            80,
        )
        .unwrap();
        assert_eq!((h.host.as_str(), h.port), ("Allowed.test", 80));
        assert_eq!(h.origin_line.as_deref(), Some("GET /x?y HTTP/1.1"));
        let h = parse(b"GET http://a.test:8080?q HTTP/1.0\r\n\r\n", 80).unwrap();
        assert_eq!(
            (h.port, h.origin_line.as_deref()),
            (8080, Some("GET /?q HTTP/1.0"))
        );
        let h = parse(b"GET / HTTP/1.1\r\nhost: a.test\r\nAccept: */*\r\n\r\n", 80).unwrap();
        assert_eq!((h.host.as_str(), h.port, h.connect), ("a.test", 80, false));
        let h = parse(b"CONNECT [2001:db8::1]:22 HTTP/1.1\r\n\r\n", 80).unwrap();
        assert_eq!((h.host.as_str(), h.port), ("2001:db8::1", 22));
    }

    #[test]
    fn mismatched_and_malformed_heads_are_refused() {
        assert!(matches!(
            parse(
                b"CONNECT allowed.test:443 HTTP/1.1\r\nHost: other.test:443\r\n\r\n",
                80
            ),
            Err(HeadError::Mismatch { .. })
        ));
        assert!(matches!(
            parse(
                b"GET http://allowed.test/ HTTP/1.1\r\nHost: other.test\r\n\r\n",
                80
            ),
            Err(HeadError::Mismatch { .. })
        ));
        for bad in [
            &b"CONNECT allowed.test HTTP/1.1\r\n\r\n"[..],
            b"GET / HTTP/1.1\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost: a.test\r\nHost: b.test\r\n\r\n",
            b"GET https://a.test/ HTTP/1.1\r\nHost: a.test\r\n\r\n",
            b"GET http://user@a.test/ HTTP/1.1\r\nHost: a.test\r\n\r\n",
            b"GET  / HTTP/1.1\r\nHost: a.test\r\n\r\n",
            b"get / HTTP/1.1\r\nHost: a.test\r\n\r\n",
            b"GET / HTTP/2\r\nHost: a.test\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost: a.test:0\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost: a.test:99999\r\n\r\n",
            b"GET / HTTP/1.1\r\nX\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost: a\x01.test\r\n\r\n",
            b"CONNECT a.test:443 HTTP/1.1\r\nHost: a.test:443\r\nBad\x7f: 1\r\n\r\n",
        ] {
            assert!(
                parse(bad, 80).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        assert_eq!(
            parse(b"GET / HTTP/1.1\r\nHost: a", 80),
            Err(HeadError::Incomplete)
        );
        let mut huge = b"GET / HTTP/1.1\r\nX-A: ".to_vec();
        huge.extend(std::iter::repeat_n(b'a', MAX_HEAD));
        assert_eq!(parse(&huge, 80), Err(HeadError::TooLarge));
        let mut many = b"GET / HTTP/1.1\r\nHost: a.test\r\n".to_vec();
        for _ in 0..200 {
            many.extend_from_slice(b"X: y\r\n");
        }
        many.extend_from_slice(b"\r\n");
        assert_eq!(parse(&many, 80), Err(HeadError::TooLarge));
    }
}
