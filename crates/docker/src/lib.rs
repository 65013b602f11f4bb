//! Docker and Podman through the Engine API (bollard), never the CLI (docs/decisions.md, "Docker and Podman"). Owns the
//! connection, container lookup, inventory, restart, removal and crash GC; creation lives in
//! [`create`], the warm pool of spares in [`pool`] and command execution in [`exec`].
//!
//! The word *container* appears only under this folder. Label keys come from
//! [`kilntainers_backend::labels::docker`] so the Python reference's containers are found as ours.

mod brokering;
mod checkpoints;
pub mod config;
mod create;
mod egress;
mod exec;
mod helper;
mod networks;
mod pool;
mod ports;
pub mod run_flags;
mod run_flags_api;
mod tls;

pub use helper::broker::broker_available;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use async_trait::async_trait;
use bollard::Docker;
use bollard::errors::Error as DockerError;
use bollard::models::ContainerInspectResponse;
use bollard::query_parameters::{
    InspectContainerOptions, ListContainersOptionsBuilder, RemoveContainerOptionsBuilder,
    RestartContainerOptionsBuilder, StartContainerOptions, StopContainerOptionsBuilder,
    WaitContainerOptionsBuilder,
};
use futures_util::{StreamExt, TryStreamExt};
use tokio::sync::OnceCell;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::{DockerConfig, Engine, EngineAddress, scheme};
use kilntainers_backend::ids::{ComputerId, ExecId, InstanceId, SandboxId};
use kilntainers_backend::labels::{self, docker as label};
use kilntainers_backend::posix::{self, SweepReach, shell_basename};
use kilntainers_backend::{
    Backend, BackendError, ComputerInfo, CreateSpec, ExecEnd, ExecSpec, Found, IdleStop,
    IdleStopped, OutputSink, PortRoute, PortStream, Progress, Restarted, SandboxRef, WarmPoolSize,
};
use kilntainers_backend::{Common, DEFAULT_IMAGE};

/// How long the startup check waits for the engine before leaving it to the first use.
const STARTUP_CHECK_TIMEOUT: Duration = Duration::from_secs(10);

/// bollard's client timeout bounds request → response headers only; streamed bodies (exec
/// output, pulls) are bounded by our own timers. 30 s covers a slow remote engine.
const API_TIMEOUT: Duration = Duration::from_secs(30);
/// Readiness exec after create/start/restart (docs/decisions.md, "Constants").
const READINESS_TIMEOUT: Duration = Duration::from_secs(15);
/// How much of a failed readiness probe's output the log keeps.
const READINESS_LOGGED_BYTES: usize = 200;
/// Stop grace for restart: the keep-alive exits at once on SIGTERM, so 2 s only matters for
/// the reference's `tail -f /dev/null` containers.
const RESTART_GRACE_SECS: i32 = 2;
/// How long idle stop waits for this server's own helper exec to end before taking the execs
/// still running for another server's.
const OWN_HELPER_EXIT: Duration = Duration::from_secs(3);
/// Most execs idle stop inspects on one container; past it the computer counts as in use.
const EXECS_INSPECTED: usize = 512;

/// Whether any of a container's execs still runs. Docker lists only running execs in a
/// container's `ExecIDs`; Podman keeps ended exec sessions there too, so each is asked.
async fn any_exec_running(docker: &Docker, exec_ids: &[String]) -> bool {
    if exec_ids.len() > EXECS_INSPECTED {
        return true;
    }
    for id in exec_ids {
        match docker.inspect_exec(id).await {
            Ok(exec) if exec.running == Some(false) => {}
            // Gone since the listing: ended.
            Err(e) if status_of(&e) == Some(404) => {}
            _ => return true,
        }
    }
    false
}
/// How long a restart waits for the engine to record the exit of the old process when it
/// answered before doing so; the keep-alive exits at once, so this is the engine's backlog.
const STALE_EXIT_WAIT: Duration = Duration::from_secs(10);
/// How long a removal asks again while Docker answers that another removal of the same
/// container is under way.
const REMOVAL_CONFLICT_WAIT: Duration = Duration::from_secs(15);
/// Inspections in flight at once while listing, so a large inventory does not flood the engine.
const LIST_CONCURRENCY: usize = 8;

pub struct DockerBackend {
    config: DockerConfig,
    shell: String,
    default_timeout_secs: u64,
    /// Which network each new computer joins; per principal when several can exist.
    networks: networks::Networks,
    /// Connected and version-negotiated client; retried on the next call after a failure.
    client: OnceCell<Docker>,
    pulls: create::PullGate,
    /// Bounds container create+start+readiness running at once; see [`create::PARALLEL_STARTS`].
    starts: tokio::sync::Semaphore,
    /// The resident exec helpers, one connection per container.
    helpers: helper::Helpers,
    /// Started spares handed out as temporary computers (`--warm-pool`).
    pool: pool::WarmPool,
    /// The server's egress policy: new computers get it unless they narrow it.
    egress_policy: kilntainers_backend::egress::EgressPolicy,
    /// Behind the egress proxy: each running computer's proxy and address there, by
    /// container id, for the refusal lines of its commands.
    egress_addresses:
        std::sync::Mutex<HashMap<String, (std::sync::Arc<egress::Proxy>, std::net::IpAddr)>>,
    /// The proxies' questions (ask-to-allow), until the server takes them.
    egress_questions: std::sync::Mutex<
        Option<tokio::sync::mpsc::Receiver<kilntainers_backend::egress::EgressQuestion>>,
    >,
    /// The secrets computers use through the proxy (docs/secrets.md); empty when off.
    secrets: kilntainers_backend::brokering::SecretBook,
    /// The containers this process installed the broker's CA in.
    ca_installed: brokering::Installed,
}

impl DockerBackend {
    pub fn new(config: &DockerConfig, common: &Common) -> Result<Self, BackendError> {
        // Questions flow only where a proxy can ask them (docs/egress.md, "Ask-to-allow").
        let grants = egress::Grants::new(config.state_dir.as_deref());
        let (asking, questions) = if common.egress.filters() && common.egress.policy.ask {
            let (tx, rx) = tokio::sync::mpsc::channel(egress::QUESTIONS_QUEUED);
            let asking = egress::Asking {
                questions: tx,
                grants: grants.clone(),
            };
            (Some(asking), Some(rx))
        } else {
            (None, None)
        };
        let wiring = networks::Wiring::for_engine(config.engine, config.runtime.as_deref());
        let networks = networks::Networks::new(
            config.network,
            config.engine,
            &common.egress,
            asking,
            grants,
            wiring,
            &common.secrets,
        );
        if common.secrets.enabled()
            && wiring == networks::Wiring::Socket
            && !common.egress.filters()
        {
            return Err(BackendError::Unavailable(format!(
                "secrets with --egress open are brokered by a proxy beside the computer's own network, which {} cannot give a computer (docs/secrets.md, \"Backends\"); use --egress allowlist, or add an --egress-deny rule.",
                if config.engine == Engine::Podman {
                    "Podman"
                } else {
                    "gVisor"
                }
            )));
        }
        // A spare cannot be given the proxy's volume when it is handed out, and a computer
        // behind a socket-wired proxy needs it from its creation (docs/warm-pool.md, "Egress").
        let warm_pool = if (networks.socket_wired() || networks.beside()) && config.warm_pool > 0 {
            warn!(
                "--warm-pool is not used with this egress wiring (docs/egress.md, \"Socket wiring\"; docs/secrets.md, \"Egress modes\"): every computer is made when asked for"
            );
            0
        } else {
            config.warm_pool
        };
        Ok(Self {
            config: config.clone(),
            shell: common.shell.clone(),
            default_timeout_secs: common.default_timeout_secs,
            networks,
            egress_questions: std::sync::Mutex::new(questions),
            egress_policy: common.egress.policy.clone(),
            egress_addresses: std::sync::Mutex::new(HashMap::new()),
            secrets: common.secrets.clone(),
            ca_installed: brokering::Installed::default(),
            client: OnceCell::new(),
            pulls: create::PullGate::default(),
            starts: tokio::sync::Semaphore::new(create::PARALLEL_STARTS),
            helpers: helper::Helpers::new(config.exec_helper, helper::PLAIN),
            pool: pool::WarmPool::new(warm_pool),
        })
    }

    fn engine_name(&self) -> &'static str {
        self.config.engine.display_name()
    }

    /// The error of a connection that failed: the reference's first line, then what would
    /// help — the TLS files in use, or that the engine wants TLS.
    fn unreachable(&self, endpoint: Option<&str>, error: &dyn std::error::Error) -> BackendError {
        let engine = self.engine_name();
        let detail = error_chain(error);
        let mut message = format!("Cannot connect to {engine}. Is the {engine} daemon running?");
        if self.config.engine == Engine::Podman {
            message.push_str("\nStart the Podman API service with: podman system service --time=0 (rootful) or systemctl --user start podman.socket (rootless).");
        }
        let endpoint_shown = endpoint.unwrap_or("the engine");
        if let Some(tls) = &self.config.connection.tls {
            message.push_str(&format!(
                "\nTLS to {endpoint_shown} with the certificates in {} failed: {detail}\nca.pem must hold the CA that signed the engine's certificate, and the engine must accept cert.pem and key.pem.",
                tls.dir.display()
            ));
        } else if detail.contains(TLS_ENGINE_ANSWER) {
            message.push_str(&format!(
                "\n{endpoint_shown} speaks TLS: set DOCKER_TLS_VERIFY=1 and DOCKER_CERT_PATH (or --docker-tls-verify and --docker-cert-path) to the directory holding ca.pem, cert.pem and key.pem."
            ));
        }
        warn!(engine, endpoint = endpoint_shown, %detail, "engine unreachable");
        BackendError::Unavailable(message)
    }

    /// The engine address now: the configured one, or the first of Podman's sockets that exists.
    fn endpoint(&self) -> Option<String> {
        match &self.config.connection.address {
            EngineAddress::Fixed(host) => Some(host.clone()),
            EngineAddress::FirstExisting(candidates) => candidates
                .iter()
                .find(|c| std::path::Path::new(c.trim_start_matches("unix://")).exists())
                .cloned(),
        }
    }

    /// A client for `endpoint` (nothing sent yet): TLS with the configured files, plain HTTP
    /// for `tcp://` and `http://` without them, else by scheme.
    fn connect(&self, endpoint: &str) -> Result<Docker, tls::TlsSetupError> {
        let secs = API_TIMEOUT.as_secs();
        let docker = match (&self.config.connection.tls, scheme(endpoint).as_str()) {
            (Some(files), _) => tls::connect(endpoint, files, secs)?,
            // Not `connect_with_host`: it would switch to TLS by itself when the environment
            // has DOCKER_TLS_VERIFY, which the configuration already decided on.
            (None, "tcp" | "http") => {
                if !is_loopback_address(endpoint) {
                    warn!(%endpoint, "the engine API is reached over plain HTTP: anyone on the path can read and change what the server sends, and run containers as root on that host; use TLS (DOCKER_TLS_VERIFY, https://) or ssh://");
                }
                Docker::connect_with_http(endpoint, secs, bollard::API_DEFAULT_VERSION)?
            }
            (None, _) => Docker::connect_with_host(endpoint)?,
        };
        Ok(docker.with_timeout(API_TIMEOUT))
    }

    async fn client(&self) -> Result<&Docker, BackendError> {
        self.client
            .get_or_try_init(|| async {
                let endpoint = self.endpoint().ok_or_else(|| {
                    self.unreachable(None, &std::io::Error::other("no Podman API socket found"))
                })?;
                let docker = self
                    .connect(&endpoint)
                    .map_err(|e| self.unreachable(Some(&endpoint), &e))?;
                let unreachable = |e: DockerError| self.unreachable(Some(&endpoint), &e);
                docker.ping().await.map_err(unreachable)?;
                let docker = docker.negotiate_version().await.map_err(unreachable)?;
                let tls = self.config.connection.tls.is_some();
                info!(engine = self.engine_name(), %endpoint, tls, api = ?docker.client_version(), "connected");
                Ok(docker)
            })
            .await
    }

    fn container_name(id: &ComputerId) -> String {
        format!("{}{}", label::NAME_PREFIX, id)
    }

    async fn inspect(
        &self,
        name_or_id: &str,
    ) -> Result<Option<ContainerInspectResponse>, BackendError> {
        let docker = self.client().await?;
        match docker
            .inspect_container(name_or_id, None::<InspectContainerOptions>)
            .await
        {
            Ok(inspect) => Ok(Some(inspect)),
            // Podman answers 500 for a container removed while it is being inspected (a
            // listing racing another process's delete): gone all the same.
            Err(e)
                if status_of(&e) == Some(404)
                    || describe(&e).contains("does not exist in database") =>
            {
                Ok(None)
            }
            Err(e) => Err(BackendError::Provider(format!(
                "Docker inspect of '{name_or_id}' failed: {}",
                describe(&e)
            ))),
        }
    }

    /// Reads our labels off an inspected container.
    fn sandbox_from(
        &self,
        id: &ComputerId,
        inspect: &ContainerInspectResponse,
    ) -> Result<SandboxRef, BackendError> {
        let labels = inspect.config.as_ref().and_then(|c| c.labels.as_ref());
        let full_id = inspect.id.as_deref().filter(|i| i.len() >= 12);
        let (Some(labels), Some(full_id)) = (labels, full_id) else {
            return Err(BackendError::Provider(format!(
                "Docker returned invalid inspect data for computer '{id}'."
            )));
        };
        if claimed_id(labels, inspect.name.as_deref().unwrap_or_default()) != Some(id.as_str()) {
            return Err(BackendError::Provider(format!(
                "Docker name '{}' is already in use by a container not owned by this server.",
                Self::container_name(id)
            )));
        }
        Ok(SandboxRef {
            computer_id: id.clone(),
            sandbox_id: SandboxId::new(full_id[..12].to_owned()),
            temporary: labels::parse_temporary(labels.get(label::TEMPORARY).map(String::as_str)),
            image: labels
                .get(label::IMAGE)
                .cloned()
                .unwrap_or_else(|| self.config.image.clone()),
        })
    }

    async fn remove_container(&self, name_or_id: &str) -> Result<(), BackendError> {
        let docker = self.client().await?;
        let options = RemoveContainerOptionsBuilder::default()
            .force(true)
            .v(true)
            .build();
        let deadline = tokio::time::Instant::now() + REMOVAL_CONFLICT_WAIT;
        let mut pause = Duration::from_millis(20);
        loop {
            match docker
                .remove_container(name_or_id, Some(options.clone()))
                .await
            {
                // Removed, or gone already.
                Ok(()) => return Ok(()),
                Err(e) if status_of(&e) == Some(404) => return Ok(()),
                // Docker is removing it already, which is not yet its end: an AutoRemove
                // started by a restart's stop can still fail once the container runs again
                // (it does not force), leaving it running. Asked again once that removal is
                // over, Docker answers 404 or removes it.
                Err(e) if status_of(&e) == Some(409) && tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(500));
                }
                Err(e) => {
                    return Err(BackendError::Provider(format!(
                        "Docker remove of '{name_or_id}' failed: {}",
                        describe(&e)
                    )));
                }
            }
        }
    }

    /// Behind the egress proxy: gives the proxy this running container's policy at its
    /// current address and remembers both for its commands' refusal lines.
    async fn egress_attach(&self, inspect: &ContainerInspectResponse) -> Result<(), BackendError> {
        let name = inspect.name.as_deref().unwrap_or_default();
        // A spare waiting for an owner is behind no proxy yet (docs/warm-pool.md, "Egress").
        if !self.networks.egress()
            || name
                .trim_start_matches('/')
                .starts_with(label::SPARE_NAME_PREFIX)
        {
            return Ok(());
        }
        let docker = self.client().await?;
        let attached = self
            .networks
            .apply_policy(docker, inspect, &self.egress_policy)
            .await?;
        let born_spare = inspect
            .config
            .as_ref()
            .and_then(|c| c.labels.as_ref())
            .and_then(|l| l.get(label::POOLED))
            .is_some_and(|pooled| pooled == "true");
        if let (true, Some((proxy, _))) = (born_spare, &attached) {
            self.point_at_proxy(docker, inspect, proxy.address).await?;
        }
        if attached.is_some() && self.networks.socket_wired() {
            self.start_relay(docker, inspect).await?;
        }
        if attached.is_some() && self.secrets.ca().is_some() {
            self.install_ca(docker, inspect).await;
        }
        if let (Some(attached), Some(id)) = (attached, inspect.id.as_deref()) {
            self.egress_addresses
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .insert(id.chars().take(12).collect(), attached);
        }
        Ok(())
    }

    /// Socket wiring: starts the relay inside the computer (idempotent: one already running
    /// stays), which also points its resolver at itself (docs/egress.md, "Socket wiring").
    /// Run at each start of the computer and when this process first meets it running. A
    /// computer whose root ends its relay only cuts itself off until its next restart.
    async fn start_relay(
        &self,
        docker: &bollard::Docker,
        inspect: &ContainerInspectResponse,
    ) -> Result<(), BackendError> {
        let container = inspect.id.as_deref().unwrap_or_default();
        let token = inspect
            .config
            .as_ref()
            .and_then(|c| c.labels.as_ref())
            .and_then(|l| l.get(egress::TOKEN_LABEL))
            .cloned()
            .unwrap_or_default();
        let failed = |why: String| {
            BackendError::Provider(format!(
                "could not start the egress relay in container {container}: {why}"
            ))
        };
        let path = helper::put_binary(docker, container)
            .await
            .map_err(failed)?;
        match exec::run_simple_with(
            docker,
            container,
            Some("0"),
            vec![format!("{}={token}", egress::TOKEN_ENV)],
            egress::relay_argv(path),
            egress::RELAY_START_TIMEOUT,
        )
        .await
        {
            Ok((0, _)) => Ok(()),
            Ok((code, _)) => Err(failed(format!("exit code {code}"))),
            Err(why) => Err(failed(why)),
        }
    }

    /// Installs the broker's CA in the computer's trust stores (docs/secrets.md, "The CA"), at
    /// each start and when this process first meets it running. A failure (a read-only root,
    /// no `sed`) is logged and leaves the computer's commands without the CA variables, so
    /// HTTPS to hosts without a secret keeps working and to bound ones fails verification.
    async fn install_ca(&self, docker: &bollard::Docker, inspect: &ContainerInspectResponse) {
        let container = inspect.id.as_deref().unwrap_or_default();
        let Some(ca) = self.secrets.ca() else {
            return;
        };
        let argv = vec![
            self.shell.clone(),
            "-c".to_owned(),
            brokering::INSTALL_CA.to_owned(),
            "sh".to_owned(),
            ca.cert_pem.clone(),
        ];
        let outcome = exec::run_simple_as(
            docker,
            container,
            Some("0"),
            argv,
            posix::KILL_SWEEP_TIMEOUT,
        )
        .await;
        let installed = matches!(outcome, Ok((0, _)));
        if !installed {
            warn!(container, outcome = ?outcome.map(|(code, _)| code), "could not install the secrets broker's CA; HTTPS to hosts with a secret will not verify in this computer");
        }
        self.ca_installed.mark(container, installed);
    }

    /// What every command of `sandbox` gets added to its environment: the placeholders of its
    /// secrets, and the CA variables once the CA is installed in it.
    pub(crate) fn command_env(&self, sandbox: &SandboxRef) -> Vec<String> {
        if !self.secrets.enabled() {
            return Vec::new();
        }
        let mut env = self.secrets.env_for(&sandbox.computer_id);
        if self.ca_installed.has(sandbox.sandbox_id.as_str()) {
            env.extend(brokering::ca_env());
        }
        env
    }

    /// Points the resolver and [`egress::PROXY_HOST`] of a computer born a warm-pool spare at
    /// the proxy of the network it was handed over to (docs/warm-pool.md, "Egress").
    async fn point_at_proxy(
        &self,
        docker: &bollard::Docker,
        inspect: &ContainerInspectResponse,
        proxy: std::net::IpAddr,
    ) -> Result<(), BackendError> {
        let container = inspect.id.as_deref().unwrap_or_default();
        let argv = vec![
            self.shell.clone(),
            "-c".to_owned(),
            egress::SPARE_NETWORK_FIXUP.to_owned(),
            "sh".to_owned(),
            proxy.to_string(),
            egress::PROXY_HOST.to_owned(),
        ];
        match exec::run_simple_as(
            docker,
            container,
            Some("0"),
            argv,
            posix::KILL_SWEEP_TIMEOUT,
        )
        .await
        {
            Ok((0, _)) => Ok(()),
            Ok((code, _)) => Err(BackendError::Provider(format!(
                "could not point container {container} at its egress proxy (exit code {code})"
            ))),
            Err(e) => Err(BackendError::Provider(format!(
                "could not point container {container} at its egress proxy: {e}"
            ))),
        }
    }

    /// Where to read the refusals of `sandbox`'s commands: its proxy, its address and the
    /// count of refusals so far.
    fn egress_mark(
        &self,
        sandbox: &SandboxRef,
    ) -> Option<(std::sync::Arc<egress::Proxy>, std::net::IpAddr, u64)> {
        let (proxy, address) = self
            .egress_addresses
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(sandbox.sandbox_id.as_str())
            .cloned()?;
        let mark = proxy
            .denials
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .count(address);
        Some((proxy, address, mark))
    }

    /// Starts the container if needed, checks it stayed up, then runs the readiness exec.
    async fn start_and_check(&self, sandbox: &SandboxRef) -> Result<(), BackendError> {
        let docker = self.client().await?;
        let name = Self::container_name(&sandbox.computer_id);
        let inspect = self
            .inspect(&name)
            .await?
            .ok_or_else(|| BackendError::Vanished(sandbox.computer_id.clone()))?;
        self.networks.adopt_legacy(docker, &inspect).await?;
        if !is_running(&inspect) {
            // Whatever helper connection there was died with the container.
            self.helpers.forget(sandbox.sandbox_id.as_str());
            if let Err(e) = docker
                .start_container(&name, None::<StartContainerOptions>)
                .await
            {
                return Err(match status_of(&e) {
                    Some(404) => BackendError::Provider(format!(
                        "Computer '{}' disappeared while it was starting.",
                        sandbox.computer_id
                    )),
                    _ => BackendError::Provider(format!(
                        "Docker start of '{name}' failed: {}",
                        describe(&e)
                    )),
                });
            }
            let inspect = self.inspect(&name).await?.ok_or_else(|| {
                BackendError::Provider(format!(
                    "Computer '{}' disappeared while it was starting.",
                    sandbox.computer_id
                ))
            })?;
            if !is_running(&inspect) {
                return Err(self.exited_immediately(sandbox.sandbox_id.as_str()));
            }
            self.egress_attach(&inspect).await?;
        } else if self.networks.egress() {
            // Running already (this server restarted, or another one started it): its address
            // is unchanged, but this process may not know it yet.
            let inspect = self
                .inspect(&name)
                .await?
                .ok_or_else(|| BackendError::Vanished(sandbox.computer_id.clone()))?;
            self.egress_attach(&inspect).await?;
        }
        self.readiness(sandbox).await
    }

    /// The host pid of the container's main process (0 when stopped).
    async fn main_pid(&self, sandbox: &SandboxRef) -> Result<i64, BackendError> {
        let name = Self::container_name(&sandbox.computer_id);
        let inspect = self
            .inspect(&name)
            .await?
            .ok_or_else(|| BackendError::Vanished(sandbox.computer_id.clone()))?;
        Ok(inspect.state.and_then(|state| state.pid).unwrap_or(0))
    }

    /// Returns once the engine records the container as not running, or after
    /// [`STALE_EXIT_WAIT`] (then the caller's start check decides).
    async fn wait_until_not_running(&self, sandbox: &SandboxRef) -> Result<(), BackendError> {
        let docker = self.client().await?;
        let name = Self::container_name(&sandbox.computer_id);
        let options = WaitContainerOptionsBuilder::default()
            .condition("not-running")
            .build();
        let mut wait = docker.wait_container(&name, Some(options));
        match tokio::time::timeout(STALE_EXIT_WAIT, wait.next()).await {
            // A non-zero exit status arrives as an error; it is still an exit.
            Ok(None | Some(Ok(_)) | Some(Err(DockerError::DockerContainerWaitError { .. }))) => {
                Ok(())
            }
            Ok(Some(Err(e))) if status_of(&e) == Some(404) => {
                Err(BackendError::Vanished(sandbox.computer_id.clone()))
            }
            Ok(Some(Err(e))) => Err(BackendError::Provider(format!(
                "Docker wait for the stop of '{name}' failed: {}",
                describe(&e)
            ))),
            Err(_) => {
                warn!(container = %name, "restart left the old process recorded as running");
                Ok(())
            }
        }
    }

    fn exited_immediately(&self, sandbox_id: &str) -> BackendError {
        BackendError::Provider(format!(
            "Container {sandbox_id} exited immediately after start. Shell '{}' may not be available in the image. Use --shell /bin/sh for images without bash.",
            self.shell
        ))
    }

    async fn readiness(&self, sandbox: &SandboxRef) -> Result<(), BackendError> {
        let argv = posix::readiness_argv(&self.shell);
        let docker = self.client().await?;
        // Through the helper when it can run: this also connects it, so the first command
        // after a create or a start pays for no exec of its own.
        let outcome = match self
            .helpers
            .run_collected(
                &helper::DockerTransport(docker),
                sandbox,
                argv.clone(),
                READINESS_TIMEOUT,
            )
            .await
        {
            Some(outcome) => outcome,
            None => {
                exec::run_simple(docker, sandbox.sandbox_id.as_str(), argv, READINESS_TIMEOUT).await
            }
        };
        match outcome {
            Ok((0, stdout)) if posix::shows_ready(&stdout) => Ok(()),
            Ok((code, stdout)) => {
                // What the probe printed goes to the log only (it comes from the computer),
                // and only its start: enough to tell a missing shell from an engine's refusal.
                let start = &stdout[..stdout.len().min(READINESS_LOGGED_BYTES)];
                warn!(container = %sandbox.sandbox_id, code, printed = ?String::from_utf8_lossy(start), "readiness probe answered without the marker");
                let mut message = format!(
                    "Container {} started but readiness check failed (unexpected output)",
                    sandbox.sandbox_id
                );
                if code == 126 || code == 127 {
                    message.push_str(&format!(
                        "\nShell '{}' may not be available in the image. Use --shell /bin/sh for images without bash.",
                        self.shell
                    ));
                }
                Err(BackendError::Provider(message))
            }
            Err(e) => Err(BackendError::Provider(format!(
                "Container {} started but readiness check failed ({e})",
                sandbox.sandbox_id
            ))),
        }
    }
}

#[async_trait]
impl Backend for DockerBackend {
    fn kind(&self) -> &'static str {
        "docker"
    }

    fn tool_instructions(&self) -> String {
        let shell = shell_basename(&self.shell);
        let timeout = self.default_timeout_secs;
        if self.config.image == DEFAULT_IMAGE {
            format!(
                "Execute a shell command in an isolated Debian Linux sandbox. Commands run in {shell}. Each call is independent — no state (shell variables, working directory) persists between calls (however filesystem does persist). Use the working_directory parameter or chain commands with && to control execution context. \n\n{}",
                kilntainers_backend::stdin_and_timeout_paragraph(timeout)
            )
        } else {
            kilntainers_backend::generic_description(
                &format!(
                    "an isolated Linux container built from image `{}`",
                    self.config.image
                ),
                shell,
                timeout,
            )
        }
    }

    fn checkpoints(&self) -> Option<&dyn kilntainers_backend::checkpoints::Checkpoints> {
        Some(self)
    }

    async fn validate(&self) -> Result<(), BackendError> {
        self.client().await.map(drop)
    }

    async fn check_startup(&self) -> Result<(), BackendError> {
        let gvisor = self
            .config
            .runtime
            .as_deref()
            .filter(|runtime| runtime.contains("runsc"));
        let Some(runtime) =
            gvisor.filter(|_| self.networks.socket_wired() && self.config.engine == Engine::Docker)
        else {
            return Ok(());
        };
        // gVisor refuses connections to host sockets unless told otherwise, and the relay
        // reaches the proxy through one (docs/egress.md, "Socket wiring"). An engine that does
        // not answer now is reported at first use, as ever: startup never waits on it.
        let info = tokio::time::timeout(STARTUP_CHECK_TIMEOUT, async {
            self.client().await.ok()?.info().await.ok()
        })
        .await;
        let Ok(Some(info)) = info else {
            return Ok(());
        };
        let Some(registered) = info.runtimes.and_then(|mut r| r.remove(runtime)) else {
            return Err(BackendError::Provider(format!(
                "--runtime {runtime}: Docker has no runtime of that name; register it in /etc/docker/daemon.json (\"runtimes\") with \"--host-uds=open\" among its \"runtimeArgs\" (docs/egress.md, \"Socket wiring\")."
            )));
        };
        let args = registered.runtime_args.unwrap_or_default();
        if egress::runsc_reaches_sockets(&args) {
            return Ok(());
        }
        Err(BackendError::Provider(format!(
            "--runtime {runtime} with an egress policy needs gVisor to reach the proxy's Unix socket: add \"--host-uds=open\" to the \"runtimeArgs\" of runtime '{runtime}' in /etc/docker/daemon.json and reload Docker (kill -HUP the dockerd process); its runtimeArgs now: {args:?}."
        )))
    }

    fn validates_eagerly(&self) -> bool {
        true
    }

    async fn keep_warm(&self, instance: &InstanceId) {
        self.pool.keep(self, instance).await;
    }

    fn warm_pool(&self) -> Option<WarmPoolSize> {
        self.pool.size()
    }

    async fn release_spares(&self) -> Result<(), BackendError> {
        let released = self.pool.release(self).await;
        if self.networks.per_principal()
            && let Ok(docker) = self.client().await
        {
            self.networks
                .release_all_unused(docker, &HashSet::new())
                .await;
        }
        released
    }

    async fn create(
        &self,
        spec: &CreateSpec,
        progress: &dyn Progress,
    ) -> Result<SandboxRef, BackendError> {
        create::create(self, spec, progress).await
    }

    async fn lookup(&self, id: &ComputerId) -> Result<Option<Found>, BackendError> {
        let Some(inspect) = self.inspect(&Self::container_name(id)).await? else {
            return Ok(None);
        };
        let sandbox = self.sandbox_from(id, &inspect)?;
        Ok(Some(Found {
            sandbox,
            running: is_running(&inspect),
        }))
    }

    async fn ensure_running(&self, sandbox: &SandboxRef) -> Result<SandboxRef, BackendError> {
        self.start_and_check(sandbox).await?;
        // The container id cannot change by starting, but re-read it so a concurrent factory
        // reset by another server is noticed.
        match self.lookup(&sandbox.computer_id).await? {
            Some(found) => Ok(found.sandbox),
            None => Err(BackendError::Vanished(sandbox.computer_id.clone())),
        }
    }

    async fn list(&self) -> Result<Vec<ComputerInfo>, BackendError> {
        let docker = self.client().await?;
        // Every computer has the managed label; those born as spares have no computer-id label.
        let filters = HashMap::from([("label".to_owned(), vec![label::MANAGED.to_owned()])]);
        let options = ListContainersOptionsBuilder::default()
            .all(true)
            .filters(&filters)
            .build();
        let summaries = list_containers(docker, options).await?;
        let invalid = || {
            BackendError::Provider("Docker returned invalid computer inventory data.".to_owned())
        };
        let mut targets = Vec::new();
        for summary in summaries {
            let Some(labels) = summary.labels.as_ref() else {
                continue;
            };
            // A spare not handed out, or a container labelled by someone else with a non-slug
            // id, is not a computer to show.
            let names = summary.names.iter().flatten();
            let Some(id) = names
                .filter_map(|name| claimed_id(labels, name))
                .find_map(|raw| ComputerId::parse_stored(raw).ok())
            else {
                continue;
            };
            if summary
                .names
                .iter()
                .flatten()
                .any(|n| n.trim_start_matches('/') == Self::container_name(&id))
            {
                targets.push((id, summary.id.ok_or_else(invalid)?));
            }
        }
        let rows: Vec<Option<ComputerInfo>> = futures_util::stream::iter(targets)
            .map(|(id, container)| async move {
                let inspect = self.inspect(&container).await?;
                let Some(inspect) = inspect else {
                    return Ok(None);
                };
                let sandbox = self.sandbox_from(&id, &inspect)?;
                let state = inspect
                    .state
                    .as_ref()
                    .and_then(|s| s.status)
                    .map(|s| s.to_string())
                    .unwrap_or_default();
                Ok::<_, BackendError>(Some(ComputerInfo {
                    sandbox,
                    state,
                    created_at: inspect.created.clone(),
                }))
            })
            .buffer_unordered(LIST_CONCURRENCY)
            .try_collect()
            .await?;
        Ok(rows.into_iter().flatten().collect())
    }

    async fn restart(&self, sandbox: &SandboxRef) -> Result<Restarted, BackendError> {
        let docker = self.client().await?;
        let name = Self::container_name(&sandbox.computer_id);
        // The restart kills the helper; the next command connects a new one.
        self.helpers.forget(sandbox.sandbox_id.as_str());
        let old_pid = self.main_pid(sandbox).await?;
        // Restart, not stop + start: stopping a temporary (auto-removed) container removes it.
        let options = RestartContainerOptionsBuilder::default()
            .t(RESTART_GRACE_SECS)
            .build();
        docker
            .restart_container(&name, Some(options))
            .await
            .map_err(|e| match status_of(&e) {
                Some(404) => BackendError::Vanished(sandbox.computer_id.clone()),
                _ => BackendError::Provider(format!(
                    "Docker restart of '{name}' failed: {}",
                    describe(&e)
                )),
            })?;
        // Docker can answer a restart before it has handled the exit of the old process; its
        // start then does nothing (the state still says running) and handling the exit later
        // marks the computer exited (moby/moby#43403, seen here under load). The same main
        // process after a restart is that case: wait for the exit to be recorded, start again.
        if old_pid != 0 && self.main_pid(sandbox).await? == old_pid {
            self.wait_until_not_running(sandbox).await?;
        }
        let sandbox = match self.ensure_running(sandbox).await {
            Ok(sandbox) => sandbox,
            // That late exit can also land after the start check, while the readiness probe
            // runs (the engine then answers "cannot exec in a stopped state"): a computer found
            // stopped after a failed probe is started once more.
            Err(failed) => {
                if self.main_pid(sandbox).await? != 0 {
                    return Err(failed);
                }
                warn!(container = %sandbox.sandbox_id, error = %failed, "the restarted computer stopped during its readiness check; starting it again");
                self.ensure_running(sandbox).await?
            }
        };
        Ok(Restarted {
            sandbox,
            state_preserved: true,
        })
    }

    fn idle_stop(&self) -> IdleStop {
        IdleStop::Stops
    }

    /// `docker stop` with the restart's grace: a permanent container is not auto-removed, so
    /// its writable layer stays for the next start. Another server's work on the computer
    /// shows as a running exec (its resident helper, or a command when the helper is off):
    /// once our own helper has gone, any exec left means the computer is in use elsewhere.
    async fn stop_idle(&self, sandbox: &SandboxRef) -> Result<IdleStopped, BackendError> {
        let docker = self.client().await?;
        let name = Self::container_name(&sandbox.computer_id);
        // Our helper ends when its connection is dropped; the next command connects a new one.
        self.helpers.forget(sandbox.sandbox_id.as_str());
        let deadline = tokio::time::Instant::now() + OWN_HELPER_EXIT;
        loop {
            let inspect = self
                .inspect(&name)
                .await?
                .ok_or_else(|| BackendError::Vanished(sandbox.computer_id.clone()))?;
            let exec_ids = inspect.exec_ids.unwrap_or_default();
            if !any_exec_running(docker, &exec_ids).await {
                break;
            }
            if tokio::time::Instant::now() >= deadline {
                return Ok(IdleStopped::InUseElsewhere);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let options = StopContainerOptionsBuilder::default()
            .t(RESTART_GRACE_SECS)
            .build();
        match docker.stop_container(&name, Some(options)).await {
            // 304: already stopped.
            Ok(()) => Ok(IdleStopped::Stopped),
            Err(e) if status_of(&e) == Some(304) => Ok(IdleStopped::Stopped),
            Err(e) if status_of(&e) == Some(404) => {
                Err(BackendError::Vanished(sandbox.computer_id.clone()))
            }
            Err(e) => Err(BackendError::Provider(format!(
                "Docker stop of '{name}' failed: {}",
                describe(&e)
            ))),
        }
    }

    async fn remove(&self, sandbox: &SandboxRef) -> Result<(), BackendError> {
        self.helpers.forget(sandbox.sandbox_id.as_str());
        let name = Self::container_name(&sandbox.computer_id);
        // The networks it was on, to remove those it was the last computer on.
        let (networks, full_id) = match self.inspect(&name).await? {
            Some(inspect) => (joined_networks(&inspect), inspect.id.clone()),
            None => (Vec::new(), None),
        };
        self.remove_container(&name).await?;
        if let (Some(grants), Some(full_id)) = (self.networks.grants(), full_id) {
            grants.remove(&full_id);
        }
        let behind_proxy = self
            .egress_addresses
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(sandbox.sandbox_id.as_str());
        if let Some((proxy, address)) = behind_proxy {
            // Its address may be given to the next computer, which must not inherit this policy.
            if let Err(error) = proxy.forget(address).await {
                warn!(%error, "could not tell the egress proxy a computer is gone");
            }
        }
        if !networks.is_empty() {
            let docker = self.client().await?;
            self.networks
                .release(docker, networks.iter().map(String::as_str))
                .await;
        }
        Ok(())
    }

    async fn egress_policy(
        &self,
        sandbox: &SandboxRef,
    ) -> Result<Option<kilntainers_backend::egress::EgressPolicy>, BackendError> {
        let name = Self::container_name(&sandbox.computer_id);
        let Some(inspect) = self.inspect(&name).await? else {
            return Err(BackendError::Vanished(sandbox.computer_id.clone()));
        };
        let full_id = inspect.id.clone().unwrap_or_default();
        let recorded = inspect
            .config
            .and_then(|c| c.labels)
            .and_then(|mut labels| labels.remove(label::EGRESS))
            .map(|text| {
                kilntainers_backend::egress::EgressPolicy::from_label(&text).map_err(|e| {
                    BackendError::Provider(format!("computer '{}': {e}", sandbox.computer_id))
                })
            })
            .transpose()?;
        // With the hosts people allowed for it (docs/egress.md, "Ask-to-allow").
        Ok(recorded.map(|policy| match self.networks.grants() {
            Some(grants) => grants.apply(&full_id, policy),
            None => policy,
        }))
    }

    async fn egress_grants(
        &self,
        sandbox: &SandboxRef,
    ) -> Result<Option<Vec<kilntainers_backend::egress::Pattern>>, BackendError> {
        let Some(grants) = self.networks.grants() else {
            return Ok(None);
        };
        let name = Self::container_name(&sandbox.computer_id);
        let Some(inspect) = self.inspect(&name).await? else {
            return Err(BackendError::Vanished(sandbox.computer_id.clone()));
        };
        Ok(Some(grants.load(inspect.id.as_deref().unwrap_or_default())))
    }

    async fn set_egress_grant(
        &self,
        sandbox: &SandboxRef,
        pattern: &kilntainers_backend::egress::Pattern,
        granted: bool,
    ) -> Result<bool, BackendError> {
        let Some(grants) = self.networks.grants() else {
            return Err(BackendError::Provider(
                "this server runs no egress proxy, so it keeps no rules for a computer".to_owned(),
            ));
        };
        let name = Self::container_name(&sandbox.computer_id);
        let Some(inspect) = self.inspect(&name).await? else {
            return Err(BackendError::Vanished(sandbox.computer_id.clone()));
        };
        let container = inspect.id.as_deref().unwrap_or_default();
        let changed = if granted {
            let before = grants.load(container).len();
            grants
                .add(container, pattern)
                .map(|()| grants.load(container).len() != before)
        } else {
            grants.revoke(container, pattern)
        }
        .map_err(|why| {
            BackendError::Provider(format!(
                "cannot keep the rule for computer '{}': {why}",
                sandbox.computer_id.slug()
            ))
        })?;
        // A running computer's proxy gets the recorded policy with its grants now; a stopped
        // one gets it when it starts.
        if changed && is_running(&inspect) {
            self.egress_attach(&inspect).await?;
        }
        Ok(changed)
    }

    async fn secrets_changed(&self) {
        self.networks.resend_secrets().await;
    }

    fn egress_questions(
        &self,
    ) -> Option<tokio::sync::mpsc::Receiver<kilntainers_backend::egress::EgressQuestion>> {
        self.egress_questions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
    }

    async fn egress_denials(
        &self,
        sandbox: &SandboxRef,
    ) -> Result<Option<Vec<kilntainers_backend::egress::DeniedEntry>>, BackendError> {
        if !self.networks.egress() {
            return Ok(None);
        }
        let Some((proxy, address, _)) = self.egress_mark(sandbox) else {
            // Not started by this process since it began: nothing recorded here yet.
            return Ok(Some(Vec::new()));
        };
        proxy.sync().await;
        let entries = proxy
            .denials
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .distinct(address);
        Ok(Some(entries))
    }

    async fn egress_denials_between(
        &self,
        sandbox: &SandboxRef,
        from_ms: u64,
        to_ms: u64,
    ) -> Vec<kilntainers_backend::egress::Denial> {
        let Some((proxy, address, _)) = self.egress_mark(sandbox) else {
            return Vec::new();
        };
        // A refusal is on its way to this process before the computer hears of it.
        proxy.sync().await;
        // A refusal is timed when this process reads it, which on a busy machine can be after
        // the job's own record of its end: the window stays open for as long as a `sync`
        // may take.
        let read_by = to_ms.saturating_add(egress::REFUSAL_READ_DELAY_MS);
        proxy
            .denials
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .between(address, from_ms, read_by)
    }

    async fn exec(
        &self,
        sandbox: &SandboxRef,
        spec: &ExecSpec,
        sink: &mut dyn OutputSink,
        cancel: &CancellationToken,
    ) -> Result<ExecEnd, BackendError> {
        let Some((mut proxy, mut address, mut mark)) = self.egress_mark(sandbox) else {
            return exec::exec(self, sandbox, spec, sink, cancel).await;
        };
        if !proxy.is_connected() {
            // Another server process on this engine replaced the network's proxy (or it
            // stopped): start ours again and give it this computer's policy, so this command's
            // refusals come back here (docs/egress.md, "Docker wiring").
            let name = Self::container_name(&sandbox.computer_id);
            let inspect = self
                .inspect(&name)
                .await?
                .ok_or_else(|| BackendError::Vanished(sandbox.computer_id.clone()))?;
            self.egress_attach(&inspect).await?;
            if let Some(again) = self.egress_mark(sandbox) {
                (proxy, address, mark) = again;
            }
        }
        let mut watched = egress::WatchedSink::new(sink);
        let end = exec::exec(self, sandbox, spec, &mut watched, cancel).await?;
        // A refusal is on its way to this process before the computer hears of it.
        proxy.sync().await;
        let denials = proxy
            .denials
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .since(address, mark);
        let tail = kilntainers_backend::egress::stderr_tail(&denials, watched.at_line_start());
        if !tail.is_empty() {
            watched.push(kilntainers_backend::Stream::Stderr, tail.as_bytes());
        }
        Ok(end)
    }

    async fn port_route(&self, _: &SandboxRef, _: u16) -> Result<PortRoute, BackendError> {
        Ok(PortRoute::Forwarded)
    }

    async fn connect_port(
        &self,
        sandbox: &SandboxRef,
        port: u16,
    ) -> Result<Box<dyn PortStream>, BackendError> {
        ports::connect(self, sandbox, port).await
    }

    async fn kill_exec(&self, sandbox: &SandboxRef, exec_id: &ExecId) -> Result<(), BackendError> {
        if self
            .helpers
            .kill(sandbox, exec_id.env_entry())
            .await
            .is_some()
        {
            return Ok(());
        }
        let argv = posix::kill_sweep_argv(&self.shell, exec_id, SweepReach::TaggedAndOrphans);
        let docker = self.client().await?;
        exec::run_simple(
            docker,
            sandbox.sandbox_id.as_str(),
            argv,
            posix::KILL_SWEEP_TIMEOUT,
        )
        .await
        .map(drop)
        .map_err(|e| {
            BackendError::Provider(format!("kill sweep in {} failed: {e}", sandbox.sandbox_id))
        })
    }

    async fn collect_orphans(
        &self,
        dead: &HashSet<InstanceId>,
    ) -> Result<Vec<ComputerId>, BackendError> {
        let docker = self.client().await?;
        let filters = HashMap::from([("label".to_owned(), vec![label::INSTANCE.to_owned()])]);
        let options = ListContainersOptionsBuilder::default()
            .all(true)
            .filters(&filters)
            .build();
        let summaries = list_containers(docker, options).await?;
        let mut removed = Vec::new();
        let mut spares = 0;
        for summary in summaries {
            let Some(labels) = summary.labels.as_ref() else {
                continue;
            };
            let temporary =
                labels::parse_temporary(labels.get(label::TEMPORARY).map(String::as_str));
            let instance = labels
                .get(label::INSTANCE)
                .and_then(|i| InstanceId::parse(i));
            let (Some(instance), Some(container)) = (instance, summary.id.as_deref()) else {
                continue;
            };
            if !(temporary && dead.contains(&instance)) {
                continue;
            }
            // A spare never handed out has no computer id: removed, but not a computer.
            let id = summary
                .names
                .iter()
                .flatten()
                .filter_map(|name| claimed_id(labels, name))
                .find_map(|raw| ComputerId::parse_stored(raw).ok());
            if id.is_none() && labels.get(label::COMPUTER_ID).is_some() {
                continue;
            }
            self.remove_container(container).await?;
            if let Some(grants) = self.networks.grants() {
                grants.remove(container);
            }
            match id {
                Some(id) => removed.push(id),
                None => spares += 1,
            }
        }
        if spares > 0 {
            info!(spares, "removed warm-pool spares left by a previous server");
        }
        // Networks whose computers are all gone: a temporary computer the engine removed
        // when it stopped, or a server that died before removing them.
        self.networks.release_all_unused(docker, dead).await;
        // Checkpoints of computers that are gone (docs/checkpoints.md).
        self.collect_orphan_checkpoints(dead).await;
        Ok(removed)
    }
}

/// The computer id a container claims, from its labels and its name (with or without the
/// leading `/`): the computer-id label, or for a container born a warm-pool spare, which has
/// none, the name after `kilntainer-` (docs/warm-pool.md, "Labels"). `None` for a spare not
/// handed out and for containers that are not computers.
fn claimed_id<'a>(labels: &'a HashMap<String, String>, name: &'a str) -> Option<&'a str> {
    match labels.get(label::COMPUTER_ID) {
        Some(id) => Some(id),
        None if labels.get(label::POOLED).map(String::as_str) == Some("true") => name
            .trim_start_matches('/')
            .strip_prefix(label::NAME_PREFIX),
        None => None,
    }
}

/// The names of the networks a container is on.
/// The networks a container is on, and the egress volume it mounts (socket wiring), which
/// [`networks::Networks::release`] removes as it removes a network.
fn joined_networks(inspect: &ContainerInspectResponse) -> Vec<String> {
    let networks = inspect
        .network_settings
        .as_ref()
        .and_then(|n| n.networks.as_ref())
        .into_iter()
        .flat_map(|n| n.keys().cloned());
    let volumes = inspect
        .mounts
        .iter()
        .flatten()
        .filter_map(|m| m.name.clone())
        .filter(|name| name.starts_with(networks::EGRESS_NETWORK_PREFIX));
    networks.chain(volumes).collect()
}

fn is_running(inspect: &ContainerInspectResponse) -> bool {
    inspect
        .state
        .as_ref()
        .and_then(|s| s.running)
        .unwrap_or(false)
}

fn status_of(error: &DockerError) -> Option<u16> {
    match error {
        DockerError::DockerResponseServerError { status_code, .. } => Some(*status_code),
        _ => None,
    }
}

/// Attempts at a container listing whose answer did not parse.
const LISTING_ATTEMPTS: u32 = 4;

/// The engine's container list. Podman's compat API briefly reports a container being stopped
/// in the state `stopped`, which is not in Docker's API and so fails bollard's parsing of the
/// whole list; such an answer is asked for again a few times before it counts as a failure.
async fn list_containers(
    docker: &Docker,
    options: bollard::query_parameters::ListContainersOptions,
) -> Result<Vec<bollard::models::ContainerSummary>, BackendError> {
    let mut attempt = 1;
    loop {
        match docker.list_containers(Some(options.clone())).await {
            Ok(summaries) => return Ok(summaries),
            Err(DockerError::JsonDataError { .. }) if attempt < LISTING_ATTEMPTS => {
                tokio::time::sleep(std::time::Duration::from_millis(100 * u64::from(attempt)))
                    .await;
                attempt += 1;
            }
            Err(error) => {
                return Err(BackendError::Provider(format!(
                    "Docker container listing failed: {}",
                    describe(&error)
                )));
            }
        }
    }
}

/// The engine's own message when it sent one, else the client error.
fn describe(error: &DockerError) -> String {
    match error {
        DockerError::DockerResponseServerError { message, .. } => message.trim().to_owned(),
        other => other.to_string(),
    }
}

/// What a Docker engine listening with TLS answers a plain HTTP request.
const TLS_ENGINE_ANSWER: &str = "Client sent an HTTP request to an HTTPS server";

/// An error and its sources, joined with `: ` (bollard's own text hides the cause, e.g. the
/// TLS alert under "client error (Connect)").
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let line = cause.to_string();
        if !text.contains(&line) {
            text.push_str(": ");
            text.push_str(&line);
        }
        source = cause.source();
    }
    text
}

/// Whether a `tcp://` or `http://` address names this machine (plain HTTP is then no exposure).
fn is_loopback_address(endpoint: &str) -> bool {
    let rest = endpoint
        .split_once("://")
        .map_or(endpoint, |(_, rest)| rest);
    let authority = rest.split('/').next().unwrap_or_default();
    let host = match authority.strip_prefix('[') {
        Some(bracketed) => bracketed.split(']').next().unwrap_or_default(),
        None => authority
            .rsplit_once(':')
            .map_or(authority, |(host, _)| host),
    };
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn loopback_addresses_are_told_from_remote_ones() {
        for local in [
            "tcp://127.0.0.1:2375",
            "http://localhost:1",
            "tcp://[::1]:2375",
            "tcp://127.9.0.1",
        ] {
            assert!(is_loopback_address(local), "{local}");
        }
        for remote in [
            "tcp://10.0.0.5:2375",
            "tcp://engine.example:2376",
            "http://[2001:db8::1]:2375",
            "tcp://127.0.0.1.example:1",
        ] {
            assert!(!is_loopback_address(remote), "{remote}");
        }
    }

    #[test]
    fn an_error_shows_its_causes_once() {
        #[derive(Debug, thiserror::Error)]
        #[error("client error (Connect)")]
        struct Connect(#[source] std::io::Error);
        let tls = std::io::Error::other("invalid peer certificate: UnknownIssuer");
        let error = DockerError::IOError {
            err: std::io::Error::other(Connect(tls)),
        };
        assert_eq!(
            error_chain(&error),
            "client error (Connect): invalid peer certificate: UnknownIssuer"
        );
    }

    #[test]
    fn a_computer_is_named_by_its_label_and_a_handed_out_spare_by_its_name() {
        let reference = labels(&[(label::COMPUTER_ID, "dev-box")]);
        assert_eq!(claimed_id(&reference, "/kilntainer-other"), Some("dev-box"));
        let spare = labels(&[(label::POOLED, "true")]);
        assert_eq!(
            claimed_id(&spare, "/kilntainer-amber-otter-1a2b"),
            Some("amber-otter-1a2b")
        );
        assert_eq!(claimed_id(&spare, "kilntainer-x"), Some("x"));
        // Not handed out yet: no computer at all.
        assert_eq!(
            claimed_id(&spare, "/kilntainers-spare-0123456789abcdef"),
            None
        );
        // Neither label: someone else's container.
        assert_eq!(claimed_id(&labels(&[]), "/kilntainer-x"), None);
        assert_eq!(
            claimed_id(&labels(&[(label::POOLED, "no")]), "/kilntainer-x"),
            None
        );
    }
}
