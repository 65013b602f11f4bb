//! Ask-to-allow (docs/egress.md, "Ask-to-allow"): the backend's egress questions, put to the
//! person through MCP elicitation on the session that holds the computer, and the answer given
//! back. Knows sessions and rmcp peers, never how a backend holds the connection: the questions
//! arrive as [`EgressQuestion`]s from `Backend::egress_questions`.
//!
//! Routing: the session whose call runs on the computer; else the live sessions holding it,
//! then the owner's other live sessions, most recently opened first (`Registry::egress_audience`).
//! The first of them that has connected decides how it is asked: `elicitation/create` (form
//! mode, one enum field) when it negotiated 2025-06-18 or 2025-11-25 and declared the
//! capability; otherwise the question is refused at once with the reason the computer's command
//! shows. At most [`MAX_QUESTIONS_PER_SESSION`] open per session; a `deny` is remembered for the
//! computer and host for [`DENY_REMEMBERED`]; `decline`, `cancel` and no answer refuse this
//! connection only.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use rmcp::model::{
    ElicitRequestParams, ElicitationAction, ElicitationSchema, EnumSchema, ProtocolVersion,
};
use rmcp::service::ServiceError;
use rmcp::{Peer, RoleServer};
use tracing::{debug, warn};

use crate::backends::egress::{
    ASK_TIMEOUT, DENY_REMEMBERED, EgressAnswer, EgressQuestion, MAX_QUESTIONS_PER_SESSION, reasons,
};
use crate::ids::ComputerId;
use crate::registry::Registry;

/// The form's one field and its three choices (the contract's words).
const FIELD: &str = "choice";
pub const ALLOW_ONCE: &str = "allow once";
pub const ALLOW_COMPUTER: &str = "allow for this computer";
pub const DENY: &str = "deny";

/// Remembered denies kept at most; the oldest go first past this.
const MAX_REMEMBERED: usize = 4096;

/// How one session can be asked.
#[derive(Clone)]
enum Asker {
    Elicit(Peer<RoleServer>),
    /// Connected without the elicitation capability (or with a protocol before 2025-06-18).
    NoElicitation,
    /// Protocol 2026-07-28 (or a sessionless request): questions would need `input_required`.
    Mrtr,
}

impl Asker {
    fn of(peer: &Peer<RoleServer>) -> Self {
        let Some(info) = peer.peer_info() else {
            return Self::Mrtr;
        };
        let version = &info.protocol_version;
        if *version >= ProtocolVersion::V_2026_07_28 {
            return Self::Mrtr;
        }
        let speaks =
            *version == ProtocolVersion::V_2025_06_18 || *version == ProtocolVersion::V_2025_11_25;
        let form = info
            .capabilities
            .elicitation
            .as_ref()
            .is_some_and(|e| e.form.is_some() || e.url.is_none());
        if speaks && form {
            Self::Elicit(peer.clone())
        } else {
            Self::NoElicitation
        }
    }
}

/// The sessions that can be asked, the questions open on each, and the remembered denies.
#[derive(Default)]
pub struct Asks {
    askers: Mutex<HashMap<u64, Asker>>,
    open: Mutex<HashMap<u64, usize>>,
    declined: Mutex<HashMap<(ComputerId, String, u16), Instant>>,
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Asks {
    /// Takes the backend's questions, if it asks any, and answers them until it stops.
    pub fn start(registry: Arc<Registry>) -> Option<Arc<Self>> {
        let mut questions = registry.backend().egress_questions()?;
        let asks = Arc::new(Self::default());
        let runtime = tokio::runtime::Handle::try_current().ok()?;
        let serving = Arc::clone(&asks);
        runtime.spawn(async move {
            while let Some(question) = questions.recv().await {
                let asks = Arc::clone(&serving);
                let registry = Arc::clone(&registry);
                tokio::spawn(async move {
                    let answer = asks.answer(&registry, &question).await;
                    question.answer(answer);
                });
            }
        });
        Some(asks)
    }

    /// Records how session `session` can be asked (at initialisation and on each call).
    pub fn connected(&self, session: u64, peer: &Peer<RoleServer>) {
        lock(&self.askers).insert(session, Asker::of(peer));
    }

    /// The session ended: it can no longer be asked.
    pub fn closed(&self, session: u64) {
        lock(&self.askers).remove(&session);
    }

    async fn answer(&self, registry: &Registry, question: &EgressQuestion) -> EgressAnswer {
        let key = (
            question.computer_id.clone(),
            question.host.clone(),
            question.port,
        );
        if let Some(at) = lock(&self.declined).get(&key)
            && at.elapsed() < DENY_REMEMBERED
        {
            return EgressAnswer::Refuse(reasons::DECLINED_EARLIER.to_owned());
        }
        let chosen = {
            let askers = lock(&self.askers);
            registry
                .egress_audience(&question.computer_id)
                .into_iter()
                .find_map(|session| askers.get(&session).map(|a| (session, a.clone())))
        };
        let (session, peer) = match chosen {
            None => return EgressAnswer::Refuse(reasons::NO_SESSION.to_owned()),
            Some((_, Asker::NoElicitation)) => {
                return EgressAnswer::Refuse(reasons::NO_ELICITATION.to_owned());
            }
            Some((_, Asker::Mrtr)) => return EgressAnswer::Refuse(reasons::NO_MRTR.to_owned()),
            Some((session, Asker::Elicit(peer))) => (session, peer),
        };
        {
            let mut open = lock(&self.open);
            let count = open.entry(session).or_default();
            if *count >= MAX_QUESTIONS_PER_SESSION {
                return EgressAnswer::Refuse(reasons::TOO_MANY.to_owned());
            }
            *count += 1;
        }
        let answer = ask(&peer, question).await;
        {
            let mut open = lock(&self.open);
            if let Some(count) = open.get_mut(&session) {
                *count = count.saturating_sub(1);
                if *count == 0 {
                    open.remove(&session);
                }
            }
        }
        match answer {
            Asked::Answer(answer) => answer,
            Asked::Deny => {
                let mut declined = lock(&self.declined);
                declined.retain(|_, at| at.elapsed() < DENY_REMEMBERED);
                if declined.len() >= MAX_REMEMBERED
                    && let Some(oldest) = declined
                        .iter()
                        .min_by_key(|(_, at)| **at)
                        .map(|(k, _)| k.clone())
                {
                    declined.remove(&oldest);
                }
                declined.insert(key, Instant::now());
                EgressAnswer::Refuse(reasons::DECLINED.to_owned())
            }
        }
    }
}

/// What the person answered.
enum Asked {
    Answer(EgressAnswer),
    /// `deny`: refused and remembered.
    Deny,
}

/// The form: "The computer `dev-box` wants to reach `pypi.org:443`." and one enum field.
fn request(question: &EgressQuestion) -> Option<ElicitRequestParams> {
    let choices = [ALLOW_ONCE, ALLOW_COMPUTER, DENY]
        .map(str::to_owned)
        .to_vec();
    let schema = ElicitationSchema::builder()
        .required_enum_schema(
            FIELD,
            EnumSchema::builder(choices)
                .title("Network access")
                .description("allow once: this connection; allow for this computer: added to its egress policy; deny: refused, and not asked again for 10 minutes")
                .build(),
        )
        .build()
        .ok()?;
    let host = if question.host.contains(':') {
        format!("[{}]", question.host)
    } else {
        question.host.clone()
    };
    Some(ElicitRequestParams::FormElicitationParams {
        meta: None,
        message: format!(
            "The computer `{}` wants to reach `{host}:{}`.",
            question.computer_id.slug(),
            question.port
        ),
        requested_schema: schema,
    })
}

async fn ask(peer: &Peer<RoleServer>, question: &EgressQuestion) -> Asked {
    let Some(params) = request(question) else {
        return Asked::Answer(EgressAnswer::Refuse(reasons::NO_ELICITATION.to_owned()));
    };
    debug!(computer = %question.computer_id, host = %question.host, port = question.port, "asking the user");
    let result = match peer
        .create_elicitation_with_timeout(params, Some(ASK_TIMEOUT))
        .await
    {
        Ok(result) => result,
        Err(ServiceError::Timeout { .. }) => {
            return Asked::Answer(EgressAnswer::Refuse(reasons::NO_ANSWER.to_owned()));
        }
        Err(error) => {
            warn!(%error, "the elicitation failed");
            return Asked::Answer(EgressAnswer::Refuse(reasons::NO_ANSWER.to_owned()));
        }
    };
    // decline and cancel refuse this connection only; so does an answer outside the choices.
    if result.action != ElicitationAction::Accept {
        return Asked::Answer(EgressAnswer::Refuse(reasons::DECLINED.to_owned()));
    }
    let choice = result
        .content
        .as_ref()
        .and_then(|c| c.get(FIELD))
        .and_then(|v| v.as_str());
    match choice {
        Some(ALLOW_ONCE) => Asked::Answer(EgressAnswer::Once),
        Some(ALLOW_COMPUTER) => Asked::Answer(EgressAnswer::ForComputer),
        Some(DENY) => Asked::Deny,
        _ => Asked::Answer(EgressAnswer::Refuse(reasons::DECLINED.to_owned())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_question_names_the_computer_and_host_and_offers_three_choices() {
        let id = ComputerId::parse("dev-box")
            .unwrap()
            .owned_by(&crate::ids::Principal::named("alice").unwrap());
        for (host, shown) in [
            ("pypi.org", "pypi.org:443"),
            ("2001:db8::1", "[2001:db8::1]:443"),
        ] {
            let (question, _answer) = EgressQuestion::new(id.clone(), host.to_owned(), 443);
            let wire = serde_json::to_value(request(&question).unwrap()).unwrap();
            assert_eq!(
                wire["message"],
                format!("The computer `dev-box` wants to reach `{shown}`.")
            );
            assert_eq!(wire["mode"], "form");
            let schema = &wire["requestedSchema"];
            assert_eq!(schema["required"], serde_json::json!([FIELD]));
            assert_eq!(
                schema["properties"][FIELD]["enum"],
                serde_json::json!([ALLOW_ONCE, ALLOW_COMPUTER, DENY])
            );
        }
    }
}
