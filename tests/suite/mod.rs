//! Integration suites: `tidy` keeps the code map honest; `stdio` drives the real binary with
//! the Rust MCP client against a real Docker engine; `engines` does the same on Podman and on
//! gVisor; `exec_helper` drives the resident exec helper through the `Backend` trait;
//! `contract` runs the same backend behaviours on every backend; `fly`, `e2b`, `modal` and `wasm`
//! pin what is particular to one provider; `tasks` drives the MCP Tasks extension with rmcp's
//! own client.

mod contract;
#[cfg(feature = "e2b")]
mod e2b;
mod engines;
mod exec_helper;
#[cfg(feature = "fly")]
mod fly;
mod http;
#[cfg(feature = "modal")]
mod modal;
mod stdio;
mod tasks;
mod tidy;
#[cfg(feature = "wasm")]
mod wasm;
