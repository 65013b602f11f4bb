//! `secret_request` (docs/secrets-onboarding.md): the model asks the person for a secret it
//! names, for hosts it names, and says why. The person enters the value on a one-time page of
//! this server ([`super::onboarding`]), never in the chat: the client is sent a URL-mode
//! elicitation pointing at the page when it declared `elicitation.url`, and otherwise the
//! result gives the page's address for the person to open. Listed with `--secret-tools`.
//!
//! The result says only whether the secret is now set, or why not; the value never passes
//! through here.

use std::time::{Duration, Instant};

use rmcp::model::{
    CustomNotification, ElicitationAction, ServerNotification, Tool, ToolAnnotations,
};
use rmcp::service::ElicitationError;
use rmcp::{Peer, RoleServer};
use serde_json::{Map, Value, json};
use tracing::debug;

use super::args::Args;
use super::call::{Call, CallError, Payload};
use super::format;
use super::onboarding::{Onboarding, Opened, Outcome, SecretAsk};
use super::routes::Definitions;
use crate::backends::brokering::{HeaderTemplate, SecretName};
use crate::backends::egress::Pattern;

pub const SECRET_REQUEST: &str = "secret_request";
/// Appended to the server instructions with the switch on.
pub(super) const INSTRUCTIONS: &str = " When a computer needs an API key or token, call secret_request: the user enters it on a page of this server, and computers get a placeholder the server replaces in requests to the named hosts. Never ask the user to paste a secret into the chat.";
/// The longest reason shown to the person.
const MAX_REASON_CHARS: usize = 2000;
/// Hosts one secret may name.
const MAX_HOSTS: usize = 32;
/// After the page took the value, how long the elicitation's own answer is awaited (the
/// client may answer it after the person submitted) before the result goes out.
const ELICITATION_GRACE: Duration = Duration::from_secs(5);

pub(super) fn tool(_: &Definitions<'_>) -> Tool {
    let mut annotations = ToolAnnotations::new();
    annotations.read_only_hint = Some(false);
    annotations.destructive_hint = Some(false);
    annotations.open_world_hint = Some(true);
    Tool::new(
        SECRET_REQUEST,
        "Ask the user for a secret (an API key or token) that computers need. The user enters it on a page of this server, not in the chat; you never see it. Computers get an environment variable NAME holding a placeholder, and the server puts the real value into requests to the given hosts only, in the given header (default 'Authorization: Bearer {}'). Waits until the user has entered it (up to 10 minutes) and says whether it is set.",
        format::object(json!({
            "type": "object",
            "properties": {
                "name": {"type": "string", "title": "Name", "description": "The environment variable computers get, such as GITHUB_TOKEN: A-Z, 0-9 and _, starting with a letter."},
                "hosts": {"type": "array", "items": {"type": "string"}, "title": "Hosts", "description": "The hosts the secret may be sent to, such as api.github.com or *.example.com."},
                "header": {"type": "string", "title": "Header", "description": "How the secret is sent: 'Header-Name: text with {} where the value goes'. Default 'Authorization: Bearer {}'."},
                "reason": {"type": "string", "title": "Reason", "description": "Why the secret is needed, shown to the user."}
            },
            "required": ["name", "hosts", "reason"],
        })),
    )
    .with_raw_output_schema(format::output_schema(
        json!({
            "name": {"type": "string"},
            "hosts": {"type": "array", "items": {"type": "string"}},
            "status": {"type": "string", "enum": ["set", "waiting", "declined", "cancelled", "expired", "refused"]},
            "message": {"type": "string"},
            "url": {"type": "string"}
        }),
        &["name", "hosts", "status", "message"],
        None,
    ))
    .with_annotations(annotations)
}

/// The arguments, checked by the rules of the secrets flags; each refusal names the argument.
fn decode(args: &Args<'_>) -> Result<SecretAsk, CallError> {
    let name = args.required_string("name")?;
    let name =
        SecretName::parse(name.trim()).map_err(|e| CallError::invalid(format!("name: {e}.")))?;
    let hosts = match args.get("hosts") {
        // One comma-separated string is taken too, as `--secret-hosts` takes it.
        Some(Value::String(text)) => text.split(',').map(str::to_owned).collect(),
        _ => args
            .string_list("hosts")?
            .ok_or_else(|| CallError::invalid("hosts: missing required field."))?,
    };
    let hosts = hosts
        .iter()
        .map(|h| h.trim())
        .filter(|h| !h.is_empty())
        .map(|h| {
            Pattern::parse(h)
                .map_err(|e| CallError::invalid(format!("hosts: invalid host pattern '{h}': {e}.")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    if hosts.is_empty() {
        return Err(CallError::invalid(
            "hosts: name at least one host the secret may be sent to, such as api.example.com.",
        ));
    }
    if hosts.len() > MAX_HOSTS {
        return Err(CallError::invalid(format!(
            "hosts: at most {MAX_HOSTS} hosts."
        )));
    }
    let header = match args.string("header")? {
        None => HeaderTemplate::default(),
        Some(text) if text.trim().is_empty() => HeaderTemplate::default(),
        Some(text) => {
            HeaderTemplate::parse(&text).map_err(|e| CallError::invalid(format!("header: {e}.")))?
        }
    };
    let reason = args.required_string("reason")?.trim().to_owned();
    if reason.is_empty() {
        return Err(CallError::invalid(
            "reason: say why the secret is needed; the user reads it before entering the value.",
        ));
    }
    if reason.chars().count() > MAX_REASON_CHARS {
        return Err(CallError::invalid(format!(
            "reason: at most {MAX_REASON_CHARS} characters."
        )));
    }
    Ok(SecretAsk {
        name,
        hosts,
        header,
        reason,
    })
}

/// `secret_request`.
pub(super) async fn secret_request(call: &Call<'_>) -> Result<Payload, CallError> {
    let onboarding = call
        .surface
        .onboarding
        .as_deref()
        .ok_or(CallError::NotListed)?;
    let ask = decode(&call.args())?;
    let opened = onboarding
        .open(call.principal(), ask.clone(), Instant::now())
        .await
        .map_err(|e| CallError::invalid(format!("{e}.")))?;
    let Some(peer) = call.peer.filter(|peer| takes_urls(peer)) else {
        return Ok(waiting(&ask, &opened.url, onboarding));
    };
    wait_for_the_person(call, onboarding, peer, &ask, opened).await
}

/// Whether the client declared URL-mode elicitation.
fn takes_urls(peer: &Peer<RoleServer>) -> bool {
    peer.supported_elicitation_modes()
        .contains(&rmcp::service::ElicitationMode::Url)
}

async fn wait_for_the_person(
    call: &Call<'_>,
    onboarding: &Onboarding,
    peer: &Peer<RoleServer>,
    ask: &SecretAsk,
    opened: Opened,
) -> Result<Payload, CallError> {
    let Opened { id, url, done } = opened;
    let Ok(address) = url::Url::parse(&url) else {
        onboarding.withdraw(&id);
        return Err(CallError::invalid(
            "the server's secret page has no valid address.",
        ));
    };
    let message = format!(
        "The assistant asks for the secret {name}, to be sent only to {hosts}. Open the page to read why and to enter it (the link works once, for 10 minutes).",
        name = ask.name,
        hosts = ask.hosts_text(),
    );
    let ttl = onboarding.ttl();
    let elicitation = peer.elicit_url_with_timeout(message, address, id.clone(), Some(ttl));
    tokio::pin!(elicitation);
    let deadline = tokio::time::sleep(ttl);
    tokio::pin!(deadline);
    let mut done = done;
    let mut asking = true;
    let outcome = loop {
        tokio::select! {
            outcome = &mut done => break outcome,
            answer = &mut elicitation, if asking => {
                asking = false;
                match answer {
                    // URL mode: the person agreed to open the page; the value comes from it.
                    Ok(ElicitationAction::Accept) => {}
                    Ok(ElicitationAction::Decline) => {
                        onboarding.withdraw(&id);
                        return Ok(ended(ask, "declined", format!("the user declined to enter secret {}.", ask.name)));
                    }
                    // Cancel (and any action a later protocol adds).
                    Ok(_) => {
                        onboarding.withdraw(&id);
                        return Ok(ended(ask, "cancelled", format!("the user cancelled the request for secret {}.", ask.name)));
                    }
                    Err(ElicitationError::Service(rmcp::service::ServiceError::Timeout { .. })) => {
                        onboarding.withdraw(&id);
                        return Ok(expired(ask));
                    }
                    // Any other failure to ask: the person can still open the page.
                    Err(error) => {
                        debug!(%error, "URL elicitation failed; giving the page's address instead");
                        return Ok(waiting(ask, &url, onboarding));
                    }
                }
            }
            () = &mut deadline => {
                onboarding.withdraw(&id);
                return Ok(expired(ask));
            }
            () = call.cancel.cancelled() => {
                onboarding.withdraw(&id);
                return Err(CallError::Cancelled);
            }
        }
    };
    if asking {
        // The page was answered first: let the client close its prompt before the result.
        let _ = tokio::time::timeout(ELICITATION_GRACE, &mut elicitation).await;
    }
    complete(peer, &id).await;
    match outcome {
        Ok(Outcome::Set) => Ok(set(ask)),
        Ok(Outcome::Refused(why)) => Ok(ended(
            ask,
            "refused",
            format!(
                "the value entered for secret {} was refused: {why}.",
                ask.name
            ),
        )),
        // The page was withdrawn under us (cannot happen while we wait); say it ended.
        Err(_) => Ok(expired(ask)),
    }
}

/// `notifications/elicitation/complete`: the page the elicitation pointed at is done with.
async fn complete(peer: &Peer<RoleServer>, id: &str) {
    let notification = CustomNotification::new(
        "notifications/elicitation/complete",
        Some(json!({"elicitationId": id})),
    );
    if let Err(error) = peer
        .send_notification(ServerNotification::CustomNotification(notification))
        .await
    {
        debug!(%error, "cannot send notifications/elicitation/complete");
    }
}

fn payload(ask: &SecretAsk, status: &str, message: String) -> Map<String, Value> {
    let mut payload = Map::new();
    payload.insert("name".into(), json!(ask.name.as_str()));
    payload.insert(
        "hosts".into(),
        json!(
            ask.hosts
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
        ),
    );
    payload.insert("status".into(), json!(status));
    payload.insert("message".into(), json!(message));
    payload
}

fn set(ask: &SecretAsk) -> Payload {
    payload(
        ask,
        "set",
        format!(
            "secret {} is set for {}; computers have it as the environment variable {} (a placeholder the server replaces in requests to those hosts).",
            ask.name,
            ask.hosts_text(),
            ask.name
        ),
    )
    .into()
}

fn ended(ask: &SecretAsk, status: &str, message: String) -> Payload {
    payload(ask, status, message).into()
}

fn expired(ask: &SecretAsk) -> Payload {
    ended(
        ask,
        "expired",
        format!(
            "the link to enter secret {} expired before the user entered it.",
            ask.name
        ),
    )
}

/// A client that cannot open a URL for the person: the address, for the person to open.
fn waiting(ask: &SecretAsk, url: &str, onboarding: &Onboarding) -> Payload {
    let minutes = onboarding.ttl().as_secs().div_ceil(60);
    let mut fields = payload(
        ask,
        "waiting",
        format!(
            "this client cannot open pages for the user (no URL elicitation). Ask the user to open {url} within {minutes} minutes and enter secret {name} there; it is set when they submit the page. Do not ask for the value in the chat.",
            name = ask.name
        ),
    );
    fields.insert("url".into(), json!(url));
    fields.into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rmcp::model::JsonObject;

    fn decoded(arguments: Value) -> Result<SecretAsk, String> {
        let object: JsonObject = arguments.as_object().cloned().unwrap_or_default();
        decode(&Args::new(SECRET_REQUEST, Some(&object))).map_err(|e| e.to_string())
    }

    #[test]
    fn arguments_are_checked_by_the_flags_rules_and_named() {
        let ok = decoded(json!({"name": "GITHUB_TOKEN", "hosts": ["api.github.com", "*.github.com"], "header": "X-Api-Key: {}", "reason": "to push"})).unwrap();
        assert_eq!(ok.name.as_str(), "GITHUB_TOKEN");
        assert_eq!(ok.hosts_text(), "api.github.com, *.github.com");
        assert_eq!(ok.header.as_str(), "X-Api-Key: {}");
        let default =
            decoded(json!({"name": "A", "hosts": "a.test, b.test", "reason": "r"})).unwrap();
        assert_eq!(default.header.as_str(), "Authorization: Bearer {}");
        assert_eq!(default.hosts.len(), 2);
        for (arguments, starts) in [
            (
                json!({"name": "lower", "hosts": ["a.test"], "reason": "r"}),
                "name: ",
            ),
            (json!({"hosts": ["a.test"], "reason": "r"}), ""),
            (
                json!({"name": "A", "hosts": [], "reason": "r"}),
                "hosts: name at least one",
            ),
            (
                json!({"name": "A", "hosts": ["not a host"], "reason": "r"}),
                "hosts: invalid host pattern 'not a host'",
            ),
            (
                json!({"name": "A", "hosts": ["a.test"], "header": "X-Key none", "reason": "r"}),
                "header: ",
            ),
            (
                json!({"name": "A", "hosts": ["a.test"], "reason": "  "}),
                "reason: ",
            ),
        ] {
            let error = decoded(arguments.clone()).unwrap_err();
            assert!(error.starts_with(starts), "{arguments}: {error}");
        }
        let missing = decoded(json!({"hosts": ["a.test"], "reason": "r"})).unwrap_err();
        assert!(missing.contains("name"), "{missing}");
    }
}
