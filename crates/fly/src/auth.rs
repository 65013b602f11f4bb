//! Fly API credentials (docs/decisions.md, "Fly authentication"): the first token found in the configured order
//! (`--fly-token`, `FLY_API_TOKEN`, `FLY_TOKEN`, `FLY_ACCESS_TOKEN`, then the top-level
//! `access_token` of flyctl's `~/.fly/config.yml`), normalised the way flyctl does into one
//! `Authorization` header value: `FlyV1 <macaroons>` for macaroon tokens, else `Bearer <token>`.
//!
//! Tokens never reach a log line or an error message; [`Authorization`]'s `Debug` is redacted.

use std::fmt;

use crate::config::TokenSources;

/// Prefixes of macaroon tokens, which Fly wants under the `FlyV1` scheme (as flyctl decides).
const MACAROON_PREFIXES: [&str; 3] = ["fm1r_", "fm1a_", "fm2_"];

/// The exact text of docs/decisions.md, "Fly authentication" for a missing token.
pub(super) const NO_TOKEN_MESSAGE: &str = "No Fly API token found (checked --fly-token, FLY_API_TOKEN, FLY_TOKEN, FLY_ACCESS_TOKEN and ~/.fly/config.yml). Install flyctl (https://fly.io/docs/flyctl/install/) and run 'fly auth login' once, or set FLY_API_TOKEN (for example to the output of 'fly tokens create org'), then restart your MCP client.";

/// A ready-to-send `Authorization` header value.
#[derive(Clone, PartialEq, Eq)]
pub(super) struct Authorization(String);

impl Authorization {
    pub(super) fn header_value(&self) -> &str {
        &self.0
    }

    /// Which scheme was chosen, for logs (never the token itself).
    pub(super) fn scheme(&self) -> &'static str {
        if self.0.starts_with("FlyV1 ") {
            "FlyV1"
        } else {
            "Bearer"
        }
    }
}

impl fmt::Debug for Authorization {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Authorization({} <redacted>)", self.scheme())
    }
}

/// Finds the first usable token; `None` when every source is empty.
pub(super) fn discover(sources: &TokenSources) -> Option<Authorization> {
    let from_flag_or_env = sources
        .flag
        .iter()
        .chain(sources.env.iter().map(|(_, secret)| secret))
        .find_map(|secret| normalise(secret.expose()));
    from_flag_or_env.or_else(|| {
        let path = sources.config_file.as_ref()?;
        let text = std::fs::read_to_string(path).ok()?;
        normalise(&config_file_token(&text)?)
    })
}

/// flyctl's normalisation: drop a leading scheme, split on commas, trim; macaroons go under
/// `FlyV1` joined by commas, anything else is a bearer token.
pub(super) fn normalise(raw: &str) -> Option<Authorization> {
    let trimmed = raw.trim();
    let is_scheme = |word: &str| {
        ["Bearer", "FlyV1"]
            .iter()
            .any(|s| word.eq_ignore_ascii_case(s))
    };
    let token = match trimmed.split_once(char::is_whitespace) {
        Some((scheme, rest)) if is_scheme(scheme) => rest.trim(),
        None if is_scheme(trimmed) => "",
        _ => trimmed,
    };
    let pieces: Vec<&str> = token
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .collect();
    if pieces.is_empty() {
        return None;
    }
    let macaroon = pieces
        .iter()
        .any(|p| MACAROON_PREFIXES.iter().any(|prefix| p.starts_with(prefix)));
    Some(Authorization(if macaroon {
        format!("FlyV1 {}", pieces.join(","))
    } else {
        format!("Bearer {token}")
    }))
}

/// The top-level `access_token:` of flyctl's YAML config. Only that one scalar is needed, so a
/// line scan replaces a YAML dependency: unindented key, optional single or double quotes,
/// optional trailing comment on unquoted values.
fn config_file_token(text: &str) -> Option<String> {
    text.lines().find_map(|line| {
        let rest = line.strip_prefix("access_token:")?;
        let value = rest.trim();
        let value = if let Some(inner) = value.strip_prefix('"') {
            inner.split('"').next()?.to_owned()
        } else if let Some(inner) = value.strip_prefix('\'') {
            inner.split('\'').next()?.to_owned()
        } else {
            value.split(" #").next()?.trim().to_owned()
        };
        (!value.is_empty()).then_some(value)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kilntainers_backend::secret::Secret;

    #[test]
    fn scheme_follows_the_token_shape() {
        assert_eq!(normalise("abc").unwrap().header_value(), "Bearer abc");
        assert_eq!(
            normalise(" Bearer abc ").unwrap().header_value(),
            "Bearer abc"
        );
        assert_eq!(
            normalise("FlyV1 fm2_aaa, fm2_bbb").unwrap().header_value(),
            "FlyV1 fm2_aaa,fm2_bbb"
        );
        assert_eq!(normalise("fm1r_x").unwrap().header_value(), "FlyV1 fm1r_x");
        assert_eq!(normalise("fm1a_x,").unwrap().header_value(), "FlyV1 fm1a_x");
        assert!(normalise("  ").is_none());
        assert!(normalise("Bearer ").is_none());
        assert!(!format!("{:?}", normalise("secret").unwrap()).contains("secret"));
    }

    #[test]
    fn discovery_order_is_flag_env_then_file() {
        let dir = std::env::temp_dir().join(format!("fly-auth-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("config.yml");
        std::fs::write(&file, "wire_guard_state: {}\naccess_token: \"fm2_file\"\n").unwrap();
        let mut sources = TokenSources {
            flag: Some(Secret::new("flag")),
            env: vec![("FLY_API_TOKEN", Secret::new("env"))],
            config_file: Some(file.clone()),
        };
        assert_eq!(discover(&sources).unwrap().header_value(), "Bearer flag");
        sources.flag = None;
        assert_eq!(discover(&sources).unwrap().header_value(), "Bearer env");
        sources.env.clear();
        assert_eq!(discover(&sources).unwrap().header_value(), "FlyV1 fm2_file");
        sources.config_file = Some(dir.join("missing.yml"));
        assert!(discover(&sources).is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn config_file_forms() {
        assert_eq!(config_file_token("access_token: abc\n"), Some("abc".into()));
        assert_eq!(
            config_file_token("access_token: 'a b'\n"),
            Some("a b".into())
        );
        assert_eq!(
            config_file_token("access_token: abc # c\n"),
            Some("abc".into())
        );
        assert_eq!(config_file_token("  access_token: nested\n"), None);
        assert_eq!(config_file_token("access_token:\n"), None);
    }
}
