//! Credentials as a type of their own. A [`Secret`] never shows its value through `Debug`, so a
//! logged or printed configuration cannot leak a token; the only way to the value is
//! [`Secret::expose`], at the one place that sends it. A leaf: the command line parses straight
//! into it, and every layer that holds a credential (configuration, state, providers, the HTTP
//! transport) names the same type. Reading `…-file` spellings is `config::secret`'s.

use std::convert::Infallible;
use std::fmt;
use std::str::FromStr;

/// A credential. `Debug` never shows it, so a logged config cannot leak it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// Lets clap parse a flag straight into a [`Secret`], so the value is never a plain `String`
/// anywhere, the parsed command line included.
impl FromStr for Secret {
    type Err = Infallible;

    fn from_str(value: &str) -> Result<Self, Self::Err> {
        Ok(Self::new(value))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_never_shows_the_value() {
        let secret: Secret = "hunter2-value".parse().unwrap();
        assert_eq!(format!("{secret:?}"), "Secret(<redacted>)");
        assert_eq!(secret.expose(), "hunter2-value");
    }
}
