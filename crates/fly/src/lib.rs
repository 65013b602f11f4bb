//! Fly Machines through the Machines REST API (docs/decisions.md, "Fly Machines"), never flyctl. A computer is a
//! Machine named by its computer id and carrying our metadata keys (docs/decisions.md, "Labels and metadata"), so the Python reference's
//! Machines and ours find each other. Owns lookup, creation (create → wait `started` →
//! readiness, destroying what it made on failure), attach, restart, destroy, inventory, the
//! lease that keeps temporary Machines alive while held, and crash GC by instance and lease.
//!
//! Split: [`auth`] (token discovery and header), [`api`] (HTTP, retries, error texts), [`app`]
//! (which Fly App), [`machines`] (wire types and thin calls), [`exec`] (commands). reqwest
//! appears only under this folder.

mod api;
mod app;
mod auth;
pub mod config;
mod exec;
mod machines;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use tokio::sync::OnceCell;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::config::FlyConfig;
use api::Api;
use kilntainers_backend::ids::{ComputerId, ExecId, InstanceId, SandboxId};
use kilntainers_backend::labels::{self, fly as meta};
use kilntainers_backend::posix::{self, KILL_SWEEP_TIMEOUT, SweepReach, shell_basename};
use kilntainers_backend::{
    Backend, BackendError, ComputerInfo, CreateSpec, ExecEnd, ExecSpec, Found, OutputSink,
    Progress, Restarted, SandboxRef,
};
use kilntainers_backend::{Common, DEFAULT_IMAGE};
use machines::{
    CreateConfig, CreateRequest, Guest, Init, Machine, Machines, RestartPolicy, Rootfs, Waited,
};

/// Fly's `/wait` is clamped to 60 s; a start waits at most two rounds (docs/decisions.md, "Fly operations")...
const WAIT_ROUNDS: u32 = 2;
/// ...and at most this long in all, which is what the "did not start" message reports.
const START_DEADLINE: Duration = Duration::from_secs(120);
/// How long a slow or unreachable Fly API may delay startup for the app check; past it the
/// server starts and the same check runs, failing closed, before the first Machine is made.
const STARTUP_CHECK_TIMEOUT: Duration = Duration::from_secs(15);
/// Readiness exec after create/start/restart (docs/decisions.md, "Constants": Fly 20 s).
const READINESS_TIMEOUT: Duration = Duration::from_secs(20);
/// Pause between readiness attempts: right after `started`, the exec endpoint may still refuse.
const READINESS_RETRY: Duration = Duration::from_millis(500);
/// Lease TTL written on temporary Machines (docs/decisions.md, "Fly leases": 900 s).
const LEASE_TTL_SECS: u64 = 900;
/// How often a holder renews its leases (docs/decisions.md, "Constants": 300 s, a third of the TTL).
const LEASE_RENEWAL: Duration = Duration::from_secs(300);
/// How often any server collects expired leases (docs/decisions.md, "Constants": 600 s).
const LEASE_GC_PERIOD: Duration = Duration::from_secs(600);
/// Grace after lease expiry before a Machine is collected (docs/decisions.md, "Crash recovery": 60 s), so a
/// holder whose renewal is merely late is not robbed.
const LEASE_GRACE_SECS: u64 = 60;

/// The reference tool text for the default image (docs/decisions.md, "Tool descriptions").
const T_FLY: &str = "Execute shell commands in an isolated Debian Fly Machine. Pass a computer_id to reconnect to a named Machine, or omit it to create a readable random ID. Temporary Machines are destroyed with their MCP session; permanent Machines persist on Fly and can be reattached later.";

pub struct FlyBackend {
    inner: Arc<FlyInner>,
}

/// Shared with the lease task, which holds it weakly.
pub(crate) struct FlyInner {
    config: FlyConfig,
    shell: String,
    default_timeout_secs: u64,
    api: Api,
    /// Resolved once; retried on the next call after a failure.
    app: OnceCell<String>,
    /// Temporary Machines this process holds (created or attached): Machine id → computer.
    held: Mutex<HashMap<String, ComputerId>>,
    maintenance_started: AtomicBool,
    stop: CancellationToken,
    me: Weak<FlyInner>,
}

impl FlyBackend {
    pub fn new(config: &FlyConfig, common: &Common) -> Result<Self, BackendError> {
        let fly = config.clone();
        if fly.cli_notice {
            eprintln!(
                "kilntainers: --fly-cli is accepted for compatibility and ignored; this server uses the Fly Machines REST API, not flyctl."
            );
        }
        if !common.network {
            eprintln!(
                "kilntainers: --no-network is not supported by the fly backend; Machines keep network access."
            );
        }
        let api = Api::new(&fly.api_url, &fly.graphql_url, fly.tokens.clone())?;
        let inner = Arc::new_cyclic(|me| FlyInner {
            config: fly,
            shell: common.shell.clone(),
            default_timeout_secs: common.default_timeout_secs,
            api,
            app: OnceCell::new(),
            held: Mutex::new(HashMap::new()),
            maintenance_started: AtomicBool::new(false),
            stop: CancellationToken::new(),
            me: me.clone(),
        });
        // Lease GC "at startup" (docs/decisions.md, "Crash recovery") needs the app; look it up in the background
        // without creating one, so starting a server never has side effects on the account.
        if tokio::runtime::Handle::try_current().is_ok() {
            let weak = Arc::downgrade(&inner);
            tokio::spawn(async move {
                let Some(inner) = weak.upgrade() else { return };
                // Through the same cell as `app()`, so a first tool call racing with this
                // waits for it instead of looking the app up twice.
                let found = inner
                    .app
                    .get_or_try_init(|| async {
                        match app::existing(&inner.api, &inner.config).await {
                            Ok(Some(app)) => Ok(app),
                            Ok(None) => Err(None),
                            Err(error) => Err(Some(error)),
                        }
                    })
                    .await;
                match found {
                    Ok(_) => inner.start_maintenance(),
                    Err(None) => {}
                    Err(Some(error)) => debug!(%error, "Fly lease cleanup at startup skipped"),
                }
            });
        }
        Ok(Self { inner })
    }
}

impl Drop for FlyBackend {
    fn drop(&mut self) {
        self.inner.stop.cancel();
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Docker Hub short names as the Machines API wants them (`debian:x` →
/// `docker.io/library/debian:x`, `user/img` → `docker.io/user/img`); references that already
/// name a registry pass unchanged.
fn api_image(image: &str) -> String {
    match image.split_once('/') {
        None => format!("docker.io/library/{image}"),
        Some((first, _)) if first.contains(['.', ':']) || first == "localhost" => image.to_owned(),
        Some(_) => format!("docker.io/{image}"),
    }
}

impl FlyInner {
    async fn app(&self) -> Result<String, BackendError> {
        let app = self
            .app
            .get_or_try_init(|| app::resolve(&self.api, &self.config))
            .await?
            .clone();
        self.start_maintenance();
        Ok(app)
    }

    fn machines<'a>(&'a self, app: &'a str) -> Machines<'a> {
        Machines {
            api: &self.api,
            app,
        }
    }

    fn held(&self) -> std::sync::MutexGuard<'_, HashMap<String, ComputerId>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The live Machine carrying `id`'s computer-id metadata (a started one if several).
    async fn find(
        &self,
        machines: &Machines<'_>,
        id: &ComputerId,
    ) -> Result<Option<Machine>, BackendError> {
        let all = machines.list().await.map_err(|e| {
            e.into_backend(format!("Fly Machine lookup for computer '{id}' failed"))
        })?;
        let mut candidates: Vec<Machine> = all
            .into_iter()
            .filter(|m| !m.is_gone() && m.metadata(meta::COMPUTER_ID) == Some(id.as_str()))
            .collect();
        candidates.sort_by_key(|m| m.state != "started");
        Ok(candidates.into_iter().next())
    }

    fn sandbox_from(&self, id: &ComputerId, machine: &Machine) -> SandboxRef {
        SandboxRef {
            computer_id: id.clone(),
            sandbox_id: SandboxId::new(machine.id.clone()),
            temporary: labels::parse_temporary(machine.metadata(meta::TEMPORARY)),
            image: machine
                .metadata(meta::IMAGE)
                .map(str::to_owned)
                .unwrap_or_else(|| self.config.image.clone()),
        }
    }

    /// Waits (at most two bounded `/wait` rounds) for `started`. `Ok(false)` = not in time.
    async fn wait_started(
        &self,
        machines: &Machines<'_>,
        sandbox: &SandboxRef,
    ) -> Result<bool, BackendError> {
        let deadline = Instant::now() + START_DEADLINE;
        for _ in 0..WAIT_ROUNDS {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            let secs = left.as_secs().clamp(1, machines::MAX_WAIT_SECS);
            match machines
                .wait(sandbox.sandbox_id.as_str(), "started", None, secs)
                .await
            {
                Ok(Waited::Reached) => return Ok(true),
                Ok(Waited::TimedOut) => continue,
                Err(e) if e.status() == Some(404) => {
                    return Err(BackendError::Vanished(sandbox.computer_id.clone()));
                }
                Err(e) => {
                    return Err(e.into_backend(format!(
                        "Fly wait for Machine {} (computer '{}') to start failed",
                        sandbox.sandbox_id, sandbox.computer_id
                    )));
                }
            }
        }
        Ok(false)
    }

    /// `<shell> -c "echo kilntainers-ready"` must print the marker (docs/decisions.md, "Execution model").
    async fn readiness(&self, sandbox: &SandboxRef) -> Result<(), BackendError> {
        let argv = posix::readiness_argv(&self.shell);
        let failed = |detail: &str| {
            BackendError::Provider(format!(
                "Fly Machine {} started but readiness failed: {detail}",
                sandbox.sandbox_id
            ))
        };
        let deadline = Instant::now() + READINESS_TIMEOUT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let attempt = exec::run_simple(
                self,
                sandbox,
                argv.clone(),
                left.max(Duration::from_secs(1)),
            )
            .await;
            match attempt {
                Ok(out) if out.exit_code == 0 && posix::shows_ready(&out.stdout) => {
                    return Ok(());
                }
                Ok(out) => {
                    let stderr = String::from_utf8_lossy(&out.stderr).trim().to_owned();
                    let stdout = String::from_utf8_lossy(&out.stdout).trim().to_owned();
                    let detail = match (stderr.is_empty(), stdout.is_empty()) {
                        (false, _) => stderr,
                        (true, false) => stdout,
                        (true, true) => format!("exit code {}", out.exit_code),
                    };
                    return Err(failed(&detail));
                }
                Err(error @ (BackendError::Unavailable(_) | BackendError::Vanished(_))) => {
                    return Err(error);
                }
                Err(error) if Instant::now() + READINESS_RETRY >= deadline => {
                    return Err(failed(&error.to_string()));
                }
                Err(_) => tokio::time::sleep(READINESS_RETRY).await,
            }
        }
    }

    fn lease_value() -> String {
        (unix_now() + LEASE_TTL_SECS).to_string()
    }

    /// Remembers a held temporary Machine (its lease is renewed from now on).
    fn hold(&self, sandbox: &SandboxRef) {
        if sandbox.temporary {
            self.held().insert(
                sandbox.sandbox_id.as_str().to_owned(),
                sandbox.computer_id.clone(),
            );
        }
    }

    async fn create(
        &self,
        spec: &CreateSpec,
        progress: &dyn Progress,
    ) -> Result<SandboxRef, BackendError> {
        let app = self.app().await?;
        let machines = self.machines(&app);
        let id = &spec.computer_id;
        if self.find(&machines, id).await?.is_some() {
            return Err(BackendError::Provider(format!(
                "Computer '{id}' already exists in Fly."
            )));
        }
        progress.report(1.0, None, format!("Creating fly computer {id}…"));
        let image = spec
            .image
            .clone()
            .unwrap_or_else(|| self.config.image.clone());
        let mut metadata = std::collections::BTreeMap::from([
            (meta::MANAGED.to_owned(), "true".to_owned()),
            (meta::COMPUTER_ID.to_owned(), id.to_string()),
            (
                meta::TEMPORARY.to_owned(),
                labels::format_bool(spec.temporary).to_owned(),
            ),
            (meta::IMAGE.to_owned(), image.clone()),
        ]);
        if let Some(owner) = &spec.owner {
            metadata.insert(meta::OWNER.to_owned(), owner.to_string());
        }
        if spec.temporary {
            metadata.insert(meta::INSTANCE.to_owned(), spec.instance.to_string());
            metadata.insert(meta::LEASE_UNTIL.to_owned(), Self::lease_value());
        }
        let request = CreateRequest {
            name: id.to_string(),
            region: self.config.region.clone(),
            config: CreateConfig {
                image: api_image(&image),
                init: Init {
                    exec: posix::keep_alive_argv(&self.shell),
                },
                guest: Guest {
                    cpu_kind: self.config.cpu_kind.to_owned(),
                    cpus: self.config.cpus,
                    memory_mb: self.config.memory_mb,
                },
                rootfs: Rootfs {
                    persist: if spec.temporary { "never" } else { "always" },
                    size_gb: self.config.rootfs_size_gb,
                },
                restart: RestartPolicy {
                    policy: if spec.temporary { "no" } else { "always" },
                },
                auto_destroy: spec.temporary,
                metadata,
            },
        };
        let machine = machines.create(&request).await.map_err(|e| {
            e.into_backend(format!(
                "Fly could not create a Machine for computer '{id}'"
            ))
        })?;
        let sandbox = SandboxRef {
            computer_id: id.clone(),
            sandbox_id: SandboxId::new(machine.id.clone()),
            temporary: spec.temporary,
            image,
        };
        info!(computer_id = %id, machine = %machine.id, "Fly Machine created");
        self.hold(&sandbox);
        progress.report(2.0, None, format!("Waiting for {id} to start…"));
        let started = async {
            if !self.wait_started(&machines, &sandbox).await? {
                return Err(BackendError::Provider(format!(
                    "Fly created computer '{id}' but it did not start within {}s.",
                    START_DEADLINE.as_secs()
                )));
            }
            self.readiness(&sandbox).await
        }
        .await;
        match started {
            Ok(()) => Ok(sandbox),
            Err(error) => {
                // Never leave a half-made computer behind, permanent ones included.
                if let Err(e) = machines.destroy(sandbox.sandbox_id.as_str()).await {
                    warn!(machine = %sandbox.sandbox_id, error = %e.detail(), "could not destroy a Machine that failed to start");
                }
                self.held().remove(sandbox.sandbox_id.as_str());
                Err(error)
            }
        }
    }

    async fn ensure_running(&self, sandbox: &SandboxRef) -> Result<SandboxRef, BackendError> {
        let app = self.app().await?;
        let machines = self.machines(&app);
        let id = &sandbox.computer_id;
        let machine = self
            .find(&machines, id)
            .await?
            .ok_or_else(|| BackendError::Vanished(id.clone()))?;
        let current = self.sandbox_from(id, &machine);
        let start_failed = |e: api::ApiError| {
            e.into_backend(format!(
                "Fly start of Machine {} (computer '{id}') failed",
                current.sandbox_id
            ))
        };
        match machine.state.as_str() {
            "started" => {}
            "stopping" => {
                let _ = machines
                    .wait(
                        current.sandbox_id.as_str(),
                        "stopped",
                        machine.version(),
                        machines::MAX_WAIT_SECS,
                    )
                    .await;
                machines
                    .start(current.sandbox_id.as_str())
                    .await
                    .map_err(start_failed)?;
            }
            "starting" | "replacing" | "updating" => {}
            _ => machines
                .start(current.sandbox_id.as_str())
                .await
                .map_err(start_failed)?,
        }
        if !self.wait_started(&machines, &current).await? {
            return Err(BackendError::Provider(format!(
                "Fly Machine {} (computer '{id}') did not start within {}s.",
                current.sandbox_id,
                START_DEADLINE.as_secs()
            )));
        }
        self.readiness(&current).await?;
        if current.temporary {
            self.hold(&current);
            if let Err(e) = machines
                .set_metadata(
                    current.sandbox_id.as_str(),
                    meta::LEASE_UNTIL,
                    &Self::lease_value(),
                )
                .await
            {
                warn!(machine = %current.sandbox_id, error = %e.detail(), "could not renew the lease");
            }
        }
        Ok(current)
    }

    async fn restart(&self, sandbox: &SandboxRef) -> Result<Restarted, BackendError> {
        let app = self.app().await?;
        let machines = self.machines(&app);
        let id = &sandbox.computer_id;
        let machine = self
            .find(&machines, id)
            .await?
            .ok_or_else(|| BackendError::Vanished(id.clone()))?;
        let current = self.sandbox_from(id, &machine);
        let result = if machine.state == "started" {
            machines.restart(current.sandbox_id.as_str()).await
        } else {
            machines.start(current.sandbox_id.as_str()).await
        };
        result.map_err(|e| match e.status() {
            Some(404) => BackendError::Vanished(id.clone()),
            _ => e.into_backend(format!(
                "Fly restart of Machine {} (computer '{id}') failed",
                current.sandbox_id
            )),
        })?;
        if !self.wait_started(&machines, &current).await? {
            return Err(BackendError::Provider(format!(
                "Fly Machine {} (computer '{id}') did not start within {}s after restart.",
                current.sandbox_id,
                START_DEADLINE.as_secs()
            )));
        }
        self.readiness(&current).await?;
        Ok(Restarted {
            // A temporary Machine's root filesystem is created with `persist: never`, which Fly
            // resets on restart; only permanent Machines keep their files.
            state_preserved: !current.temporary,
            sandbox: current,
        })
    }

    async fn remove(&self, sandbox: &SandboxRef) -> Result<(), BackendError> {
        let app = self.app().await?;
        let machines = self.machines(&app);
        machines
            .destroy(sandbox.sandbox_id.as_str())
            .await
            .map_err(|e| {
                e.into_backend(format!(
                    "Fly destroy of Machine {} (computer '{}') failed",
                    sandbox.sandbox_id, sandbox.computer_id
                ))
            })?;
        self.held().remove(sandbox.sandbox_id.as_str());
        Ok(())
    }

    async fn list(&self) -> Result<Vec<ComputerInfo>, BackendError> {
        let app = self.app().await?;
        let all = self
            .machines(&app)
            .list()
            .await
            .map_err(|e| e.into_backend("Fly Machine listing failed"))?;
        Ok(all
            .iter()
            .filter(|m| !m.is_gone())
            .filter_map(|m| {
                let id = ComputerId::parse_stored(m.metadata(meta::COMPUTER_ID)?).ok()?;
                Some(ComputerInfo {
                    sandbox: self.sandbox_from(&id, m),
                    state: m.state.clone(),
                    created_at: m.created_at.clone(),
                })
            })
            .collect())
    }

    /// Destroys temporary Machines left by dead instances (`dead`) or whose lease expired more
    /// than the grace ago. Machines this process holds, and ones without our markers, are never
    /// touched.
    async fn collect(&self, dead: &HashSet<InstanceId>) -> Result<Vec<ComputerId>, BackendError> {
        let app = self.app().await?;
        let machines = self.machines(&app);
        let all = machines
            .list()
            .await
            .map_err(|e| e.into_backend("Fly Machine listing for cleanup failed"))?;
        let now = unix_now();
        let mut removed = Vec::new();
        for machine in all.iter().filter(|m| !m.is_gone()) {
            let Some(id) = machine
                .metadata(meta::COMPUTER_ID)
                .and_then(|i| ComputerId::parse_stored(i).ok())
            else {
                continue;
            };
            let temporary = machine
                .metadata(meta::TEMPORARY)
                .is_some_and(|t| labels::parse_temporary(Some(t)));
            let orphaned = machine
                .metadata(meta::INSTANCE)
                .and_then(InstanceId::parse)
                .is_some_and(|i| dead.contains(&i));
            let expired = machine
                .metadata(meta::LEASE_UNTIL)
                .and_then(|l| l.trim().parse::<u64>().ok())
                .is_some_and(|until| until + LEASE_GRACE_SECS < now);
            if !temporary || !(orphaned || expired) || self.held().contains_key(&machine.id) {
                continue;
            }
            match machines.destroy(&machine.id).await {
                Ok(()) => removed.push(id),
                Err(e) => {
                    warn!(machine = %machine.id, error = %e.detail(), "could not collect a Machine")
                }
            }
        }
        Ok(removed)
    }

    async fn renew_leases(&self) {
        let Some(app) = self.app.get().cloned() else {
            return;
        };
        let machines = self.machines(&app);
        let held: Vec<(String, ComputerId)> = self
            .held()
            .iter()
            .map(|(m, c)| (m.clone(), c.clone()))
            .collect();
        for (machine, computer) in held {
            match machines
                .set_metadata(&machine, meta::LEASE_UNTIL, &Self::lease_value())
                .await
            {
                Ok(()) => {}
                Err(e) if e.status() == Some(404) => {
                    self.held().remove(&machine);
                }
                Err(e) => {
                    warn!(%machine, computer_id = %computer, error = %e.detail(), "could not renew the lease")
                }
            }
        }
    }

    /// Starts the lease task once the app is known: renewals every 300 s, lease GC at once and
    /// every 600 s. It ends when the backend is dropped.
    fn start_maintenance(&self) {
        if self.maintenance_started.swap(true, Ordering::SeqCst) {
            return;
        }
        let me = self.me.clone();
        let stop = self.stop.clone();
        tokio::spawn(async move {
            let mut renew = tokio::time::interval(LEASE_RENEWAL);
            let mut gc = tokio::time::interval(LEASE_GC_PERIOD);
            renew.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            gc.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            // The first renewal tick fires at once; skip it (leases were just written).
            renew.tick().await;
            loop {
                tokio::select! {
                    () = stop.cancelled() => break,
                    _ = renew.tick() => {
                        let Some(inner) = me.upgrade() else { break };
                        inner.renew_leases().await;
                    }
                    _ = gc.tick() => {
                        let Some(inner) = me.upgrade() else { break };
                        match inner.collect(&HashSet::new()).await {
                            Ok(removed) if !removed.is_empty() => {
                                let ids: Vec<&str> = removed.iter().map(ComputerId::as_str).collect();
                                eprintln!(
                                    "kilntainers: removed {} temporary computer(s) whose Fly lease expired: {}",
                                    removed.len(),
                                    ids.join(", ")
                                );
                            }
                            Ok(_) => {}
                            Err(error) => warn!(%error, "Fly lease cleanup failed"),
                        }
                    }
                }
            }
        });
    }
}

#[async_trait]
impl Backend for FlyBackend {
    fn kind(&self) -> &'static str {
        "fly"
    }

    fn exec_output_is_binary(&self) -> bool {
        false
    }

    fn has_ports(&self) -> bool {
        false
    }

    fn tool_instructions(&self) -> String {
        let inner = &self.inner;
        if inner.config.image == DEFAULT_IMAGE {
            T_FLY.to_owned()
        } else {
            kilntainers_backend::generic_description(
                &format!(
                    "an isolated Fly Machine (VM) built from image `{}`",
                    inner.config.image
                ),
                shell_basename(&inner.shell),
                inner.default_timeout_secs,
            )
        }
    }

    async fn validate(&self) -> Result<(), BackendError> {
        self.inner.app().await.map(drop)
    }

    async fn check_startup(&self) -> Result<(), BackendError> {
        let inner = &self.inner;
        match tokio::time::timeout(
            STARTUP_CHECK_TIMEOUT,
            app::existing_checked(&inner.api, &inner.config),
        )
        .await
        {
            Ok(Err(app::Unsafe::Refused(text))) => Err(BackendError::Unavailable(text)),
            Ok(Err(app::Unsafe::Unknown(error))) => {
                debug!(%error, "Fly App check at startup deferred to first use");
                Ok(())
            }
            Ok(Ok(_)) | Err(_) => Ok(()),
        }
    }

    async fn create(
        &self,
        spec: &CreateSpec,
        progress: &dyn Progress,
    ) -> Result<SandboxRef, BackendError> {
        self.inner.create(spec, progress).await
    }

    async fn lookup(&self, id: &ComputerId) -> Result<Option<Found>, BackendError> {
        let app = self.inner.app().await?;
        let machines = self.inner.machines(&app);
        Ok(self.inner.find(&machines, id).await?.map(|machine| Found {
            sandbox: self.inner.sandbox_from(id, &machine),
            running: machine.state == "started",
        }))
    }

    async fn ensure_running(&self, sandbox: &SandboxRef) -> Result<SandboxRef, BackendError> {
        self.inner.ensure_running(sandbox).await
    }

    async fn list(&self) -> Result<Vec<ComputerInfo>, BackendError> {
        self.inner.list().await
    }

    async fn restart(&self, sandbox: &SandboxRef) -> Result<Restarted, BackendError> {
        self.inner.restart(sandbox).await
    }

    async fn remove(&self, sandbox: &SandboxRef) -> Result<(), BackendError> {
        self.inner.remove(sandbox).await
    }

    async fn exec(
        &self,
        sandbox: &SandboxRef,
        spec: &ExecSpec,
        sink: &mut dyn OutputSink,
        cancel: &CancellationToken,
    ) -> Result<ExecEnd, BackendError> {
        exec::exec(&self.inner, sandbox, spec, sink, cancel).await
    }

    async fn kill_exec(&self, sandbox: &SandboxRef, exec_id: &ExecId) -> Result<(), BackendError> {
        let argv = posix::kill_sweep_argv(&self.inner.shell, exec_id, SweepReach::Tagged);
        exec::run_simple(&self.inner, sandbox, argv, KILL_SWEEP_TIMEOUT)
            .await
            .map(drop)
    }

    async fn collect_orphans(
        &self,
        dead: &HashSet<InstanceId>,
    ) -> Result<Vec<ComputerId>, BackendError> {
        self.inner.collect(dead).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn images_are_normalised_for_the_api() {
        assert_eq!(
            api_image("debian:bookworm-slim"),
            "docker.io/library/debian:bookworm-slim"
        );
        assert_eq!(api_image("user/img:1"), "docker.io/user/img:1");
        assert_eq!(
            api_image("registry.fly.io/app:tag"),
            "registry.fly.io/app:tag"
        );
        assert_eq!(api_image("localhost/x"), "localhost/x");
        assert_eq!(api_image("host:5000/x"), "host:5000/x");
    }
}
