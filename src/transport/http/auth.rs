//! Who is calling (docs/auth.md): every request to `/mcp` and the port routes is authenticated
//! to a [`Principal`] by the single token (`default`), a named token of `--auth-tokens-file`,
//! or an OAuth access token ([`oauth`]); or refused with 401/403 and a `WWW-Authenticate`
//! challenge that tells an OAuth client where to find the protected-resource metadata. The
//! principal travels on in the request's extensions. Tokens are compared in constant time and
//! never logged; one audit line records each request's outcome, with the path capped and
//! escaped ([`loggable`]); refusal lines, which anyone can cause, at a bounded rate
//! ([`RefusalLog`]).

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE, WWW_AUTHENTICATE};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use subtle::ConstantTimeEq;

use crate::ids::Principal;
use crate::secret::Secret;

pub mod allowance;
#[cfg(feature = "oauth")]
pub mod oauth;

/// The audit log's target: `RUST_LOG=kilntainers::audit=info` keeps it when others are off.
pub const AUDIT: &str = "kilntainers::audit";

/// Largest tokens file read.
const MAX_TOKENS_FILE_BYTES: u64 = 1024 * 1024;
/// Shortest token a tokens-file line may give: 16 bytes of random text are out of reach of
/// guessing, at the rates any listener answers; shorter ones are typos or passwords.
const MIN_TOKEN_BYTES: usize = 16;

/// Longest request path (or method, or Host) written to a log line, in bytes once escaped;
/// the rest is counted, not written. Paths of the routes are far shorter; a request can carry
/// one of 64 KiB.
pub const MAX_LOGGED_TEXT: usize = 256;
/// Refusal lines written at once, and then per second: anyone who reaches the listener can
/// cause one per request, so a flood must not become a flood of log.
const REFUSAL_LINES_BURST: u32 = 20;
const REFUSAL_LINES_PER_SECOND: u32 = 10;

/// `text` (a request path, method or Host) as it can go into a log line: every byte outside
/// printable ASCII as `%XX`, so nothing in it can end the line, move a terminal's cursor or
/// reorder what a reader sees (bidirectional controls); at most [`MAX_LOGGED_TEXT`] bytes, then
/// `… (<n> bytes)` with the whole length.
pub fn loggable(text: &str) -> String {
    let mut shown = String::with_capacity(text.len().min(MAX_LOGGED_TEXT) + 24);
    for byte in text.bytes() {
        let piece_len = if byte.is_ascii_graphic() { 1 } else { 3 };
        if shown.len() + piece_len > MAX_LOGGED_TEXT {
            shown.push_str(&format!("… ({} bytes)", text.len()));
            return shown;
        }
        if byte.is_ascii_graphic() {
            shown.push(char::from(byte));
        } else {
            shown.push_str(&format!("%{byte:02X}"));
        }
    }
    shown
}

/// The gate of refusal lines: [`REFUSAL_LINES_BURST`] at once, then
/// [`REFUSAL_LINES_PER_SECOND`]; the lines left out are counted, and the next line written
/// says how many (`suppressed=<n>`).
#[derive(Debug)]
pub struct RefusalLog {
    lines: allowance::Allowance,
    suppressed: std::sync::atomic::AtomicU64,
}

impl Default for RefusalLog {
    fn default() -> Self {
        Self {
            lines: allowance::Allowance::new(
                REFUSAL_LINES_BURST,
                std::time::Duration::from_secs(1) / REFUSAL_LINES_PER_SECOND,
            ),
            suppressed: std::sync::atomic::AtomicU64::new(0),
        }
    }
}

impl RefusalLog {
    /// Whether a refusal line may be written now; if so, how many were left out before it
    /// (`None` for none, so that the field appears only when it says something).
    pub fn admit(&self) -> Option<Option<u64>> {
        use std::sync::atomic::Ordering;
        match self.lines.take() {
            Ok(()) => Some(Some(self.suppressed.swap(0, Ordering::Relaxed)).filter(|n| *n > 0)),
            Err(_) => {
                self.suppressed.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }
}

/// Why a request was not let in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// No `Authorization: Bearer` at all.
    Missing,
    /// A token that no configured source accepts; the text says why (never the token).
    Invalid(String),
    /// A valid OAuth token without every required scope.
    #[cfg_attr(
        not(feature = "oauth"),
        expect(dead_code, reason = "only OAuth tokens carry scopes")
    )]
    InsufficientScope,
}

/// `--auth-tokens-file`: principals by token, re-read on SIGHUP.
pub struct NamedTokens {
    path: PathBuf,
    entries: RwLock<Vec<(Principal, Secret)>>,
}

impl std::fmt::Debug for NamedTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NamedTokens")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl NamedTokens {
    /// Reads and checks the file; the error is the startup message.
    pub fn load(path: &Path) -> Result<Self, String> {
        Ok(Self {
            path: path.to_owned(),
            entries: RwLock::new(read_tokens_file(path)?),
        })
    }

    /// Re-reads the file; the number of principals. A file that does not load is no reason to
    /// keep honouring what it no longer says: the tokens whose lines are still in it, exactly,
    /// stay valid, and every other is revoked at once; a file that cannot be read at all (gone,
    /// opened to others, too large) leaves none of its tokens valid (docs/auth.md).
    pub fn reload(&self) -> Result<usize, ReloadFailure> {
        let (error, text) = match read_tokens_text(&self.path) {
            Ok(text) => match parse_tokens(&text) {
                Ok(entries) => {
                    let count = entries.len();
                    *self.write() = entries;
                    return Ok(count);
                }
                Err(error) => (
                    format!("--auth-tokens-file {}: {error}", self.path.display()),
                    Some(text),
                ),
            },
            Err(error) => (error, None),
        };
        let mut entries = self.write();
        let before = entries.len();
        entries.retain(|(principal, token)| {
            text.as_deref()
                .is_some_and(|text| still_granted(text, principal, token))
        });
        Err(ReloadFailure {
            error,
            kept: entries.len(),
            revoked: before - entries.len(),
        })
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Vec<(Principal, Secret)>> {
        self.entries
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The principal whose token `presented` is. Every entry is compared, in constant time
    /// each, so the time taken says nothing about which (or whether one) matched.
    fn principal(&self, presented: &str) -> Option<Principal> {
        let entries = self
            .entries
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut found = None;
        for (principal, token) in entries.iter() {
            let equal: bool = presented.as_bytes().ct_eq(token.expose().as_bytes()).into();
            if equal {
                found = Some(principal.clone());
            }
        }
        found
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// A reload that did not load the file: why, and what became of the tokens in use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReloadFailure {
    /// The file's error, as at startup.
    pub error: String,
    /// Tokens whose lines are still in the file, exactly and once: still valid.
    pub kept: usize,
    /// Tokens no longer valid.
    pub revoked: usize,
}

/// Whether `text`, a tokens file that does not load as a whole, still has the line
/// `<principal> <token>`, and gives the token on no other line.
fn still_granted(text: &str, principal: &Principal, token: &Secret) -> bool {
    let lines: Vec<Vec<&str>> = text
        .lines()
        .filter(|line| !line.trim_start().starts_with('#'))
        .map(|line| line.split_whitespace().collect())
        .collect();
    let exact = lines
        .iter()
        .filter(|fields| fields[..] == [principal.as_str(), token.expose()])
        .count();
    let anywhere = lines
        .iter()
        .filter(|fields| fields.iter().any(|field| *field == token.expose()))
        .count();
    exact == 1 && anywhere == 1
}

/// Reads and checks a tokens file: `<principal> <token>` per line, `#` comment lines, blank
/// lines. Refused when group or others may read it, since every line is a credential.
fn read_tokens_file(path: &Path) -> Result<Vec<(Principal, Secret)>, String> {
    let text = read_tokens_text(path)?;
    parse_tokens(&text).map_err(|e| format!("--auth-tokens-file {}: {e}", path.display()))
}

/// The text of a tokens file that only its owner can read, within [`MAX_TOKENS_FILE_BYTES`].
fn read_tokens_text(path: &Path) -> Result<String, String> {
    use std::io::Read;
    use std::os::unix::fs::PermissionsExt;
    let shown = path.display();
    let file = std::fs::File::open(path)
        .map_err(|e| format!("Cannot read --auth-tokens-file {shown}: {e}"))?;
    let meta = file
        .metadata()
        .map_err(|e| format!("Cannot read --auth-tokens-file {shown}: {e}"))?;
    if !meta.is_file() {
        return Err(format!("--auth-tokens-file {shown} is not a regular file."));
    }
    if meta.permissions().mode() & 0o077 != 0 {
        return Err(format!(
            "--auth-tokens-file {shown} is readable or writable by group or others (mode {:o}); its lines are credentials. Run: chmod 600 {shown}",
            meta.permissions().mode() & 0o777
        ));
    }
    let mut text = String::new();
    file.take(MAX_TOKENS_FILE_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(|e| format!("Cannot read --auth-tokens-file {shown}: {e}"))?;
    if text.len() as u64 > MAX_TOKENS_FILE_BYTES {
        return Err(format!(
            "--auth-tokens-file {shown} is larger than {MAX_TOKENS_FILE_BYTES} bytes."
        ));
    }
    Ok(text)
}

fn parse_tokens(text: &str) -> Result<Vec<(Principal, Secret)>, String> {
    let mut entries: Vec<(Principal, Secret)> = Vec::new();
    for (index, line) in text.lines().enumerate() {
        let number = index + 1;
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let fields: Vec<&str> = line.split_whitespace().collect();
        let [name, token] = fields[..] else {
            return Err(format!(
                "line {number}: expected '<principal> <token>' (two fields separated by whitespace), got {} fields.",
                fields.len()
            ));
        };
        let principal = Principal::named(name)
            .map_err(|why| format!("line {number}: the principal name {why}."))?;
        if entries.iter().any(|(p, _)| *p == principal) {
            return Err(format!(
                "line {number}: principal '{principal}' appears twice."
            ));
        }
        if token.len() < MIN_TOKEN_BYTES {
            return Err(format!(
                "line {number}: the token is {} bytes; a token must be at least {MIN_TOKEN_BYTES} bytes (make one with: openssl rand -hex 32).",
                token.len()
            ));
        }
        if entries.iter().any(|(_, t)| t.expose() == token) {
            return Err(format!(
                "line {number}: this token is already given to another principal."
            ));
        }
        entries.push((principal, Secret::new(token)));
    }
    if entries.is_empty() {
        return Err("no '<principal> <token>' line.".to_owned());
    }
    Ok(entries)
}

/// Every way this server accepts a caller. With none configured, everyone is `default`.
pub struct Authenticator {
    /// `--auth-token` (or the generated one): principal `default`.
    single: Option<Secret>,
    named: Option<Arc<NamedTokens>>,
    #[cfg(feature = "oauth")]
    oauth: Option<Arc<oauth::Verifier>>,
    /// The gate of every refusal line of this listener, the guard's included.
    pub refusals: RefusalLog,
}

impl std::fmt::Debug for Authenticator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authenticator")
            .field("single", &self.single.is_some())
            .field("named", &self.named)
            .finish_non_exhaustive()
    }
}

impl Authenticator {
    pub fn new(single: Option<Secret>, named: Option<Arc<NamedTokens>>) -> Self {
        Self {
            single: single.filter(|t| !t.expose().is_empty()),
            named,
            #[cfg(feature = "oauth")]
            oauth: None,
            refusals: RefusalLog::default(),
        }
    }

    #[cfg(feature = "oauth")]
    pub fn with_oauth(mut self, verifier: Arc<oauth::Verifier>) -> Self {
        self.oauth = Some(verifier);
        self
    }

    /// Whether any credential is required.
    pub fn enabled(&self) -> bool {
        self.single.is_some() || self.named.is_some() || self.oauth_enabled()
    }

    fn oauth_enabled(&self) -> bool {
        #[cfg(feature = "oauth")]
        return self.oauth.is_some();
        #[cfg(not(feature = "oauth"))]
        false
    }

    /// The caller of a request with this `Authorization` header value.
    pub async fn authenticate(&self, authorization: Option<&[u8]>) -> Result<Principal, Refusal> {
        if !self.enabled() {
            return Ok(Principal::default_principal());
        }
        let Some(presented) = bearer(authorization) else {
            return Err(if authorization.is_some() {
                Refusal::Invalid("expected 'Authorization: Bearer <token>'".to_owned())
            } else {
                Refusal::Missing
            });
        };
        if let Some(single) = &self.single {
            let equal: bool = presented
                .as_bytes()
                .ct_eq(single.expose().as_bytes())
                .into();
            if equal {
                return Ok(Principal::default_principal());
            }
        }
        if let Some(principal) = self.named.as_ref().and_then(|n| n.principal(presented)) {
            return Ok(principal);
        }
        #[cfg(feature = "oauth")]
        if let Some(verifier) = &self.oauth {
            return verifier.verify(presented).await;
        }
        Err(Refusal::Invalid("unknown token".to_owned()))
    }

    /// The `WWW-Authenticate` value for a refusal.
    fn challenge(&self, refusal: &Refusal) -> String {
        #[cfg(feature = "oauth")]
        if let Some(verifier) = &self.oauth {
            return verifier.challenge(refusal);
        }
        let _ = refusal;
        // Without OAuth the answer stays what single-token clients have always seen.
        "Bearer".to_owned()
    }

    /// The protected-resource metadata document, when OAuth is on.
    pub fn resource_metadata(&self) -> Option<serde_json::Value> {
        #[cfg(feature = "oauth")]
        if let Some(verifier) = &self.oauth {
            return Some(verifier.resource_metadata());
        }
        None
    }
}

/// The token of an `Authorization: Bearer <token>` value (scheme case-insensitive).
fn bearer(authorization: Option<&[u8]>) -> Option<&str> {
    let value = std::str::from_utf8(authorization?).ok()?;
    let (scheme, token) = value.trim().split_once(char::is_whitespace)?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// The response to a refused request.
fn refused(auth: &Authenticator, refusal: &Refusal) -> Response {
    let (status, body) = match refusal {
        Refusal::InsufficientScope => (StatusCode::FORBIDDEN, r#"{"error":"insufficient_scope"}"#),
        Refusal::Missing | Refusal::Invalid(_) if !auth.oauth_enabled() => {
            (StatusCode::UNAUTHORIZED, r#"{"error":"unauthorized"}"#)
        }
        Refusal::Missing => (StatusCode::UNAUTHORIZED, r#"{"error":"unauthorized"}"#),
        Refusal::Invalid(_) => (StatusCode::UNAUTHORIZED, r#"{"error":"invalid_token"}"#),
    };
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    let challenge = auth.challenge(refusal);
    headers.insert(
        WWW_AUTHENTICATE,
        HeaderValue::try_from(challenge).unwrap_or_else(|_| HeaderValue::from_static("Bearer")),
    );
    response
}

/// The principal [`require_auth`] attached to the request; `default` where no authentication
/// runs (an open server).
pub fn principal_of(request: &Request) -> Principal {
    request
        .extensions()
        .get::<Principal>()
        .cloned()
        .unwrap_or_else(Principal::default_principal)
}

/// Authenticates the request, puts its [`Principal`] in the extensions, and logs the outcome.
pub async fn require_auth(
    State(auth): State<Arc<Authenticator>>,
    mut request: Request,
    next: Next,
) -> Response {
    let presented = request
        .headers()
        .get(AUTHORIZATION)
        .map(HeaderValue::as_bytes);
    let method = loggable(request.method().as_str());
    let path = loggable(request.uri().path());
    match auth.authenticate(presented).await {
        Ok(principal) => {
            request.extensions_mut().insert(principal.clone());
            let response = next.run(request).await;
            tracing::info!(
                target: AUDIT,
                principal = %principal,
                method,
                path,
                status = response.status().as_u16(),
                "request"
            );
            response
        }
        Err(refusal) => {
            let response = refused(&auth, &refusal);
            if let Some(suppressed) = auth.refusals.admit() {
                let reason = match &refusal {
                    Refusal::Missing => "no bearer token".to_owned(),
                    Refusal::Invalid(reason) => reason.clone(),
                    Refusal::InsufficientScope => "missing required scope".to_owned(),
                };
                tracing::warn!(
                    target: AUDIT,
                    method,
                    path,
                    status = response.status().as_u16(),
                    reason,
                    suppressed,
                    "request refused"
                );
            }
            response
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file in a scratch directory of this test process, removed by [`Scratch`]'s drop.
    struct Scratch(PathBuf);

    impl Scratch {
        fn file(name: &str, text: &str, mode: u32) -> Self {
            use std::os::unix::fs::PermissionsExt;
            let dir = std::env::temp_dir().join(format!(
                "kilntainers-auth-test-{}-{name}",
                std::process::id()
            ));
            std::fs::create_dir_all(&dir).unwrap();
            let path = dir.join("tokens");
            std::fs::write(&path, text).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            Self(path)
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            if let Some(dir) = self.0.parent() {
                let _ = std::fs::remove_dir_all(dir);
            }
        }
    }

    fn block_on<T>(future: impl std::future::Future<Output = T>) -> T {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(future)
    }

    /// Tokens of the 16 bytes a line needs at least.
    const A: &str = "token-a-16-bytes";
    const B: &str = "token-b-16-bytes";
    const C: &str = "token-c-16-bytes";

    #[test]
    fn tokens_file_lines_name_principals() {
        let entries = parse_tokens(&format!("# team\nalice  {A}\n\n  bob\t{B}  \n")).unwrap();
        let names: Vec<&str> = entries.iter().map(|(p, _)| p.as_str()).collect();
        assert_eq!(names, ["alice", "bob"]);
        for (bad, why) in [
            ("alice".to_owned(), "expected"),
            (format!("alice {A} b"), "3 fields"),
            (format!("alice {A}\nalice {B}"), "appears twice"),
            (format!("alice {A}\nbob {A}"), "already given"),
            ("# only a comment".to_owned(), "no '<principal>"),
            (
                format!("https://id.example.com#bob {A}"),
                "only OAuth principals",
            ),
            (format!("bo\u{200b}b {A}"), "U+200B"),
            (
                format!("alice {A}\nbob thirteen-byte"),
                "line 2: the token is 13 bytes; a token must be at least 16 bytes",
            ),
        ] {
            let error = parse_tokens(&bad).unwrap_err();
            assert!(error.contains(why), "{bad:?}: {error}");
        }
    }

    #[test]
    fn tokens_file_readable_by_others_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let scratch = Scratch::file("perm", &format!("alice {A}\n"), 0o644);
        let path = scratch.0.clone();
        let error = NamedTokens::load(&path).unwrap_err();
        assert!(error.contains("chmod 600"), "{error}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        let tokens = NamedTokens::load(&path).unwrap();
        assert_eq!(tokens.principal(A).unwrap().as_str(), "alice");
        std::fs::write(&path, format!("bob {B}\n")).unwrap();
        assert_eq!(tokens.reload(), Ok(1));
        assert!(tokens.principal(A).is_none());
    }

    #[test]
    fn a_failed_reload_keeps_only_the_lines_still_in_the_file() {
        // See: issue 30
        use std::os::unix::fs::PermissionsExt;
        let scratch = Scratch::file("reload", &format!("alice {A}\nbob {B}\ncarol {C}\n"), 0o600);
        let path = scratch.0.clone();
        let tokens = NamedTokens::load(&path).unwrap();
        // alice's line gone, carol's token moved onto a broken line, bob's kept.
        std::fs::write(&path, format!("bob {B}\ncarol {C} extra\n# alice {A}\n")).unwrap();
        let failure = tokens.reload().unwrap_err();
        assert!(failure.error.contains("line 2"), "{failure:?}");
        assert_eq!((failure.kept, failure.revoked), (1, 2));
        assert!(tokens.principal(A).is_none() && tokens.principal(C).is_none());
        assert_eq!(tokens.principal(B).unwrap().as_str(), "bob");
        // A token given on two lines of a broken file is nobody's.
        std::fs::write(&path, format!("bob {B}\ndave {B}\nbroken\n")).unwrap();
        assert_eq!(tokens.reload().unwrap_err().kept, 0);
        assert!(tokens.principal(B).is_none());
        // Unreadable as a whole (opened to others): none of the file's tokens.
        std::fs::write(&path, format!("bob {B}\n")).unwrap();
        assert_eq!(tokens.reload(), Ok(1));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).unwrap();
        let failure = tokens.reload().unwrap_err();
        assert_eq!((failure.kept, failure.revoked), (0, 1));
        assert!(tokens.principal(B).is_none());
    }

    #[test]
    fn logged_text_is_escaped_and_capped() {
        // See: issue 30
        assert_eq!(loggable("/computers/x/ports/80/"), "/computers/x/ports/80/");
        assert_eq!(
            loggable("/a b\n\u{1b}[2J\u{202e}"),
            "/a%20b%0A%1B[2J%E2%80%AE"
        );
        let long = format!("/p/{}", "a".repeat(50_000));
        let shown = loggable(&long);
        assert!(shown.len() <= MAX_LOGGED_TEXT + 24, "{}", shown.len());
        assert!(
            shown.starts_with("/p/aaa") && shown.ends_with("… (50003 bytes)"),
            "{shown}"
        );
        // An escape is never cut in half.
        let shown = loggable(&"\u{7f}".repeat(200));
        assert!(
            shown
                .trim_end_matches(" (200 bytes)")
                .trim_end_matches('…')
                .ends_with("%7F")
        );
    }

    #[test]
    fn refusal_lines_are_rationed_and_counted() {
        let log = RefusalLog::default();
        let written = (0..100).filter(|_| log.admit().is_some()).count();
        // The burst, plus what refilled while the loop ran (a few at most).
        assert!((20..25).contains(&written), "{written}");
        // The next line once the rate allows one, within a second (polled).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let mut admitted = log.admit();
        while admitted.is_none() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(20));
            admitted = log.admit();
        }
        let suppressed = admitted.flatten().unwrap();
        assert!(suppressed >= 100 - 25, "{suppressed}");
    }

    #[test]
    fn callers_map_to_principals() {
        let scratch = Scratch::file("map", &format!("alice {A}\nbob {B}\n"), 0o600);
        let named = Arc::new(NamedTokens::load(&scratch.0).unwrap());
        let auth = Authenticator::new(Some(Secret::new("single")), Some(named));
        let who = |header: Option<&'static [u8]>| block_on(auth.authenticate(header));
        assert_eq!(who(Some(b"Bearer single")).unwrap().as_str(), "default");
        assert_eq!(who(Some(b"BEARER   single")).unwrap().as_str(), "default");
        assert!(matches!(
            who(Some(b"Bearer singl")),
            Err(Refusal::Invalid(_))
        ));
        assert!(matches!(
            who(Some(b"Bearer SINGLE")),
            Err(Refusal::Invalid(_))
        ));
        assert_eq!(
            who(Some(b"bearer token-a-16-bytes")).unwrap().as_str(),
            "alice"
        );
        assert_eq!(
            who(Some(b"Bearer token-b-16-bytes")).unwrap().as_str(),
            "bob"
        );
        assert_eq!(who(None), Err(Refusal::Missing));
        assert!(matches!(
            who(Some(b"Bearer token-c")),
            Err(Refusal::Invalid(_))
        ));
        assert!(matches!(
            who(Some(b"Basic token-a-16-bytes")),
            Err(Refusal::Invalid(_))
        ));
        let open = Authenticator::new(None, None);
        assert_eq!(
            block_on(open.authenticate(None)).unwrap(),
            Principal::default_principal()
        );
    }
}
