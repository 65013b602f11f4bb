//! The `…-file` way of passing a credential ([`Secret`], a leaf type of its own).
//!
//! Tokens given on the command line are readable by every local user through
//! `/proc/<pid>/cmdline`; a file (or an environment variable) is not. This module reads such
//! files at startup: bounded, one trailing newline trimmed, and empty or unreadable files are a
//! startup error rather than a silent "no token".

use std::io::Read;
use std::path::Path;

use super::ConfigError;
use crate::secret::Secret;

/// Largest token file we read. Real tokens are at most a few KiB (Fly macaroons are the
/// longest, ~2 KiB); the bound keeps `--auth-token-file /dev/zero` from eating memory.
const MAX_SECRET_FILE_BYTES: u64 = 64 * 1024;

/// One secret's two spellings: the value itself (`--auth-token`, or its environment variable)
/// and a file holding it (`--auth-token-file`, or its `…_FILE` variable).
pub struct SecretSource<'a> {
    /// The value flag, e.g. `--auth-token`.
    pub flag: &'static str,
    /// The file flag, e.g. `--auth-token-file`.
    pub file_flag: &'static str,
    pub value: Option<&'a Secret>,
    pub file: Option<&'a Path>,
}

impl SecretSource<'_> {
    /// The secret from whichever spelling was used; a blank value counts as absent. Both at
    /// once is an error: silently preferring one would hide a stale token.
    pub fn resolve(&self) -> Result<Option<Secret>, ConfigError> {
        let value = self.value.filter(|v| !v.expose().trim().is_empty());
        match (value, self.file) {
            (Some(_), Some(_)) => Err(ConfigError(format!(
                "{} and {} were both given; use only one of them.",
                self.flag, self.file_flag
            ))),
            (Some(value), None) => Ok(Some(value.clone())),
            (None, Some(path)) => read_secret_file(self.file_flag, path).map(Some),
            (None, None) => Ok(None),
        }
    }
}

/// Reads a token file: at most [`MAX_SECRET_FILE_BYTES`], UTF-8, one trailing newline removed
/// (`echo token > file` writes one), not blank.
pub fn read_secret_file(flag: &str, path: &Path) -> Result<Secret, ConfigError> {
    let shown = path.display();
    let file = std::fs::File::open(path)
        .map_err(|e| ConfigError(format!("Cannot read {flag} '{shown}': {e}.")))?;
    let mut bytes = Vec::new();
    file.take(MAX_SECRET_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| ConfigError(format!("Cannot read {flag} '{shown}': {e}.")))?;
    if bytes.len() as u64 > MAX_SECRET_FILE_BYTES {
        return Err(ConfigError(format!(
            "{flag} '{shown}' is larger than {} KiB; it should hold only the token.",
            MAX_SECRET_FILE_BYTES / 1024
        )));
    }
    let mut text = String::from_utf8(bytes)
        .map_err(|_| ConfigError(format!("{flag} '{shown}' is not UTF-8 text.")))?;
    if text.ends_with('\n') {
        text.pop();
        if text.ends_with('\r') {
            text.pop();
        }
    }
    if text.trim().is_empty() {
        return Err(ConfigError(format!("{flag} '{shown}' is empty.")));
    }
    Ok(Secret::new(text))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "kilntainers-secret-test-{}-{name}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_file_loses_one_trailing_newline_only() {
        let dir = scratch("trim");
        let path = dir.join("token");
        std::fs::write(&path, "abc \n\n").unwrap();
        assert_eq!(
            read_secret_file("--x-file", &path).unwrap().expose(),
            "abc \n"
        );
        std::fs::write(&path, "abc\r\n").unwrap();
        assert_eq!(read_secret_file("--x-file", &path).unwrap().expose(), "abc");
        std::fs::write(&path, "abc").unwrap();
        assert_eq!(read_secret_file("--x-file", &path).unwrap().expose(), "abc");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn empty_missing_and_huge_files_are_startup_errors() {
        let dir = scratch("bad");
        let path = dir.join("token");
        std::fs::write(&path, "\n").unwrap();
        assert_eq!(
            read_secret_file("--x-file", &path).unwrap_err().0,
            format!("--x-file '{}' is empty.", path.display())
        );
        let missing = dir.join("missing");
        assert!(
            read_secret_file("--x-file", &missing)
                .unwrap_err()
                .0
                .starts_with(&format!("Cannot read --x-file '{}': ", missing.display()))
        );
        std::fs::write(&path, vec![b'a'; 64 * 1024 + 1]).unwrap();
        assert!(
            read_secret_file("--x-file", &path)
                .unwrap_err()
                .0
                .contains("is larger than 64 KiB")
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn value_and_file_together_are_refused() {
        let value = Secret::new("v");
        let source = SecretSource {
            flag: "--x",
            file_flag: "--x-file",
            value: Some(&value),
            file: Some(Path::new("/nonexistent")),
        };
        assert_eq!(
            source.resolve().unwrap_err().0,
            "--x and --x-file were both given; use only one of them."
        );
        let blank = Secret::new(" ");
        let source = SecretSource {
            value: Some(&blank),
            file: None,
            ..source
        };
        assert_eq!(source.resolve().unwrap(), None);
    }
}
