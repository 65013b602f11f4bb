//! One live connection to a helper: a single attached exec of `<helper> serve` (a Docker exec,
//! a `pods/exec` stream) whose stdin/stdout carry the frames of [`kilntainers_helper::wire`].
//! Many commands share it, each under its own id.
//!
//! Two tasks own the stream halves: the writer sends whole frames from a bounded queue, so a
//! command future dropped mid-call (timeout, cancellation) can never leave half a frame behind;
//! the reader decodes events and routes them by id. When the stream ends, every waiting
//! command learns it at once (its channel closes) and the connection is never used again.
//!
//! The helper runs inside the computer, where a root user can replace it or write into its
//! pipes, so everything it sends is checked: the handshake keeps and reads a bounded amount,
//! an event is at most one output chunk, output never exceeds the credit granted, answers
//! never outnumber questions, stderr is rate-limited and budgeted ([`super::untrusted`]), and
//! a helper that stops reading its input is given up after [`STALL_TIMEOUT`]. Any breach marks
//! the connection *broken*: it is dropped and the computer falls back to the plain exec path.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures_util::{Stream as FuturesStream, StreamExt};
use kilntainers_helper::wire::{self, Event, FrameBuffer, OutputStream, Request, Start};
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::debug;

use super::untrusted::{StderrLog, printable};
use kilntainers_backend::{ExecEnd, ExecSpec, OutputSink, SinkControl, Stream};

/// How long a starting helper may take to answer `Hello`. The real helper answers within
/// milliseconds of its exec starting (the exec itself is already running when this clock
/// starts), and one that cannot run fails at once with the runtime's message; a file that
/// stays silent is not our helper, and every command would otherwise wait for it.
pub(super) const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// Credit is returned in batches of this many consumed bytes, so small outputs cost no frames.
const CREDIT_BATCH: u32 = wire::WINDOW / 4;
/// Bytes read before the `Hello` at most. The real helper sends a 13-byte frame and nothing
/// else; a runtime's failure message is a line or two. Past this the file is not our helper.
const HANDSHAKE_LIMIT: usize = 16 * 1024;
/// Of those, what is kept as the reason (and logged, escaped).
const HANDSHAKE_KEPT: usize = 1024;
/// Frames queued toward the helper. Stdin travels in 64 KiB chunks, so this bounds what waits
/// for the writer at 2 MiB (the stdin limit); a full queue makes senders wait.
const QUEUED_FRAMES: usize = 32;
/// How long a write to the helper, or a wait for room in the queue, may take. The real helper
/// reads its stdin all the time (it buffers a slow command's stdin itself), so a write that
/// does not finish in this long means the helper stopped reading.
const STALL_TIMEOUT: Duration = Duration::from_secs(10);

/// One piece of what the helper's process wrote, as the backend's stream delivers it.
#[derive(Debug)]
pub enum Chunk {
    Stdout(Bytes),
    Stderr(Bytes),
}

/// The helper's attached output; `Err` = the stream broke (the text says how).
pub type Output = Pin<Box<dyn FuturesStream<Item = Result<Chunk, String>> + Send>>;
/// The helper's attached stdin.
pub type Input = Pin<Box<dyn AsyncWrite + Send>>;

/// A process started by a [`crate::Transport`] with its streams attached.
pub struct Attached {
    pub output: Output,
    pub input: Input,
}

/// Why a helper could not be started on a computer.
#[derive(Debug)]
pub(super) enum ConnectError {
    /// The backend refused the exec itself (computer gone or stopped): not the helper's fault,
    /// and the plain exec path will report it in the usual words.
    Refused(String),
    /// The helper did not come up. `broken` = something answered that is not our helper
    /// (silence, a flood, a wrong frame), rather than a runtime that cannot run it.
    Unusable { reason: String, broken: bool },
}

/// The connection broke while a command was running; the text says how.
#[derive(Debug)]
pub struct Lost(pub String);

/// How a connection ended.
#[derive(Debug, Clone)]
struct Closed {
    reason: String,
    /// The helper broke the protocol or its limits (not a plain exit or a dead computer).
    broken: bool,
}

impl Closed {
    fn ended(reason: impl Into<String>) -> Self {
        Self {
            reason: reason.into(),
            broken: false,
        }
    }

    fn broken(reason: impl Into<String>) -> Self {
        Self {
            reason: reason.into(),
            broken: true,
        }
    }
}

#[derive(Default)]
struct Routes {
    commands: HashMap<u32, mpsc::UnboundedSender<Event>>,
    kills: HashMap<u32, oneshot::Sender<()>>,
    /// Set once, when the stream ends; no route is added after.
    lost: Option<Closed>,
    /// Output credit handed out so far, all commands together (each `Start` brings
    /// [`wire::WINDOW`], each `Credit` its bytes), counted before the frame is sent.
    granted: u64,
    /// Output bytes received so far; never more than `granted` from an honest helper. This
    /// also bounds what waits in the per-command channels.
    received: u64,
    /// Answers the helper owes: one `Exited` per `Start`, one `Killed` per `Kill`.
    owed: u64,
}

pub(super) struct Connection {
    frames: mpsc::Sender<Vec<u8>>,
    routes: Mutex<Routes>,
    next_id: AtomicU32,
    closed: CancellationToken,
    /// Stops both tasks when the connection is dropped, which closes the exec's stdin: the
    /// helper then kills whatever it still runs and exits.
    _tasks: tokio_util::task::AbortOnDropHandle<()>,
}

impl Connection {
    /// Says `Hello` over an attached exec and, once the helper answers, starts the tasks.
    pub(super) async fn over(
        attached: Attached,
        sandbox: &str,
    ) -> Result<std::sync::Arc<Connection>, ConnectError> {
        let Attached {
            mut output,
            mut input,
        } = attached;
        let mut hello = Vec::new();
        Request::Hello {
            version: wire::PROTOCOL_VERSION,
        }
        .encode(&mut hello);
        let greeting = async {
            input.write_all(&hello).await?;
            input.flush().await?;
            Ok::<_, std::io::Error>(())
        };
        match tokio::time::timeout(HELLO_TIMEOUT, greeting).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(unusable(&format!("cannot write to the helper: {e}"))),
            Err(_) => return Err(broken("the helper did not read its input")),
        }

        // Anything the runtime prints instead of a frame (a missing file, a wrong
        // architecture) is kept as the reason, up to a bound.
        let mut buffer = FrameBuffer::with_limit(wire::MAX_EVENT_PAYLOAD);
        let mut kept = Vec::new();
        let mut seen = 0usize;
        let waited = tokio::time::timeout(HELLO_TIMEOUT, async {
            // Not a frame: the runtime's message, which ends with the failed exec.
            let mut garbage = false;
            loop {
                let message = match output.next().await {
                    Some(Ok(Chunk::Stdout(message))) => {
                        if !garbage {
                            buffer.extend(&message);
                            match buffer.next_payload() {
                                Ok(Some(payload)) => return Handshake::Frame(payload),
                                Ok(None) => {}
                                Err(_) => garbage = true,
                            }
                        }
                        message
                    }
                    Some(Ok(Chunk::Stderr(message))) => message,
                    Some(Err(e)) => {
                        return Handshake::Ended(format!("the helper's stream broke: {e}"));
                    }
                    None => return Handshake::Ended(String::new()),
                };
                let room = HANDSHAKE_KEPT.saturating_sub(kept.len());
                kept.extend_from_slice(&message[..message.len().min(room)]);
                seen = seen.saturating_add(message.len());
                if seen > HANDSHAKE_LIMIT {
                    return Handshake::Flood;
                }
            }
        })
        .await;
        let said = || printable(trim(&kept), HANDSHAKE_KEPT);
        let pid = match waited {
            Ok(Handshake::Frame(payload)) => match Event::decode(&payload) {
                Ok(Event::Hello { version, pid }) if version == wire::PROTOCOL_VERSION => pid,
                Ok(Event::Hello { version, .. }) => {
                    return Err(broken(&format!(
                        "the helper speaks protocol {version}, this server {}",
                        wire::PROTOCOL_VERSION
                    )));
                }
                Ok(other) => {
                    return Err(broken(&format!(
                        "the helper answered {} instead of Hello",
                        kind(&other)
                    )));
                }
                Err(e) => return Err(broken(&e.to_string())),
            },
            Ok(Handshake::Flood) => {
                return Err(broken(&format!(
                    "the helper printed more than {} KiB instead of answering: {}",
                    HANDSHAKE_LIMIT / 1024,
                    said()
                )));
            }
            Ok(Handshake::Ended(detail)) => {
                let reason = match (trim(&kept).is_empty(), detail.is_empty()) {
                    (true, true) => "the helper exited without answering".to_owned(),
                    (true, false) => detail,
                    (false, _) => said(),
                };
                return Err(ConnectError::Unusable {
                    reason,
                    broken: false,
                });
            }
            Err(_) => {
                return Err(broken(&format!(
                    "the helper did not answer within {}s",
                    HELLO_TIMEOUT.as_secs()
                )));
            }
        };

        let (frames, mut queue) = mpsc::channel::<Vec<u8>>(QUEUED_FRAMES);
        let closed = CancellationToken::new();
        let connection = std::sync::Arc::new_cyclic(|weak: &std::sync::Weak<Connection>| {
            let reader_side = weak.clone();
            // `close` below needs the connection; this marks it closed even if the stream ends
            // before the Arc is complete.
            let tasks_closed = closed.clone();
            let mut stderr = StderrLog::new(sandbox);
            let tasks = async move {
                let writer = async {
                    while let Some(frame) = queue.recv().await {
                        let write = async {
                            input.write_all(&frame).await?;
                            input.flush().await
                        };
                        match tokio::time::timeout(STALL_TIMEOUT, write).await {
                            Ok(Ok(())) => {}
                            Ok(Err(e)) => {
                                return Closed::ended(format!("writing to the helper failed: {e}"));
                            }
                            Err(_) => return Closed::broken(stalled()),
                        }
                    }
                    Closed::ended("the connection was closed")
                };
                let reader = async {
                    loop {
                        // First what is already buffered: the handshake may have read past
                        // the Hello.
                        loop {
                            let event = match buffer.next_payload() {
                                Ok(Some(payload)) => Event::decode(&payload),
                                Ok(None) => break,
                                Err(e) => Err(e),
                            };
                            let routed = match (event, reader_side.upgrade()) {
                                (Ok(event), Some(connection)) => connection.route(event),
                                (Ok(_), None) => Ok(()),
                                (Err(e), _) => Err(e.to_string()),
                            };
                            if let Err(violation) = routed {
                                return Closed::broken(violation);
                            }
                        }
                        match output.next().await {
                            Some(Ok(Chunk::Stdout(message))) => buffer.extend(&message),
                            Some(Ok(Chunk::Stderr(message))) => {
                                if let Err(reason) = stderr.write(&message) {
                                    return Closed::broken(reason);
                                }
                            }
                            Some(Err(e)) => {
                                return Closed::ended(format!("the helper's stream broke: {e}"));
                            }
                            None => return Closed::ended("the helper exited"),
                        }
                    }
                };
                let ended = tokio::select! {
                    ended = writer => ended,
                    ended = reader => ended,
                    // Closed from outside (a stalled queue): stop reading at once.
                    () = tasks_closed.cancelled() => Closed::ended("the connection was closed"),
                };
                if let Some(connection) = reader_side.upgrade() {
                    connection.close(ended);
                }
                tasks_closed.cancel();
            };
            Connection {
                frames,
                routes: Mutex::new(Routes::default()),
                next_id: AtomicU32::new(1),
                closed,
                _tasks: tokio_util::task::AbortOnDropHandle::new(tokio::spawn(tasks)),
            }
        });
        debug!(sandbox, pid, "exec helper connected");
        Ok(connection)
    }

    pub(super) fn is_lost(&self) -> bool {
        self.closed.is_cancelled()
    }

    /// Judges the helper broken for `reason` (it stopped answering): the connection ends and
    /// the computer falls back to the plain path, saying so once.
    pub(super) fn give_up(&self, reason: &str) {
        self.close(Closed::broken(reason));
    }

    /// Why the helper was judged broken, if it was (a breach, not a plain end).
    pub(super) fn broken(&self) -> Option<String> {
        match &self.routes().lost {
            Some(Closed {
                reason,
                broken: true,
            }) => Some(reason.clone()),
            _ => None,
        }
    }

    fn routes(&self) -> std::sync::MutexGuard<'_, Routes> {
        self.routes
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Delivers one event; `Err(violation)` when the helper sent what it never may.
    fn route(&self, event: Event) -> Result<(), String> {
        let mut routes = self.routes();
        match event {
            Event::Output { id, ref data, .. } => {
                if data.is_empty() {
                    return Err("the helper sent an empty output frame".to_owned());
                }
                if id >= self.next_id.load(Ordering::Relaxed) {
                    return Err(format!("the helper sent output for unknown command {id}"));
                }
                routes.received = routes.received.saturating_add(data.len() as u64);
                if routes.received > routes.granted {
                    return Err(format!(
                        "the helper sent {} bytes of output with {} bytes of credit",
                        routes.received, routes.granted
                    ));
                }
                if let Some(command) = routes.commands.get(&id) {
                    let _ = command.send(event);
                }
            }
            Event::Exited { id, .. } => {
                owe_one(&mut routes, "Exited")?;
                if let Some(command) = routes.commands.remove(&id) {
                    let _ = command.send(event);
                }
            }
            Event::Killed { id } => {
                owe_one(&mut routes, "Killed")?;
                if let Some(waiter) = routes.kills.remove(&id) {
                    let _ = waiter.send(());
                }
            }
            // Nothing here sends `Ping`, and `Hello` comes once, before the tasks start.
            Event::Hello { .. } | Event::Pong { .. } => {
                return Err(format!("the helper sent an unasked {}", kind(&event)));
            }
        }
        Ok(())
    }

    /// Marks the connection dead and wakes everyone waiting on it.
    fn close(&self, ended: Closed) {
        let mut routes = self.routes();
        if routes.lost.is_none() {
            debug!(reason = %ended.reason, broken = ended.broken, "exec helper connection closed");
            routes.lost = Some(ended);
        }
        routes.commands.clear();
        routes.kills.clear();
        drop(routes);
        self.closed.cancel();
    }

    fn lost_reason(&self) -> String {
        self.routes()
            .lost
            .as_ref()
            .map(|closed| closed.reason.clone())
            .unwrap_or_else(|| "the connection was closed".to_owned())
    }

    /// Queues one frame for the writer, waiting for room at most [`STALL_TIMEOUT`].
    async fn send(&self, request: &Request) -> Result<(), Lost> {
        let mut frame = Vec::new();
        request.encode(&mut frame);
        match tokio::time::timeout(STALL_TIMEOUT, self.frames.send(frame)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(Lost(self.lost_reason())),
            Err(_) => {
                self.close(Closed::broken(stalled()));
                Err(Lost(self.lost_reason()))
            }
        }
    }

    fn next_id(&self) -> u32 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Runs one command through the helper, pushing its output into `sink`; `env` is added to
    /// its environment (the computer's secrets placeholders and CA variables).
    pub(super) async fn run(
        &self,
        spec: &ExecSpec,
        env: &[String],
        sink: &mut dyn OutputSink,
        cancel: &CancellationToken,
    ) -> Result<ExecEnd, Lost> {
        let id = self.next_id();
        let (events_tx, mut events) = mpsc::unbounded_channel();
        {
            let mut routes = self.routes();
            if let Some(closed) = &routes.lost {
                return Err(Lost(closed.reason.clone()));
            }
            routes.commands.insert(id, events_tx);
            routes.granted += u64::from(wire::WINDOW);
            routes.owed += 1;
        }
        let _route = RouteGuard {
            connection: self,
            id,
        };
        self.send(&Request::Start(Start {
            id,
            argv: spec.argv.clone(),
            working_dir: spec.working_dir.clone(),
            env: std::iter::once(spec.exec_id.env_entry())
                .chain(env.iter().cloned())
                .collect(),
            stdin: spec.stdin.is_some(),
        }))
        .await?;
        // Stdin goes through the bounded queue while output streams back, so a command that
        // answers before reading all its input cannot deadlock against us; the helper buffers
        // it for a command that reads slowly (stdin is capped at 2 MiB).
        let feed = async {
            if let Some(stdin) = &spec.stdin {
                for chunk in stdin.chunks(wire::CHUNK) {
                    self.send(&Request::Stdin {
                        id,
                        data: chunk.to_vec(),
                    })
                    .await?;
                }
                self.send(&Request::CloseStdin { id }).await?;
            }
            Ok::<(), Lost>(())
        };
        tokio::pin!(feed);
        let mut fed = false;
        let mut unreturned: u32 = 0;
        loop {
            tokio::select! {
                result = &mut feed, if !fed => {
                    result?;
                    fed = true;
                }
                event = events.recv() => match event {
                    Some(Event::Output { stream, data, .. }) => {
                        let stream = match stream {
                            OutputStream::Stdout => Stream::Stdout,
                            OutputStream::Stderr => Stream::Stderr,
                        };
                        if sink.push(stream, &data) == SinkControl::Stop {
                            return Ok(ExecEnd::StoppedBySink);
                        }
                        unreturned = unreturned.saturating_add(data.len() as u32);
                        if unreturned >= CREDIT_BATCH {
                            // Counted before it is sent, so the helper can never be ahead.
                            self.routes().granted += u64::from(unreturned);
                            self.send(&Request::Credit { id, bytes: unreturned }).await?;
                            unreturned = 0;
                        }
                    }
                    Some(Event::Exited { code, .. }) => return Ok(ExecEnd::Exited(code)),
                    Some(_) => {}
                    None => return Err(Lost(self.lost_reason())),
                },
                () = cancel.cancelled() => return Ok(ExecEnd::StoppedBySink),
            }
        }
    }

    /// Kills every process tagged `tag` (the helper's process-group kill plus its /proc sweep).
    pub(super) async fn kill(&self, tag: String) -> Result<(), Lost> {
        let id = self.next_id();
        let (done_tx, done) = oneshot::channel();
        {
            let mut routes = self.routes();
            if let Some(closed) = &routes.lost {
                return Err(Lost(closed.reason.clone()));
            }
            routes.kills.insert(id, done_tx);
            routes.owed += 1;
        }
        self.send(&Request::Kill { id, tag }).await?;
        done.await.map_err(|_| Lost(self.lost_reason()))
    }
}

/// What came back before the `Hello`.
enum Handshake {
    /// A complete frame (checked by the caller).
    Frame(Vec<u8>),
    /// The stream ended (the exec failed); the detail when the engine gave one.
    Ended(String),
    /// More than [`HANDSHAKE_LIMIT`] bytes and still no frame.
    Flood,
}

/// Owes one answer less; `Err` when the helper answers what nobody asked.
fn owe_one(routes: &mut Routes, what: &str) -> Result<(), String> {
    match routes.owed.checked_sub(1) {
        Some(left) => {
            routes.owed = left;
            Ok(())
        }
        None => Err(format!("the helper sent an unasked {what}")),
    }
}

/// An event's name, for reasons (never its contents: they came from the computer).
fn kind(event: &Event) -> &'static str {
    match event {
        Event::Hello { .. } => "Hello",
        Event::Output { .. } => "Output",
        Event::Exited { .. } => "Exited",
        Event::Killed { .. } => "Killed",
        Event::Pong { .. } => "Pong",
    }
}

fn stalled() -> String {
    format!(
        "the helper stopped reading its input for {}s",
        STALL_TIMEOUT.as_secs()
    )
}

/// `bytes` without surrounding ASCII whitespace.
fn trim(bytes: &[u8]) -> &[u8] {
    bytes.trim_ascii()
}

/// Forgets a command's route when its call ends, however it ends.
struct RouteGuard<'a> {
    connection: &'a Connection,
    id: u32,
}

impl Drop for RouteGuard<'_> {
    fn drop(&mut self) {
        self.connection.routes().commands.remove(&self.id);
    }
}

fn unusable(reason: &str) -> ConnectError {
    ConnectError::Unusable {
        reason: reason.to_owned(),
        broken: false,
    }
}

fn broken(reason: &str) -> ConnectError {
    ConnectError::Unusable {
        reason: reason.to_owned(),
        broken: true,
    }
}

#[cfg(test)]
mod tests;
