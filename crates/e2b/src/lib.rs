//! E2B sandboxes (docs/decisions.md, "E2B sandboxes"): the REST control plane plus envd's process and file APIs, hand-rolled
//! over reqwest. Both base URLs are configurable, so self-hosted E2B-compatible services work
//! the same way as E2B's cloud. A computer is a sandbox carrying our metadata keys (docs/decisions.md, "Labels and metadata"), found again
//! by listing with a metadata filter, so permanent computers survive a server restart — while
//! their E2B lifetime lasts: every attach (`connect`) and, throttled, every exec extends it, so
//! a computer in active use does not expire.
//!
//! Restart keeps files where the service can pause: pause → resume → kill every process our
//! commands started → readiness (`state_preserved: true`). Where pausing is not offered, the
//! sandbox is killed and created again from its template, and the result says files were lost.
//!
//! Split: [`api`] (control plane, retries, error texts), [`checkpoints`] (snapshots as
//! checkpoints), [`connect`] (Connect framing),
//! [`process`] (envd process service), [`files`] (the file tools over envd's file API),
//! [`egress`] (the egress policy as E2B's network config). reqwest appears only under this folder and `fly/`.

mod api;
mod checkpoints;
pub mod config;
mod connect;
pub mod egress;
mod files;
mod process;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use tokio::sync::OnceCell;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::E2bConfig;
use api::{Api, ApiError, Connected, KEY_HINT, NewSandbox};
use kilntainers_backend::Common;
use kilntainers_backend::egress::EgressPolicy;
use kilntainers_backend::files::FileSystem;
use kilntainers_backend::ids::{ComputerId, ExecId, InstanceId, Principal, SandboxId};
use kilntainers_backend::labels::{self, e2b as meta};
use kilntainers_backend::posix::{self, KILL_SWEEP_TIMEOUT, SweepReach, shell_basename};
use kilntainers_backend::snapshots::SnapshotCheckpoints;
use kilntainers_backend::{
    Backend, BackendError, ComputerInfo, CreateSpec, ExecEnd, ExecSpec, Found, IdleStop,
    IdleStopped, OutputSink, PortRoute, Progress, Restarted, SandboxRef, SinkControl, Stream,
};
use process::{Command, Envd, EnvdVersion, RunError};

/// Readiness exec after create/attach/restart (docs/decisions.md, "Constants": E2B 10 s).
const READINESS_TIMEOUT: Duration = Duration::from_secs(10);
/// Pause between readiness attempts while envd is still coming up.
const READINESS_RETRY: Duration = Duration::from_millis(250);
/// `Connect-Timeout-Ms` of user commands. The exec layer enforces the call's own timeout and
/// kills the tree itself; this only stops a command that outlives every client (the trait does
/// not carry the per-call timeout, see docs/e2b.md): one hour plus the spec's 30 s margin.
const EXEC_DEADLINE: Duration = Duration::from_secs(3600 + 30);
/// Most often the lifetime is extended on use: a quarter of the lifetime, within these bounds,
/// so a busy computer never gets close to expiring and a quiet one costs no calls.
const EXTEND_MIN: Duration = Duration::from_secs(1);
const EXTEND_MAX: Duration = Duration::from_secs(300);

/// The E2B reference text (docs/decisions.md, "Tool descriptions"): the reference text for the default template.
const T_E2B_FIRST: &str =
    "Execute a shell command in a remote cloud sandbox (E2B). Commands run in";
const T_E2B_REST: &str = "Each call is independent — no state (shell variables, working directory) persists between calls. Use the working_directory parameter or chain commands with && to control execution context.";

/// Kills every process carrying any exec tag (restart after resume: the processes our commands
/// started, and only those).
const KILL_ALL_TAGGED: &str = "for n in 1 2; do\n  for d in /proc/[0-9]*; do\n    tr '\\0' '\\n' < \"$d/environ\" 2>/dev/null | grep -q '^KILNTAINERS_EXEC_ID=' && kill -9 \"${d#/proc/}\" 2>/dev/null\n  done\ndone\ntrue\n";

/// What we know about reaching one sandbox's envd.
#[derive(Debug, Clone)]
struct Conn {
    token: Option<String>,
    domain: Option<String>,
    /// The envd release `envdVersion` named (docs/e2b.md, "envd versions").
    envd: EnvdVersion,
    /// When the lifetime was last set; it ends `sandbox_timeout` after that.
    extended_at: Instant,
}

pub struct E2bBackend {
    config: E2bConfig,
    shell: String,
    network: bool,
    default_timeout_secs: u64,
    api: Api,
    envd_http: reqwest::Client,
    validated: OnceCell<()>,
    conns: Mutex<HashMap<String, Conn>>,
    /// Exec id → (sandbox id, pid) of commands that may still run, for `SendSignal`.
    pids: Mutex<HashMap<String, (String, u32)>>,
    /// Checkpoint records (`checkpoints`), under the state directory.
    records: SnapshotCheckpoints,
    /// The server's egress policy: new computers get it unless they narrow it.
    egress_policy: EgressPolicy,
}

impl E2bBackend {
    pub fn new(config: &E2bConfig, common: &Common) -> Result<Self, BackendError> {
        let e2b = config.clone();
        for entry in &e2b.skipped {
            eprintln!("kilntainers: warning: ignoring {entry}: expected key=value.");
        }
        let api = Api::new(&e2b.api_url, e2b.api_key.clone())?;
        let envd_http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .user_agent(concat!(
                "mcp-sandbox-computer-vm-for-ai/",
                env!("CARGO_PKG_VERSION")
            ))
            .build()
            .map_err(|e| {
                BackendError::Unavailable(format!("Cannot set up the E2B envd client: {e}"))
            })?;
        Ok(Self {
            config: e2b,
            shell: common.shell.clone(),
            network: common.network,
            default_timeout_secs: common.default_timeout_secs,
            api,
            envd_http,
            validated: OnceCell::new(),
            conns: Mutex::new(HashMap::new()),
            pids: Mutex::new(HashMap::new()),
            records: SnapshotCheckpoints::new(config.state_dir.as_deref(), "e2b"),
            egress_policy: common.egress.policy.clone(),
        })
    }

    fn conns(&self) -> std::sync::MutexGuard<'_, HashMap<String, Conn>> {
        self.conns.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn pids(&self) -> std::sync::MutexGuard<'_, HashMap<String, (String, u32)>> {
        self.pids.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lifetime(&self) -> Duration {
        Duration::from_secs(self.config.sandbox_timeout_secs)
    }

    fn remember(&self, sandbox: &api::Sandbox) {
        self.conns().insert(
            sandbox.sandbox_id.clone(),
            Conn {
                token: sandbox.envd_access_token.clone(),
                domain: sandbox.domain.clone(),
                envd: EnvdVersion::parse(sandbox.envd_version.as_deref()),
                extended_at: Instant::now(),
            },
        );
    }

    /// Validation once, cached on success (docs/decisions.md, "E2B sandboxes" validate row).
    async fn validated(&self) -> Result<(), BackendError> {
        self.validated
            .get_or_try_init(|| async {
                if self.config.api_key.is_none() {
                    return Err(BackendError::Unavailable(format!(
                        "E2B validation failed: no API key. {KEY_HINT}"
                    )));
                }
                self.api.probe().await.map_err(|e| {
                    BackendError::Unavailable(format!("E2B validation failed: {}", e.short()))
                })
            })
            .await
            .map(|_| ())
    }

    fn sandbox_from(&self, id: &ComputerId, row: &api::Listed) -> SandboxRef {
        SandboxRef {
            computer_id: id.clone(),
            sandbox_id: SandboxId::new(row.sandbox_id.clone()),
            temporary: labels::parse_temporary(row.meta(meta::TEMPORARY)),
            image: row
                .meta(meta::IMAGE)
                .map(str::to_owned)
                .unwrap_or_else(|| self.config.template.clone()),
        }
    }

    /// The live sandbox carrying `id`'s computer-id metadata (a running one if several).
    async fn find(&self, id: &ComputerId) -> Result<Option<api::Listed>, BackendError> {
        self.validated().await?;
        let filter =
            api::metadata_query(&[(meta::MANAGED, "true"), (meta::COMPUTER_ID, id.as_str())]);
        let mut rows = self.api.list(&filter).await.map_err(|e| {
            e.into_backend(format!("E2B sandbox lookup for computer '{id}' failed"))
        })?;
        rows.retain(|r| r.meta(meta::COMPUTER_ID) == Some(id.as_str()));
        rows.sort_by_key(|r| r.state.as_deref() != Some("running"));
        Ok(rows.into_iter().next())
    }

    /// `POST /sandboxes/{id}/connect`: resumes, extends the lifetime, refreshes the token.
    async fn connect(&self, sandbox: &SandboxRef) -> Result<(), BackendError> {
        match self
            .api
            .connect(
                sandbox.sandbox_id.as_str(),
                self.config.sandbox_timeout_secs,
            )
            .await
        {
            Ok(Connected::Running(found) | Connected::Resumed(found)) => {
                self.remember(&found);
                Ok(())
            }
            Err(e) if e.status() == Some(404) => {
                self.conns().remove(sandbox.sandbox_id.as_str());
                Err(BackendError::Vanished(sandbox.computer_id.clone()))
            }
            Err(e) => Err(e.into_backend(format!(
                "E2B connect to sandbox {} (computer '{}') failed",
                sandbox.sandbox_id, sandbox.computer_id
            ))),
        }
    }

    /// The envd connection for `sandbox`, connecting first if this process has none yet, and
    /// extending the lifetime when a quarter of it has passed since the last extension.
    async fn conn(&self, sandbox: &SandboxRef) -> Result<Conn, BackendError> {
        let known = self.conns().get(sandbox.sandbox_id.as_str()).cloned();
        let Some(conn) = known else {
            self.connect(sandbox).await?;
            return self
                .conns()
                .get(sandbox.sandbox_id.as_str())
                .cloned()
                .ok_or_else(|| BackendError::Vanished(sandbox.computer_id.clone()));
        };
        let every = (self.lifetime() / 4).clamp(EXTEND_MIN, EXTEND_MAX);
        if conn.extended_at.elapsed() >= every {
            match self
                .api
                .set_timeout(
                    sandbox.sandbox_id.as_str(),
                    self.config.sandbox_timeout_secs,
                )
                .await
            {
                Ok(()) => {
                    if let Some(c) = self.conns().get_mut(sandbox.sandbox_id.as_str()) {
                        c.extended_at = Instant::now();
                    }
                }
                // The exec that follows finds out what happened; say why here.
                Err(e) => {
                    warn!(sandbox_id = %sandbox.sandbox_id, error = %e.detail(), "could not extend the E2B sandbox lifetime")
                }
            }
        }
        Ok(conn)
    }

    fn envd<'a>(&'a self, sandbox_id: &'a str, conn: &'a Conn) -> Envd<'a> {
        Envd {
            http: &self.envd_http,
            base: self.config.envd_base(sandbox_id, conn.domain.as_deref()),
            sandbox_id,
            token: conn.token.as_deref(),
            version: conn.envd,
        }
    }

    /// Turns an envd failure into the trait's error, asking the control plane whether the
    /// sandbox still exists (docs/decisions.md, "E2B sandboxes" died row).
    async fn classify(&self, sandbox: &SandboxRef, error: RunError) -> BackendError {
        let (started, detail) = match error {
            RunError::Auth(text) => {
                return BackendError::Provider(format!(
                    "E2B sandbox {} (computer '{}'): {text}",
                    sandbox.sandbox_id, sandbox.computer_id
                ));
            }
            RunError::Failed { started, detail } => {
                return BackendError::Provider(format!(
                    "E2B command in sandbox {} (computer '{}') failed{}: {detail}",
                    sandbox.sandbox_id,
                    sandbox.computer_id,
                    if started { "" } else { " to start" }
                ));
            }
            RunError::Unreachable { started, detail } => (started, detail),
        };
        match self.api.get(sandbox.sandbox_id.as_str()).await {
            Ok(None) => {
                let expired = self
                    .conns()
                    .remove(sandbox.sandbox_id.as_str())
                    .is_some_and(|c| {
                        c.extended_at.elapsed() + Duration::from_secs(2) >= self.lifetime()
                    });
                if expired {
                    BackendError::Provider(format!(
                        "Sandbox {} lifetime timeout expired",
                        sandbox.sandbox_id
                    ))
                } else if started {
                    BackendError::Provider(format!(
                        "Sandbox {} died during command execution: {detail}",
                        sandbox.sandbox_id
                    ))
                } else {
                    BackendError::Vanished(sandbox.computer_id.clone())
                }
            }
            Ok(Some(row)) if row.state.as_deref() == Some("paused") => {
                BackendError::NotRunning(sandbox.sandbox_id.clone())
            }
            _ => BackendError::Provider(format!(
                "E2B envd of sandbox {} (computer '{}') is unreachable: {detail}",
                sandbox.sandbox_id, sandbox.computer_id
            )),
        }
    }

    /// Runs `argv` with no tag and collects up to 64 KiB of output (readiness, sweeps).
    async fn run_simple(
        &self,
        sandbox: &SandboxRef,
        argv: &[String],
        limit: Duration,
    ) -> Result<Collected, BackendError> {
        let conn = self.conn(sandbox).await?;
        let envd = self.envd(sandbox.sandbox_id.as_str(), &conn);
        let envs = BTreeMap::new();
        let command = Command {
            argv,
            envs: &envs,
            cwd: None,
            stdin: None,
            deadline: limit,
        };
        let mut sink = Collected::default();
        let ran = tokio::time::timeout(
            limit,
            envd.run(&command, &mut sink, &CancellationToken::new(), &mut |_| {}),
        )
        .await;
        match ran {
            Err(_) => Err(BackendError::Provider(format!(
                "E2B command in sandbox {} did not finish within {}s",
                sandbox.sandbox_id,
                limit.as_secs()
            ))),
            Ok(Ok(end)) => {
                sink.exit_code = match end {
                    ExecEnd::Exited(code) => code,
                    // Only WASM guests run on fuel; envd never ends a command this way.
                    ExecEnd::StoppedBySink | ExecEnd::OutOfFuel(_) => 0,
                };
                Ok(sink)
            }
            Ok(Err(error)) => Err(self.classify(sandbox, error).await),
        }
    }

    /// `<shell> -c "echo kilntainers-ready"` must print the marker (docs/decisions.md, "E2B sandboxes" create row).
    async fn readiness(&self, sandbox: &SandboxRef) -> Result<(), BackendError> {
        let argv = posix::readiness_argv(&self.shell);
        let deadline = Instant::now() + READINESS_TIMEOUT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self
                .run_simple(sandbox, &argv, left.max(Duration::from_secs(1)))
                .await
            {
                Ok(out) if posix::shows_ready(&out.stdout) => {
                    return Ok(());
                }
                Ok(_) => {
                    return Err(BackendError::Provider(format!(
                        "Sandbox started but readiness check failed (unexpected output). Shell '{}' may not be available in the template. Use --shell /bin/sh for templates without bash.",
                        self.shell
                    )));
                }
                Err(error @ (BackendError::Unavailable(_) | BackendError::Vanished(_))) => {
                    return Err(error);
                }
                Err(error) if Instant::now() + READINESS_RETRY >= deadline => {
                    return Err(BackendError::Provider(format!(
                        "Sandbox readiness check failed: {error}"
                    )));
                }
                Err(_) => tokio::time::sleep(READINESS_RETRY).await,
            }
        }
    }

    async fn create_sandbox(
        &self,
        spec: &CreateSpec,
        progress: &dyn Progress,
    ) -> Result<SandboxRef, BackendError> {
        self.create_sandbox_from(spec, None, progress).await
    }

    /// Creates the computer of `spec` from its template, or from `snapshot` (a checkpoint) with
    /// the template still recorded as its image.
    async fn create_sandbox_from(
        &self,
        spec: &CreateSpec,
        snapshot: Option<&str>,
        progress: &dyn Progress,
    ) -> Result<SandboxRef, BackendError> {
        self.validated().await?;
        let id = &spec.computer_id;
        progress.report(1.0, None, format!("Creating e2b computer {id}…"));
        let template = spec
            .image
            .clone()
            .unwrap_or_else(|| self.config.template.clone());
        let mut metadata = self.config.metadata.clone();
        metadata.insert(meta::MANAGED.to_owned(), "true".to_owned());
        metadata.insert(meta::COMPUTER_ID.to_owned(), id.to_string());
        metadata.insert(
            meta::TEMPORARY.to_owned(),
            labels::format_bool(spec.temporary).to_owned(),
        );
        metadata.insert(meta::IMAGE.to_owned(), template.clone());
        if let Some(owner) = &spec.owner {
            metadata.insert(meta::OWNER.to_owned(), owner.to_string());
        }
        if spec.temporary {
            metadata.insert(meta::INSTANCE.to_owned(), spec.instance.to_string());
        }
        // E2B enforces the policy; recorded so a restart, a rollback or another server process
        // finds it again (docs/egress.md, "E2B").
        let policy = spec.egress.as_ref().unwrap_or(&self.egress_policy);
        let network = egress::network_config(policy).map_err(|why| {
            BackendError::Provider(format!(
                "Cannot create computer '{}': E2B cannot enforce its egress policy: {why}.",
                id.slug()
            ))
        })?;
        if network.is_some() {
            metadata.insert(meta::EGRESS.to_owned(), policy.to_label());
        }
        let body = NewSandbox {
            template_id: snapshot.unwrap_or(&template),
            timeout: self.config.sandbox_timeout_secs,
            secure: true,
            allow_internet_access: self.network,
            auto_pause: false,
            metadata: &metadata,
            env_vars: &self.config.env,
            network,
        };
        let created = self.api.create(&body).await.map_err(|e| match e {
            ApiError::Auth { text, .. } => BackendError::Unavailable(text),
            other => {
                BackendError::Provider(format!("Failed to create E2B sandbox: {}", other.short()))
            }
        })?;
        self.remember(&created);
        let sandbox = SandboxRef {
            computer_id: id.clone(),
            sandbox_id: SandboxId::new(created.sandbox_id.clone()),
            temporary: spec.temporary,
            image: template,
        };
        info!(computer_id = %id, sandbox_id = %sandbox.sandbox_id, "E2B sandbox created");
        progress.report(2.0, None, format!("Waiting for {id} to start…"));
        if let Err(error) = self.readiness(&sandbox).await {
            // Never leave a half-made computer behind, permanent ones included.
            if let Err(e) = self.api.kill(sandbox.sandbox_id.as_str()).await {
                warn!(sandbox_id = %sandbox.sandbox_id, error = %e.detail(), "could not kill a sandbox that failed readiness");
            }
            self.conns().remove(sandbox.sandbox_id.as_str());
            return Err(error);
        }
        Ok(sandbox)
    }

    /// Kills every process our commands started (restart after a resume, a sandbox made from
    /// a snapshot).
    async fn kill_all_tagged(&self, sandbox: &SandboxRef) -> Result<(), BackendError> {
        let argv = vec![
            self.shell.clone(),
            "-c".to_owned(),
            KILL_ALL_TAGGED.to_owned(),
        ];
        self.run_simple(sandbox, &argv, KILL_SWEEP_TIMEOUT)
            .await
            .map(drop)
    }

    async fn recreate(&self, sandbox: &SandboxRef) -> Result<Restarted, BackendError> {
        let row = self.find(&sandbox.computer_id).await?;
        let instance = row
            .as_ref()
            .and_then(|row| row.meta(meta::INSTANCE).and_then(InstanceId::parse))
            .unwrap_or_else(InstanceId::random);
        let owner = row
            .as_ref()
            .and_then(|row| row.meta(meta::OWNER).and_then(Principal::parse));
        // A narrowed policy stays the computer's.
        let egress = match &row {
            Some(row) => recorded_policy(&sandbox.computer_id, row)?,
            None => None,
        };
        self.remove_sandbox(sandbox).await?;
        let spec = CreateSpec {
            computer_id: sandbox.computer_id.clone(),
            temporary: sandbox.temporary,
            image: Some(sandbox.image.clone()),
            instance,
            owner,
            egress,
        };
        let fresh = self
            .create_sandbox(&spec, &kilntainers_backend::NoProgress)
            .await?;
        Ok(Restarted {
            sandbox: fresh,
            state_preserved: false,
        })
    }

    async fn remove_sandbox(&self, sandbox: &SandboxRef) -> Result<(), BackendError> {
        self.api
            .kill(sandbox.sandbox_id.as_str())
            .await
            .map_err(|e| {
                e.into_backend(format!(
                    "E2B kill of sandbox {} (computer '{}') failed",
                    sandbox.sandbox_id, sandbox.computer_id
                ))
            })?;
        self.conns().remove(sandbox.sandbox_id.as_str());
        Ok(())
    }
}

/// The egress policy recorded on a sandbox (docs/egress.md, "Recorded"); one the server
/// cannot read is an error for that computer, never an open computer.
fn recorded_policy(
    id: &ComputerId,
    row: &api::Listed,
) -> Result<Option<EgressPolicy>, BackendError> {
    row.meta(meta::EGRESS)
        .map(|text| {
            EgressPolicy::from_label(text)
                .map_err(|e| BackendError::Provider(format!("computer '{}': {e}", id.slug())))
        })
        .transpose()
}

/// Output of an internal command.
#[derive(Debug, Default)]
struct Collected {
    exit_code: i64,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
}

impl OutputSink for Collected {
    fn push(&mut self, stream: Stream, bytes: &[u8]) -> SinkControl {
        const CAP: usize = 64 * 1024;
        let buffer = match stream {
            Stream::Stdout => &mut self.stdout,
            Stream::Stderr => &mut self.stderr,
        };
        let room = CAP.saturating_sub(buffer.len());
        buffer.extend_from_slice(&bytes[..bytes.len().min(room)]);
        SinkControl::Continue
    }
}

#[async_trait]
impl Backend for E2bBackend {
    fn kind(&self) -> &'static str {
        "e2b"
    }

    fn tool_instructions(&self) -> String {
        let shell = shell_basename(&self.shell);
        if self.config.template == "base" {
            format!(
                "{T_E2B_FIRST} {shell}. {T_E2B_REST}\n\n{}",
                kilntainers_backend::stdin_and_timeout_paragraph(self.default_timeout_secs)
            )
        } else {
            kilntainers_backend::generic_description(
                &format!(
                    "an isolated E2B cloud sandbox from template `{}`",
                    self.config.template
                ),
                shell,
                self.default_timeout_secs,
            )
        }
    }

    /// The file tools go through envd's file API ([`files`]); appends and a few other cases
    /// fall back to the shell programs.
    fn file_system(&self) -> Option<&dyn FileSystem> {
        Some(self)
    }

    /// Snapshots as checkpoints ([`checkpoints`]).
    fn checkpoints(&self) -> Option<&dyn kilntainers_backend::checkpoints::Checkpoints> {
        Some(self)
    }

    async fn validate(&self) -> Result<(), BackendError> {
        self.validated().await
    }

    async fn egress_policy(
        &self,
        sandbox: &SandboxRef,
    ) -> Result<Option<EgressPolicy>, BackendError> {
        match self.find(&sandbox.computer_id).await? {
            Some(row) => recorded_policy(&sandbox.computer_id, &row),
            None => Err(BackendError::Vanished(sandbox.computer_id.clone())),
        }
    }

    async fn create(
        &self,
        spec: &CreateSpec,
        progress: &dyn Progress,
    ) -> Result<SandboxRef, BackendError> {
        self.create_sandbox(spec, progress).await
    }

    async fn lookup(&self, id: &ComputerId) -> Result<Option<Found>, BackendError> {
        Ok(self.find(id).await?.map(|row| Found {
            sandbox: self.sandbox_from(id, &row),
            running: row.state.as_deref() == Some("running"),
        }))
    }

    async fn ensure_running(&self, sandbox: &SandboxRef) -> Result<SandboxRef, BackendError> {
        self.connect(sandbox).await?;
        self.readiness(sandbox).await?;
        Ok(sandbox.clone())
    }

    async fn list(&self) -> Result<Vec<ComputerInfo>, BackendError> {
        self.validated().await?;
        let filter = api::metadata_query(&[(meta::MANAGED, "true")]);
        let rows = self
            .api
            .list(&filter)
            .await
            .map_err(|e| e.into_backend("E2B sandbox listing failed"))?;
        Ok(rows
            .iter()
            .filter_map(|row| {
                let id = ComputerId::parse_stored(row.meta(meta::COMPUTER_ID)?).ok()?;
                Some(ComputerInfo {
                    sandbox: self.sandbox_from(&id, row),
                    state: row.state.clone().unwrap_or_else(|| "running".to_owned()),
                    created_at: row.started_at.clone(),
                })
            })
            .collect())
    }

    async fn restart(&self, sandbox: &SandboxRef) -> Result<Restarted, BackendError> {
        self.validated().await?;
        match self.api.pause(sandbox.sandbox_id.as_str()).await {
            Ok(()) => {
                // Resume: the memory snapshot brings every process back, so kill the ones our
                // commands started; the filesystem is kept.
                self.connect(sandbox).await?;
                if let Err(error) = self.kill_all_tagged(sandbox).await {
                    warn!(sandbox_id = %sandbox.sandbox_id, %error, "could not stop old processes after resume");
                }
                self.readiness(sandbox).await?;
                Ok(Restarted {
                    sandbox: sandbox.clone(),
                    state_preserved: true,
                })
            }
            Err(e) if e.status() == Some(404) => {
                Err(BackendError::Vanished(sandbox.computer_id.clone()))
            }
            Err(ApiError::Auth { text, .. }) => Err(BackendError::Unavailable(text)),
            Err(e @ ApiError::Status { .. }) => {
                info!(sandbox_id = %sandbox.sandbox_id, error = %e.detail(), "pause not available; recreating the sandbox");
                self.recreate(sandbox).await
            }
            Err(e) => Err(e.into_backend(format!(
                "E2B pause of sandbox {} (computer '{}') failed",
                sandbox.sandbox_id, sandbox.computer_id
            ))),
        }
    }

    async fn remove(&self, sandbox: &SandboxRef) -> Result<(), BackendError> {
        self.remove_sandbox(sandbox).await
    }

    fn idle_stop(&self) -> IdleStop {
        IdleStop::Stops
    }

    /// E2B's pause: the sandbox keeps its files and memory and costs nothing until the next
    /// use resumes it ([`Backend::ensure_running`] connects, which resumes).
    async fn stop_idle(&self, sandbox: &SandboxRef) -> Result<IdleStopped, BackendError> {
        self.validated().await?;
        match self.api.pause(sandbox.sandbox_id.as_str()).await {
            Ok(()) => Ok(IdleStopped::Stopped),
            Err(e) if e.status() == Some(404) => {
                Err(BackendError::Vanished(sandbox.computer_id.clone()))
            }
            Err(e) => Err(e.into_backend(format!(
                "E2B pause of sandbox {} (computer '{}') failed",
                sandbox.sandbox_id, sandbox.computer_id
            ))),
        }
    }

    async fn exec(
        &self,
        sandbox: &SandboxRef,
        spec: &ExecSpec,
        sink: &mut dyn OutputSink,
        cancel: &CancellationToken,
    ) -> Result<ExecEnd, BackendError> {
        let conn = self.conn(sandbox).await?;
        let envd = self.envd(sandbox.sandbox_id.as_str(), &conn);
        let envs = BTreeMap::from([(
            "KILNTAINERS_EXEC_ID".to_owned(),
            spec.exec_id.as_str().to_owned(),
        )]);
        let command = Command {
            argv: &spec.argv,
            envs: &envs,
            cwd: spec.working_dir.as_deref(),
            stdin: spec.stdin.as_deref(),
            deadline: EXEC_DEADLINE,
        };
        let key = spec.exec_id.as_str().to_owned();
        let sandbox_id = sandbox.sandbox_id.clone();
        let pids = &self.pids;
        let mut on_pid = |pid: u32| {
            pids.lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(key.clone(), (sandbox_id.as_str().to_owned(), pid));
        };
        let result = envd.run(&command, sink, cancel, &mut on_pid).await;
        match result {
            Ok(end @ ExecEnd::Exited(_)) => {
                self.pids().remove(spec.exec_id.as_str());
                Ok(end)
            }
            Ok(end) => Ok(end),
            Err(error) => Err(self.classify(sandbox, error).await),
        }
    }

    /// E2B serves each port of a sandbox on a host name of its own, open to anyone who has the
    /// URL (sandboxes are created with public traffic allowed, E2B's default).
    async fn port_route(&self, sandbox: &SandboxRef, port: u16) -> Result<PortRoute, BackendError> {
        if !self.config.serves_ports() {
            return Err(BackendError::Provider(
                "Ports are not available: --e2b-envd-url has no {port} placeholder, so the sandbox's ports have no URL.".to_owned(),
            ));
        }
        let conn = self.conn(sandbox).await?;
        let url = self
            .config
            .port_base(sandbox.sandbox_id.as_str(), port, conn.domain.as_deref());
        Ok(PortRoute::Provider {
            url: format!("{}/", url.trim_end_matches('/')),
            public: true,
        })
    }

    async fn kill_exec(&self, sandbox: &SandboxRef, exec_id: &ExecId) -> Result<(), BackendError> {
        // The native signal first (docs/decisions.md, "Killing a command"), then the sweep for its descendants.
        let known = self.pids().remove(exec_id.as_str());
        if let Some((sandbox_id, pid)) = known
            && sandbox_id == sandbox.sandbox_id.as_str()
        {
            let conn = self.conns().get(sandbox.sandbox_id.as_str()).cloned();
            if let Some(conn) = conn
                && let Err(error) = self
                    .envd(sandbox.sandbox_id.as_str(), &conn)
                    .kill(pid)
                    .await
            {
                warn!(sandbox_id = %sandbox.sandbox_id, pid, ?error, "SendSignal failed");
            }
        }
        let argv = posix::kill_sweep_argv(&self.shell, exec_id, SweepReach::Tagged);
        self.run_simple(sandbox, &argv, KILL_SWEEP_TIMEOUT)
            .await
            .map(drop)
    }

    async fn collect_orphans(
        &self,
        dead: &HashSet<InstanceId>,
    ) -> Result<Vec<ComputerId>, BackendError> {
        self.validated().await?;
        let filter = api::metadata_query(&[(meta::MANAGED, "true"), (meta::TEMPORARY, "true")]);
        let rows = self
            .api
            .list(&filter)
            .await
            .map_err(|e| e.into_backend("E2B sandbox listing for cleanup failed"))?;
        let mut removed = Vec::new();
        for row in rows {
            let Some(id) = row
                .meta(meta::COMPUTER_ID)
                .and_then(|i| ComputerId::parse_stored(i).ok())
            else {
                continue;
            };
            let orphaned = row
                .meta(meta::INSTANCE)
                .and_then(InstanceId::parse)
                .is_some_and(|i| dead.contains(&i));
            if !orphaned || !labels::parse_temporary(row.meta(meta::TEMPORARY)) {
                continue;
            }
            match self.api.kill(&row.sandbox_id).await {
                Ok(()) => removed.push(id),
                Err(e) => {
                    warn!(sandbox_id = %row.sandbox_id, error = %e.detail(), "could not collect a sandbox")
                }
            }
        }
        self.records.collect_orphans(self, dead).await;
        Ok(removed)
    }
}
