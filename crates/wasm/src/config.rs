//! The WebAssembly section of the configuration: what the `--wasm-*` flags and the environment
//! (HOME, XDG_CACHE_HOME, KILNTAINERS_GO_BUSYBOX_DOWNLOAD, KILNTAINERS_PYTHON) resolve to (the
//! server's `config` module reads them), as plain data these backends are built from.

use std::path::PathBuf;

/// The interpreter whose pip fetches the go-busybox wheel; `python3` when unset.
pub const PYTHON_ENV: &str = "KILNTAINERS_PYTHON";
pub const DOWNLOAD_ENV: &str = "KILNTAINERS_GO_BUSYBOX_DOWNLOAD";

#[derive(Debug, Clone)]
pub enum WasmModule {
    /// `--backend wasm --wasm-path FILE`.
    Custom(PathBuf),
    /// `--backend go_busybox`; `explicit` = `--go-busybox-wasm`.
    GoBusybox { explicit: Option<PathBuf> },
}

#[derive(Debug, Clone)]
pub struct WasmConfig {
    pub module: WasmModule,
    pub max_memory_mib: u64,
    pub fuel: Option<u64>,
    pub shell: String,
    pub output_limit: u64,
    pub default_timeout_secs: u64,
    /// `<user cache dir>/mcp-sandbox-computer-vm-for-ai`.
    pub cache_dir: Option<PathBuf>,
    /// The state dir; permanent computers live under `wasm/<backend>/`.
    pub state_dir: Option<PathBuf>,
    /// Where temporary computers' directories go.
    pub temp_dir: PathBuf,
    pub download: bool,
    pub python: String,
}
