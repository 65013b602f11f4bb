//! Screens one incoming JSON-RPC line before rmcp sees it, so that every request whose id can be
//! read gets exactly one answer.
//!
//! rmcp drops what it cannot parse without a word: a lone UTF-16 surrogate escape (`"\ud800"`,
//! which a model emitting half a surrogate pair produces), a number outside the f64 range
//! (`1e400`) and any other syntax error vanish, and a request whose params do not fit its method
//! is read as an unknown custom method. Here the line is repaired where the intent is plain
//! (lone surrogates and invalid UTF-8 become U+FFFD), and everything else that cannot reach a
//! handler is answered with the JSON-RPC error that names the problem: `-32700` (not JSON),
//! `-32600` (not a request; `id` is the request's when readable, else `null`), `-32602` (params
//! that do not fit). Transports call [`screen`]; this file owns no I/O and knows nothing about
//! stdio or HTTP.

use std::borrow::Cow;

use rmcp::RoleServer;
use rmcp::model::{CallToolRequestParams, ClientRequest, ErrorCode, JsonRpcMessage, RequestId};
use rmcp::service::RxJsonRpcMessage;
use serde_json::{Value, json};

/// The longest line accepted as one message. The largest legal request carries 2 MiB of stdin;
/// JSON escapes a control byte as `\u00XX` (six bytes), so that request can reach 12 MiB on the
/// wire. 16 MiB covers it with room for the envelope and equals rmcp's own stdio default, so a
/// request rmcp would have taken is still taken.
pub const MAX_LINE_BYTES: usize = 16 * 1024 * 1024;

/// How much of the start of an over-long line is kept to look for its `id`. Many clients write
/// `id` before `params`, so it sits in the first few hundred bytes; 64 KiB leaves room for a
/// long `jsonrpc`/`method` prefix while keeping the cost of a refused line small.
pub const OVERSIZED_ID_PREFIX_BYTES: usize = 64 * 1024;

/// How much of the end of an over-long line is kept: the official Python SDK writes `id` last
/// (`{"method":…,"params":…,"jsonrpc":"2.0","id":7}`), so without its tail a refused request
/// would be answered with a null id its client can never match, and the call would hang.
pub const OVERSIZED_ID_TAIL_BYTES: usize = 4 * 1024;

/// The methods rmcp 3.11 reads as typed client requests (the variants of `ClientRequest`). A
/// request for one of these whose params do not fit falls through to rmcp's custom request and
/// would be answered "method not found"; for these names the answer is "invalid params".
/// Methods outside this list (`tasks/list`, a typo) stay rmcp's, which answers -32601.
/// Follow rmcp upgrades: a variant missing here only means -32601 for its bad params.
const CLIENT_REQUEST_METHODS: &[&str] = &[
    "ping",
    "initialize",
    "server/discover",
    "completion/complete",
    "logging/setLevel",
    "prompts/get",
    "prompts/list",
    "resources/list",
    "resources/templates/list",
    "resources/read",
    "subscriptions/listen",
    "resources/subscribe",
    "resources/unsubscribe",
    "tools/call",
    "tools/list",
    "tasks/get",
    "tasks/update",
    "tasks/cancel",
    "skills/list",
    "skills/get",
    "resources/directory/read",
];

/// What to do with one line.
#[derive(Debug)]
pub enum Screened {
    /// A message rmcp can handle.
    Message(Box<RxJsonRpcMessage<RoleServer>>),
    /// A JSON-RPC error response to write back instead.
    Reply(Value),
    /// Nothing to hand on and nothing to answer: a blank line, or a notification that is
    /// malformed (notifications never get a response).
    Skip,
}

/// Screens one line (without its trailing newline).
pub fn screen(line: &[u8]) -> Screened {
    if line.iter().all(u8::is_ascii_whitespace) {
        return Screened::Skip;
    }
    let text = repair(line);
    match serde_json::from_str::<Value>(&text) {
        Ok(value) => classify(value),
        Err(error) => match tame_out_of_range_numbers(&text)
            .and_then(|tamed| serde_json::from_str::<Value>(&tamed).ok())
        {
            Some(tamed) => out_of_range(&tamed),
            None => Screened::Reply(error_reply(
                None,
                ErrorCode::PARSE_ERROR,
                format!("Parse error: {error}"),
            )),
        },
    }
}

/// The text of a message as it is read: a leading byte order mark dropped (RFC 8259 §8.1),
/// invalid UTF-8 and lone surrogate escapes replaced by U+FFFD. Borrowed when nothing changed.
pub fn repair(line: &[u8]) -> Cow<'_, str> {
    let line = line.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(line);
    match String::from_utf8_lossy(line) {
        Cow::Borrowed(text) => repair_lone_surrogates(text),
        Cow::Owned(text) => Cow::Owned(repair_lone_surrogates(&text).into_owned()),
    }
}

/// The answer to a line longer than [`MAX_LINE_BYTES`], given its first and last bytes.
pub fn oversized(prefix: &[u8], tail: &[u8]) -> Value {
    let id = leading_id(&String::from_utf8_lossy(prefix)).or_else(|| trailing_id(tail));
    error_reply(
        id,
        ErrorCode::INVALID_REQUEST,
        format!(
            "Invalid Request: the message is longer than the {} MiB limit",
            MAX_LINE_BYTES / (1024 * 1024)
        ),
    )
}

fn classify(value: Value) -> Screened {
    let Value::Object(object) = value else {
        let message = if value.is_array() {
            "Invalid Request: batches are not supported"
        } else {
            "Invalid Request: a message must be a JSON object"
        };
        return Screened::Reply(error_reply(None, ErrorCode::INVALID_REQUEST, message));
    };
    let id = match object.get("id") {
        None => None,
        Some(raw) => match serde_json::from_value::<RequestId>(raw.clone()) {
            Ok(id) => Some(id),
            Err(_) => {
                return Screened::Reply(error_reply(
                    None,
                    ErrorCode::INVALID_REQUEST,
                    "Invalid Request: id must be a string or an integer",
                ));
            }
        },
    };
    let invalid = |message: &str| {
        Screened::Reply(error_reply(
            id.clone(),
            ErrorCode::INVALID_REQUEST,
            format!("Invalid Request: {message}"),
        ))
    };
    if object.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
        return invalid("jsonrpc must be \"2.0\"");
    }
    let method = match object.get("method") {
        Some(Value::String(method)) => Some(method.clone()),
        Some(_) => return invalid("method must be a string"),
        None => None,
    };
    let is_response = object.contains_key("result") || object.contains_key("error");
    if method.is_none() && !(id.is_some() && is_response) {
        return invalid("method is missing");
    }
    let is_notification = method.is_some() && id.is_none();
    if let (Some(method), Some(id)) = (&method, &id)
        && let Some(problem) = params_problem(method, object.get("params"))
    {
        return Screened::Reply(error_reply(
            Some(id.clone()),
            ErrorCode::INVALID_PARAMS,
            format!("Invalid params for {method}: {problem}"),
        ));
    }
    match serde_json::from_value::<RxJsonRpcMessage<RoleServer>>(Value::Object(object)) {
        Ok(JsonRpcMessage::Request(request))
            if matches!(request.request, ClientRequest::CustomRequest(_))
                && method
                    .as_deref()
                    .is_some_and(|m| CLIENT_REQUEST_METHODS.contains(&m)) =>
        {
            Screened::Reply(error_reply(
                Some(request.id),
                ErrorCode::INVALID_PARAMS,
                format!(
                    "Invalid params for {}: they do not match the MCP schema",
                    method.unwrap_or_default()
                ),
            ))
        }
        Ok(message) => Screened::Message(Box::new(message)),
        // rmcp ignores notifications it cannot read, and a notification must not be answered.
        Err(_) if is_notification => Screened::Skip,
        Err(error) => invalid(&error.to_string()),
    }
}

/// Why a request's params cannot be handed on, for the checks that need a precise message:
/// MCP params are always an object, and `tools/call` is the request agents build by hand.
fn params_problem(method: &str, params: Option<&Value>) -> Option<String> {
    match params {
        None | Some(Value::Null) => None,
        Some(Value::Object(params)) if method == "tools/call" => {
            if !matches!(params.get("arguments"), None | Some(Value::Object(_))) {
                return Some("arguments must be an object".to_owned());
            }
            serde_json::from_value::<CallToolRequestParams>(Value::Object(params.clone()))
                .err()
                .map(|error| error.to_string())
        }
        Some(Value::Object(_)) => None,
        Some(_) => Some("params must be an object".to_owned()),
    }
}

/// The answer to a message that is valid JSON except for numbers outside the f64 range (which
/// serde_json refuses to parse); `tamed` is that message with each such number replaced by
/// `null`.
fn out_of_range(tamed: &Value) -> Screened {
    let id = tamed
        .get("id")
        .and_then(|raw| serde_json::from_value::<RequestId>(raw.clone()).ok());
    let has_method = tamed.get("method").is_some_and(Value::is_string);
    match id {
        Some(id) if has_method => Screened::Reply(error_reply(
            Some(id),
            ErrorCode::INVALID_PARAMS,
            "Invalid params: a number is outside the range of a 64-bit float",
        )),
        None if has_method && tamed.get("id").is_none() => Screened::Skip,
        _ => Screened::Reply(error_reply(
            None,
            ErrorCode::INVALID_REQUEST,
            "Invalid Request: a number is outside the range of a 64-bit float",
        )),
    }
}

fn error_reply(id: Option<RequestId>, code: ErrorCode, message: impl Into<String>) -> Value {
    json!({
        "jsonrpc": "2.0",
        "id": id.map_or(Value::Null, RequestId::into_json_value),
        "error": {"code": code.0, "message": message.into()},
    })
}

/// Replaces every `\uXXXX` escape that is half of a surrogate pair without its other half by
/// `\ufffd`, which is what a lossy UTF-16 decoder does; serde_json refuses such escapes outright.
/// Only string contents are touched. Returns the text unchanged when nothing needed repair.
fn repair_lone_surrogates(text: &str) -> Cow<'_, str> {
    if !text.contains("\\u") {
        return Cow::Borrowed(text);
    }
    let bytes = text.as_bytes();
    let mut repaired: Option<String> = None;
    let mut copied_up_to = 0;
    let mut in_string = false;
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'"' => in_string = !in_string,
            b'\\' if in_string => {
                let unit = escaped_unit(bytes, i);
                let lone = match unit {
                    Some(0xD800..=0xDBFF) => {
                        !matches!(escaped_unit(bytes, i + 6), Some(0xDC00..=0xDFFF))
                    }
                    Some(0xDC00..=0xDFFF) => true,
                    _ => false,
                };
                if lone {
                    let out = repaired.get_or_insert_with(|| String::with_capacity(text.len()));
                    out.push_str(&text[copied_up_to..i]);
                    out.push_str("\\ufffd");
                    copied_up_to = i + 6;
                    i += 6;
                } else if matches!(unit, Some(0xD800..=0xDBFF)) {
                    // A whole pair: skip both halves so the low half is not seen as lone.
                    i += 12;
                } else {
                    // Any other escape: skip the backslash and the escaped character, so an
                    // escaped quote does not end the string.
                    i += 2;
                }
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    match repaired {
        Some(mut out) => {
            out.push_str(&text[copied_up_to.min(text.len())..]);
            Cow::Owned(out)
        }
        None => Cow::Borrowed(text),
    }
}

/// The UTF-16 code unit of a `\uXXXX` escape starting at `at`, if there is one.
fn escaped_unit(bytes: &[u8], at: usize) -> Option<u16> {
    let escape = bytes.get(at..at + 6)?;
    if escape[0] != b'\\' || escape[1] != b'u' {
        return None;
    }
    let hex = std::str::from_utf8(&escape[2..]).ok()?;
    u16::from_str_radix(hex, 16).ok()
}

/// Replaces each number outside strings that does not fit an f64 (`1e400`, `-1e400`, a
/// 400-digit integer) by `null`, so the rest of the message can be read. `None` when there was
/// no such number, i.e. the parse error has another cause.
fn tame_out_of_range_numbers(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut tamed: Option<String> = None;
    let mut copied_up_to = 0;
    let mut in_string = false;
    let mut i = 0;
    while i < bytes.len() {
        let byte = bytes[i];
        if in_string {
            match byte {
                b'\\' => i += 1,
                b'"' => in_string = false,
                _ => {}
            }
            i += 1;
            continue;
        }
        if byte == b'"' {
            in_string = true;
            i += 1;
            continue;
        }
        if byte == b'-' || byte.is_ascii_digit() {
            let start = i;
            while i < bytes.len()
                && matches!(bytes[i], b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E')
            {
                i += 1;
            }
            let token = &text[start..i];
            if token.parse::<f64>().is_ok_and(|n| n.is_infinite()) {
                let out = tamed.get_or_insert_with(|| String::with_capacity(text.len()));
                out.push_str(&text[copied_up_to..start]);
                out.push_str("null");
                copied_up_to = i;
            }
            continue;
        }
        i += 1;
    }
    tamed.map(|mut out| {
        out.push_str(&text[copied_up_to..]);
        out
    })
}

/// The `id` of a JSON object whose text may be cut short, read from its top-level members up to
/// where the text ends. `None` when the text is not an object, the id comes after the cut, or
/// the id is not a string or an integer.
fn leading_id(text: &str) -> Option<RequestId> {
    let bytes = text.as_bytes();
    let mut i = skip_whitespace(bytes, 0);
    if bytes.get(i) != Some(&b'{') {
        return None;
    }
    i += 1;
    loop {
        i = skip_whitespace(bytes, i);
        if bytes.get(i) != Some(&b'"') {
            return None;
        }
        let key_end = end_of_string(bytes, i)?;
        let key: String = serde_json::from_str(&text[i..key_end]).ok()?;
        i = skip_whitespace(bytes, key_end);
        if bytes.get(i) != Some(&b':') {
            return None;
        }
        i = skip_whitespace(bytes, i + 1);
        let value_end = end_of_value(bytes, i)?;
        if key == "id" {
            return serde_json::from_str(&text[i..value_end]).ok();
        }
        i = skip_whitespace(bytes, value_end);
        if bytes.get(i) != Some(&b',') {
            return None;
        }
        i += 1;
    }
}

/// The `id` of an object whose last member it is, read from the object's last bytes (which may
/// start anywhere, even inside a string): the rightmost `"id"` that stands as a key and whose
/// value is followed only by the closing brace. A nested object's `id` is followed by two
/// braces, so it is never taken.
fn trailing_id(tail: &[u8]) -> Option<RequestId> {
    let body = tail.trim_ascii_end();
    if body.last() != Some(&b'}') {
        return None;
    }
    let closing = body.len() - 1;
    let mut search_end = closing;
    while let Some(at) = body[..search_end].windows(4).rposition(|w| w == b"\"id\"") {
        let as_key = matches!(
            body[..at].iter().rev().find(|b| !b.is_ascii_whitespace()),
            Some(b',' | b'{')
        );
        let colon = skip_whitespace(body, at + 4);
        if as_key && body.get(colon) == Some(&b':') {
            let start = skip_whitespace(body, colon + 1);
            if let Some(end) = end_of_value(body, start)
                && skip_whitespace(body, end) == closing
            {
                return serde_json::from_slice(&body[start..end]).ok();
            }
        }
        search_end = at;
    }
    None
}

fn skip_whitespace(bytes: &[u8], mut i: usize) -> usize {
    while bytes.get(i).is_some_and(u8::is_ascii_whitespace) {
        i += 1;
    }
    i
}

/// The index just past the string that opens at `start` (a `"`).
fn end_of_string(bytes: &[u8], start: usize) -> Option<usize> {
    let mut i = start + 1;
    while let Some(&byte) = bytes.get(i) {
        match byte {
            b'\\' => i += 2,
            b'"' => return Some(i + 1),
            _ => i += 1,
        }
    }
    None
}

/// The index just past the value that starts at `start`; `None` when the text ends first.
fn end_of_value(bytes: &[u8], start: usize) -> Option<usize> {
    match bytes.get(start)? {
        b'"' => end_of_string(bytes, start),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut i = start;
            while let Some(&byte) = bytes.get(i) {
                match byte {
                    b'"' => {
                        i = end_of_string(bytes, i)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(i + 1);
                        }
                    }
                    _ => {}
                }
                i += 1;
            }
            None
        }
        _ => {
            let mut i = start;
            while let Some(&byte) = bytes.get(i) {
                if matches!(byte, b',' | b'}' | b']') || byte.is_ascii_whitespace() {
                    return Some(i);
                }
                i += 1;
            }
            None
        }
    }
}

#[cfg(test)]
mod tests;
