//! Golden wire shapes: `tools/list` for every combination of the tool switches, pinned as
//! committed JSON (`src/mcp/golden/tools-*.json`), so a change to a tool's name, order, schema,
//! annotations or metadata shows in `cargo test` without an engine, and its review is a JSON
//! diff. After a deliberate change, write the files again with
//! `KILNTAINERS_BLESS=1 cargo test --all-features --lib mcp::golden` and review the diff.
//! The description text itself is pinned by `description.rs`'s tests (the reference's words).

use std::path::PathBuf;

use serde_json::Value;

use super::Surface;
use crate::backends::fake::FakeBackend;
use crate::config::{ExecLimits, Quotas};
use crate::ids::InstanceId;
use crate::jobs::{JobSettings, Jobs};
use crate::registry::Registry;

/// The defaults of `--timeout` and `--output-limit`, which the schemas quote.
const LIMITS: ExecLimits = ExecLimits {
    default_timeout_secs: 120,
    output_limit: 1_048_576,
};

fn surface(lifecycle: bool, jobs: bool, files: bool) -> std::sync::Arc<Surface> {
    let backend = FakeBackend::new();
    let registry = Registry::new(
        backend.clone(),
        InstanceId::random(),
        "/bin/sh".to_owned(),
        LIMITS,
        Quotas::default(),
    );
    let jobs = jobs.then(|| {
        Jobs::new(
            backend,
            "/bin/sh".to_owned(),
            JobSettings {
                max_jobs: 16,
                default_timeout_secs: 0,
                log_limit: 1 << 20,
                output_limit: LIMITS.output_limit,
            },
        )
    });
    Surface::new(registry, "DESCRIPTION", lifecycle, jobs, files)
}

fn golden_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("src/mcp/golden")
        .join(format!("{name}.json"))
}

/// Compares `actual` with the committed file, or writes it when blessing.
fn check(name: &str, actual: &Value) {
    let path = golden_path(name);
    let text = serde_json::to_string_pretty(actual).expect("JSON") + "\n";
    if std::env::var_os("KILNTAINERS_BLESS").is_some() {
        std::fs::write(&path, &text).expect("write golden file");
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; write it with KILNTAINERS_BLESS=1 and review it",
            path.display()
        )
    });
    assert!(
        expected == text,
        "{} differs from what the server lists now; if the change is meant, write it again with \
         KILNTAINERS_BLESS=1 and review the diff.\n--- now ---\n{text}",
        path.display()
    );
}

#[tokio::test]
async fn tools_list_for_every_combination_of_switches() {
    for lifecycle in [false, true] {
        for jobs in [false, true] {
            for files in [false, true] {
                let surface = surface(lifecycle, jobs, files);
                let tools = serde_json::to_value(&surface.tools).expect("tools as JSON");
                let name = format!(
                    "tools-lifecycle-{}-jobs-{}-files-{}",
                    on(lifecycle),
                    on(jobs),
                    on(files)
                );
                check(&name, &tools);
            }
        }
    }
}

fn on(switch: bool) -> &'static str {
    if switch { "on" } else { "off" }
}
