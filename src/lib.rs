//! `mcp-sandbox-computer-vm-for-ai`: an MCP server that gives AI agents named, isolated Linux
//! computers. This crate is the server and the composition root: the backend API is the
//! `kilntainers-backend` crate and each provider a crate of its own under `crates/`, which this
//! one pulls in by cargo feature and names only in [`providers`]. The modules are listed
//! alphabetically; their layers, from the providers up to the wire, are ARCHITECTURE.md's
//! "Layers" (kept by the tidy test), and its code map says what each holds.

/// The backend API, under the name the server's modules use for it.
pub use kilntainers_backend as backends;
pub use kilntainers_backend::{clock, ids, secret};

pub mod cli;
pub mod config;
pub mod dashboard;
pub mod exec;
pub mod files;
pub mod jobs;
pub mod mcp;
pub mod ports;
pub mod providers;
pub mod registry;
pub mod secrets_store;
pub mod shutdown;
pub mod state;
pub mod transport;
