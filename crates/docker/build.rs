//! Builds the in-computer exec helper (`helper/`) with the same `rustc` as the server but
//! statically linked (`+crt-static`), so it runs in any Linux image of our architecture; this
//! crate embeds the result with `include_bytes!`. When static linking is impossible (no static
//! C library installed), an empty file is embedded instead and the backend runs every command
//! through plain Docker exec, saying why once at startup. Nothing generated is committed; it
//! lands in `OUT_DIR`.
//!
//! Two environment variables serve release builds (scripts/build-wheel.sh, README "Releasing"):
//! `KILNTAINERS_HELPER_BINARY` embeds a helper built elsewhere (a macOS build cannot link a
//! Linux binary itself, and the helper must match the containers' architecture, not the
//! host's), and `KILNTAINERS_REQUIRE_HELPER=1` turns "no helper" into a build failure, so a
//! published artifact never silently lacks it.
//!
//! It also builds the broker (`broker/`: the egress proxy with TLS termination for secrets
//! brokering, docs/egress.md), which needs rustls and so cannot be built with plain rustc: a
//! nested `cargo build --release --locked -p kilntainers-broker`, static (`+crt-static`), in a
//! target directory of its own beside the outer one (`<target>/kilntainers-broker`, shared by
//! debug, test and clippy builds, so only the first one pays for it), with the outer build's
//! flags, wrappers and jobserver kept out. `KILNTAINERS_BROKER_BINARY` embeds one built
//! elsewhere; `KILNTAINERS_REQUIRE_BROKER=1` makes "no broker" a build failure. Without one the
//! proxy's image carries the helper and secrets cannot be brokered, which the server says at
//! startup (`broker_available`).

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    exec_helper();
    broker();
}

/// Where the embedded helper lands; `src/helper/binary.rs` includes it.
const HELPER_OUT: &str = "kilntainers-helper";

/// The helper's sources, from this crate's directory (build scripts run there).
const HELPER_SRC: &str = "../../helper/src";

fn exec_helper() {
    println!("cargo:rerun-if-changed={HELPER_SRC}");
    println!("cargo:rerun-if-env-changed=KILNTAINERS_HELPER_BINARY");
    println!("cargo:rerun-if-env-changed=KILNTAINERS_REQUIRE_HELPER");
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").unwrap_or_default());
    let target = std::env::var("TARGET").unwrap_or_default();
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let binary = out_dir.join(HELPER_OUT);
    let work = out_dir.join("helper-build");
    let prebuilt = std::env::var_os("KILNTAINERS_HELPER_BINARY").filter(|p| !p.is_empty());
    let outcome = if let Some(prebuilt) = prebuilt {
        println!("cargo:rerun-if-changed={}", Path::new(&prebuilt).display());
        std::fs::copy(&prebuilt, &binary).map(drop).map_err(|e| {
            format!(
                "cannot copy KILNTAINERS_HELPER_BINARY {}: {e}",
                Path::new(&prebuilt).display()
            )
        })
    } else if target.contains("linux") {
        build_static_helper(&rustc, &target, &work, &binary)
    } else {
        Err(format!(
            "the helper runs in Linux containers; target {target} is not Linux"
        ))
    };
    if let Err(reason) = outcome {
        if std::env::var_os("KILNTAINERS_REQUIRE_HELPER").is_some_and(|v| v == "1") {
            panic!("KILNTAINERS_REQUIRE_HELPER=1 and the exec helper could not be built: {reason}");
        }
        println!(
            "cargo:warning=exec helper not built ({reason}); commands will use plain Docker exec"
        );
        // The server reads an empty file as "no helper in this build".
        if let Err(e) = std::fs::write(&binary, b"") {
            panic!("cannot write {}: {e}", binary.display());
        }
        println!("cargo:rustc-env=KILNTAINERS_HELPER_MISSING={reason}");
    } else {
        println!("cargo:rustc-env=KILNTAINERS_HELPER_MISSING=");
    }
}

/// Two plain rustc runs (library, then binary), so no nested cargo and no lock on the outer
/// build's target directory.
fn build_static_helper(
    rustc: &std::ffi::OsStr,
    target: &str,
    work: &Path,
    binary: &Path,
) -> Result<(), String> {
    std::fs::create_dir_all(work).map_err(|e| format!("cannot create {}: {e}", work.display()))?;
    let common = |cmd: &mut Command| {
        cmd.args(["--edition", "2024", "--target", target])
            .args([
                "-C",
                "opt-level=s",
                "-C",
                "panic=abort",
                "-C",
                "codegen-units=1",
            ])
            .args(["-C", "target-feature=+crt-static", "-C", "debuginfo=0"])
            // The outer build's flags are for the server, not for this binary.
            .env_remove("CARGO_ENCODED_RUSTFLAGS")
            .env_remove("RUSTFLAGS");
    };
    let mut lib = Command::new(rustc);
    common(&mut lib);
    lib.args(["--crate-type", "rlib", "--crate-name", "kilntainers_helper"])
        .arg("--out-dir")
        .arg(work)
        .arg(format!("{HELPER_SRC}/lib.rs"));
    run(lib)?;
    let mut bin = Command::new(rustc);
    common(&mut bin);
    bin.args([
        "--crate-type",
        "bin",
        "--crate-name",
        "kilntainers_helper_bin",
    ])
    .args(["-C", "strip=symbols"])
    .arg("--extern")
    .arg(format!(
        "kilntainers_helper={}",
        work.join("libkilntainers_helper.rlib").display()
    ))
    .arg("-o")
    .arg(binary)
    .arg(format!("{HELPER_SRC}/main.rs"));
    run(bin)
}

fn run(mut cmd: Command) -> Result<(), String> {
    let output = cmd.output().map_err(|e| format!("cannot run rustc: {e}"))?;
    if output.status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&output.stderr);
    // The linker's complaint is the useful line (usually a missing static libc).
    let reason = stderr
        .lines()
        .find(|l| l.contains("cannot find") || l.starts_with("error"))
        .unwrap_or("rustc failed")
        .trim()
        .to_owned();
    Err(reason)
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
/// server, not a static binary), wrappers (`cargo clippy` sets one), target and target
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
