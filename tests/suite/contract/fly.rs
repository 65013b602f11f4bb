//! The contract on the Fly backend against the local fake of the documented Machines API
//! (`common::fly`; its Machines are local containers, so `KILNTAINERS_IT_DOCKER=1`). Every
//! case also checks that the fake saw no request outside its reading of the API.
//!
//! Documented difference: Fly's exec endpoint answers once, when the command has ended
//! (`kilntainers_fly::exec`), so output cannot stop a command that keeps running; its timeout
//! does. Crash GC never takes Machines whose lease the collecting backend holds itself, so the
//! orphans are collected by a second backend, as a newly started server would.

use super::{Differences, Harness, OUTPUT_LIMIT_FLAG};
use crate::common::enabled;
use crate::common::fly::{Fake, TOKEN, backend_with};

async fn harness() -> Option<Harness> {
    if !enabled("KILNTAINERS_IT_DOCKER") {
        return None;
    }
    let fake = Fake::with_demo();
    let violations = format!("{}/_fake/violations", fake.url);
    let backend = backend_with(&fake, Some("demo"), Some(TOKEN), &OUTPUT_LIMIT_FLAG);
    let collector = backend_with(&fake, Some("demo"), Some(TOKEN), &OUTPUT_LIMIT_FLAG);
    Some(
        Harness::new(backend, collector, "/bin/sh", fake)
            .with_differences(Differences {
                output_while_running: false,
                ..Differences::CONTAINER
            })
            .with_violations_check(violations),
    )
}

contract_tests!(fake);
