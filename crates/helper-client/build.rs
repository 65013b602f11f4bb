//! Builds the in-computer exec helper (`helper/`) with the same `rustc` as the server but
//! statically linked (`+crt-static`), so it runs in any Linux image of our architecture; this
//! crate embeds the result with `include_bytes!`. When static linking is impossible (no static
//! C library installed), an empty file is embedded instead and the backends run every command
//! through their plain exec, saying why once at startup. Nothing generated is committed; it
//! lands in `OUT_DIR`.
//!
//! Two environment variables serve release builds (scripts/build-wheel.sh, README "Releasing"):
//! `KILNTAINERS_HELPER_BINARY` embeds a helper built elsewhere (a macOS build cannot link a
//! Linux binary itself, and the helper must match the containers' architecture, not the
//! host's), and `KILNTAINERS_REQUIRE_HELPER=1` turns "no helper" into a build failure, so a
//! published artifact never silently lacks it.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    exec_helper();
}

/// Where the embedded helper lands; `src/binary.rs` includes it.
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
            "cargo:warning=exec helper not built ({reason}); commands will use the plain exec path"
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
