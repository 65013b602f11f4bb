//! The checkpoint tools (docs/checkpoints.md), with `--checkpoint-tools`:
//! `computer_checkpoint`, `computer_rollback`, `computer_fork`, `checkpoint_list` and
//! `checkpoint_delete`. Definitions with their output schemas, argument decoding with the
//! exact messages, and one thin handler each over the registry's checkpoint operations. Every
//! tool takes an optional `computer_id` (the session's default computer, attached or created
//! as by `terminal_execute`); a backend without checkpoints refuses before any of that.

use std::sync::Arc;

use rmcp::model::{JsonObject, Tool, ToolAnnotations};
use serde_json::{Map, Value, json};

use super::call::{Call, CallError, Payload};
use super::files::{computer_id_property, decode_computer, mode_of};
use super::format;
use super::routes::Definitions;
use crate::backends::SandboxRef;
use crate::backends::checkpoints::{CheckpointName, CheckpointRecord};
use crate::ids::ComputerId;
use crate::registry::Unnamed;
use crate::registry::checkpoints::{CheckpointEntry, ForkTargets, MAX_FORK_COUNT};

pub const CHECKPOINT: &str = "computer_checkpoint";
pub const ROLLBACK: &str = "computer_rollback";
pub const FORK: &str = "computer_fork";
pub const LIST: &str = "checkpoint_list";
pub const DELETE: &str = "checkpoint_delete";

/// The longest `note` (docs/checkpoints.md, "Tools").
const MAX_NOTE_CHARS: usize = 500;

/// The sentence the server's instructions gain with the switch on.
pub const INSTRUCTIONS: &str = " Before a risky change, save the computer with computer_checkpoint; computer_rollback returns to a checkpoint and computer_fork makes independent copies to try alternatives side by side.";

fn annotations(read_only: bool, destructive: bool) -> ToolAnnotations {
    let mut annotations = ToolAnnotations::new();
    annotations.read_only_hint = Some(read_only);
    annotations.destructive_hint = Some(destructive);
    annotations.open_world_hint = Some(false);
    annotations
}

fn checkpoint_property(what: &str) -> Value {
    json!({"type": "string", "title": "Checkpoint", "description": what})
}

fn input(properties: Value, required: &[&str]) -> Arc<JsonObject> {
    let mut properties = properties.as_object().cloned().unwrap_or_default();
    properties.insert("computer_id".into(), computer_id_property());
    format::object(json!({"type": "object", "properties": properties, "required": required}))
}

fn checkpoint_defs() -> Value {
    json!({"Checkpoint": {
        "type": "object",
        "properties": {
            "checkpoint": {"type": "string"},
            "parent": {"type": ["string", "null"]},
            "created_at": {"type": "string"},
            "size_bytes": {"type": ["integer", "null"]},
            "memory": {"type": "boolean"},
            "note": {"type": ["string", "null"]}
        },
        "required": ["checkpoint", "parent", "created_at", "size_bytes", "memory", "note"]
    }})
}

pub(super) fn checkpoint_tool(_: &Definitions<'_>) -> Tool {
    Tool::new(
        CHECKPOINT,
        "Save the computer's current state (its files) as a named checkpoint you can roll back to or fork from later. Running commands and jobs keep running.",
        input(
            json!({
                "name": {"type": "string", "title": "Name", "description": "Lowercase letters, numbers and hyphens, unique on this computer; omit for c-<8 hex>."},
                "note": {"type": "string", "maxLength": MAX_NOTE_CHARS, "title": "Note", "description": "Why this checkpoint was taken (at most 500 characters)."}
            }),
            &[],
        ),
    )
    .with_raw_output_schema(format::output_schema(
        json!({
            "computer_id": {"type": "string"},
            "checkpoint": {"type": "string"},
            "parent": {"type": ["string", "null"]},
            "created_at": {"type": "string"},
            "size_bytes": {"type": ["integer", "null"]},
            "memory": {"type": "boolean"},
            "note": {"type": ["string", "null"]}
        }),
        &["computer_id", "checkpoint", "parent", "created_at", "size_bytes", "memory", "note"],
        None,
    ))
    .with_annotations(annotations(false, false))
}

pub(super) fn rollback_tool(_: &Definitions<'_>) -> Tool {
    Tool::new(
        ROLLBACK,
        "Return the computer to a checkpoint: its files become the checkpoint's, under the same computer_id. Running commands and jobs end and port forwards close; later checkpoints are kept.",
        input(
            json!({"checkpoint": checkpoint_property("The checkpoint to return to (see checkpoint_list).")}),
            &["checkpoint"],
        ),
    )
    .with_raw_output_schema(format::output_schema(
        json!({
            "computer_id": {"type": "string"},
            "checkpoint": {"type": "string"},
            "restored_at": {"type": "string"},
            "memory": {"type": "boolean"}
        }),
        &["computer_id", "checkpoint", "restored_at", "memory"],
        None,
    ))
    .with_annotations(annotations(false, true))
}

pub(super) fn fork_tool(_: &Definitions<'_>) -> Tool {
    Tool::new(
        FORK,
        "Make new, independent computers from a checkpoint (or from the computer as it is now), to try alternatives side by side. Forks are named <computer_id>-f1, -f2, … unless new_computer_id is given (count 1 only).",
        input(
            json!({
                "checkpoint": checkpoint_property("The checkpoint to fork from; omit to fork the computer as it is now."),
                "new_computer_id": {"type": "string", "title": "New Computer Id", "description": "The fork's id, with count 1 only."},
                "count": {"type": "integer", "minimum": 1, "maximum": MAX_FORK_COUNT, "default": 1, "title": "Count", "description": "How many forks to make (1-8)."},
                "temporary": {"type": "boolean", "title": "Temporary", "description": "The forks' mode; default: the source computer's."}
            }),
            &[],
        ),
    )
    .with_raw_output_schema(format::output_schema(
        json!({
            "source": {"type": "string"},
            "checkpoint": {"type": "string"},
            "computers": {"type": "array", "items": {"type": "string"}}
        }),
        &["source", "checkpoint", "computers"],
        None,
    ))
    .with_annotations(annotations(false, false))
}

pub(super) fn list_tool(_: &Definitions<'_>) -> Tool {
    Tool::new(
        LIST,
        "List a computer's checkpoints in creation order, each with its parent, and which one the computer's present state descends from (current).",
        input(json!({}), &[]),
    )
    .with_raw_output_schema(format::output_schema(
        json!({
            "computer_id": {"type": "string"},
            "current": {"type": ["string", "null"]},
            "checkpoints": {"type": "array", "items": {"$ref": "#/$defs/Checkpoint"}}
        }),
        &["computer_id", "current", "checkpoints"],
        Some(checkpoint_defs()),
    ))
    .with_annotations(annotations(true, false))
}

pub(super) fn delete_tool(_: &Definitions<'_>) -> Tool {
    Tool::new(
        DELETE,
        "Delete a checkpoint. Checkpoints taken after it keep working.",
        input(
            json!({"checkpoint": checkpoint_property("The checkpoint to delete.")}),
            &["checkpoint"],
        ),
    )
    .with_raw_output_schema(format::output_schema(
        json!({
            "computer_id": {"type": "string"},
            "checkpoint": {"type": "string"},
            "deleted": {"type": "boolean"}
        }),
        &["computer_id", "checkpoint", "deleted"],
        None,
    ))
    .with_annotations(annotations(false, true))
}

fn parse_name(raw: &str) -> Result<CheckpointName, CallError> {
    CheckpointName::parse(raw).map_err(|e| CallError::invalid(e.to_string()))
}

/// The computer a checkpoint tool acts on, attached or created as by `terminal_execute`,
/// after the backend said it has checkpoints.
async fn target(call: &Call<'_>) -> Result<SandboxRef, CallError> {
    let registry = call.registry();
    registry.check_checkpoints_available()?;
    let computer = decode_computer(&call.args(), call.session)?;
    let temporary = mode_of(registry, call.session, computer.as_ref()).await?;
    Ok(registry
        .acquire(
            call.session,
            computer,
            temporary,
            Unnamed::SessionDefault,
            call.progress,
        )
        .await?)
}

fn entry_fields(
    payload: &mut Map<String, Value>,
    record: &CheckpointRecord,
    parent: Option<&CheckpointName>,
) {
    payload.insert("checkpoint".into(), json!(record.name.as_str()));
    payload.insert("parent".into(), json!(parent.map(CheckpointName::as_str)));
    payload.insert("created_at".into(), json!(record.created_at));
    payload.insert("size_bytes".into(), json!(record.size_bytes));
    payload.insert("memory".into(), json!(record.memory));
    payload.insert("note".into(), json!(record.note));
}

/// `computer_checkpoint`.
pub(super) async fn checkpoint(call: &Call<'_>) -> Result<Payload, CallError> {
    let args = call.args();
    let name = args
        .string("name")?
        .filter(|raw| !raw.trim().is_empty())
        .map(|raw| parse_name(&raw))
        .transpose()?;
    let note = args.string("note")?;
    if let Some(note) = &note
        && note.chars().count() > MAX_NOTE_CHARS
    {
        return Err(CallError::invalid(format!(
            "note must be at most {MAX_NOTE_CHARS} characters, got {}.",
            note.chars().count()
        )));
    }
    let sandbox = target(call).await?;
    let entry = call
        .registry()
        .checkpoint(&sandbox, call.principal(), name, note)
        .await?;
    let mut payload = Map::new();
    payload.insert("computer_id".into(), json!(sandbox.computer_id.slug()));
    entry_fields(&mut payload, &entry.record, entry.parent.as_ref());
    Ok(payload.into())
}

/// `computer_rollback`.
pub(super) async fn rollback(call: &Call<'_>) -> Result<Payload, CallError> {
    let name = parse_name(&call.args().required_string("checkpoint")?)?;
    let sandbox = target(call).await?;
    let id = &sandbox.computer_id;
    let (_, entry): (SandboxRef, CheckpointEntry) = call
        .registry()
        .rollback(id, call.principal(), &name, call.progress)
        .await?;
    let mut payload = Map::new();
    payload.insert("computer_id".into(), json!(id.slug()));
    payload.insert("checkpoint".into(), json!(name.as_str()));
    payload.insert("restored_at".into(), json!(crate::clock::now_rfc3339()));
    payload.insert("memory".into(), json!(entry.record.memory));
    Ok(payload.into())
}

/// `computer_fork`.
pub(super) async fn fork(call: &Call<'_>) -> Result<Payload, CallError> {
    let args = call.args();
    let name = args
        .string("checkpoint")?
        .filter(|raw| !raw.trim().is_empty())
        .map(|raw| parse_name(&raw))
        .transpose()?;
    let count = args.integer("count")?.unwrap_or(1);
    let count = usize::try_from(count)
        .ok()
        .filter(|n| (1..=MAX_FORK_COUNT).contains(n))
        .ok_or_else(|| {
            CallError::invalid(format!(
                "count must be between 1 and {MAX_FORK_COUNT}, got {count}."
            ))
        })?;
    let new_id = args
        .string("new_computer_id")?
        .filter(|raw| !raw.trim().is_empty());
    let targets = match new_id {
        Some(_) if count > 1 => {
            return Err(CallError::invalid(
                "new_computer_id names one computer; use it only with count 1 (forks are named <computer_id>-f1, -f2, … otherwise).",
            ));
        }
        Some(raw) => ForkTargets::Named(ComputerId::parse(&raw)?.owned_by(call.principal())),
        None => ForkTargets::Numbered(count),
    };
    let temporary = args.boolean("temporary")?;
    let source = target(call).await?;
    let forked = call
        .registry()
        .fork(
            call.session,
            &source,
            name,
            targets,
            temporary,
            call.progress,
        )
        .await?;
    let made: Vec<&str> = forked
        .computers
        .iter()
        .map(|s| s.computer_id.slug())
        .collect();
    if let Some((failed, error)) = forked.failed {
        let message = format::user_message(&error);
        return Err(CallError::invalid(if made.is_empty() {
            format!("Fork '{}' failed: {message}", failed.slug())
        } else {
            format!(
                "Fork '{}' failed: {message} The forks made before it are kept: {}.",
                failed.slug(),
                made.join(", ")
            )
        }));
    }
    let mut payload = Map::new();
    payload.insert("source".into(), json!(source.computer_id.slug()));
    payload.insert("checkpoint".into(), json!(forked.checkpoint.as_str()));
    payload.insert("computers".into(), json!(made));
    Ok(payload.into())
}

/// `checkpoint_list`.
pub(super) async fn list(call: &Call<'_>) -> Result<Payload, CallError> {
    let sandbox = target(call).await?;
    let tree = call
        .registry()
        .checkpoint_tree(&sandbox.computer_id)
        .await?;
    let rows: Vec<Value> = tree
        .entries
        .iter()
        .map(|entry| {
            let mut row = Map::new();
            entry_fields(&mut row, &entry.record, entry.parent.as_ref());
            Value::Object(row)
        })
        .collect();
    let mut payload = Map::new();
    payload.insert("computer_id".into(), json!(sandbox.computer_id.slug()));
    payload.insert(
        "current".into(),
        json!(tree.current.as_ref().map(CheckpointName::as_str)),
    );
    payload.insert("checkpoints".into(), Value::Array(rows));
    Ok(payload.into())
}

/// `checkpoint_delete`.
pub(super) async fn delete(call: &Call<'_>) -> Result<Payload, CallError> {
    let name = parse_name(&call.args().required_string("checkpoint")?)?;
    let sandbox = target(call).await?;
    call.registry()
        .delete_checkpoint(&sandbox.computer_id, &name)
        .await?;
    let mut payload = Map::new();
    payload.insert("computer_id".into(), json!(sandbox.computer_id.slug()));
    payload.insert("checkpoint".into(), json!(name.as_str()));
    payload.insert("deleted".into(), json!(true));
    Ok(payload.into())
}
