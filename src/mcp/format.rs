//! Result formatting: payload objects become one text block, serialised like Python's
//! `json.dumps` defaults so text output is byte-identical to the reference, plus the same
//! object as `structuredContent` (docs/decisions.md, "Result formatting").
//!
//! This is the only place that turns a payload or an error message into a `CallToolResult`:
//! [`respond`] does it for every tool call, at the edge.

use std::fmt::Write as _;
use std::sync::Arc;

use rmcp::ErrorData;
use rmcp::model::{CallToolResult, ContentBlock, JsonObject};
use serde_json::{Map, Value, json};

use super::call::{CallError, Payload};
use crate::registry::RegistryError;

/// Serialises `value` exactly like Python's `json.dumps(value)`: `", "` and `": "` separators,
/// no newlines, non-ASCII escaped as `\uXXXX` (surrogate pairs above U+FFFF).
pub fn python_json(value: &Value) -> String {
    let mut out = String::new();
    write_value(&mut out, value);
    out
}

fn write_value(out: &mut String, value: &Value) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => out.push_str(&n.to_string()),
        Value::String(s) => write_string(out, s),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_value(out, item);
            }
            out.push(']');
        }
        Value::Object(map) => {
            out.push('{');
            for (i, (key, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_string(out, key);
                out.push_str(": ");
                write_value(out, item);
            }
            out.push('}');
        }
    }
}

fn write_string(out: &mut String, s: &str) {
    out.push('"');
    for ch in s.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            ' '..='~' => out.push(ch),
            _ => {
                let mut units = [0u16; 2];
                for unit in ch.encode_utf16(&mut units) {
                    // Writing into a String cannot fail.
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
        }
    }
    out.push('"');
}

/// How a tool's error result reads as text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ErrorText {
    /// The bare message (the reference's words).
    Message,
    /// The `{"error": …}` object as JSON text: the reference's lifecycle tools answered so.
    Json,
}

/// The answer to one `tools/call`: a success or an error result, or (cancelled, or no such
/// tool) a JSON-RPC error.
pub(super) fn respond(
    answer: Result<Payload, CallError>,
    errors: ErrorText,
) -> Result<CallToolResult, ErrorData> {
    match answer {
        Ok(payload) => Ok(success(payload)),
        // rmcp sends no response for a request the client cancelled.
        Err(CallError::Cancelled) => Err(ErrorData::internal_error("request cancelled", None)),
        Err(CallError::NotListed) => Err(ErrorData::invalid_params("tool not found", None)),
        Err(error) => Ok(match errors {
            ErrorText::Message => error_message(error.to_string()),
            ErrorText::Json => error_json(error.to_string()),
        }),
    }
}

/// A successful tool result: text JSON + identical `structuredContent`, then the image if any.
fn success(payload: Payload) -> CallToolResult {
    let value = Value::Object(payload.fields);
    let mut content = vec![ContentBlock::text(python_json(&value))];
    if let Some(image) = payload.image {
        content.push(ContentBlock::image(image.base64, image.mime));
    }
    let mut result = CallToolResult::success(content);
    result.structured_content = Some(value);
    result
}

/// A tool error: the bare message as text (the reference's words) and `{"error": msg}` as
/// structured content (docs/decisions.md, "Result formatting").
fn error_message(message: String) -> CallToolResult {
    let mut structured = Map::new();
    structured.insert("error".to_owned(), Value::String(message.clone()));
    let mut result = CallToolResult::error(vec![ContentBlock::text(message)]);
    result.structured_content = Some(Value::Object(structured));
    result
}

/// A lifecycle-tool error: the reference returned the JSON object as text for these.
fn error_json(message: String) -> CallToolResult {
    let mut structured = Map::new();
    structured.insert("error".to_owned(), Value::String(message));
    let value = Value::Object(structured);
    let mut result = CallToolResult::error(vec![ContentBlock::text(python_json(&value))]);
    result.structured_content = Some(value);
    result
}

/// The words a model sees for a typed error: its own message, phrased for the user where it
/// is made (a backend error names the computer and the call).
pub fn user_message(error: &RegistryError) -> String {
    error.to_string()
}

/// A JSON object literal as the `Arc<JsonObject>` a tool's schema is.
pub(super) fn object(value: Value) -> Arc<JsonObject> {
    Arc::new(value.as_object().cloned().unwrap_or_default())
}

/// `{type: object, properties, required, anyOf: [success keys | error]}`.
pub(super) fn output_schema(
    properties: Value,
    success: &[&str],
    defs: Option<Value>,
) -> Arc<JsonObject> {
    let mut properties = properties.as_object().cloned().unwrap_or_default();
    properties.insert("error".into(), json!({"type": "string"}));
    let mut schema = json!({
        "type": "object",
        "properties": properties,
        "anyOf": [{"required": success}, {"required": ["error"]}]
    });
    if let (Some(defs), Some(map)) = (defs, schema.as_object_mut()) {
        map.insert("$defs".into(), defs);
    }
    object(schema)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn matches_python_json_dumps() {
        let value = json!({"a": "x/y", "b": [1, true, null], "c": "tab\there\u{1}", "d": "é😀"});
        assert_eq!(
            python_json(&value),
            r#"{"a": "x/y", "b": [1, true, null], "c": "tab\there\u0001", "d": "\u00e9\ud83d\ude00"}"#
        );
    }

    #[test]
    fn keeps_key_order() {
        let mut map = Map::new();
        map.insert("z".into(), json!(1));
        map.insert("a".into(), json!(2));
        assert_eq!(python_json(&Value::Object(map)), r#"{"z": 1, "a": 2}"#);
    }

    #[test]
    fn error_results_carry_structured_error() {
        let result = error_message("boom".to_owned());
        assert_eq!(result.is_error, Some(true));
        assert_eq!(result.structured_content, Some(json!({"error": "boom"})));
    }
}
