//! Our `src/modal_api.proto` against Modal's own published definitions
//! (`tests/provider-definitions/modal/`: `api.proto` and `task_command_router.proto`). Our file
//! declares only what we send or read, so every message, enum and RPC it declares must exist in
//! the official files under the same full name, and every field must agree in name, number, type
//! (including the message or enum it names) and label. A mismatch here is a message the real
//! service would read differently from us, which no fake built from our own file can notice.
// See: issue 32

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use protox::prost_reflect::{
    Cardinality, DescriptorPool, EnumDescriptor, FieldDescriptor, Kind, MessageDescriptor,
};

/// A scratch directory of its own for each caller (tests run in parallel in one process).
fn scratch(what: &str) -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    std::env::temp_dir().join(format!(
        "kilntainers-modal-{what}-{}-{n}",
        std::process::id()
    ))
}

fn repository_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Compiles proto files into a descriptor pool; `includes` are the import roots.
fn pool(files: &[&str], includes: &[PathBuf]) -> DescriptorPool {
    let mut compiler = match protox::Compiler::new(includes) {
        Ok(compiler) => compiler,
        Err(error) => panic!("cannot set up protox for {includes:?}: {error}"),
    };
    compiler.include_imports(true);
    if let Err(error) = compiler.open_files(files) {
        panic!("cannot compile {files:?}: {error}");
    }
    compiler.descriptor_pool()
}

/// The official files: `task_command_router.proto` imports `modal_proto/api.proto`, so both are
/// laid out under a scratch directory the way the upstream repository has them.
fn official() -> DescriptorPool {
    let source = repository_root().join("tests/provider-definitions/modal");
    let scratch = scratch("definitions");
    let nested = scratch.join("modal_proto");
    std::fs::create_dir_all(&nested).unwrap_or_else(|e| panic!("mkdir {nested:?}: {e}"));
    for name in ["api.proto", "task_command_router.proto"] {
        std::fs::copy(source.join(name), nested.join(name))
            .unwrap_or_else(|e| panic!("copy {name}: {e}"));
    }
    let pool = pool(
        &[
            "modal_proto/api.proto",
            "modal_proto/task_command_router.proto",
        ],
        std::slice::from_ref(&scratch),
    );
    let _ = std::fs::remove_dir_all(&scratch);
    pool
}

fn ours() -> DescriptorPool {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    pool(&["modal_api.proto", "task_command_router.proto"], &[src])
}

/// Type of a field as text: scalar name, or `message <full name>` / `enum <full name>`.
fn kind(field: &FieldDescriptor) -> String {
    match field.kind() {
        Kind::Message(message) if field.is_map() => format!("map {}", message.full_name()),
        Kind::Message(message) => format!("message {}", message.full_name()),
        Kind::Enum(e) => format!("enum {}", e.full_name()),
        other => format!("{other:?}"),
    }
}

fn label(field: &FieldDescriptor) -> &'static str {
    match field.cardinality() {
        Cardinality::Repeated => "repeated",
        Cardinality::Required => "required",
        // proto3 `optional` and members of a real oneof track presence; plain singular fields do not.
        Cardinality::Optional
            if field.supports_presence() && field.kind().as_message().is_none() =>
        {
            "optional (with presence)"
        }
        Cardinality::Optional => "singular",
    }
}

fn compare_message(
    ours: &MessageDescriptor,
    official: &DescriptorPool,
    problems: &mut Vec<String>,
) {
    let name = ours.full_name();
    let Some(theirs) = official.get_message_by_name(name) else {
        problems.push(format!("message {name}: not in the official definitions"));
        return;
    };
    for field in ours.fields() {
        let at = format!("{name}.{}", field.name());
        let Some(other) = theirs.get_field_by_name(field.name()) else {
            let taken = theirs
                .get_field(field.number())
                .map(|f| {
                    format!(
                        "; number {} is `{} {}` there",
                        field.number(),
                        kind(&f),
                        f.name()
                    )
                })
                .unwrap_or_default();
            problems.push(format!(
                "{at}: no such field in the official message{taken}"
            ));
            continue;
        };
        if field.number() != other.number() {
            problems.push(format!(
                "{at}: number {} here, {} in the official definition",
                field.number(),
                other.number()
            ));
        }
        if kind(&field) != kind(&other) {
            problems.push(format!(
                "{at}: type {} here, {} officially",
                kind(&field),
                kind(&other)
            ));
        }
        if label(&field) != label(&other) {
            problems.push(format!(
                "{at}: label {} here, {} officially",
                label(&field),
                label(&other)
            ));
        }
    }
    for nested in ours.child_messages().filter(|m| !m.is_map_entry()) {
        compare_message(&nested, official, problems);
    }
    for nested in ours.child_enums() {
        compare_enum(&nested, official, problems);
    }
}

fn compare_enum(ours: &EnumDescriptor, official: &DescriptorPool, problems: &mut Vec<String>) {
    let name = ours.full_name();
    let Some(theirs) = official.get_enum_by_name(name) else {
        problems.push(format!("enum {name}: not in the official definitions"));
        return;
    };
    let official_values: BTreeMap<i32, String> = theirs
        .values()
        .map(|v| (v.number(), v.name().to_owned()))
        .collect();
    for value in ours.values() {
        match official_values.get(&value.number()) {
            None => problems.push(format!(
                "{name}: value {} ({}) is not official",
                value.name(),
                value.number()
            )),
            Some(official_name) if official_name != value.name() => problems.push(format!(
                "{name}: value {} is {} here, {official_name} officially",
                value.number(),
                value.name()
            )),
            Some(_) => {}
        }
    }
}

/// Every difference between our file and the official ones, one line each.
fn differences() -> Vec<String> {
    let ours = ours();
    let official = official();
    let mut problems = Vec::new();
    for file in ours.files() {
        if file.package_name().starts_with("google.") {
            continue;
        }
        for message in file.messages() {
            compare_message(&message, &official, &mut problems);
        }
        for e in file.enums() {
            compare_enum(&e, &official, &mut problems);
        }
        for service in file.services() {
            let Some(theirs) = official.get_service_by_name(service.full_name()) else {
                problems.push(format!("service {}: not official", service.full_name()));
                continue;
            };
            for method in service.methods() {
                let at = format!("{}/{}", service.full_name(), method.name());
                let Some(other) = theirs.methods().find(|m| m.name() == method.name()) else {
                    problems.push(format!("{at}: no such RPC in the official service"));
                    continue;
                };
                let shape = |m: &protox::prost_reflect::MethodDescriptor| {
                    format!(
                        "{}{} -> {}{}",
                        if m.is_client_streaming() {
                            "stream "
                        } else {
                            ""
                        },
                        m.input().full_name(),
                        if m.is_server_streaming() {
                            "stream "
                        } else {
                            ""
                        },
                        m.output().full_name()
                    )
                };
                if shape(&method) != shape(&other) {
                    problems.push(format!(
                        "{at}: {} here, {} officially",
                        shape(&method),
                        shape(&other)
                    ));
                }
            }
        }
    }
    problems
}

#[test]
fn issue_32_modal_proto_matches_the_official_definitions_field_by_field() {
    // See: issue 32
    let problems = differences();
    assert!(
        problems.is_empty(),
        "src/modal_api.proto differs from Modal's api.proto / task_command_router.proto:\n  {}",
        problems.join("\n  ")
    );
}

#[test]
fn the_comparison_sees_a_renumbered_field() {
    // The check itself must be able to fail: a file with one field renumbered is caught.
    let scratch = scratch("renumbered");
    std::fs::create_dir_all(&scratch).unwrap_or_else(|e| panic!("mkdir: {e}"));
    std::fs::write(
        scratch.join("x.proto"),
        "syntax = \"proto3\"; package modal.client; message SandboxTerminateRequest { string sandbox_id = 2; }",
    )
    .unwrap_or_else(|e| panic!("write: {e}"));
    let ours = pool(&["x.proto"], std::slice::from_ref(&scratch));
    let _ = std::fs::remove_dir_all(&scratch);
    let official = official();
    let mut problems = Vec::new();
    let message = ours
        .get_message_by_name("modal.client.SandboxTerminateRequest")
        .unwrap_or_else(|| panic!("the scratch message compiles"));
    compare_message(&message, &official, &mut problems);
    assert_eq!(
        problems,
        [
            "modal.client.SandboxTerminateRequest.sandbox_id: number 2 here, 1 in the official definition"
        ]
    );
}
