//! Validated identifiers: [`ComputerId`] (a computer, scoped to its owner), [`Principal`] (who
//! a request acts for, tokens-file and OAuth names kept apart), [`InstanceId`] (one server process), [`ExecId`] (the tag carried by
//! every command's process tree) and [`JobId`] (a command that outlives its tool call).
//!
//! Everything past the MCP argument layer takes these types, never `&str`, so the slug rule of
//! docs/decisions.md, "Computer ids" is checked exactly once. This module knows nothing about providers.

use std::fmt;

use rand::RngExt;

/// The exact message for a malformed `computer_id` (docs/decisions.md, "Computer ids").
pub const INVALID_COMPUTER_ID: &str = "computer_id must be 1-63 lowercase letters, numbers, or hyphens; it must start and end with a letter or number.";

/// Length of the owner tag in a scoped computer id (docs/auth.md, "Computer ids per principal").
const OWNER_TAG_LEN: usize = 16;

/// A computer, as providers know it: the user-facing slug (trimmed, 1-63 chars of `[a-z0-9-]`,
/// alphanumeric at both ends), followed for a principal other than `default` by `.` and the
/// owner tag (docs/auth.md, "Computer ids per principal"). Display and [`ComputerId::as_str`]
/// give this whole provider-side key; clients only ever see [`ComputerId::slug`].
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ComputerId(String);

fn is_slug(slug: &str) -> bool {
    let bytes = slug.as_bytes();
    let edge_ok = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    !bytes.is_empty()
        && bytes.len() <= 63
        && bytes.iter().all(|&b| edge_ok(b) || b == b'-')
        && bytes.first().copied().is_some_and(edge_ok)
        && bytes.last().copied().is_some_and(edge_ok)
}

fn is_owner_tag(tag: &str) -> bool {
    tag.len() == OWNER_TAG_LEN
        && tag
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

impl ComputerId {
    /// A client's id: trims surrounding whitespace and checks the slug rule. The result is the
    /// `default` principal's computer; [`ComputerId::owned_by`] scopes it to another.
    pub fn parse(raw: &str) -> Result<Self, InvalidComputerId> {
        let slug = raw.trim();
        if is_slug(slug) {
            Ok(Self(slug.to_owned()))
        } else {
            Err(InvalidComputerId)
        }
    }

    /// A provider-side key read back from a label, metadata or name: a slug, optionally
    /// followed by `.` and an owner tag.
    pub fn parse_stored(raw: &str) -> Result<Self, InvalidComputerId> {
        let valid = match raw.split_once('.') {
            Some((slug, tag)) => is_slug(slug) && is_owner_tag(tag),
            None => is_slug(raw),
        };
        if valid {
            Ok(Self(raw.to_owned()))
        } else {
            Err(InvalidComputerId)
        }
    }

    /// The same slug as `principal`'s computer. The `default` principal's ids stay bare, so
    /// the computers of the single-token and stdio modes keep their names.
    #[must_use]
    pub fn owned_by(&self, principal: &Principal) -> Self {
        match principal.tag() {
            None => Self(self.slug().to_owned()),
            Some(tag) => Self(format!("{}.{tag}", self.slug())),
        }
    }

    /// Whether this computer is `principal`'s.
    pub fn belongs_to(&self, principal: &Principal) -> bool {
        self.0.split_once('.').map(|(_, tag)| tag) == principal.tag().as_deref()
    }

    /// What a client sees: the id without its owner tag.
    pub fn slug(&self) -> &str {
        self.0.split_once('.').map_or(&self.0, |(slug, _)| slug)
    }

    /// A readable random slug `<adjective>-<noun>-<hex4>`; uniqueness is the caller's check.
    pub fn random() -> Self {
        const ADJECTIVES: [&str; 12] = [
            "amber", "brisk", "calm", "clever", "coral", "crisp", "gentle", "lucky", "quiet",
            "rapid", "silver", "steady",
        ];
        const NOUNS: [&str; 12] = [
            "badger", "comet", "falcon", "gecko", "heron", "lynx", "otter", "panda", "raven",
            "tiger", "whale", "wolf",
        ];
        let mut rng = rand::rng();
        let adjective = ADJECTIVES[rng.random_range(0..ADJECTIVES.len())];
        let noun = NOUNS[rng.random_range(0..NOUNS.len())];
        let suffix: u16 = rng.random();
        Self(format!("{adjective}-{noun}-{suffix:04x}"))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ComputerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The slug rule was violated; displays as [`INVALID_COMPUTER_ID`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", INVALID_COMPUTER_ID)]
pub struct InvalidComputerId;

/// Who a request acts for: a tokens-file name, an OAuth principal (`<issuer>#<claim value>`), or
/// `default` (stdio, the single `--auth-token`, unauthenticated HTTP). Computers are per
/// principal (docs/auth.md, "Who is calling").
///
/// The two namespaces cannot meet: every OAuth principal contains the issuer's `://`, and no
/// tokens-file name may ([`Principal::named`]). So an OAuth subject `bob` is not the tokens
/// file's `bob`, nor the subject `bob` of another issuer.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Principal(String);

/// Longest tokens-file name or OAuth claim value, in bytes.
const MAX_NAME_LEN: usize = 256;
/// Longest whole principal read back from a label or metadata, in bytes: an OAuth claim value
/// of [`MAX_NAME_LEN`] after an issuer URL.
const MAX_STORED_LEN: usize = 1024;
/// What every OAuth principal contains and no tokens-file name may.
const OAUTH_MARK: &str = "://";

/// Why a name cannot be a principal; the text completes "the principal name …".
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidPrincipal {
    #[error("must be 1-{MAX_NAME_LEN} bytes long")]
    Length,
    #[error("contains whitespace or a control character")]
    Control,
    #[error(
        "contains U+{0:04X}, an invisible Unicode format character that would make two different names look the same"
    )]
    Format(u32),
    #[error("contains '://', which only OAuth principals (<issuer>#<claim>) have")]
    OAuthForm,
}

/// Unicode general category Cf (format characters, as of Unicode 15.0): invisible characters such as
/// zero-width spaces and joiners, bidirectional overrides and the byte-order mark, with which
/// `bob` and `bo\u{200b}b` would read the same in a log line or a label listing.
fn is_format_char(c: char) -> bool {
    matches!(
        u32::from(c),
        0x00AD
            | 0x0600..=0x0605
            | 0x061C
            | 0x06DD
            | 0x070F
            | 0x0890..=0x0891
            | 0x08E2
            | 0x180E
            | 0x200B..=0x200F
            | 0x202A..=0x202E
            | 0x2060..=0x2064
            | 0x2066..=0x206F
            | 0xFEFF
            | 0xFFF9..=0xFFFB
            | 0x110BD
            | 0x110CD
            | 0x13430..=0x1343F
            | 0x1BCA0..=0x1BCA3
            | 0x1D173..=0x1D17A
            | 0xE0001
            | 0xE0020..=0xE007F
    )
}

/// The character rules every principal keeps: principals end up in labels and log lines.
fn check_characters(raw: &str) -> Result<(), InvalidPrincipal> {
    if raw.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(InvalidPrincipal::Control);
    }
    if let Some(c) = raw.chars().find(|c| is_format_char(*c)) {
        return Err(InvalidPrincipal::Format(u32::from(c)));
    }
    Ok(())
}

/// A tokens-file name or an OAuth claim value: 1-256 bytes and [`check_characters`].
fn check_name(raw: &str) -> Result<(), InvalidPrincipal> {
    if raw.is_empty() || raw.len() > MAX_NAME_LEN {
        return Err(InvalidPrincipal::Length);
    }
    check_characters(raw)
}

impl Principal {
    pub const DEFAULT_NAME: &'static str = "default";

    /// The principal of stdio and of single-token HTTP; owns every computer made before
    /// principals existed.
    pub fn default_principal() -> Self {
        Self(Self::DEFAULT_NAME.to_owned())
    }

    /// A name of `--auth-tokens-file`: 1-256 bytes without whitespace, control or format
    /// characters, and without `://`, which marks the OAuth namespace.
    pub fn named(raw: &str) -> Result<Self, InvalidPrincipal> {
        check_name(raw)?;
        if raw.contains(OAUTH_MARK) {
            return Err(InvalidPrincipal::OAuthForm);
        }
        Ok(Self(raw.to_owned()))
    }

    /// The principal of an OAuth token: `value` (its principal claim, 1-256 bytes, the same
    /// characters as a tokens-file name) qualified by the issuer, as `<issuer>#<value>`, since a
    /// subject is unique only within its issuer (OpenID Connect Core §2). A trailing `/` of the
    /// issuer is dropped, so both spellings of one issuer name the same principals.
    pub fn oauth(issuer: &str, value: &str) -> Result<Self, InvalidPrincipal> {
        check_name(value)?;
        Ok(Self(format!("{}#{value}", issuer.trim_end_matches('/'))))
    }

    /// Any principal as this server wrote it into a label or metadata.
    pub fn parse(raw: &str) -> Option<Self> {
        let ok = !raw.is_empty() && raw.len() <= MAX_STORED_LEN && check_characters(raw).is_ok();
        ok.then(|| Self(raw.to_owned()))
    }

    pub fn is_default(&self) -> bool {
        self.0 == Self::DEFAULT_NAME
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The owner tag of this principal's computer ids: [`Principal::digest_tag`]; none for
    /// `default`, whose ids are the reference's.
    fn tag(&self) -> Option<String> {
        (!self.is_default()).then(|| self.digest_tag())
    }

    /// The first 16 hex digits of the SHA-256 of the name, for every principal: fixed length
    /// and free of whatever characters the name has, for names of provider objects that
    /// belong to one principal (computer ids, Docker networks).
    pub fn digest_tag(&self) -> String {
        use sha2::Digest;
        let digest = sha2::Sha256::digest(self.0.as_bytes());
        let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
        hex[..OWNER_TAG_LEN].to_owned()
    }
}

impl fmt::Display for Principal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// One running server process: 16 random lowercase hex digits.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct InstanceId(String);

impl InstanceId {
    pub fn random() -> Self {
        let value: u64 = rand::rng().random();
        Self(format!("{value:016x}"))
    }

    /// Accepts only the shape [`InstanceId::random`] produces, so a lock file name or a label
    /// value from elsewhere cannot smuggle in a path.
    pub fn parse(raw: &str) -> Option<Self> {
        let ok = raw.len() == 16
            && raw
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        ok.then(|| Self(raw.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for InstanceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The provider's handle of one incarnation of a computer: a container id (12 hex digits) on
/// Docker, a Machine id on Fly, a sandbox id on E2B and Modal, a directory name for WASM. It
/// changes on factory reset while the [`ComputerId`] stays, so the two must never be confused:
/// backends take this type where they talk to the provider about an incarnation.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub struct SandboxId(String);

impl SandboxId {
    /// Whatever the provider calls the incarnation; the provider's answer is the only source.
    pub fn new(id: impl Into<String>) -> Self {
        Self(id.into())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for SandboxId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The exec tag: a UUID v4 set as `KILNTAINERS_EXEC_ID` on a command so its whole process tree
/// can be found and killed (docs/decisions.md, "Killing a command").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecId(String);

impl ExecId {
    pub const ENV_NAME: &'static str = "KILNTAINERS_EXEC_ID";

    pub fn random() -> Self {
        Self(uuid::Uuid::new_v4().to_string())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// `KILNTAINERS_EXEC_ID=<uuid>`, the form placed in the process environment.
    pub fn env_entry(&self) -> String {
        format!("{}={}", Self::ENV_NAME, self.0)
    }

    /// The tag values of jobs start with this, so that kill sweeps of other commands leave a
    /// job's orphans alone (docs/jobs.md, "Inside the computer").
    pub const JOB_PREFIX: &'static str = "job";

    /// The tag of a job's command and everything it starts.
    pub fn for_job(job: &JobId) -> Self {
        Self(format!("job-{job}"))
    }
}

/// A job: `j-` and 8 lowercase hex digits, unique per computer (docs/jobs.md, "Job ids").
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct JobId(String);

impl JobId {
    pub fn random() -> Self {
        let value: u32 = rand::rng().random();
        Self(format!("j-{value:08x}"))
    }

    /// Accepts only the shape [`JobId::random`] produces: the id becomes a path in the computer.
    pub fn parse(raw: &str) -> Option<Self> {
        let raw = raw.trim();
        let ok = raw.len() == 10
            && raw.starts_with("j-")
            && raw[2..]
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        ok.then(|| Self(raw.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_and_trims_valid_slugs() {
        assert_eq!(
            ComputerId::parse(" dev-box ").map(|c| c.0),
            Ok("dev-box".to_owned())
        );
        assert!(ComputerId::parse("a").is_ok());
        assert!(ComputerId::parse("a--b").is_ok());
        assert!(ComputerId::parse(&"a".repeat(63)).is_ok());
    }

    #[test]
    fn rejects_invalid_slugs() {
        for bad in [
            "",
            "   ",
            "UPPER",
            "with space",
            "-leading",
            "trailing-",
            "under_score",
            "é",
        ] {
            assert_eq!(ComputerId::parse(bad), Err(InvalidComputerId), "{bad:?}");
        }
        assert!(ComputerId::parse(&"a".repeat(64)).is_err());
        assert_eq!(InvalidComputerId.to_string(), INVALID_COMPUTER_ID);
    }

    #[test]
    fn ids_are_scoped_to_their_principal() {
        let dev_box = ComputerId::parse("dev-box").unwrap();
        let default = Principal::default_principal();
        let alice = Principal::parse("alice").unwrap();
        assert_eq!(dev_box.owned_by(&default), dev_box);
        let alices = dev_box.owned_by(&alice);
        // sha256("alice") = 2bd806c97f0e00af...
        assert_eq!(alices.as_str(), "dev-box.2bd806c97f0e00af");
        assert_eq!(alices.slug(), "dev-box");
        assert!(alices.belongs_to(&alice) && !alices.belongs_to(&default));
        assert!(dev_box.belongs_to(&default) && !dev_box.belongs_to(&alice));
        assert_eq!(alices.owned_by(&alice), alices);
        assert_eq!(
            ComputerId::parse_stored(alices.as_str()),
            Ok(alices.clone())
        );
        assert_eq!(ComputerId::parse_stored("dev-box"), Ok(dev_box));
        for bad in [
            "dev-box.",
            "dev-box.xyz",
            "dev-box.2BD806C97F0E00AF",
            "Dev.2bd806c97f0e00af",
            "a.b.c",
        ] {
            assert!(ComputerId::parse_stored(bad).is_err(), "{bad}");
        }
        // A client cannot name another principal's key.
        assert!(ComputerId::parse(alices.as_str()).is_err());
    }

    #[test]
    fn principals_are_printable_names() {
        assert!(Principal::named("alice@example.com").is_ok());
        assert!(Principal::named("auth0|1234").is_ok());
        for bad in ["", "a b", "a\tb", "a\u{7}"] {
            assert!(Principal::named(bad).is_err(), "{bad:?}");
            assert!(Principal::parse(bad).is_none(), "{bad:?}");
        }
        assert_eq!(
            Principal::named(&"x".repeat(257)),
            Err(InvalidPrincipal::Length)
        );
        assert!(Principal::named("default").is_ok_and(|p| p.is_default()));
    }

    #[test]
    fn format_characters_are_refused_everywhere() {
        // See: issue 30
        for (bad, code) in [
            ("bo\u{200b}b", 0x200B),
            ("\u{200f}bob", 0x200F),
            ("bob\u{202e}", 0x202E),
            ("b\u{2060}ob", 0x2060),
            ("b\u{2064}ob", 0x2064),
            ("\u{feff}bob", 0xFEFF),
            ("bo\u{ad}b", 0xAD),
            ("bob\u{e0041}", 0xE0041),
        ] {
            assert_eq!(
                Principal::named(bad),
                Err(InvalidPrincipal::Format(code)),
                "{bad:?}"
            );
            assert_eq!(
                Principal::oauth("https://id.example.com", bad),
                Err(InvalidPrincipal::Format(code)),
                "{bad:?}"
            );
            assert!(Principal::parse(bad).is_none(), "{bad:?}");
        }
        // Visible non-ASCII letters stay accepted.
        assert!(Principal::named("jos\u{e9}").is_ok());
        assert!(Principal::named("\u{5f20}\u{4e09}").is_ok());
    }

    #[test]
    fn oauth_principals_are_apart_from_tokens_file_names() {
        // See: issue 30
        let bob = Principal::named("bob").unwrap();
        let oauth_bob = Principal::oauth("https://id.example.com/realms/team/", "bob").unwrap();
        assert_eq!(oauth_bob.as_str(), "https://id.example.com/realms/team#bob");
        assert_eq!(
            Principal::oauth("https://id.example.com/realms/team", "bob"),
            Ok(oauth_bob.clone())
        );
        assert_ne!(bob, oauth_bob);
        assert_ne!(
            Principal::oauth("https://other.example.com", "bob").unwrap(),
            oauth_bob
        );
        let dev_box = ComputerId::parse("dev-box").unwrap();
        assert_ne!(dev_box.owned_by(&bob), dev_box.owned_by(&oauth_bob));
        // No tokens-file line can name an OAuth principal, nor the reserved `default` an OAuth one.
        assert_eq!(
            Principal::named(oauth_bob.as_str()),
            Err(InvalidPrincipal::OAuthForm)
        );
        assert!(
            !Principal::oauth("https://id.example.com", "default")
                .unwrap()
                .is_default()
        );
        // What the server wrote into a label reads back.
        assert_eq!(Principal::parse(oauth_bob.as_str()), Some(oauth_bob));
        assert_eq!(
            Principal::oauth("https://id.example.com", &"x".repeat(257)),
            Err(InvalidPrincipal::Length)
        );
    }

    #[test]
    fn random_slugs_are_valid_and_readable() {
        for _ in 0..100 {
            let id = ComputerId::random();
            assert!(ComputerId::parse(id.as_str()).is_ok(), "{id}");
            assert_eq!(id.as_str().split('-').count(), 3);
        }
    }

    #[test]
    fn job_ids_round_trip_and_reject_paths() {
        let id = JobId::random();
        assert_eq!(JobId::parse(id.as_str()), Some(id.clone()));
        assert_eq!(ExecId::for_job(&id).as_str(), format!("job-{id}"));
        for bad in ["j-../../x", "j-ABCDEF12", "j-1234567", "x-12345678", ""] {
            assert_eq!(JobId::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn instance_ids_round_trip_and_reject_paths() {
        let id = InstanceId::random();
        assert_eq!(InstanceId::parse(id.as_str()), Some(id));
        assert_eq!(InstanceId::parse("../../etc/passwd"), None);
    }
}
