//! Entry point: parse the command line, set up logging on stderr, build the backend and the
//! registry, start crash GC in the background, and run the chosen transport. Nothing else.

use std::process::ExitCode;

use tracing_subscriber::EnvFilter;

/// The log filter without `RUST_LOG`: warnings from everything, and this program's own
/// information lines, which come from the server crate, the backend crates (their targets are
/// their crate names) and the audit target (docs/decisions.md, "Environment variables").
const DEFAULT_LOG: &str = "warn,mcp_sandbox_computer_vm_for_ai=info,kilntainers_backend=info,\
kilntainers_docker=info,kilntainers_helper_client=info,kilntainers_fly=info,kilntainers_e2b=info,kilntainers_modal=info,\
kilntainers_wasm=info,kilntainers_kubernetes=info,kilntainers::audit=info";

use mcp_sandbox_computer_vm_for_ai::backends::IdleStop;
use mcp_sandbox_computer_vm_for_ai::cli::Cli;
use mcp_sandbox_computer_vm_for_ai::config::{self, Config, Transport};
use mcp_sandbox_computer_vm_for_ai::ids::InstanceId;
use mcp_sandbox_computer_vm_for_ai::jobs::{JobSettings, Jobs};
use mcp_sandbox_computer_vm_for_ai::mcp::{Surface, TaskSettings, description};
use mcp_sandbox_computer_vm_for_ai::providers;
use mcp_sandbox_computer_vm_for_ai::registry::{Registry, orphans};
use mcp_sandbox_computer_vm_for_ai::state::{self, InstanceLock};
use mcp_sandbox_computer_vm_for_ai::transport;

fn fail(message: impl std::fmt::Display) -> ExitCode {
    eprintln!("kilntainers: error: {message}");
    ExitCode::from(1)
}

/// Buffers of 256 KiB and more (request bodies, command output) are mapped and unmapped on
/// their own instead of joining a malloc arena. glibc otherwise raises that threshold after the
/// first large free, so later large buffers stay in per-thread arenas and the server's resident
/// memory keeps what a burst of 8 MiB bodies once needed (fault scenario 8 measured 110 MiB
/// retained under a 64 MiB body budget). Setting the threshold once fixes it.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn return_large_buffers_to_the_system() {
    // glibc's `M_MMAP_THRESHOLD` (malloc.h); an explicit value also turns off its adjustment.
    const M_MMAP_THRESHOLD: std::ffi::c_int = -3;
    unsafe extern "C" {
        fn mallopt(param: std::ffi::c_int, value: std::ffi::c_int) -> std::ffi::c_int;
    }
    // SAFETY: mallopt only sets an allocator parameter; called before any other thread exists.
    unsafe {
        mallopt(M_MMAP_THRESHOLD, 256 * 1024);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn return_large_buffers_to_the_system() {}

fn main() -> ExitCode {
    return_large_buffers_to_the_system();
    let (cli, warnings) = Cli::parse_with_warnings();
    for warning in warnings {
        eprintln!("kilntainers: warning: {warning}");
    }
    let config = match Config::from_cli(&cli, config::process_env) {
        Ok(config) => config,
        Err(error) => return fail(error),
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(DEFAULT_LOG));
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(filter)
        .with_ansi(false)
        .init();

    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => return fail(format!("cannot start the async runtime: {error}")),
    };
    let code = runtime.block_on(run(config));
    // Blocking stdin readers must not keep the process alive after cleanup.
    runtime.shutdown_background();
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}

async fn run(config: Config) -> i32 {
    let backend = match providers::build(&config) {
        Ok(backend) => backend,
        Err(error) => {
            eprintln!("kilntainers: error: {error}");
            return 1;
        }
    };
    if let Err(error) = backend.check_startup().await {
        eprintln!("kilntainers: error: {error}");
        return 1;
    }
    let instance = InstanceId::random();
    let state_dir = state::state_dir();
    let mut instance_lock = match state_dir
        .as_deref()
        .map(|dir| InstanceLock::acquire(dir, &instance, config.backend.name()))
    {
        Some(Ok(lock)) => Some(lock),
        Some(Err(error)) => {
            tracing::warn!(%error, "no instance lock: temporary computers of this process cannot be collected after a crash");
            None
        }
        None => None,
    };
    backend.prepare().await;
    let description = description::assemble(backend.tool_instructions(), &config.description);
    let registry = Registry::new(
        backend.clone(),
        instance.clone(),
        config.shell.clone(),
        config.limits,
        config.quotas,
    );
    // Tasks are jobs whether or not the job tools are listed (docs/tasks.md).
    let all_jobs = Jobs::new(
        backend.clone(),
        config.shell.clone(),
        JobSettings {
            max_jobs: config.jobs.max_jobs,
            default_timeout_secs: config.jobs.default_timeout_secs,
            log_limit: config.jobs.log_limit,
            output_limit: config.limits.output_limit,
        },
    );
    let jobs = config.jobs.enabled.then(|| all_jobs.clone());
    registry.set_max_checkpoints(config.checkpoints.max_per_computer);
    if let Some(after) = config.idle_stop {
        match backend.idle_stop() {
            IdleStop::Refused(message) => {
                eprintln!("kilntainers: error: {message}");
                return 1;
            }
            IdleStop::NothingToStop => {
                tracing::info!(
                    "--idle-stop: nothing to stop on the {} backend",
                    backend.kind()
                );
            }
            // A task's job keeps its computer awake like any job.
            IdleStop::Stops => registry.start_idle_stop(after, Some(all_jobs.clone())),
        }
    }
    let surface = Surface::with_secrets(
        registry,
        &description,
        config.lifecycle_tools,
        jobs,
        config.file_tools,
        config.checkpoints.enabled,
        // `computer_network` is listed when a policy is enforced or secrets are brokered (not with
        // `--no-network` or `--egress none`, whose tool list stays as it was).
        (config.egress.filters() || config.secret_book.enabled())
            .then(|| config.egress.policy.clone()),
        // `secret_request` puts what people enter into the book the backend brokers from.
        config.secrets.tools.then(|| config.secret_book.clone()),
    );
    surface.enable_secrets(config.secret_book.clone());
    surface.enable_tasks(
        all_jobs,
        TaskSettings {
            after: config.tasks.after,
            ttl: config.tasks.ttl,
        },
    );

    if backend.warm_pool().is_some() {
        let (backend, instance) = (backend.clone(), instance.clone());
        tokio::spawn(async move { backend.keep_warm(&instance).await });
    }
    let state_dir_for_token = state_dir.clone();
    // Crash GC (and the eager backend check) never delays MCP traffic.
    match state_dir {
        Some(dir) => {
            tokio::spawn(async move { orphans::collect(backend, &dir, &instance).await });
        }
        None if backend.validates_eagerly() => {
            tokio::spawn(async move { backend.validate().await });
        }
        None => {}
    }
    let lifecycle = if config.lifecycle_tools { "on" } else { "off" };
    // The line stays the reference's when the job switch is off.
    let job_tools = if config.jobs.enabled {
        ", job tools: on"
    } else {
        ""
    };
    let file_tools = match (config.file_tools, config.checkpoints.enabled) {
        (true, true) => ", file tools: on, checkpoint tools: on",
        (true, false) => ", file tools: on",
        (false, true) => ", checkpoint tools: on",
        (false, false) => "",
    };
    let code = match &config.transport {
        Transport::Stdio => {
            eprintln!(
                "kilntainers: mcp-sandbox-computer-vm-for-ai {} serving stdio (backend: {}, lifecycle tools: {lifecycle}{job_tools}{file_tools})",
                env!("CARGO_PKG_VERSION"),
                config.backend.name()
            );
            transport::stdio::serve(surface).await
        }
        Transport::Http(http) => {
            let options = transport::http::ServeOptions {
                backend: config.backend.name(),
                lifecycle_tools: config.lifecycle_tools,
                default_call_timeout: std::time::Duration::from_secs(
                    config.limits.default_timeout_secs,
                ),
                state_dir: state_dir_for_token.as_deref(),
            };
            transport::http::serve(surface, http, options).await
        }
    };
    if code != 0
        && let Some(lock) = instance_lock.as_mut()
    {
        lock.keep_for_collection();
    }
    code
}
