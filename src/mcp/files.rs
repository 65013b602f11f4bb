//! The file tools (docs/files.md): `file_read`, `file_write`, `file_list`, and the resource
//! template `computer://{computer_id}/{+path}`. Argument decoding with the exact messages,
//! the programs' runs through the registry (the same computer, lock and attach rules as
//! `terminal_execute`), and the result payloads. The programs themselves are
//! [`crate::files`]'s.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use rmcp::ErrorData;
use rmcp::model::{ReadResourceResult, ResourceContents, ResourceTemplate, Tool, ToolAnnotations};
use serde_json::{Map, Value, json};
use tokio_util::sync::CancellationToken;

use super::args::Args;
use super::call::{Call, CallError, Image, Payload};
use super::format;
use super::routes::Definitions;
use crate::backends::SandboxRef;
use crate::backends::files::{FileError, FileOpError, MAX_DEPTH, ReadAnswer, WRITE_LIMIT};
use crate::files::{self, Access};
use crate::ids::ComputerId;
use crate::registry::{Registry, RegistryError, Session};

pub const READ: &str = "file_read";
pub const WRITE: &str = "file_write";
pub const LIST: &str = "file_list";

/// The sentence the server's instructions gain with the switch on.
pub const INSTRUCTIONS: &str = " To move files in or out of a computer, use file_read, file_write and file_list rather than cat and stdin: they keep binary data intact, and file_read shows images. To open a server running in a computer in a browser, use port_url.";

pub const RESOURCE_TEMPLATE: &str = "computer://{computer_id}/{+path}";
const RESOURCE_SCHEME: &str = "computer://";

pub(super) fn annotations(read_only: bool) -> ToolAnnotations {
    let mut annotations = ToolAnnotations::new();
    annotations.read_only_hint = Some(read_only);
    annotations.destructive_hint = Some(!read_only);
    annotations.open_world_hint = Some(true);
    annotations
}

fn path_property(what: &str) -> Value {
    json!({"type": "string", "title": "Path", "description": format!("Absolute path of the {what} in the computer.")})
}

pub(super) fn computer_id_property() -> Value {
    json!({"type": "string", "title": "Computer Id", "description": "The computer; omit for this session's default computer (created on first use, like terminal_execute)."})
}

/// `file_read`; a page is at most the output limit.
pub(super) fn read_tool(definitions: &Definitions<'_>) -> Tool {
    let output_limit = definitions.output_limit;
    Tool::new(
        READ,
        "Read a file from a computer. Returns UTF-8 text as is and anything else as base64 (see `encoding`); PNG, JPEG, GIF and WebP images read whole also come back as an image you can see. Large files: page with `offset` and `length` until `eof` is true.",
        format::object(json!({
            "type": "object",
            "properties": {
                "path": path_property("file"),
                "computer_id": computer_id_property(),
                "offset": {"type": "integer", "minimum": 0, "default": 0, "title": "Offset", "description": "Byte offset to start reading at."},
                "length": {"type": "integer", "minimum": 1, "maximum": output_limit, "title": "Length", "description": format!("Most bytes to read (default and maximum {output_limit}).")}
            },
            "required": ["path"]
        })),
    )
    .with_raw_output_schema(format::output_schema(
        json!({
            "computer_id": {"type": "string"},
            "path": {"type": "string"},
            "size": {"type": "integer"},
            "offset": {"type": "integer"},
            "length": {"type": "integer"},
            "encoding": {"type": "string", "enum": ["utf-8", "base64"]},
            "content": {"type": "string"},
            "eof": {"type": "boolean"}
        }),
        &["computer_id", "path", "size", "offset", "length", "encoding", "content", "eof"],
        None,
    ))
    .with_annotations(annotations(true))
}

pub(super) fn write_tool(_: &Definitions<'_>) -> Tool {
    Tool::new(
        WRITE,
        "Write a file in a computer, creating parent directories. Replaces the file atomically unless `append` is true. `content` is UTF-8 text, or base64 with encoding \"base64\" (binary files); up to 16 MiB per call, append for more.",
        format::object(json!({
            "type": "object",
            "properties": {
                "path": path_property("file"),
                "content": {"type": "string", "title": "Content", "description": "The file's content: text, or base64 with encoding \"base64\"."},
                "computer_id": computer_id_property(),
                "encoding": {"type": "string", "enum": ["utf-8", "base64"], "default": "utf-8", "title": "Encoding"},
                "append": {"type": "boolean", "default": false, "title": "Append", "description": "Add to the end of the file instead of replacing it."},
                "mode": {"type": "string", "title": "Mode", "description": "Permission bits in octal, like \"0755\"; a replaced file keeps its mode otherwise."}
            },
            "required": ["path", "content"]
        })),
    )
    .with_raw_output_schema(format::output_schema(
        json!({
            "computer_id": {"type": "string"},
            "path": {"type": "string"},
            "size": {"type": "integer"},
            "bytes_written": {"type": "integer"}
        }),
        &["computer_id", "path", "size", "bytes_written"],
        None,
    ))
    .with_annotations(annotations(false))
}

pub(super) fn list_tool(_: &Definitions<'_>) -> Tool {
    Tool::new(
        LIST,
        "List a directory in a computer, to `depth` levels (1-5): each entry's path, type (file, dir, symlink, other), size, mode and modification time, sorted by path, at most 1,000.",
        format::object(json!({
            "type": "object",
            "properties": {
                "path": path_property("directory"),
                "computer_id": computer_id_property(),
                "depth": {"type": "integer", "minimum": 1, "maximum": MAX_DEPTH, "default": 1, "title": "Depth"}
            },
            "required": ["path"]
        })),
    )
    .with_raw_output_schema(format::output_schema(
        json!({
            "entries": {"type": "array", "items": {"type": "object", "properties": {
                "path": {"type": "string"},
                "type": {"type": "string", "enum": ["file", "dir", "symlink", "other"]},
                "size": {"type": "integer"},
                "mode": {"type": "string"},
                "modified": {"type": "string"}
            }}},
            "count": {"type": "integer"},
            "truncated": {"type": "boolean"}
        }),
        &["entries", "count", "truncated"],
        None,
    ))
    .with_annotations(annotations(true))
}

pub fn resource_template() -> ResourceTemplate {
    ResourceTemplate::new(RESOURCE_TEMPLATE, "computer-file")
        .with_title("File in a sandbox computer")
        .with_description("A file in an existing computer, e.g. computer://dev-box/root/report.png. Text files come back as text, others as a blob. Reading never creates a computer.")
}

fn decode_path(args: &Args<'_>) -> Result<String, CallError> {
    let path = args.required_string("path")?;
    if !path.starts_with('/') {
        return Err(CallError::invalid(format!(
            "path must be an absolute path, got: {path}"
        )));
    }
    if path.contains('\0') {
        return Err(CallError::invalid("path must not contain a NUL character."));
    }
    Ok(path)
}

/// The optional `computer_id`, as the caller's computer.
pub(super) fn decode_computer(
    args: &Args<'_>,
    session: &Session,
) -> Result<Option<ComputerId>, CallError> {
    let Some(raw) = args.string("computer_id")?.filter(|raw| !raw.is_empty()) else {
        return Ok(None);
    };
    Ok(Some(ComputerId::parse(&raw)?.owned_by(session.principal())))
}

/// Runs one file operation on a computer in its exec turn: `computer` (the session's default
/// when `None`) created on first use like terminal_execute, in the mode it has when it exists.
async fn in_turn<T>(
    registry: &Registry,
    session: &Session,
    computer: Option<ComputerId>,
    cancel: &CancellationToken,
    operation: impl AsyncFnOnce(&Access<'_>, &SandboxRef) -> Result<T, FileOpError>,
) -> Result<(ComputerId, T), CallError> {
    Access::check_available(registry.backend().as_ref())?;
    let temporary = mode_of(registry, session, computer.as_ref()).await?;
    let backend = registry.backend().as_ref();
    let shell = registry.shell();
    let timeout_secs = registry.limits().default_timeout_secs;
    let (sandbox, answer) = registry
        .with_turn(
            session,
            computer,
            temporary,
            cancel,
            async |sandbox, cancel| {
                let access = Access::new(backend, shell, timeout_secs, cancel);
                operation(&access, sandbox).await
            },
        )
        .await?;
    Ok((sandbox.computer_id, answer?))
}

/// The `temporary` a call without that argument uses for `computer`: a named computer that
/// exists keeps the mode it has (the file and port tools take no `temporary`); the session's
/// default, or a named one that does not exist yet, is temporary, as by terminal_execute.
pub(super) async fn mode_of(
    registry: &Registry,
    session: &Session,
    computer: Option<&ComputerId>,
) -> Result<bool, CallError> {
    let Some(id) = computer else {
        return Ok(true);
    };
    match registry.attach_existing(session, id).await {
        Ok(sandbox) => Ok(sandbox.temporary),
        Err(RegistryError::NotFound(_)) => Ok(true),
        Err(error) => Err(error.into()),
    }
}

/// One page of a file, as `file_read` and resources return it.
struct Page {
    size: u64,
    offset: u64,
    bytes: Vec<u8>,
    /// How many of `bytes` are UTF-8 text, or `None` when they are not text.
    text_len: Option<usize>,
}

impl Page {
    fn new(answer: ReadAnswer, offset: u64) -> Self {
        let end = offset.saturating_add(answer.bytes.len() as u64);
        let text_len = files::utf8_prefix(&answer.bytes, end >= answer.size);
        let mut bytes = answer.bytes;
        if let Some(n) = text_len {
            bytes.truncate(n);
        }
        Self {
            size: answer.size,
            offset,
            bytes,
            text_len,
        }
    }

    fn eof(&self) -> bool {
        self.offset.saturating_add(self.bytes.len() as u64) >= self.size
    }
}

async fn read_page(
    registry: &Registry,
    session: &Session,
    computer: Option<ComputerId>,
    path: &str,
    offset: u64,
    length: u64,
    cancel: &CancellationToken,
) -> Result<(ComputerId, Page), CallError> {
    let (id, answer) = in_turn(
        registry,
        session,
        computer,
        cancel,
        async |access, sandbox| access.read(sandbox, path, offset, length).await,
    )
    .await?;
    Ok((id, Page::new(answer, offset)))
}

/// `file_read`.
pub(super) async fn read(call: &Call<'_>) -> Result<Payload, CallError> {
    let (registry, session) = (call.registry(), call.session);
    let args = call.args();
    let path = decode_path(&args)?;
    let computer = decode_computer(&args, session)?;
    let limit = registry.limits().output_limit.max(1);
    let offset = match args.integer("offset")? {
        Some(o) if o < 0 => return Err(CallError::invalid("offset must be 0 or more.")),
        Some(o) => o.unsigned_abs(),
        None => 0,
    };
    let length = match args.integer("length")? {
        Some(l) if l < 1 => return Err(CallError::invalid("length must be at least 1.")),
        Some(l) => l.unsigned_abs().min(limit),
        None => limit,
    };
    let read = read_page(
        registry,
        session,
        computer,
        &path,
        offset,
        length,
        call.cancel,
    );
    let (id, page) = read.await?;
    let image = (page.offset == 0 && page.eof() && page.size <= limit)
        .then(|| files::image_type(&page.bytes))
        .flatten();
    let (encoding, content) = match page.text_len {
        Some(_) => ("utf-8", String::from_utf8_lossy(&page.bytes).into_owned()),
        None => ("base64", BASE64.encode(&page.bytes)),
    };
    let mut payload = Map::new();
    payload.insert("computer_id".into(), json!(id.slug()));
    payload.insert("path".into(), json!(path));
    payload.insert("size".into(), json!(page.size));
    payload.insert("offset".into(), json!(page.offset));
    payload.insert("length".into(), json!(page.bytes.len()));
    payload.insert("encoding".into(), json!(encoding));
    payload.insert("content".into(), json!(content));
    payload.insert("eof".into(), json!(page.eof()));
    let image = image.map(|mime| Image {
        base64: BASE64.encode(&page.bytes),
        mime,
    });
    Ok(Payload::from(payload).with_image(image))
}

/// `file_write`.
pub(super) async fn write(call: &Call<'_>) -> Result<Payload, CallError> {
    let args = call.args();
    let path = decode_path(&args)?;
    let content = args.required_string("content")?;
    let computer = decode_computer(&args, call.session)?;
    let append = args.boolean("append")?.unwrap_or(false);
    let mode = args.string("mode")?.filter(|m| !m.is_empty());
    let mode = match mode {
        None => None,
        Some(mode) => Some(files::parse_mode(&mode).ok_or_else(|| {
            CallError::invalid(format!(
                "mode must be an octal string like \"0755\", got: {mode}"
            ))
        })?),
    };
    let bytes = match args.string("encoding")?.as_deref() {
        None | Some("" | "utf-8" | "utf8") => content.into_bytes(),
        Some("base64") => {
            let compact: String = content.split_ascii_whitespace().collect();
            BASE64
                .decode(compact.as_bytes())
                .map_err(|_| CallError::invalid("content is not valid base64."))?
        }
        Some(other) => {
            return Err(CallError::invalid(format!(
                "encoding must be \"utf-8\" or \"base64\", got: {other}"
            )));
        }
    };
    if bytes.len() > WRITE_LIMIT {
        return Err(CallError::invalid(format!(
            "content is larger than 16 MiB ({} bytes); write the file in several calls with append: true.",
            bytes.len()
        )));
    }
    let write = async |access: &Access<'_>, sandbox: &SandboxRef| {
        access.write(sandbox, &path, &bytes, append, mode).await
    };
    let (computer, size) =
        in_turn(call.registry(), call.session, computer, call.cancel, write).await?;
    let mut payload = Map::new();
    payload.insert("computer_id".into(), json!(computer.as_str()));
    payload.insert("path".into(), json!(path));
    payload.insert("size".into(), json!(size));
    payload.insert("bytes_written".into(), json!(bytes.len()));
    Ok(payload.into())
}

/// `file_list`.
pub(super) async fn list(call: &Call<'_>) -> Result<Payload, CallError> {
    let args = call.args();
    let path = decode_path(&args)?;
    let computer = decode_computer(&args, call.session)?;
    let depth = match args.integer("depth")? {
        None => 1,
        Some(d) if (1..=i64::from(MAX_DEPTH)).contains(&d) => d,
        Some(d) => {
            return Err(CallError::invalid(format!(
                "depth must be between 1 and {}, got: {d}",
                MAX_DEPTH
            )));
        }
    };
    let depth = u8::try_from(depth).unwrap_or(MAX_DEPTH);
    let list =
        async |access: &Access<'_>, sandbox: &SandboxRef| access.list(sandbox, &path, depth).await;
    let (_, listing) = in_turn(call.registry(), call.session, computer, call.cancel, list).await?;
    let entries: Vec<Value> = listing
        .entries
        .iter()
        .map(|entry| {
            json!({
                "path": entry.path,
                "type": entry.kind.to_string(),
                "size": entry.size,
                "mode": entry.mode,
                "modified": crate::clock::rfc3339_utc(entry.modified),
            })
        })
        .collect();
    let mut payload = Map::new();
    payload.insert("count".into(), json!(entries.len()));
    payload.insert("entries".into(), Value::Array(entries));
    payload.insert("truncated".into(), json!(listing.truncated));
    Ok(payload.into())
}

/// The computer and path a `computer://` URI names, or `None` when it is not one.
pub fn parse_uri(uri: &str) -> Option<Result<(ComputerId, String), String>> {
    let rest = uri.strip_prefix(RESOURCE_SCHEME)?;
    let Some((id, path)) = rest.split_once('/') else {
        return Some(Err(format!(
            "Resource URI {uri} names no file; use computer://<computer_id>/<path>."
        )));
    };
    let path = percent_encoding::percent_decode_str(path).decode_utf8_lossy();
    let id = match ComputerId::parse(id) {
        Ok(id) => id,
        Err(e) => return Some(Err(e.to_string())),
    };
    Some(Ok((id, format!("/{path}"))))
}

/// `resources/read` of a `computer://` URI: the whole file as one text or blob item. Never
/// creates a computer.
pub async fn read_resource(
    registry: &Registry,
    session: &Session,
    uri: &str,
    id: ComputerId,
    path: String,
    cancel: &CancellationToken,
) -> Result<ReadResourceResult, ErrorData> {
    let id = id.owned_by(session.principal());
    let sandbox = match registry.attach_existing(session, &id).await {
        Ok(sandbox) => sandbox,
        Err(RegistryError::NotFound(_)) => {
            return Err(ErrorData::resource_not_found(
                format!("Computer {} not found.", id.slug()),
                None,
            ));
        }
        Err(error) => {
            return Err(ErrorData::internal_error(
                format::user_message(&error),
                None,
            ));
        }
    };
    let limit = registry.limits().output_limit.max(1);
    let page = read_page(
        registry,
        session,
        Some(sandbox.computer_id.clone()),
        &path,
        0,
        limit,
        cancel,
    )
    .await;
    let page = match page {
        Ok((_, page)) => page,
        Err(CallError::File(error @ FileError::NotFound(_))) => {
            return Err(ErrorData::resource_not_found(error.to_string(), None));
        }
        Err(error) => return Err(ErrorData::internal_error(error.to_string(), None)),
    };
    if page.size > limit {
        return Err(ErrorData::invalid_params(
            format!("File is larger than {limit} bytes; use file_read with offset and length."),
            None,
        ));
    }
    let contents = match page.text_len {
        Some(_) => ResourceContents::text(String::from_utf8_lossy(&page.bytes), uri)
            .with_mime_type(files::text_type(&path)),
        None => ResourceContents::blob(BASE64.encode(&page.bytes), uri)
            .with_mime_type(files::image_type(&page.bytes).unwrap_or("application/octet-stream")),
    };
    Ok(ReadResourceResult::new(vec![contents]))
}
