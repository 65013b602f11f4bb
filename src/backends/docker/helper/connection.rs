//! One live connection to a helper: a single Docker exec of `<helper> serve` whose attached
//! stdin/stdout carry the frames of [`kilntainers_helper::wire`]. Many commands share it, each
//! under its own id.
//!
//! Two tasks own the stream halves: the writer sends whole frames from a queue, so a command
//! future dropped mid-call (timeout, cancellation) can never leave half a frame behind; the
//! reader decodes events and routes them by id. When the stream ends, every waiting command
//! learns it at once (its channel closes) and the connection is never used again.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use bollard::Docker;
use bollard::container::LogOutput;
use bollard::exec::{CreateExecOptions, StartExecOptions, StartExecResults};
use futures_util::StreamExt;
use kilntainers_helper::wire::{self, Event, FrameBuffer, OutputStream, Request, Start};
use tokio::io::AsyncWriteExt;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::backends::{ExecEnd, ExecSpec, OutputSink, SinkControl, Stream};

/// How long a starting helper may take to answer `Hello`. Generous: a cold start on a loaded
/// engine can take a second; a helper that cannot run fails at once with the runtime's message.
const HELLO_TIMEOUT: Duration = Duration::from_secs(15);
/// Credit is returned in batches of this many consumed bytes, so small outputs cost no frames.
const CREDIT_BATCH: u32 = wire::WINDOW / 4;

/// Why a helper could not be started on a computer.
#[derive(Debug)]
pub(super) enum ConnectError {
    /// The engine refused the exec itself (computer gone or stopped): not the helper's fault,
    /// and the plain exec path will report it in the usual words.
    Engine(bollard::errors::Error),
    /// The helper did not come up. `missing` = its file is not in the computer (yet).
    Unusable { reason: String, missing: bool },
}

/// The connection broke while a command was running; the text says how.
#[derive(Debug)]
pub(crate) struct Lost(pub String);

#[derive(Default)]
struct Routes {
    commands: HashMap<u32, mpsc::UnboundedSender<Event>>,
    kills: HashMap<u32, oneshot::Sender<()>>,
    /// Set once, when the stream ends; no route is added after.
    lost: Option<String>,
}

pub(super) struct Connection {
    frames: mpsc::UnboundedSender<Vec<u8>>,
    routes: Mutex<Routes>,
    next_id: AtomicU32,
    closed: CancellationToken,
    /// Stops both tasks when the connection is dropped, which closes the exec's stdin: the
    /// helper then kills whatever it still runs and exits.
    _tasks: tokio_util::task::AbortOnDropHandle<()>,
}

impl Connection {
    /// Starts `<path> serve` in `container` and waits for its `Hello`.
    pub(super) async fn open(
        docker: &Docker,
        container: &str,
        path: &str,
    ) -> Result<std::sync::Arc<Connection>, ConnectError> {
        let options = CreateExecOptions {
            cmd: Some(vec![path.to_owned(), "serve".to_owned()]),
            attach_stdin: Some(true),
            attach_stdout: Some(true),
            attach_stderr: Some(true),
            tty: Some(false),
            ..Default::default()
        };
        let created = docker
            .create_exec(container, options)
            .await
            .map_err(ConnectError::Engine)?;
        let start = StartExecOptions {
            detach: false,
            tty: false,
            // Small on purpose: one connection stays open per computer, and frames larger
            // than the buffer are simply read in several pieces.
            output_capacity: Some(16 * 1024),
        };
        let started = docker
            .start_exec(&created.id, Some(start))
            .await
            .map_err(ConnectError::Engine)?;
        let StartExecResults::Attached {
            mut output,
            mut input,
        } = started
        else {
            return Err(unusable("the engine did not attach to the helper's exec"));
        };

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
        if let Err(e) = greeting.await {
            return Err(unusable(&format!("cannot write to the helper: {e}")));
        }

        // Anything the runtime prints instead of a frame (a missing file, a wrong
        // architecture) is kept as the reason.
        let mut buffer = FrameBuffer::default();
        let mut raw = Vec::new();
        let waited = tokio::time::timeout(HELLO_TIMEOUT, async {
            // Not a frame: the runtime's message. Read it whole; the failed exec ends at once.
            let mut garbage = false;
            loop {
                match output.next().await {
                    Some(Ok(LogOutput::StdOut { message })) => {
                        raw.extend_from_slice(&message);
                        if garbage {
                            continue;
                        }
                        buffer.extend(&message);
                        match buffer.next_payload() {
                            Ok(Some(payload)) => {
                                return Event::decode(&payload).map_err(|e| e.to_string());
                            }
                            Ok(None) => {}
                            Err(_) => garbage = true,
                        }
                    }
                    Some(Ok(LogOutput::StdErr { message })) => raw.extend_from_slice(&message),
                    Some(Ok(_)) => {}
                    Some(Err(e)) => return Err(format!("the helper's stream broke: {e}")),
                    None => return Err(String::new()),
                }
            }
        })
        .await;
        let pid = match waited {
            Ok(Ok(Event::Hello { version, pid })) if version == wire::PROTOCOL_VERSION => pid,
            Ok(Ok(Event::Hello { version, .. })) => {
                return Err(unusable(&format!(
                    "the helper speaks protocol {version}, this server {}",
                    wire::PROTOCOL_VERSION
                )));
            }
            Ok(Ok(other)) => return Err(unusable(&format!("the helper answered {other:?}"))),
            Ok(Err(detail)) => {
                let text = String::from_utf8_lossy(&raw).trim().to_owned();
                let missing = text.contains(path) && text.contains("no such file or directory");
                let reason = match (text.is_empty(), detail.is_empty()) {
                    (true, true) => "the helper exited without answering".to_owned(),
                    (true, false) => detail,
                    (false, _) => text,
                };
                return Err(ConnectError::Unusable { reason, missing });
            }
            Err(_) => {
                return Err(unusable(&format!(
                    "the helper did not answer within {}s",
                    HELLO_TIMEOUT.as_secs()
                )));
            }
        };

        let (frames, mut queue) = mpsc::unbounded_channel::<Vec<u8>>();
        let closed = CancellationToken::new();
        let connection = std::sync::Arc::new_cyclic(|weak: &std::sync::Weak<Connection>| {
            let reader_side = weak.clone();
            // `close` below needs the connection; this marks it closed even if the stream ends
            // before the Arc is complete.
            let writer_closed = closed.clone();
            let container = container.to_owned();
            let tasks = async move {
                let writer = async {
                    while let Some(frame) = queue.recv().await {
                        if let Err(e) = input.write_all(&frame).await {
                            return format!("writing to the helper failed: {e}");
                        }
                        if let Err(e) = input.flush().await {
                            return format!("writing to the helper failed: {e}");
                        }
                    }
                    "the connection was closed".to_owned()
                };
                let reader = async {
                    loop {
                        match output.next().await {
                            Some(Ok(LogOutput::StdOut { message })) => {
                                buffer.extend(&message);
                                loop {
                                    let event = match buffer.next_payload() {
                                        Ok(Some(payload)) => Event::decode(&payload),
                                        Ok(None) => break,
                                        Err(e) => Err(e),
                                    };
                                    match event {
                                        Ok(event) => {
                                            if let Some(connection) = reader_side.upgrade() {
                                                connection.route(event);
                                            }
                                        }
                                        Err(e) => return e.to_string(),
                                    }
                                }
                            }
                            Some(Ok(LogOutput::StdErr { message })) => {
                                let text = String::from_utf8_lossy(&message);
                                for line in text.lines().filter(|l| !l.trim().is_empty()) {
                                    warn!(container = %container, "exec helper: {line}");
                                }
                            }
                            Some(Ok(_)) => {}
                            Some(Err(e)) => return format!("the helper's stream broke: {e}"),
                            None => return "the helper exited".to_owned(),
                        }
                    }
                };
                let reason = tokio::select! {
                    reason = writer => reason,
                    reason = reader => reason,
                };
                if let Some(connection) = reader_side.upgrade() {
                    connection.close(reason);
                }
                writer_closed.cancel();
            };
            Connection {
                frames,
                routes: Mutex::new(Routes::default()),
                next_id: AtomicU32::new(1),
                closed,
                _tasks: tokio_util::task::AbortOnDropHandle::new(tokio::spawn(tasks)),
            }
        });
        debug!(container, pid, "exec helper connected");
        Ok(connection)
    }

    pub(super) fn is_lost(&self) -> bool {
        self.closed.is_cancelled()
    }

    fn routes(&self) -> std::sync::MutexGuard<'_, Routes> {
        self.routes
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn route(&self, event: Event) {
        let mut routes = self.routes();
        match event {
            Event::Output { id, .. } => {
                if let Some(command) = routes.commands.get(&id) {
                    let _ = command.send(event);
                }
            }
            Event::Exited { id, .. } => {
                if let Some(command) = routes.commands.remove(&id) {
                    let _ = command.send(event);
                }
            }
            Event::Killed { id } => {
                if let Some(waiter) = routes.kills.remove(&id) {
                    let _ = waiter.send(());
                }
            }
            Event::Hello { .. } | Event::Pong { .. } => {}
        }
    }

    /// Marks the connection dead and wakes everyone waiting on it.
    fn close(&self, reason: String) {
        let mut routes = self.routes();
        if routes.lost.is_none() {
            debug!(%reason, "exec helper connection closed");
            routes.lost = Some(reason);
        }
        routes.commands.clear();
        routes.kills.clear();
        drop(routes);
        self.closed.cancel();
    }

    fn lost_reason(&self) -> String {
        self.routes()
            .lost
            .clone()
            .unwrap_or_else(|| "the connection was closed".to_owned())
    }

    fn send(&self, request: &Request) -> Result<(), Lost> {
        let mut frame = Vec::new();
        request.encode(&mut frame);
        self.frames
            .send(frame)
            .map_err(|_| Lost(self.lost_reason()))
    }

    fn next_id(&self) -> u32 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Runs one command through the helper, pushing its output into `sink`.
    pub(super) async fn run(
        &self,
        spec: &ExecSpec,
        sink: &mut dyn OutputSink,
        cancel: &CancellationToken,
    ) -> Result<ExecEnd, Lost> {
        let id = self.next_id();
        let (events_tx, mut events) = mpsc::unbounded_channel();
        {
            let mut routes = self.routes();
            if let Some(reason) = &routes.lost {
                return Err(Lost(reason.clone()));
            }
            routes.commands.insert(id, events_tx);
        }
        let _route = RouteGuard {
            connection: self,
            id,
        };
        self.send(&Request::Start(Start {
            id,
            argv: spec.argv.clone(),
            working_dir: spec.working_dir.clone(),
            env: vec![spec.exec_id.env_entry()],
            stdin: spec.stdin.is_some(),
        }))?;
        if let Some(stdin) = &spec.stdin {
            // Queued whole: the writer task feeds it while output streams back, and the
            // helper buffers it for a command that reads slowly (stdin is capped at 2 MiB).
            for chunk in stdin.chunks(wire::CHUNK) {
                self.send(&Request::Stdin {
                    id,
                    data: chunk.to_vec(),
                })?;
            }
            self.send(&Request::CloseStdin { id })?;
        }
        let mut unreturned: u32 = 0;
        loop {
            tokio::select! {
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
                            self.send(&Request::Credit { id, bytes: unreturned })?;
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
            if let Some(reason) = &routes.lost {
                return Err(Lost(reason.clone()));
            }
            routes.kills.insert(id, done_tx);
        }
        self.send(&Request::Kill { id, tag })?;
        done.await.map_err(|_| Lost(self.lost_reason()))
    }
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
        missing: false,
    }
}
