//! `mcp-sandbox-computer-vm-for-ai`: an MCP server that gives AI agents named, isolated Linux
//! computers. The modules are listed alphabetically; their layers, from the providers up to the
//! wire, are ARCHITECTURE.md's "Layers" (kept by the tidy test), and its code map says what
//! each holds.

pub mod backends;
pub mod cli;
pub mod clock;
pub mod config;
pub mod dashboard;
pub mod exec;
pub mod files;
pub mod ids;
pub mod jobs;
pub mod mcp;
pub mod ports;
pub mod providers;
pub mod registry;
pub mod secret;
pub mod shutdown;
pub mod state;
pub mod transport;
