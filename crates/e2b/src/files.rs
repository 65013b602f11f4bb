//! The file tools on E2B through envd's own file API (docs/files.md, "Backends"), not through
//! the shell programs: `GET /files` (download, with a `Range`) and `POST /files` (a
//! `multipart/form-data` upload with one `file` field) from envd's OpenAPI document, and the
//! unary calls `Stat`, `ListDir`, `Move` and `Remove` of its Connect service
//! `filesystem.Filesystem` (`filesystem.proto`, proto3 JSON like the process service). Written
//! from those published definitions; tested against the project's local fake only.
//!
//! - **read**: `Stat` (a directory, a missing path, something that is not a regular file), then
//!   `GET /files` for the page only; the body is read as it streams and reading stops once the
//!   page is complete, so no more than the page is ever held, whatever envd sends.
//! - **write**: `Stat` (a directory is refused; an existing file's permission bits are kept),
//!   upload to a hidden temporary file beside the target (envd's upload creates the parent
//!   directories), then `Move` it over the target (one `rename`); a failed or abandoned write
//!   removes the temporary file with `Remove`. envd has no chmod: when the file must end with
//!   other bits than the upload gave it, one `chmod` runs through the process service before the
//!   move.
//! - **list**: `Stat`, then `ListDir` with the depth (a file lists itself); entries mapped to
//!   the programs' answer (symlinks as `symlink` with mode `0777`, as `stat` shows a link).
//!
//! Left to the programs ([`FileOpError::NotDirect`]): appends (envd only replaces whole files),
//! reads of a file `Stat` calls empty (`/proc` files say 0 and envd would serve nothing; the
//! program counts them), and a listing whose answer is larger than the programs' own cap
//! (`ListDir` has no limit; the program stops at 1,001 entries).
//!
//! Everything envd answers is hostile: bodies are read up to a cap, anything that does not
//! parse is [`FileError::Garbled`], and envd's error texts are shortened before they are shown.

use std::time::Duration;

use async_trait::async_trait;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize};

use super::E2bBackend;
use super::process::{Envd, EnvdVersion, RunError, envd_transport};
use kilntainers_backend::files::{
    self, Entry, EntryKind, FileError, FileOpError, FileSystem, Listing, ReadAnswer,
};
use kilntainers_backend::rest::bounded_text;
use kilntainers_backend::{BackendError, SandboxRef};

/// Bound of one `filesystem.Filesystem` call: they answer at once (a deep `ListDir` walks a
/// tree, still well within this).
const RPC_TIMEOUT: Duration = Duration::from_secs(60);
/// Bound of one download or upload (at most 16 MiB, see `files::WRITE_LIMIT`).
const TRANSFER_TIMEOUT: Duration = Duration::from_secs(300);
/// Bound of the `chmod` run through the process service.
const CHMOD_TIMEOUT: Duration = Duration::from_secs(30);
/// Most bytes read of an answer about one entry (`Stat`, `Move`, an upload's entry list): an
/// `EntryInfo` is a path, a few names and numbers, and at most 4 KiB of user metadata.
const ENTRY_ANSWER_LIMIT: usize = 64 * 1024;
/// Most bytes read of a `ListDir` answer: the programs' own listing cap.
const LIST_ANSWER_LIMIT: usize = files::LIST_ANSWER_LIMIT as usize;
/// Longest piece of an envd error text kept in a message.
const REASON_CHARS: usize = 300;
/// Sets the temporary file's permission bits: `$1` the octal mode, `$2` the file. Values are
/// positional arguments, never spliced into the program.
const CHMOD: &str = "chmod \"$1\" \"$2\"";

/// Where one sandbox's envd is, owned, so a drop guard can still reach it after the call that
/// made it is gone.
#[derive(Clone)]
struct Target {
    http: reqwest::Client,
    base: String,
    sandbox_id: String,
    token: Option<String>,
    version: EnvdVersion,
}

impl Target {
    fn envd(&self) -> Envd<'_> {
        Envd {
            http: &self.http,
            base: self.base.clone(),
            sandbox_id: &self.sandbox_id,
            token: self.token.as_deref(),
            version: self.version,
        }
    }
}

// --- wire types (filesystem.proto, proto3 JSON) ----------------------------------------------

#[derive(Debug, Serialize)]
struct PathRequest<'a> {
    path: &'a str,
}

#[derive(Debug, Serialize)]
struct ListDirRequest<'a> {
    path: &'a str,
    depth: u32,
}

#[derive(Debug, Serialize)]
struct MoveRequest<'a> {
    source: &'a str,
    destination: &'a str,
}

/// `StatResponse`, `MoveResponse`: `{entry}`.
#[derive(Debug, Deserialize)]
struct EntryResponse {
    #[serde(default)]
    entry: Option<EntryInfo>,
}

#[derive(Debug, Deserialize)]
struct ListDirResponse {
    #[serde(default)]
    entries: Vec<EntryInfo>,
}

/// `RemoveResponse` is empty; whatever comes is ignored.
#[derive(Debug, Deserialize)]
struct Ignored {}

/// `FileType`, by name or number (proto3 JSON parsers accept both); omitted = unspecified.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum FileType {
    #[default]
    Unspecified,
    File,
    Directory,
    Symlink,
}

impl<'de> Deserialize<'de> for FileType {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = serde_json::Value::deserialize(deserializer)?;
        Ok(match value {
            serde_json::Value::String(name) => match name.as_str() {
                "FILE_TYPE_FILE" => Self::File,
                "FILE_TYPE_DIRECTORY" => Self::Directory,
                "FILE_TYPE_SYMLINK" => Self::Symlink,
                _ => Self::Unspecified,
            },
            serde_json::Value::Number(n) => match n.as_u64() {
                Some(1) => Self::File,
                Some(2) => Self::Directory,
                Some(3) => Self::Symlink,
                _ => Self::Unspecified,
            },
            serde_json::Value::Null => Self::Unspecified,
            _ => return Err(serde::de::Error::custom("FileType is not a name or number")),
        })
    }
}

/// proto3 JSON writes 64-bit integers as strings; numbers are accepted too.
fn int64<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
    match serde_json::Value::deserialize(deserializer)? {
        serde_json::Value::String(text) => text.parse().map_err(serde::de::Error::custom),
        serde_json::Value::Number(n) => n
            .as_u64()
            .ok_or_else(|| serde::de::Error::custom("size is not a byte count")),
        serde_json::Value::Null => Ok(0),
        _ => Err(serde::de::Error::custom("size is not a number")),
    }
}

/// `EntryInfo`; every field may be missing (proto3 omits defaults). `type` of a symlink is its
/// target's type (unspecified when the link dangles; newer envd also say `isSymlink`), `mode`
/// the permission bits (of the target, for a symlink), `permissions` Go's `FileMode` text of
/// the entry itself (`Lrwxrwxrwx`, `dtrwxrwxrwx`, `-rw-r--r--`).
#[derive(Debug, Default, Deserialize)]
struct EntryInfo {
    #[serde(rename = "type", default)]
    kind: FileType,
    #[serde(default)]
    path: String,
    #[serde(default, deserialize_with = "int64")]
    size: u64,
    #[serde(default)]
    mode: u32,
    #[serde(default)]
    permissions: String,
    #[serde(rename = "modifiedTime", alias = "modified_time", default)]
    modified_time: Option<String>,
    #[serde(rename = "symlinkTarget", alias = "symlink_target", default)]
    symlink_target: Option<String>,
    #[serde(rename = "isSymlink", alias = "is_symlink", default)]
    is_symlink: bool,
}

impl EntryInfo {
    /// Type letters of Go's `FileMode` text: everything before the nine `rwx` characters.
    fn type_letters(&self) -> &str {
        let chars = self.permissions.chars().count();
        let cut = self
            .permissions
            .char_indices()
            .nth(chars.saturating_sub(9))
            .map_or(self.permissions.len(), |(i, _)| i);
        &self.permissions[..cut]
    }

    fn is_symlink(&self) -> bool {
        self.is_symlink
            || self.symlink_target.is_some()
            || self.kind == FileType::Symlink
            || self.type_letters().contains('L')
    }

    /// A symlink whose target does not exist: envd could not resolve it.
    fn dangles(&self) -> bool {
        self.is_symlink()
            && self.symlink_target.is_none()
            && matches!(self.kind, FileType::Unspecified | FileType::Symlink)
    }

    /// The entry as `file_list` shows it; `None` when it cannot be read.
    fn to_entry(&self, path: String) -> Option<Entry> {
        let modified = match self.modified_time.as_deref() {
            None => 0,
            Some(text) => rfc3339_seconds(text)?,
        };
        let (kind, mode) = if self.is_symlink() {
            (EntryKind::Symlink, 0o777)
        } else {
            let special = self.type_letters().chars().fold(0, |bits, c| match c {
                'u' => bits | 0o4000,
                'g' => bits | 0o2000,
                't' => bits | 0o1000,
                _ => bits,
            });
            let kind = match self.kind {
                FileType::File => EntryKind::File,
                FileType::Directory => EntryKind::Dir,
                FileType::Symlink => EntryKind::Symlink,
                FileType::Unspecified => EntryKind::Other,
            };
            (kind, self.mode & 0o777 | special)
        };
        Some(Entry {
            path,
            kind,
            size: self.size,
            mode: format!("{mode:04o}"),
            modified,
        })
    }
}

/// envd's HTTP error body (`{code: <int>, message}`).
#[derive(Debug, Deserialize)]
struct HttpError {
    #[serde(default)]
    message: String,
}

/// Seconds since the epoch of an RFC 3339 time (`2024-05-01T10:00:00.123456Z`, or with an
/// offset), as protobuf's `Timestamp` is written in JSON. `None` when it is not one.
fn rfc3339_seconds(text: &str) -> Option<i64> {
    chrono::DateTime::parse_from_rfc3339(text)
        .ok()
        .map(|time| time.timestamp())
}

// --- calls ------------------------------------------------------------------------------------

/// Why an envd call gave no usable answer.
#[derive(Debug)]
enum CallError {
    /// envd (or the sandbox proxy in front of it) could not be reached.
    Unreachable(String),
    /// The access token was refused.
    Auth(String),
    /// envd answered with an error: the HTTP status, the Connect code (empty for the HTTP
    /// endpoints) and the message.
    Refused {
        status: u16,
        code: String,
        message: String,
    },
    /// The answer was longer than its cap.
    TooLarge,
    /// The answer did not parse.
    Garbled,
}

impl CallError {
    fn code(&self) -> &str {
        match self {
            Self::Refused { code, .. } => code,
            _ => "",
        }
    }

    /// envd's own words, shortened, for a "Could not …" message.
    fn reason(&self) -> String {
        match self {
            Self::Refused {
                status, message, ..
            } if message.trim().is_empty() => format!("envd answered HTTP {status}"),
            Self::Refused { message, .. } => message.trim().chars().take(REASON_CHARS).collect(),
            Self::TooLarge => "envd answered with more than was asked for".to_owned(),
            Self::Garbled => "envd gave an unreadable answer".to_owned(),
            Self::Unreachable(detail) | Self::Auth(detail) => detail.clone(),
        }
    }
}

/// At most `limit` bytes of a body; `Err(TooLarge)` as soon as more arrive.
async fn capped_body(mut response: reqwest::Response, limit: usize) -> Result<Vec<u8>, CallError> {
    let mut body = Vec::new();
    loop {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                if body.len() + chunk.len() > limit {
                    return Err(CallError::TooLarge);
                }
                body.extend_from_slice(&chunk);
            }
            Ok(None) => return Ok(body),
            Err(e) => {
                return Err(CallError::Unreachable(format!(
                    "the answer broke off: {}",
                    envd_transport(&e)
                )));
            }
        }
    }
}

/// A non-success answer of envd or of the proxy before it, as a [`CallError`]. `connect` says
/// the error body is Connect's `{code, message}` (else envd's `{code: <int>, message}`).
async fn refusal(response: reqwest::Response, call: &str, connect: bool) -> CallError {
    let status = response.status().as_u16();
    let text = bounded_text(response).await;
    let parsed: Option<(String, String)> = if connect {
        serde_json::from_str::<super::connect::ConnectError>(&text)
            .ok()
            .map(|e| (e.code, e.message))
    } else {
        serde_json::from_str::<HttpError>(&text)
            .ok()
            .map(|e| (String::new(), e.message))
    };
    let shown: String = text.trim().chars().take(REASON_CHARS).collect();
    match (status, parsed) {
        (401 | 403, _) => CallError::Auth(format!("{call} was refused (HTTP {status}): {shown}")),
        (502..=504, _) | (404, None) => {
            CallError::Unreachable(format!("{call} returned HTTP {status}: {shown}"))
        }
        (404, Some((code, _))) if connect && code.is_empty() => {
            CallError::Unreachable(format!("{call} returned HTTP {status}: {shown}"))
        }
        (_, Some((code, message))) => CallError::Refused {
            status,
            code,
            message,
        },
        (_, None) => CallError::Refused {
            status,
            code: String::new(),
            message: shown,
        },
    }
}

impl Target {
    /// One unary `filesystem.Filesystem/<method>` call with a JSON body; the answer read up to
    /// `limit` bytes.
    async fn rpc<B: Serialize, R: DeserializeOwned>(
        &self,
        method: &str,
        body: &B,
        limit: usize,
    ) -> Result<R, CallError> {
        let call = format!("filesystem.Filesystem/{method}");
        let envd = self.envd();
        let response = envd
            .routed(
                self.http
                    .post(format!("{}/{call}", self.base))
                    .header("Connect-Protocol-Version", "1")
                    .header(reqwest::header::CONTENT_TYPE, "application/json"),
            )
            .timeout(RPC_TIMEOUT)
            .json(body)
            .send()
            .await
            .map_err(|e| {
                CallError::Unreachable(format!("{call} failed: {}", envd_transport(&e)))
            })?;
        if response.status().as_u16() != 200 {
            return Err(refusal(response, &call, true).await);
        }
        let bytes = capped_body(response, limit).await?;
        serde_json::from_slice(&bytes).map_err(|_| CallError::Garbled)
    }

    async fn stat(&self, path: &str) -> Result<EntryInfo, CallError> {
        let answer: EntryResponse = self
            .rpc("Stat", &PathRequest { path }, ENTRY_ANSWER_LIMIT)
            .await?;
        answer.entry.ok_or(CallError::Garbled)
    }

    async fn remove(&self, path: &str) -> Result<(), CallError> {
        self.rpc::<_, Ignored>("Remove", &PathRequest { path }, ENTRY_ANSWER_LIMIT)
            .await
            .map(drop)
    }

    /// `GET /files?path=…` for bytes `offset ..< offset + length` (never more kept, whatever
    /// comes): a `Range` is asked for; a whole-file answer is skipped through to the page.
    async fn download(&self, path: &str, offset: u64, length: u64) -> Result<Vec<u8>, CallError> {
        let last = offset.saturating_add(length).saturating_sub(1);
        let response = self
            .envd()
            .routed(self.http.get(format!("{}/files", self.base)))
            .query(&[("path", path)])
            .header(reqwest::header::RANGE, format!("bytes={offset}-{last}"))
            .timeout(TRANSFER_TIMEOUT)
            .send()
            .await
            .map_err(|e| {
                CallError::Unreachable(format!("GET /files failed: {}", envd_transport(&e)))
            })?;
        let mut skip = match response.status().as_u16() {
            200 => offset,
            206 => {
                let start = response
                    .headers()
                    .get(reqwest::header::CONTENT_RANGE)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.strip_prefix("bytes "))
                    .and_then(|v| v.split_once('-'))
                    .and_then(|(start, _)| start.trim().parse::<u64>().ok());
                if start != Some(offset) {
                    return Err(CallError::Garbled);
                }
                0
            }
            // The file became shorter than the offset since it was looked at.
            416 => return Ok(Vec::new()),
            _ => return Err(refusal(response, "GET /files", false).await),
        };
        let want = usize::try_from(length).unwrap_or(usize::MAX);
        let mut page = Vec::new();
        let mut response = response;
        while page.len() < want {
            let chunk = match response.chunk().await {
                Ok(Some(chunk)) => chunk,
                Ok(None) => break,
                Err(e) => {
                    return Err(CallError::Unreachable(format!(
                        "GET /files broke off: {}",
                        envd_transport(&e)
                    )));
                }
            };
            let mut piece: &[u8] = &chunk;
            let skipped = usize::try_from(skip).unwrap_or(usize::MAX).min(piece.len());
            piece = &piece[skipped..];
            skip -= skipped as u64;
            let room = want - page.len();
            page.extend_from_slice(&piece[..piece.len().min(room)]);
        }
        Ok(page)
    }

    /// `POST /files?path=…` with `bytes` as the `file` part of a `multipart/form-data` body.
    async fn upload(&self, path: &str, bytes: &[u8]) -> Result<(), CallError> {
        let (boundary, body) = multipart(bytes);
        let response = self
            .envd()
            .routed(self.http.post(format!("{}/files", self.base)))
            .query(&[("path", path)])
            .header(
                reqwest::header::CONTENT_TYPE,
                format!("multipart/form-data; boundary={boundary}"),
            )
            .timeout(TRANSFER_TIMEOUT)
            .body(body)
            .send()
            .await
            .map_err(|e| {
                CallError::Unreachable(format!("POST /files failed: {}", envd_transport(&e)))
            })?;
        if response.status().is_success() {
            // The answer lists the entries written; only its size is checked.
            return capped_body(response, ENTRY_ANSWER_LIMIT).await.map(drop);
        }
        Err(refusal(response, "POST /files", false).await)
    }
}

/// A `multipart/form-data` body with one part, `file`, and its boundary (random, and checked
/// not to occur in the bytes).
fn multipart(bytes: &[u8]) -> (String, Vec<u8>) {
    let boundary = loop {
        let candidate = format!("kilntainers-{:032x}", rand::random::<u128>());
        let needle = candidate.as_bytes();
        if !bytes.windows(needle.len()).any(|w| w == needle) {
            break candidate;
        }
    };
    let mut body = Vec::with_capacity(bytes.len() + 256);
    body.extend_from_slice(
        format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"file\"\r\nContent-Type: application/octet-stream\r\n\r\n"
        )
        .as_bytes(),
    );
    body.extend_from_slice(bytes);
    body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
    (boundary, body)
}

/// Removes a temporary file when dropped armed: a write that failed, or was cancelled (its
/// future dropped) between the upload and the move.
struct Leftover {
    target: Target,
    path: String,
    armed: bool,
}

impl Leftover {
    async fn discard(mut self) {
        self.armed = false;
        if let Err(error) = self.target.remove(&self.path).await {
            tracing::warn!(sandbox_id = %self.target.sandbox_id, ?error, "could not remove a temporary file of a failed write");
        }
    }
}

impl Drop for Leftover {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let target = self.target.clone();
        let path = std::mem::take(&mut self.path);
        runtime.spawn(async move {
            if let Err(error) = target.remove(&path).await {
                tracing::warn!(sandbox_id = %target.sandbox_id, ?error, "could not remove a temporary file of an abandoned write");
            }
        });
    }
}

// --- the trait --------------------------------------------------------------------------------

impl E2bBackend {
    async fn target(&self, sandbox: &SandboxRef) -> Result<Target, BackendError> {
        let conn = self.conn(sandbox).await?;
        Ok(Target {
            http: self.envd_http.clone(),
            base: self
                .config
                .envd_base(sandbox.sandbox_id.as_str(), conn.domain.as_deref()),
            sandbox_id: sandbox.sandbox_id.as_str().to_owned(),
            token: conn.token,
            version: conn.envd,
        })
    }

    /// A call that failed for another reason than the file: the sandbox (asking the control
    /// plane whether it still exists), the token, or an answer that does not parse.
    async fn call_failed(&self, sandbox: &SandboxRef, path: &str, error: CallError) -> FileOpError {
        match error {
            CallError::Unreachable(detail) => self
                .classify(
                    sandbox,
                    RunError::Unreachable {
                        started: false,
                        detail,
                    },
                )
                .await
                .into(),
            CallError::Auth(text) => self.classify(sandbox, RunError::Auth(text)).await.into(),
            error @ CallError::Refused { .. } => FileError::ReadFailed {
                path: path.to_owned(),
                reason: error.reason(),
            }
            .into(),
            CallError::TooLarge | CallError::Garbled => FileError::Garbled(path.to_owned()).into(),
        }
    }

    /// `Stat` for the file tools: `Ok(None)` when nothing is there (a dangling symlink neither).
    async fn look(
        &self,
        sandbox: &SandboxRef,
        target: &Target,
        path: &str,
    ) -> Result<Option<EntryInfo>, FileOpError> {
        match target.stat(path).await {
            Ok(entry) => Ok(Some(entry)),
            Err(error) if error.code() == "not_found" => Ok(None),
            Err(error) if error.code() == "permission_denied" => {
                Err(FileError::PermissionDenied(path.to_owned()).into())
            }
            Err(error) => Err(self.call_failed(sandbox, path, error).await),
        }
    }

    /// Runs `chmod` on the temporary file through the process service (envd has no chmod).
    async fn chmod(&self, sandbox: &SandboxRef, path: &str, mode: u32) -> Result<(), FileOpError> {
        let argv = vec![
            self.shell.clone(),
            "-c".to_owned(),
            CHMOD.to_owned(),
            "kilntainers-chmod".to_owned(),
            format!("{mode:o}"),
            path.to_owned(),
        ];
        let ran = self.run_simple(sandbox, &argv, CHMOD_TIMEOUT).await?;
        if ran.exit_code == 0 {
            Ok(())
        } else {
            Err(FileError::WriteFailed {
                path: path.to_owned(),
                reason: format!("cannot set mode {mode:o}"),
            }
            .into())
        }
    }
}

#[async_trait]
impl FileSystem for E2bBackend {
    async fn read(
        &self,
        sandbox: &SandboxRef,
        path: &str,
        offset: u64,
        length: u64,
    ) -> Result<ReadAnswer, FileOpError> {
        let target = self.target(sandbox).await?;
        let Some(entry) = self.look(sandbox, &target, path).await? else {
            return Err(FileError::NotFound(path.to_owned()).into());
        };
        match entry.kind {
            FileType::Directory => return Err(FileError::IsDirectory(path.to_owned()).into()),
            FileType::File => {}
            _ if entry.dangles() => return Err(FileError::NotFound(path.to_owned()).into()),
            _ => return Err(FileError::NotRegular(path.to_owned()).into()),
        }
        let size = entry.size;
        if size == 0 {
            // Empty, or a file that only says so (`/proc`): the program counts what it reads.
            return Err(FileOpError::NotDirect);
        }
        if offset >= size || length == 0 {
            return Ok(ReadAnswer {
                size,
                bytes: Vec::new(),
            });
        }
        let length = length.min(size - offset);
        match target.download(path, offset, length).await {
            Ok(bytes) => Ok(ReadAnswer { size, bytes }),
            Err(CallError::Refused {
                status, message, ..
            }) => Err(match status {
                404 => FileError::NotFound(path.to_owned()),
                400 if message.contains("is a directory") => {
                    FileError::IsDirectory(path.to_owned())
                }
                _ if message.to_ascii_lowercase().contains("permission denied") => {
                    FileError::PermissionDenied(path.to_owned())
                }
                _ => FileError::ReadFailed {
                    path: path.to_owned(),
                    reason: CallError::Refused {
                        status,
                        code: String::new(),
                        message,
                    }
                    .reason(),
                },
            }
            .into()),
            Err(error) => Err(self.call_failed(sandbox, path, error).await),
        }
    }

    async fn write(
        &self,
        sandbox: &SandboxRef,
        path: &str,
        bytes: &[u8],
        append: bool,
        mode: Option<u32>,
    ) -> Result<u64, FileOpError> {
        if append {
            return Err(FileOpError::NotDirect);
        }
        let target = self.target(sandbox).await?;
        let write_failed = |reason: String| -> FileOpError {
            FileError::WriteFailed {
                path: path.to_owned(),
                reason,
            }
            .into()
        };
        let existing = match self.look(sandbox, &target, path).await {
            Ok(existing) => existing,
            Err(FileOpError::File(FileError::ReadFailed { reason, .. })) => {
                return Err(write_failed(reason));
            }
            Err(error) => return Err(error),
        };
        // A replaced file keeps its permission bits (docs/files.md, "file_write").
        let kept = match &existing {
            Some(entry) if entry.kind == FileType::Directory => {
                return Err(FileError::WriteToDirectory(path.to_owned()).into());
            }
            Some(entry) if entry.kind == FileType::File && !entry.is_symlink() => entry
                .to_entry(path.to_owned())
                .and_then(|e| u32::from_str_radix(&e.mode, 8).ok()),
            _ => None,
        };
        let wanted = mode.or(kept);
        let temporary = files::temporary_path(path, rand::random());
        let mut leftover = Leftover {
            target: target.clone(),
            path: temporary.clone(),
            armed: true,
        };
        if let Err(error) = target.upload(&temporary, bytes).await {
            return Err(match error {
                CallError::Refused { .. } => {
                    leftover.discard().await;
                    write_failed(error.reason())
                }
                other => self.call_failed(sandbox, path, other).await,
            });
        }
        if let Some(wanted) = wanted {
            let given = match target.stat(&temporary).await {
                Ok(entry) => entry.to_entry(temporary.clone()).map(|e| e.mode),
                Err(error) => {
                    leftover.discard().await;
                    return Err(match error {
                        CallError::Refused { .. } => write_failed(error.reason()),
                        other => self.call_failed(sandbox, path, other).await,
                    });
                }
            };
            if given.as_deref() != Some(format!("{wanted:04o}").as_str())
                && let Err(error) = self.chmod(sandbox, &temporary, wanted).await
            {
                leftover.discard().await;
                return Err(match error {
                    FileOpError::File(FileError::WriteFailed { reason, .. }) => {
                        write_failed(reason)
                    }
                    other => other,
                });
            }
        }
        let moved: Result<EntryResponse, CallError> = target
            .rpc(
                "Move",
                &MoveRequest {
                    source: &temporary,
                    destination: path,
                },
                ENTRY_ANSWER_LIMIT,
            )
            .await;
        match moved {
            Ok(_) => {
                leftover.armed = false;
                Ok(bytes.len() as u64)
            }
            Err(error @ CallError::Refused { .. }) => {
                leftover.discard().await;
                Err(write_failed(format!(
                    "cannot replace {path}: {}",
                    error.reason()
                )))
            }
            Err(other) => Err(self.call_failed(sandbox, path, other).await),
        }
    }

    async fn list(
        &self,
        sandbox: &SandboxRef,
        path: &str,
        depth: u8,
    ) -> Result<Listing, FileOpError> {
        let target = self.target(sandbox).await?;
        let base = path.trim_end_matches('/');
        let base = if base.is_empty() { "/" } else { base };
        let Some(own) = self.look(sandbox, &target, path).await? else {
            return Err(FileError::NotFound(path.to_owned()).into());
        };
        if own.kind != FileType::Directory || own.is_symlink() {
            let entry = own
                .to_entry(base.to_owned())
                .ok_or_else(|| FileError::Garbled(path.to_owned()))?;
            return Ok(Listing {
                entries: vec![entry],
                truncated: false,
            });
        }
        let request = ListDirRequest {
            path,
            depth: u32::from(depth.max(1)),
        };
        let answer: ListDirResponse = match target.rpc("ListDir", &request, LIST_ANSWER_LIMIT).await
        {
            Ok(answer) => answer,
            Err(CallError::TooLarge) => return Err(FileOpError::NotDirect),
            Err(error) if error.code() == "not_found" => {
                return Err(FileError::NotFound(path.to_owned()).into());
            }
            Err(error) if error.code() == "permission_denied" => {
                return Err(FileError::PermissionDenied(path.to_owned()).into());
            }
            Err(error) => return Err(self.call_failed(sandbox, path, error).await),
        };
        let mut entries = Vec::with_capacity(answer.entries.len().min(files::LIST_LIMIT + 1));
        for info in &answer.entries {
            if !info.path.starts_with('/') {
                continue;
            }
            let entry = info
                .to_entry(info.path.clone())
                .ok_or_else(|| FileError::Garbled(path.to_owned()))?;
            entries.push(entry);
        }
        let truncated = entries.len() > files::LIST_LIMIT;
        entries.sort_by(|a, b| a.path.cmp(&b.path));
        entries.truncate(files::LIST_LIMIT);
        Ok(Listing { entries, truncated })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_in_rfc3339() {
        assert_eq!(rfc3339_seconds("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(rfc3339_seconds("2023-11-14T22:13:20Z"), Some(1_700_000_000));
        assert_eq!(
            rfc3339_seconds("2023-11-14T22:13:20.123456789Z"),
            Some(1_700_000_000)
        );
        assert_eq!(
            rfc3339_seconds("2023-11-15T00:13:20+02:00"),
            Some(1_700_000_000)
        );
        assert_eq!(rfc3339_seconds("2000-02-29T00:00:00Z"), Some(951_782_400));
        for bad in [
            "",
            "2023-11-14",
            "2023-11-14T22:13:20",
            "2023-13-14T22:13:20Z",
            "2023-11-14T22:13:20.Z",
            "2023-11-14T22:13:20+0200",
            "+023-11-14T22:13:20Z",
            "2023-11-14T22:13:2xZ",
        ] {
            assert_eq!(rfc3339_seconds(bad), None, "{bad}");
        }
    }

    fn info(json: &str) -> EntryInfo {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn entries_follow_the_programs_answers() {
        let file = info(
            r#"{"name":"a","type":"FILE_TYPE_FILE","path":"/a","size":"12","mode":420,
                "permissions":"-rw-r--r--","modifiedTime":"2023-11-14T22:13:20Z"}"#,
        );
        let entry = file.to_entry("/a".into()).unwrap();
        assert_eq!(
            (entry.kind, entry.size, entry.mode.as_str(), entry.modified),
            (EntryKind::File, 12, "0644", 1_700_000_000)
        );
        let tmp = info(
            r#"{"type":"FILE_TYPE_DIRECTORY","path":"/tmp","size":4096,"mode":511,
                "permissions":"dtrwxrwxrwx"}"#,
        );
        let entry = tmp.to_entry("/tmp".into()).unwrap();
        assert_eq!((entry.kind, entry.mode.as_str()), (EntryKind::Dir, "1777"));
        // A link to a directory: envd says the target's type and mode; the listing says link.
        let link = info(
            r#"{"type":2,"path":"/l","size":"3","mode":493,"permissions":"Lrwxrwxrwx",
                "symlinkTarget":"/usr"}"#,
        );
        assert!(link.is_symlink() && !link.dangles());
        let entry = link.to_entry("/l".into()).unwrap();
        assert_eq!(
            (entry.kind, entry.mode.as_str()),
            (EntryKind::Symlink, "0777")
        );
        let dangling = info(r#"{"path":"/d","permissions":"Lrwxrwxrwx"}"#);
        assert!(dangling.dangles());
        let fifo = info(r#"{"path":"/p","mode":420,"permissions":"prw-r--r--"}"#);
        assert!(!fifo.is_symlink());
        assert_eq!(fifo.to_entry("/p".into()).unwrap().kind, EntryKind::Other);
        // Hostile answers do not parse, or do not become entries.
        assert!(serde_json::from_str::<EntryInfo>(r#"{"size":"-1"}"#).is_err());
        assert!(serde_json::from_str::<EntryInfo>(r#"{"size":[1]}"#).is_err());
        assert!(serde_json::from_str::<EntryInfo>(r#"{"type":{}}"#).is_err());
        assert!(
            info(r#"{"modifiedTime":"yesterday"}"#)
                .to_entry("/x".into())
                .is_none()
        );
        assert_eq!(info(r#"{"permissions":"é"}"#).type_letters(), "");
    }

    #[test]
    fn multipart_body_has_one_file_part() {
        let (boundary, body) = multipart(b"a\r\nb");
        assert!(boundary.starts_with("kilntainers-"));
        let text = String::from_utf8(body).unwrap();
        assert!(text.starts_with(&format!("--{boundary}\r\n")));
        assert!(text.contains("name=\"file\""));
        assert!(text.ends_with(&format!("\r\n\r\na\r\nb\r\n--{boundary}--\r\n")));
    }

    /// A loopback "envd" that answers every request with `head` and then an endless body.
    async fn endless(head: &'static str) -> (Target, tokio::task::JoinHandle<()>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut request = [0u8; 4096];
            let _ = socket.read(&mut request).await;
            socket.write_all(head.as_bytes()).await.unwrap();
            let chunk = format!("{:x}\r\n{}\r\n", 65536, "x".repeat(65536));
            while socket.write_all(chunk.as_bytes()).await.is_ok() {}
        });
        let target = Target {
            http: reqwest::Client::new(),
            base: format!("http://{address}"),
            sandbox_id: "isb".to_owned(),
            token: None,
            version: EnvdVersion::CURRENT,
        };
        (target, server)
    }

    #[tokio::test]
    async fn endless_answers_are_cut_at_the_page_or_the_cap() {
        let limit = Duration::from_secs(20);
        // A download that ignores the Range: the page is skipped to and kept, nothing more.
        let (target, server) =
            endless("HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n").await;
        let page = tokio::time::timeout(limit, target.download("/f", 100_000, 1000))
            .await
            .expect("the page ends the read")
            .unwrap();
        assert_eq!(page, vec![b'x'; 1000]);
        server.abort();
        // A 206 for another range than asked is not taken.
        let (target, server) = endless(
            "HTTP/1.1 206 Partial Content\r\ncontent-range: bytes 0-9/10\r\ntransfer-encoding: chunked\r\n\r\n",
        )
        .await;
        let answer = target.download("/f", 5, 5).await;
        assert!(matches!(answer, Err(CallError::Garbled)), "{answer:?}");
        server.abort();
        // A listing without end stops at the cap.
        let (target, server) =
            endless("HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n").await;
        let request = ListDirRequest {
            path: "/",
            depth: 1,
        };
        let answer = tokio::time::timeout(
            limit,
            target.rpc::<_, ListDirResponse>("ListDir", &request, LIST_ANSWER_LIMIT),
        )
        .await
        .expect("the cap ends the read");
        assert!(matches!(answer, Err(CallError::TooLarge)), "{answer:?}");
        server.abort();
    }
}
