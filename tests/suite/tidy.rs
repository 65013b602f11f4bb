//! Keeps the code map true (after rust-analyzer's tidy): every source file opens with a `//!`
//! paragraph, every top-level module and every crate is in ARCHITECTURE.md, the crates depend
//! only downwards, inside the server each third-party crate stays in the module that owns it,
//! and `scripts/serve.sh` reads the server's flags as the server does. The import checks read code only (comments may name anything) and
//! see through grouped imports (`use crate::{mcp, registry::Registry};`).

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

/// The directory names under `crates/`.
fn workspace_crates() -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("crates");
    let mut names: Vec<String> = std::fs::read_dir(root)
        .expect("read crates")
        .map(|entry| {
            entry
                .expect("entry")
                .file_name()
                .into_string()
                .expect("utf-8")
        })
        .collect();
    names.sort();
    names
}

fn sources() -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    rust_files(&root.join("src"), &mut files);
    for krate in workspace_crates() {
        rust_files(&root.join("crates").join(krate).join("src"), &mut files);
    }
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

/// `text` without its comments: whole comment lines, and what follows ` //` at the end of a
/// code line. String literals that contain `//` (URLs) end a line with a quote or a comma, so
/// they are kept.
fn code_only(text: &str) -> String {
    text.lines()
        .filter(|line| !line.trim_start().starts_with("//"))
        .map(|line| match line.find(" // ") {
            Some(at) if !line[..at].contains('"') => &line[..at],
            _ => line,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every path a `use` item names, with groups expanded: `use crate::{a, b::{c, d}};` gives
/// `crate::a`, `crate::b::c`, `crate::b::d`.
fn used_paths(code: &str) -> Vec<String> {
    fn expand(prefix: &str, tree: &str, out: &mut Vec<String>) {
        let tree = tree.trim();
        let Some(open) = tree.find('{') else {
            let path = tree.split(" as ").next().unwrap_or(tree).trim();
            if !path.is_empty() {
                out.push(format!("{prefix}{path}"));
            }
            return;
        };
        let head = &tree[..open];
        let close = tree.rfind('}').filter(|&c| c > open).unwrap_or(tree.len());
        let inner = &tree[open + 1..close];
        let mut depth = 0;
        let mut start = 0;
        for (i, c) in inner.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    expand(&format!("{prefix}{head}"), &inner[start..i], out);
                    start = i + 1;
                }
                _ => {}
            }
        }
        expand(&format!("{prefix}{head}"), &inner[start..], out);
    }
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("use ") {
        let before = rest[..at].chars().last();
        rest = &rest[at + 4..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let Some(end) = rest.find(';') else { break };
        let item: String = rest[..end].split_whitespace().collect::<Vec<_>>().join(" ");
        expand(
            "",
            &item.replace(":: ", "::").replace(" ::", "::"),
            &mut out,
        );
        rest = &rest[end..];
    }
    out
}

/// Whether `code` refers to `path` (a prefix such as `bollard::` or `crate::mcp`), inline or
/// through a `use`.
fn refers_to(code: &str, uses: &[String], path: &str) -> bool {
    let bare = path.trim_end_matches("::");
    code.contains(path)
        || uses
            .iter()
            .any(|u| u == bare || u.starts_with(&format!("{bare}::")) || u.starts_with(path))
}

#[test]
fn the_import_checks_see_through_groups_and_ignore_comments() {
    let code = code_only(
        "// use bollard::Docker;\nuse crate::{exec, mcp::tools::{a, b as c}};\nlet x = 1; // bollard::x\n",
    );
    let uses = used_paths(&code);
    assert_eq!(
        uses,
        [
            "crate::exec",
            "crate::mcp::tools::a",
            "crate::mcp::tools::b"
        ]
    );
    assert!(refers_to(&code, &uses, "crate::mcp"));
    assert!(refers_to(&code, &uses, "crate::exec"));
    assert!(!refers_to(&code, &uses, "bollard::"));
    assert!(!refers_to(&code, &uses, "crate::registry"));
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
    for krate in workspace_crates() {
        let heading = format!("### crates/{krate}/");
        if !map.contains(&heading) {
            missing.push(heading);
        }
    }
    assert!(missing.is_empty(), "ARCHITECTURE.md lacks: {missing:?}");
}

/// Inside the server crate, (crate path prefix, directories or files allowed to use it). Which
/// crate of the workspace may use a library at all is its manifest's business: a provider's
/// libraries (bollard, tonic, wasmtime, …) are dependencies of that provider's crate alone.
const CONFINED: &[(&str, &[&str])] = &[
    ("axum::", &["src/transport/"]),
    ("hyper::", &["src/transport/"]),
    ("hyper_util::", &["src/transport/"]),
    ("subtle::", &["src/transport/", "src/mcp/tasks.rs"]),
    // The OAuth module is `oauth.rs` and its tests `oauth/tests.rs`.
    ("reqwest::", &["src/transport/http/auth/oauth"]),
    ("jsonwebtoken::", &["src/transport/http/auth/oauth"]),
    (
        "percent_encoding::",
        &["src/mcp/files.rs", "src/mcp/onboarding.rs"],
    ),
    // The secrets store's encryption.
    ("aws_lc_rs::", &["src/secrets_store.rs"]),
    ("base64::", &["src/files/", "src/mcp/files.rs"]),
    ("rmcp::", &["src/mcp/", "src/transport/"]),
    ("clap::", &["src/cli.rs"]),
    // The secrets broker's CA is made in the state dir, and the secrets file read by config.
    ("rcgen::", &["src/state.rs"]),
    ("toml::", &["src/config/secrets.rs"]),
];

#[test]
fn third_party_crates_stay_in_their_modules() {
    let mut offences = Vec::new();
    for (path, text) in sources() {
        if !path.starts_with("src/") {
            continue;
        }
        let code = code_only(&text);
        let uses = used_paths(&code);
        for (krate, allowed) in CONFINED {
            if refers_to(&code, &uses, krate) && !allowed.iter().any(|a| path.starts_with(a)) {
                offences.push(format!("{path} uses {krate}"));
            }
        }
    }
    assert!(offences.is_empty(), "{offences:#?}");
}

/// The top-level modules of `src/`, from the bottom up. A module may use the modules of the
/// layers below its own and nothing else: not a module of a layer above, not another module of
/// its own layer. `main.rs` and `lib.rs` sit on top. ARCHITECTURE.md, "Layers" explains each.
/// The bottom layer is the backend API crate, re-exported by `lib.rs` under these names.
const LAYERS: &[&[&str]] = &[
    &["backends", "ids", "clock", "secret"],
    &["cli"],
    &["state", "secrets_store"],
    &["config"],
    &["providers"],
    &["exec"],
    &["files", "jobs"],
    &["registry"],
    &["ports"],
    &["dashboard"],
    &["mcp"],
    &["shutdown"],
    &["transport"],
];

/// The top-level modules `code` names (`crate::<module>`, inline or in a grouped `use`).
fn crate_modules_used(code: &str) -> std::collections::BTreeSet<String> {
    let word = |c: char| c.is_alphanumeric() || c == '_';
    let mut found = std::collections::BTreeSet::new();
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        let before = rest[..at].chars().last();
        rest = &rest[at + "crate::".len()..];
        if before.is_some_and(word) {
            continue;
        }
        let name: String = rest.chars().take_while(|&c| word(c)).collect();
        if !name.is_empty() {
            found.insert(name);
        }
    }
    for path in used_paths(code) {
        if let Some(name) = path.strip_prefix("crate::") {
            found.insert(name.split("::").next().unwrap_or(name).to_owned());
        }
    }
    found
}

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|layer| layer.contains(&module))
}

#[test]
fn every_top_level_module_has_a_layer() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut modules: Vec<String> = std::fs::read_dir(&root)
        .expect("src")
        .map(|entry| {
            let name = entry.expect("entry").file_name();
            let name = name.to_str().expect("utf-8 name");
            name.trim_end_matches(".rs").to_owned()
        })
        .filter(|name| name != "lib" && name != "main")
        .collect();
    let lib = std::fs::read_to_string(root.join("lib.rs")).expect("lib.rs");
    assert!(
        lib.contains("pub use kilntainers_backend as backends;")
            && lib.contains("pub use kilntainers_backend::{clock, ids, secret};"),
        "lib.rs no longer re-exports the backend API as {:?}",
        LAYERS[0]
    );
    modules.extend(LAYERS[0].iter().map(|m| (*m).to_owned()));
    modules.sort();
    modules.dedup();
    let unplaced: Vec<&String> = modules.iter().filter(|m| layer_of(m).is_none()).collect();
    let stale: Vec<&&str> = LAYERS
        .iter()
        .flat_map(|layer| layer.iter())
        .filter(|m| !modules.iter().any(|n| n == *m))
        .collect();
    assert!(
        unplaced.is_empty(),
        "modules missing from LAYERS: {unplaced:?}"
    );
    assert!(
        stale.is_empty(),
        "LAYERS names modules that do not exist: {stale:?}"
    );
}

#[test]
fn the_layer_check_sees_inline_and_grouped_paths() {
    let code = code_only(
        "// crate::mcp in a comment\nuse crate::{exec, backends::files::{A, B}};\nfn f() { crate::registry::x(); my_crate::ports::y(); }\n",
    );
    let used: Vec<String> = crate_modules_used(&code).into_iter().collect();
    assert_eq!(used, ["backends", "exec", "registry"]);
}

#[test]
fn modules_import_only_from_layers_below() {
    let mut offences = Vec::new();
    for (path, text) in sources() {
        let Some(inside) = path.strip_prefix("src/") else {
            continue;
        };
        let module = inside
            .split('/')
            .next()
            .unwrap_or(inside)
            .trim_end_matches(".rs");
        let Some(own) = layer_of(module) else {
            continue;
        };
        for used in crate_modules_used(&code_only(&text)) {
            if used == module {
                continue;
            }
            match layer_of(&used) {
                Some(layer) if layer < own => {}
                Some(_) => offences.push(format!("{path} ({module}) uses crate::{used}")),
                None => {}
            }
        }
    }
    assert!(
        offences.is_empty(),
        "upward or sideways imports: {offences:#?}"
    );
}

/// The workspace crates each crate under `crates/` may depend on (normal, dev and build
/// dependencies alike): the backend API depends on none, a provider on the backend API (and the
/// Docker backend on the helper whose binary it embeds), and none on the server or on another
/// provider.
fn allowed_workspace_dependencies(krate: &str) -> &'static [&'static str] {
    match krate {
        "backend" => &[],
        "docker" => &[
            "kilntainers-backend",
            "kilntainers-helper",
            "kilntainers-helper-client",
        ],
        "helper-client" => &["kilntainers-backend", "kilntainers-helper"],
        "kubernetes" => &["kilntainers-backend", "kilntainers-helper-client"],
        _ => &["kilntainers-backend"],
    }
}

/// The package names a manifest's dependency tables list (`name = …` or `name.workspace = …`
/// lines under any `[*dependencies]` table).
fn manifest_dependencies(manifest: &str) -> Vec<String> {
    let mut in_dependencies = false;
    let mut names = Vec::new();
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            in_dependencies = line.trim_matches(['[', ']']).ends_with("dependencies");
            continue;
        }
        if !in_dependencies || line.is_empty() || line.starts_with('#') {
            continue;
        }
        let name: String = line
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '-' || *c == '_')
            .collect();
        names.push(name);
    }
    names
}

#[test]
fn the_manifest_reader_sees_every_dependency_table() {
    let manifest = "[package]\nname = \"x\"\n[dependencies]\na.workspace = true\nb = { path = \"b\" }\n# c\n[dev-dependencies]\nd = \"1\"\n[lints]\ne = 1\n";
    assert_eq!(manifest_dependencies(manifest), ["a", "b", "d"]);
}

#[test]
fn crates_depend_only_downwards() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let server = "mcp-sandbox-computer-vm-for-ai";
    let mut offences = Vec::new();
    for krate in workspace_crates() {
        let manifest = std::fs::read_to_string(root.join("crates").join(&krate).join("Cargo.toml"))
            .expect("manifest");
        for dependency in manifest_dependencies(&manifest) {
            let ours = dependency.starts_with("kilntainers-") || dependency == server;
            if ours && !allowed_workspace_dependencies(&krate).contains(&dependency.as_str()) {
                offences.push(format!("crates/{krate} depends on {dependency}"));
            }
            // The backend API speaks plain data: no MCP, no HTTP server, no provider library.
            let provider_or_wire = ["rmcp", "axum", "hyper", "bollard", "tonic", "wasmtime"];
            if krate == "backend" && provider_or_wire.contains(&dependency.as_str()) {
                offences.push(format!("crates/backend depends on {dependency}"));
            }
        }
    }
    assert!(offences.is_empty(), "{offences:#?}");
}

/// The flags `scripts/serve.sh` reads before the server does, as `name:shortest` entries.
fn serve_script_flags(script: &str) -> Vec<(String, String)> {
    let line = script
        .lines()
        .find(|l| l.trim_start().starts_with("for entry in "))
        .expect("serve.sh's `for entry in …` list of flags");
    let list = line.trim().trim_start_matches("for entry in ");
    let list = list.split(';').next().unwrap_or_default();
    list.split_whitespace()
        .map(|entry| {
            let (name, shortest) = entry.split_once(':').expect("name:shortest");
            (name.to_owned(), shortest.to_owned())
        })
        .collect()
}

#[test]
fn serve_sh_reads_the_flags_as_the_server_does() {
    use clap::CommandFactory;
    use mcp_sandbox_computer_vm_for_ai::cli::{BackendKind, Cli};
    let script =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/serve.sh"))
            .expect("serve.sh");
    let command = Cli::command();
    let longs: Vec<String> = command
        .get_arguments()
        .flat_map(|a| a.get_long_and_visible_aliases().unwrap_or_default())
        .map(str::to_owned)
        .collect();
    let flags = serve_script_flags(&script);
    assert!(!flags.is_empty());
    for (name, shortest) in flags {
        assert!(
            longs.contains(&name),
            "serve.sh reads --{name}, which the server does not have"
        );
        // clap (infer_long_args) takes any prefix that names one flag only: the shortest one
        // must be what serve.sh starts to recognise at.
        let unambiguous = (1..=name.len())
            .map(|n| &name[..n])
            .find(|prefix| longs.iter().filter(|l| l.starts_with(prefix)).count() == 1)
            .expect("a prefix");
        assert_eq!(
            shortest, unambiguous,
            "serve.sh's shortest prefix of --{name}"
        );
    }
    // Every backend but Docker needs its cargo feature built in (`BackendKind::not_built`):
    // serve.sh's `case` maps each name to it.
    for backend in BackendKind::ALL
        .into_iter()
        .filter(|b| *b != BackendKind::Docker)
    {
        let label = backend.name();
        assert!(
            script.lines().any(|l| {
                let l = l.trim_start();
                l.contains(')')
                    && (l.starts_with(&format!("{label} ")) || l.contains(&format!("| {label}")))
            }),
            "serve.sh does not map --backend {label} to its cargo feature"
        );
    }
}
