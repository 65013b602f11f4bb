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
//! Out: `ready`, `denied <ip> <host> <port> <reason>`, `ask <id> <ip> <host> <port>`,
//! `synced <id>`. A refusal is written before the computer hears of it, so once `synced <id>`
//! arrives every refusal the computer saw before the server sent `sync <id>` has arrived too.

use std::io::BufRead;
use std::net::IpAddr;

use super::policy::{Mode, Policy, Rule};
use super::socket::Token;
use super::{Answer, State};

/// Longest control line: a policy of a few thousand patterns.
pub const MAX_LINE: usize = 256 * 1024;

/// One control message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    Policy(IpAddr, Policy),
    Token(IpAddr, Token),
    Forget(IpAddr),
    Address(IpAddr),
    Answer(u64, Answer),
    Sync(u64),
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
            }
            Some(Message::Address(ip)) => state.set_address(ip),
            Some(Message::Answer(id, answer)) => state.answer(id, answer),
            Some(Message::Sync(id)) => state.emit(&format!("synced {id}")),
            None => eprintln!("kilntainers-helper egress-proxy: unreadable control line, skipped"),
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
