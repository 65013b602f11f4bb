//! The integration test binary: one binary for every suite (faster to build and link).

// Test helpers may panic: a panic is a test failure with its message.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
mod suite;
