//! The egress policy (docs/egress.md): which hosts a computer may reach. Plain data shared by the
//! server (flags, per-computer narrowing, the recorded label) and by the backends that enforce
//! it: host patterns (IDNA, trailing dot, IP literals and CIDRs, ports), the policy a computer
//! records, the deny-beats-allow decision and the narrowing check of `computer_create`'s
//! `egress`. Knows no provider and no enforcement mechanism; the in-computer-facing proxy has
//! its own copy of the decision over the normalised patterns this module produces.

use std::fmt;
use std::net::IpAddr;

/// Ports a pattern without `:PORT` covers: plain HTTP and HTTPS.
pub const DEFAULT_PORTS: [u16; 2] = [80, 443];

/// Longest host name DNS can carry (RFC 1035 §2.3.4, without the trailing dot).
const MAX_NAME_LEN: usize = 253;

/// `--egress`: what a computer may reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EgressMode {
    /// Anything, as before egress policies existed (minus deny rules).
    Open,
    /// Only the hosts the rules allow.
    Allowlist,
    /// No network at all (`--no-network`).
    None,
}

impl EgressMode {
    /// The flag value and label spelling.
    pub fn name(self) -> &'static str {
        match self {
            Self::Open => "open",
            Self::Allowlist => "allowlist",
            Self::None => "none",
        }
    }

    /// The mode a flag value names (exact, lower case).
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "open" => Some(Self::Open),
            "allowlist" => Some(Self::Allowlist),
            "none" => Some(Self::None),
            _ => None,
        }
    }
}

/// Why a pattern was refused; the caller names the pattern and the flag.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PatternError {
    #[error("it is empty")]
    Empty,
    #[error("the port must be a number from 1 to 65535")]
    BadPort,
    #[error("the prefix length must be a number from 0 to {0}")]
    BadPrefix(u8),
    #[error("a CIDR needs an IP address before the '/'")]
    BadNetwork,
    #[error("'*' is allowed only as the whole first label, as in *.example.com")]
    BadWildcard,
    #[error("it is not a valid host name ({0})")]
    BadName(String),
}

/// What a pattern names, after normalisation.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum HostPattern {
    /// That host only: lower-case ASCII (punycode), no trailing dot.
    Name(String),
    /// Every subdomain of the name, not the name itself (`*.example.com`).
    Subdomains(String),
    /// An IP address (full prefix) or a network; host bits are cleared.
    Network { addr: IpAddr, prefix: u8 },
}

/// One `--egress-allow` / `--egress-deny` rule: a host pattern and its port (`None`: 80 and 443).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Pattern {
    pub host: HostPattern,
    pub port: Option<u16>,
}

/// A destination as the proxy sees it: a normalised name or an IP literal.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Host {
    Name(String),
    Ip(IpAddr),
}

impl Host {
    /// Parses a destination (a `Host` header's or a `CONNECT` target's host part, or an SNI):
    /// an IP literal (IPv6 with or without brackets) or a name, normalised like a pattern.
    pub fn parse(text: &str) -> Result<Self, PatternError> {
        let text = text.trim();
        let unbracketed = text
            .strip_prefix('[')
            .and_then(|t| t.strip_suffix(']'))
            .unwrap_or(text);
        if let Ok(ip) = unbracketed.parse::<IpAddr>() {
            return Ok(Self::Ip(ip));
        }
        normalise_name(text).map(Self::Name)
    }
}

impl fmt::Display for Host {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Name(name) => f.write_str(name),
            Self::Ip(IpAddr::V6(ip)) => write!(f, "[{ip}]"),
            Self::Ip(ip) => write!(f, "{ip}"),
        }
    }
}

/// A host name in the one form every comparison uses: IDNA (UTS 46) to lower-case ASCII, one
/// trailing dot dropped, each label 1-63 letters, digits or hyphens, at most 253 bytes; a name
/// that ends in a numeric label is refused because resolvers read it as an IPv4 address.
pub fn normalise_name(text: &str) -> Result<String, PatternError> {
    let text = text.strip_suffix('.').unwrap_or(text);
    if text.is_empty() {
        return Err(PatternError::Empty);
    }
    if text.contains('*') {
        return Err(PatternError::BadWildcard);
    }
    let ascii = idna::domain_to_ascii_strict(text)
        .map_err(|_| PatternError::BadName("IDNA conversion failed".to_owned()))?;
    if ascii.is_empty() || ascii.len() > MAX_NAME_LEN {
        return Err(PatternError::BadName("wrong length".to_owned()));
    }
    for label in ascii.split('.') {
        if label.is_empty() || label.len() > 63 {
            return Err(PatternError::BadName(
                "an empty or too long label".to_owned(),
            ));
        }
        if !label
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        {
            return Err(PatternError::BadName(
                "only letters, digits, hyphens and dots".to_owned(),
            ));
        }
    }
    if ascii
        .rsplit('.')
        .next()
        .is_some_and(|last| last.bytes().all(|b| b.is_ascii_digit()))
    {
        return Err(PatternError::BadName(
            "it ends in a number, like an IPv4 address".to_owned(),
        ));
    }
    Ok(ascii)
}

fn parse_port(text: &str) -> Result<u16, PatternError> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(PatternError::BadPort);
    }
    match text.parse::<u16>() {
        Ok(port) if port > 0 => Ok(port),
        _ => Err(PatternError::BadPort),
    }
}

fn family_bits(addr: IpAddr) -> u8 {
    match addr {
        IpAddr::V4(_) => 32,
        IpAddr::V6(_) => 128,
    }
}

/// `addr` with every bit after `prefix` cleared.
fn masked(addr: IpAddr, prefix: u8) -> IpAddr {
    match addr {
        IpAddr::V4(v4) => {
            let bits = u32::from(v4);
            let mask = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
            IpAddr::V4((bits & mask).into())
        }
        IpAddr::V6(v6) => {
            let bits = u128::from(v6);
            let mask = u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0);
            IpAddr::V6((bits & mask).into())
        }
    }
}

fn parse_network(text: &str) -> Result<HostPattern, PatternError> {
    let (addr, prefix) = match text.split_once('/') {
        Some((addr, prefix)) => (addr, Some(prefix)),
        None => (text, None),
    };
    let addr: IpAddr = addr.parse().map_err(|_| PatternError::BadNetwork)?;
    let max = family_bits(addr);
    let prefix = match prefix {
        None => max,
        Some(p)
            if p.is_empty()
                || !p.bytes().all(|b| b.is_ascii_digit())
                || (p.len() > 1 && p.starts_with('0')) =>
        {
            return Err(PatternError::BadPrefix(max));
        }
        Some(p) => match p.parse::<u8>() {
            Ok(p) if p <= max => p,
            _ => return Err(PatternError::BadPrefix(max)),
        },
    };
    Ok(HostPattern::Network {
        addr: masked(addr, prefix),
        prefix,
    })
}

impl Pattern {
    /// Parses `example.com`, `*.example.com`, `203.0.113.7`, `203.0.113.0/24`, `2001:db8::/32`,
    /// `[2001:db8::1]`, each with an optional `:PORT` (IPv6 only in brackets).
    pub fn parse(text: &str) -> Result<Self, PatternError> {
        let text = text.trim();
        if text.is_empty() {
            return Err(PatternError::Empty);
        }
        let (host, port) = if let Some(rest) = text.strip_prefix('[') {
            let (inner, after) = rest.split_once(']').ok_or(PatternError::BadNetwork)?;
            let port = match after {
                "" => None,
                _ => Some(parse_port(
                    after.strip_prefix(':').ok_or(PatternError::BadPort)?,
                )?),
            };
            return Ok(Self {
                host: parse_network(inner)?,
                port,
            });
        } else if text.matches(':').count() > 1 {
            // An IPv6 address or network without brackets cannot carry a port.
            (text, None)
        } else {
            match text.rsplit_once(':') {
                Some((host, port)) => (host, Some(parse_port(port)?)),
                None => (text, None),
            }
        };
        if host.is_empty() {
            return Err(PatternError::Empty);
        }
        let first = host.as_bytes()[0];
        let looks_numeric = first.is_ascii_digit() || host.contains(':');
        let host = if host.contains('/') || (looks_numeric && host.parse::<IpAddr>().is_ok()) {
            parse_network(host)?
        } else if let Some(domain) = host.strip_prefix("*.") {
            HostPattern::Subdomains(normalise_name(domain)?)
        } else {
            HostPattern::Name(normalise_name(host)?)
        };
        Ok(Self { host, port })
    }

    /// Whether the pattern's ports include `port`.
    pub fn covers_port(&self, port: u16) -> bool {
        match self.port {
            Some(own) => own == port,
            None => DEFAULT_PORTS.contains(&port),
        }
    }

    /// Whether a connection to `host:port` matches this pattern.
    pub fn matches(&self, host: &Host, port: u16) -> bool {
        self.covers_port(port)
            && match (&self.host, host) {
                (HostPattern::Name(own), Host::Name(name)) => own == name,
                (HostPattern::Subdomains(domain), Host::Name(name)) => is_subdomain(name, domain),
                (HostPattern::Network { addr, prefix }, Host::Ip(ip)) => {
                    family_bits(*addr) == family_bits(*ip) && masked(*ip, *prefix) == *addr
                }
                _ => false,
            }
    }

    /// Whether some host both patterns name, ports aside (for providers whose rules have no
    /// ports). Names nest and networks nest or lie apart, so two overlap exactly when one
    /// covers the other.
    pub fn overlaps_host(&self, other: &Pattern) -> bool {
        let host_only = |p: &Pattern| Pattern {
            host: p.host.clone(),
            port: None,
        };
        let (a, b) = (host_only(self), host_only(other));
        a.covers(&b) || b.covers(&a)
    }

    /// Whether everything `other` matches, this pattern matches too (the narrowing rule).
    pub fn covers(&self, other: &Pattern) -> bool {
        let ports = match other.port {
            Some(port) => self.covers_port(port),
            None => DEFAULT_PORTS.iter().all(|p| self.covers_port(*p)),
        };
        ports
            && match (&self.host, &other.host) {
                (HostPattern::Name(own), HostPattern::Name(name)) => own == name,
                (HostPattern::Subdomains(domain), HostPattern::Name(name)) => {
                    is_subdomain(name, domain)
                }
                (HostPattern::Subdomains(domain), HostPattern::Subdomains(inner)) => {
                    inner == domain || is_subdomain(inner, domain)
                }
                (
                    HostPattern::Network { addr, prefix },
                    HostPattern::Network {
                        addr: inner,
                        prefix: inner_prefix,
                    },
                ) => {
                    family_bits(*addr) == family_bits(*inner)
                        && prefix <= inner_prefix
                        && masked(*inner, *prefix) == *addr
                }
                _ => false,
            }
    }
}

/// `name` is a strict subdomain of `domain` (both normalised).
fn is_subdomain(name: &str, domain: &str) -> bool {
    name.len() > domain.len() + 1
        && name.ends_with(domain)
        && name.as_bytes()[name.len() - domain.len() - 1] == b'.'
}

impl fmt::Display for Pattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let bracket = matches!(
            &self.host,
            HostPattern::Network {
                addr: IpAddr::V6(_),
                ..
            }
        ) && self.port.is_some();
        if bracket {
            f.write_str("[")?;
        }
        match &self.host {
            HostPattern::Name(name) => f.write_str(name)?,
            HostPattern::Subdomains(domain) => write!(f, "*.{domain}")?,
            HostPattern::Network { addr, prefix } if *prefix == family_bits(*addr) => {
                write!(f, "{addr}")?;
            }
            HostPattern::Network { addr, prefix } => write!(f, "{addr}/{prefix}")?,
        }
        if bracket {
            f.write_str("]")?;
        }
        match self.port {
            Some(port) => write!(f, ":{port}"),
            None => Ok(()),
        }
    }
}

/// Why a connection is refused, before any address is resolved; the proxy adds `private
/// address` and the ask-to-allow outcomes. `Display` is the reason of the stderr line
/// (docs/egress.md, "What the model sees").
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// A deny rule matched; carries the rule as written back.
    DeniedByRule(String),
    /// Allow-list mode and no rule names the host.
    NotAllowed,
    /// `--egress none`.
    NoNetwork,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::DeniedByRule(rule) => write!(f, "denied by rule {rule}"),
            Self::NotAllowed => f.write_str("not in this computer's allow-list"),
            Self::NoNetwork => f.write_str("this computer has no network"),
        }
    }
}

/// What the policy says about one destination.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Allowed,
    /// No rule names it and `--egress-ask` is on: a person decides.
    Ask,
    Refused(Refusal),
}

/// The policy one computer runs under; recorded on it ([`EgressPolicy::to_label`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EgressPolicy {
    pub mode: EgressMode,
    pub allow: Vec<Pattern>,
    pub deny: Vec<Pattern>,
    /// `--egress-ask` (allow-list mode only).
    pub ask: bool,
    /// `--egress-allow-private`: destinations in private ranges are not refused by the proxy.
    pub allow_private: bool,
}

/// A per-computer allow pattern the server's policy does not cover.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "egress.allow pattern '{pattern}' is wider than this server allows ({server}); a computer's egress can only narrow the server's."
)]
pub struct NarrowError {
    pub pattern: String,
    pub server: String,
}

/// An allow rule a person may not add to a computer: outside the server's bounds
/// ([`EgressPolicy::admits`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GrantError {
    #[error("'{pattern}' is denied by this server's rule '{rule}'; a person cannot allow it.")]
    Denied { pattern: String, rule: String },
    #[error(
        "'{pattern}' is outside what this server allows ({server}); a person can allow only hosts within the server's allow-list."
    )]
    Outside { pattern: String, server: String },
}

/// A recorded policy that cannot be read back.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unreadable egress label: {0}")]
pub struct LabelError(String);

impl Default for EgressPolicy {
    fn default() -> Self {
        Self::open()
    }
}

impl EgressPolicy {
    /// `--egress open` without rules: today's behaviour.
    pub fn open() -> Self {
        Self {
            mode: EgressMode::Open,
            allow: Vec::new(),
            deny: Vec::new(),
            ask: false,
            allow_private: false,
        }
    }

    /// Whether nothing is filtered: open mode without deny rules, so nothing about the computer
    /// changes (no proxy, no label).
    pub fn is_unfiltered(&self) -> bool {
        self.mode == EgressMode::Open && self.deny.is_empty()
    }

    /// Deny beats allow; then the mode decides.
    pub fn decide(&self, host: &Host, port: u16) -> Verdict {
        if self.mode == EgressMode::None {
            return Verdict::Refused(Refusal::NoNetwork);
        }
        if let Some(rule) = self.deny.iter().find(|p| p.matches(host, port)) {
            return Verdict::Refused(Refusal::DeniedByRule(rule.to_string()));
        }
        match self.mode {
            EgressMode::Open => Verdict::Allowed,
            _ if self.allow.iter().any(|p| p.matches(host, port)) => Verdict::Allowed,
            _ if self.ask => Verdict::Ask,
            _ => Verdict::Refused(Refusal::NotAllowed),
        }
    }

    /// The policy of a computer created with `egress: {allow}`: every pattern must lie inside
    /// what this (the server's) policy allows; the server's deny rules stay.
    /// A deny rule and an allow rule that name a host in common, ports aside: what a provider
    /// whose allow rules beat its deny rules, or that has no deny rules, cannot express. A deny
    /// rule apart from every allow rule changes nothing in `allowlist` mode.
    pub fn deny_within_allow(&self) -> Option<(&Pattern, &Pattern)> {
        self.deny.iter().find_map(|deny| {
            self.allow
                .iter()
                .find(|allow| allow.overlaps_host(deny))
                .map(|allow| (deny, allow))
        })
    }

    pub fn narrowed(&self, allow: &[Pattern]) -> Result<Self, NarrowError> {
        for pattern in allow {
            let covered = match self.mode {
                EgressMode::Open => !self.deny.iter().any(|d| d.covers(pattern)),
                EgressMode::Allowlist => self.allow.iter().any(|a| a.covers(pattern)),
                EgressMode::None => false,
            };
            if !covered {
                return Err(NarrowError {
                    pattern: pattern.to_string(),
                    server: self.summary(),
                });
            }
        }
        Ok(Self {
            mode: match self.mode {
                EgressMode::None => EgressMode::None,
                _ => EgressMode::Allowlist,
            },
            allow: allow.to_vec(),
            deny: self.deny.clone(),
            ask: self.ask,
            allow_private: self.allow_private,
        })
    }

    /// Whether a person may add `pattern` to a computer's allow rules (docs/egress.md,
    /// "Dashboard"): no deny rule of this (the server's) policy covers it, and it lies within
    /// what a person could allow through ask-to-allow too: inside an allow rule, or anything
    /// with `--egress-ask`. `open` mode without a matching deny rule admits it (a computer
    /// narrowed at creation is then widened within the server's bounds); `none` admits nothing.
    pub fn admits(&self, pattern: &Pattern) -> Result<(), GrantError> {
        if let Some(rule) = self.deny.iter().find(|d| d.covers(pattern)) {
            return Err(GrantError::Denied {
                pattern: pattern.to_string(),
                rule: rule.to_string(),
            });
        }
        let within = match self.mode {
            EgressMode::Open => true,
            EgressMode::Allowlist => self.ask || self.allow.iter().any(|a| a.covers(pattern)),
            EgressMode::None => false,
        };
        if within {
            Ok(())
        } else {
            Err(GrantError::Outside {
                pattern: pattern.to_string(),
                server: self.summary(),
            })
        }
    }

    /// One line naming what the policy allows, for messages.
    pub fn summary(&self) -> String {
        match self.mode {
            EgressMode::Open if self.deny.is_empty() => "--egress open".to_owned(),
            EgressMode::Open => format!("--egress open, denying {}", join(&self.deny)),
            EgressMode::None => "--egress none".to_owned(),
            EgressMode::Allowlist if self.allow.is_empty() => {
                "--egress allowlist with no allow rule".to_owned()
            }
            EgressMode::Allowlist => format!("--egress allowlist: {}", join(&self.allow)),
        }
    }

    /// The `kilntainers.egress` label: compact JSON, keys in a fixed order.
    pub fn to_label(&self) -> String {
        let list = |patterns: &[Pattern]| {
            serde_json::Value::Array(
                patterns
                    .iter()
                    .map(|p| serde_json::Value::String(p.to_string()))
                    .collect(),
            )
        };
        let mut object = serde_json::Map::new();
        object.insert("mode".into(), self.mode.name().into());
        object.insert("allow".into(), list(&self.allow));
        object.insert("deny".into(), list(&self.deny));
        object.insert("ask".into(), self.ask.into());
        object.insert("allow_private".into(), self.allow_private.into());
        serde_json::Value::Object(object).to_string()
    }

    /// Reads a `kilntainers.egress` label back. Strict: a label this server cannot read is an
    /// error, never a silently open computer.
    pub fn from_label(text: &str) -> Result<Self, LabelError> {
        let bad = |what: &str| LabelError(what.to_owned());
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| LabelError(e.to_string()))?;
        let object = value.as_object().ok_or_else(|| bad("not an object"))?;
        let mode = object
            .get("mode")
            .and_then(|m| m.as_str())
            .and_then(EgressMode::parse)
            .ok_or_else(|| bad("no known mode"))?;
        let list = |key: &str| -> Result<Vec<Pattern>, LabelError> {
            match object.get(key) {
                None => Ok(Vec::new()),
                Some(serde_json::Value::Array(items)) => items
                    .iter()
                    .map(|item| {
                        item.as_str()
                            .ok_or_else(|| bad("a pattern is not a string"))
                            .and_then(|s| {
                                Pattern::parse(s).map_err(|e| LabelError(format!("'{s}': {e}")))
                            })
                    })
                    .collect(),
                Some(_) => Err(bad("a rule list is not an array")),
            }
        };
        let flag = |key: &str| object.get(key).and_then(|v| v.as_bool()).unwrap_or(false);
        Ok(Self {
            mode,
            allow: list("allow")?,
            deny: list("deny")?,
            ask: flag("ask"),
            allow_private: flag("allow_private"),
        })
    }
}

/// One refused destination of a computer, as `computer_network` lists it: the same host, port
/// and reason refused again counts up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeniedEntry {
    pub host: String,
    pub port: u16,
    pub reason: String,
    pub count: u64,
    /// RFC 3339 UTC, whole seconds ([`crate::clock::rfc3339_utc`]).
    pub first_at: String,
    pub last_at: String,
}

/// One refused connection of a computer, as the enforcement reported it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Denial {
    pub host: String,
    pub port: u16,
    pub reason: String,
}

impl Denial {
    /// The line that says so at the end of a command's or a job's stderr (docs/egress.md,
    /// "Docker wiring").
    pub fn stderr_line(&self) -> String {
        format!(
            "[kilntainers: network access to {}:{} was blocked: {}]",
            self.host, self.port, self.reason
        )
    }
}

/// Refusal lines shown at the end of one result; the rest are counted.
pub const LINES_SHOWN: usize = 5;

/// What ends a command's or a finished job's stderr after refusals while it ran
/// (docs/egress.md, "Docker wiring"): one line per refused host and port, the first
/// [`LINES_SHOWN`], then a count; empty without refusals. Starts with a newline unless
/// `at_line_start`.
pub fn stderr_tail(denials: &[Denial], at_line_start: bool) -> String {
    let mut distinct: Vec<&Denial> = Vec::new();
    for denial in denials {
        if !distinct
            .iter()
            .any(|d| d.host == denial.host && d.port == denial.port)
        {
            distinct.push(denial);
        }
    }
    if distinct.is_empty() {
        return String::new();
    }
    let mut text = String::new();
    if !at_line_start {
        text.push('\n');
    }
    for denial in distinct.iter().take(LINES_SHOWN) {
        text.push_str(&denial.stderr_line());
        text.push('\n');
    }
    if distinct.len() > LINES_SHOWN {
        text.push_str(&format!(
            "[kilntainers: {} more network accesses were blocked]\n",
            distinct.len() - LINES_SHOWN
        ));
    }
    text
}

/// The server's egress settings as every backend gets them (`Common`): the policy new
/// computers get unless they narrow it, and how the enforcing proxy resolves and connects.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EgressSettings {
    pub policy: EgressPolicy,
    /// `--egress-dns`: the upstream resolver; `None` = the system's.
    pub dns: Option<std::net::SocketAddr>,
    /// `--egress-resolve`: fixed answers (normalised name, address), used before DNS.
    pub resolve: Vec<(String, IpAddr)>,
    /// `--egress-upstream-ca`: extra PEM certificates trusted upstream.
    pub upstream_ca_pem: Option<String>,
    /// `--egress-upstream-network`: the engine network upstream connections leave through.
    pub upstream_network: Option<String>,
}

impl EgressSettings {
    /// Whether computers need enforcement at all (see [`EgressPolicy::is_unfiltered`]).
    pub fn filters(&self) -> bool {
        !self.policy.is_unfiltered() && self.policy.mode != EgressMode::None
    }
}

/// Reasons a question is refused without asking anyone (docs/egress.md, "Ask-to-allow").
pub mod reasons {
    /// The user chose `deny`, declined or cancelled.
    pub const DECLINED: &str = "the user declined";
    /// The user chose `deny` for this computer and host less than 10 minutes ago.
    pub const DECLINED_EARLIER: &str = "the user declined (remembered for 10 minutes)";
    /// No answer within the proxy's hold.
    pub const NO_ANSWER: &str = "no answer from the user in 60 s";
    /// The session's client did not declare the elicitation capability.
    pub const NO_ELICITATION: &str =
        "no way to ask the user (the client does not support elicitation)";
    /// No live session holds or runs the computer.
    pub const NO_SESSION: &str = "no way to ask the user (no session holds this computer)";
    /// A 2026-07-28 request was chosen, but its call (which would answer `input_required`)
    /// has ended.
    pub const CALL_ENDED: &str = "no way to ask the user (the request that could ask has ended)";
    /// The session already has [`super::MAX_QUESTIONS_PER_SESSION`] questions open.
    pub const TOO_MANY: &str = "too many questions are open for this session (at most 3)";
}

/// Questions open at once per MCP session; more are refused with [`reasons::TOO_MANY`].
pub const MAX_QUESTIONS_PER_SESSION: usize = 3;

/// How long a connection waits for the person (the proxy's hold).
pub const ASK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// How long a `deny` is remembered for a computer and host.
pub const DENY_REMEMBERED: std::time::Duration = std::time::Duration::from_secs(600);

/// What the person (or the server for them) answered to an [`EgressQuestion`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EgressAnswer {
    /// `allow once`: this connection (and those waiting on the same question).
    Once,
    /// `allow for this computer`: the backend adds `host:port` to the computer's recorded
    /// policy and lets this connection through.
    ForComputer,
    /// Refused, with the reason line the computer's command shows (§2 of the contract).
    Refuse(String),
}

/// A connection from a computer to a host no rule covers, held by the enforcing backend until
/// [`EgressQuestion::answer`] is called (or its hold ends). Backends with ask-to-allow hand
/// these to the server ([`crate::Backend::egress_questions`]); the server asks the person.
#[derive(Debug)]
pub struct EgressQuestion {
    pub computer_id: crate::ids::ComputerId,
    /// The host as the computer named it (normalised), and the port.
    pub host: String,
    pub port: u16,
    answer: tokio::sync::oneshot::Sender<EgressAnswer>,
}

impl EgressQuestion {
    /// A question and the receiver its answer arrives on (for the backend that asks).
    pub fn new(
        computer_id: crate::ids::ComputerId,
        host: String,
        port: u16,
    ) -> (Self, tokio::sync::oneshot::Receiver<EgressAnswer>) {
        let (answer, rx) = tokio::sync::oneshot::channel();
        (
            Self {
                computer_id,
                host,
                port,
                answer,
            },
            rx,
        )
    }

    /// Answers it; a question dropped unanswered counts as [`reasons::NO_ANSWER`].
    pub fn answer(self, answer: EgressAnswer) {
        let _ = self.answer.send(answer);
    }

    /// The pattern `allow for this computer` adds: exactly this host and port.
    pub fn pattern(&self) -> Result<Pattern, PatternError> {
        pattern_for(&self.host, self.port)
    }
}

/// `host:port` as a pattern (an IPv6 literal in brackets).
pub fn pattern_for(host: &str, port: u16) -> Result<Pattern, PatternError> {
    if host.parse::<std::net::Ipv6Addr>().is_ok() {
        Pattern::parse(&format!("[{host}]:{port}"))
    } else {
        Pattern::parse(&format!("{host}:{port}"))
    }
}

fn join(patterns: &[Pattern]) -> String {
    patterns
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
#[path = "egress_tests.rs"]
mod tests;
