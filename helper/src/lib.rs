//! `kilntainers-helper`: a small static program that runs inside a Docker/Podman computer for
//! the lifetime of one server connection and starts commands there on the server's behalf, so a
//! warm `terminal_execute` costs a pipe round trip instead of a Docker exec.
//!
//! [`egress`] is a second mode of the same binary: the egress proxy, run in a sidecar
//! container beside the computers (docs/egress.md), and its relay ([`egress::relay`]), run
//! inside a computer without a network to reach the proxy over a Unix socket.
//!
//! [`wire`] is the framed protocol, shared with the server (which depends on this crate for it
//! alone); [`serve`] is the helper's side, used by `main.rs`. std only: the server's build
//! script compiles this crate with plain `rustc` and `+crt-static`, so the binary runs in any
//! Linux image of the same architecture, BusyBox and distroless ones included.

pub mod egress;
pub mod forward;
pub mod serve;
mod sweep;
mod sys;
pub mod wire;
