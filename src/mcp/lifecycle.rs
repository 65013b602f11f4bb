//! The six lifecycle tools (docs/decisions.md, "Lifecycle tools", "Lifecycle operations"): definitions with their
//! output schemas, and one thin function each that decodes arguments, calls the registry and
//! formats the payload. Errors use the reference's `{"error": …}` shape in text and structure.

use std::sync::Arc;

use rmcp::model::{CallToolResult, JsonObject, MetaObject, Tool, ToolAnnotations};
use serde_json::{Map, Value, json};

use super::args::Args;
use super::format;
use crate::backends::{ComputerInfo, Progress};
use crate::dashboard;
use crate::ids::ComputerId;
use crate::registry::{Registry, Session, Unnamed};

pub const DASHBOARD: &str = "computer_dashboard";
pub const LIST: &str = "computer_list";
pub const CREATE: &str = "computer_create";
pub const RESTART: &str = "computer_restart";
pub const FACTORY_RESET: &str = "computer_factory_reset";
pub const DELETE: &str = "computer_delete";

fn annotations(read_only: Option<bool>, destructive: Option<bool>) -> ToolAnnotations {
    let mut annotations = ToolAnnotations::new();
    annotations.read_only_hint = read_only;
    annotations.destructive_hint = destructive;
    annotations
}

fn meta(value: Value) -> MetaObject {
    MetaObject(value.as_object().cloned().unwrap_or_default())
}

fn computer_info_defs() -> Value {
    json!({"ComputerInfo": {
        "type": "object",
        "properties": {
            "computer_id": {"type": "string"},
            "sandbox_id": {"type": "string"},
            "backend": {"type": "string"},
            "state": {"type": "string"},
            "temporary": {"type": "boolean"},
            "image": {"type": ["string", "null"]},
            "created_at": {"type": ["string", "null"]}
        },
        "required": ["computer_id", "sandbox_id", "backend", "state", "temporary", "image", "created_at"]
    }})
}

fn id_input(description: &str) -> Arc<JsonObject> {
    format::object(json!({
        "type": "object",
        "properties": {"computer_id": {"type": "string", "title": "Computer Id", "description": description}},
        "required": ["computer_id"]
    }))
}

/// The six tools in registration order (after `terminal_execute`).
pub fn tools() -> Vec<Tool> {
    let visibility = json!({"visibility": ["model", "app"]});
    let plain_meta = || meta(json!({"ui": visibility.clone()}));
    let list_output = || {
        format::output_schema(
            json!({"computers": {"type": "array", "items": {"$ref": "#/$defs/ComputerInfo"}}, "count": {"type": "integer"}, "warning": {"type": "string"}}),
            &["computers", "count"],
            Some(computer_info_defs()),
        )
    };
    let empty_input = || format::object(json!({"type": "object", "properties": {}}));
    vec![
        Tool::new(
            DASHBOARD,
            "Open the interactive MCP App dashboard for listing computers, running terminal commands, restarting, factory-resetting, and deleting.",
            empty_input(),
        )
        .with_title("Sandbox Computer Dashboard")
        .with_raw_output_schema(list_output())
        .with_annotations(annotations(Some(true), None))
        .with_meta(meta(json!({
            "ui": {"visibility": ["model", "app"], "resourceUri": dashboard::RESOURCE_URI},
            "ui/resourceUri": dashboard::RESOURCE_URI
        }))),
        Tool::new(LIST, "List all sandbox computers managed by the selected backend.", empty_input())
            .with_raw_output_schema(list_output())
            .with_annotations(annotations(Some(true), None))
            .with_meta(plain_meta()),
        Tool::new(
            CREATE,
            "Create a temporary or permanent sandbox computer. If computer_id is omitted, a readable random slug is returned.",
            format::object(json!({
                "type": "object",
                "properties": {
                    "computer_id": {"type": "string", "title": "Computer Id", "description": "Optional lowercase slug. Omit to generate a readable random ID."},
                    "temporary": {"type": "boolean", "default": true, "title": "Temporary", "description": "Remove on MCP session shutdown when true; persist and allow reattachment by ID when false."}
                }
            })),
        )
        .with_raw_output_schema(format::output_schema(
            json!({"ok": {"type": "boolean"}, "computer_id": {"type": "string"}, "sandbox_id": {"type": "string"}, "temporary": {"type": "boolean"}}),
            &["ok", "computer_id", "sandbox_id", "temporary"],
            None,
        ))
        .with_annotations(annotations(None, Some(false)))
        .with_meta(plain_meta()),
        Tool::new(RESTART, "Restart a computer without erasing its writable filesystem.", id_input("Computer slug to restart"))
            .with_raw_output_schema(format::output_schema(
                json!({"ok": {"type": "boolean"}, "computer_id": {"type": "string"}, "sandbox_id": {"type": "string"}, "temporary": {"type": "boolean"}, "state_preserved": {"type": "boolean"}, "warning": {"type": "string"}}),
                &["ok", "computer_id", "sandbox_id", "temporary", "state_preserved"],
                None,
            ))
            .with_annotations(annotations(None, Some(false)))
            .with_meta(plain_meta()),
        Tool::new(
            FACTORY_RESET,
            "Erase a computer's writable filesystem and recreate it from the base image.",
            id_input("Computer slug whose writable state will be erased"),
        )
        .with_raw_output_schema(format::output_schema(
            json!({"ok": {"type": "boolean"}, "computer_id": {"type": "string"}, "sandbox_id": {"type": "string"}, "temporary": {"type": "boolean"}}),
            &["ok", "computer_id", "sandbox_id", "temporary"],
            None,
        ))
        .with_annotations(annotations(None, Some(true)))
        .with_meta(plain_meta()),
        Tool::new(DELETE, "Permanently delete a computer and all of its writable state.", id_input("Computer slug to permanently delete"))
            .with_raw_output_schema(format::output_schema(
                json!({"ok": {"type": "boolean"}, "computer_id": {"type": "string"}, "deleted": {"type": "boolean"}}),
                &["ok", "computer_id", "deleted"],
                None,
            ))
            .with_annotations(annotations(None, Some(true)))
            .with_meta(plain_meta()),
    ]
}

fn info_json(row: &ComputerInfo, backend: &str) -> Value {
    let mut item = Map::new();
    item.insert("computer_id".into(), json!(row.sandbox.computer_id.slug()));
    item.insert("sandbox_id".into(), json!(row.sandbox.sandbox_id));
    item.insert("backend".into(), json!(backend));
    item.insert("state".into(), json!(row.state));
    item.insert("temporary".into(), json!(row.sandbox.temporary));
    item.insert("image".into(), json!(row.sandbox.image));
    item.insert("created_at".into(), json!(row.created_at));
    Value::Object(item)
}

/// `computer_list` and `computer_dashboard` (the same payload; docs/warm-pool.md for `warm_pool`).
pub async fn list(registry: &Registry, session: &Session) -> CallToolResult {
    let (rows, warning) = registry.list(session.principal()).await;
    let backend = registry.backend().kind();
    let mut payload = Map::new();
    payload.insert(
        "computers".into(),
        Value::Array(rows.iter().map(|r| info_json(r, backend)).collect()),
    );
    payload.insert("count".into(), json!(rows.len()));
    // Only with `--warm-pool`, so the payload stays the reference's without it. Not in the
    // output schema for the same reason; the schema allows extra fields.
    if let Some(pool) = registry.backend().warm_pool() {
        payload.insert(
            "warm_pool".into(),
            json!({"ready": pool.ready, "size": pool.target}),
        );
    }
    if let Some(warning) = warning {
        payload.insert("warning".into(), json!(warning));
    }
    format::success(payload)
}

/// A client's id, as `session`'s principal's computer.
fn parse_id(raw: &str, session: &Session) -> Result<ComputerId, String> {
    ComputerId::parse(raw)
        .map(|id| id.owned_by(session.principal()))
        .map_err(|e| e.to_string())
}

/// The audit line of a lifecycle action (docs/auth.md, "Audit"): who, on what, and how it
/// ended.
fn audit(
    action: &'static str,
    session: &Session,
    arguments: Option<&JsonObject>,
    result: &Result<Map<String, Value>, String>,
) {
    let requested = arguments
        .and_then(|a| a.get("computer_id"))
        .and_then(Value::as_str)
        .map(str::trim);
    let computer_id = match result {
        Ok(payload) => payload.get("computer_id").and_then(Value::as_str),
        Err(_) => requested,
    }
    .unwrap_or("");
    match result {
        Ok(_) => tracing::info!(
            target: "kilntainers::audit",
            principal = %session.principal(),
            action,
            computer_id,
            result = "ok",
            "lifecycle"
        ),
        Err(error) => tracing::info!(
            target: "kilntainers::audit",
            principal = %session.principal(),
            action,
            computer_id,
            result = "error",
            error = error.as_str(),
            "lifecycle"
        ),
    }
}

/// A lifecycle payload or message, in the reference's result shapes.
fn respond(result: Result<Map<String, Value>, String>) -> CallToolResult {
    match result {
        Ok(payload) => format::success(payload),
        Err(message) => format::error_json(message),
    }
}

pub async fn create(
    registry: &Registry,
    session: &Session,
    arguments: Option<&JsonObject>,
    progress: &dyn Progress,
) -> CallToolResult {
    let result = async {
        let args = Args::new(CREATE, arguments);
        let raw_id = args.string("computer_id").map_err(|e| e.to_string())?;
        let temporary = args.boolean("temporary").map_err(|e| e.to_string())?;
        let computer_id = raw_id
            .filter(|id| !id.is_empty())
            .map(|raw| parse_id(&raw, session))
            .transpose()?;
        let sandbox = registry
            .acquire(
                session,
                computer_id,
                temporary.unwrap_or(true),
                Unnamed::Fresh,
                progress,
            )
            .await
            .map_err(|e| format::user_message(&e))?;
        let mut payload = Map::new();
        payload.insert("ok".into(), json!(true));
        payload.insert("computer_id".into(), json!(sandbox.computer_id.slug()));
        payload.insert("sandbox_id".into(), json!(sandbox.sandbox_id));
        payload.insert("temporary".into(), json!(sandbox.temporary));
        Ok(payload)
    }
    .await;
    audit("create", session, arguments, &result);
    respond(result)
}

/// Decodes the required `computer_id` of restart, reset and delete.
fn required_id(
    tool: &'static str,
    session: &Session,
    arguments: Option<&JsonObject>,
) -> Result<ComputerId, String> {
    let raw = Args::new(tool, arguments)
        .required_string("computer_id")
        .map_err(|e| e.to_string())?;
    parse_id(&raw, session)
}

pub async fn restart(
    registry: &Registry,
    session: &Session,
    arguments: Option<&JsonObject>,
) -> CallToolResult {
    let result = async {
            let id = required_id(RESTART, session, arguments)?;
            let restarted = registry.restart(&id, session.principal()).await.map_err(|e| format::user_message(&e))?;
            let mut payload = Map::new();
            payload.insert("ok".into(), json!(true));
            payload.insert("computer_id".into(), json!(id.slug()));
            payload.insert("sandbox_id".into(), json!(restarted.sandbox.sandbox_id));
            payload.insert("temporary".into(), json!(restarted.sandbox.temporary));
            payload.insert("state_preserved".into(), json!(restarted.state_preserved));
            if !restarted.state_preserved {
                let backend = registry.backend().kind();
                payload.insert(
                    "warning".into(),
                    json!(format!(
                        "{backend} cannot restart a computer and keep its files; '{id}' was recreated from its base image and its previous files are gone.",
                        id = id.slug()
                    )),
                );
            }
            Ok(payload)
        }
        .await;
    audit("restart", session, arguments, &result);
    respond(result)
}

pub async fn factory_reset(
    registry: &Registry,
    session: &Session,
    arguments: Option<&JsonObject>,
    progress: &dyn Progress,
) -> CallToolResult {
    let result = async {
        let id = required_id(FACTORY_RESET, session, arguments)?;
        let sandbox = registry
            .factory_reset(&id, session.principal(), progress)
            .await
            .map_err(|e| format::user_message(&e))?;
        let mut payload = Map::new();
        payload.insert("ok".into(), json!(true));
        payload.insert("computer_id".into(), json!(id.slug()));
        payload.insert("sandbox_id".into(), json!(sandbox.sandbox_id));
        payload.insert("temporary".into(), json!(sandbox.temporary));
        Ok(payload)
    }
    .await;
    audit("factory_reset", session, arguments, &result);
    respond(result)
}

pub async fn delete(
    registry: &Registry,
    session: &Session,
    arguments: Option<&JsonObject>,
) -> CallToolResult {
    let result = async {
        let id = required_id(DELETE, session, arguments)?;
        registry
            .delete(&id)
            .await
            .map_err(|e| format::user_message(&e))?;
        let mut payload = Map::new();
        payload.insert("ok".into(), json!(true));
        payload.insert("computer_id".into(), json!(id.slug()));
        payload.insert("deleted".into(), json!(true));
        Ok(payload)
    }
    .await;
    audit("delete", session, arguments, &result);
    respond(result)
}
