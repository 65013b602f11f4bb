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
//! end settles the mailbox, one cut again leaves it for the next.
//!
//! Read to its end is not received: a connection can die without the server noticing (a
//! middlebox that drops it silently, a FIN the server has not read yet), and the answer is then
//! written into it without an error. So a stream that ends with its answer is kept too, as
//! *settled*: its last few events, for [`SETTLED_GRACE`], for a reconnect that names it.
//!
//! Bounded: at most [`EVENTS_PER_MAILBOX`] events each (the oldest go first; the answer comes
//! last), [`MAILBOXES_PER_SESSION`] cut ones per session and [`REPLAY_BUDGET_BYTES`] of them in
//! all (the oldest mailboxes go first); settled ones apart, [`SETTLED_MAX`] and
//! [`SETTLED_BUDGET_BYTES`] in all, so answers that were received never push out ones that
//! were not; all of a session's go when it ends.

use std::collections::{HashMap, VecDeque};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::{Stream, StreamExt};
use rmcp::model::JsonRpcMessage;
use rmcp::transport::streamable_http_server::SessionId;
use rmcp::transport::streamable_http_server::session::ServerSseMessage;
use tokio::sync::mpsc;
use tokio::time::Instant;
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
/// How long the end of a stream read to its end stays kept: long after a client that lost it
/// notices (the SDKs come back after the announced retry delay, 3 s).
pub const SETTLED_GRACE: Duration = Duration::from_secs(120);
/// Settled streams kept in all: calls of the last [`SETTLED_GRACE`] on a busy server.
pub const SETTLED_MAX: usize = 1024;
/// Bytes of settled streams kept in all: a few of the largest answers.
pub const SETTLED_BUDGET_BYTES: usize = 16 * 1024 * 1024;

type Key = (SessionId, u64);

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Whether a request's stream ended with its answer (a result or an error), rather than being
/// closed under it (rmcp ends a request's old stream when a reconnect takes it over).
fn ends_with_answer(events: &VecDeque<ServerSseMessage>) -> bool {
    events
        .back()
        .and_then(|event| event.message.as_deref())
        .is_some_and(|message| {
            matches!(
                message,
                JsonRpcMessage::Response(_) | JsonRpcMessage::Error(_)
            )
        })
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
    /// Read to its end once (see the module doc): counted apart from the cut ones.
    settled: bool,
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
    /// Cut requests, oldest first.
    order: VecDeque<Key>,
    bytes: usize,
    /// Settled requests and when they settled, oldest first.
    settled: VecDeque<(Key, Instant)>,
    settled_bytes: usize,
}

impl ReplaysState {
    fn remove(&mut self, key: &Key) {
        if let Some(mailbox) = self.mailboxes.remove(key) {
            let mut state = lock(&mailbox.state);
            let freed: usize = state.events.iter().map(|(_, size)| size).sum();
            if state.settled {
                self.settled.retain(|(k, _)| k != key);
                self.settled_bytes = self.settled_bytes.saturating_sub(freed);
            } else {
                self.order.retain(|k| k != key);
                self.bytes = self.bytes.saturating_sub(freed);
            }
            state.events.clear();
            state.dropped = true;
            state.live = None;
        }
    }

    /// Lets go of settled requests past their grace or beyond the bounds, oldest first.
    fn prune_settled(&mut self, now: Instant) {
        while let Some((key, since)) = self.settled.front().cloned() {
            let expired = now.duration_since(since) >= SETTLED_GRACE;
            if !expired
                && self.settled.len() <= SETTLED_MAX
                && self.settled_bytes <= SETTLED_BUDGET_BYTES
            {
                break;
            }
            self.remove(&key);
        }
    }

    /// Keeps `mailbox` (already ended) as settled from now on.
    fn settle(&mut self, key: Key, mailbox: Arc<Mailbox>) {
        let size: usize = {
            let mut state = lock(&mailbox.state);
            state.settled = true;
            state.ended = true;
            state.live = None;
            state.events.iter().map(|(_, size)| size).sum()
        };
        self.settled_bytes += size;
        self.settled.push_back((key.clone(), Instant::now()));
        self.mailboxes.insert(key, mailbox);
        self.prune_settled(Instant::now());
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
            .mailboxes
            .keys()
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
        let mailbox = {
            let mut state = lock(&self.state);
            state.prune_settled(Instant::now());
            state.mailboxes.get(&key).cloned()?
        };
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

    /// A stream ended with its answer: it is kept as settled, in case the connection that
    /// took it was already dead.
    fn settle_ended(&self, key: Key, events: VecDeque<ServerSseMessage>) {
        let events = events.into_iter().map(|event| {
            let size = event_size(&event);
            (event, size)
        });
        let mailbox = Arc::new(Mailbox {
            key: key.clone(),
            state: Mutex::new(MailboxState {
                events: events.collect(),
                ..MailboxState::default()
            }),
        });
        let mut state = lock(&self.state);
        state.remove(&key);
        state.settle(key, mailbox);
    }

    /// A reconnect's stream ended: if it read the request's end, the mailbox is settled, kept
    /// for another reconnect in case this one's connection was dead too.
    fn delivered(&self, key: &Key) {
        let mut state = lock(&self.state);
        let Some(mailbox) = state.mailboxes.get(key).cloned() else {
            return;
        };
        let (ended, settled) = {
            let mailbox = lock(&mailbox.state);
            (mailbox.ended, mailbox.settled)
        };
        // Not ended: a newer reconnect took the live events over, and this one stopped.
        if ended && !settled {
            // Out of the cut requests' accounting, then into the settled ones'.
            let freed: usize = lock(&mailbox.state)
                .events
                .iter()
                .map(|(_, size)| size)
                .sum();
            state.order.retain(|k| k != key);
            state.bytes = state.bytes.saturating_sub(freed);
            state.settle(key.clone(), mailbox);
        }
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
                // Read to the end: the answer went into the connection, which may be dead.
                self.inner = None;
                if let Some(request) = self.request
                    && ends_with_answer(&self.recent)
                {
                    let recent = std::mem::take(&mut self.recent);
                    self.replays
                        .settle_ended((self.session.clone(), request), recent);
                }
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

    /// A stream the test feeds by hand, and the sender that feeds it.
    fn fed() -> (
        mpsc::UnboundedSender<ServerSseMessage>,
        impl Stream<Item = ServerSseMessage> + Send + Sync + 'static,
    ) {
        let (sender, receiver) = mpsc::unbounded_channel::<ServerSseMessage>();
        let stream = futures_util::stream::unfold(receiver, |mut r| async move {
            r.recv().await.map(|event| (event, r))
        });
        (sender, stream)
    }

    async fn settle_tasks() {
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn a_cut_stream_keeps_its_answer_for_its_reconnects() {
        let replays = Arc::new(Replays::default());
        let session = SessionId::from("s1".to_owned());
        let (sender, inner) = fed();
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
        settle_tasks().await;
        let replayed: Vec<_> = replays.resume(&session, "0/4").unwrap().collect().await;
        assert_eq!(replayed.len(), 1, "{replayed:?}");
        assert!(text_of(&replayed[0]).contains("late answer"));
        // Read to its end, but that reconnect's connection may have died as well.
        let again: Vec<_> = replays.resume(&session, "0/4").unwrap().collect().await;
        assert_eq!(again.len(), 1);
        // Another session cannot name it.
        assert!(
            replays
                .resume(&SessionId::from("s2".to_owned()), "0/4")
                .is_none()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_stream_read_to_its_end_keeps_its_answer_for_the_grace_only() {
        let replays = Arc::new(Replays::default());
        let session = SessionId::from("s1".to_owned());
        let whole = futures_util::stream::iter(vec![priming(1), answer(1, 1, "x")]);
        let read: Vec<_> = replays.wrap(session.clone(), whole).collect().await;
        assert_eq!(read.len(), 2);
        // The client got the priming event only: the answer went into a dead connection.
        let replayed: Vec<_> = replays.resume(&session, "0/1").unwrap().collect().await;
        assert_eq!(replayed.len(), 1);
        assert!(text_of(&replayed[0]).contains("\"x\""));
        // It had everything: nothing after the answer's own id.
        let none: Vec<_> = replays.resume(&session, "1/1").unwrap().collect().await;
        assert!(none.is_empty());
        tokio::time::advance(SETTLED_GRACE).await;
        assert!(replays.resume(&session, "0/1").is_none());
    }

    #[tokio::test]
    async fn a_stream_closed_without_its_answer_is_not_settled() {
        // rmcp ends a request's old stream when a reconnect takes the request over.
        let replays = Arc::new(Replays::default());
        let session = SessionId::from("s1".to_owned());
        let taken_over = futures_util::stream::iter(vec![priming(3)]);
        let read: Vec<_> = replays.wrap(session.clone(), taken_over).collect().await;
        assert_eq!(read.len(), 1);
        assert!(replays.resume(&session, "0/3").is_none());
    }

    #[tokio::test]
    async fn a_newer_reconnect_takes_over_and_the_older_ending_does_not_end_it() {
        let replays = Arc::new(Replays::default());
        let session = SessionId::from("s1".to_owned());
        let (sender, inner) = fed();
        let mut stream = replays.wrap(session.clone(), inner);
        sender.send(priming(5)).unwrap();
        stream.next().await.unwrap();
        drop(stream);
        settle_tasks().await;
        let older = replays.resume(&session, "0/5").unwrap();
        let mut newer = replays.resume(&session, "0/5").unwrap();
        // The older one ends at once (its live events went to the newer one), settling nothing.
        assert!(older.collect::<Vec<_>>().await.is_empty());
        sender.send(answer(5, 1, "for the newer")).unwrap();
        drop(sender);
        let got = newer.next().await.unwrap();
        assert!(text_of(&got).contains("for the newer"));
        assert!(newer.next().await.is_none());
    }

    #[tokio::test]
    async fn settled_streams_are_bounded_and_a_session_end_forgets_them() {
        let replays = Arc::new(Replays::default());
        let session = SessionId::from("s1".to_owned());
        for request in 0..(SETTLED_MAX as u64 + 1) {
            let whole = futures_util::stream::iter(vec![answer(request, 1, "x")]);
            let _: Vec<_> = replays.wrap(session.clone(), whole).collect().await;
        }
        assert!(replays.resume(&session, "0/0").is_none(), "the oldest goes");
        assert!(replays.resume(&session, "0/1").is_some());
        let cut = futures_util::stream::iter(vec![priming(9999), answer(9999, 1, "y")]);
        let mut stream = replays.wrap(session.clone(), cut);
        stream.next().await.unwrap();
        drop(stream);
        settle_tasks().await;
        assert!(replays.resume(&session, "0/9999").is_some());
        replays.forget_session(&session);
        assert!(replays.resume(&session, "0/1").is_none());
        assert!(replays.resume(&session, "0/9999").is_none());
        let state = lock(&replays.state);
        assert_eq!((state.bytes, state.settled_bytes), (0, 0));
        assert!(state.settled.is_empty() && state.order.is_empty());
    }
}
