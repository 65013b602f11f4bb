//! The contract on the go-busybox WASM backend, for real on wasmtime (the module comes from the
//! shared cache of `common::wasm`, like `suite::wasm`).
//!
//! Documented difference: a command is one guest instance inside the server process, with no
//! process tree: a timeout or the output limit stops the guest, and that is the whole kill
//! (nothing can outlive it and there is no /proc to look in). The cases check that the command
//! comes back promptly and the computer stays usable instead. The backend enforces the
//! configured `--output-limit` itself while the guest writes, so the harness configures the
//! limit the cases pass to `exec::run`, as the server does.

use super::{Differences, Harness, OUTPUT_LIMIT_FLAG};
use crate::common::wasm::Place;

async fn harness() -> Option<Harness> {
    let place = Place::new();
    let backend = place.busybox(&OUTPUT_LIMIT_FLAG);
    let collector = place.busybox(&OUTPUT_LIMIT_FLAG);
    Some(
        Harness::new(backend, collector, "/bin/sh", place).with_differences(Differences {
            process_tree: false,
            job_stdin_after_start: false,
            ..Differences::CONTAINER
        }),
    )
}

contract_tests!(real);
