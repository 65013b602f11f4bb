//! The vocabulary of a computer's files, shared by the server's file tools (its `files` module) and
//! the backends that reach files without them ([`FileSystem`]): the answers, the errors in the
//! words the caller sees, and the limits every way of reaching files keeps. Knows no provider.

use std::fmt;

use async_trait::async_trait;

use super::{BackendError, SandboxRef};

/// The most bytes one `file_write` call takes, decoded (docs/files.md, "file_write").
pub const WRITE_LIMIT: usize = 16 * 1024 * 1024;

/// The most entries `file_list` returns.
pub const LIST_LIMIT: usize = 1000;

/// The deepest `file_list` goes.
pub const MAX_DEPTH: u8 = 5;

/// What `file_list` may answer with at most: its status line and its entries. 2 MiB holds a thousand entries with 2 KiB paths (a real listing's lines are nearer
/// 100 bytes); a larger result would be more than a model reads, and each byte of it costs the
/// server several times over on its way out as JSON.
pub const LIST_ANSWER_LIMIT: u64 = 2 * 1024 * 1024;

/// Why a file operation did not happen, in the words the caller sees.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FileError {
    #[error("File not found: {0}")]
    NotFound(String),
    #[error("{0} is a directory; use file_list.")]
    IsDirectory(String),
    #[error("{0} is a directory; give the path of a file to write.")]
    WriteToDirectory(String),
    #[error("{0} is not a regular file.")]
    NotRegular(String),
    #[error("Permission denied: {0}")]
    PermissionDenied(String),
    #[error("Could not write {path}: {reason}")]
    WriteFailed { path: String, reason: String },
    #[error("Could not read {path}: {reason}")]
    ReadFailed { path: String, reason: String },
    /// The path, a `..` in it or a symlink on the way, leads out of a computer whose files the
    /// server reaches directly (WASM).
    #[error("Permission denied: {0} leads outside the computer.")]
    Outside(String),
    /// The computer answered something the program never prints.
    #[error("The computer gave an unreadable answer about {0}.")]
    Garbled(String),
}

/// Why a file operation on a computer did not answer: the file, or the computer.
#[derive(Debug, thiserror::Error)]
pub enum FileOpError {
    #[error(transparent)]
    File(#[from] FileError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// The backend's own [`FileSystem`] cannot do this one operation (say, an
    /// append where the provider only replaces whole files): the file programs run
    /// instead (the server's `files::Access`), and no caller above them ever sees it.
    #[error("not done directly")]
    NotDirect,
    /// Neither the backend nor a shell in its computers can reach files.
    #[error("File tools are not available on the {0} backend.")]
    Unavailable(&'static str),
    #[error("The computer did not finish the file operation within {0} seconds.")]
    TimedOut(u64),
    /// A program sent more than its answer limit, whatever it was asked for.
    #[error("The computer answered with more than was asked for.")]
    Overflow,
    #[error("cancelled")]
    Cancelled,
}

/// What a read found: the file's size and at most the bytes asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadAnswer {
    pub size: u64,
    pub bytes: Vec<u8>,
}

/// One `file_list` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub path: String,
    pub kind: EntryKind,
    pub size: u64,
    /// Permission bits, as `0755`.
    pub mode: String,
    /// Seconds since the epoch.
    pub modified: i64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryKind {
    File,
    Dir,
    Symlink,
    Other,
}

impl fmt::Display for EntryKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::File => "file",
            Self::Dir => "dir",
            Self::Symlink => "symlink",
            Self::Other => "other",
        })
    }
}

/// A listing: the entries sorted by path, and whether more were there than [`LIST_LIMIT`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listing {
    pub entries: Vec<Entry>,
    pub truncated: bool,
}

/// The temporary file a non-appending write fills before renaming it over `path`: beside it,
/// so the rename stays on one file system, hidden, and unique per call.
pub fn temporary_path(path: &str, nonce: u32) -> String {
    let (dir, name) = path.rsplit_once('/').unwrap_or(("", path));
    format!("{dir}/.{name}.kilntainers-{nonce:08x}")
}

/// A computer's files reached without running anything in it. Paths are absolute paths in the
/// computer; the answers are the same as the file programs' (docs/files.md), so the tools cannot
/// tell which way a file was reached.
#[async_trait]
pub trait FileSystem: Send + Sync {
    /// At most `length` bytes of `path` from `offset`, and the file's size.
    async fn read(
        &self,
        sandbox: &SandboxRef,
        path: &str,
        offset: u64,
        length: u64,
    ) -> Result<ReadAnswer, FileOpError>;

    /// Replaces `path` atomically with `bytes` (or appends them), creating parent directories;
    /// `mode` (permission bits) is applied when given. Returns the file's size afterwards.
    async fn write(
        &self,
        sandbox: &SandboxRef,
        path: &str,
        bytes: &[u8],
        append: bool,
        mode: Option<u32>,
    ) -> Result<u64, FileOpError>;

    /// The entries under `path` to `depth` levels (symlinks not followed), or `path` alone
    /// when it is not a directory.
    async fn list(
        &self,
        sandbox: &SandboxRef,
        path: &str,
        depth: u8,
    ) -> Result<Listing, FileOpError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_temporary_file_sits_hidden_beside_its_target() {
        assert_eq!(
            temporary_path("/a/b.txt", 0xab),
            "/a/.b.txt.kilntainers-000000ab"
        );
        assert_eq!(temporary_path("/top", 1), "/.top.kilntainers-00000001");
    }
}
