//! The one-time secret pages of `secret_request` (docs/secrets-onboarding.md, "The page"):
//! each request opens a page at `/secrets/enter/<id>` where the person reads what is asked
//! (name, hosts, header, the model's reason) and types the value. The unguessable id (192
//! random bits) is the page's only capability; a page lives [`PAGE_TTL`] and takes one value.
//!
//! This module holds the pages and decides every answer (status and HTML) as plain functions
//! of the request, so the one-time logic is tested here without a listener; the transport only
//! routes `GET`/`POST` to [`Onboarding::show`] and [`Onboarding::submit`] and adds the headers.
//! A value goes from the POST body through `check_value` into the `SecretBook` of the asking
//! principal, and nowhere else: not into a result, an error, a log line or a page.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use tokio::sync::oneshot;
use tracing::{info, warn};

use crate::backends::Backend;
use crate::backends::brokering::{
    BrokeredSecret, HeaderTemplate, SecretBook, SecretName, check_value,
};
use crate::backends::egress::Pattern;
use crate::ids::Principal;
use crate::secret::Secret;

/// How long a page takes a value (and how long the tool waits for it).
pub const PAGE_TTL: Duration = Duration::from_secs(10 * 60);
/// Largest POST body read: a value is at most 16 KiB, percent-encoded at most three times that.
pub const MAX_BODY_BYTES: usize = 64 * 1024;
/// Where the pages live on a listener.
pub const PAGE_PATH: &str = "/secrets/enter/";
/// Pages one principal may have open at once; past it a request is refused (a model cannot
/// fill the server's memory with pages).
const MAX_OPEN_PER_PRINCIPAL: usize = 16;
/// Pages kept at all, open or answered.
const MAX_PAGES: usize = 4096;
const AUDIT: &str = "kilntainers::audit";

/// What the model asked for, checked.
#[derive(Debug, Clone)]
pub struct SecretAsk {
    pub name: SecretName,
    pub hosts: Vec<Pattern>,
    pub header: HeaderTemplate,
    pub reason: String,
}

impl SecretAsk {
    pub fn hosts_text(&self) -> String {
        self.hosts
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// How a page ended, for the tool that waits on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Set,
    /// The value was refused: the reason, which never quotes it.
    Refused(String),
}

/// Why a page could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error(
        "this user already has {MAX_OPEN_PER_PRINCIPAL} secret pages open; wait for them to be answered or to expire (10 minutes)"
    )]
    TooMany,
    #[error("the server cannot serve the secret page: {0}")]
    NoListener(String),
}

/// A page just opened: its id, address, and where its outcome arrives.
pub struct Opened {
    pub id: String,
    pub url: String,
    pub done: oneshot::Receiver<Outcome>,
}

/// An answer of the page, before the transport adds its headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageReply {
    pub status: u16,
    pub html: String,
}

/// Starts a listener for the pages and gives its base URL (`http://127.0.0.1:<port>`): the
/// stdio transport's, run on the first request.
pub type Starter = Box<dyn Fn() -> BoxFuture<'static, Result<String, String>> + Send + Sync>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Open,
    Used,
    Withdrawn,
}

struct Page {
    principal: Principal,
    ask: SecretAsk,
    expires: Instant,
    state: State,
    done: Option<oneshot::Sender<Outcome>>,
}

/// Every open page, and where they are served.
pub struct Onboarding {
    book: SecretBook,
    backend: Arc<dyn Backend>,
    ttl: Duration,
    pages: Mutex<HashMap<String, Page>>,
    /// The listener's base URL, once known (the HTTP transport's at startup; stdio's once
    /// [`Self::starter`] ran).
    base: OnceLock<String>,
    starter: Mutex<Option<Starter>>,
    /// Held while a starter runs, so two first requests start one listener.
    starting: tokio::sync::Mutex<()>,
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Onboarding {
    pub fn new(book: SecretBook, backend: Arc<dyn Backend>) -> Self {
        Self::with_ttl(book, backend, PAGE_TTL)
    }

    /// With another lifetime for the pages (tests).
    pub fn with_ttl(book: SecretBook, backend: Arc<dyn Backend>, ttl: Duration) -> Self {
        Self {
            book,
            backend,
            ttl,
            pages: Mutex::new(HashMap::new()),
            base: OnceLock::new(),
            starter: Mutex::new(None),
            starting: tokio::sync::Mutex::new(()),
        }
    }

    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// The HTTP transport serves the pages at `base` (`http://host:port`).
    pub fn set_base(&self, base: String) {
        let _ = self.base.set(base);
    }

    /// The stdio transport: `starter` starts a loopback listener on the first request.
    pub fn set_starter(&self, starter: Starter) {
        *lock(&self.starter) = Some(starter);
    }

    /// The base URL, starting the listener when none runs yet.
    async fn base(&self) -> Result<String, OpenError> {
        if let Some(base) = self.base.get() {
            return Ok(base.clone());
        }
        let _one = self.starting.lock().await;
        if let Some(base) = self.base.get() {
            return Ok(base.clone());
        }
        let start = lock(&self.starter).as_ref().map(|starter| starter());
        let Some(start) = start else {
            return Err(OpenError::NoListener("no listener serves it".to_owned()));
        };
        let base = start.await.map_err(OpenError::NoListener)?;
        let _ = self.base.set(base.clone());
        Ok(base)
    }

    /// Opens a page for `principal`'s request.
    pub async fn open(
        &self,
        principal: &Principal,
        ask: SecretAsk,
        now: Instant,
    ) -> Result<Opened, OpenError> {
        let base = self.base().await?;
        let id = format!(
            "{:032x}{:016x}",
            rand::random::<u128>(),
            rand::random::<u64>()
        );
        let (done, waiting) = oneshot::channel();
        let mut pages = lock(&self.pages);
        self.forget_old(&mut pages, now);
        let open = pages
            .values()
            .filter(|p| p.state == State::Open && p.principal == *principal && now < p.expires)
            .count();
        if open >= MAX_OPEN_PER_PRINCIPAL || pages.len() >= MAX_PAGES {
            return Err(OpenError::TooMany);
        }
        pages.insert(
            id.clone(),
            Page {
                principal: principal.clone(),
                ask,
                expires: now + self.ttl,
                state: State::Open,
                done: Some(done),
            },
        );
        Ok(Opened {
            url: format!("{base}{PAGE_PATH}{id}"),
            id,
            done: waiting,
        })
    }

    /// The request was declined, cancelled or given up: its page takes no value any more.
    pub fn withdraw(&self, id: &str) {
        if let Some(page) = lock(&self.pages).get_mut(id)
            && page.state == State::Open
        {
            page.state = State::Withdrawn;
            page.done = None;
        }
    }

    /// Answered and expired pages are kept one more lifetime, to be refused clearly (410)
    /// rather than as unknown; then forgotten.
    fn forget_old(&self, pages: &mut HashMap<String, Page>, now: Instant) {
        pages.retain(|_, page| now < page.expires + self.ttl);
    }

    /// `GET /secrets/enter/<id>`.
    pub fn show(&self, id: &str, now: Instant) -> PageReply {
        let mut pages = lock(&self.pages);
        self.forget_old(&mut pages, now);
        let Some(page) = pages.get(id) else {
            return gone_page(404, "This link is not valid. Ask for a new one.");
        };
        if let Some(reply) = closed_reply(page, now) {
            return reply;
        }
        PageReply {
            status: 200,
            html: form_page(&page.ask, page.expires.saturating_duration_since(now)),
        }
    }

    /// `POST /secrets/enter/<id>` with the form's body. `origin` and `host` are the request's
    /// headers: an Origin, when sent, must be the page's own (`http(s)://` + its Host).
    pub async fn submit(
        &self,
        id: &str,
        origin: Option<&str>,
        host: Option<&str>,
        body: &[u8],
        now: Instant,
    ) -> PageReply {
        if !same_origin(origin, host) {
            return gone_page(
                403,
                "This form can only be sent from its own page. Open the link you were given and enter the value there.",
            );
        }
        let Some(value) = form_value(body) else {
            return gone_page(
                400,
                "The form did not carry a value. Go back and enter it again.",
            );
        };
        let (principal, ask, done) = {
            let mut pages = lock(&self.pages);
            self.forget_old(&mut pages, now);
            let Some(page) = pages.get_mut(id) else {
                return gone_page(404, "This link is not valid. Ask for a new one.");
            };
            if let Some(reply) = closed_reply(page, now) {
                return reply;
            }
            page.state = State::Used;
            (page.principal.clone(), page.ask.clone(), page.done.take())
        };
        let name = ask.name.clone();
        let refused = check_value(value.expose()).and_then(|()| {
            self.book.set(
                &principal,
                BrokeredSecret {
                    name: ask.name.clone(),
                    hosts: ask.hosts.clone(),
                    header: ask.header.clone(),
                    value,
                },
            )
        });
        if let Err(why) = refused {
            warn!(target: AUDIT, %principal, secret = %name, hosts = %ask.hosts_text(), reason = %why, "secret refused");
            if let Some(done) = done {
                let _ = done.send(Outcome::Refused(why.to_string()));
            }
            return gone_page(
                422,
                &format!(
                    "The value was not accepted: {why}. This link is now used up; the assistant has to ask again."
                ),
            );
        }
        info!(target: AUDIT, %principal, secret = %name, hosts = %ask.hosts_text(), "secret set");
        // Running computers get it now, not at their next start.
        self.backend.secrets_changed().await;
        if let Some(done) = done {
            let _ = done.send(Outcome::Set);
        }
        PageReply {
            status: 200,
            html: page(
                "Secret saved",
                &format!(
                    "<p>The secret <code>{}</code> is saved. Computers send it only to {}. You can close this page.</p>",
                    escape(name.as_str()),
                    escape(&ask.hosts_text())
                ),
            ),
        }
    }
}

/// A used, withdrawn or expired page's answer; `None` while it takes a value.
fn closed_reply(page: &Page, now: Instant) -> Option<PageReply> {
    match page.state {
        State::Used => Some(gone_page(
            410,
            "This link was used already; it works once. Ask for a new one if the secret must change.",
        )),
        State::Withdrawn => Some(gone_page(
            410,
            "This request was withdrawn (declined, cancelled or given up). Ask for a new one.",
        )),
        State::Open if now >= page.expires => Some(gone_page(
            410,
            "This link expired (links are valid for 10 minutes). Ask for a new one.",
        )),
        State::Open => None,
    }
}

/// No Origin (a non-browser client) passes; a browser's must be `http(s)://` + the Host.
fn same_origin(origin: Option<&str>, host: Option<&str>) -> bool {
    let Some(origin) = origin else {
        return true;
    };
    let Some(host) = host else {
        return false;
    };
    let origin = origin.trim().to_ascii_lowercase();
    let host = host.trim().to_ascii_lowercase();
    origin == format!("http://{host}") || origin == format!("https://{host}")
}

/// The `value` field of an `application/x-www-form-urlencoded` body.
fn form_value(body: &[u8]) -> Option<Secret> {
    for pair in body.split(|b| *b == b'&') {
        let (key, value) = match pair.iter().position(|b| *b == b'=') {
            Some(at) => (&pair[..at], &pair[at + 1..]),
            None => (pair, &pair[..0]),
        };
        if key != b"value" {
            continue;
        }
        let spaced: Vec<u8> = value
            .iter()
            .map(|b| if *b == b'+' { b' ' } else { *b })
            .collect();
        let decoded: Vec<u8> = percent_encoding::percent_decode(&spaced).collect();
        return String::from_utf8(decoded).ok().map(Secret::new);
    }
    None
}

/// HTML-escapes text for element content and quoted attributes.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for ch in text.chars() {
        match ch {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            _ => out.push(ch),
        }
    }
    out
}

fn page(title: &str, body: &str) -> String {
    format!(
        "<!doctype html>
<html lang=\"en\">
<head>
<meta charset=\"utf-8\">
<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">
<meta name=\"referrer\" content=\"no-referrer\">
<title>{title}</title>
<style>body{{font-family:system-ui,sans-serif;max-width:40rem;margin:3rem auto;padding:0 1rem;line-height:1.5}}dt{{font-weight:600}}dd{{margin:0 0 .6rem 0;word-break:break-word}}input{{width:100%;font:inherit;padding:.4rem;box-sizing:border-box}}button{{font:inherit;margin-top:.8rem;padding:.4rem 1rem}}blockquote{{margin:0;padding-left:.8rem;border-left:3px solid #888;white-space:pre-wrap}}@media (prefers-color-scheme:dark){{body{{background:#111;color:#eee}}}}</style>
</head>
<body>
<h1>{title}</h1>
{body}
</body>
</html>
",
        title = escape(title),
    )
}

fn gone_page(status: u16, message: &str) -> PageReply {
    let title = match status {
        200 => "Secret saved",
        403 => "Refused",
        400 | 422 => "Not accepted",
        _ => "Link not valid",
    };
    PageReply {
        status,
        html: page(title, &format!("<p>{}</p>", escape(message))),
    }
}

fn form_page(ask: &SecretAsk, left: Duration) -> String {
    let mut body = String::new();
    let _ = write!(
        body,
        "<p>An AI assistant asks you for a secret. Its computers will get a placeholder instead of the value; the server puts the value into requests to the hosts below only, in the header shown.</p>
<dl>
<dt>Name</dt><dd><code>{name}</code></dd>
<dt>Sent only to</dt><dd>{hosts}</dd>
<dt>In the header</dt><dd><code>{header}</code></dd>
<dt>The assistant's reason</dt><dd><blockquote>{reason}</blockquote></dd>
</dl>
<form method=\"post\">
<label for=\"value\">Value</label>
<input id=\"value\" name=\"value\" type=\"password\" autocomplete=\"off\" required autofocus>
<button type=\"submit\">Save the secret</button>
</form>
<p><small>This link works once and for {minutes} more minute(s). If you did not expect this request, close the page.</small></p>",
        name = escape(ask.name.as_str()),
        hosts = escape(&ask.hosts_text()),
        header = escape(ask.header.as_str()),
        reason = escape(&ask.reason),
        minutes = left.as_secs().div_ceil(60),
    );
    page("Enter a secret", &body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backends::fake::FakeBackend;

    fn onboarding(ttl: Duration) -> (Onboarding, SecretBook) {
        let book = SecretBook::new([5; 32], None, Vec::new(), HashMap::new(), None);
        let backend: Arc<dyn Backend> = FakeBackend::new();
        let onboarding = Onboarding::with_ttl(book.clone(), backend, ttl);
        onboarding.set_base("http://127.0.0.1:9".to_owned());
        (onboarding, book)
    }

    fn ask() -> SecretAsk {
        SecretAsk {
            name: SecretName::parse("GITHUB_TOKEN").unwrap(),
            hosts: vec![Pattern::parse("api.github.com").unwrap()],
            header: HeaderTemplate::default(),
            reason: "to open <b>pull requests</b> & \"issues\"".to_owned(),
        }
    }

    const HOST: Option<&str> = Some("127.0.0.1:9");

    #[tokio::test]
    async fn a_page_takes_one_value_for_its_principal_only() {
        let (onboarding, book) = onboarding(PAGE_TTL);
        let alice = Principal::parse("alice").unwrap();
        let now = Instant::now();
        let opened = onboarding.open(&alice, ask(), now).await.unwrap();
        assert!(opened.url.starts_with("http://127.0.0.1:9/secrets/enter/"));
        assert_eq!(opened.id.len(), 48);
        let shown = onboarding.show(&opened.id, now);
        assert_eq!(shown.status, 200);
        assert!(shown.html.contains("GITHUB_TOKEN") && shown.html.contains("api.github.com"));
        assert!(
            shown
                .html
                .contains("&lt;b&gt;pull requests&lt;/b&gt; &amp; &quot;issues&quot;")
        );
        assert!(shown.html.contains("type=\"password\""));

        let origin = Some("http://127.0.0.1:9");
        let body = b"value=ghp_abc%2Bdef+x";
        let reply = onboarding.submit(&opened.id, origin, HOST, body, now).await;
        assert_eq!(reply.status, 200, "{}", reply.html);
        assert!(!reply.html.contains("ghp_abc"));
        assert_eq!(opened.done.await.unwrap(), Outcome::Set);
        let bob = Principal::parse("bob").unwrap();
        assert_eq!(book.summaries(&alice).len(), 1);
        assert!(book.summaries(&bob).is_empty());
        let of_alice = crate::ids::ComputerId::parse("box")
            .unwrap()
            .owned_by(&alice);
        let secrets = book.for_computer(&of_alice);
        assert_eq!(secrets[0].value.expose(), "ghp_abc+def x");

        // A second use, whether a look or a value, is refused.
        let again = onboarding
            .submit(&opened.id, origin, HOST, b"value=other", now)
            .await;
        assert_eq!(again.status, 410);
        assert_eq!(onboarding.show(&opened.id, now).status, 410);
        assert_eq!(
            book.for_computer(&of_alice)[0].value.expose(),
            "ghp_abc+def x"
        );
        assert_eq!(onboarding.show("0123", now).status, 404);
    }

    #[tokio::test]
    async fn an_expired_or_withdrawn_page_is_gone() {
        let (onboarding, book) = onboarding(Duration::from_secs(60));
        let alice = Principal::parse("alice").unwrap();
        let now = Instant::now();
        let opened = onboarding.open(&alice, ask(), now).await.unwrap();
        let later = now + Duration::from_secs(61);
        assert_eq!(onboarding.show(&opened.id, later).status, 410);
        let reply = onboarding
            .submit(&opened.id, None, HOST, b"value=v", later)
            .await;
        assert_eq!(reply.status, 410);
        assert!(reply.html.contains("expired"));
        assert!(book.summaries(&alice).is_empty());
        // Long after, it is forgotten.
        assert_eq!(
            onboarding
                .show(&opened.id, now + Duration::from_secs(121))
                .status,
            404
        );

        let withdrawn = onboarding.open(&alice, ask(), now).await.unwrap();
        onboarding.withdraw(&withdrawn.id);
        assert_eq!(onboarding.show(&withdrawn.id, now).status, 410);
        assert!(withdrawn.done.await.is_err());
    }

    #[tokio::test]
    async fn a_foreign_origin_is_refused_and_leaves_the_page_open() {
        let (onboarding, book) = onboarding(PAGE_TTL);
        let alice = Principal::parse("alice").unwrap();
        let now = Instant::now();
        let opened = onboarding.open(&alice, ask(), now).await.unwrap();
        for origin in ["http://evil.test", "null", "http://127.0.0.1:10"] {
            let reply = onboarding
                .submit(&opened.id, Some(origin), HOST, b"value=v", now)
                .await;
            assert_eq!(reply.status, 403, "{origin}");
        }
        assert!(book.summaries(&alice).is_empty());
        let reply = onboarding
            .submit(
                &opened.id,
                Some("HTTP://127.0.0.1:9"),
                HOST,
                b"value=v",
                now,
            )
            .await;
        assert_eq!(reply.status, 200);
    }

    #[tokio::test]
    async fn a_value_no_header_can_carry_is_refused_without_quoting_it() {
        let (onboarding, book) = onboarding(PAGE_TTL);
        let alice = Principal::parse("alice").unwrap();
        let now = Instant::now();
        let opened = onboarding.open(&alice, ask(), now).await.unwrap();
        let reply = onboarding
            .submit(&opened.id, None, HOST, b"value=sk-9xq%0Azz7", now)
            .await;
        assert_eq!(reply.status, 422);
        assert!(!reply.html.contains("sk-9xq") && !reply.html.contains("zz7"));
        match opened.done.await.unwrap() {
            Outcome::Refused(why) => {
                assert!(why.contains("control character") && !why.contains("sk-9xq"))
            }
            other => panic!("{other:?}"),
        }
        assert!(book.summaries(&alice).is_empty());
        assert_eq!(onboarding.show(&opened.id, now).status, 410);
        // A body without the field takes nothing and leaves the page open.
        let other = onboarding.open(&alice, ask(), now).await.unwrap();
        let reply = onboarding
            .submit(&other.id, None, HOST, b"nothing=here", now)
            .await;
        assert_eq!(reply.status, 400);
        assert_eq!(onboarding.show(&other.id, now).status, 200);
    }

    #[tokio::test]
    async fn pages_per_principal_are_capped() {
        let (onboarding, _) = onboarding(PAGE_TTL);
        let alice = Principal::parse("alice").unwrap();
        let now = Instant::now();
        let mut kept = Vec::new();
        for _ in 0..MAX_OPEN_PER_PRINCIPAL {
            kept.push(onboarding.open(&alice, ask(), now).await.unwrap());
        }
        assert!(matches!(
            onboarding.open(&alice, ask(), now).await,
            Err(OpenError::TooMany)
        ));
        let bob = Principal::parse("bob").unwrap();
        assert!(onboarding.open(&bob, ask(), now).await.is_ok());
    }

    #[test]
    fn the_form_value_is_decoded() {
        assert_eq!(form_value(b"a=1&value=x%26y+z").unwrap().expose(), "x&y z");
        assert_eq!(form_value(b"value=").unwrap().expose(), "");
        assert!(form_value(b"a=1").is_none());
        assert!(form_value(b"value=%FF").is_none());
    }
}
