//! The WASM backends' settings (docs/decisions.md, "Backend options" and "WebAssembly runtime") as one
//! typed section. The environment (HOME, XDG_CACHE_HOME, KILNTAINERS_GO_BUSYBOX_DOWNLOAD,
//! KILNTAINERS_PYTHON) is read here once, so the backend is pure data plus I/O.

use std::path::PathBuf;

pub use kilntainers_wasm::config::*;

use crate::cli::BackendKind;
use crate::cli::Cli;

const CACHE_NAME: &str = "mcp-sandbox-computer-vm-for-ai";

pub fn from_cli(cli: &Cli, env: impl Fn(&str) -> Option<String>) -> WasmConfig {
    let module = match (&cli.backend, &cli.wasm.wasm_path) {
        (BackendKind::Wasm, Some(path)) => WasmModule::Custom(PathBuf::from(path)),
        _ => WasmModule::GoBusybox {
            explicit: cli
                .wasm
                .go_busybox_wasm
                .as_ref()
                .filter(|p| !p.is_empty())
                .map(PathBuf::from),
        },
    };
    let home = env("HOME").filter(|h| !h.is_empty()).map(PathBuf::from);
    let cache_dir = env("XDG_CACHE_HOME")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .or_else(|| home.as_ref().map(|h| h.join(".cache")))
        .map(|d| d.join(CACHE_NAME));
    WasmConfig {
        module,
        max_memory_mib: cli.wasm.wasm_max_memory.max(1).unsigned_abs(),
        fuel: cli.wasm.wasm_fuel.map(i64::unsigned_abs),
        shell: cli.shell.clone(),
        output_limit: cli.output_limit.unsigned_abs(),
        default_timeout_secs: cli.timeout.unsigned_abs(),
        cache_dir,
        state_dir: home.map(|h| h.join(crate::state::STATE_DIR_NAME)),
        temp_dir: std::env::temp_dir(),
        download: !env(DOWNLOAD_ENV).is_some_and(|v| v.trim().eq_ignore_ascii_case("false")),
        python: env(PYTHON_ENV)
            .filter(|p| !p.is_empty())
            .unwrap_or_else(|| "python3".to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_dir_and_python_from_env() {
        let cli = super::super::test_cli(&["--backend", "go_busybox"]);
        let c = from_cli(&cli, |k| match k {
            "HOME" => Some("/h".into()),
            "KILNTAINERS_PYTHON" => Some("/venv/bin/python".into()),
            "KILNTAINERS_GO_BUSYBOX_DOWNLOAD" => Some("False".into()),
            _ => None,
        });
        assert_eq!(
            c.cache_dir,
            Some(PathBuf::from("/h/.cache/mcp-sandbox-computer-vm-for-ai"))
        );
        assert_eq!(
            c.state_dir,
            Some(PathBuf::from("/h/.mcp-sandbox-computer-vm-for-ai"))
        );
        assert_eq!(c.python, "/venv/bin/python");
        assert!(!c.download);
        let c = from_cli(&cli, |k| (k == "XDG_CACHE_HOME").then(|| "/x".into()));
        assert_eq!(
            c.cache_dir,
            Some(PathBuf::from("/x/mcp-sandbox-computer-vm-for-ai"))
        );
        assert_eq!(c.python, "python3");
        assert!(c.download);
    }
}
