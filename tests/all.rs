//! The integration test binary: one binary for every suite (faster to build and link).

mod common;
mod suite;
