//! Transports: how MCP sessions reach the server. Each transport opens a registry session per
//! MCP session, serves [`crate::mcp::SessionHandler`] on it, and closes the session when it ends.

pub mod http;
pub mod screen;
pub mod stdio;
