//! Golden wire shapes, pinned as committed JSON so a change to what clients see shows in
//! `cargo test` without an engine, and its review is a JSON diff:
//!
//! - `golden/tools-*.json`: `tools/list` for every combination of the tool switches (names,
//!   order, schemas, annotations, metadata);
//! - `golden/results/<tool>-<outcome>.json`: one `tools/call` answer per outcome the in-process
//!   fake backend can produce ([`results`]): the result as the wire carries it (`{"result": …}`),
//!   or the JSON-RPC error (`{"error": …}`).
//!
//! After a deliberate change, write the files again with
//! `KILNTAINERS_BLESS=1 cargo test --all-features --lib mcp::golden` and review the diff.
//! What varies from run to run is replaced before comparing, in one place: [`normalise`].
//! The description text itself is pinned by `description.rs`'s tests (the reference's words).

mod results;

use std::path::PathBuf;
use std::sync::Arc;

use serde_json::{Map, Value};

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

/// The tool switches of one surface.
#[derive(Clone, Copy)]
struct On {
    lifecycle: bool,
    jobs: bool,
    files: bool,
}

const ALL_ON: On = On {
    lifecycle: true,
    jobs: true,
    files: true,
};

fn surface(backend: Arc<FakeBackend>, on: On) -> Arc<Surface> {
    let registry = Registry::new(
        backend.clone(),
        InstanceId::random(),
        "/bin/sh".to_owned(),
        LIMITS,
        Quotas::default(),
    );
    let jobs = on.jobs.then(|| {
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
    Surface::new(registry, "DESCRIPTION", on.lifecycle, jobs, on.files, None)
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
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).expect("golden directory");
        }
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
        "{} differs from what the server answers now; if the change is meant, write it again \
         with KILNTAINERS_BLESS=1 and review the diff.\n--- now ---\n{text}",
        path.display()
    );
}

/// Result fields that hold a duration measured while the test ran.
const DURATIONS: [&str; 2] = ["exec_duration_ms", "elapsed_ms"];

/// The one place where what varies between runs is made fixed, everywhere in `value`: in
/// `structuredContent` and equally inside the text block that carries the same payload as JSON.
///
/// - Durations ([`DURATIONS`]) become 0.
/// - Values the server generated, `generated` (computer ids it chose, job ids, the loopback
///   forwarder's URL, as [`results::Bench`] noted them), become their placeholders.
///
/// Everything else stays as it was, so a renamed field or a changed message still fails.
fn normalise(value: &Value, generated: &[(String, String)]) -> Value {
    match value {
        Value::String(text) => {
            let mut text = text.clone();
            for (actual, placeholder) in generated {
                text = text.replace(actual.as_str(), placeholder);
            }
            for key in DURATIONS {
                text = zero_number_after(&text, &format!("\"{key}\": "));
            }
            Value::String(text)
        }
        Value::Array(items) => Value::Array(
            items
                .iter()
                .map(|item| normalise(item, generated))
                .collect(),
        ),
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(key, item)| {
                    let item = if DURATIONS.contains(&key.as_str()) && item.is_number() {
                        Value::from(0)
                    } else {
                        normalise(item, generated)
                    };
                    (key.clone(), item)
                })
                .collect::<Map<String, Value>>(),
        ),
        other => other.clone(),
    }
}

/// `text` with the digits that follow each `prefix` replaced by `0`.
fn zero_number_after(text: &str, prefix: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(prefix) {
        let (before, after) = rest.split_at(at + prefix.len());
        out.push_str(before);
        let digits = after.len() - after.trim_start_matches(|c: char| c.is_ascii_digit()).len();
        if digits > 0 {
            out.push('0');
        }
        rest = &after[digits..];
    }
    out.push_str(rest);
    out
}

#[tokio::test]
async fn tools_list_for_every_combination_of_switches() {
    for lifecycle in [false, true] {
        for jobs in [false, true] {
            for files in [false, true] {
                let on = On {
                    lifecycle,
                    jobs,
                    files,
                };
                let surface = surface(FakeBackend::new(), on);
                let tools = serde_json::to_value(&surface.tools).expect("tools as JSON");
                let name = format!(
                    "tools-lifecycle-{}-jobs-{}-files-{}",
                    switch(lifecycle),
                    switch(jobs),
                    switch(files)
                );
                check(&name, &tools);
            }
        }
    }
}

/// With `--checkpoint-tools` (docs/checkpoints.md) and every other switch on; with it off the
/// files above hold unchanged.
#[tokio::test]
async fn tools_list_with_the_checkpoint_tools() {
    let backend = FakeBackend::new();
    let registry = Registry::new(
        backend,
        InstanceId::random(),
        "/bin/sh".to_owned(),
        LIMITS,
        Quotas::default(),
    );
    let surface = Surface::with_checkpoints(registry, "DESCRIPTION", true, None, true, true, None);
    let tools = serde_json::to_value(&surface.tools).expect("tools as JSON");
    check("tools-checkpoints-on-lifecycle-on-files-on", &tools);
}

fn switch(on: bool) -> &'static str {
    if on { "on" } else { "off" }
}

#[test]
fn normalising_fixes_durations_and_generated_values_only() {
    let generated = [("brave-otter-1a2b".to_owned(), "<computer_id 1>".to_owned())];
    let value = serde_json::json!({
        "content": [{"type": "text", "text": "{\"computer_id\": \"brave-otter-1a2b\", \"exec_duration_ms\": 17}"}],
        "structuredContent": {"computer_id": "brave-otter-1a2b", "exec_duration_ms": 17, "exit_code": 3}
    });
    assert_eq!(
        normalise(&value, &generated),
        serde_json::json!({
            "content": [{"type": "text", "text": "{\"computer_id\": \"<computer_id 1>\", \"exec_duration_ms\": 0}"}],
            "structuredContent": {"computer_id": "<computer_id 1>", "exec_duration_ms": 0, "exit_code": 3}
        })
    );
}
