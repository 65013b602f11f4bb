//! The built-in command interpreter of `--backend go_busybox` (docs/decisions.md, "The go_busybox command interpreter".): go-busybox
//! has no shell, so `command` strings are parsed here ([`parse`]) and run by chaining applet
//! runs ([`run`]). Nothing in this module touches wasmtime or the disk.

pub mod parse;
pub mod run;

pub use parse::{ParseError, parse};
pub use run::{Aborted, Host, Interpreter, Out, normalize};
