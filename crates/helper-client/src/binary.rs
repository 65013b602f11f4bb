//! The helper binary this server carries (built by `build.rs`, embedded here), the path it
//! gets inside a computer, and the tar archive Docker's upload call takes.
//!
//! The path carries a hash of the bytes, so servers of different versions sharing a permanent
//! computer each run their own copy and never overwrite a binary another one is running.

use std::hash::{Hash, Hasher};
use std::sync::LazyLock;

/// The statically linked helper; empty when `build.rs` could not link it statically.
static BINARY: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/kilntainers-helper"));
/// Why the build has no helper (empty when it has one).
const MISSING_REASON: &str = env!("KILNTAINERS_HELPER_MISSING");

/// Directory in the computer's root filesystem that holds helper copies.
pub const DIR: &str = ".kilntainers";

/// A hash of the helper's bytes, in hex: names its copies in computers and the egress proxy's
/// image tag.
pub static HASH: LazyLock<String> = LazyLock::new(|| {
    // SipHash with fixed keys: stable for the same bytes, which is all a name needs.
    let mut hasher = std::hash::DefaultHasher::new();
    BINARY.hash(&mut hasher);
    format!("{:016x}", hasher.finish())
});

/// Absolute path of this server's helper inside a computer.
pub static PATH: LazyLock<String> = LazyLock::new(|| format!("/{DIR}/helper-{}", *HASH));

/// The helper's bytes; empty when this build has none ([`available`]).
pub fn bytes() -> &'static [u8] {
    BINARY
}

/// `Err(reason)` when this build carries no helper.
pub fn available() -> Result<(), String> {
    if BINARY.is_empty() {
        Err(format!("this build has no exec helper ({MISSING_REASON})"))
    } else {
        Ok(())
    }
}

/// A tar archive holding `DIR/` and the helper at [`PATH`], to be extracted at `/`.
pub fn archive() -> std::io::Result<Vec<u8>> {
    let mut builder = tar::Builder::new(Vec::with_capacity(BINARY.len() + 2048));
    let mut dir = tar::Header::new_gnu();
    dir.set_entry_type(tar::EntryType::Directory);
    dir.set_mode(0o755);
    dir.set_size(0);
    builder.append_data(&mut dir, format!("{DIR}/"), std::io::empty())?;
    let mut file = tar::Header::new_gnu();
    file.set_entry_type(tar::EntryType::Regular);
    file.set_mode(0o755);
    file.set_size(BINARY.len() as u64);
    builder.append_data(&mut file, PATH.trim_start_matches('/'), BINARY)?;
    builder.into_inner()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_archive_holds_the_helper_at_its_path() {
        // A build that silently lost its helper would pass every other test on the fallback.
        available().unwrap();
        let bytes = archive().unwrap();
        let mut archive = tar::Archive::new(bytes.as_slice());
        let entries: Vec<(String, u64, u32)> = archive
            .entries()
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                (
                    e.path().unwrap().to_string_lossy().into_owned(),
                    e.header().size().unwrap(),
                    e.header().mode().unwrap(),
                )
            })
            .collect();
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[0].0, ".kilntainers/");
        assert_eq!(entries[1].0, PATH.trim_start_matches('/'));
        assert_eq!(entries[1].1, BINARY.len() as u64);
        assert_eq!(entries[1].2, 0o755);
        assert!(PATH.starts_with("/.kilntainers/helper-"));
    }
}
