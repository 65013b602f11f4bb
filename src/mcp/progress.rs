//! MCP progress notifications for calls that may wait on the provider (docs/decisions.md, "Progress notifications"):
//! sent only when the request carried a progress token, at most four a second, and the last
//! one is delivered before the result.

use std::time::Duration;

use rmcp::model::{ProgressNotificationParam, ProgressToken};
use rmcp::service::RequestContext;
use rmcp::{Peer, RoleServer};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::backends::Progress;

/// Four notifications a second at most, per call.
const MIN_INTERVAL: Duration = Duration::from_millis(250);

struct Update {
    progress: f64,
    total: Option<f64>,
    message: String,
}

pub struct McpProgress {
    sender: Option<mpsc::UnboundedSender<Update>>,
    forwarder: Option<JoinHandle<()>>,
}

impl McpProgress {
    pub fn start(context: &RequestContext<RoleServer>) -> Self {
        let Some(token) = context.meta.get_progress_token() else {
            return Self {
                sender: None,
                forwarder: None,
            };
        };
        let (sender, receiver) = mpsc::unbounded_channel();
        let forwarder = tokio::spawn(forward(context.peer.clone(), token, receiver));
        Self {
            sender: Some(sender),
            forwarder: Some(forwarder),
        }
    }

    /// Flushes pending notifications so they precede the result.
    pub async fn finish(mut self) {
        self.sender = None;
        if let Some(forwarder) = self.forwarder.take() {
            let _ = forwarder.await;
        }
    }
}

impl Progress for McpProgress {
    fn report(&self, progress: f64, total: Option<f64>, message: String) {
        if let Some(sender) = &self.sender {
            let _ = sender.send(Update {
                progress,
                total,
                message,
            });
        }
    }
}

async fn forward(
    peer: Peer<RoleServer>,
    token: ProgressToken,
    mut receiver: mpsc::UnboundedReceiver<Update>,
) {
    let mut last_sent: Option<tokio::time::Instant> = None;
    let mut pending: Option<Update> = None;
    loop {
        let wait = last_sent
            .map(|t| t + MIN_INTERVAL)
            .filter(|_| pending.is_some());
        tokio::select! {
            update = receiver.recv() => match update {
                Some(update) => pending = Some(update),
                None => break,
            },
            () = async { if let Some(at) = wait { tokio::time::sleep_until(at).await } else { std::future::pending().await } } => {}
        }
        let due = last_sent.is_none_or(|t| t.elapsed() >= MIN_INTERVAL);
        if due && let Some(update) = pending.take() {
            send(&peer, &token, update).await;
            last_sent = Some(tokio::time::Instant::now());
        }
    }
    if let Some(update) = pending {
        send(&peer, &token, update).await;
    }
}

async fn send(peer: &Peer<RoleServer>, token: &ProgressToken, update: Update) {
    let mut param = ProgressNotificationParam::new(token.clone(), update.progress);
    param.total = update.total;
    param.message = Some(update.message);
    let _ = peer.notify_progress(param).await;
}
