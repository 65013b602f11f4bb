//! The six lifecycle tools (docs/decisions.md, "Lifecycle tools", "Lifecycle operations"): definitions with their
//! output schemas, and one thin handler each that decodes arguments, calls the registry and
//! builds the payload; each action is audited. Their errors read as the reference's
//! `{"error": …}` JSON text (the route table says so).

use std::sync::Arc;

use rmcp::model::{JsonObject, MetaObject, Tool, ToolAnnotations};
use serde_json::{Map, Value, json};

use super::call::{Call, CallError, Payload};
use super::format;
use super::routes::Definitions;
use crate::backends::ComputerInfo;
use crate::backends::egress::{EgressPolicy, Pattern};
use crate::dashboard;
use crate::ids::ComputerId;
use crate::registry::Unnamed;

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

fn plain_meta() -> MetaObject {
    meta(json!({"ui": {"visibility": ["model", "app"]}}))
}

fn empty_input() -> Arc<JsonObject> {
    format::object(json!({"type": "object", "properties": {}}))
}

/// The output of `computer_list` and `computer_dashboard`.
fn list_output() -> Arc<JsonObject> {
    format::output_schema(
        json!({"computers": {"type": "array", "items": {"$ref": "#/$defs/ComputerInfo"}}, "count": {"type": "integer"}, "warning": {"type": "string"}}),
        &["computers", "count"],
        Some(computer_info_defs()),
    )
}

/// `computer_dashboard`: the MCP App.
pub(super) fn dashboard_tool(_: &Definitions<'_>) -> Tool {
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
    })))
}

pub(super) fn list_tool(_: &Definitions<'_>) -> Tool {
    Tool::new(
        LIST,
        "List all sandbox computers managed by the selected backend.",
        empty_input(),
    )
    .with_raw_output_schema(list_output())
    .with_annotations(annotations(Some(true), None))
    .with_meta(plain_meta())
}

pub(super) fn create_tool(definitions: &Definitions<'_>) -> Tool {
    let mut input = json!({
        "type": "object",
        "properties": {
            "computer_id": {"type": "string", "title": "Computer Id", "description": "Optional lowercase slug. Omit to generate a readable random ID."},
            "temporary": {"type": "boolean", "default": true, "title": "Temporary", "description": "Remove on MCP session shutdown when true; persist and allow reattachment by ID when false."}
        }
    });
    if definitions.egress {
        // Only with an enforced policy, so the default tool list is unchanged (docs/egress.md).
        input["properties"]["egress"] = json!({
            "type": "object",
            "title": "Egress",
            "description": "Narrow the hosts this new computer may reach: allow lists patterns (example.com, *.example.com, an IP or CIDR, optional :PORT), each inside what the server allows.",
            "properties": {"allow": {"type": "array", "items": {"type": "string"}}},
            "required": ["allow"]
        });
    }
    Tool::new(
        CREATE,
        "Create a temporary or permanent sandbox computer. If computer_id is omitted, a readable random slug is returned.",
        format::object(input),
    )
    .with_raw_output_schema(format::output_schema(
        json!({"ok": {"type": "boolean"}, "computer_id": {"type": "string"}, "sandbox_id": {"type": "string"}, "temporary": {"type": "boolean"}}),
        &["ok", "computer_id", "sandbox_id", "temporary"],
        None,
    ))
    .with_annotations(annotations(None, Some(false)))
    .with_meta(plain_meta())
}

pub(super) fn restart_tool(_: &Definitions<'_>) -> Tool {
    Tool::new(RESTART, "Restart a computer without erasing its writable filesystem.", id_input("Computer slug to restart"))
        .with_raw_output_schema(format::output_schema(
            json!({"ok": {"type": "boolean"}, "computer_id": {"type": "string"}, "sandbox_id": {"type": "string"}, "temporary": {"type": "boolean"}, "state_preserved": {"type": "boolean"}, "warning": {"type": "string"}}),
            &["ok", "computer_id", "sandbox_id", "temporary", "state_preserved"],
            None,
        ))
        .with_annotations(annotations(None, Some(false)))
        .with_meta(plain_meta())
}

pub(super) fn factory_reset_tool(_: &Definitions<'_>) -> Tool {
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
    .with_meta(plain_meta())
}

pub(super) fn delete_tool(_: &Definitions<'_>) -> Tool {
    Tool::new(DELETE, "Permanently delete a computer and all of its writable state.", id_input("Computer slug to permanently delete"))
        .with_raw_output_schema(format::output_schema(
            json!({"ok": {"type": "boolean"}, "computer_id": {"type": "string"}, "deleted": {"type": "boolean"}}),
            &["ok", "computer_id", "deleted"],
            None,
        ))
        .with_annotations(annotations(None, Some(true)))
        .with_meta(plain_meta())
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

/// When the computer of `row` stops unless used (RFC 3339, whole seconds).
fn idle_stop_at(registry: &crate::registry::Registry, row: &ComputerInfo) -> Option<String> {
    if row.sandbox.temporary || row.state != "running" {
        return None;
    }
    let at = registry.idle_stop_at(&row.sandbox.computer_id)?;
    let secs = at.duration_since(std::time::UNIX_EPOCH).ok()?.as_secs();
    Some(crate::clock::rfc3339_utc(i64::try_from(secs).ok()?))
}

/// `computer_list` and `computer_dashboard` (the same payload; docs/warm-pool.md for `warm_pool`).
pub(super) async fn list(call: &Call<'_>) -> Result<Payload, CallError> {
    let registry = call.registry();
    let (rows, warning) = registry.list(call.principal()).await;
    let backend = registry.backend().kind();
    let mut payload = Map::new();
    let computers = rows
        .iter()
        .map(|row| {
            let mut item = info_json(row, backend);
            // docs/idle-stop.md: present only with --idle-stop, for a running permanent computer.
            if let (Some(at), Value::Object(fields)) = (idle_stop_at(registry, row), &mut item) {
                fields.insert("idle_stop_at".into(), json!(at));
            }
            item
        })
        .collect();
    payload.insert("computers".into(), Value::Array(computers));
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
    Ok(payload.into())
}

/// A client's id, as the caller's computer.
fn parse_id(raw: &str, call: &Call<'_>) -> Result<ComputerId, CallError> {
    Ok(ComputerId::parse(raw)?.owned_by(call.principal()))
}

/// Writes the audit line of a lifecycle action (docs/auth.md, "Audit": who, on what, and how
/// it ended) and passes its answer on.
fn audited(
    action: &'static str,
    call: &Call<'_>,
    answer: Result<Payload, CallError>,
) -> Result<Payload, CallError> {
    let requested = call
        .arguments
        .and_then(|a| a.get("computer_id"))
        .and_then(Value::as_str)
        .map(str::trim);
    let computer_id = match &answer {
        Ok(payload) => payload.get("computer_id").and_then(Value::as_str),
        Err(_) => requested,
    }
    .unwrap_or("");
    match &answer {
        Ok(_) => tracing::info!(
            target: "kilntainers::audit",
            principal = %call.principal(),
            action,
            computer_id,
            result = "ok",
            "lifecycle"
        ),
        Err(error) => tracing::info!(
            target: "kilntainers::audit",
            principal = %call.principal(),
            action,
            computer_id,
            result = "error",
            error = error.to_string().as_str(),
            "lifecycle"
        ),
    }
    answer
}

/// `computer_create`.
pub(super) async fn create(call: &Call<'_>) -> Result<Payload, CallError> {
    audited("create", call, create_computer(call).await)
}

async fn create_computer(call: &Call<'_>) -> Result<Payload, CallError> {
    let args = call.args();
    let raw_id = args.string("computer_id")?;
    let temporary = args.boolean("temporary")?;
    let computer_id = raw_id
        .filter(|id| !id.is_empty())
        .map(|raw| parse_id(&raw, call))
        .transpose()?;
    let narrowed = narrowed_egress(call)?;
    let sandbox = match narrowed {
        Some(policy) => {
            call.registry()
                .create_narrowed(
                    call.session,
                    computer_id,
                    temporary.unwrap_or(true),
                    &policy,
                    call.progress,
                )
                .await?
        }
        None => {
            call.registry()
                .acquire(
                    call.session,
                    computer_id,
                    temporary.unwrap_or(true),
                    Unnamed::Fresh,
                    call.progress,
                )
                .await?
        }
    };
    let mut payload = Map::new();
    payload.insert("ok".into(), json!(true));
    payload.insert("computer_id".into(), json!(sandbox.computer_id.slug()));
    payload.insert("sandbox_id".into(), json!(sandbox.sandbox_id));
    payload.insert("temporary".into(), json!(sandbox.temporary));
    Ok(payload.into())
}

/// `computer_create`'s `egress: {"allow": [PATTERN…]}` as the computer's own policy, checked
/// to lie inside the server's (docs/egress.md, "Per computer") before anything is created.
fn narrowed_egress(call: &Call<'_>) -> Result<Option<EgressPolicy>, CallError> {
    let Some(value) = call.args().get("egress").cloned() else {
        return Ok(None);
    };
    let Some(server) = call.surface.egress.as_ref() else {
        return Err(CallError::invalid(
            "egress: this server enforces no egress policy (--egress allowlist or --egress-deny), so there is nothing to narrow.",
        ));
    };
    let texts = value
        .get("allow")
        .and_then(Value::as_array)
        .filter(|_| value.as_object().is_some_and(|o| o.len() == 1))
        .and_then(|list| {
            list.iter()
                .map(|v| v.as_str().map(str::to_owned))
                .collect::<Option<Vec<_>>>()
        })
        .ok_or_else(|| {
            CallError::invalid(
                "egress must be {\"allow\": [PATTERN, ...]}, a list of host patterns.",
            )
        })?;
    let patterns = texts
        .iter()
        .map(|text| {
            Pattern::parse(text).map_err(|why| {
                CallError::invalid(format!("egress.allow: invalid pattern '{text}': {why}."))
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    server
        .narrowed(&patterns)
        .map(Some)
        .map_err(|e| CallError::invalid(e.to_string()))
}

/// The required `computer_id` of restart, reset and delete.
fn required_id(call: &Call<'_>) -> Result<ComputerId, CallError> {
    let raw = call.args().required_string("computer_id")?;
    parse_id(&raw, call)
}

/// `computer_restart`.
pub(super) async fn restart(call: &Call<'_>) -> Result<Payload, CallError> {
    audited("restart", call, restart_computer(call).await)
}

async fn restart_computer(call: &Call<'_>) -> Result<Payload, CallError> {
    let id = required_id(call)?;
    let registry = call.registry();
    let restarted = registry.restart(&id, call.principal()).await?;
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
    Ok(payload.into())
}

/// `computer_factory_reset`.
pub(super) async fn factory_reset(call: &Call<'_>) -> Result<Payload, CallError> {
    audited("factory_reset", call, reset_computer(call).await)
}

async fn reset_computer(call: &Call<'_>) -> Result<Payload, CallError> {
    let id = required_id(call)?;
    let sandbox = call
        .registry()
        .factory_reset(&id, call.principal(), call.progress)
        .await?;
    let mut payload = Map::new();
    payload.insert("ok".into(), json!(true));
    payload.insert("computer_id".into(), json!(id.slug()));
    payload.insert("sandbox_id".into(), json!(sandbox.sandbox_id));
    payload.insert("temporary".into(), json!(sandbox.temporary));
    Ok(payload.into())
}

/// `computer_delete`.
pub(super) async fn delete(call: &Call<'_>) -> Result<Payload, CallError> {
    audited("delete", call, delete_computer(call).await)
}

async fn delete_computer(call: &Call<'_>) -> Result<Payload, CallError> {
    let id = required_id(call)?;
    call.registry().delete(&id).await?;
    let mut payload = Map::new();
    payload.insert("ok".into(), json!(true));
    payload.insert("computer_id".into(), json!(id.slug()));
    payload.insert("deleted".into(), json!(true));
    Ok(payload.into())
}
