//! The proxy's DNS, both ways, over hostile bytes: reading a computer's query and writing the
//! answer (the proxy's own address for an allowed name, NXDOMAIN otherwise, so no query for a
//! name the policy does not allow ever leaves the proxy), and the tiny upstream client that asks
//! the resolver of `/etc/resolv.conf` or `--egress-dns` for the A and AAAA records of an allowed
//! name. A static binary cannot trust `getaddrinfo`, so this is the only resolver the proxy has.
//! Every length is checked before use; compression pointers are followed at most
//! [`MAX_POINTERS`] times and only backwards.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::time::Duration;

/// Record types the proxy answers with data.
pub const TYPE_A: u16 = 1;
pub const TYPE_AAAA: u16 = 28;
const CLASS_IN: u16 = 1;
/// Response codes.
pub const RCODE_OK: u8 = 0;
pub const RCODE_FORMERR: u8 = 1;
pub const RCODE_SERVFAIL: u8 = 2;
pub const RCODE_NXDOMAIN: u8 = 3;
pub const RCODE_NOTIMP: u8 = 4;
pub const RCODE_REFUSED: u8 = 5;
/// Largest UDP message read or written without EDNS (RFC 1035 §4.2.1); longer queries are not
/// queries a resolver sends.
pub const MAX_UDP: usize = 512;
/// A compressed name may point back at most this often; more is a loop or an attack.
const MAX_POINTERS: usize = 16;
/// Longest name in presentation form (RFC 1035 §2.3.4).
const MAX_NAME: usize = 253;
/// TTL of the proxy's own answers: short, so a widened or narrowed policy shows at once.
const ANSWER_TTL: u32 = 5;
/// How long the upstream resolver has to answer one query, and how many it is asked.
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(3);
const UPSTREAM_TRIES: usize = 2;
/// Most addresses kept from one upstream answer.
const MAX_ADDRESSES: usize = 16;

/// Why a message could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DnsError {
    Truncated,
    /// A label, name or pointer outside the rules.
    BadName,
    /// Not a query, or not exactly one question.
    NotAQuery,
}

/// One question of a computer's query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Query {
    pub id: u16,
    /// Recursion desired, echoed back.
    pub rd: bool,
    /// Lower-case, no trailing dot; labels as received (not yet IDNA-checked).
    pub name: String,
    pub qtype: u16,
    pub qclass: u16,
    /// End of the question section, to copy it into the answer.
    question_end: usize,
}

fn u16_at(msg: &[u8], at: usize) -> Result<u16, DnsError> {
    match msg.get(at..at + 2) {
        Some(b) => Ok(u16::from_be_bytes([b[0], b[1]])),
        None => Err(DnsError::Truncated),
    }
}

/// Reads a (possibly compressed) name starting at `at`; returns it and the offset after it in
/// the message (after the first pointer, if any).
pub fn read_name(msg: &[u8], mut at: usize) -> Result<(String, usize), DnsError> {
    let mut name = String::new();
    let mut end = None;
    let mut pointers = 0;
    loop {
        let len = *msg.get(at).ok_or(DnsError::Truncated)? as usize;
        match len & 0xC0 {
            0x00 if len == 0 => {
                return Ok((name, end.unwrap_or(at + 1)));
            }
            0x00 => {
                let label = msg.get(at + 1..at + 1 + len).ok_or(DnsError::Truncated)?;
                if !name.is_empty() {
                    name.push('.');
                }
                for &b in label {
                    // A label with a dot or a control byte would change what the name means.
                    if b == b'.' || !b.is_ascii_graphic() {
                        return Err(DnsError::BadName);
                    }
                    name.push(b.to_ascii_lowercase() as char);
                }
                if name.len() > MAX_NAME {
                    return Err(DnsError::BadName);
                }
                at += 1 + len;
            }
            0xC0 => {
                let target = (u16_at(msg, at)? & 0x3FFF) as usize;
                pointers += 1;
                // Only backwards, and boundedly often: no loops.
                if pointers > MAX_POINTERS || target >= at {
                    return Err(DnsError::BadName);
                }
                end.get_or_insert(at + 2);
                at = target;
            }
            _ => return Err(DnsError::BadName),
        }
    }
}

/// Reads a computer's query: a standard query (opcode 0, QR clear) with exactly one question
/// and no answer or authority records. Anything else is `NotAQuery` (answered FORMERR/NOTIMP
/// when at least the header was readable).
pub fn parse_query(msg: &[u8]) -> Result<Query, DnsError> {
    if msg.len() < 12 {
        return Err(DnsError::Truncated);
    }
    let id = u16_at(msg, 0)?;
    let flags = u16_at(msg, 2)?;
    let qr = flags & 0x8000 != 0;
    let opcode = (flags >> 11) & 0xF;
    if qr || opcode != 0 || u16_at(msg, 4)? != 1 || u16_at(msg, 6)? != 0 || u16_at(msg, 8)? != 0 {
        return Err(DnsError::NotAQuery);
    }
    let (name, after) = read_name(msg, 12)?;
    let qtype = u16_at(msg, after)?;
    let qclass = u16_at(msg, after + 2)?;
    Ok(Query {
        id,
        rd: flags & 0x0100 != 0,
        name,
        qtype,
        qclass,
        question_end: after + 4,
    })
}

/// The transaction id of a message too broken to parse, to answer FORMERR with it.
pub fn message_id(msg: &[u8]) -> Option<u16> {
    u16_at(msg, 0).ok()
}

/// A header-only answer (`rcode`) for a query that could not be read.
pub fn bare_answer(id: u16, rcode: u8) -> Vec<u8> {
    let mut out = Vec::with_capacity(12);
    out.extend_from_slice(&id.to_be_bytes());
    out.extend_from_slice(&(0x8000u16 | 0x0080 | u16::from(rcode)).to_be_bytes());
    out.extend_from_slice(&[0; 8]);
    out
}

/// The answer to `query` (whose bytes are `msg`): `rcode`, and for a `NOERROR` answer the given
/// addresses of the question's type (an A question gets the IPv4 ones, AAAA the IPv6 ones,
/// anything else none: NODATA).
pub fn answer(msg: &[u8], query: &Query, rcode: u8, addresses: &[IpAddr]) -> Vec<u8> {
    let question = msg.get(12..query.question_end).unwrap_or_default();
    let records: Vec<&IpAddr> = if rcode == RCODE_OK && query.qclass == CLASS_IN {
        addresses
            .iter()
            .filter(|a| match a {
                IpAddr::V4(_) => query.qtype == TYPE_A,
                IpAddr::V6(_) => query.qtype == TYPE_AAAA,
            })
            .collect()
    } else {
        Vec::new()
    };
    let mut out = Vec::with_capacity(12 + question.len() + records.len() * 28);
    out.extend_from_slice(&query.id.to_be_bytes());
    // QR, RA, RD echoed, AA: this server is the authority for what the computer may see.
    let mut flags = 0x8000u16 | 0x0400 | 0x0080 | u16::from(rcode);
    if query.rd {
        flags |= 0x0100;
    }
    out.extend_from_slice(&flags.to_be_bytes());
    out.extend_from_slice(&1u16.to_be_bytes());
    out.extend_from_slice(&(records.len() as u16).to_be_bytes());
    out.extend_from_slice(&[0, 0, 0, 0]);
    out.extend_from_slice(question);
    for record in records {
        // The name is a pointer to the question's (offset 12).
        out.extend_from_slice(&[0xC0, 12]);
        let (rtype, data): (u16, Vec<u8>) = match record {
            IpAddr::V4(v4) => (TYPE_A, v4.octets().to_vec()),
            IpAddr::V6(v6) => (TYPE_AAAA, v6.octets().to_vec()),
        };
        out.extend_from_slice(&rtype.to_be_bytes());
        out.extend_from_slice(&CLASS_IN.to_be_bytes());
        out.extend_from_slice(&ANSWER_TTL.to_be_bytes());
        out.extend_from_slice(&(data.len() as u16).to_be_bytes());
        out.extend_from_slice(&data);
    }
    out
}

/// A query for `name` of type `qtype`, recursion desired.
pub fn build_query(id: u16, name: &str, qtype: u16) -> Option<Vec<u8>> {
    if name.is_empty() || name.len() > MAX_NAME {
        return None;
    }
    let mut out = Vec::with_capacity(18 + name.len());
    out.extend_from_slice(&id.to_be_bytes());
    out.extend_from_slice(&0x0100u16.to_be_bytes());
    out.extend_from_slice(&[0, 1, 0, 0, 0, 0, 0, 0]);
    for label in name.split('.') {
        if label.is_empty() || label.len() > 63 {
            return None;
        }
        out.push(label.len() as u8);
        out.extend_from_slice(label.as_bytes());
    }
    out.push(0);
    out.extend_from_slice(&qtype.to_be_bytes());
    out.extend_from_slice(&CLASS_IN.to_be_bytes());
    Some(out)
}

/// The addresses an upstream answer gives for `name`, following CNAMEs inside the answer.
/// `Ok(vec![])` for NXDOMAIN or no data; `Err` for a message that is not the answer to our
/// query (wrong id, wrong question, broken).
pub fn parse_answer(msg: &[u8], id: u16, name: &str, qtype: u16) -> Result<Vec<IpAddr>, DnsError> {
    if msg.len() < 12 || u16_at(msg, 0)? != id {
        return Err(DnsError::NotAQuery);
    }
    let flags = u16_at(msg, 2)?;
    if flags & 0x8000 == 0 || u16_at(msg, 4)? != 1 {
        return Err(DnsError::NotAQuery);
    }
    let (question, mut at) = read_name(msg, 12)?;
    if question != name || u16_at(msg, at)? != qtype {
        return Err(DnsError::NotAQuery);
    }
    at += 4;
    let rcode = (flags & 0xF) as u8;
    if rcode != RCODE_OK {
        return Ok(Vec::new());
    }
    let count = u16_at(msg, 6)?;
    let mut wanted = vec![name.to_owned()];
    let mut found = Vec::new();
    for _ in 0..count {
        let (owner, after) = read_name(msg, at)?;
        let rtype = u16_at(msg, after)?;
        let len = u16_at(msg, after + 8)? as usize;
        let data_at = after + 10;
        let data = msg.get(data_at..data_at + len).ok_or(DnsError::Truncated)?;
        if wanted.contains(&owner) {
            match (rtype, data.len()) {
                (TYPE_A, 4) if qtype == TYPE_A && found.len() < MAX_ADDRESSES => {
                    found.push(IpAddr::V4(Ipv4Addr::new(
                        data[0], data[1], data[2], data[3],
                    )));
                }
                (TYPE_AAAA, 16) if qtype == TYPE_AAAA && found.len() < MAX_ADDRESSES => {
                    let mut octets = [0u8; 16];
                    octets.copy_from_slice(data);
                    found.push(IpAddr::V6(Ipv6Addr::from(octets)));
                }
                // CNAME: its target is the name the next records are about.
                (5, _) if wanted.len() < MAX_POINTERS => {
                    wanted.push(read_name(msg, data_at)?.0);
                }
                _ => {}
            }
        }
        at = data_at + len;
    }
    Ok(found)
}

/// The first `nameserver` of a resolv.conf text, port 53.
pub fn nameserver_from_resolv_conf(text: &str) -> Option<SocketAddr> {
    text.lines().find_map(|line| {
        let mut words = line.split_whitespace();
        (words.next() == Some("nameserver"))
            .then(|| words.next())
            .flatten()
            .and_then(|addr| addr.split('%').next())
            .and_then(|addr| addr.parse::<IpAddr>().ok())
            .map(|ip| SocketAddr::new(ip, 53))
    })
}

/// Asks `server` for `name`'s records of `qtype` over UDP (random id and source port, answers
/// from anyone but the server ignored); `Err` with a short reason when nobody answered.
pub fn resolve(server: SocketAddr, name: &str, qtype: u16) -> Result<Vec<IpAddr>, String> {
    let bind: SocketAddr = match server {
        SocketAddr::V4(_) => SocketAddr::from(([0, 0, 0, 0], 0)),
        SocketAddr::V6(_) => SocketAddr::from(([0u16; 8], 0)),
    };
    let socket = UdpSocket::bind(bind).map_err(|e| format!("DNS socket: {e}"))?;
    socket
        .set_read_timeout(Some(UPSTREAM_TIMEOUT))
        .map_err(|e| format!("DNS socket: {e}"))?;
    let mut buffer = [0u8; 4096];
    for _ in 0..UPSTREAM_TRIES {
        let id = random_id();
        let query = build_query(id, name, qtype).ok_or("not a name DNS can carry")?;
        socket
            .send_to(&query, server)
            .map_err(|e| format!("DNS to {server}: {e}"))?;
        let deadline = std::time::Instant::now() + UPSTREAM_TIMEOUT;
        while std::time::Instant::now() < deadline {
            let Ok((len, from)) = socket.recv_from(&mut buffer) else {
                break;
            };
            if from != server {
                continue;
            }
            if let Ok(addresses) = parse_answer(&buffer[..len], id, name, qtype) {
                return Ok(addresses);
            }
        }
    }
    Err(format!("no answer from the resolver {server}"))
}

/// A query id nobody on the path can guess cheaply: std has no random source, so mix the
/// clock, the process id and a counter through a hash with a random per-process key.
fn random_id() -> u16 {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default(),
    );
    (hasher.finish() & 0xFFFF) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query_bytes(name: &str, qtype: u16) -> Vec<u8> {
        build_query(0x1234, name, qtype).unwrap()
    }

    #[test]
    fn a_query_round_trips_and_is_answered() {
        let msg = query_bytes("Allowed.TEST", TYPE_A);
        let q = parse_query(&msg).unwrap();
        assert_eq!(
            (q.id, q.name.as_str(), q.qtype, q.rd),
            (0x1234, "allowed.test", TYPE_A, true)
        );
        let proxy: IpAddr = "172.30.0.2".parse().unwrap();
        let out = answer(&msg, &q, RCODE_OK, &[proxy]);
        assert_eq!(
            parse_answer(&out, 0x1234, "allowed.test", TYPE_A).unwrap(),
            vec![proxy]
        );
        // AAAA for the same name: no data, not the IPv4 address.
        let msg6 = query_bytes("allowed.test", TYPE_AAAA);
        let q6 = parse_query(&msg6).unwrap();
        let out6 = answer(&msg6, &q6, RCODE_OK, &[proxy]);
        assert!(
            parse_answer(&out6, 0x1234, "allowed.test", TYPE_AAAA)
                .unwrap()
                .is_empty()
        );
        // NXDOMAIN carries no record whatever the type.
        let txt = query_bytes("secret.data.evil.test", 16);
        let qt = parse_query(&txt).unwrap();
        let nx = answer(&txt, &qt, RCODE_NXDOMAIN, &[proxy]);
        assert_eq!(nx[3] & 0xF, RCODE_NXDOMAIN);
        assert_eq!(u16_at(&nx, 6).unwrap(), 0);
    }

    #[test]
    fn hostile_queries_are_refused_without_panicking() {
        let good = query_bytes("a.test", TYPE_A);
        for cut in 0..good.len() {
            assert!(parse_query(&good[..cut]).is_err(), "cut at {cut}");
        }
        // A pointer loop, a forward pointer, a reserved label type, a dot inside a label.
        let mut looped = good[..12].to_vec();
        looped.extend_from_slice(&[0xC0, 12, 0, 1, 0, 1]);
        assert_eq!(parse_query(&looped), Err(DnsError::BadName));
        let mut forward = good[..12].to_vec();
        forward.extend_from_slice(&[0xC0, 40, 0, 1, 0, 1]);
        assert_eq!(parse_query(&forward), Err(DnsError::BadName));
        let mut reserved = good[..12].to_vec();
        reserved.extend_from_slice(&[0x40, 0, 0, 1, 0, 1]);
        assert_eq!(parse_query(&reserved), Err(DnsError::BadName));
        let mut dotted = good[..12].to_vec();
        dotted.extend_from_slice(&[3, b'a', b'.', b'b', 0, 0, 1, 0, 1]);
        assert_eq!(parse_query(&dotted), Err(DnsError::BadName));
        // Two questions, an answer section, a response: not a query.
        let mut two = good.clone();
        two[5] = 2;
        assert_eq!(parse_query(&two), Err(DnsError::NotAQuery));
        let mut response = good.clone();
        response[2] |= 0x80;
        assert_eq!(parse_query(&response), Err(DnsError::NotAQuery));
        // A name longer than DNS allows.
        let mut long = good[..12].to_vec();
        for _ in 0..5 {
            long.push(63);
            long.extend_from_slice(&[b'a'; 63]);
        }
        long.extend_from_slice(&[0, 0, 1, 0, 1]);
        assert_eq!(parse_query(&long), Err(DnsError::BadName));
        assert_eq!(bare_answer(7, RCODE_FORMERR)[3] & 0xF, RCODE_FORMERR);
    }

    #[test]
    fn upstream_answers_follow_cnames_and_check_the_question() {
        // An answer with a CNAME to b.test, then b.test's A record, and an unrelated A record.
        let mut msg = vec![0x12, 0x34, 0x81, 0x80, 0, 1, 0, 3, 0, 0, 0, 0];
        msg.extend_from_slice(&[1, b'a', 4, b't', b'e', b's', b't', 0, 0, 1, 0, 1]);
        msg.extend_from_slice(&[0xC0, 12, 0, 5, 0, 1, 0, 0, 0, 60, 0, 4, 1, b'b', 0xC0, 14]);
        let b_at = msg.len() - 4;
        msg.extend_from_slice(&[
            0xC0, b_at as u8, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4, 198, 18, 0, 7,
        ]);
        msg.extend_from_slice(&[1, b'c', 0, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4, 10, 0, 0, 1]);
        assert_eq!(
            parse_answer(&msg, 0x1234, "a.test", TYPE_A).unwrap(),
            vec!["198.18.0.7".parse::<IpAddr>().unwrap()]
        );
        assert!(parse_answer(&msg, 0x9999, "a.test", TYPE_A).is_err());
        assert!(parse_answer(&msg, 0x1234, "other.test", TYPE_A).is_err());
        for cut in 12..msg.len() {
            let _ = parse_answer(&msg[..cut], 0x1234, "a.test", TYPE_A);
        }
    }

    #[test]
    fn resolv_conf_gives_the_first_nameserver() {
        let text = "# generated\nsearch x\nnameserver 127.0.0.11\nnameserver 8.8.8.8\n";
        assert_eq!(
            nameserver_from_resolv_conf(text),
            Some("127.0.0.11:53".parse().unwrap())
        );
        assert_eq!(
            nameserver_from_resolv_conf("nameserver fe80::1%eth0"),
            Some("[fe80::1]:53".parse().unwrap())
        );
        assert_eq!(nameserver_from_resolv_conf("options ndots:0"), None);
    }
}
