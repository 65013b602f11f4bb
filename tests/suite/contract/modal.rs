//! The contract on the Modal backend against the local fake of Modal's gRPC API (the
//! `fake-modal` crate, started in process by `common::modal`; its sandboxes are local
//! containers, so `KILNTAINERS_IT_DOCKER=1`). The fake checks every call's metadata strictly.
//!
//! Documented difference: Modal cannot stop a sandbox, so restart terminates and recreates it
//! and reports `state_preserved: false` (docs/decisions.md, "Modal sandboxes").

use super::{Differences, Harness, OUTPUT_LIMIT_FLAG};
use crate::common::enabled;
use crate::common::modal::{StateDir, fake, modal, state_dir};

async fn harness() -> Option<Harness> {
    if !enabled("KILNTAINERS_IT_DOCKER") {
        return None;
    }
    let fake = fake().await;
    let backend = modal(&fake, &OUTPUT_LIMIT_FLAG);
    let collector = modal(&fake, &OUTPUT_LIMIT_FLAG);
    let state = StateDir(state_dir(&fake));
    Some(
        Harness::new(backend, collector, "/bin/sh", (fake, state)).with_differences(Differences {
            restart_keeps_files: false,
            ..Differences::CONTAINER
        }),
    )
}

contract_tests!(fake);
