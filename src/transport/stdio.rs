//! The stdio transport: one process, one session. Ends on stdin EOF or SIGINT/SIGTERM, and
//! then drains (temporary computers removed before exit).
//!
//! EOF is watched on the raw stdin stream rather than through rmcp: rmcp waits up to 5 s for
//! in-flight calls before its service ends, while clients such as the Python SDK kill the
//! server 2 s after closing stdin. Draining at EOF kills in-flight commands at once, so their
//! calls finish and the temporaries are gone well inside that grace.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use rmcp::ServiceExt;
use rmcp::transport::io::stdio_pipes;
use tokio::io::{AsyncRead, ReadBuf};
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::mcp::{SessionHandler, Surface};
use crate::shutdown;

/// Serves until EOF or a signal; returns the process exit code.
pub async fn serve(surface: Arc<Surface>) -> i32 {
    let mut signals = shutdown::Signals::install();
    let registry = surface.registry.clone();
    let handler = SessionHandler::new(surface);
    let (reader, writer) = stdio_pipes();
    let eof = CancellationToken::new();
    let reader = EofWatch {
        inner: reader,
        eof: eof.clone(),
    };
    let serving = async {
        match handler.serve((reader, writer)).await {
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
