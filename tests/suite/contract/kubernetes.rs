//! The contract on the Kubernetes backend in pod mode against the local fake of the API
//! server (`common::kubernetes`; its Pods are local containers, so `KILNTAINERS_IT_DOCKER=1`).
//! Every case also checks that the fake saw no request outside the published definitions.
//! No real cluster has run these.
//!
//! Restart keeps the home volume (`/root`, the PVC) and makes the rest of the computer again
//! from its image; the contract's restart case writes under `/root`, so it holds as written.

use super::{Harness, OUTPUT_LIMIT_FLAG};
use crate::common::enabled;
use crate::common::kubernetes::{Fake, backend_with};

async fn harness() -> Option<Harness> {
    if !enabled("KILNTAINERS_IT_DOCKER") {
        return None;
    }
    let fake = Fake::start(&[]);
    let violations = fake.violations_url();
    let backend = backend_with(&fake, &OUTPUT_LIMIT_FLAG);
    let collector = backend_with(&fake, &OUTPUT_LIMIT_FLAG);
    Some(Harness::new(backend, collector, "/bin/sh", fake).with_violations_check(violations))
}

contract_tests!(fake);
