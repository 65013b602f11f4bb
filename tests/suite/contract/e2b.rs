//! The contract on the E2B backend against the local fake of E2B's control plane and envd
//! (`common::e2b`; its sandboxes are local containers, so `KILNTAINERS_IT_DOCKER=1`). Every
//! case also checks that the fake saw no request outside its reading of the API.

use super::{Harness, OUTPUT_LIMIT_FLAG};
use crate::common::e2b::{Fake, KEY, backend_with};
use crate::common::enabled;

async fn harness() -> Option<Harness> {
    if !enabled("KILNTAINERS_IT_DOCKER") {
        return None;
    }
    let fake = Fake::start(&[]);
    let violations = format!("{}/_fake/violations", fake.api);
    let backend = backend_with(&fake, Some(KEY), &OUTPUT_LIMIT_FLAG);
    let collector = backend_with(&fake, Some(KEY), &OUTPUT_LIMIT_FLAG);
    Some(Harness::new(backend, collector, "/bin/sh", fake).with_violations_check(violations))
}

contract_tests!(fake);
