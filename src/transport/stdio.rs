//! The stdio transport: one process, one session. Ends on stdin EOF or SIGINT/SIGTERM, and
//! then drains (temporary computers removed before exit).
//!
//! EOF is watched on the raw stdin stream rather than through rmcp: rmcp waits up to 5 s for
//! in-flight calls before its service ends, while clients such as the Python SDK kill the
//! server 2 s after closing stdin. Draining at EOF kills in-flight commands at once, so their
//! calls finish and the temporaries are gone well inside that grace.
//!
//! The line framing is ours ([`LineTransport`]) rather than rmcp's, so that every line passes
//! through [`super::screen`] and malformed requests are answered instead of dropped. One writer
//! task owns stdout: rmcp's responses and the screen's error replies are whole lines queued to
//! it, so they never interleave.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use rmcp::RoleServer;
use rmcp::ServiceExt;
use rmcp::service::{RxJsonRpcMessage, TxJsonRpcMessage};
use rmcp::transport::Transport;
use rmcp::transport::io::stdio_pipes;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader, ReadBuf};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::screen::{
    self, MAX_LINE_BYTES, OVERSIZED_ID_PREFIX_BYTES, OVERSIZED_ID_TAIL_BYTES, Screened,
};
use crate::mcp::{SessionHandler, Surface};
use crate::shutdown;

/// Lines queued for stdout before senders wait. Small on purpose: when the client stops reading
/// stdout, the server stops reading stdin soon after instead of queueing replies without end.
const OUTGOING_QUEUE_LINES: usize = 32;

/// The line buffer keeps at most this much capacity between messages, so one large request
/// does not pin up to 16 MiB for the rest of the session; ordinary requests fit without
/// reallocating.
const RETAINED_LINE_CAPACITY: usize = 64 * 1024;

/// Serves until EOF or a signal; returns the process exit code.
pub async fn serve(surface: Arc<Surface>) -> i32 {
    let mut signals = shutdown::Signals::install();
    let registry = surface.registry.clone();
    // `secret_request`'s pages: a loopback listener, started on the first request and
    // stopped with this function.
    let pages = CancellationToken::new();
    let _stop_pages = pages.clone().drop_guard();
    if let Some(onboarding) = &surface.onboarding {
        onboarding.set_starter(super::http::secret_page_starter(
            Arc::downgrade(onboarding),
            pages,
        ));
    }
    let handler = SessionHandler::new(surface, crate::ids::Principal::default_principal());
    let (reader, writer) = stdio_pipes();
    let eof = CancellationToken::new();
    let reader = EofWatch {
        inner: reader,
        eof: eof.clone(),
    };
    let transport = LineTransport::new(reader, writer);
    let serving = async {
        match handler.serve(transport).await {
            Ok(running) => {
                let _ = running.waiting().await;
            }
            // The client went away before or during initialisation: just clean up.
            Err(error) => warn!(%error, "stdio session ended during initialisation"),
        }
    };
    let trigger = tokio::select! {
        () = serving => shutdown::Trigger::ClientGone,
        () = eof.cancelled() => shutdown::Trigger::ClientGone,
        () = signals.next() => shutdown::Trigger::Signal,
    };
    shutdown::drain(&registry, trigger, &mut signals).await
}

/// Passes reads through and cancels `eof` when the stream ends.
struct EofWatch<R> {
    inner: R,
    eof: CancellationToken,
}

impl<R: AsyncRead + Unpin> AsyncRead for EofWatch<R> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = polled
            && buf.filled().len() == before
            && buf.remaining() > 0
        {
            self.eof.cancel();
        }
        polled
    }
}

/// One line of output and, for rmcp's own messages, who waits for it to be written.
struct Outgoing {
    line: Vec<u8>,
    written: Option<oneshot::Sender<std::io::Result<()>>>,
}

/// rmcp's transport over newline-delimited JSON, with every incoming line screened.
///
/// `receive` is polled inside rmcp's `select!` and may be dropped at any await, so all progress
/// lives in the struct: a partial line stays in `line`, a refused over-long line is skipped via
/// `discarding`, and a reply not yet queued waits in `pending_reply`.
pub struct LineTransport<R> {
    reader: BufReader<R>,
    line: Vec<u8>,
    /// Set while the rest of an over-long line is skipped; holds its first bytes, where the id
    /// is looked for once the line ends.
    discarding: Option<Refused>,
    pending_reply: Option<Vec<u8>>,
    outgoing: Option<mpsc::Sender<Outgoing>>,
}

/// The result of reading up to one line.
enum LineRead {
    Line,
    Oversized(Refused),
    Eof,
}

/// What is kept of a line over [`MAX_LINE_BYTES`] to find its `id`: its start and its end.
struct Refused {
    prefix: Vec<u8>,
    tail: Vec<u8>,
}

impl Refused {
    /// Starts from the line read so far. Its buffer is shrunk in place to become the prefix
    /// rather than freed: glibc raises its mmap threshold when a large mapped block is freed,
    /// and the next large line would then come from the heap and stay resident after it.
    fn from_line(mut line: Vec<u8>) -> Self {
        let tail = line[line.len().saturating_sub(OVERSIZED_ID_TAIL_BYTES)..].to_vec();
        line.truncate(OVERSIZED_ID_PREFIX_BYTES);
        line.shrink_to_fit();
        Self { prefix: line, tail }
    }

    fn keep(&mut self, chunk: &[u8]) {
        let room = OVERSIZED_ID_PREFIX_BYTES.saturating_sub(self.prefix.len());
        self.prefix
            .extend_from_slice(&chunk[..room.min(chunk.len())]);
        let chunk = &chunk[chunk.len().saturating_sub(OVERSIZED_ID_TAIL_BYTES)..];
        self.tail.extend_from_slice(chunk);
        let excess = self.tail.len().saturating_sub(OVERSIZED_ID_TAIL_BYTES);
        self.tail.drain(..excess);
    }
}

impl<R: AsyncRead + Unpin + Send> LineTransport<R> {
    /// Starts the writer task for `writer`; it ends when the transport is closed or dropped.
    pub fn new<W: AsyncWrite + Unpin + Send + 'static>(reader: R, writer: W) -> Self {
        let (outgoing, queue) = mpsc::channel(OUTGOING_QUEUE_LINES);
        tokio::spawn(write_lines(writer, queue));
        Self {
            reader: BufReader::new(reader),
            line: Vec::new(),
            discarding: None,
            pending_reply: None,
            outgoing: Some(outgoing),
        }
    }

    /// Reads until a whole line is in `self.line`, never holding more than [`MAX_LINE_BYTES`]
    /// of it: a longer line is dropped as it arrives and only its first bytes are kept.
    async fn read_line(&mut self) -> std::io::Result<LineRead> {
        loop {
            let available = self.reader.fill_buf().await?;
            if available.is_empty() {
                return Ok(LineRead::Eof);
            }
            let newline = available.iter().position(|b| *b == b'\n');
            let take = newline.map_or(available.len(), |at| at + 1);
            let chunk = &available[..take];
            let mut finished = None;
            if let Some(refused) = &mut self.discarding {
                refused.keep(chunk);
                if newline.is_some() {
                    finished = self.discarding.take().map(LineRead::Oversized);
                }
            } else if self.line.len() + take > MAX_LINE_BYTES {
                let mut refused = Refused::from_line(std::mem::take(&mut self.line));
                refused.keep(chunk);
                if newline.is_some() {
                    finished = Some(LineRead::Oversized(refused));
                } else {
                    self.discarding = Some(refused);
                }
            } else {
                self.line.extend_from_slice(chunk);
                if newline.is_some() {
                    finished = Some(LineRead::Line);
                }
            }
            self.reader.consume(take);
            if let Some(done) = finished {
                return Ok(done);
            }
        }
    }

    /// Queues a reply; kept in `pending_reply` until the queue has room, so a cancelled
    /// `receive` loses nothing.
    async fn flush_pending_reply(&mut self) -> bool {
        let Some(line) = self.pending_reply.take() else {
            return true;
        };
        let Some(outgoing) = &self.outgoing else {
            return false;
        };
        self.pending_reply = Some(line);
        let Ok(permit) = outgoing.reserve().await else {
            return false;
        };
        if let Some(line) = self.pending_reply.take() {
            permit.send(Outgoing {
                line,
                written: None,
            });
        }
        true
    }

    fn set_reply(&mut self, reply: &serde_json::Value) {
        debug!(reply = %reply["error"]["code"], "answered a malformed JSON-RPC line");
        let mut line = reply.to_string().into_bytes();
        line.push(b'\n');
        self.pending_reply = Some(line);
    }
}

impl<R: AsyncRead + Unpin + Send> Transport<RoleServer> for LineTransport<R> {
    type Error = std::io::Error;

    fn send(
        &mut self,
        item: TxJsonRpcMessage<RoleServer>,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send + 'static {
        let outgoing = self.outgoing.clone();
        async move {
            let mut line = serde_json::to_vec(&item)?;
            line.push(b'\n');
            let (written, done) = oneshot::channel();
            let closed =
                || std::io::Error::new(std::io::ErrorKind::NotConnected, "stdout is closed");
            let outgoing = outgoing.ok_or_else(closed)?;
            outgoing
                .send(Outgoing {
                    line,
                    written: Some(written),
                })
                .await
                .map_err(|_| closed())?;
            done.await.map_err(|_| closed())?
        }
    }

    async fn receive(&mut self) -> Option<RxJsonRpcMessage<RoleServer>> {
        loop {
            if !self.flush_pending_reply().await {
                return None;
            }
            let read = match self.read_line().await {
                Ok(read) => read,
                Err(error) => {
                    warn!(%error, "reading stdin failed");
                    return None;
                }
            };
            match read {
                LineRead::Eof => return None,
                LineRead::Oversized(refused) => {
                    warn!(limit = MAX_LINE_BYTES, "refused an over-long JSON-RPC line");
                    self.set_reply(&screen::oversized(&refused.prefix, &refused.tail));
                }
                LineRead::Line => {
                    let body = self.line.strip_suffix(b"\n").unwrap_or(&self.line);
                    let body = body.strip_suffix(b"\r").unwrap_or(body);
                    let screened = screen::screen(body);
                    self.line.clear();
                    if self.line.capacity() > RETAINED_LINE_CAPACITY {
                        self.line = Vec::new();
                    }
                    match screened {
                        Screened::Message(message) => return Some(*message),
                        Screened::Reply(reply) => self.set_reply(&reply),
                        Screened::Skip => {}
                    }
                }
            }
        }
    }

    async fn close(&mut self) -> Result<(), Self::Error> {
        // Dropping the sender lets the writer task finish what is queued and end.
        self.outgoing = None;
        Ok(())
    }
}

/// Owns stdout: writes each queued line whole and flushes it, then tells its sender.
async fn write_lines<W: AsyncWrite + Unpin>(mut writer: W, mut queue: mpsc::Receiver<Outgoing>) {
    while let Some(Outgoing { line, written }) = queue.recv().await {
        let result = async {
            writer.write_all(&line).await?;
            writer.flush().await
        }
        .await;
        let failed = result.is_err();
        if let Some(written) = written {
            let _ = written.send(result);
        }
        if failed {
            // The client closed stdout; whoever sends next learns it from the closed queue.
            return;
        }
    }
}
