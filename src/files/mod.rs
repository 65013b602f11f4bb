//! Files in a computer without the user's shell (docs/files.md): the POSIX `sh` programs that
//! read, write and list, and the strict reading of what they answer. Every value reaches a
//! program as a positional argument, never spliced into its text; data goes in as base64 on
//! stdin and comes out raw on stdout, with one status line on stderr. What a computer answers
//! is hostile: anything that does not parse is an error, never a panic, and nothing is trusted
//! to be shorter than asked for. Knows no provider and no MCP.

mod access;
#[cfg(test)]
mod tests;

pub use access::Access;

use crate::backends::files::{
    Entry, EntryKind, FileError, LIST_ANSWER_LIMIT, LIST_LIMIT, Listing, ReadAnswer,
};

/// Decoded bytes sent per exec of a write: keeps each exec's stdin (base64, 4/3 larger) under
/// the 2 MiB that every backend's exec accepts.
pub const WRITE_CHUNK: usize = 1536 * 1024;

/// Room for a program's status line on top of the data it returns.
pub const STATUS_ROOM: u64 = 4096;

/// The entry bytes [`LIST`] prints at most (it cuts its own output there, so an honest
/// computer never meets [`LIST_ANSWER_LIMIT`]; a listing cut there is `truncated`).
pub const LIST_ENTRY_BYTES: u64 = LIST_ANSWER_LIMIT - STATUS_ROOM;

/// Reads at most `$3` bytes of `$1` from offset `$2`. Status on stderr: `ok <size>`,
/// `missing`, `dir`, `other` or `denied`; the bytes on stdout, as base64 when `$4` is
/// `base64` (backends whose exec output is text, see [`parse_read_base64`]). The size comes from `stat`
/// (BusyBox `wc -c` reads the whole file); only a file that says it is empty, as those in
/// `/proc` do, is counted.
pub const READ: &str = r#"p=$1; o=$2; n=$3; e=$4
if [ -d "$p" ]; then echo dir >&2; exit 0; fi
if [ ! -e "$p" ]; then echo missing >&2; exit 0; fi
if [ ! -f "$p" ]; then echo other >&2; exit 0; fi
if [ ! -r "$p" ]; then echo denied >&2; exit 0; fi
s=$(stat -L -c %s "$p" 2>/dev/null) || s=0
if [ "$s" = 0 ]; then s=$(wc -c < "$p" 2>/dev/null) || { echo denied >&2; exit 0; }; fi
s=$((s))
printf 'ok %s\n' "$s" >&2
if [ "$o" -lt "$s" ]; then
  if [ "$e" = base64 ]; then tail -c +$((o + 1)) "$p" | head -c "$n" | base64
  else tail -c +$((o + 1)) "$p" | head -c "$n"; fi
fi
exit 0
"#;

/// Writes base64 from stdin into `$2` for the file `$1`. `$3` = 1 on the first chunk (make the
/// parent directories, start `$2` empty unless it is the file itself, as for an append), `$4` =
/// 1 on the last (give the temporary file the mode, `$5` or the old file's, and rename it over
/// `$1`). Prints `ok` or `ok <size>` after the last chunk, `dir`, or `failed <reason>`; a
/// failure removes the temporary file. (It starts the file with `true >`, not `: >`: a failed
/// redirection on a special builtin ends the whole program.)
pub const WRITE: &str = r#"p=$1; t=$2; first=$3; last=$4; m=$5
fail() { [ "$t" != "$p" ] && rm -f "$t"; printf 'failed %s\n' "$1"; exit 0; }
if [ "$first" = 1 ]; then
  if [ -d "$p" ]; then echo dir; exit 0; fi
  d=${p%/*}; [ -n "$d" ] || d=/
  [ -d "$d" ] || mkdir -p "$d" 2>/dev/null || fail "cannot create the directory $d"
  if [ "$t" != "$p" ]; then true > "$t" 2>/dev/null || fail "cannot create a file in $d"; fi
fi
base64 -d >> "$t" 2>/dev/null || fail "writing failed (disk full or not writable)"
if [ "$last" != 1 ]; then echo ok; exit 0; fi
if [ "$t" != "$p" ]; then
  if [ -n "$m" ]; then chmod "$m" "$t" 2>/dev/null || fail "cannot set mode $m"
  elif [ -e "$p" ]; then chmod "$(stat -c %a "$p" 2>/dev/null || echo 644)" "$t" 2>/dev/null
  fi
  mv -f "$t" "$p" 2>/dev/null || fail "cannot replace $p"
elif [ -n "$m" ]; then chmod "$m" "$p" 2>/dev/null || fail "cannot set mode $m"
fi
printf 'ok %s\n' "$(stat -L -c %s "$p")"
"#;

/// Removes a temporary file a cancelled write left: `$1`.
pub const DISCARD: &str = r#"rm -f "$1"; exit 0
"#;

/// Lists `$1` to depth `$2`: `missing`, `denied`, or `ok` and then one line per entry, at most
/// [`LIST_LIMIT`] + 1 and `$3` bytes of them ([`LIST_ENTRY_BYTES`]), `<raw mode in hex> <size>
/// <mtime> <path>` (a file lists itself).
pub const LIST: &str = r#"p=$1; k=$2; b=$3
if [ ! -e "$p" ] && [ ! -L "$p" ]; then echo missing; exit 0; fi
if [ -d "$p" ] && [ ! -r "$p" ]; then echo denied; exit 0; fi
echo ok
if [ -d "$p" ]; then
  find "$p" -mindepth 1 -maxdepth "$k" -exec stat -c '%f %s %Y %n' {} + 2>/dev/null | head -n 1001 | head -c "$b"
else
  stat -c '%f %s %Y %n' "$p" 2>/dev/null
fi
exit 0
"#;

/// Reads [`READ`]'s answer for `path`, keeping at most `length` bytes whatever came.
pub fn parse_read(
    path: &str,
    stdout: Vec<u8>,
    stderr: &[u8],
    length: u64,
) -> Result<ReadAnswer, FileError> {
    let status = first_line(stderr);
    let mut bytes = stdout;
    bytes.truncate(usize::try_from(length).unwrap_or(usize::MAX));
    match status.split_once(' ') {
        Some(("ok", size)) => size
            .parse()
            .map(|size| ReadAnswer { size, bytes })
            .map_err(|_| FileError::Garbled(path.to_owned())),
        _ => Err(status_error(status, path)),
    }
}

/// The most base64 text [`READ`] sends for `length` bytes: 4 characters per 3 bytes, plus
/// the line breaks `base64` puts after every 76.
pub fn base64_answer_len(length: u64) -> u64 {
    let text = length.div_ceil(3).saturating_mul(4);
    text.saturating_add(text / 76 + 1)
}

/// Reads [`READ`]'s answer given as base64 (`$4` = `base64`); keeps at most `length` bytes.
pub fn parse_read_base64(
    path: &str,
    stdout: &[u8],
    stderr: &[u8],
    length: u64,
) -> Result<ReadAnswer, FileError> {
    use base64::Engine as _;
    let compact: Vec<u8> = stdout
        .iter()
        .copied()
        .filter(|b| !b.is_ascii_whitespace())
        .collect();
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(compact)
        .map_err(|_| FileError::Garbled(path.to_owned()))?;
    parse_read(path, bytes, stderr, length)
}

/// Reads [`WRITE`]'s answer: the file's size after the last chunk.
pub fn parse_write(path: &str, stdout: &[u8]) -> Result<Option<u64>, FileError> {
    let status = first_line(stdout);
    match status.split_once(' ') {
        None if status == "ok" => Ok(None),
        None if status == "dir" => Err(FileError::WriteToDirectory(path.to_owned())),
        Some(("ok", size)) => size
            .parse()
            .map(Some)
            .map_err(|_| FileError::Garbled(path.to_owned())),
        Some(("failed", reason)) => Err(FileError::WriteFailed {
            path: path.to_owned(),
            reason: reason.chars().take(300).collect(),
        }),
        _ => Err(FileError::Garbled(path.to_owned())),
    }
}

/// Reads [`LIST`]'s answer. Lines that do not parse (a name with a newline splits into two)
/// are skipped, as is a last line without its newline (cut by the byte budget); paths are taken
/// as bytes and shown lossily. Reading stops at the first entry past [`LIST_LIMIT`], which is
/// all the program prints: a computer that sends more (up to [`LIST_ANSWER_LIMIT`] of short
/// lines) costs no more than that many entries.
pub fn parse_list(path: &str, stdout: &[u8]) -> Result<Listing, FileError> {
    let (status, body) = match stdout.iter().position(|&b| b == b'\n') {
        Some(end) => (&stdout[..end], &stdout[end + 1..]),
        None => (stdout, &[][..]),
    };
    let status = String::from_utf8_lossy(status);
    if status != "ok" {
        return Err(status_error(&status, path));
    }
    let cut_by_bytes = body.len() as u64 >= LIST_ENTRY_BYTES;
    let whole_lines = body
        .iter()
        .rposition(|&b| b == b'\n')
        .map_or(&[][..], |end| &body[..end]);
    let mut entries: Vec<Entry> = whole_lines
        .split(|&b| b == b'\n')
        .filter_map(parse_entry)
        .take(LIST_LIMIT + 1)
        .collect();
    let truncated = entries.len() > LIST_LIMIT || cut_by_bytes;
    entries.sort_by(|a, b| a.path.cmp(&b.path));
    entries.truncate(LIST_LIMIT);
    Ok(Listing { entries, truncated })
}

fn parse_entry(line: &[u8]) -> Option<Entry> {
    let mut fields = line.splitn(4, |&b| b == b' ');
    let raw_mode = u32::from_str_radix(std::str::from_utf8(fields.next()?).ok()?, 16).ok()?;
    let size = std::str::from_utf8(fields.next()?).ok()?.parse().ok()?;
    let modified = std::str::from_utf8(fields.next()?).ok()?.parse().ok()?;
    let path = String::from_utf8_lossy(fields.next()?).into_owned();
    if !path.starts_with('/') {
        return None;
    }
    let kind = match raw_mode & 0o170_000 {
        0o100_000 => EntryKind::File,
        0o040_000 => EntryKind::Dir,
        0o120_000 => EntryKind::Symlink,
        _ => EntryKind::Other,
    };
    Some(Entry {
        path,
        kind,
        size,
        mode: format!("{:04o}", raw_mode & 0o7777),
        modified,
    })
}

fn first_line(bytes: &[u8]) -> &str {
    let line = bytes.split(|&b| b == b'\n').next().unwrap_or_default();
    std::str::from_utf8(line).unwrap_or("").trim_end()
}

fn status_error(status: &str, path: &str) -> FileError {
    match status {
        "missing" => FileError::NotFound(path.to_owned()),
        "dir" => FileError::IsDirectory(path.to_owned()),
        "other" => FileError::NotRegular(path.to_owned()),
        "denied" => FileError::PermissionDenied(path.to_owned()),
        _ => FileError::Garbled(path.to_owned()),
    }
}

/// `mode` as given to `file_write` (3 or 4 octal digits), as permission bits.
pub fn parse_mode(mode: &str) -> Option<u32> {
    let digits = (3..=4).contains(&mode.len()) && mode.bytes().all(|b| (b'0'..=b'7').contains(&b));
    digits.then(|| u32::from_str_radix(mode, 8).ok()).flatten()
}

/// How much of `bytes` to return as text: all of it when it is UTF-8; when only a character
/// cut by the end of the page is incomplete and the file goes on, the page up to it (the next
/// page starts there). `None` when the bytes are not text.
pub fn utf8_prefix(bytes: &[u8], at_end_of_file: bool) -> Option<usize> {
    match std::str::from_utf8(bytes) {
        Ok(_) => Some(bytes.len()),
        Err(e) if e.error_len().is_none() && !at_end_of_file && e.valid_up_to() > 0 => {
            Some(e.valid_up_to())
        }
        Err(_) => None,
    }
}

/// The MIME type of an image the model can be shown, from its first bytes.
pub fn image_type(bytes: &[u8]) -> Option<&'static str> {
    if bytes.starts_with(b"\x89PNG\r\n\x1a\n") {
        Some("image/png")
    } else if bytes.starts_with(b"\xff\xd8\xff") {
        Some("image/jpeg")
    } else if bytes.starts_with(b"GIF87a") || bytes.starts_with(b"GIF89a") {
        Some("image/gif")
    } else if bytes.len() >= 12 && &bytes[..4] == b"RIFF" && &bytes[8..12] == b"WEBP" {
        Some("image/webp")
    } else {
        None
    }
}

/// The MIME type a text file is served with as a resource, from its extension.
pub fn text_type(path: &str) -> &'static str {
    let extension = path
        .rsplit_once('.')
        .map(|(_, e)| e.to_ascii_lowercase())
        .unwrap_or_default();
    match extension.as_str() {
        "md" => "text/markdown",
        "html" | "htm" => "text/html",
        "css" => "text/css",
        "csv" => "text/csv",
        "js" | "mjs" => "text/javascript",
        "json" => "application/json",
        "xml" => "application/xml",
        "svg" => "image/svg+xml",
        "yaml" | "yml" => "application/yaml",
        _ => "text/plain",
    }
}
