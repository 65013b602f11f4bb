//! Keeps the code map true (after rust-analyzer's tidy): every source file opens with a `//!`
//! paragraph, every top-level module is in ARCHITECTURE.md, and each third-party crate stays in
//! the module that owns it.

use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read src") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

fn sources() -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    rust_files(&root.join("src"), &mut files);
    rust_files(&root.join("helper/src"), &mut files);
    rust_files(&root.join("fakes/modal/src"), &mut files);
    files.sort();
    files
        .into_iter()
        .map(|path| {
            let text = std::fs::read_to_string(&path).expect("read file");
            let relative = path
                .strip_prefix(root)
                .expect("under root")
                .to_string_lossy()
                .into_owned();
            (relative, text)
        })
        .collect()
}

#[test]
fn every_source_file_starts_with_a_module_doc() {
    let missing: Vec<String> = sources()
        .into_iter()
        .filter(|(_, text)| !text.trim_start().starts_with("//!"))
        .map(|(path, _)| path)
        .collect();
    assert!(
        missing.is_empty(),
        "files without a leading //! paragraph: {missing:?}"
    );
}

#[test]
fn every_top_level_module_is_in_the_architecture_map() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let map = std::fs::read_to_string(root.join("ARCHITECTURE.md")).expect("ARCHITECTURE.md");
    let mut missing = Vec::new();
    for entry in std::fs::read_dir(root.join("src")).expect("src") {
        let path = entry.expect("entry").path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .expect("name")
            .to_owned();
        if name == "lib.rs" || name == "main.rs" {
            continue;
        }
        let heading = if path.is_dir() {
            format!("### src/{name}/")
        } else {
            format!("### src/{name}")
        };
        if !map.contains(&heading) {
            missing.push(heading);
        }
    }
    assert!(missing.is_empty(), "ARCHITECTURE.md lacks: {missing:?}");
}

/// (crate path prefix, directories or files allowed to use it)
const CONFINED: &[(&str, &[&str])] = &[
    ("bollard::", &["src/backends/docker/"]),
    (
        "kilntainers_helper::",
        &["src/backends/docker/helper/", "helper/src/"],
    ),
    ("tar::", &["src/backends/docker/helper/"]),
    ("axum::", &["src/transport/"]),
    ("hyper::", &["src/transport/"]),
    ("hyper_util::", &["src/transport/"]),
    ("subtle::", &["src/transport/"]),
    ("reqwest::", &["src/backends/fly/", "src/backends/e2b/"]),
    ("base64::", &["src/backends/e2b/"]),
    ("tonic::", &["src/backends/modal/", "fakes/modal/"]),
    ("prost::", &["src/backends/modal/", "fakes/modal/"]),
    ("protox::", &["src/backends/modal/"]),
    ("toml::", &["src/backends/modal/"]),
    ("wasmtime", &["src/backends/wasm/"]),
    ("cap_std::", &["src/backends/wasm/"]),
    ("zip::", &["src/backends/wasm/"]),
    ("glob::", &["src/backends/wasm/"]),
    ("sha2::", &["src/backends/wasm/"]),
    ("rmcp::", &["src/mcp/", "src/transport/"]),
    (
        "clap::",
        &["src/cli.rs", "src/main.rs", "src/config/mod.rs"],
    ),
];

#[test]
fn third_party_crates_stay_in_their_modules() {
    let mut offences = Vec::new();
    for (path, text) in sources() {
        for (krate, allowed) in CONFINED {
            if text.contains(krate) && !allowed.iter().any(|a| path.starts_with(a)) {
                offences.push(format!("{path} uses {krate}"));
            }
        }
    }
    assert!(offences.is_empty(), "{offences:#?}");
}

#[test]
fn backends_do_not_import_upper_layers() {
    let upper = [
        "crate::mcp",
        "crate::registry",
        "crate::exec",
        "crate::transport",
    ];
    let offences: Vec<String> = sources()
        .into_iter()
        .filter(|(path, _)| path.starts_with("src/backends/"))
        .flat_map(|(path, text)| {
            upper
                .iter()
                .filter(|u| text.contains(*u))
                .map(move |u| format!("{path} imports {u}"))
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(offences.is_empty(), "{offences:#?}");
}
