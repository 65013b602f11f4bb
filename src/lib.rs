//! `mcp-sandbox-computer-vm-for-ai`: an MCP server that gives AI agents named, isolated Linux
//! computers. Modules in reading order, from the wire down to the providers; see
//! ARCHITECTURE.md for the map and its invariants.

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
