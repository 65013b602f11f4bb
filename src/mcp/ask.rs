//! Ask-to-allow (docs/egress.md, "Ask-to-allow"): the backend's egress questions, put to the
//! person through MCP elicitation on the session that holds the computer, and the answer given
//! back. Knows sessions and rmcp peers, never how a backend holds the connection: the questions
//! arrive as [`EgressQuestion`]s from `Backend::egress_questions`.
//!
//! Routing: the session whose call runs on the computer; else the live sessions holding it,
//! then the owner's other live sessions, most recently opened first (`Registry::egress_audience`).
//! The first of them that has connected decides how it is asked: `elicitation/create` (form
//! mode, one enum field) when it negotiated 2025-06-18 or 2025-11-25 and declared the
//! capability; for a 2026-07-28 request that declared it, the running `tools/call` is answered
//! with `input_required` and the client's retry carries the answer ([`Asks::run_call`],
//! [`Asks::resume`]); otherwise the question is refused at once with the reason the computer's
//! command shows. At most [`MAX_QUESTIONS_PER_SESSION`] open per session; a `deny` is remembered for the
//! computer and host for [`DENY_REMEMBERED`]; `decline`, `cancel` and no answer refuse this
//! connection only.
//!
//! The dashboard (docs/egress.md, "Dashboard"): a computer a dashboard watches
//! ([`Asks::watch`]) has its questions posted on a board as well, and the first answer wins,
//! from the session or the board ([`Asks::answer_on_board`]); a question no session can be
//! asked then waits for the dashboard instead of being refused at once.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use rmcp::model::{
    CallToolResponse, CallToolResult, CancelledNotificationParam, ClientCapabilities, ClientResult,
    ElicitRequest, ElicitRequestParams, ElicitResult, ElicitationAction, ElicitationSchema,
    EnumSchema, InputRequest, InputRequiredResult, InputResponses, ProtocolVersion, ServerRequest,
};
use rmcp::service::PeerRequestOptions;
use rmcp::service::ServiceError;
use rmcp::{ErrorData, Peer, RoleServer};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::backends::egress::{
    ASK_TIMEOUT, DENY_REMEMBERED, EgressAnswer, EgressQuestion, MAX_QUESTIONS_PER_SESSION, reasons,
};
use crate::ids::{ComputerId, Principal};
use crate::registry::Registry;

/// The form's one field and its three choices (the contract's words).
const FIELD: &str = "choice";
pub const ALLOW_ONCE: &str = "allow once";
pub const ALLOW_COMPUTER: &str = "allow for this computer";
pub const DENY: &str = "deny";

/// Remembered denies kept at most; the oldest go first past this.
const MAX_REMEMBERED: usize = 4096;
/// The key of the one input request of an `input_required` answer.
const INPUT_KEY: &str = "egress";
/// Calls parked on a question at once (2026-07-28); past this a question is refused as too
/// many.
const MAX_PARKED: usize = 256;
/// How long a parked call waits for the client's retry before it is let go (its command runs
/// on; its result is dropped).
const PARKED_FOR: std::time::Duration = std::time::Duration::from_secs(120);

/// How one session can be asked.
#[derive(Clone)]
enum Asker {
    Elicit(Peer<RoleServer>),
    /// Connected without the elicitation capability (or with a protocol before 2025-06-18).
    NoElicitation,
    /// Protocol 2026-07-28 (a sessionless request) with the elicitation capability: its call
    /// answers a question with `input_required`.
    Mrtr,
}

impl Asker {
    /// `capabilities`: those a 2026-07-28 request carries in its `_meta`.
    fn of(peer: &Peer<RoleServer>, capabilities: Option<ClientCapabilities>) -> Self {
        let modern = |capabilities: Option<ClientCapabilities>| {
            if capabilities.is_some_and(|c| c.elicitation.is_some()) {
                Self::Mrtr
            } else {
                Self::NoElicitation
            }
        };
        let Some(info) = peer.peer_info() else {
            return modern(capabilities);
        };
        let version = &info.protocol_version;
        if *version >= ProtocolVersion::V_2026_07_28 {
            return modern(capabilities.or_else(|| Some(info.capabilities.clone())));
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
    /// 2026-07-28 calls running now that can answer `input_required`, by session.
    calls: Mutex<HashMap<u64, mpsc::Sender<Pending>>>,
    /// Calls waiting for the client's retry, by their `requestState`.
    parked: Mutex<HashMap<String, Parked>>,
    /// The questions a dashboard may answer, and the computers a dashboard watches.
    board: Mutex<Board>,
}

/// How long a dashboard's look at a computer's questions counts as watching it: its questions
/// are then held for the dashboard too (it polls far more often than this).
const WATCHED_FOR: std::time::Duration = std::time::Duration::from_secs(10);

/// Questions open to a dashboard (docs/egress.md, "Dashboard"): those of computers a dashboard
/// looked at within [`WATCHED_FOR`]. The first answer wins, from the dashboard or the session.
#[derive(Default)]
struct Board {
    next: u64,
    open: HashMap<u64, OnBoard>,
    watched: HashMap<ComputerId, Instant>,
}

struct OnBoard {
    computer: ComputerId,
    host: String,
    port: u16,
    asked_at: String,
    reply: oneshot::Sender<Asked>,
}

/// A question as the dashboard lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BoardQuestion {
    pub id: u64,
    pub host: String,
    pub port: u16,
    pub asked_at: String,
}

/// Why the dashboard's answer was not taken.
#[derive(Debug, thiserror::Error)]
pub enum BoardError {
    #[error(
        "There is no pending question {id} for computer '{computer}': it was answered, withdrawn or timed out."
    )]
    NoQuestion { id: u64, computer: String },
    #[error("choice must be 'allow once', 'allow for this computer' or 'deny'; got '{0}'.")]
    Choice(String),
}

/// A question put to a 2026-07-28 call: the form, and where the person's answer goes.
struct Pending {
    form: ElicitRequestParams,
    reply: oneshot::Sender<Asked>,
}

/// A 2026-07-28 call carried across `input_required` rounds: its work runs on in a task.
struct Parked {
    work: JoinHandle<Result<CallToolResult, ErrorData>>,
    questions: mpsc::Receiver<Pending>,
    session: u64,
    principal: Principal,
    cancel: CancellationToken,
    /// The question the last `input_required` asked, answered by the retry.
    reply: Option<oneshot::Sender<Asked>>,
    /// When it was last parked.
    since: Instant,
}

/// Where a chosen session's question goes.
enum Channel {
    Peer(Peer<RoleServer>),
    Call(mpsc::Sender<Pending>),
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

    /// Records how session `session` can be asked: at initialisation, and on each call (with
    /// the capabilities a 2026-07-28 request carries).
    pub fn connected(
        &self,
        session: u64,
        peer: &Peer<RoleServer>,
        capabilities: Option<ClientCapabilities>,
    ) {
        lock(&self.askers).insert(session, Asker::of(peer, capabilities));
    }

    /// The session ended: it can no longer be asked.
    pub fn closed(&self, session: u64) {
        lock(&self.askers).remove(&session);
    }

    /// Whether a call of `session` answers a question with `input_required` (2026-07-28).
    pub fn takes_input_required(&self, session: u64) -> bool {
        matches!(lock(&self.askers).get(&session), Some(Asker::Mrtr))
    }

    /// Runs a 2026-07-28 call's `work` so that a question arising while it runs answers the
    /// call with `input_required` (the work goes on meanwhile); the client's retry resumes it
    /// ([`Self::resume`]). `cancel` is the work's own token: `request` cancels it only while
    /// this request is being answered.
    pub async fn run_call(
        self: &Arc<Self>,
        session: u64,
        principal: Principal,
        cancel: CancellationToken,
        request: &CancellationToken,
        work: impl Future<Output = Result<CallToolResult, ErrorData>> + Send + 'static,
    ) -> Result<CallToolResponse, ErrorData> {
        let (tx, questions) = mpsc::channel(MAX_QUESTIONS_PER_SESSION);
        lock(&self.calls).insert(session, tx);
        let parked = Parked {
            work: tokio::spawn(work),
            questions,
            session,
            principal,
            cancel,
            reply: None,
            since: Instant::now(),
        };
        self.drive(parked, request).await
    }

    /// The client's retry of a call answered with `input_required`: the person's answer goes
    /// to the question, and the call goes on.
    pub async fn resume(
        self: &Arc<Self>,
        state: &str,
        responses: Option<&InputResponses>,
        principal: &Principal,
        request: &CancellationToken,
    ) -> Result<CallToolResponse, ErrorData> {
        let parked = {
            // Only the principal that made the call resumes it; anyone else leaves it parked.
            let mut all = lock(&self.parked);
            match all.get(state) {
                Some(parked) if parked.principal == *principal => all.remove(state),
                _ => None,
            }
        };
        let Some(mut parked) = parked else {
            return Err(ErrorData::invalid_params(
                "requestState is unknown or expired; call the tool again.",
                None,
            ));
        };
        let asked = responses
            .and_then(|r| r.get(INPUT_KEY))
            .and_then(|value| serde_json::from_value::<ElicitResult>(value.clone()).ok())
            .map_or(
                Asked::Answer(EgressAnswer::Refuse(reasons::DECLINED.to_owned())),
                |result| asked_from(&result),
            );
        if let Some(reply) = parked.reply.take() {
            let _ = reply.send(asked);
        }
        self.drive(parked, request).await
    }

    /// Waits for the call's work or its next question, whichever comes first.
    async fn drive(
        self: &Arc<Self>,
        mut parked: Parked,
        request: &CancellationToken,
    ) -> Result<CallToolResponse, ErrorData> {
        loop {
            tokio::select! {
                done = &mut parked.work => {
                    lock(&self.calls).remove(&parked.session);
                    return match done {
                        Ok(result) => result.map(Into::into),
                        Err(e) => Err(ErrorData::internal_error(format!("the call failed: {e}"), None)),
                    };
                }
                Some(pending) = parked.questions.recv() => {
                    return Ok(self.park(parked, pending).into());
                }
                () = request.cancelled(), if !parked.cancel.is_cancelled() => {
                    // The client cancelled this request: the work stops and says so.
                    parked.cancel.cancel();
                }
            }
        }
    }

    /// Parks the call until the client retries with the answer to `pending`.
    fn park(self: &Arc<Self>, mut parked: Parked, pending: Pending) -> InputRequiredResult {
        let state = format!("{:032x}", rand::random::<u128>());
        parked.reply = Some(pending.reply);
        parked.since = Instant::now();
        let mut all = lock(&self.parked);
        if all.len() >= MAX_PARKED {
            // Bounded: the oldest is let go (its command runs on, its result is dropped).
            let oldest = all
                .iter()
                .min_by_key(|(_, p)| p.since)
                .map(|(key, _)| key.clone());
            if let Some(gone) = oldest.and_then(|key| all.remove(&key)) {
                lock(&self.calls).remove(&gone.session);
            }
        }
        all.insert(state.clone(), parked);
        drop(all);
        let asks = Arc::downgrade(self);
        let expired = state.clone();
        tokio::spawn(async move {
            tokio::time::sleep(PARKED_FOR).await;
            if let Some(asks) = asks.upgrade()
                && let Some(parked) = lock(&asks.parked).remove(&expired)
            {
                lock(&asks.calls).remove(&parked.session);
            }
        });
        let requests = [(
            INPUT_KEY.to_owned(),
            InputRequest::Elicitation(ElicitRequest::new(pending.form)),
        )]
        .into_iter()
        .collect();
        InputRequiredResult::new(Some(requests), Some(state))
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
        let (posted, answered) = self.post(question).unzip();
        let asked = match self.session_channel(registry, question) {
            Err(reason) => match answered {
                // Nobody to ask but a watching dashboard: it alone may answer.
                Some(answered) => by_dashboard(answered).await,
                None => return EgressAnswer::Refuse(reason.to_owned()),
            },
            Ok((session, channel)) => {
                let asked = match channel {
                    Channel::Peer(peer) => ask(&peer, question, answered).await,
                    Channel::Call(call) => match answered {
                        // The first answer wins; the parked call's answer is then ignored.
                        Some(answered) => tokio::select! {
                            asked = ask_call(&call, question) => asked,
                            asked = by_dashboard(answered) => asked,
                        },
                        None => ask_call(&call, question).await,
                    },
                };
                self.release(session);
                asked
            }
        };
        if let Some(id) = posted {
            lock(&self.board).open.remove(&id);
        }
        match asked {
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

    /// The session to ask and how, with one more question counted open on it; else the
    /// reason the question is refused when no dashboard can answer it either.
    fn session_channel(
        &self,
        registry: &Registry,
        question: &EgressQuestion,
    ) -> Result<(u64, Channel), &'static str> {
        let chosen = {
            let askers = lock(&self.askers);
            registry
                .egress_audience(&question.computer_id)
                .into_iter()
                .find_map(|session| askers.get(&session).map(|a| (session, a.clone())))
        };
        let (session, channel) = match chosen {
            None => return Err(reasons::NO_SESSION),
            Some((_, Asker::NoElicitation)) => return Err(reasons::NO_ELICITATION),
            Some((session, Asker::Mrtr)) => match lock(&self.calls).get(&session) {
                Some(call) => (session, Channel::Call(call.clone())),
                None => return Err(reasons::CALL_ENDED),
            },
            Some((session, Asker::Elicit(peer))) => (session, Channel::Peer(peer)),
        };
        let mut open = lock(&self.open);
        let count = open.entry(session).or_default();
        if *count >= MAX_QUESTIONS_PER_SESSION {
            return Err(reasons::TOO_MANY);
        }
        *count += 1;
        Ok((session, channel))
    }

    /// A question on `session` is over.
    fn release(&self, session: u64) {
        let mut open = lock(&self.open);
        if let Some(count) = open.get_mut(&session) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                open.remove(&session);
            }
        }
    }

    /// Puts `question` on the board when a dashboard watches its computer: its id, and where
    /// the dashboard's answer arrives.
    fn post(&self, question: &EgressQuestion) -> Option<(u64, oneshot::Receiver<Asked>)> {
        let mut board = lock(&self.board);
        board.watched.retain(|_, at| at.elapsed() < WATCHED_FOR);
        if !board.watched.contains_key(&question.computer_id) {
            return None;
        }
        board.next += 1;
        let id = board.next;
        let (reply, answered) = oneshot::channel();
        board.open.insert(
            id,
            OnBoard {
                computer: question.computer_id.clone(),
                host: question.host.clone(),
                port: question.port,
                asked_at: crate::clock::now_rfc3339(),
                reply,
            },
        );
        Some((id, answered))
    }

    /// A dashboard looks at `computer`: its questions from now on are held for the dashboard
    /// too, and those open now are returned, oldest first.
    pub fn watch(&self, computer: &ComputerId) -> Vec<BoardQuestion> {
        let mut board = lock(&self.board);
        board.watched.retain(|_, at| at.elapsed() < WATCHED_FOR);
        board.watched.insert(computer.clone(), Instant::now());
        let mut open: Vec<BoardQuestion> = board
            .open
            .iter()
            .filter(|(_, q)| q.computer == *computer)
            .map(|(id, q)| BoardQuestion {
                id: *id,
                host: q.host.clone(),
                port: q.port,
                asked_at: q.asked_at.clone(),
            })
            .collect();
        open.sort_by_key(|q| q.id);
        open
    }

    /// The dashboard's answer to question `id` of `computer`: taken when the question is still
    /// open (the first answer wins, wherever it comes from).
    pub fn answer_on_board(
        &self,
        computer: &ComputerId,
        id: u64,
        choice: &str,
    ) -> Result<(), BoardError> {
        let asked = match choice {
            ALLOW_ONCE => Asked::Answer(EgressAnswer::Once),
            ALLOW_COMPUTER => Asked::Answer(EgressAnswer::ForComputer),
            DENY => Asked::Deny,
            other => return Err(BoardError::Choice(other.to_owned())),
        };
        let missing = || BoardError::NoQuestion {
            id,
            computer: computer.slug().to_owned(),
        };
        let mut board = lock(&self.board);
        // Another principal's question, or another computer's, is answered like a missing one.
        if board.open.get(&id).is_none_or(|q| q.computer != *computer) {
            return Err(missing());
        }
        let question = board.open.remove(&id).ok_or_else(missing)?;
        question.reply.send(asked).map_err(|_| missing())
    }
}

/// Waits for a dashboard's answer, up to the proxy's hold.
async fn by_dashboard(answered: oneshot::Receiver<Asked>) -> Asked {
    match tokio::time::timeout(ASK_TIMEOUT, answered).await {
        Ok(Ok(asked)) => asked,
        _ => Asked::Answer(EgressAnswer::Refuse(reasons::NO_ANSWER.to_owned())),
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

/// Asks through `elicitation/create`; with a dashboard watching (`answered`), whichever answers
/// first decides, and a form the dashboard answered first is withdrawn from the client
/// (`notifications/cancelled`).
async fn ask(
    peer: &Peer<RoleServer>,
    question: &EgressQuestion,
    answered: Option<oneshot::Receiver<Asked>>,
) -> Asked {
    let Some(params) = request(question) else {
        return match answered {
            Some(answered) => by_dashboard(answered).await,
            None => Asked::Answer(EgressAnswer::Refuse(reasons::NO_ELICITATION.to_owned())),
        };
    };
    debug!(computer = %question.computer_id, host = %question.host, port = question.port, "asking the user");
    let elicit = ServerRequest::ElicitRequest(ElicitRequest::new(params));
    let handle = match peer
        .send_request_with_option(elicit, PeerRequestOptions::with_timeout(ASK_TIMEOUT))
        .await
    {
        Ok(handle) => handle,
        Err(error) => {
            warn!(%error, "the elicitation could not be sent");
            return match answered {
                Some(answered) => by_dashboard(answered).await,
                None => Asked::Answer(EgressAnswer::Refuse(reasons::NO_ANSWER.to_owned())),
            };
        }
    };
    let request_id = handle.id.clone();
    let response = handle.await_response();
    let result = match answered {
        None => response.await,
        Some(answered) => tokio::select! {
            result = response => result,
            asked = by_dashboard(answered) => {
                let withdrawn = CancelledNotificationParam::new(
                    Some(request_id),
                    Some("answered on the dashboard".to_owned()),
                );
                let _ = peer.notify_cancelled(withdrawn).await;
                return asked;
            }
        },
    };
    match result {
        Ok(ClientResult::ElicitResult(result)) => asked_from(&result),
        Ok(_) => {
            warn!("the client answered the elicitation with another result");
            Asked::Answer(EgressAnswer::Refuse(reasons::NO_ANSWER.to_owned()))
        }
        Err(ServiceError::Timeout { .. }) => {
            Asked::Answer(EgressAnswer::Refuse(reasons::NO_ANSWER.to_owned()))
        }
        Err(error) => {
            warn!(%error, "the elicitation failed");
            Asked::Answer(EgressAnswer::Refuse(reasons::NO_ANSWER.to_owned()))
        }
    }
}

/// Puts a question to a 2026-07-28 call, which answers its client with `input_required`.
async fn ask_call(call: &mpsc::Sender<Pending>, question: &EgressQuestion) -> Asked {
    let Some(form) = request(question) else {
        return Asked::Answer(EgressAnswer::Refuse(reasons::NO_ELICITATION.to_owned()));
    };
    let (reply, answered) = oneshot::channel();
    if call.try_send(Pending { form, reply }).is_err() {
        return Asked::Answer(EgressAnswer::Refuse(reasons::TOO_MANY.to_owned()));
    }
    match tokio::time::timeout(ASK_TIMEOUT, answered).await {
        Ok(Ok(asked)) => asked,
        _ => Asked::Answer(EgressAnswer::Refuse(reasons::NO_ANSWER.to_owned())),
    }
}

/// What an elicitation's result means for the connection.
fn asked_from(result: &ElicitResult) -> Asked {
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

    #[tokio::test]
    async fn a_watched_computers_question_is_answered_once_on_the_board() {
        let asks = Asks::default();
        let alice = Principal::named("alice").unwrap();
        let id = ComputerId::parse("dev-box").unwrap().owned_by(&alice);
        let (unwatched, _) = EgressQuestion::new(id.clone(), "other.test".to_owned(), 80);
        assert!(
            asks.post(&unwatched).is_none(),
            "posted without a dashboard"
        );
        assert!(asks.watch(&id).is_empty());
        let (posted, answered) = asks.post(&unwatched).expect("not posted while watched");
        let shown = asks.watch(&id);
        assert_eq!(
            shown
                .iter()
                .map(|q| (q.id, q.host.as_str(), q.port))
                .collect::<Vec<_>>(),
            vec![(posted, "other.test", 80)]
        );
        // Another principal's computer of the same slug sees nothing and answers nothing.
        let bobs = ComputerId::parse("dev-box")
            .unwrap()
            .owned_by(&Principal::named("bob").unwrap());
        assert!(asks.watch(&bobs).is_empty());
        assert!(matches!(
            asks.answer_on_board(&bobs, posted, ALLOW_ONCE),
            Err(BoardError::NoQuestion { .. })
        ));
        assert!(matches!(
            asks.answer_on_board(&id, posted, "maybe"),
            Err(BoardError::Choice(_))
        ));
        asks.answer_on_board(&id, posted, ALLOW_ONCE).unwrap();
        assert!(matches!(
            by_dashboard(answered).await,
            Asked::Answer(EgressAnswer::Once)
        ));
        // The first answer won: a second finds no question.
        assert!(asks.answer_on_board(&id, posted, DENY).is_err());
        assert!(asks.watch(&id).is_empty());
    }

    fn question() -> EgressQuestion {
        let id = ComputerId::parse("dev-box").unwrap();
        EgressQuestion::new(id, "other.test".to_owned(), 80).0
    }

    /// Waits (bounded) until `session` has a running call that can be asked.
    async fn call_of(asks: &Asks, session: u64) -> mpsc::Sender<Pending> {
        for _ in 0..1000 {
            if let Some(call) = lock(&asks.calls).get(&session).cloned() {
                return call;
            }
            tokio::task::yield_now().await;
        }
        panic!("the call was never registered");
    }

    #[tokio::test]
    async fn a_2026_07_28_call_is_answered_input_required_and_only_its_principal_resumes_it() {
        let asks = Arc::new(Asks::default());
        let alice = Principal::named("alice").unwrap();
        let (finish, finished) = oneshot::channel::<()>();
        let work = async move {
            let _ = finished.await;
            Ok(CallToolResult::success(Vec::new()))
        };
        let first = {
            let (asks, alice) = (Arc::clone(&asks), alice.clone());
            tokio::spawn(async move {
                let request = CancellationToken::new();
                asks.run_call(1, alice, CancellationToken::new(), &request, work)
                    .await
            })
        };
        let call = call_of(&asks, 1).await;
        let asking = tokio::spawn(async move { ask_call(&call, &question()).await });
        let Ok(CallToolResponse::InputRequired(required)) = first.await.unwrap() else {
            panic!("expected input_required");
        };
        let wire = serde_json::to_value(&required).unwrap();
        assert_eq!(wire["resultType"], "input_required");
        assert_eq!(
            wire["inputRequests"][INPUT_KEY]["method"],
            "elicitation/create"
        );
        assert_eq!(
            wire["inputRequests"][INPUT_KEY]["params"]["message"],
            "The computer `dev-box` wants to reach `other.test:80`."
        );
        let state = required.request_state.clone().unwrap();
        let request = CancellationToken::new();
        // Another principal cannot resume it, nor can an unknown state; it stays parked.
        let bob = Principal::named("bob").unwrap();
        assert!(asks.resume(&state, None, &bob, &request).await.is_err());
        assert!(asks.resume("feed", None, &alice, &request).await.is_err());
        // A retry without an answer declines this connection; the call goes on.
        let resumed = {
            let asks = Arc::clone(&asks);
            tokio::spawn(async move {
                let request = CancellationToken::new();
                asks.resume(&state, None, &alice, &request).await
            })
        };
        assert!(matches!(
            asking.await.unwrap(),
            Asked::Answer(EgressAnswer::Refuse(reason)) if reason == reasons::DECLINED
        ));
        finish.send(()).unwrap();
        assert!(matches!(
            resumed.await.unwrap(),
            Ok(CallToolResponse::Complete(_))
        ));
    }

    #[tokio::test]
    async fn the_retry_carries_the_answer_and_the_call_goes_on() {
        let asks = Arc::new(Asks::default());
        let alice = Principal::named("alice").unwrap();
        let (finish, finished) = oneshot::channel::<()>();
        let work = async move {
            let _ = finished.await;
            Ok(CallToolResult::success(Vec::new()))
        };
        let first = {
            let (asks, alice) = (Arc::clone(&asks), alice.clone());
            tokio::spawn(async move {
                let request = CancellationToken::new();
                asks.run_call(1, alice, CancellationToken::new(), &request, work)
                    .await
            })
        };
        let call = call_of(&asks, 1).await;
        let asking = tokio::spawn(async move { ask_call(&call, &question()).await });
        let Ok(CallToolResponse::InputRequired(required)) = first.await.unwrap() else {
            panic!("expected input_required");
        };
        let state = required.request_state.unwrap();
        let responses: InputResponses = [(
            INPUT_KEY.to_owned(),
            serde_json::json!({"action": "accept", "content": {"choice": ALLOW_ONCE}}),
        )]
        .into_iter()
        .collect();
        let resumed = {
            let asks = Arc::clone(&asks);
            tokio::spawn(async move {
                let request = CancellationToken::new();
                asks.resume(&state, Some(&responses), &alice, &request)
                    .await
            })
        };
        assert!(matches!(
            asking.await.unwrap(),
            Asked::Answer(EgressAnswer::Once)
        ));
        finish.send(()).unwrap();
        assert!(matches!(
            resumed.await.unwrap(),
            Ok(CallToolResponse::Complete(_))
        ));
        assert!(lock(&asks.calls).is_empty() && lock(&asks.parked).is_empty());
    }
}
