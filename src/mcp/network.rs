//! `computer_network` (docs/egress.md, "What the model sees"): a computer's egress policy and
//! the refusals recorded for it, read-only. Listed whenever the server enforces an egress
//! policy (`allowlist`, or deny rules).

use std::sync::Arc;

use rmcp::model::{JsonObject, Tool, ToolAnnotations};
use serde_json::{Map, Value, json};

use super::call::{Call, CallError, Payload};
use super::format;
use super::routes::Definitions;
use crate::backends::egress::EgressPolicy;
use crate::ids::ComputerId;

pub const COMPUTER_NETWORK: &str = "computer_network";

fn input() -> Arc<JsonObject> {
    format::object(json!({
        "type": "object",
        "properties": {"computer_id": {"type": "string", "title": "Computer Id", "description": "Computer slug; omit for this session's current computer."}},
    }))
}

pub(super) fn tool(_: &Definitions<'_>) -> Tool {
    let mut annotations = ToolAnnotations::new();
    annotations.read_only_hint = Some(true);
    annotations.destructive_hint = Some(false);
    Tool::new(
        COMPUTER_NETWORK,
        "Show which hosts a computer may reach (its egress policy) and the network accesses that were blocked, with the reason for each.",
        input(),
    )
    .with_raw_output_schema(format::output_schema(
        json!({
            "computer_id": {"type": "string"},
            "mode": {"type": "string"},
            "allow": {"type": "array", "items": {"type": "string"}},
            "deny": {"type": "array", "items": {"type": "string"}},
            "secrets": {"type": "array", "items": {"type": "object"}},
            "denied": {"type": "array", "items": {
                "type": "object",
                "properties": {
                    "host": {"type": "string"},
                    "port": {"type": "integer"},
                    "count": {"type": "integer"},
                    "first_at": {"type": "string"},
                    "last_at": {"type": "string"},
                    "reason": {"type": "string"}
                },
                "required": ["host", "port", "count", "first_at", "last_at", "reason"]
            }}
        }),
        &["computer_id", "mode", "allow", "deny", "secrets", "denied"],
        None,
    ))
    .with_annotations(annotations)
}

/// `computer_network`.
pub(super) async fn computer_network(call: &Call<'_>) -> Result<Payload, CallError> {
    let id = match call.args().string("computer_id")? {
        Some(raw) => ComputerId::parse(&raw)?.owned_by(call.principal()),
        None => call.session.default_id().ok_or_else(|| {
            CallError::invalid(
                "This session has no computer yet; pass computer_id, or run a command first.",
            )
        })?,
    };
    let registry = call.registry();
    let sandbox = registry.find(&id).await?;
    let denied = registry
        .backend()
        .egress_denials(&sandbox)
        .await?
        .unwrap_or_default();
    // The computer's own policy as recorded on it, else the server's.
    let policy = match registry.backend().egress_policy(&sandbox).await? {
        Some(policy) => policy,
        None => call
            .surface
            .egress
            .clone()
            .unwrap_or_else(EgressPolicy::open),
    };
    let texts = |patterns: &[crate::backends::egress::Pattern]| -> Vec<Value> {
        patterns.iter().map(|p| json!(p.to_string())).collect()
    };
    let mut payload = Map::new();
    payload.insert("computer_id".into(), json!(id.slug()));
    payload.insert("mode".into(), json!(policy.mode.name()));
    payload.insert("allow".into(), Value::Array(texts(&policy.allow)));
    payload.insert("deny".into(), Value::Array(texts(&policy.deny)));
    payload.insert("secrets".into(), json!([]));
    payload.insert(
        "denied".into(),
        Value::Array(
            denied
                .into_iter()
                .map(|d| {
                    json!({"host": d.host, "port": d.port, "count": d.count, "first_at": d.first_at, "last_at": d.last_at, "reason": d.reason})
                })
                .collect(),
        ),
    );
    Ok(payload.into())
}
