//! The control channel between the server and the egress proxy: text lines on the proxy's
//! stdin (policies, the proxy's own address, answers) and stdout (readiness, refusals,
//! questions). The server reaches them through the engine (an attached container), so this
//! works with a remote engine and from a server in a container. Lines in are capped at
//! [`MAX_LINE`] and read strictly; a line the proxy cannot read is reported on stderr and
//! skipped, never half applied.
//!
//! In: `policy <ip> <open|allowlist|none> ask=<0|1> private=<0|1> allow=<p,…> deny=<p,…>`,
//! `token <ip> <32 lowercase hex>` (the socket wiring's token of the computer whose policy key
//! is `<ip>`, [`super::socket`]; a new one replaces the old), `forget <ip>` (its policy and
//! token), `address <ip>`, `answer <id> <once|computer|deny|decline>`,
//! `answer <id> refuse <reason>` (the server's own refusal, shown as the reason), `sync <id>`.
//!
//! Secrets brokering ([`super::secrets`], [`super::tls`]; base64 is the standard alphabet with
//! padding): `ca <base64 CA certificate PEM> <base64 CA PKCS#8 key PEM>` (the CA leaf
//! certificates are minted from; a new one replaces the old), `roots <base64 PEM bundle>`
//! (extra upstream trust anchors), `secret <ip> <NAME> <placeholder> <hosts> <base64 header
//! template> <base64 value>` (the secret NAME of the computer whose policy key is `<ip>`,
//! replacing an earlier one of that name; `<hosts>` comma-separated patterns as in `allow=`),
//! `unsecret <ip> <NAME>`; `forget <ip>` drops the computer's secrets too. A proxy without a
//! terminator ignores `ca` and `roots`, saying so on stderr. No line is ever echoed: these
//! carry keys and values.
//!
//! Out: `ready` (or `ready tls` when the proxy can terminate TLS: the broker),
//! `denied <ip> <host> <port> <reason>`, `ask <id> <ip> <host> <port>`, `synced <id>`. A refusal is written before the computer hears of it, so once `synced <id>`
//! arrives every refusal the computer saw before the server sent `sync <id>` has arrived too.

use std::io::BufRead;
use std::net::IpAddr;

use super::policy::{Mode, Policy, Rule};
use super::secrets::Secret;
use super::socket::Token;
use super::{Answer, State, base64};

/// Longest control line: a policy of a few thousand patterns, a CA, a roots bundle of about
/// 190 KB of PEM, a secret.
pub const MAX_LINE: usize = 256 * 1024;

/// The first words of the lines in.
const KEYWORDS: [&str; 11] = [
    "policy", "token", "forget", "address", "answer", "sync", "ca", "roots", "secret", "unsecret",
    "",
];

/// One control message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    Policy(IpAddr, Policy),
    Token(IpAddr, Token),
    Forget(IpAddr),
    Address(IpAddr),
    Answer(u64, Answer),
    Sync(u64),
    /// The CA's certificate and key, PEM.
    Ca(String, Private),
    /// Extra upstream roots, PEM.
    Roots(String),
    Secret(IpAddr, Box<Secret>),
    Unsecret(IpAddr, String),
}

/// Text never shown: a private key.
#[derive(Clone, PartialEq, Eq)]
pub struct Private(pub String);

impl std::fmt::Debug for Private {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Private(…)")
    }
}

/// Base64 of UTF-8 text (PEM).
fn text(word: &str) -> Option<String> {
    String::from_utf8(base64::decode(word)?).ok()
}

fn rules(list: &str) -> Option<Vec<Rule>> {
    if list.is_empty() {
        return Some(Vec::new());
    }
    list.split(',').map(Rule::parse).collect()
}

fn flag(word: Option<&str>, key: &str) -> Option<bool> {
    match word?.strip_prefix(key)?.strip_prefix('=')? {
        "0" => Some(false),
        "1" => Some(true),
        _ => None,
    }
}

/// Parses one line (without its newline).
pub fn parse(line: &str) -> Option<Message> {
    let mut words = line.split(' ');
    let message = match words.next()? {
        "policy" => {
            let ip = words.next()?.parse().ok()?;
            let mode = match words.next()? {
                "open" => Mode::Open,
                "allowlist" => Mode::Allowlist,
                "none" => Mode::None,
                _ => return None,
            };
            let ask = flag(words.next(), "ask")?;
            let allow_private = flag(words.next(), "private")?;
            let allow = rules(words.next()?.strip_prefix("allow=")?)?;
            let deny = rules(words.next()?.strip_prefix("deny=")?)?;
            Message::Policy(
                ip,
                Policy {
                    mode,
                    allow,
                    deny,
                    ask,
                    allow_private,
                },
            )
        }
        "token" => Message::Token(words.next()?.parse().ok()?, Token::parse(words.next()?)?),
        "forget" => Message::Forget(words.next()?.parse().ok()?),
        "address" => Message::Address(words.next()?.parse().ok()?),
        "sync" => Message::Sync(words.next()?.parse().ok()?),
        "ca" => Message::Ca(text(words.next()?)?, Private(text(words.next()?)?)),
        "roots" => Message::Roots(text(words.next()?)?),
        "secret" => {
            let ip = words.next()?.parse().ok()?;
            let name = words.next()?;
            let placeholder = words.next()?;
            let hosts = rules(words.next()?).filter(|hosts| !hosts.is_empty())?;
            let template = base64::decode(words.next()?)?;
            let value = base64::decode(words.next()?)?;
            let secret = Secret::new(name, placeholder, hosts, &template, value).ok()?;
            Message::Secret(ip, Box::new(secret))
        }
        "unsecret" => {
            let ip = words.next()?.parse().ok()?;
            let name = words.next()?;
            if !super::secrets::is_name(name) {
                return None;
            }
            Message::Unsecret(ip, name.to_owned())
        }
        "answer" => {
            let id = words.next()?.parse().ok()?;
            let answer = match words.next()? {
                "refuse" => {
                    // The reason is the rest of the line, shown to the computer as it is.
                    let reason = clean(&words.collect::<Vec<_>>().join(" "), 200, true);
                    if reason.is_empty() {
                        return None;
                    }
                    return Some(Message::Answer(id, Answer::Refuse(reason)));
                }
                "once" => Answer::Once,
                "computer" => Answer::Computer,
                "deny" => Answer::Deny,
                "decline" => Answer::Decline,
                _ => return None,
            };
            Message::Answer(id, answer)
        }
        _ => return None,
    };
    words.next().is_none().then_some(message)
}

/// Applies control lines until the input ends.
pub fn read(state: &State, mut input: impl BufRead) {
    let mut line = Vec::new();
    loop {
        line.clear();
        let mut limited = std::io::Read::take(&mut input, MAX_LINE as u64 + 1);
        match limited.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        if line.last() != Some(&b'\n') && line.len() > MAX_LINE {
            eprintln!("kilntainers-helper egress-proxy: control line too long, skipped");
            // Skip the rest of the line, a bounded piece at a time.
            loop {
                line.clear();
                let mut piece = std::io::Read::take(&mut input, MAX_LINE as u64);
                match piece.read_until(b'\n', &mut line) {
                    Ok(0) | Err(_) => return,
                    Ok(_) if line.last() == Some(&b'\n') => break,
                    Ok(_) => {}
                }
            }
            continue;
        }
        let text = String::from_utf8_lossy(&line);
        match parse(text.trim_end_matches(['\n', '\r'])) {
            Some(Message::Policy(ip, policy)) => state.set_policy(ip, Some(policy)),
            Some(Message::Token(ip, token)) => state.set_token(ip, Some(token)),
            Some(Message::Forget(ip)) => {
                state.set_policy(ip, None);
                state.set_token(ip, None);
                state.forget_secrets(ip);
            }
            Some(Message::Secret(ip, secret)) => {
                if let Err(why) = state.set_secret(ip, *secret) {
                    eprintln!("kilntainers-helper egress-proxy: secret skipped: {why}");
                }
            }
            Some(Message::Unsecret(ip, name)) => state.remove_secret(ip, &name),
            Some(Message::Ca(cert, key)) => {
                if let Err(why) = state.set_ca(&cert, &key.0) {
                    eprintln!("kilntainers-helper egress-proxy: CA not used: {why}");
                }
            }
            Some(Message::Roots(pem)) => {
                if let Err(why) = state.set_roots(&pem) {
                    eprintln!("kilntainers-helper egress-proxy: roots not used: {why}");
                }
            }
            Some(Message::Address(ip)) => state.set_address(ip),
            Some(Message::Answer(id, answer)) => state.answer(id, answer),
            Some(Message::Sync(id)) => state.emit(&format!("synced {id}")),
            None => {
                // Only the keyword is shown: the rest may hold a key or a secret's value.
                let keyword = text.split(' ').next().unwrap_or_default();
                let keyword = if KEYWORDS.contains(&keyword) {
                    keyword
                } else {
                    "?"
                };
                eprintln!(
                    "kilntainers-helper egress-proxy: unreadable control line ({keyword}), skipped"
                );
            }
        }
    }
}

/// Host and reason text may come from a computer: no spaces or control bytes in the host, no
/// line breaks anywhere, and capped, so one event stays one short line.
fn clean(text: &str, max: usize, spaces: bool) -> String {
    text.chars()
        .filter(|c| !c.is_control())
        .map(|c| if c == ' ' && !spaces { '_' } else { c })
        .take(max)
        .collect()
}

pub fn denied_line(source: IpAddr, host: &str, port: u16, reason: &str) -> String {
    format!(
        "denied {source} {} {port} {}",
        clean(host, 255, false),
        clean(reason, 200, true)
    )
}

pub fn ask_line(id: u64, source: IpAddr, host: &str, port: u16) -> String {
    format!("ask {id} {source} {} {port}", clean(host, 255, false))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_read_strictly() {
        let Some(Message::Policy(ip, p)) =
            parse("policy 172.30.0.5 allowlist ask=1 private=0 allow=a.test,*.b.test:8443 deny=")
        else {
            panic!("not read");
        };
        assert_eq!(ip.to_string(), "172.30.0.5");
        assert_eq!(
            (p.mode, p.ask, p.allow_private, p.allow.len(), p.deny.len()),
            (Mode::Allowlist, true, false, 2, 0)
        );
        assert_eq!(
            parse("answer 7 computer"),
            Some(Message::Answer(7, Answer::Computer))
        );
        assert_eq!(
            parse(
                "answer 8 refuse no way to ask the user (the client does not support elicitation)"
            ),
            Some(Message::Answer(
                8,
                Answer::Refuse(
                    "no way to ask the user (the client does not support elicitation)".to_owned()
                )
            ))
        );
        assert_eq!(parse("answer 9 refuse"), None);
        assert_eq!(
            parse("answer 9 refuse a\u{7}b"),
            Some(Message::Answer(9, Answer::Refuse("ab".to_owned())))
        );
        assert_eq!(
            parse("forget ::1"),
            Some(Message::Forget("::1".parse().unwrap()))
        );
        assert_eq!(parse("sync 12"), Some(Message::Sync(12)));
        for bad in [
            "",
            "policy 172.30.0.5 allowlist ask=1 private=0 allow=A.test deny=",
            "policy 172.30.0.5 wide ask=1 private=0 allow= deny=",
            "policy 172.30.0.5 open ask=2 private=0 allow= deny=",
            "policy 172.30.0.5 open ask=0 private=0 allow= deny= extra",
            "policy x open ask=0 private=0 allow= deny=",
            "answer x once",
            "answer 1 maybe",
            "sync",
            "sync x",
            "sync 1 2",
            "unknown",
        ] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
    }

    const HEX: &str = "0123456789abcdef00112233445566ff";

    #[test]
    fn token_lines_are_read_strictly() {
        let Some(Message::Token(ip, token)) = parse(&format!("token fd00:6b69::5 {HEX}")) else {
            panic!("not read");
        };
        assert_eq!(ip.to_string(), "fd00:6b69::5");
        assert_eq!(token.to_string(), HEX);
        for bad in [
            format!("token fd00::5 {}", HEX.to_uppercase()),
            format!("token fd00::5 {}", &HEX[1..]),
            format!("token fd00::5 {HEX}0"),
            format!("token fd00::5 {}g", &HEX[1..]),
            format!("token fd00::5 {HEX} extra"),
            format!("token nowhere {HEX}"),
            "token fd00::5".to_owned(),
            "token".to_owned(),
        ] {
            assert_eq!(parse(&bad), None, "{bad:?}");
        }
    }

    #[test]
    fn forget_drops_the_token_and_a_new_token_replaces_the_old() {
        let state = State::new(super::super::Upstream::default(), Box::new(std::io::sink()));
        let other = "ffeeddccbbaa99887766554433221100";
        let input = format!("token fd00::5 {HEX}\ntoken fd00::6 {other}\n");
        read(&state, input.as_bytes());
        let first = Token::parse(HEX).unwrap();
        let second = Token::parse(other).unwrap();
        let key: IpAddr = "fd00::5".parse().unwrap();
        assert_eq!(state.source_of(&first), Some(key));
        read(
            &state,
            format!("token fd00::5 {}\n", "1".repeat(32)).as_bytes(),
        );
        assert_eq!(state.source_of(&first), None);
        assert_eq!(
            state.source_of(&Token::parse(&"1".repeat(32)).unwrap()),
            Some(key)
        );
        read(&state, "forget fd00::6\n".as_bytes());
        assert_eq!(state.source_of(&second), None);
    }

    const PLACEHOLDER: &str = "kts_0123456789abcdef0123456789abcdef";

    fn b64(text: &str) -> String {
        base64::encode(text.as_bytes())
    }

    fn secret_line(name: &str, hosts: &str, template: &str, value: &str) -> String {
        format!(
            "secret 10.0.0.5 {name} {PLACEHOLDER} {hosts} {} {}",
            b64(template),
            b64(value)
        )
    }

    #[test]
    fn secret_lines_are_read_strictly() {
        let Some(Message::Secret(ip, secret)) = parse(&secret_line(
            "GH_TOKEN",
            "api.github.com,*.github.com",
            "Authorization: Bearer {}",
            "v",
        )) else {
            panic!("not read");
        };
        assert_eq!(ip.to_string(), "10.0.0.5");
        assert_eq!(secret.name(), "GH_TOKEN");
        let dest = |name: &str| super::super::policy::Dest::Name(name.to_owned());
        assert!(secret.bound_to(&dest("api.github.com"), 443));
        assert!(secret.bound_to(&dest("x.github.com"), 80));
        assert!(!secret.bound_to(&dest("github.com"), 443));
        assert_eq!(
            parse("unsecret 10.0.0.5 GH_TOKEN"),
            Some(Message::Unsecret(
                "10.0.0.5".parse().unwrap(),
                "GH_TOKEN".to_owned()
            ))
        );
        let good = secret_line("A", "a.test", "X: {}", "v");
        for bad in [
            secret_line("a", "a.test", "X: {}", "v"),
            secret_line("A-B", "a.test", "X: {}", "v"),
            secret_line("A", "", "X: {}", "v"),
            secret_line("A", "A.test", "X: {}", "v"),
            secret_line("A", "a.test,", "X: {}", "v"),
            secret_line("A", "a.test", "X: none", "v"),
            secret_line("A", "a.test", "X: {}", "a\r\nX-Evil: 1"),
            secret_line("A", "a.test", "X: {}", "a\nb"),
            secret_line("A", "a.test", "X: {}", "a\0b"),
            secret_line("A", "a.test", "X: {}", ""),
            good.replace(PLACEHOLDER, &PLACEHOLDER.to_uppercase()),
            good.replace(PLACEHOLDER, "kts_123"),
            good.replace(&b64("v"), "dg"),
            good.replace(&b64("v"), "d g=="),
            good.replace(&b64("X: {}"), "WDoge30=!"),
            format!("{good} extra"),
            good.replace("10.0.0.5", "nowhere"),
            "unsecret 10.0.0.5 lower".to_owned(),
            "unsecret 10.0.0.5".to_owned(),
            "unsecret 10.0.0.5 A B".to_owned(),
            "secret".to_owned(),
        ] {
            assert_eq!(parse(&bad), None, "{bad:?}");
        }
        assert!(parse(&good).is_some());
    }

    #[test]
    fn ca_and_roots_lines_are_read_strictly_and_never_shown() {
        let Some(Message::Ca(cert, key)) = parse(&format!(
            "ca {} {}",
            b64("-----BEGIN CERTIFICATE-----"),
            b64("secret key")
        )) else {
            panic!("not read");
        };
        assert_eq!(cert, "-----BEGIN CERTIFICATE-----");
        assert_eq!(key.0, "secret key");
        assert!(!format!("{key:?}").contains("secret"));
        assert_eq!(
            parse(&format!("roots {}", b64("pem"))),
            Some(Message::Roots("pem".to_owned()))
        );
        for bad in [
            "ca".to_owned(),
            format!("ca {}", b64("c")),
            format!("ca {} {} x", b64("c"), b64("k")),
            format!("ca {} k", b64("c")),
            format!("ca {} {}", b64("c"), base64::encode(&[0xff, 0xfe])),
            "roots".to_owned(),
            "roots @@@@".to_owned(),
            format!("roots {} {}", b64("a"), b64("b")),
        ] {
            assert_eq!(parse(&bad), None, "{bad:?}");
        }
        // A proxy without a terminator ignores them.
        let state = State::new(super::super::Upstream::default(), Box::new(std::io::sink()));
        assert!(state.set_ca("c", "k").is_err());
        assert!(state.set_roots("r").is_err());
    }

    #[test]
    fn secrets_are_replaced_by_name_and_forgotten_with_the_computer() {
        let state = State::new(super::super::Upstream::default(), Box::new(std::io::sink()));
        let ip: IpAddr = "10.0.0.5".parse().unwrap();
        let input = [
            secret_line("B", "b.test", "X: {}", "1"),
            secret_line("A", "a.test", "X: {}", "2"),
            secret_line("B", "c.test", "X: {}", "3"),
        ]
        .join("\n");
        read(&state, format!("{input}\n").as_bytes());
        let names = |state: &State| {
            state
                .secrets_of(ip)
                .iter()
                .map(|s| s.name().to_owned())
                .collect::<Vec<_>>()
        };
        assert_eq!(names(&state), ["A", "B"]);
        let c = super::super::policy::Dest::Name("c.test".to_owned());
        assert!(state.secrets_of(ip)[1].bound_to(&c, 443));
        read(&state, "unsecret 10.0.0.5 A\n".as_bytes());
        assert_eq!(names(&state), ["B"]);
        read(&state, "forget 10.0.0.5\n".as_bytes());
        assert!(names(&state).is_empty());
        // At most MAX_SECRETS per computer.
        let many: String = (0..=crate::egress::secrets::MAX_SECRETS)
            .map(|i| {
                format!(
                    "{}\n",
                    secret_line(&format!("S{i}"), "a.test", "X: {}", "v")
                )
            })
            .collect();
        read(&state, many.as_bytes());
        assert_eq!(names(&state).len(), crate::egress::secrets::MAX_SECRETS);
    }

    #[test]
    fn an_overlong_line_is_skipped_and_the_next_one_applies() {
        let state = State::new(super::super::Upstream::default(), Box::new(std::io::sink()));
        let mut input = vec![b'x'; MAX_LINE * 3];
        input.extend_from_slice(b"\naddress 10.0.0.9\n");
        read(&state, input.as_slice());
        assert_eq!(
            *super::super::lock(&state.address),
            Some("10.0.0.9".parse().unwrap())
        );
    }

    #[test]
    fn events_stay_one_line() {
        let line = denied_line("10.0.0.2".parse().unwrap(), "evil host\n", 443, "why\nnot");
        assert_eq!(line, "denied 10.0.0.2 evil_host 443 whynot");
        assert!(denied_line("10.0.0.2".parse().unwrap(), &"x".repeat(10_000), 1, "r").len() < 300);
    }
}
