//! Wall-clock times as the inventory prints them: RFC 3339 in UTC, whole seconds
//! (`2026-12-03T14:05:00Z`). One formatter for every backend that has to make the text itself.

use chrono::{DateTime, SecondsFormat, Utc};

/// Seconds since the Unix epoch as RFC 3339 UTC; a time chrono cannot hold (beyond ±262,000
/// years) prints as the epoch.
pub fn rfc3339_utc(unix_secs: i64) -> String {
    DateTime::<Utc>::from_timestamp(unix_secs, 0)
        .unwrap_or_default()
        .to_rfc3339_opts(SecondsFormat::Secs, true)
}

/// The current time as [`rfc3339_utc`].
pub fn now_rfc3339() -> String {
    Utc::now().to_rfc3339_opts(SecondsFormat::Secs, true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_known_instants() {
        assert_eq!(rfc3339_utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339_utc(1_700_000_000), "2023-11-14T22:13:20Z");
        assert_eq!(rfc3339_utc(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339_utc(-1), "1969-12-31T23:59:59Z");
    }

    #[test]
    fn now_has_the_shape() {
        let now = now_rfc3339();
        assert_eq!(now.len(), 20, "{now}");
        assert!(now.starts_with("20") && now.ends_with('Z'));
    }
}
