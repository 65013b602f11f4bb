//! The contract on the Kubernetes backend in sandbox mode (the agent-sandbox CRDs) against
//! the local fake of the API server, which plays the agent-sandbox controller: a Sandbox gets
//! a Pod (a local container) and its home PVC from the volume claim template, suspend and
//! resume end and make the Pod again. Every case also checks that the fake saw no request
//! outside the published definitions (the vendored CRDs for the Sandbox bodies). No real
//! cluster has run these.
//!
//! Restart suspends and resumes the Sandbox; the home PVC stays, so the contract's restart
//! case (which writes under `/root`) holds as written.

use super::{Harness, OUTPUT_LIMIT_FLAG};
use crate::common::enabled;
use crate::common::kubernetes::{Fake, backend_in_mode};

async fn harness() -> Option<Harness> {
    if !enabled("KILNTAINERS_IT_DOCKER") {
        return None;
    }
    let fake = Fake::start(&[]);
    let violations = fake.violations_url();
    let backend = backend_in_mode(&fake, "sandbox", &OUTPUT_LIMIT_FLAG);
    let collector = backend_in_mode(&fake, "sandbox", &OUTPUT_LIMIT_FLAG);
    Some(Harness::new(backend, collector, "/bin/sh", fake).with_violations_check(violations))
}

contract_tests!(fake);
