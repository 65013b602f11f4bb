//! wasmtime for both WASM backends (docs/decisions.md, "WebAssembly runtime"): one engine per process with
//! epoch interruption (ticked every 100 ms; the guest yields to the async executor on every
//! tick, so the exec timer and cancellation can always drop it), fuel only when `--wasm-fuel`
//! is set, a memory limit per store, and the compiled module cached on disk as `.cwasm`.
//!
//! One [`Runtime::run`] is one WASI command-module instance: argv, env, stdin bytes, a root
//! preopen `/` and a working-directory preopen `.`, and stdout/stderr written into [`Outputs`],
//! the per-command-line buffers that count bytes against the output limit.

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use sha2::{Digest, Sha256};
use tokio::io::AsyncWrite;
use wasmtime::{
    Config, Engine, Linker, Module, Store, StoreLimits, StoreLimitsBuilder, Trap, UpdateDeadline,
};
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::p1::WasiP1Ctx;
use wasmtime_wasi::p2::pipe::MemoryInputPipe;
use wasmtime_wasi::p2::{OutputStream, Pollable, StreamError};
use wasmtime_wasi::{FsPerms, I32Exit, WasiCtxBuilder};

use super::shell::Out;

/// The wasmtime version in cache file names; a different runtime never loads our artefacts.
const WASMTIME_VERSION: &str = "48.0.8";
const EPOCH_TICK: Duration = Duration::from_millis(100);
/// The most a single guest write may hand us at once.
const WRITE_PERMIT: usize = 64 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("Failed to compile WASM module '{path}': {message}")]
    Compile { path: String, message: String },
    #[error(
        "WASM module does not export a '_start' function. Only WASI command modules are supported."
    )]
    NoStart,
    #[error("Failed to start the WASM module: {0}")]
    Setup(String),
}

/// Why a command line stopped early. The backend turns each into the fixed result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    OutputLimit,
    OutOfFuel,
}

/// The end of one module run that the command line continues after.
#[derive(Debug)]
pub enum RunEnd {
    Exit(i32),
    /// A trap other than fuel/interrupt: the message for `[kilntainers: WASM trap: …]`.
    Trap(String),
}

pub struct RuntimeOptions {
    pub max_memory_mib: u64,
    pub fuel: Option<u64>,
    pub cache_dir: Option<PathBuf>,
}

/// A compiled module plus the engine and linker to run it.
pub struct Runtime {
    engine: Engine,
    module: Module,
    linker: Linker<GuestState>,
    max_memory: usize,
    fuel: Option<u64>,
    /// `argv[0]` for every run: the module file's stem (`busybox`).
    pub stem: String,
    pub sha256: String,
}

struct GuestState {
    wasi: WasiP1Ctx,
    limits: StoreLimits,
}

fn engine(fuel: bool) -> Result<Engine, String> {
    let mut config = Config::new();
    config.epoch_interruption(true);
    config.consume_fuel(fuel);
    let engine = Engine::new(&config).map_err(|e| e.to_string())?;
    // The ticker lives as long as the process: engines are created once per backend.
    let ticker = engine.clone();
    std::thread::Builder::new()
        .name("wasm-epoch".into())
        .spawn(move || {
            loop {
                std::thread::sleep(EPOCH_TICK);
                ticker.increment_epoch();
            }
        })
        .map_err(|e| e.to_string())?;
    Ok(engine)
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

impl Runtime {
    /// Compiles (or loads the cached compilation of) the module at `path`. CPU-heavy: call it
    /// from a blocking thread.
    pub fn load(path: &Path, options: &RuntimeOptions) -> Result<Self, RuntimeError> {
        let shown = path.display().to_string();
        let compile_error = |message: String| RuntimeError::Compile {
            path: shown.clone(),
            message,
        };
        let bytes = std::fs::read(path).map_err(|e| compile_error(e.to_string()))?;
        let sha256 = sha256_hex(&bytes);
        let engine = engine(options.fuel.is_some()).map_err(compile_error)?;
        // Fuel metering changes the generated code, so it is part of the cache key.
        let cached = options.cache_dir.as_ref().map(|dir| {
            dir.join("wasm-modules").join(format!(
                "{sha256}-wasmtime-{WASMTIME_VERSION}{}.cwasm",
                if options.fuel.is_some() { "-fuel" } else { "" }
            ))
        });
        let module = match cached
            .as_deref()
            .and_then(|file| load_cached(&engine, file))
        {
            Some(module) => module,
            None => {
                let module =
                    Module::new(&engine, &bytes).map_err(|e| compile_error(format!("{e:#}")))?;
                if let Some(file) = &cached {
                    store_cached(&module, file);
                }
                module
            }
        };
        if module.get_export("_start").is_none() {
            return Err(RuntimeError::NoStart);
        }
        let mut linker: Linker<GuestState> = Linker::new(&engine);
        wasmtime_wasi::p1::add_to_linker_async(&mut linker, |state: &mut GuestState| {
            &mut state.wasi
        })
        .map_err(|e| RuntimeError::Setup(e.to_string()))?;
        let stem = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "module".into());
        Ok(Self {
            engine,
            module,
            linker,
            max_memory: usize::try_from(options.max_memory_mib.saturating_mul(1 << 20))
                .unwrap_or(usize::MAX),
            fuel: options.fuel,
            stem,
            sha256,
        })
    }

    pub fn fuel(&self) -> Option<u64> {
        self.fuel
    }

    /// Runs `_start` once. `args` excludes `argv[0]` (the stem is prepended). `fuel_left` is
    /// the command line's remaining budget, updated after the run.
    #[allow(clippy::too_many_arguments)]
    pub async fn run(
        &self,
        args: &[String],
        env: &[(String, String)],
        root: &Path,
        cwd_host: &Path,
        stdin: Vec<u8>,
        outputs: &Outputs,
        stdout: Out,
        stderr: Out,
        fuel_left: &mut Option<u64>,
    ) -> Result<Result<RunEnd, Stop>, RuntimeError> {
        let mut builder = WasiCtxBuilder::new();
        builder
            .arg(&self.stem)
            .args(args)
            .envs(env)
            .stdin(MemoryInputPipe::new(Bytes::from(stdin)))
            .stdout(outputs.stream(stdout))
            .stderr(outputs.stream(stderr));
        builder
            .preopened_dir(root, "/", FsPerms::ReadWrite)
            .and_then(|b| b.preopened_dir(cwd_host, ".", FsPerms::ReadWrite))
            .map_err(|e| RuntimeError::Setup(format!("{e:#}")))?;
        let state = GuestState {
            wasi: builder.build_p1(),
            limits: StoreLimitsBuilder::new()
                .memory_size(self.max_memory)
                .instances(4)
                .build(),
        };
        let mut store = Store::new(&self.engine, state);
        store.limiter(|state| &mut state.limits);
        let stop = outputs.stop_flag();
        store.set_epoch_deadline(1);
        store.epoch_deadline_callback(move |_| {
            Ok(if stop.load(Ordering::Relaxed) {
                UpdateDeadline::Interrupt
            } else {
                UpdateDeadline::Yield(1)
            })
        });
        if let Some(fuel) = *fuel_left {
            store
                .set_fuel(fuel)
                .map_err(|e| RuntimeError::Setup(e.to_string()))?;
        }
        let result: wasmtime::Result<()> = async {
            let instance = self
                .linker
                .instantiate_async(&mut store, &self.module)
                .await?;
            let start = instance.get_typed_func::<(), ()>(&mut store, "_start")?;
            start.call_async(&mut store, ()).await
        }
        .await;
        if fuel_left.is_some() {
            *fuel_left = Some(store.get_fuel().unwrap_or(0));
        }
        if outputs.overflowed() {
            return Ok(Err(Stop::OutputLimit));
        }
        match result {
            Ok(()) => Ok(Ok(RunEnd::Exit(0))),
            Err(error) => {
                if let Some(exit) = error.downcast_ref::<I32Exit>() {
                    return Ok(Ok(RunEnd::Exit(exit.0)));
                }
                match error.downcast_ref::<Trap>() {
                    Some(Trap::OutOfFuel) => Ok(Err(Stop::OutOfFuel)),
                    Some(trap) => Ok(Ok(RunEnd::Trap(trap.to_string()))),
                    None => Ok(Ok(RunEnd::Trap(format!("{error:#}")))),
                }
            }
        }
    }
}

fn load_cached(engine: &Engine, file: &Path) -> Option<Module> {
    if !file.is_file() {
        return None;
    }
    // SAFETY: the file is one this server wrote with `Module::serialize` under a name that
    // carries the module's sha256 and the wasmtime version; wasmtime still checks the header
    // and engine compatibility and we fall back to compiling on any error. It lives in the
    // user's own cache directory, which is as trusted as the binary's own configuration.
    match unsafe { Module::deserialize_file(engine, file) } {
        Ok(module) => Some(module),
        Err(error) => {
            tracing::warn!(file = %file.display(), %error, "ignoring unusable compiled module cache");
            None
        }
    }
}

fn store_cached(module: &Module, file: &Path) {
    let write = || -> std::io::Result<()> {
        let bytes = module.serialize().map_err(std::io::Error::other)?;
        if let Some(dir) = file.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let staging = file.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&staging, bytes)?;
        std::fs::rename(&staging, file)
    };
    if let Err(error) = write() {
        tracing::warn!(file = %file.display(), %error, "could not cache the compiled module");
    }
}

/// The output buffers of one command line: the exec's stdout and stderr (counted together
/// against the limit), the pipe between pipeline stages (bounded by the same limit), and the
/// files opened by redirections.
#[derive(Clone)]
pub struct Outputs {
    inner: Arc<Mutex<OutputsInner>>,
    stop: Arc<AtomicBool>,
}

struct OutputsInner {
    limit: u64,
    counted: u64,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    pipe: Vec<u8>,
    files: Vec<std::fs::File>,
    overflow: bool,
}

impl Outputs {
    pub fn new(limit: u64) -> Self {
        Self {
            inner: Arc::new(Mutex::new(OutputsInner {
                limit,
                counted: 0,
                stdout: Vec::new(),
                stderr: Vec::new(),
                pipe: Vec::new(),
                files: Vec::new(),
                overflow: false,
            })),
            stop: Arc::new(AtomicBool::new(false)),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, OutputsInner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn stop_flag(&self) -> Arc<AtomicBool> {
        self.stop.clone()
    }

    pub fn overflowed(&self) -> bool {
        self.lock().overflow
    }

    pub fn add_file(&self, file: std::fs::File) -> usize {
        let mut inner = self.lock();
        inner.files.push(file);
        inner.files.len() - 1
    }

    pub fn take_pipe(&self) -> Vec<u8> {
        std::mem::take(&mut self.lock().pipe)
    }

    /// The collected stdout and stderr, emptied.
    pub fn take_output(&self) -> (Vec<u8>, Vec<u8>) {
        let mut inner = self.lock();
        (
            std::mem::take(&mut inner.stdout),
            std::mem::take(&mut inner.stderr),
        )
    }

    /// Appends to a target; `false` once the limit is crossed (the guest is then stopped at
    /// its next epoch tick, and the write itself traps).
    pub fn write(&self, target: &Out, bytes: &[u8]) -> bool {
        let mut inner = self.lock();
        if inner.overflow {
            return false;
        }
        let len = bytes.len() as u64;
        match target {
            Out::Stdout | Out::Stderr => {
                inner.counted = inner.counted.saturating_add(len);
                if inner.counted > inner.limit {
                    return self.overflow(&mut inner);
                }
                if *target == Out::Stdout {
                    inner.stdout.extend_from_slice(bytes);
                } else {
                    inner.stderr.extend_from_slice(bytes);
                }
            }
            Out::Pipe => {
                if inner.pipe.len() as u64 + len > inner.limit {
                    return self.overflow(&mut inner);
                }
                inner.pipe.extend_from_slice(bytes);
            }
            Out::Null => {}
            Out::File(id) => {
                use std::io::Write;
                if let Some(file) = inner.files.get_mut(*id) {
                    // A full disk surfaces to the guest as a failed write.
                    return file.write_all(bytes).is_ok();
                }
            }
        }
        true
    }

    fn overflow(&self, inner: &mut OutputsInner) -> bool {
        inner.overflow = true;
        inner.stdout = Vec::new();
        inner.stderr = Vec::new();
        inner.pipe = Vec::new();
        self.stop.store(true, Ordering::Relaxed);
        false
    }

    fn stream(&self, target: Out) -> GuestOutput {
        GuestOutput {
            outputs: self.clone(),
            target,
        }
    }
}

/// One guest stdout/stderr handle writing into [`Outputs`].
#[derive(Clone)]
struct GuestOutput {
    outputs: Outputs,
    target: Out,
}

impl IsTerminal for GuestOutput {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for GuestOutput {
    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(self.clone())
    }

    fn async_stream(&self) -> Box<dyn AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }
}

#[async_trait::async_trait]
impl Pollable for GuestOutput {
    async fn ready(&mut self) {}
}

impl OutputStream for GuestOutput {
    fn write(&mut self, bytes: Bytes) -> Result<(), StreamError> {
        if self.outputs.write(&self.target, &bytes) {
            Ok(())
        } else if self.outputs.overflowed() {
            Err(StreamError::trap("output limit exceeded"))
        } else {
            Err(StreamError::LastOperationFailed(wasmtime::format_err!(
                "write failed"
            )))
        }
    }

    fn flush(&mut self) -> Result<(), StreamError> {
        Ok(())
    }

    fn check_write(&mut self) -> Result<usize, StreamError> {
        if self.outputs.overflowed() {
            Err(StreamError::trap("output limit exceeded"))
        } else {
            Ok(WRITE_PERMIT)
        }
    }
}

impl AsyncWrite for GuestOutput {
    fn poll_write(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        if self.outputs.write(&self.target, buf) {
            Poll::Ready(Ok(buf.len()))
        } else {
            Poll::Ready(Err(std::io::Error::other("output limit exceeded")))
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}
