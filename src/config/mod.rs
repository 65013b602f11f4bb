//! The validated configuration. [`Config::from_cli`] applies docs/decisions.md, "Startup validation" in order and produces
//! one section per concern, so nothing downstream re-checks a flag (ripgrep's HiArgs).
//!
//! Below every service: it uses `cli`, `state` and the section types of the provider crates,
//! and knows neither MCP nor any provider API.

#[cfg(feature = "e2b")]
pub mod e2b;
pub mod egress;
pub mod engine;
#[cfg(feature = "fly")]
pub mod fly;
#[cfg(feature = "kubernetes")]
pub mod kubernetes;
#[cfg(feature = "modal")]
pub mod modal;
pub mod secret;
pub mod secrets;
#[cfg(feature = "wasm")]
pub mod wasm;

use std::time::Duration;

use crate::cli::BackendKind;
use crate::cli::{Cli, DEFAULT_HOST, DEFAULT_PORT, DEFAULT_SESSION_TIMEOUT, TransportChoice};
use crate::secret::Secret;
#[cfg(feature = "e2b")]
pub use e2b::E2bConfig;
pub use engine::{EngineAddress, EngineConnection, EngineTls};
#[cfg(feature = "fly")]
pub use fly::FlyConfig;
pub use kilntainers_backend::DEFAULT_IMAGE;
pub use kilntainers_backend::egress::EgressSettings;
pub use kilntainers_docker::config::{ComputerNetwork, DockerConfig, Engine};
use kilntainers_docker::run_flags::{parse_run_flags, parse_size};
#[cfg(feature = "kubernetes")]
pub use kubernetes::KubernetesConfig;
#[cfg(feature = "modal")]
pub use modal::ModalConfig;
use secret::SecretSource;
#[cfg(feature = "wasm")]
pub use wasm::{WasmConfig, WasmModule};

/// Upper bound of any command timeout (`--timeout` and the `timeout` argument): one week. A
/// longer call is almost certainly a mistake (a value in milliseconds), and a bound keeps every
/// deadline computable and every idle session eventually reapable.
pub const MAX_TIMEOUT_SECS: u64 = 604_800;

/// `--allowed-host` value that turns the Host check off.
const ANY_HOST: &str = "*";

/// A startup error; `main` prints it as `kilntainers: error: <message>` and exits 1.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

fn fail<T>(message: impl Into<String>) -> Result<T, ConfigError> {
    Err(ConfigError(message.into()))
}

/// `--max-computers-per-user` and `--max-running-per-user`; `None` = unlimited (docs/auth.md,
/// "Quotas"; enforced by the registry).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Quotas {
    pub max_computers: Option<usize>,
    pub max_running: Option<usize>,
}

impl Quotas {
    /// Whether any limit is set.
    pub fn any(self) -> bool {
        self.max_computers.is_some() || self.max_running.is_some()
    }
}

/// The checkpoint tools' switch and limit (docs/checkpoints.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckpointsConfig {
    pub enabled: bool,
    /// `--max-checkpoints`.
    pub max_per_computer: usize,
}

#[derive(Debug, Clone)]
pub struct Config {
    pub backend: BackendKind,
    pub transport: Transport,
    pub limits: ExecLimits,
    pub shell: String,
    /// False with `--no-network` or `--egress none`.
    pub network: bool,
    /// `--egress*` (docs/egress.md); open without rules unless asked.
    pub egress: EgressSettings,
    /// `--secret*` (docs/secrets.md).
    pub secrets: secrets::SecretsConfig,
    /// The secrets computers use without seeing them; empty when brokering is off.
    pub secret_book: kilntainers_backend::brokering::SecretBook,
    pub lifecycle_tools: bool,
    pub jobs: JobsConfig,
    /// `--file-tools` or `ENABLE_FILE_TOOLS=true` (docs/files.md).
    pub file_tools: bool,
    /// `--checkpoint-tools` or `ENABLE_CHECKPOINT_TOOLS=true`, and `--max-checkpoints`
    /// (docs/checkpoints.md).
    pub checkpoints: CheckpointsConfig,
    /// `--idle-stop`: how long a permanent computer may go unused before it is stopped
    /// (docs/idle-stop.md); `None` = never.
    pub idle_stop: Option<Duration>,
    /// `--task-after`, `--task-ttl` (docs/tasks.md, "Settings").
    pub tasks: TasksConfig,
    /// `--max-computers-per-user`, `--max-running-per-user` (docs/auth.md, "Quotas").
    pub quotas: Quotas,
    pub description: DescriptionConfig,
    pub docker: DockerConfig,
    #[cfg(feature = "fly")]
    pub fly: FlyConfig,
    #[cfg(feature = "e2b")]
    pub e2b: E2bConfig,
    #[cfg(feature = "modal")]
    pub modal: ModalConfig,
    #[cfg(feature = "wasm")]
    pub wasm: WasmConfig,
    #[cfg(feature = "kubernetes")]
    pub kubernetes: KubernetesConfig,
}

#[derive(Debug, Clone)]
pub enum Transport {
    Stdio,
    /// Boxed: the HTTP settings are large, and a config is made once.
    Http(Box<HttpConfig>),
}

#[derive(Debug, Clone)]
pub struct HttpConfig {
    pub host: String,
    pub port: u16,
    pub session_timeout: Duration,
    pub auth_token: Option<Secret>,
    /// `--auth-tokens-file`: named tokens, read (and checked) when the server starts.
    pub auth_tokens_file: Option<std::path::PathBuf>,
    /// `--oauth-*`: JWT access tokens of one issuer.
    pub oauth: Option<OAuthConfig>,
    /// `--allow-unauthenticated-http`: without a token, serve `/mcp` with no authentication
    /// instead of generating a token.
    pub allow_unauthenticated: bool,
    pub extra_allowed_hosts: Vec<String>,
}

/// The OAuth resource-server settings (docs/auth.md, "OAuth").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OAuthConfig {
    pub issuer: String,
    /// `None`: the listener's own `/mcp` URL.
    pub audience: Option<String>,
    pub required_scopes: Vec<String>,
    pub principal_claim: String,
    /// `--oauth-dashboard-client-id`: the web dashboard's pre-registered public client; `None`:
    /// registered dynamically when the issuer offers it.
    pub dashboard_client_id: Option<String>,
}

impl OAuthConfig {
    fn from_cli(cli: &Cli) -> Result<Option<Self>, ConfigError> {
        let Some(issuer) = cli.oauth_issuer.as_deref().map(str::trim) else {
            if cli.oauth_audience.is_some() || cli.oauth_required_scope.is_some() {
                return fail("--oauth-audience and --oauth-required-scope need --oauth-issuer.");
            }
            if cli.oauth_dashboard_client_id.is_some() {
                return fail("--oauth-dashboard-client-id needs --oauth-issuer.");
            }
            return Ok(None);
        };
        if !cfg!(feature = "oauth") {
            return fail(
                "--oauth-issuer: this build has no OAuth support; build with the `oauth` cargo feature (on by default).",
            );
        }
        check_oauth_url("--oauth-issuer", issuer)?;
        // RFC 8414 §2; and the issuer names OAuth principals as `<issuer>#<claim>`
        // (docs/auth.md), which a `#` of its own would make ambiguous.
        if issuer.contains(['?', '#']) {
            return fail(format!(
                "--oauth-issuer must be a URL without a query or fragment (no '?' or '#'), got: {issuer}"
            ));
        }
        if let Some(audience) = &cli.oauth_audience
            && audience.trim().is_empty()
        {
            return fail("--oauth-audience must not be empty.");
        }
        let claim = cli.oauth_principal_claim.trim();
        if claim.is_empty() {
            return fail("--oauth-principal-claim must name a claim.");
        }
        let dashboard_client_id = cli.oauth_dashboard_client_id.as_deref().map(str::trim);
        // RFC 6749 §A.1: a client_id is printable ASCII; it goes into the page and a URL.
        if let Some(id) = dashboard_client_id
            && (id.is_empty() || !id.chars().all(|c| c.is_ascii_graphic() || c == ' '))
        {
            return fail(
                "--oauth-dashboard-client-id must be a client id of printable ASCII characters.",
            );
        }
        Ok(Some(Self {
            issuer: issuer.to_owned(),
            audience: cli.oauth_audience.as_deref().map(|a| a.trim().to_owned()),
            required_scopes: cli
                .oauth_required_scope
                .as_deref()
                .unwrap_or_default()
                .split_whitespace()
                .map(str::to_owned)
                .collect(),
            principal_claim: claim.to_owned(),
            dashboard_client_id: dashboard_client_id.map(str::to_owned),
        }))
    }
}

/// An issuer must be `https://`, except on a loopback host (local testing): tokens and keys
/// fetched over plain HTTP could be forged by anyone on the path.
pub fn check_oauth_url(flag: &str, url: &str) -> Result<(), ConfigError> {
    let Some((scheme, rest)) = url.split_once("://") else {
        return fail(format!(
            "{flag} must be an absolute URL such as https://auth.example.com, got: {url}"
        ));
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    // `user@host` would let the text before `@` pose as the host to a reader.
    let host = if authority.contains('@') {
        ""
    } else if let Some(bracketed) = authority.strip_prefix('[') {
        bracketed.split(']').next().unwrap_or_default()
    } else {
        authority.split(':').next().unwrap_or_default()
    };
    if host.is_empty() {
        return fail(format!(
            "{flag} must be an absolute URL such as https://auth.example.com, got: {url}"
        ));
    }
    let loopback = host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    match scheme.to_ascii_lowercase().as_str() {
        "https" => Ok(()),
        "http" if loopback => Ok(()),
        _ => fail(format!(
            "{flag} must be an https:// URL (http:// is accepted only on a loopback address), got: {url}"
        )),
    }
}

/// When a `terminal_execute` of a client that declared the Tasks extension becomes a task, and
/// how long a task is kept (docs/tasks.md, "Settings").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TasksConfig {
    /// `--task-after`: how long the call waits for the command before answering with a task.
    pub after: Duration,
    /// `--task-ttl`: the time to live every task is granted.
    pub ttl: Duration,
}

/// The job switch and settings (docs/jobs.md, "Settings").
#[derive(Debug, Clone, Copy)]
pub struct JobsConfig {
    /// `--job-tools` or `ENABLE_JOB_TOOLS=true`.
    pub enabled: bool,
    pub max_jobs: u32,
    pub default_timeout_secs: u64,
    pub log_limit: u64,
}

/// Whether an `ENABLE_*_TOOLS` value turns its switch on: `true`, trimmed, any case.
fn switch_on(value: Option<&str>) -> bool {
    value.is_some_and(|v| v.trim().eq_ignore_ascii_case("true"))
}

/// The process's environment, as [`Config::from_cli`] reads it (tests pass their own).
pub fn process_env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// Server-wide exec limits; a call may override only the timeout.
#[derive(Debug, Clone, Copy)]
pub struct ExecLimits {
    pub default_timeout_secs: u64,
    pub output_limit: u64,
}

#[derive(Debug, Clone, Default)]
pub struct DescriptionConfig {
    pub override_text: Option<String>,
    pub extended_text: Option<String>,
}

impl Config {
    /// Applies every rule of docs/decisions.md, "Startup validation" in the documented order; the first failure wins.
    /// `env` reads the environment variables that are not flags of their own: the engine's
    /// (`DOCKER_HOST` and the rest), the providers', and the three `ENABLE_*_TOOLS` switches.
    pub fn from_cli(
        cli: &Cli,
        env: impl Fn(&str) -> Option<String> + Copy,
    ) -> Result<Self, ConfigError> {
        let stdio = cli.transport == TransportChoice::Stdio;
        if stdio && cli.host != DEFAULT_HOST {
            return fail(
                "--host is only valid with --transport http. In stdio mode, there is no HTTP server to bind.",
            );
        }
        if stdio && cli.port != DEFAULT_PORT {
            return fail(
                "--port is only valid with --transport http. In stdio mode, there is no HTTP server to bind.",
            );
        }
        if stdio && cli.session_timeout != DEFAULT_SESSION_TIMEOUT {
            return fail(
                "--session-timeout is only valid with --transport http. In stdio mode, the session lives as long as the process.",
            );
        }
        if stdio && !cli.allowed_host.is_empty() {
            return fail(
                "--allowed-host is only valid with --transport http. In stdio mode, there is no HTTP server to bind.",
            );
        }
        if cli.tool_instruction_override.is_some() && cli.extended_tool_instruction.is_some() {
            return fail(
                "Cannot use both --tool-instruction-override and --extended-tool-instruction. Use override to replace the description entirely, or extended to append to the backend default.",
            );
        }
        if cli.timeout < 1 {
            return fail("--timeout must be at least 1 second.");
        }
        if cli.timeout.unsigned_abs() > MAX_TIMEOUT_SECS {
            return fail(format!(
                "--timeout must be at most {MAX_TIMEOUT_SECS} seconds (one week)."
            ));
        }
        if cli.output_limit < 1 {
            return fail("--output-limit must be at least 1 byte.");
        }
        if cli.session_timeout < 1 {
            return fail("--session-timeout must be at least 1 second.");
        }
        if cli.max_jobs < 1 {
            return fail("--max-jobs must be at least 1.");
        }
        if cli.job_timeout < 0 || cli.job_timeout.unsigned_abs() > MAX_TIMEOUT_SECS {
            return fail(format!(
                "--job-timeout must be between 0 (no limit) and {MAX_TIMEOUT_SECS} seconds."
            ));
        }
        if cli.job_log_limit < 1024 * 1024 {
            return fail("--job-log-limit must be at least 1048576 bytes (1 MiB).");
        }
        let idle_stop = parse_idle_stop(&cli.idle_stop)?;
        let tasks = TasksConfig {
            after: parse_task_after(cli.task_after)?,
            ttl: parse_task_ttl(&cli.task_ttl)?,
        };
        let Ok(port) = u16::try_from(cli.port)
            .map_err(drop)
            .and_then(|p| if p == 0 { Err(()) } else { Ok(p) })
        else {
            return fail("--port must be between 1 and 65535.");
        };
        if stdio && (cli.auth_tokens_file.is_some() || cli.oauth_issuer.is_some()) {
            return fail(
                "--auth-tokens-file and --oauth-issuer are only valid with --transport http. In stdio mode, the one client is the principal 'default'.",
            );
        }
        let oauth = if stdio {
            None
        } else {
            OAuthConfig::from_cli(cli)?
        };
        // Only HTTP uses the token, so only HTTP reads its file.
        let auth_token = match stdio {
            true => None,
            false => SecretSource {
                flag: "--auth-token",
                file_flag: "--auth-token-file",
                value: cli.auth_token.as_ref(),
                file: cli.auth_token_file.as_deref(),
            }
            .resolve()?
            .filter(|t| !t.expose().is_empty()),
        };
        if !stdio
            && !matches!(cli.host.as_str(), "127.0.0.1" | "localhost" | "::1")
            && auth_token.is_none()
            && cli.auth_tokens_file.is_none()
            && oauth.is_none()
            && !cli.allow_unauthenticated_http
        {
            return fail(
                "A non-loopback HTTP listener can execute arbitrary sandbox commands. Set KILNTAINERS_AUTH_TOKEN/--auth-token, or explicitly pass --allow-unauthenticated-http behind a trusted private network.",
            );
        }
        check_backend_is_built(cli.backend)?;
        let egress = egress::from_cli(cli, env)?;
        // `--egress none` is `--no-network` (docs/egress.md, "Policy model").
        let no_network = egress.policy.mode == kilntainers_backend::egress::EgressMode::None;
        let mut docker = docker_config(cli, no_network, env)?;
        let secrets = secrets::from_cli(cli, env, &egress)?;
        let secret_book = secrets::book(&secrets, docker.state_dir.as_deref())?;
        let principals = !stdio && (cli.auth_tokens_file.is_some() || oauth.is_some());
        docker.network =
            ComputerNetwork::choose(!no_network, principals, docker.run_flags.network.is_some());
        if docker.network == ComputerNetwork::PerPrincipal && docker.engine == Engine::Podman {
            eprintln!(
                "kilntainers: warning: on Podman, principals' networks are kept apart only as reliably as Podman's network backend; Podman 4.3 with netavark 1.4 has known gaps (docs/auth.md, \"Network\")."
            );
        }
        if principals && docker.network == ComputerNetwork::EngineDefault {
            eprintln!(
                "kilntainers: warning: --docker-run-flag --network puts the computers of every principal on one network, where they can reach each other; without it each principal gets a network of its own."
            );
        }
        check_other_backend_values(cli)?;
        #[cfg(feature = "fly")]
        let fly = fly::from_cli(cli, env)?;
        #[cfg(feature = "fly")]
        if cli.backend == BackendKind::Fly {
            fly::check_sandbox_app(&fly)?;
        }
        #[cfg(feature = "e2b")]
        let e2b = e2b::from_cli(cli)?;
        #[cfg(feature = "modal")]
        let modal = modal::from_cli(cli, env)?;
        #[cfg(feature = "kubernetes")]
        let kubernetes = if cli.backend == BackendKind::Kubernetes {
            kubernetes::from_cli(cli, &docker)?
        } else {
            // The flags of an unselected backend are not checked, as for the others.
            kubernetes::from_cli(cli, &docker).unwrap_or_else(|_| KubernetesConfig {
                namespace: None,
                context: None,
                mode: kubernetes::ModeChoice::Auto,
                storage: None,
                service_account: None,
                template: None,
                warm_pool: None,
                image: docker.image.clone(),
                cpu: None,
                memory_bytes: None,
                runtime: None,
                exec_helper: docker.exec_helper,
                spares: 0,
                kubeconfig: None,
            })
        };

        let transport = if stdio {
            Transport::Stdio
        } else {
            let mut extra_allowed_hosts = cli.allowed_host.clone();
            extra_allowed_hosts.extend(Cli::allowed_hosts_from_env());
            // Without the Host check and without a token, any web page the user opens can
            // drive the server through DNS rebinding.
            if auth_token.is_none()
                && cli.auth_tokens_file.is_none()
                && oauth.is_none()
                && cli.allow_unauthenticated_http
                && extra_allowed_hosts.iter().any(|h| h.trim() == ANY_HOST)
            {
                return fail(
                    "--allowed-host '*' turns off the Host check, so /mcp needs authentication. Set KILNTAINERS_AUTH_TOKEN/--auth-token, or drop --allow-unauthenticated-http to use a generated token.",
                );
            }
            Transport::Http(Box::new(HttpConfig {
                host: cli.host.clone(),
                port,
                session_timeout: Duration::from_secs(cli.session_timeout.unsigned_abs()),
                auth_token,
                auth_tokens_file: cli.auth_tokens_file.clone(),
                oauth,
                allow_unauthenticated: cli.allow_unauthenticated_http,
                extra_allowed_hosts,
            }))
        };
        Ok(Self {
            backend: cli.backend,
            transport,
            limits: ExecLimits {
                default_timeout_secs: cli.timeout.unsigned_abs(),
                output_limit: cli.output_limit.unsigned_abs(),
            },
            shell: cli.shell.clone(),
            network: !no_network,
            egress,
            secrets,
            secret_book,
            lifecycle_tools: cli.lifecycle_tools
                || switch_on(env("ENABLE_LIFECYCLE_TOOLS").as_deref()),
            file_tools: cli.file_tools || switch_on(env("ENABLE_FILE_TOOLS").as_deref()),
            checkpoints: CheckpointsConfig {
                enabled: cli.checkpoint_tools
                    || switch_on(env("ENABLE_CHECKPOINT_TOOLS").as_deref()),
                max_per_computer: cli.max_checkpoints as usize,
            },
            idle_stop,
            tasks,
            quotas: Quotas {
                max_computers: cli.max_computers_per_user.map(|n| n as usize),
                max_running: cli.max_running_per_user.map(|n| n as usize),
            },
            jobs: JobsConfig {
                enabled: cli.job_tools || switch_on(env("ENABLE_JOB_TOOLS").as_deref()),
                max_jobs: u32::try_from(cli.max_jobs).unwrap_or(u32::MAX),
                default_timeout_secs: cli.job_timeout.unsigned_abs(),
                log_limit: cli.job_log_limit.unsigned_abs(),
            },
            description: DescriptionConfig {
                override_text: cli.tool_instruction_override.clone(),
                extended_text: cli.extended_tool_instruction.clone(),
            },
            docker,
            #[cfg(feature = "fly")]
            fly,
            #[cfg(feature = "e2b")]
            e2b,
            #[cfg(feature = "modal")]
            modal,
            #[cfg(feature = "wasm")]
            wasm: wasm::from_cli(cli, env),
            #[cfg(feature = "kubernetes")]
            kubernetes,
        })
    }
}

/// The longest `--idle-stop`: 30 days.
const MAX_IDLE_STOP: Duration = Duration::from_secs(30 * 24 * 3600);

/// `--idle-stop`: `0` (off), or a duration ([`duration_secs`]) between 1 second and 30 days.
pub fn parse_idle_stop(raw: &str) -> Result<Option<Duration>, ConfigError> {
    if raw.trim() == "0" {
        return Ok(None);
    }
    let Some(total) = duration_secs(raw) else {
        return Err(ConfigError(format!(
            "--idle-stop must be a duration such as 90s, 30m, 2h or 1h30m, or 0 to never stop; got '{raw}'."
        )));
    };
    let duration = Duration::from_secs(total);
    if duration.is_zero() || duration > MAX_IDLE_STOP {
        return Err(ConfigError(format!(
            "--idle-stop must be between 1s and 30d (or 0 to never stop); got '{raw}'."
        )));
    }
    Ok(Some(duration))
}

/// The seconds of a duration flag: whole numbers each followed by `d`, `h`, `m` or `s`,
/// largest first (`90s`, `30m`, `1h30m`); a bare number is seconds. `None` when malformed.
fn duration_secs(raw: &str) -> Option<u64> {
    let text = raw.trim();
    if text.is_empty() {
        return None;
    }
    let mut total: u64 = 0;
    let mut rest = text;
    let mut last_unit = u64::MAX;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        if digits == 0 {
            return None;
        }
        let number: u64 = rest[..digits].parse().ok()?;
        rest = &rest[digits..];
        let unit = match rest.chars().next() {
            None if total == 0 && last_unit == u64::MAX => 1,
            Some('d') => 86_400,
            Some('h') => 3_600,
            Some('m') => 60,
            Some('s') => 1,
            _ => return None,
        };
        if unit >= last_unit {
            return None;
        }
        last_unit = unit;
        rest = rest.get(1..).unwrap_or("");
        total = number
            .checked_mul(unit)
            .and_then(|secs| total.checked_add(secs))?;
    }
    Some(total)
}

/// The longest `--task-after`: what `yield_after` allows too (docs/tasks.md, "Settings").
pub const MAX_TASK_AFTER_SECS: i64 = 3600;

/// The longest `--task-ttl`: one week, the longest wall-clock limit of anything else.
const MAX_TASK_TTL: Duration = Duration::from_secs(MAX_TIMEOUT_SECS);

/// `--task-after`: whole seconds, 0 to 3600.
pub fn parse_task_after(secs: i64) -> Result<Duration, ConfigError> {
    if !(0..=MAX_TASK_AFTER_SECS).contains(&secs) {
        return Err(ConfigError(format!(
            "--task-after must be between 0 and {MAX_TASK_AFTER_SECS} seconds; got {secs}."
        )));
    }
    Ok(Duration::from_secs(secs.unsigned_abs()))
}

/// `--task-ttl`: a duration ([`duration_secs`]) between 1 second and 7 days.
pub fn parse_task_ttl(raw: &str) -> Result<Duration, ConfigError> {
    let Some(total) = duration_secs(raw) else {
        return Err(ConfigError(format!(
            "--task-ttl must be a duration such as 90s, 30m, 1h or 2d; got '{raw}'."
        )));
    };
    let duration = Duration::from_secs(total);
    if duration.is_zero() || duration > MAX_TASK_TTL {
        return Err(ConfigError(format!(
            "--task-ttl must be between 1s and 7d; got '{raw}'."
        )));
    }
    Ok(duration)
}

/// A backend left out of this build fails at startup with one clear line rather than at the
/// first tool call.
fn check_backend_is_built(backend: BackendKind) -> Result<(), ConfigError> {
    backend.not_built().map_or(Ok(()), fail)
}

fn docker_config(
    cli: &Cli,
    no_network: bool,
    env: impl Fn(&str) -> Option<String>,
) -> Result<DockerConfig, ConfigError> {
    let engine = match cli.docker.engine.as_str() {
        "docker" => Engine::Docker,
        "podman" => Engine::Podman,
        other => {
            return fail(format!(
                "--engine must be 'docker' or 'podman'; got '{other}'. Other engines can be used through --docker-host with a Docker-compatible API socket."
            ));
        }
    };
    let nano_cpus = match &cli.docker.cpu {
        None => None,
        Some(text) => match text.trim().parse::<f64>() {
            Ok(cpus) if cpus > 0.0 && cpus.is_finite() => Some((cpus * 1e9).round() as i64),
            _ => {
                return fail(format!(
                    "--cpu must be a positive number like \"1.5\"; got '{text}'."
                ));
            }
        },
    };
    let memory_bytes = match &cli.docker.memory {
        None => None,
        Some(text) => match parse_size(text) {
            Some(bytes) if bytes > 0 => Some(bytes),
            _ => {
                return fail(format!(
                    "--memory must be a size like \"512m\" or \"2g\"; got '{text}'."
                ));
            }
        },
    };
    let run_flags = parse_run_flags(&cli.docker.docker_run_flag, no_network)
        .map_err(|e| ConfigError(e.to_string()))?;
    if cli.docker.pull_timeout < 1 {
        return fail("--pull-timeout must be at least 1 second.");
    }
    // Only the docker backend connects; a stray DOCKER_TLS_VERIFY must not stop the others.
    let connection = if cli.backend == BackendKind::Docker {
        engine::connection(engine, &cli.docker, &env, engine::current_uid())?
    } else {
        EngineConnection::unused()
    };
    let mut security_opts = Vec::new();
    if !cli.docker.allow_new_privileges {
        security_opts.push("no-new-privileges:true".to_owned());
    }
    security_opts.extend(cli.docker.security_opt.iter().cloned());
    Ok(DockerConfig {
        engine,
        connection,
        pull_timeout: Duration::from_secs(cli.docker.pull_timeout.unsigned_abs()),
        image: cli
            .docker
            .image
            .clone()
            .unwrap_or_else(|| DEFAULT_IMAGE.to_owned()),
        nano_cpus,
        memory_bytes,
        run_flags,
        pids_limit: (cli.docker.pids_limit > 0).then_some(cli.docker.pids_limit),
        security_opts,
        runtime: cli.docker.runtime.clone(),
        exec_helper: cli.docker.exec_helper == crate::cli::ExecHelperChoice::On,
        warm_pool: usize::from(cli.docker.warm_pool),
        // Decided once the transport's principals are known (`Config::from_cli`).
        network: if no_network {
            ComputerNetwork::Disabled
        } else {
            ComputerNetwork::EngineDefault
        },
        state_dir: env("HOME")
            .filter(|h| !h.is_empty())
            .map(|h| std::path::PathBuf::from(h).join(crate::state::STATE_DIR_NAME)),
    })
}

/// Rows 17-20 of docs/decisions.md, "Startup validation": value checks of the other backends, applied only when that
/// backend is selected.
fn check_other_backend_values(cli: &Cli) -> Result<(), ConfigError> {
    let k8s_sandbox_mode = cli.kubernetes.k8s_mode == Some(crate::cli::K8sModeChoice::Sandbox)
        || cli.kubernetes.k8s_warm_pool.is_some();
    if cli.backend == BackendKind::Kubernetes && cli.docker.warm_pool > 0 && k8s_sandbox_mode {
        // In sandbox mode the cluster keeps the spares (docs/kubernetes.md, "Warm pool"); in
        // auto mode the startup check refuses it once the mode is known.
        return fail(
            "--warm-pool (KILNTAINERS_WARM_POOL) keeps spare Pods in pod mode only: in sandbox mode spare computers come from an agent-sandbox SandboxWarmPool; name it with --k8s-warm-pool, and remove --warm-pool or set it to 0.",
        );
    }
    if !matches!(cli.backend, BackendKind::Docker | BackendKind::Kubernetes)
        && cli.docker.warm_pool > 0
    {
        return fail(format!(
            "--warm-pool (KILNTAINERS_WARM_POOL) is only available with --backend docker (Docker or Podman) and --backend kubernetes (pod mode); the {} backend starts its computers itself. Remove it or set it to 0.",
            cli.backend.name()
        ));
    }
    match cli.backend {
        BackendKind::Fly => {
            if cli.fly.fly_cpus < 1 {
                return fail("--fly-cpus must be at least 1.");
            }
            if cli.fly.fly_memory < 256 {
                return fail("--fly-memory must be at least 256 MB.");
            }
            if cli.fly.fly_rootfs_size.is_some_and(|s| s < 1) {
                return fail("--fly-rootfs-size must be at least 1 GB.");
            }
        }
        BackendKind::Modal => {
            if !(1..=86_400).contains(&cli.modal.sandbox_timeout) {
                return fail("--sandbox-timeout must be between 1 and 86400 seconds.");
            }
            if cli.modal.modal_cpu <= 0.0 {
                return fail("--modal-cpu must be greater than 0.");
            }
            if cli.modal.modal_memory < 1 {
                return fail("--modal-memory must be at least 1 MiB.");
            }
        }
        BackendKind::E2b => {
            if cli.e2b.e2b_sandbox_timeout < 1 {
                return fail("--e2b-sandbox-timeout must be at least 1 second.");
            }
            for entry in &cli.e2b.e2b_metadata {
                if let Some((key, _)) = entry.split_once('=')
                    && key.starts_with("kilntainers")
                {
                    return fail(format!("--e2b-metadata key '{key}' is reserved."));
                }
            }
        }
        BackendKind::Wasm | BackendKind::GoBusybox => {
            if cli.backend == BackendKind::Wasm && cli.wasm.wasm_path.is_none() {
                return fail("--wasm-path is required for --backend wasm.");
            }
            if cli.wasm.wasm_max_memory < 1 {
                return fail("--wasm-max-memory must be at least 1 MiB.");
            }
            if cli.wasm.wasm_fuel.is_some_and(|f| f < 1) {
                return fail("--wasm-fuel must be at least 1.");
            }
        }
        BackendKind::Docker | BackendKind::Kubernetes => {}
    }
    Ok(())
}

/// Parses a command line for unit tests of the config sections.
#[cfg(test)]
pub(crate) fn test_cli(args: &[&str]) -> Cli {
    Cli::from_test_args(args).unwrap()
}

#[cfg(test)]
mod tests;
