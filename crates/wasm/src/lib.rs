//! The WebAssembly backends (docs/decisions.md, "WebAssembly runtime"): `--backend wasm --wasm-path FILE` runs a custom
//! WASI preview-1 command module, `--backend go_busybox` runs go-busybox's applets and
//! interprets `command` strings itself ([`shell`]). Both keep each computer as a directory the
//! module sees as its root; permanent ones live under the state dir and are found again by id.
//! Temporary ones live in a per-user private directory under the OS temp dir (0700, owner
//! checked, see [`private_dir`]), never directly in the shared temp dir, and a computer whose
//! directory or `root` is a symbolic link is never used: another local user must not be able
//! to plant a computer whose root points into the victim's files.
//!
//! Files: [`runtime`] (wasmtime, limits, output capture), [`fs`] (root-confined paths),
//! [`files`] (the file tools on the root), [`fetch`] (the pinned go-busybox module), [`shell`]
//! (the command interpreter).

mod checkpoints;
pub mod config;
pub mod fetch;
mod files;
pub mod fs;
pub mod private_dir;
pub mod runtime;
pub mod shell;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::config::{WasmConfig, WasmModule};
use fetch::FetchOptions;
use fs::Root;
use kilntainers_backend::files::FileSystem;
use kilntainers_backend::ids::{ComputerId, ExecId, InstanceId, SandboxId};
use kilntainers_backend::{
    Backend, BackendError, ComputerInfo, CreateSpec, ExecEnd, ExecSpec, Found, IdleStop,
    OutputSink, Progress, Restarted, SandboxRef, SinkControl, Stream,
};
use runtime::{Outputs, RunEnd, Runtime, RuntimeOptions, Stop};
use shell::{Aborted, Host, Interpreter, Out};

const TEMP_PREFIX: &str = "kilntainers-wasm-";

/// `meta.json` in every computer directory (docs/decisions.md, "WASM computers").
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Meta {
    computer_id: String,
    temporary: bool,
    backend: String,
    image: String,
    module_sha256: String,
    created_at: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    instance: Option<String>,
}

pub struct WasmBackend {
    kind: &'static str,
    config: WasmConfig,
    /// `<temp dir>/kilntainers-wasm-<uid>`: where temporary computers live. Created on first
    /// use, checked before every use, removed again when empty.
    private_dir: PathBuf,
    runtime: tokio::sync::OnceCell<Arc<Runtime>>,
    applets: OnceLock<Vec<String>>,
}

fn provider(message: impl Into<String>) -> BackendError {
    BackendError::Provider(message.into())
}

/// Creates `path` 0700, or accepts it when it already is a real directory (a permanent
/// computer's directory left by an earlier, interrupted create). A symlink is an error.
fn reuse_or_create_private(path: &Path) -> std::io::Result<()> {
    match crate::private_dir::create_private_subdir(path) {
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            match std::fs::symlink_metadata(path)?.file_type().is_dir() {
                true => Ok(()),
                false => Err(e),
            }
        }
        other => other,
    }
}

fn random_suffix() -> String {
    use rand::RngExt;
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    (0..8)
        .map(|_| char::from(ALPHABET[rng.random_range(0..ALPHABET.len())]))
        .collect()
}

impl WasmBackend {
    pub fn new(config: &WasmConfig) -> Result<Self, BackendError> {
        let kind = match config.module {
            WasmModule::Custom(_) => "wasm",
            WasmModule::GoBusybox { .. } => "go_busybox",
        };
        let private_dir = crate::private_dir::private_temp_dir(&config.temp_dir)
            .map_err(|e| BackendError::Unavailable(e.to_string()))?;
        // Refuse at startup a private directory someone else made or opened up.
        crate::private_dir::check_private_dir(&private_dir)
            .map_err(|e| BackendError::Unavailable(e.to_string()))?;
        Ok(Self {
            kind,
            config: config.clone(),
            private_dir,
            runtime: tokio::sync::OnceCell::new(),
            applets: OnceLock::new(),
        })
    }

    fn image(&self) -> String {
        match &self.config.module {
            WasmModule::Custom(path) => path.file_name().map_or_else(
                || path.display().to_string(),
                |n| n.to_string_lossy().into_owned(),
            ),
            WasmModule::GoBusybox { explicit } => {
                explicit.as_ref().and_then(|p| p.file_name()).map_or_else(
                    || "busybox.wasm".to_owned(),
                    |n| n.to_string_lossy().into_owned(),
                )
            }
        }
    }

    /// Resolves, compiles (or loads the cached compilation of) the module, once per process.
    async fn runtime(&self) -> Result<Arc<Runtime>, BackendError> {
        self.runtime
            .get_or_try_init(|| async {
                let path = match &self.config.module {
                    WasmModule::Custom(path) => {
                        if !path.is_file() {
                            return Err(BackendError::Unavailable(format!(
                                "WASM file not found: '{}'",
                                path.display()
                            )));
                        }
                        path.clone()
                    }
                    WasmModule::GoBusybox { explicit } => fetch::resolve(&FetchOptions {
                        explicit: explicit.clone(),
                        cache_dir: self.config.cache_dir.clone(),
                        download: self.config.download,
                        python: self.config.python.clone(),
                    })
                    .await
                    .map_err(BackendError::Unavailable)?,
                };
                let options = RuntimeOptions {
                    max_memory_mib: self.config.max_memory_mib,
                    fuel: self.config.fuel,
                    cache_dir: self.config.cache_dir.clone(),
                };
                let mut loaded =
                    tokio::task::spawn_blocking(move || Runtime::load(&path, &options))
                        .await
                        .map_err(|e| BackendError::Unavailable(e.to_string()))?
                        .map_err(|e| BackendError::Unavailable(e.to_string()))?;
                if matches!(self.config.module, WasmModule::GoBusybox { .. }) {
                    // A multicall binary picks its applet from argv[0] when it is not its own
                    // name, and the cached file is `busybox-<sha prefix>.wasm`.
                    loaded.stem = "busybox".to_owned();
                }
                Ok(Arc::new(loaded))
            })
            .await
            .cloned()
    }

    fn permanent_dir(&self, id: &ComputerId) -> Option<PathBuf> {
        self.config
            .state_dir
            .as_ref()
            .map(|dir| dir.join("wasm").join(self.kind).join(id.as_str()))
    }

    /// The private directory, created when missing; refused when it is not ours alone.
    fn ensure_private_dir(&self) -> Result<(), BackendError> {
        crate::private_dir::ensure_private_dir(&self.private_dir)
            .map_err(|e| provider(e.to_string()))
    }

    /// Removes the private directory once it holds nothing (fails harmlessly otherwise).
    fn tidy_private_dir(&self) {
        let _ = std::fs::remove_dir(&self.private_dir);
    }

    /// The computer's directory (holding `meta.json` and `root/`).
    fn dir_of(&self, sandbox: &SandboxRef) -> Result<PathBuf, BackendError> {
        if sandbox.temporary {
            crate::private_dir::check_private_dir(&self.private_dir)
                .map_err(|e| provider(e.to_string()))?;
            Ok(self.private_dir.join(sandbox.sandbox_id.as_str()))
        } else {
            self.permanent_dir(&sandbox.computer_id).ok_or_else(|| {
                provider("Permanent WASM computers need a home directory (HOME is unset).")
            })
        }
    }

    /// The computer's `root`, only when both it and the computer's directory are real
    /// directories (lstat): a symlink anywhere here could point at files outside any computer.
    fn real_root(dir: &Path) -> Option<PathBuf> {
        let is_real_dir =
            |path: &Path| std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_dir());
        let root = dir.join("root");
        (is_real_dir(dir) && is_real_dir(&root)).then_some(root)
    }

    fn read_meta(dir: &Path) -> Option<Meta> {
        Self::real_root(dir)?;
        let text = std::fs::read_to_string(dir.join("meta.json")).ok()?;
        serde_json::from_str(&text).ok()
    }

    fn sandbox_of(&self, dir: &Path, meta: &Meta) -> Option<SandboxRef> {
        let computer_id = ComputerId::parse_stored(&meta.computer_id).ok()?;
        let sandbox_id = if meta.temporary {
            dir.file_name()?.to_string_lossy().into_owned()
        } else {
            format!("{TEMP_PREFIX}{}", meta.computer_id)
        };
        Some(SandboxRef {
            computer_id,
            sandbox_id: SandboxId::new(sandbox_id),
            temporary: meta.temporary,
            image: meta.image.clone(),
        })
    }

    /// Every computer of this backend on disk: (dir, meta).
    fn scan(&self) -> Vec<(PathBuf, Meta)> {
        let mut found = Vec::new();
        let mut look = |parent: &Path, temp: bool| {
            let Ok(entries) = std::fs::read_dir(parent) else {
                return;
            };
            for entry in entries.filter_map(Result::ok) {
                let name = entry.file_name().to_string_lossy().into_owned();
                if temp && !name.starts_with(TEMP_PREFIX) {
                    continue;
                }
                let dir = entry.path();
                if let Some(meta) = Self::read_meta(&dir)
                    && meta.backend == self.kind
                    && meta.temporary == temp
                {
                    found.push((dir, meta));
                }
            }
        };
        if crate::private_dir::check_private_dir(&self.private_dir).is_ok() {
            look(&self.private_dir, true);
        }
        if let Some(state) = &self.config.state_dir {
            look(&state.join("wasm").join(self.kind), false);
        }
        found
    }

    fn instructions_busybox(&self) -> String {
        let applets = match self.applets.get() {
            Some(list) if !list.is_empty() => list.join(", "),
            _ => "(the applet list could not be read: the module is not available yet)".to_owned(),
        };
        format!(
            "Execute a command in a lightweight sandbox (WebAssembly, BusyBox style). This is a multicall binary that provides common Unix utilities directly.\n\nUse the 'args' parameter to run one utility: the first arg is the command name, followed by its arguments. Examples:\n  - args=['ls', '-la']\n  - args=['grep', '-r', 'pattern', '.']\n  - args=['cat', 'file.txt']\n\nThe 'command' parameter accepts simple shell syntax interpreted by the server: quoting and escapes, pipes (|), &&, ||, ;, redirections (<, >, >>, 2>, 2>&1), cd, VAR=value prefixes, $VAR expansion, and * ? [ ] globs. Command substitution, subshells, background jobs and here-documents are not supported and give a clear error.\n\nAvailable commands: {applets}.\n\nThis is not a full Linux environment: many commands may be missing or simplified. Do not assume package managers, daemons, networking, or full GNU behavior. Files persist between calls for the life of the computer."
        )
    }

    /// Runs the module's `--list` and keeps the applet names for the tool description.
    async fn read_applets(&self) -> Result<Vec<String>, BackendError> {
        let runtime = self.runtime().await?;
        self.ensure_private_dir()?;
        let scratch = self
            .private_dir
            .join(format!("{TEMP_PREFIX}list-{}", random_suffix()));
        crate::private_dir::create_private_subdir(&scratch).map_err(|e| provider(e.to_string()))?;
        let outputs = Outputs::new(1 << 20);
        let mut fuel = runtime.fuel();
        let result = runtime
            .run(
                &["--list".to_owned()],
                &[],
                &scratch,
                &scratch,
                Vec::new(),
                &outputs,
                Out::Stdout,
                Out::Stderr,
                &mut fuel,
            )
            .await;
        let _ = std::fs::remove_dir_all(&scratch);
        self.tidy_private_dir();
        let _ = result.map_err(|e| provider(e.to_string()))?;
        let (stdout, _) = outputs.take_output();
        let text = String::from_utf8_lossy(&stdout);
        let body = text
            .split_once("Currently defined functions:")
            .map_or(text.as_ref(), |(_, rest)| rest);
        // The module prints its applets in map order; sort them for a stable description.
        let mut applets: Vec<String> = body
            .split(|c: char| c == ',' || c.is_whitespace())
            .filter(|w| !w.is_empty())
            .map(str::to_owned)
            .collect();
        applets.sort();
        applets.dedup();
        Ok(applets)
    }
}

/// The go_busybox interpreter's view of one command line's computer.
struct WasmHost<'a> {
    runtime: &'a Runtime,
    root: &'a Root,
    outputs: Outputs,
    fuel: Option<u64>,
    stop: Option<Stop>,
}

#[async_trait]
impl Host for WasmHost<'_> {
    async fn run(
        &mut self,
        argv: Vec<String>,
        env: Vec<(String, String)>,
        cwd: &str,
        stdin: Vec<u8>,
        stdout: Out,
        stderr: Out,
    ) -> Result<i32, Aborted> {
        let cwd_host = match self.root.resolve_dir(cwd) {
            Ok(path) => path,
            Err(error) => {
                self.write(
                    &stderr,
                    format!("kilntainers: {cwd}: {}\n", fs::describe(&error)).as_bytes(),
                )?;
                return Ok(1);
            }
        };
        let result = self
            .runtime
            .run(
                &argv,
                &env,
                self.root.host_path(),
                &cwd_host,
                stdin,
                &self.outputs,
                stdout,
                stderr.clone(),
                &mut self.fuel,
            )
            .await;
        match result {
            Ok(Ok(RunEnd::Exit(code))) => Ok(code),
            Ok(Ok(RunEnd::Trap(message))) => {
                self.write(
                    &stderr,
                    format!("[kilntainers: WASM trap: {message}]\n").as_bytes(),
                )?;
                Ok(1)
            }
            Ok(Err(stop)) => {
                self.stop = Some(stop);
                Err(Aborted)
            }
            Err(error) => {
                self.write(&stderr, format!("kilntainers: {error}\n").as_bytes())?;
                Ok(126)
            }
        }
    }

    fn take_pipe(&mut self) -> Vec<u8> {
        self.outputs.take_pipe()
    }

    fn write(&mut self, out: &Out, bytes: &[u8]) -> Result<(), Aborted> {
        if self.outputs.write(out, bytes) || !self.outputs.overflowed() {
            Ok(())
        } else {
            self.stop = Some(Stop::OutputLimit);
            Err(Aborted)
        }
    }

    fn open_output(&mut self, path: &str, append: bool) -> Result<usize, String> {
        self.root
            .open_output(path, append)
            .map(|file| self.outputs.add_file(file))
            .map_err(|e| fs::describe(&e))
    }

    fn read_input(&mut self, path: &str) -> Result<Vec<u8>, String> {
        self.root.read(path).map_err(|e| fs::describe(&e))
    }

    fn check_dir(&mut self, path: &str) -> Result<(), String> {
        self.root
            .resolve_dir(path)
            .map(drop)
            .map_err(|e| fs::describe(&e))
    }

    fn list_dir(&mut self, path: &str) -> Option<Vec<String>> {
        self.root.list(path)
    }
}

#[async_trait]
impl Backend for WasmBackend {
    fn kind(&self) -> &'static str {
        self.kind
    }

    fn tool_instructions(&self) -> String {
        match &self.config.module {
            WasmModule::GoBusybox { .. } => self.instructions_busybox(),
            WasmModule::Custom(_) => kilntainers_backend::generic_description(
                &format!(
                    "a WebAssembly (WASI) module `{}`; args run the module with those arguments; there is no shell",
                    self.image()
                ),
                self.config
                    .shell
                    .rsplit('/')
                    .next()
                    .unwrap_or(&self.config.shell),
                self.config.default_timeout_secs,
            ),
        }
    }

    async fn prepare(&self) {
        if matches!(self.config.module, WasmModule::GoBusybox { .. }) {
            match self.read_applets().await {
                Ok(list) => {
                    let _ = self.applets.set(list);
                }
                Err(error) => eprintln!("kilntainers: warning: {error}"),
            }
        }
    }

    async fn validate(&self) -> Result<(), BackendError> {
        self.runtime().await.map(drop)
    }

    async fn create(
        &self,
        spec: &CreateSpec,
        _: &dyn Progress,
    ) -> Result<SandboxRef, BackendError> {
        let runtime = self.runtime().await?;
        let (dir, sandbox_id) = if spec.temporary {
            let id = format!("{TEMP_PREFIX}{}", random_suffix());
            (self.private_dir.join(&id), id)
        } else {
            let dir = self.permanent_dir(&spec.computer_id).ok_or_else(|| {
                provider("Permanent WASM computers need a home directory (HOME is unset).")
            })?;
            (dir, format!("{TEMP_PREFIX}{}", spec.computer_id))
        };
        let image = spec.image.clone().unwrap_or_else(|| self.image());
        let meta = Meta {
            computer_id: spec.computer_id.as_str().to_owned(),
            temporary: spec.temporary,
            backend: self.kind.to_owned(),
            image: image.clone(),
            module_sha256: runtime.sha256.clone(),
            created_at: kilntainers_backend::clock::now_rfc3339(),
            instance: spec.temporary.then(|| spec.instance.as_str().to_owned()),
        };
        let write = || -> std::io::Result<()> {
            if spec.temporary {
                // A server removing the empty private dir at this moment costs one retry.
                let mut attempt = 0;
                loop {
                    self.ensure_private_dir().map_err(std::io::Error::other)?;
                    match crate::private_dir::create_private_subdir(&dir) {
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound && attempt == 0 => {
                            attempt += 1;
                        }
                        other => break other?,
                    }
                }
            } else {
                if let Some(parent) = dir.parent() {
                    std::fs::create_dir_all(parent)?;
                }
                reuse_or_create_private(&dir)?;
            }
            reuse_or_create_private(&dir.join("root"))?;
            let text = serde_json::to_string_pretty(&meta).map_err(std::io::Error::other)?;
            std::fs::write(dir.join("meta.json"), text)
        };
        if let Err(error) = write() {
            // Never follow a planted symlink into someone's files while cleaning up.
            if std::fs::symlink_metadata(&dir).is_ok_and(|m| m.file_type().is_dir()) {
                let _ = std::fs::remove_dir_all(&dir);
            }
            return Err(provider(format!(
                "Failed to create the directory of WASM computer '{}': {error}",
                spec.computer_id
            )));
        }
        Ok(SandboxRef {
            computer_id: spec.computer_id.clone(),
            sandbox_id: SandboxId::new(sandbox_id),
            temporary: spec.temporary,
            image,
        })
    }

    async fn lookup(&self, id: &ComputerId) -> Result<Option<Found>, BackendError> {
        if let Some(dir) = self.permanent_dir(id)
            && let Some(meta) = Self::read_meta(&dir)
            && let Some(sandbox) = self.sandbox_of(&dir, &meta)
        {
            return Ok(Some(Found {
                sandbox,
                running: true,
            }));
        }
        Ok(self
            .scan()
            .into_iter()
            .find(|(_, meta)| meta.computer_id == id.as_str())
            .and_then(|(dir, meta)| self.sandbox_of(&dir, &meta))
            .map(|sandbox| Found {
                sandbox,
                running: true,
            }))
    }

    async fn ensure_running(&self, sandbox: &SandboxRef) -> Result<SandboxRef, BackendError> {
        if Self::real_root(&self.dir_of(sandbox)?).is_some() {
            Ok(sandbox.clone())
        } else {
            Err(BackendError::Vanished(sandbox.computer_id.clone()))
        }
    }

    async fn list(&self) -> Result<Vec<ComputerInfo>, BackendError> {
        Ok(self
            .scan()
            .into_iter()
            .filter_map(|(dir, meta)| {
                let sandbox = self.sandbox_of(&dir, &meta)?;
                Some(ComputerInfo {
                    sandbox,
                    state: "running".into(),
                    created_at: Some(meta.created_at),
                })
            })
            .collect())
    }

    /// A WASM computer is a directory: nothing runs between commands.
    fn idle_stop(&self) -> IdleStop {
        IdleStop::NothingToStop
    }

    async fn restart(&self, sandbox: &SandboxRef) -> Result<Restarted, BackendError> {
        // No process survives a call, so there is nothing to restart; the root is kept.
        let sandbox = self.ensure_running(sandbox).await?;
        Ok(Restarted {
            sandbox,
            state_preserved: true,
        })
    }

    async fn remove(&self, sandbox: &SandboxRef) -> Result<(), BackendError> {
        let dir = self.dir_of(sandbox)?;
        let removed = match std::fs::symlink_metadata(&dir) {
            // A symlink in place of the directory is removed as a link, never followed.
            Ok(meta) if !meta.file_type().is_dir() => std::fs::remove_file(&dir),
            _ => std::fs::remove_dir_all(&dir),
        };
        if sandbox.temporary {
            self.tidy_private_dir();
        }
        match removed {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(provider(format!(
                "Failed to delete the directory of WASM computer '{}': {e}",
                sandbox.computer_id
            ))),
        }
    }

    fn runs_jobs_in_server(&self) -> bool {
        true
    }

    fn checkpoints(&self) -> Option<&dyn kilntainers_backend::checkpoints::Checkpoints> {
        Some(self)
    }

    fn file_system(&self) -> Option<&dyn FileSystem> {
        Some(self)
    }

    fn has_ports(&self) -> bool {
        false
    }

    async fn exec(
        &self,
        sandbox: &SandboxRef,
        spec: &ExecSpec,
        sink: &mut dyn OutputSink,
        _cancel: &CancellationToken,
    ) -> Result<ExecEnd, BackendError> {
        let runtime = self.runtime().await?;
        let Some(root_path) = Self::real_root(&self.dir_of(sandbox)?) else {
            return Err(BackendError::Vanished(sandbox.computer_id.clone()));
        };
        let root = Root::open(&root_path).map_err(|e| provider(e.to_string()))?;
        let wd = spec.working_dir.clone().unwrap_or_else(|| "/".to_owned());
        let cwd = shell::normalize("/", &wd);
        let cwd_host = root.working_dir(&wd, &cwd).map_err(provider)?;
        let base_env = vec![
            ("HOME".to_owned(), "/".to_owned()),
            ("PATH".to_owned(), "/bin:/usr/bin".to_owned()),
            ("PWD".to_owned(), cwd.clone()),
            (
                ExecId::ENV_NAME.to_owned(),
                spec.exec_id.as_str().to_owned(),
            ),
        ];
        let outputs = Outputs::new(self.config.output_limit);
        let stdin = spec.stdin.clone();
        let mut fuel = runtime.fuel();

        let stop = match (&self.config.module, &spec.command) {
            (WasmModule::GoBusybox { .. }, Some(command)) => match shell::parse(command) {
                Err(error) => {
                    sink.push(Stream::Stderr, format!("{error}\n").as_bytes());
                    return Ok(ExecEnd::Exited(2));
                }
                Ok(script) => {
                    let mut host = WasmHost {
                        runtime: &runtime,
                        root: &root,
                        outputs: outputs.clone(),
                        fuel,
                        stop: None,
                    };
                    let status = Interpreter::new(&mut host, base_env, cwd, stdin)
                        .run(&script)
                        .await;
                    match status {
                        Ok(code) => Ok(code),
                        Err(Aborted) => Err(host.stop.unwrap_or(Stop::OutputLimit)),
                    }
                }
            },
            (module, command) => {
                let argv: Vec<String> = match command {
                    None => spec.argv.clone(),
                    Some(_)
                        if self.config.shell == "/bin/bash"
                            || matches!(module, WasmModule::GoBusybox { .. }) =>
                    {
                        return Err(provider(
                            "This WASM backend does not support command mode (no shell configured). Use args mode instead, which passes arguments directly to the WASM module. Example: args=['ls', '-la'] instead of command='ls -la'. To enable command mode, run with the shell available in the WASM module (e.g., kilntainers --shell bash ...).",
                        ));
                    }
                    Some(_) => spec.argv.clone(),
                };
                let result = runtime
                    .run(
                        &argv,
                        &base_env,
                        &root_path,
                        &cwd_host,
                        stdin.unwrap_or_default(),
                        &outputs,
                        Out::Stdout,
                        Out::Stderr,
                        &mut fuel,
                    )
                    .await
                    .map_err(|e| provider(e.to_string()))?;
                match result {
                    Ok(RunEnd::Exit(code)) => Ok(code),
                    Ok(RunEnd::Trap(message)) => {
                        outputs.write(
                            &Out::Stderr,
                            format!("[kilntainers: WASM trap: {message}]\n").as_bytes(),
                        );
                        if outputs.overflowed() {
                            Err(Stop::OutputLimit)
                        } else {
                            Ok(1)
                        }
                    }
                    Err(stop) => Err(stop),
                }
            }
        };
        match stop {
            Ok(code) => {
                let (stdout, stderr) = outputs.take_output();
                for (stream, bytes) in [(Stream::Stdout, stdout), (Stream::Stderr, stderr)] {
                    if !bytes.is_empty() && sink.push(stream, &bytes) == SinkControl::Stop {
                        return Ok(ExecEnd::StoppedBySink);
                    }
                }
                Ok(ExecEnd::Exited(i64::from(code)))
            }
            Err(Stop::OutputLimit) => {
                // Tell the sink the limit was crossed; it decides the fixed result.
                let over = vec![
                    0u8;
                    usize::try_from(self.config.output_limit.saturating_add(1))
                        .unwrap_or(usize::MAX)
                ];
                let _ = sink.push(Stream::Stdout, &over);
                Ok(ExecEnd::StoppedBySink)
            }
            Err(Stop::OutOfFuel) => Ok(ExecEnd::OutOfFuel(self.config.fuel.unwrap_or(0))),
        }
    }

    async fn kill_exec(&self, _: &SandboxRef, _: &ExecId) -> Result<(), BackendError> {
        // Nothing outlives an exec: dropping its future drops the guest, blocked host calls
        // included.
        Ok(())
    }

    async fn collect_orphans(
        &self,
        dead: &HashSet<InstanceId>,
    ) -> Result<Vec<ComputerId>, BackendError> {
        let mut removed = Vec::new();
        let mut living = Vec::new();
        for (dir, meta) in self.scan() {
            let orphan = meta.temporary
                && meta
                    .instance
                    .as_deref()
                    .and_then(InstanceId::parse)
                    .is_some_and(|i| dead.contains(&i));
            if orphan
                && std::fs::remove_dir_all(&dir).is_ok()
                && let Ok(id) = ComputerId::parse_stored(&meta.computer_id)
            {
                removed.push(id);
            } else if let Ok(id) = ComputerId::parse_stored(&meta.computer_id) {
                living.push(id);
            }
        }
        // Checkpoints of temporary computers that are gone (docs/checkpoints.md).
        self.collect_orphan_checkpoints(&living);
        self.tidy_private_dir();
        Ok(removed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_suffix_is_8_lowercase_alnum() {
        let s = random_suffix();
        assert_eq!(s.len(), 8);
        assert!(
            s.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
        );
    }
}
