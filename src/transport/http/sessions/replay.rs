//! Answers kept for a client that reconnects (docs/decisions.md, "Streamable HTTP service"):
//! a request's SSE stream whose connection was cut before its end keeps receiving here, so a
//! `GET` with `Last-Event-ID` gets what the client missed, the answer included, however long
//! after the command ended the client comes back.
//!
//! rmcp 3.11 keeps a request's events only while the request runs: once the answer is sent
//! (into a connection already gone, if the client dropped), the request's channel is removed,
//! and a reconnect gets an empty stream — the client then waits for an answer that never comes.
//! [`Resumable`] wraps each request stream rmcp hands out. Read to its end, it costs a few
//! reference counts; dropped early (the connection was cut), it passes the rest of rmcp's stream
//! to a task that keeps every event, with the last few already sent (the client's
//! `Last-Event-ID` says which of them it got), in a [`Mailbox`]. [`Replays::resume`] serves a
//! reconnect from it, following new events live until the answer; a reconnect that reads to the
//! end takes the mailbox away, one cut again leaves it for the next.
//!
//! Bounded: at most [`EVENTS_PER_MAILBOX`] events each (the oldest go first; the answer comes
//! last), [`MAILBOXES_PER_SESSION`] per session and [`REPLAY_BUDGET_BYTES`] in all (the oldest
//! mailboxes go first); all of a session's go when it ends.

use std::collections::{HashMap, VecDeque};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};

use futures_util::{Stream, StreamExt};
use rmcp::transport::streamable_http_server::SessionId;
use rmcp::transport::streamable_http_server::session::ServerSseMessage;
use tokio::sync::mpsc;
use tracing::{debug, warn};

/// Events a cut stream keeps: a long call sends a progress notification every few seconds, and
/// a client that comes back needs the answer, not every step before it.
pub const EVENTS_PER_MAILBOX: usize = 64;
/// Cut requests kept per session: more than a client has in flight at once.
pub const MAILBOXES_PER_SESSION: usize = 16;
/// Bytes of kept events in all, as serialized: a few of the largest answers (the output limit
/// is 2 MiB by default, twice that once JSON-escaped) for the whole server.
pub const REPLAY_BUDGET_BYTES: usize = 64 * 1024 * 1024;
/// Events already passed to the connection that a cut may still have lost (in the socket's
/// buffers): the client's `Last-Event-ID` tells which.
const RECENT: usize = 8;

type Key = (SessionId, u64);

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// `<index>/<request>`: rmcp's id for an event of a request's stream.
fn parse_event_id(id: &str) -> Option<(usize, u64)> {
    let (index, request) = id.split_once('/')?;
    Some((index.parse().ok()?, request.parse().ok()?))
}

fn event_index(event: &ServerSseMessage) -> Option<usize> {
    event
        .event_id
        .as_deref()
        .and_then(parse_event_id)
        .map(|(index, _)| index)
}

fn event_size(event: &ServerSseMessage) -> usize {
    event
        .message
        .as_ref()
        .and_then(|message| serde_json::to_vec(message.as_ref()).ok())
        .map_or(0, |bytes| bytes.len())
}

/// One cut request's events, and the reconnect reading them now, if any.
struct Mailbox {
    key: Key,
    state: Mutex<MailboxState>,
}

#[derive(Default)]
struct MailboxState {
    events: VecDeque<(ServerSseMessage, usize)>,
    /// rmcp's stream ended: the answer (if the session lived) is the last event.
    ended: bool,
    /// Taken out of [`Replays`]: nothing more is kept.
    dropped: bool,
    live: Option<mpsc::UnboundedSender<ServerSseMessage>>,
}

/// Every session's kept requests.
#[derive(Default)]
pub struct Replays {
    state: Mutex<ReplaysState>,
}

#[derive(Default)]
struct ReplaysState {
    mailboxes: HashMap<Key, Arc<Mailbox>>,
    /// Oldest first.
    order: VecDeque<Key>,
    bytes: usize,
}

impl ReplaysState {
    fn remove(&mut self, key: &Key) {
        if let Some(mailbox) = self.mailboxes.remove(key) {
            self.order.retain(|k| k != key);
            let mut state = lock(&mailbox.state);
            let freed: usize = state.events.iter().map(|(_, size)| size).sum();
            self.bytes = self.bytes.saturating_sub(freed);
            state.events.clear();
            state.dropped = true;
            state.live = None;
        }
    }
}

impl Replays {
    /// Wraps a request's stream from rmcp.
    pub fn wrap<S>(self: &Arc<Self>, session: SessionId, inner: S) -> Resumable
    where
        S: Stream<Item = ServerSseMessage> + Send + Sync + 'static,
    {
        Resumable {
            inner: Some(Box::pin(inner)),
            session,
            request: None,
            recent: VecDeque::with_capacity(RECENT),
            replays: self.clone(),
        }
    }

    /// Forgets every request of a session that ended.
    pub fn forget_session(&self, session: &SessionId) {
        let mut state = lock(&self.state);
        let keys: Vec<Key> = state
            .order
            .iter()
            .filter(|(s, _)| s == session)
            .cloned()
            .collect();
        for key in keys {
            state.remove(&key);
        }
    }

    /// The events after `last_event_id` of a cut request of `session`, then its live events
    /// to the end; `None` when nothing is kept for it.
    pub fn resume(self: &Arc<Self>, session: &SessionId, last_event_id: &str) -> Option<Replay> {
        let (after, request) = parse_event_id(last_event_id)?;
        let key = (session.clone(), request);
        let mailbox = lock(&self.state).mailboxes.get(&key).cloned()?;
        let mut state = lock(&mailbox.state);
        let backlog: VecDeque<ServerSseMessage> = state
            .events
            .iter()
            .filter(|(event, _)| event_index(event).is_none_or(|index| index > after))
            .map(|(event, _)| event.clone())
            .collect();
        let live = if state.ended {
            None
        } else {
            let (sender, receiver) = mpsc::unbounded_channel();
            // A newer reconnect replaces an older one, which then ends.
            state.live = Some(sender);
            Some(receiver)
        };
        drop(state);
        Some(Replay {
            backlog,
            live,
            key: Some(key),
            replays: self.clone(),
        })
    }

    /// Starts keeping a cut request: `recent` are the events already passed on.
    fn keep(self: &Arc<Self>, key: Key, recent: VecDeque<ServerSseMessage>) -> Arc<Mailbox> {
        let mailbox = Arc::new(Mailbox {
            key: key.clone(),
            state: Mutex::new(MailboxState::default()),
        });
        {
            let mut state = lock(&self.state);
            let of_session = state.order.iter().filter(|(s, _)| *s == key.0).count();
            if of_session >= MAILBOXES_PER_SESSION
                && let Some(oldest) = state.order.iter().find(|(s, _)| *s == key.0).cloned()
            {
                warn!(session_id = %key.0, "dropping a kept answer: too many cut requests in this session");
                state.remove(&oldest);
            }
            state.remove(&key);
            state.mailboxes.insert(key.clone(), mailbox.clone());
            state.order.push_back(key);
        }
        for event in recent {
            self.push(&mailbox, event);
        }
        mailbox
    }

    /// Keeps one more event of a cut request and passes it to its reconnect, if any.
    fn push(&self, mailbox: &Mailbox, event: ServerSseMessage) {
        let size = event_size(&event);
        let mut replays = lock(&self.state);
        {
            let mut state = lock(&mailbox.state);
            if state.dropped {
                return;
            }
            if let Some(live) = &state.live
                && live.send(event.clone()).is_err()
            {
                state.live = None;
            }
            state.events.push_back((event, size));
            replays.bytes += size;
            if state.events.len() > EVENTS_PER_MAILBOX
                && let Some((_, freed)) = state.events.pop_front()
            {
                replays.bytes = replays.bytes.saturating_sub(freed);
            }
        }
        while replays.bytes > REPLAY_BUDGET_BYTES {
            let Some(oldest) = replays.order.iter().find(|k| **k != mailbox.key).cloned() else {
                break;
            };
            warn!(session_id = %oldest.0, "dropping a kept answer: the budget of kept answers is full");
            replays.remove(&oldest);
        }
    }

    /// rmcp's stream of a cut request ended.
    fn end(&self, mailbox: &Mailbox) {
        let mut state = lock(&mailbox.state);
        state.ended = true;
        state.live = None;
    }

    /// A reconnect read a request's events to the end: they are delivered.
    fn delivered(&self, key: &Key) {
        lock(&self.state).remove(key);
    }
}

/// A request's stream from rmcp, on its way to the client (see the module doc).
pub struct Resumable {
    inner: Option<Pin<Box<dyn Stream<Item = ServerSseMessage> + Send + Sync>>>,
    session: SessionId,
    /// rmcp's number for the request, from the first event id.
    request: Option<u64>,
    recent: VecDeque<ServerSseMessage>,
    replays: Arc<Replays>,
}

impl Stream for Resumable {
    type Item = ServerSseMessage;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let Some(inner) = self.inner.as_mut() else {
            return Poll::Ready(None);
        };
        match inner.as_mut().poll_next(cx) {
            Poll::Ready(Some(event)) => {
                if self.request.is_none() {
                    self.request = event
                        .event_id
                        .as_deref()
                        .and_then(parse_event_id)
                        .map(|(_, request)| request);
                }
                if self.recent.len() == RECENT {
                    self.recent.pop_front();
                }
                self.recent.push_back(event.clone());
                Poll::Ready(Some(event))
            }
            Poll::Ready(None) => {
                // Read to the end: delivered, nothing to keep.
                self.inner = None;
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl Drop for Resumable {
    fn drop(&mut self) {
        let (Some(inner), Some(request)) = (self.inner.take(), self.request) else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let key = (self.session.clone(), request);
        debug!(session_id = %key.0, request, "request stream cut before its end; keeping its events");
        let mailbox = self.replays.keep(key, std::mem::take(&mut self.recent));
        let replays = self.replays.clone();
        runtime.spawn(async move {
            let mut inner = inner;
            while let Some(event) = inner.next().await {
                replays.push(&mailbox, event);
            }
            replays.end(&mailbox);
        });
    }
}

/// A reconnect's stream: kept events after its `Last-Event-ID`, then live ones to the end.
pub struct Replay {
    backlog: VecDeque<ServerSseMessage>,
    live: Option<mpsc::UnboundedReceiver<ServerSseMessage>>,
    /// Set until the end was read.
    key: Option<Key>,
    replays: Arc<Replays>,
}

impl Stream for Replay {
    type Item = ServerSseMessage;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if let Some(event) = self.backlog.pop_front() {
            return Poll::Ready(Some(event));
        }
        if let Some(live) = self.live.as_mut() {
            match live.poll_recv(cx) {
                Poll::Ready(Some(event)) => return Poll::Ready(Some(event)),
                Poll::Ready(None) => self.live = None,
                Poll::Pending => return Poll::Pending,
            }
        }
        if let Some(key) = self.key.take() {
            self.replays.delivered(&key);
        }
        Poll::Ready(None)
    }
}

#[cfg(test)]
mod tests {
    use rmcp::model::ServerJsonRpcMessage;

    use super::*;

    fn answer(request: u64, index: usize, text: &str) -> ServerSseMessage {
        let message: ServerJsonRpcMessage = serde_json::from_value(serde_json::json!({
            "jsonrpc": "2.0", "id": 7, "result": {"content": [{"type": "text", "text": text}]}
        }))
        .unwrap();
        ServerSseMessage::new(format!("{index}/{request}"), message)
    }

    fn priming(request: u64) -> ServerSseMessage {
        let mut event = ServerSseMessage::retry(std::time::Duration::from_secs(3));
        event.event_id = Some(format!("0/{request}"));
        event
    }

    fn text_of(event: &ServerSseMessage) -> String {
        serde_json::to_string(event.message.as_deref().unwrap()).unwrap()
    }

    #[tokio::test]
    async fn a_cut_stream_keeps_its_answer_for_one_reconnect() {
        let replays = Arc::new(Replays::default());
        let session = SessionId::from("s1".to_owned());
        let (sender, receiver) = mpsc::unbounded_channel::<ServerSseMessage>();
        let inner = futures_util::stream::unfold(receiver, |mut r| async move {
            r.recv().await.map(|event| (event, r))
        });
        let mut stream = replays.wrap(session.clone(), inner);
        sender.send(priming(4)).unwrap();
        assert_eq!(
            stream.next().await.unwrap().event_id.as_deref(),
            Some("0/4")
        );
        // The connection is cut; the answer comes afterwards.
        drop(stream);
        sender.send(answer(4, 1, "late answer")).unwrap();
        drop(sender);
        let mut replayed = Vec::new();
        for _ in 0..100 {
            if let Some(replay) = replays.resume(&session, "0/4") {
                replayed = replay.collect::<Vec<_>>().await;
                if !replayed.is_empty() {
                    break;
                }
            }
            tokio::task::yield_now().await;
        }
        assert_eq!(replayed.len(), 1, "{replayed:?}");
        assert!(text_of(&replayed[0]).contains("late answer"));
        // Read to its end: delivered, not kept for another reconnect.
        assert!(replays.resume(&session, "0/4").is_none());
        // Another session cannot name it.
        assert!(
            replays
                .resume(&SessionId::from("s2".to_owned()), "0/4")
                .is_none()
        );
    }

    #[tokio::test]
    async fn a_stream_read_to_its_end_keeps_nothing_and_a_session_end_forgets() {
        let replays = Arc::new(Replays::default());
        let session = SessionId::from("s1".to_owned());
        let whole = futures_util::stream::iter(vec![priming(1), answer(1, 1, "x")]);
        let read: Vec<_> = replays.wrap(session.clone(), whole).collect().await;
        assert_eq!(read.len(), 2);
        assert!(replays.resume(&session, "0/1").is_none());
        let cut = futures_util::stream::iter(vec![priming(2), answer(2, 1, "y")]);
        let mut stream = replays.wrap(session.clone(), cut);
        stream.next().await.unwrap();
        drop(stream);
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert!(replays.resume(&session, "0/2").is_some());
        replays.forget_session(&session);
        assert!(replays.resume(&session, "0/2").is_none());
    }
}
