//! Secrets brokering, the proxy's half: a computer holds only a placeholder for each secret
//! (`kts_` and 32 lowercase hex digits, different per computer), and the proxy puts the value
//! in place of the placeholder in the *headers* of a request going to one of the secret's hosts
//! (its "bound hosts"), never in the request line or the body. A request head carrying a
//! placeholder to a host the secret is not bound to is refused, so a prompt-injected program
//! cannot send even the placeholder's owner's secret elsewhere by way of the proxy.
//!
//! [`rewrite`] is the one function that decides; it runs on the first request head of a
//! plain-HTTP connection from a computer with secrets, and on the first head inside a TLS
//! session the proxy terminates for a bound host ([`super::tls`]). Each rewritten head ends with
//! `Connection: close` (unless it asks for an `Upgrade`), so a keep-alive client sends its next
//! request on a new connection, whose head is inspected again; bytes after the first head are
//! spliced. Everything is bounded: the head read is at most [`MAX_HEAD`], its rewrite at most
//! [`MAX_REWRITTEN`], whatever a hostile computer puts in it.
//!
//! A secret's value never appears in any line the proxy writes, nor in `Debug` output.

use std::collections::HashSet;

use super::base64;
use super::http::MAX_HEAD;
use super::policy::{Dest, Rule};

/// What every placeholder starts with.
pub const PLACEHOLDER_PREFIX: &str = "kts_";
/// Length of a placeholder: the prefix and 32 hex digits.
pub const PLACEHOLDER_LEN: usize = 36;
/// Longest secret value.
pub const MAX_VALUE: usize = 16 * 1024;
/// Longest header template.
pub const MAX_TEMPLATE: usize = 1024;
/// Secrets one computer may hold; a further one is refused (the server never sends so many).
pub const MAX_SECRETS: usize = 64;
/// Longest head after substitution: room for a few values, not for an amplification.
pub const MAX_REWRITTEN: usize = MAX_HEAD + 64 * 1024;

/// The refusal of a head that carries a secret to a host it is not bound to (docs/secrets.md).
pub fn not_bound_reason(name: &str) -> String {
    format!("carries the secret {name} to a host it is not bound to")
}

/// The refusal of a head that substitution would make longer than [`MAX_REWRITTEN`].
pub const TOO_LARGE_AFTER: &str = "request head too large after substitution";

/// Header names a template may not name: they frame or route the request, and a value there
/// would say something other than a credential.
const RESERVED_HEADERS: [&str; 6] = [
    "host",
    "connection",
    "content-length",
    "transfer-encoding",
    "upgrade",
    "proxy-connection",
];

/// One secret of one computer.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret {
    name: String,
    /// Lowercase.
    placeholder: [u8; PLACEHOLDER_LEN],
    hosts: Vec<Rule>,
    /// The template's header name, as written.
    header: String,
    /// The template's value around `{}`.
    prefix: Vec<u8>,
    suffix: Vec<u8>,
    value: Vec<u8>,
}

/// Never shows the value (nor the placeholder, which names the computer's secret).
impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Secret")
            .field("name", &self.name)
            .field("hosts", &self.hosts)
            .field("header", &self.header)
            .field("value", &"<redacted>")
            .finish()
    }
}

/// So [`rewrite`] takes secrets by value, by reference or shared (`Arc`).
impl AsRef<Secret> for Secret {
    fn as_ref(&self) -> &Secret {
        self
    }
}

/// `[A-Z][A-Z0-9_]{0,63}`.
pub fn is_name(name: &str) -> bool {
    let bytes = name.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= 64
        && bytes[0].is_ascii_uppercase()
        && bytes
            .iter()
            .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || *b == b'_')
}

/// `kts_` and exactly 32 lowercase hex digits.
pub fn parse_placeholder(text: &str) -> Option<[u8; PLACEHOLDER_LEN]> {
    let hex = text.strip_prefix(PLACEHOLDER_PREFIX)?;
    if hex.len() != 32 || !hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return None;
    }
    text.as_bytes().try_into().ok()
}

/// An RFC 9110 token (header names).
fn is_token(text: &[u8]) -> bool {
    !text.is_empty()
        && text
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(b))
}

impl Secret {
    /// Checks every part; `Err` says which is wrong, never showing the value.
    pub fn new(
        name: &str,
        placeholder: &str,
        hosts: Vec<Rule>,
        template: &[u8],
        value: Vec<u8>,
    ) -> Result<Self, String> {
        if !is_name(name) {
            return Err("the name is not [A-Z][A-Z0-9_]{0,63}".to_owned());
        }
        let placeholder = parse_placeholder(placeholder)
            .ok_or("the placeholder is not kts_ and 32 lowercase hex digits")?;
        if hosts.is_empty() {
            return Err("no host".to_owned());
        }
        if value.is_empty() || value.len() > MAX_VALUE {
            return Err(format!("the value is not 1 to {MAX_VALUE} bytes"));
        }
        if value.iter().any(|b| matches!(b, b'\r' | b'\n' | 0)) {
            return Err("the value holds CR, LF or NUL".to_owned());
        }
        let (header, prefix, suffix) = parse_template(template)?;
        Ok(Self {
            name: name.to_owned(),
            placeholder,
            hosts,
            header,
            prefix,
            suffix,
            value,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether one of the secret's host patterns matches (ports as in allow rules).
    pub fn bound_to(&self, dest: &Dest, port: u16) -> bool {
        self.hosts.iter().any(|rule| rule.matches(dest, port))
    }
}

/// `Name: prefix{}suffix`: a token, a colon, optional blanks, a value with exactly one `{}` and
/// no control byte.
fn parse_template(template: &[u8]) -> Result<(String, Vec<u8>, Vec<u8>), String> {
    let bad = |why: &str| Err(format!("the header template {why}"));
    if template.len() > MAX_TEMPLATE {
        return bad("is too long");
    }
    let Some(colon) = template.iter().position(|b| *b == b':') else {
        return bad("has no ':'");
    };
    let (name, rest) = (&template[..colon], &template[colon + 1..]);
    if !is_token(name) {
        return bad("has no valid header name");
    }
    let lower = String::from_utf8_lossy(name).to_ascii_lowercase();
    if RESERVED_HEADERS.contains(&lower.as_str()) {
        return bad("names a header that frames or routes the request");
    }
    let rest = trim_start(rest);
    if rest.iter().any(|b| b.is_ascii_control() && *b != b'\t') {
        return bad("holds a control byte");
    }
    let holes: Vec<usize> = rest
        .windows(2)
        .enumerate()
        .filter(|(_, w)| *w == b"{}")
        .map(|(i, _)| i)
        .collect();
    let [hole] = holes[..] else {
        return bad("does not hold exactly one {}");
    };
    Ok((
        String::from_utf8_lossy(name).into_owned(),
        rest[..hole].to_vec(),
        rest[hole + 2..].to_vec(),
    ))
}

fn trim_start(mut bytes: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = bytes {
        bytes = rest;
    }
    bytes
}

fn trim_end(mut bytes: &[u8]) -> &[u8] {
    while let [rest @ .., b' ' | b'\t'] = bytes {
        bytes = rest;
    }
    bytes
}

/// The next placeholder at or after `from`, in any case: its position and lowercase text.
fn next_placeholder(data: &[u8], mut from: usize) -> Option<(usize, [u8; PLACEHOLDER_LEN])> {
    while from + PLACEHOLDER_LEN <= data.len() {
        let candidate = &data[from..from + PLACEHOLDER_LEN];
        if candidate[..4].eq_ignore_ascii_case(PLACEHOLDER_PREFIX.as_bytes())
            && candidate[4..].iter().all(u8::is_ascii_hexdigit)
        {
            let mut lower = [0u8; PLACEHOLDER_LEN];
            lower.copy_from_slice(candidate);
            lower.make_ascii_lowercase();
            return Some((from, lower));
        }
        from += 1;
    }
    None
}

fn placeholders_in(data: &[u8], found: &mut HashSet<[u8; PLACEHOLDER_LEN]>) {
    let mut at = 0;
    while let Some((position, placeholder)) = next_placeholder(data, at) {
        found.insert(placeholder);
        at = position + PLACEHOLDER_LEN;
    }
}

/// The lines of a head without its final blank line, split at CRLF.
fn lines(head: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = Some(head);
    std::iter::from_fn(move || {
        let text = rest?;
        match text.windows(2).position(|w| w == b"\r\n") {
            Some(i) => {
                rest = Some(&text[i + 2..]);
                Some(&text[..i])
            }
            None => {
                rest = None;
                Some(text)
            }
        }
    })
}

fn split_header(line: &[u8]) -> Option<(&[u8], &[u8])> {
    let colon = line.iter().position(|b| *b == b':')?;
    Some((&line[..colon], &line[colon + 1..]))
}

fn is_credentials_header(name: &[u8]) -> bool {
    name.eq_ignore_ascii_case(b"authorization") || name.eq_ignore_ascii_case(b"proxy-authorization")
}

/// The base64 of a `Basic` credential, when `value` is one.
fn basic_credentials(value: &[u8]) -> Option<&str> {
    let value = trim_end(trim_start(value));
    let scheme = value.get(..6)?;
    if !scheme[..5].eq_ignore_ascii_case(b"basic") || !matches!(scheme[5], b' ' | b'\t') {
        return None;
    }
    std::str::from_utf8(trim_start(&value[6..])).ok()
}

/// Every placeholder a head carries: anywhere in its bytes, and inside `Basic` credentials.
fn carried(head: &[u8]) -> HashSet<[u8; PLACEHOLDER_LEN]> {
    let mut found = HashSet::new();
    placeholders_in(head, &mut found);
    for line in lines(head).skip(1) {
        if let Some((name, value)) = split_header(line)
            && is_credentials_header(name)
            && let Some(decoded) = basic_credentials(value).and_then(base64::decode)
        {
            placeholders_in(&decoded, &mut found);
        }
    }
    found
}

/// Rule 1 alone (for a `CONNECT` head, which is not passed on): `Err` with the refusal when
/// the head carries a placeholder of a secret not bound to `dest:port`. `secrets` in the order
/// the first offender is named by.
pub fn check(
    head: &[u8],
    secrets: &[impl AsRef<Secret>],
    dest: &Dest,
    port: u16,
) -> Result<(), String> {
    let found = carried(head);
    if found.is_empty() {
        return Ok(());
    }
    match secrets
        .iter()
        .map(AsRef::as_ref)
        .find(|s| found.contains(&s.placeholder) && !s.bound_to(dest, port))
    {
        Some(secret) => Err(not_bound_reason(&secret.name)),
        None => Ok(()),
    }
}

/// Appends `value` to `out` with every placeholder of a `bound` secret replaced by its value
/// (marking it in `used`), failing once `out` would pass [`MAX_REWRITTEN`].
fn substitute_into(
    out: &mut Vec<u8>,
    value: &[u8],
    bound: &[&Secret],
    used: &mut [bool],
) -> Result<(), String> {
    let mut at = 0;
    let mut copied = 0;
    while let Some((position, placeholder)) = next_placeholder(value, at) {
        at = position + PLACEHOLDER_LEN;
        let Some(index) = bound.iter().position(|s| s.placeholder == placeholder) else {
            continue;
        };
        push(out, &value[copied..position])?;
        push(out, &bound[index].value)?;
        used[index] = true;
        copied = at;
    }
    push(out, &value[copied..])
}

fn push(out: &mut Vec<u8>, bytes: &[u8]) -> Result<(), String> {
    if out.len() + bytes.len() > MAX_REWRITTEN {
        return Err(TOO_LARGE_AFTER.to_owned());
    }
    out.extend_from_slice(bytes);
    Ok(())
}

/// Rewrites one request head (exactly the head, ending with its blank line, at most
/// [`MAX_HEAD`] bytes) from a computer holding `secrets`, going to `dest:port`:
///
/// 1. a placeholder (any case, anywhere, `Basic` credentials included) of a secret not bound
///    there refuses the head, naming the first such secret of `secrets`;
/// 2. in header values, each placeholder of a bound secret becomes its value, in `Basic`
///    credentials too (decoded, replaced, encoded again); a bound secret whose placeholder no
///    header carried gets its template's header, unless the head has a header of that name;
/// 3. unless the head asks for an `Upgrade`, its `Connection` headers are dropped and
///    `Connection: close` added;
/// 4. a result longer than [`MAX_REWRITTEN`] refuses the head.
///
/// The request line is passed on as it is. `Err` is the refusal reason.
pub fn rewrite(
    head: &[u8],
    secrets: &[impl AsRef<Secret>],
    dest: &Dest,
    port: u16,
) -> Result<Vec<u8>, String> {
    if head.len() > MAX_HEAD {
        return Err("request head too large".to_owned());
    }
    let Some(text) = head.strip_suffix(b"\r\n\r\n") else {
        return Err("not an HTTP request head".to_owned());
    };
    check(head, secrets, dest, port)?;
    let bound: Vec<&Secret> = secrets
        .iter()
        .map(AsRef::as_ref)
        .filter(|s| s.bound_to(dest, port))
        .collect();
    let mut used = vec![false; bound.len()];
    let mut headers = Vec::new();
    let mut all = lines(text);
    let request_line = all.next().unwrap_or_default();
    for line in all {
        headers.push(split_header(line).ok_or("bad header line")?);
    }
    let upgrade = headers
        .iter()
        .any(|(name, _)| name.eq_ignore_ascii_case(b"upgrade"));
    let mut out = Vec::with_capacity(head.len() + 64);
    push(&mut out, request_line)?;
    push(&mut out, b"\r\n")?;
    for (name, value) in &headers {
        if !upgrade && name.eq_ignore_ascii_case(b"connection") {
            continue;
        }
        push(&mut out, name)?;
        push(&mut out, b":")?;
        let credentials = is_credentials_header(name)
            .then(|| basic_credentials(value).and_then(base64::decode))
            .flatten();
        match credentials {
            Some(decoded) if next_placeholder(&decoded, 0).is_some() => {
                let mut plain = Vec::with_capacity(decoded.len());
                substitute_into(&mut plain, &decoded, &bound, &mut used)?;
                push(&mut out, b" Basic ")?;
                push(&mut out, base64::encode(&plain).as_bytes())?;
            }
            _ => substitute_into(&mut out, value, &bound, &mut used)?,
        }
        push(&mut out, b"\r\n")?;
    }
    for (secret, used) in bound.iter().zip(&used) {
        let named = headers
            .iter()
            .any(|(name, _)| name.eq_ignore_ascii_case(secret.header.as_bytes()));
        if !used && !named {
            push(&mut out, secret.header.as_bytes())?;
            push(&mut out, b": ")?;
            push(&mut out, &secret.prefix)?;
            push(&mut out, &secret.value)?;
            push(&mut out, &secret.suffix)?;
            push(&mut out, b"\r\n")?;
        }
    }
    if !upgrade {
        push(&mut out, b"Connection: close\r\n")?;
    }
    push(&mut out, b"\r\n")?;
    Ok(out)
}

#[cfg(test)]
mod tests;
