//! The stdio transport: one process, one session. Ends on stdin EOF or SIGINT/SIGTERM, and
//! then drains (temporary computers removed before exit).

use std::sync::Arc;

use rmcp::ServiceExt;
use rmcp::transport::io::stdio_pipes;
use tracing::warn;

use crate::mcp::{SessionHandler, Surface};
use crate::shutdown;

/// Serves until EOF or a signal; returns the process exit code.
pub async fn serve(surface: Arc<Surface>) -> i32 {
    let registry = surface.registry.clone();
    let handler = SessionHandler::new(surface);
    let serving = async {
        match handler.serve(stdio_pipes()).await {
            Ok(running) => {
                let _ = running.waiting().await;
            }
            // The client went away before or during initialisation: just clean up.
            Err(error) => warn!(%error, "stdio session ended during initialisation"),
        }
    };
    tokio::select! {
        () = serving => {}
        () = shutdown::signalled() => {}
    }
    shutdown::drain(&registry).await
}
