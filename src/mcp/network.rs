//! `computer_network` (docs/egress.md, "What the model sees"): a computer's egress policy and
//! the refusals recorded for it, read-only. Listed whenever the server enforces an egress
//! policy (`allowlist`, or deny rules).
//!
//! The person's tools (docs/egress.md, "Dashboard"): add or remove an allow rule for a
//! computer, list and answer its ask-to-allow questions. Only a person may widen a policy, so
//! they are declared for the app alone (MCP Apps `_meta.ui.visibility: ["app"]`: the host
//! never offers them to the model) and listed only with the dashboard and a policy both on.

use std::sync::Arc;

use rmcp::model::{JsonObject, MetaObject, Tool, ToolAnnotations};
use serde_json::{Map, Value, json};

use super::call::{Call, CallError, Payload};
use super::format;
use super::routes::Definitions;
use crate::backends::egress::{EgressMode, EgressPolicy, Pattern};
use crate::ids::ComputerId;

pub const COMPUTER_NETWORK: &str = "computer_network";
pub const ALLOW: &str = "computer_network_allow";
pub const REMOVE: &str = "computer_network_remove";
pub const QUESTIONS: &str = "computer_network_questions";
pub const ANSWER: &str = "computer_network_answer";

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
    .with_raw_output_schema(policy_output())
    .with_annotations(annotations)
}

/// The output of `computer_network` and of the person's rule tools: the policy, the rules a
/// person added (`added`, which a person may remove), and the refusals.
fn policy_output() -> Arc<JsonObject> {
    format::output_schema(
        json!({
            "computer_id": {"type": "string"},
            "mode": {"type": "string"},
            "allow": {"type": "array", "items": {"type": "string"}},
            "deny": {"type": "array", "items": {"type": "string"}},
            "added": {"type": "array", "items": {"type": "string"}},
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
    )
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
    network_payload(call, &id).await
}

/// The policy, the rules people added and the refusals of computer `id` (which must exist
/// for the caller: another principal's computer is not found, like an unknown one).
async fn network_payload(call: &Call<'_>, id: &ComputerId) -> Result<Payload, CallError> {
    let registry = call.registry();
    let sandbox = registry.find(id).await?;
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
    let added = registry
        .backend()
        .egress_grants(&sandbox)
        .await?
        .unwrap_or_default();
    payload.insert("added".into(), Value::Array(texts(&added)));
    let secrets: Vec<Value> = call
        .surface
        .secret_book()
        .for_computer(id)
        .iter()
        .map(|s| json!({"name": s.name.as_str(), "hosts": s.hosts.iter().map(ToString::to_string).collect::<Vec<_>>()}))
        .collect();
    payload.insert("secrets".into(), Value::Array(secrets));
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

/// Declared for the MCP App alone: a host that honours MCP Apps visibility never offers these
/// tools to the model (docs/egress.md, "Dashboard").
fn app_only() -> MetaObject {
    let mut meta = MetaObject::new();
    meta.0
        .insert("ui".to_owned(), json!({"visibility": ["app"]}));
    meta
}

fn person_tool(name: &'static str, description: &'static str, input: Value) -> Tool {
    Tool::new(name, description, format::object(input)).with_meta(app_only())
}

fn computer_id_property() -> Value {
    json!({"type": "string", "title": "Computer Id", "description": "Computer slug."})
}

pub(super) fn allow_tool(_: &Definitions<'_>) -> Tool {
    person_tool(
        ALLOW,
        "Dashboard only: a person allows a host for one computer, within the server's egress bounds.",
        json!({
            "type": "object",
            "properties": {"computer_id": computer_id_property(), "pattern": {"type": "string", "description": "An egress pattern: host, *.domain, IP or CIDR, with an optional :PORT."}},
            "required": ["computer_id", "pattern"]
        }),
    )
    .with_raw_output_schema(policy_output())
}

pub(super) fn remove_tool(_: &Definitions<'_>) -> Tool {
    person_tool(
        REMOVE,
        "Dashboard only: a person removes an allow rule a person added for one computer.",
        json!({
            "type": "object",
            "properties": {"computer_id": computer_id_property(), "pattern": {"type": "string", "description": "One of the computer's added rules."}},
            "required": ["computer_id", "pattern"]
        }),
    )
    .with_raw_output_schema(policy_output())
}

pub(super) fn questions_tool(_: &Definitions<'_>) -> Tool {
    person_tool(
        QUESTIONS,
        "Dashboard only: the open ask-to-allow questions of one computer; while a dashboard looks, its questions wait for the person there too.",
        json!({
            "type": "object",
            "properties": {"computer_id": computer_id_property()},
            "required": ["computer_id"]
        }),
    )
    .with_raw_output_schema(format::output_schema(
        json!({
            "computer_id": {"type": "string"},
            "questions": {"type": "array", "items": {
                "type": "object",
                "properties": {
                    "question_id": {"type": "integer"},
                    "host": {"type": "string"},
                    "port": {"type": "integer"},
                    "asked_at": {"type": "string"}
                },
                "required": ["question_id", "host", "port", "asked_at"]
            }}
        }),
        &["computer_id", "questions"],
        None,
    ))
}

pub(super) fn answer_tool(_: &Definitions<'_>) -> Tool {
    person_tool(
        ANSWER,
        "Dashboard only: a person answers one open ask-to-allow question of a computer.",
        json!({
            "type": "object",
            "properties": {
                "computer_id": computer_id_property(),
                "question_id": {"type": "integer"},
                "choice": {"type": "string", "enum": [super::ask::ALLOW_ONCE, super::ask::ALLOW_COMPUTER, super::ask::DENY]}
            },
            "required": ["computer_id", "question_id", "choice"]
        }),
    )
}

/// The computer a person's tool names: required, and the caller's own.
fn named_computer(call: &Call<'_>) -> Result<ComputerId, CallError> {
    let raw = call.args().required_string("computer_id")?;
    Ok(ComputerId::parse(&raw)?.owned_by(call.principal()))
}

fn pattern_argument(call: &Call<'_>) -> Result<Pattern, CallError> {
    let raw = call.args().required_string("pattern")?;
    Pattern::parse(raw.trim())
        .map_err(|why| CallError::invalid(format!("pattern: invalid pattern '{raw}': {why}.")))
}

/// `computer_network_allow`: within the server's bounds (`EgressPolicy::admits`), kept with
/// the computer's grants and given to its proxy at once.
pub(super) async fn allow(call: &Call<'_>) -> Result<Payload, CallError> {
    let id = named_computer(call)?;
    let pattern = pattern_argument(call)?;
    let server = call.surface.egress.as_ref().ok_or(CallError::NotListed)?;
    let sandbox = call.registry().find(&id).await?;
    server
        .admits(&pattern)
        .map_err(|e| CallError::invalid(e.to_string()))?;
    let current = call.registry().backend().egress_policy(&sandbox).await?;
    let covered_by = current.as_ref().and_then(|policy| match policy.mode {
        EgressMode::Open => Some("its open policy".to_owned()),
        _ => policy
            .allow
            .iter()
            .find(|rule| rule.covers(&pattern))
            .map(|rule| format!("'{rule}'")),
    });
    if let Some(by) = covered_by {
        return Err(CallError::invalid(format!(
            "'{pattern}' is already allowed for computer '{}' (by {by}).",
            id.slug()
        )));
    }
    call.registry()
        .backend()
        .set_egress_grant(&sandbox, &pattern, true)
        .await?;
    network_payload(call, &id).await
}

/// `computer_network_remove`: only a rule a person added; the server's own rules and those
/// fixed at creation stay.
pub(super) async fn remove(call: &Call<'_>) -> Result<Payload, CallError> {
    let id = named_computer(call)?;
    let pattern = pattern_argument(call)?;
    let sandbox = call.registry().find(&id).await?;
    let removed = call
        .registry()
        .backend()
        .set_egress_grant(&sandbox, &pattern, false)
        .await?;
    if !removed {
        return Err(CallError::invalid(format!(
            "'{pattern}' is not a rule a person added for computer '{}'; only those can be removed here.",
            id.slug()
        )));
    }
    network_payload(call, &id).await
}

/// `computer_network_questions`: also marks the computer watched, so that its next questions
/// wait for this dashboard as well.
pub(super) async fn questions(call: &Call<'_>) -> Result<Payload, CallError> {
    let id = named_computer(call)?;
    call.registry().find(&id).await?;
    let open = call
        .surface
        .asks
        .as_ref()
        .map(|asks| asks.watch(&id))
        .unwrap_or_default();
    let mut payload = Map::new();
    payload.insert("computer_id".into(), json!(id.slug()));
    payload.insert(
        "questions".into(),
        Value::Array(
            open.into_iter()
                .map(|q| json!({"question_id": q.id, "host": q.host, "port": q.port, "asked_at": q.asked_at}))
                .collect(),
        ),
    );
    Ok(payload.into())
}

/// `computer_network_answer`: the first answer wins, here or in the session's client.
pub(super) async fn answer(call: &Call<'_>) -> Result<Payload, CallError> {
    let id = named_computer(call)?;
    let args = call.args();
    let question = args
        .integer("question_id")?
        .and_then(|id| u64::try_from(id).ok())
        .ok_or_else(|| CallError::invalid("question_id: expected the id of an open question."))?;
    let choice = args.required_string("choice")?;
    call.registry().find(&id).await?;
    let asks = call.surface.asks.as_ref().ok_or_else(|| {
        CallError::invalid(format!(
            "There is no pending question {question} for computer '{}': this server asks none.",
            id.slug()
        ))
    })?;
    asks.answer_on_board(&id, question, &choice)
        .map_err(|e| CallError::invalid(e.to_string()))?;
    let mut payload = Map::new();
    payload.insert("computer_id".into(), json!(id.slug()));
    payload.insert("question_id".into(), json!(question));
    payload.insert("choice".into(), json!(choice));
    Ok(payload.into())
}
