//! The dashboard: one self-contained HTML file compiled into the binary (docs/decisions.md, "Dashboard"), and
//! the small page shown to browsers when lifecycle tools are off. The server only injects the
//! mode and the backend's name (for the subtitle); the page has no private API and calls the same MCP tools any client would.

/// The MCP App resource URI, kept from upstream for compatibility.
pub const RESOURCE_URI: &str = "ui://kilntainers/computers";
/// The MCP Apps HTML profile.
pub const MIME_TYPE: &str = "text/html;profile=mcp-app";

const INDEX: &str = include_str!("index.html");
/// Replaced by the mode and backend `<meta>`s when serving.
const MODE_PLACEHOLDER: &str = "<!--kilntainers-mode-->";

/// Where the page runs: inside an MCP host (postMessage) or as a web page (fetch to `/mcp`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    App,
    Web,
}

/// The dashboard HTML for `mode`, on a server whose backend is `backend` (a `--backend` name,
/// `Backend::kind`).
pub fn html(mode: Mode, backend: &'static str) -> String {
    let value = match mode {
        Mode::App => "app",
        Mode::Web => "web",
    };
    INDEX.replacen(
        MODE_PLACEHOLDER,
        &format!(
            "<meta name=\"kilntainers-mode\" content=\"{value}\">\n<meta name=\"kilntainers-backend\" content=\"{backend}\">"
        ),
        1,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn self_contained_with_mode() {
        let page = html(Mode::App, "fly");
        assert!(page.contains("<meta name=\"kilntainers-mode\" content=\"app\">"));
        assert!(page.contains("<meta name=\"kilntainers-backend\" content=\"fly\">"));
        for forbidden in ["<script src", "<link", "@import", "url(http"] {
            assert!(
                !page.contains(forbidden),
                "dashboard references an external resource: {forbidden}"
            );
        }
    }

    #[test]
    fn strips_the_job_output_marker_the_server_sends() {
        // The page removes this exact line from job output before showing it.
        let marker = format!("\"\\n{}\"", crate::jobs::MORE_WAITING);
        assert!(INDEX.contains(&marker), "index.html lacks {marker}");
    }
}
