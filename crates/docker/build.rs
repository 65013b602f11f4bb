//! Builds the broker (`broker/`: the egress proxy with TLS termination for secrets brokering,
//! docs/egress.md), which needs rustls and so cannot be built with plain rustc: a nested
//! `cargo build --release --locked -p kilntainers-broker`, static (`+crt-static`), in a target
//! directory of its own beside the outer one (`<target>/kilntainers-broker`, shared by debug,
//! test and clippy builds, so only the first one pays for it), with the outer build's flags,
//! wrappers (but a compiler cache) and jobserver kept out. This crate embeds the result with `include_bytes!`.
//! `KILNTAINERS_BROKER_BINARY` embeds one built elsewhere; `KILNTAINERS_REQUIRE_BROKER=1` makes
//! "no broker" a build failure. Without one the proxy's image carries the helper and secrets
//! cannot be brokered, which the server says at startup (`broker_available`). Nothing generated
//! is committed; it lands in `OUT_DIR`. (The exec helper is built by `crates/helper-client`.)

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    broker();
}

/// Where the embedded broker lands; `src/helper/broker.rs` includes it.
const BROKER_OUT: &str = "kilntainers-broker";

/// The broker's crate and the workspace root, from this crate's directory.
const BROKER_DIR: &str = "../../broker";
const WORKSPACE: &str = "../..";

fn broker() {
    println!("cargo:rerun-if-changed={BROKER_DIR}/src");
    println!("cargo:rerun-if-changed={BROKER_DIR}/Cargo.toml");
    println!("cargo:rerun-if-changed={WORKSPACE}/Cargo.lock");
    println!("cargo:rerun-if-changed={WORKSPACE}/Cargo.toml");
    println!("cargo:rerun-if-env-changed=KILNTAINERS_BROKER_BINARY");
    println!("cargo:rerun-if-env-changed=KILNTAINERS_REQUIRE_BROKER");
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").unwrap_or_default());
    let target = std::env::var("TARGET").unwrap_or_default();
    let binary = out_dir.join(BROKER_OUT);
    let prebuilt = std::env::var_os("KILNTAINERS_BROKER_BINARY").filter(|p| !p.is_empty());
    let outcome = if let Some(prebuilt) = prebuilt {
        println!("cargo:rerun-if-changed={}", Path::new(&prebuilt).display());
        std::fs::copy(&prebuilt, &binary).map(drop).map_err(|e| {
            format!(
                "cannot copy KILNTAINERS_BROKER_BINARY {}: {e}",
                Path::new(&prebuilt).display()
            )
        })
    } else if target.contains("linux") {
        build_static_broker(&target, &out_dir, &binary)
    } else {
        Err(format!(
            "the broker runs in a Linux container; target {target} is not Linux"
        ))
    };
    if let Err(reason) = outcome {
        if std::env::var_os("KILNTAINERS_REQUIRE_BROKER").is_some_and(|v| v == "1") {
            panic!("KILNTAINERS_REQUIRE_BROKER=1 and the broker could not be built: {reason}");
        }
        println!(
            "cargo:warning=secrets broker not built ({reason}); the egress proxy cannot terminate TLS"
        );
        // The server reads an empty file as "no broker in this build".
        if let Err(e) = std::fs::write(&binary, b"") {
            panic!("cannot write {}: {e}", binary.display());
        }
        println!("cargo:rustc-env=KILNTAINERS_BROKER_MISSING={reason}");
    } else {
        println!("cargo:rustc-env=KILNTAINERS_BROKER_MISSING=");
    }
}

/// The outer build's target directory, from cargo's layout of `OUT_DIR`:
/// `<target>[/<triple>]/<profile>/build/<package>-<hash>/out`.
fn outer_target_dir(out_dir: &Path, target: &str) -> Option<PathBuf> {
    let build = out_dir.ancestors().nth(2)?;
    if build.file_name()? != "build" {
        return None;
    }
    let above_profile = build.parent()?.parent()?;
    Some(if above_profile.file_name()? == target {
        above_profile.parent()?.to_path_buf()
    } else {
        above_profile.to_path_buf()
    })
}

/// What of the outer build's environment must not reach the nested one: its flags (for the
/// server, not a static binary), wrappers (`cargo clippy` sets one; a compiler cache is let
/// through, [`is_compiler_cache`]), target and target
/// directory, jobserver, and what cargo tells a build script about the outer package.
fn leaks_in(name: &str) -> bool {
    const EXACT: [&str; 22] = [
        "RUSTFLAGS",
        "RUSTDOCFLAGS",
        "RUSTC_WRAPPER",
        "RUSTC_WORKSPACE_WRAPPER",
        "CARGO_TARGET_DIR",
        "CARGO_BUILD_TARGET",
        "CARGO_BUILD_TARGET_DIR",
        "CARGO_BUILD_RUSTFLAGS",
        "CARGO_BUILD_RUSTC_WRAPPER",
        "CARGO_BUILD_RUSTC_WORKSPACE_WRAPPER",
        "CARGO_MAKEFLAGS",
        "MAKEFLAGS",
        "MFLAGS",
        "CARGO_PRIMARY_PACKAGE",
        "OUT_DIR",
        "TARGET",
        "HOST",
        "PROFILE",
        "OPT_LEVEL",
        "DEBUG",
        "NUM_JOBS",
        "CLIPPY_ARGS",
    ];
    const PREFIXES: [&str; 8] = [
        "CARGO_ENCODED_",
        "CARGO_CFG_",
        "CARGO_FEATURE_",
        "CARGO_PKG_",
        "CARGO_MANIFEST_",
        "CARGO_CRATE_",
        "CARGO_PROFILE_",
        "__CARGO",
    ];
    EXACT.contains(&name)
        || PREFIXES.iter().any(|p| name.starts_with(p))
        || (name.starts_with("CARGO_TARGET_") && name.ends_with("_RUSTFLAGS"))
}

/// Whether `name` is a `RUSTC_WRAPPER` that is the sccache compiler cache: it changes no
/// output, so it may reach the nested build, whose dependencies a fresh checkout then finds
/// in the cache as the outer build's (docs/testing.md, "Time budget").
fn is_compiler_cache(name: &str) -> bool {
    name == "RUSTC_WRAPPER"
        && std::env::var_os(name).is_some_and(|wrapper| {
            Path::new(&wrapper)
                .file_stem()
                .is_some_and(|s| s == "sccache")
        })
}

fn build_static_broker(target: &str, out_dir: &Path, binary: &Path) -> Result<(), String> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let target_dir = outer_target_dir(out_dir, target)
        .unwrap_or_else(|| out_dir.to_path_buf())
        .join("kilntainers-broker");
    let jobs = std::env::var("NUM_JOBS").unwrap_or_else(|_| "1".to_owned());
    let mut cmd = Command::new(cargo);
    for (name, _) in std::env::vars_os() {
        if let Some(name) = name.to_str()
            && leaks_in(name)
            && !is_compiler_cache(name)
        {
            cmd.env_remove(name);
        }
    }
    cmd.args(["build", "--release", "--locked", "--quiet"])
        .args([
            "-p",
            "kilntainers-broker",
            "--target",
            target,
            "--jobs",
            &jobs,
        ])
        .arg("--manifest-path")
        .arg(format!("{WORKSPACE}/Cargo.toml"))
        .arg("--target-dir")
        .arg(&target_dir)
        .env("RUSTFLAGS", "-C target-feature=+crt-static")
        // Small, as the helper: stripped and optimised for size (4.9 MB instead of 6.6;
        // the hot crypto is aws-lc's assembly either way). No LTO: it would save 0.8 MB more
        // but make every rebuild after a change to the helper's sources five times slower.
        // Panics still unwind: a failing connection ends alone, not the proxy.
        .env("CARGO_PROFILE_RELEASE_STRIP", "symbols")
        .env("CARGO_PROFILE_RELEASE_OPT_LEVEL", "s");
    let output = cmd.output().map_err(|e| format!("cannot run cargo: {e}"))?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let reason = stderr
            .lines()
            .find(|l| l.starts_with("error"))
            .unwrap_or("cargo build failed")
            .trim()
            .to_owned();
        return Err(reason);
    }
    let built = target_dir
        .join(target)
        .join("release")
        .join("kilntainers-broker");
    std::fs::copy(&built, binary)
        .map(drop)
        .map_err(|e| format!("cannot copy {}: {e}", built.display()))
}
