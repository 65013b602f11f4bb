//! The networks computers join (docs/auth.md, "Network"). With one principal (stdio, a single
//! token) a computer joins the engine's default network, as the Python reference's do. When
//! more than one principal can exist, each principal's computers join a bridge network of that
//! principal's own, so that no principal's computer can reach, scan or impersonate another's:
//! the engine keeps user-defined bridges apart (Docker by default, Podman with `isolate`).
//!
//! A principal's network is made on first use and removed with the last container on it; it is
//! found by name and label, so another server process on the same engine shares it. Warm-pool
//! spares wait on an internal network of their own and move to their owner's when handed out.
//! Computers made before principals existed are moved from the default network to their
//! owner's the first time they are started or attached.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, OnceLock};

use bollard::Docker;
use bollard::models::{
    ContainerInspectResponse, NetworkConnectRequest, NetworkCreateRequest,
    NetworkDisconnectRequest, VolumeCreateRequest,
};
use bollard::query_parameters::{
    ListContainersOptionsBuilder, ListNetworksOptionsBuilder, ListVolumesOptionsBuilder,
    RemoveContainerOptionsBuilder, RemoveVolumeOptions,
};
use tokio::sync::{OwnedRwLockReadGuard, RwLock};
use tracing::{debug, info, warn};

use super::{describe, status_of};
use crate::config::{ComputerNetwork, Engine};
use crate::egress::{self, Asking, Attached, Proxy};
use kilntainers_backend::BackendError;
use kilntainers_backend::brokering::SecretBook;
use kilntainers_backend::egress::{EgressPolicy, EgressSettings};
use kilntainers_backend::ids::{ComputerId, InstanceId, Principal};
use kilntainers_backend::labels::docker as label;

/// Names of the networks this server makes; the rest of the name is the principal's hash.
pub(super) const PRINCIPAL_NETWORK_PREFIX: &str = "kilntainers-net-";
/// Names of a principal's internal networks under an egress policy (docs/egress.md, "The
/// proxy"): never the same as [`PRINCIPAL_NETWORK_PREFIX`]'s, so a network made without the
/// proxy is never taken for one behind it.
pub(super) const EGRESS_NETWORK_PREFIX: &str = "kilntainers-egress-";
/// Where warm-pool spares wait for an owner: internal (no route out), owned by nobody.
const POOL_NETWORK: &str = "kilntainers-pool";
/// `kilntainers.network` on a principal's network.
const KIND_PRINCIPAL: &str = "principal";
/// `kilntainers.network` on the spares' network.
const KIND_POOL: &str = "pool";

/// How computers reach their egress proxy (docs/egress.md, "Socket wiring").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Wiring {
    /// The computers of a principal share an internal bridge network with their proxy, which
    /// tells them apart by address.
    Network,
    /// A computer has no network at all; a relay inside it carries its loopback connections to
    /// the proxy's Unix socket on a volume of the principal's, and names the computer by a token
    /// of its own. Used where bridged traffic between containers cannot be counted on: Podman
    /// (a host firewall shared with Docker drops it, and the host keeps an address on an
    /// internal bridge) and gVisor (whose netstack runs with `--network=none` here).
    Socket,
}

impl Wiring {
    /// The wiring for this engine and runtime.
    pub(super) fn for_engine(engine: Engine, runtime: Option<&str>) -> Self {
        if engine == Engine::Podman || runtime.is_some_and(|r| r.contains("runsc")) {
            Self::Socket
        } else {
            Self::Network
        }
    }
}

/// The network a new container is created on, and what keeps that network from being
/// removed before the container exists.
pub(super) struct Placement {
    /// `HostConfig.NetworkMode`: `None` for the engine's default network.
    pub network_mode: Option<String>,
    /// The egress proxy guarding the network, when the server has an egress policy.
    pub proxy: Option<Arc<Proxy>>,
    /// With [`Wiring::Socket`]: the volume holding the proxy's socket, mounted into the
    /// computer (which then has no network).
    pub socket_volume: Option<String>,
    /// Open mode with secrets ([`Networks::beside`]): the proxy's network, joined after the
    /// container is created on its own.
    pub also_join: Option<String>,
    _hold: Option<OwnedRwLockReadGuard<()>>,
    _beside_hold: Option<OwnedRwLockReadGuard<()>>,
}

impl Placement {
    /// A network that needs no proxy and no hold: `none`, or the engine's default (`None`).
    fn unheld(network_mode: Option<String>) -> Self {
        Self {
            network_mode,
            proxy: None,
            socket_volume: None,
            also_join: None,
            _hold: None,
            _beside_hold: None,
        }
    }
}

pub(super) struct Networks {
    mode: ComputerNetwork,
    engine: Engine,
    gates: Mutex<HashMap<String, Arc<Gate>>>,
    /// Set when computers run behind the egress proxy: every principal's computers then join
    /// an internal network of its own with a proxy on it.
    egress: Option<EgressSettings>,
    /// The proxies this process started or took over, by network name.
    proxies: Mutex<HashMap<String, Arc<Proxy>>>,
    /// This server process (docs/decisions.md, "Crash recovery"), known from its first
    /// placement: the networks it makes carry it, so that a sweep tells one another live
    /// server is still setting up from one left behind ([`Networks::release_all_unused`]).
    instance: OnceLock<InstanceId>,
    /// Where the proxies' questions go (with `--egress-ask`).
    asking: Option<Asking>,
    /// The hosts people allowed per computer, whenever computers run behind the proxy
    /// (ask-to-allow and the dashboard add them; docs/egress.md, "Dashboard").
    grants: Option<egress::Grants>,
    /// How computers reach their proxy.
    wiring: Wiring,
    /// The secrets each proxy brokers for its computers (docs/secrets.md).
    secrets: SecretBook,
    /// `--egress open` without rules, with secrets (docs/secrets.md, "Open mode"): a computer
    /// keeps the network it would have without the proxy, and joins its principal's proxy
    /// network beside it, for the requests that name the proxy.
    beside: bool,
}

/// This process's coordination around one network name.
#[derive(Default)]
struct Gate {
    /// Containers being placed on the network hold it shared; the removal of the network when
    /// it looks empty holds it exclusively, so this process never removes a network under a
    /// container it is creating. Another process that does is caught by
    /// [`Networks::place`]'s callers, which ask again (`NetworkMissing`).
    in_use: Arc<RwLock<()>>,
    /// One lookup-or-create at a time: concurrent first computers of one principal would
    /// otherwise each create the network, and Docker 20.10 accepts the second of a name.
    making: tokio::sync::Mutex<()>,
}

impl Networks {
    pub(super) fn new(
        mode: ComputerNetwork,
        engine: Engine,
        egress: &EgressSettings,
        asking: Option<Asking>,
        grants: egress::Grants,
        wiring: Wiring,
        secrets: &SecretBook,
    ) -> Self {
        // Brokering alone puts computers behind the proxy too (docs/secrets.md, "Egress modes").
        let beside = mode != ComputerNetwork::Disabled
            && secrets.enabled()
            && !egress.filters()
            && wiring == Wiring::Network;
        let egress = (mode != ComputerNetwork::Disabled && (egress.filters() || secrets.enabled()))
            .then(|| egress.clone());
        Self {
            // Behind the proxy every computer needs an internal network, one principal or many;
            // beside it, the computer's own network stays what it would be.
            mode: if egress.is_some() && !beside {
                ComputerNetwork::PerPrincipal
            } else {
                mode
            },
            engine,
            gates: Mutex::new(HashMap::new()),
            proxies: Mutex::new(HashMap::new()),
            instance: OnceLock::new(),
            grants: egress.is_some().then_some(grants),
            egress,
            asking,
            wiring,
            secrets: secrets.clone(),
            beside,
        }
    }

    /// Whether computers keep their own network and join the proxy's beside it.
    pub(super) fn beside(&self) -> bool {
        self.beside
    }

    /// Whether computers behind the proxy reach it through a socket ([`Wiring::Socket`]).
    pub(super) fn socket_wired(&self) -> bool {
        self.egress.is_some() && self.wiring == Wiring::Socket
    }

    /// The hosts people allowed per computer, when computers run behind the proxy.
    pub(super) fn grants(&self) -> Option<&egress::Grants> {
        self.grants.as_ref()
    }

    /// A recorded policy with the computer's grants added.
    fn with_grants(&self, container: &str, policy: EgressPolicy) -> EgressPolicy {
        match self.grants() {
            Some(grants) => grants.apply(container, policy),
            None => policy,
        }
    }

    /// Whether computers run behind the egress proxy.
    pub(super) fn egress(&self) -> bool {
        self.egress.is_some()
    }

    /// The network a computer of `owner` joins when networks are per principal.
    fn network_of(&self, owner: &Principal) -> String {
        if self.egress.is_some() {
            format!("{EGRESS_NETWORK_PREFIX}{}", owner.digest_tag())
        } else {
            principal_network(owner)
        }
    }

    /// This process's proxy of `network`, while its control channel lives. One whose channel
    /// ended (another server process on the engine replaced it, or it stopped) is forgotten,
    /// so the next use starts one again rather than talk into the void.
    fn proxy(&self, network: &str) -> Option<Arc<Proxy>> {
        let mut proxies = self
            .proxies
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if proxies.get(network).is_some_and(|p| !p.is_connected()) {
            proxies.remove(network);
        }
        proxies.get(network).cloned()
    }

    pub(super) fn per_principal(&self) -> bool {
        self.mode == ComputerNetwork::PerPrincipal
    }

    fn gate(&self, name: &str) -> Arc<Gate> {
        let mut gates = self
            .gates
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        gates.entry(name.to_owned()).or_default().clone()
    }

    /// Where a new computer of `owner`, made by server process `instance`, goes.
    pub(super) async fn place(
        &self,
        docker: &Docker,
        owner: &Principal,
        instance: &InstanceId,
    ) -> Result<Placement, BackendError> {
        let _ = self.instance.set(instance.clone());
        self.place_for(docker, owner).await
    }

    /// Where a computer of `owner` goes: [`Networks::place`], and where a spare handed out or a
    /// computer from before principals moves to.
    async fn place_for(
        &self,
        docker: &Docker,
        owner: &Principal,
    ) -> Result<Placement, BackendError> {
        if self.beside {
            let proxied = self
                .hold(docker, &self.network_of(owner), Some(owner), true)
                .await?;
            let mut own = match self.mode {
                ComputerNetwork::PerPrincipal => {
                    self.hold(docker, &principal_network(owner), Some(owner), false)
                        .await?
                }
                _ => Placement::unheld(None),
            };
            own.also_join = proxied.network_mode;
            own.proxy = proxied.proxy;
            own._beside_hold = proxied._hold;
            return Ok(own);
        }
        match self.mode {
            ComputerNetwork::Disabled => Ok(Placement::unheld(Some("none".to_owned()))),
            ComputerNetwork::EngineDefault => Ok(Placement::unheld(None)),
            ComputerNetwork::PerPrincipal => {
                let name = self.network_of(owner);
                self.hold(docker, &name, Some(owner), true).await
            }
        }
    }

    /// Where a new warm-pool spare of server process `instance` waits.
    pub(super) async fn place_spare(
        &self,
        docker: &Docker,
        instance: &InstanceId,
    ) -> Result<Placement, BackendError> {
        let _ = self.instance.set(instance.clone());
        match self.mode {
            ComputerNetwork::PerPrincipal => self.hold(docker, POOL_NETWORK, None, false).await,
            // Spares are made exactly like the computers they become.
            _ => {
                self.place_for(docker, &Principal::default_principal())
                    .await
            }
        }
    }

    /// Network `name` made when missing and held for a new container; with `with_proxy` (and
    /// an owner) the egress proxy guarding it too.
    async fn hold(
        &self,
        docker: &Docker,
        name: &str,
        owner: Option<&Principal>,
        with_proxy: bool,
    ) -> Result<Placement, BackendError> {
        let gate = self.gate(name);
        let hold = gate.in_use.clone().read_owned().await;
        let socket = self.socket_wired() && owner.is_some() && with_proxy;
        let (network_mode, proxy) = {
            let _making = gate.making.lock().await;
            let network_mode = if socket {
                // No network: the proxy is reached through the volume's socket.
                ensure_volume(docker, name, owner).await?;
                "none".to_owned()
            } else {
                self.ensure(docker, name, owner).await?
            };
            let proxy = match (&self.egress, owner) {
                (Some(settings), Some(_)) if with_proxy => {
                    Some(self.ensure_proxy(docker, name, settings).await?)
                }
                _ => None,
            };
            (network_mode, proxy)
        };
        Ok(Placement {
            network_mode: Some(network_mode),
            proxy,
            socket_volume: socket.then(|| name.to_owned()),
            also_join: None,
            _hold: Some(hold),
            _beside_hold: None,
        })
    }

    /// The proxy of egress network `name`: this process's, or a new one. A proxy container
    /// left by another server process or a crash is replaced (this process cannot read its
    /// control channel's past), and the policies of the computers already on the network are
    /// given to the new one from their labels.
    async fn ensure_proxy(
        &self,
        docker: &Docker,
        name: &str,
        settings: &EgressSettings,
    ) -> Result<Arc<Proxy>, BackendError> {
        if let Some(proxy) = self.proxy(name) {
            return Ok(proxy);
        }
        let upstream = match self.engine {
            Engine::Docker => "bridge",
            Engine::Podman => "podman",
        };
        // Another server process of the principal on the engine may replace the proxy at the
        // same moment (docs/egress.md, "Docker wiring"), removing the one made here before it
        // starts: made again once.
        let mut attempts = 0;
        let proxy = loop {
            attempts += 1;
            remove_proxy_container(docker, name).await;
            let started = Proxy::start(
                docker,
                name,
                settings,
                upstream,
                self.asking.clone(),
                self.wiring,
                self.secrets.clone(),
            )
            .await;
            match started {
                Ok(proxy) => break Arc::new(proxy),
                Err(error) if attempts < 2 => {
                    warn!(network = name, %error, "egress proxy not started; making it again");
                }
                Err(error) => return Err(error),
            }
        };
        for (address, mut attached) in recorded_policies(docker, name, self.wiring).await? {
            attached.policy = self.with_grants(&attached.container, attached.policy);
            proxy.attach(address, attached).await?;
        }
        // Every policy applied before the first connection through the new proxy.
        proxy.sync().await;
        self.proxies
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .insert(name.to_owned(), Arc::clone(&proxy));
        Ok(proxy)
    }

    /// Gives every computer behind this process's proxies its secrets (and its policy with the
    /// hosts they are bound to) again, after the book changed.
    pub(super) async fn resend_secrets(&self) {
        let proxies: Vec<Arc<Proxy>> = self
            .proxies
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .values()
            .cloned()
            .collect();
        for proxy in proxies {
            if let Err(error) = proxy.reattach_all().await {
                warn!(%error, "could not give an egress proxy the new secrets");
            }
        }
    }

    /// Gives the proxy of the egress network `inspect`'s container is on that container's
    /// recorded policy at its current address (which changes when it restarts); returns the
    /// proxy and the address. A computer made without the proxy is refused rather than left
    /// open.
    pub(super) async fn apply_policy(
        &self,
        docker: &Docker,
        inspect: &ContainerInspectResponse,
        fallback: &EgressPolicy,
    ) -> Result<Option<(Arc<Proxy>, IpAddr)>, BackendError> {
        let Some(settings) = &self.egress else {
            return Ok(None);
        };
        let computer = inspect
            .name
            .as_deref()
            .unwrap_or("?")
            .trim_start_matches('/');
        let container = inspect.id.clone().unwrap_or_default();
        let labels = inspect.config.as_ref().and_then(|c| c.labels.as_ref());
        let made_without = || {
            BackendError::Provider(format!(
                "container {computer} was made without the egress proxy this server enforces (docs/egress.md); delete that computer, or run the server with --egress open."
            ))
        };
        let (network, address, token) = match self.wiring {
            Wiring::Network => {
                let joined = inspect
                    .network_settings
                    .as_ref()
                    .and_then(|n| n.networks.as_ref());
                let on_egress = joined.and_then(|n| {
                    n.iter()
                        .find(|(name, _)| name.starts_with(EGRESS_NETWORK_PREFIX))
                        .map(|(name, endpoint)| (name.clone(), endpoint.ip_address.clone()))
                });
                let Some((network, Some(address))) = on_egress else {
                    return Err(made_without());
                };
                let address: IpAddr = address.parse().map_err(|_| {
                    BackendError::Provider(format!(
                        "container {computer} has no usable address on network {network}"
                    ))
                })?;
                (network, address, None)
            }
            Wiring::Socket => {
                let volume = inspect
                    .mounts
                    .iter()
                    .flatten()
                    .filter_map(|m| m.name.as_deref())
                    .find(|name| name.starts_with(EGRESS_NETWORK_PREFIX))
                    .map(str::to_owned);
                let token = labels
                    .and_then(|l| l.get(egress::TOKEN_LABEL))
                    .filter(|t| egress::is_token(t))
                    .cloned();
                let (Some(volume), Some(token), Some(key)) =
                    (volume, token, egress::socket_key(&container))
                else {
                    return Err(made_without());
                };
                (volume, key, Some(token))
            }
        };
        let policy = match inspect
            .config
            .as_ref()
            .and_then(|c| c.labels.as_ref())
            .and_then(|l| l.get(egress::POLICY_LABEL))
        {
            Some(text) => EgressPolicy::from_label(text)
                .map_err(|e| BackendError::Provider(format!("container {computer}: {e}")))?,
            None => fallback.clone(),
        };
        let policy = self.with_grants(&container, policy);
        let computer_id = labels
            .and_then(|l| super::claimed_id(l, inspect.name.as_deref().unwrap_or_default()))
            .and_then(|raw| ComputerId::parse_stored(raw).ok())
            .ok_or_else(|| {
                BackendError::Provider(format!("container {computer} names no computer"))
            })?;
        let proxy = match self.proxy(&network) {
            Some(proxy) => proxy,
            None => {
                let gate = self.gate(&network);
                let _making = gate.making.lock().await;
                self.ensure_proxy(docker, &network, settings).await?
            }
        };
        let attached = Attached {
            computer_id,
            container,
            policy,
            token,
        };
        proxy.attach(address, attached).await?;
        // Applied before the computer's first connection (the proxy reads lines in order).
        proxy.sync().await;
        Ok(Some((proxy, address)))
    }

    /// Network `name`, made when missing, as a container's `NetworkMode` names it.
    ///
    /// Docker: its id. Docker 20.10 accepts a second network of the same name (API 1.41 checks
    /// duplicates only when asked, and bollard's request cannot ask); this process makes the
    /// name once ([`Gate::making`]), and [`Networks::one_of`] removes what another process
    /// made at the same moment.
    ///
    /// Podman: its name, and the network is never read back through the Docker-compatible
    /// API. Podman refuses duplicate names, and Podman 4.3 drops a network's `isolate` option
    /// from its memory when the compatible API lists or inspects that network (and joins a
    /// container named by the network's id without it), after which new containers on it are
    /// not kept apart (measured; docs/auth.md, "Network").
    async fn ensure(
        &self,
        docker: &Docker,
        name: &str,
        owner: Option<&Principal>,
    ) -> Result<String, BackendError> {
        if self.engine == Engine::Docker
            && let Some(id) = self.one_of(docker, name).await?
        {
            return Ok(id);
        }
        let egress_network =
            self.egress.is_some() && owner.is_some() && name.starts_with(EGRESS_NETWORK_PREFIX);
        let mut labels = HashMap::from([
            (label::MANAGED.to_owned(), "true".to_owned()),
            (
                label::NETWORK.to_owned(),
                if owner.is_some() {
                    KIND_PRINCIPAL
                } else {
                    KIND_POOL
                }
                .to_owned(),
            ),
        ]);
        if let Some(owner) = owner {
            labels.insert(label::OWNER.to_owned(), owner.to_string());
        }
        if let Some(instance) = self.instance.get() {
            labels.insert(label::INSTANCE.to_owned(), instance.to_string());
        }
        // Podman keeps bridge networks apart only when asked to; Docker always does.
        let options = (self.engine == Engine::Podman)
            .then(|| HashMap::from([("isolate".to_owned(), "true".to_owned())]));
        let request = if egress_network {
            // Internal, without a host address on the bridge (docs/egress.md, "The proxy").
            let mut request = egress::network_request(name, None);
            if let Some(extra) = options {
                request.options.get_or_insert_default().extend(extra);
            }
            request.labels.get_or_insert_default().extend(labels);
            request
        } else {
            NetworkCreateRequest {
                name: name.to_owned(),
                driver: Some("bridge".to_owned()),
                internal: Some(owner.is_none()),
                labels: Some(labels),
                options,
                ..Default::default()
            }
        };
        match docker.create_network(request.clone()).await {
            Ok(_) => info!(network = name, "network created"),
            Err(e) if already_exists(&e) => {
                // Podman: an empty network left from before (a crash) may have lost its
                // isolation in the engine's memory; made again, it has it.
                if self.engine == Engine::Podman && !in_use(docker, name).await? {
                    let _ = docker.remove_network(name).await;
                    match docker.create_network(request).await {
                        Ok(_) => info!(network = name, "network created again"),
                        Err(e) if already_exists(&e) => {}
                        Err(e) => return Err(create_failed(name, &describe(&e))),
                    }
                }
            }
            Err(e) => return Err(create_failed(name, &describe(&e))),
        }
        if self.engine == Engine::Podman {
            return Ok(name.to_owned());
        }
        self.one_of(docker, name).await?.ok_or_else(|| {
            BackendError::Provider(format!(
                "Docker network '{name}' vanished right after it was created; try again."
            ))
        })
    }

    /// The lowest id of the networks named `name` (Docker). Should another server on the
    /// engine have made the name a second time at the same moment, the empty ones of the
    /// others are removed: Docker 20.10 resolves a container's networks by name when it
    /// starts it, and refuses a name that is ambiguous.
    async fn one_of(&self, docker: &Docker, name: &str) -> Result<Option<String>, BackendError> {
        let mut ids = find(docker, name).await?;
        ids.sort();
        for extra in ids.iter().skip(1) {
            if !in_use(docker, extra).await? {
                match docker.remove_network(extra).await {
                    Ok(()) => {
                        info!(network = name, id = %extra, "removed a second network of the same name")
                    }
                    Err(e) => {
                        debug!(network = name, error = %describe(&e), "second network not removed")
                    }
                }
            }
        }
        Ok(ids.into_iter().next())
    }

    /// Moves a spare handed to `owner` from the spares' network to the owner's.
    pub(super) async fn hand_over(
        &self,
        docker: &Docker,
        container: &str,
        owner: &Principal,
    ) -> Result<(), BackendError> {
        if !self.per_principal() {
            return Ok(());
        }
        let placement = self.place_for(docker, owner).await?;
        let target = placement.network_mode.unwrap_or_default();
        self.move_container(docker, container, &target, POOL_NETWORK)
            .await
    }

    /// Moves a computer made before principals existed (on the engine's default network) to
    /// its owner's network, so that no computer stays reachable from another principal's.
    /// Computers on a network the operator chose, or without network, stay where they are.
    pub(super) async fn adopt_legacy(
        &self,
        docker: &Docker,
        inspect: &ContainerInspectResponse,
    ) -> Result<(), BackendError> {
        if !self.per_principal() {
            return Ok(());
        }
        let mode = inspect
            .host_config
            .as_ref()
            .and_then(|h| h.network_mode.as_deref())
            .unwrap_or("default");
        let joined = inspect
            .network_settings
            .as_ref()
            .and_then(|n| n.networks.as_ref());
        // The engine's default network: Docker's `bridge`, Podman's `podman`.
        let default_network = match self.engine {
            Engine::Docker => "bridge",
            Engine::Podman => "podman",
        };
        let on_default = joined.is_some_and(|n| n.contains_key(default_network));
        if !matches!(mode, "default" | "bridge") || !on_default {
            return Ok(());
        }
        let (Some(container), Some(labels)) = (
            inspect.id.as_deref(),
            inspect.config.as_ref().and_then(|c| c.labels.as_ref()),
        ) else {
            return Ok(());
        };
        let owner = labels
            .get(label::OWNER)
            .and_then(|o| Principal::parse(o))
            .unwrap_or_else(Principal::default_principal);
        let placement = self.place_for(docker, &owner).await?;
        let target = placement.network_mode.unwrap_or_default();
        info!(container, %owner, "moving a computer from the default network to its owner's");
        self.move_container(docker, container, &target, default_network)
            .await
    }

    async fn move_container(
        &self,
        docker: &Docker,
        container: &str,
        to: &str,
        from: &str,
    ) -> Result<(), BackendError> {
        let connect = NetworkConnectRequest {
            container: container.to_owned(),
            endpoint_config: None,
        };
        match docker.connect_network(to, connect).await {
            Ok(()) => {}
            // Already on it (a second attempt after a failed disconnect).
            Err(e) if status_of(&e) == Some(403) && describe(&e).contains("already") => {}
            Err(e) => {
                return Err(BackendError::Provider(format!(
                    "Docker could not connect container {container} to its owner's network: {}",
                    describe(&e)
                )));
            }
        }
        let disconnect = NetworkDisconnectRequest {
            container: container.to_owned(),
            force: Some(true),
        };
        match docker.disconnect_network(from, disconnect).await {
            Ok(()) => Ok(()),
            Err(e) if status_of(&e) == Some(404) => Ok(()),
            Err(e) => Err(BackendError::Provider(format!(
                "Docker could not disconnect container {container} from network '{from}': {}",
                describe(&e)
            ))),
        }
    }

    /// Removes each of this server's networks in `names` that no container (in any state)
    /// is on any more. Failures are logged: a network left over is collected later.
    pub(super) async fn release<'a>(
        &self,
        docker: &Docker,
        names: impl IntoIterator<Item = &'a str>,
    ) {
        for name in names {
            if !is_ours(name) {
                continue;
            }
            let gate = self.gate(name);
            {
                let _exclusive = gate.in_use.write().await;
                if let Err(error) = self.remove_if_unused(docker, name).await {
                    warn!(network = name, %error, "could not remove an unused network");
                }
            }
            // Forget the gate when nobody else holds it, so names do not pile up.
            let mut gates = self
                .gates
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            if gates
                .get(name)
                .is_some_and(|g| Arc::ptr_eq(g, &gate) && Arc::strong_count(g) == 2)
            {
                gates.remove(name);
            }
        }
    }

    /// Removes every network of this server's that has no container left: at startup (after
    /// crash GC) and at shutdown (after the spares). On Podman only those this process used:
    /// listing networks through the compatible API would turn their isolation off (see
    /// [`Networks::ensure`]). On Docker every server's, but not one younger than
    /// [`YOUNG_NETWORK`] made by a server that may be alive: it may have just made it for a
    /// computer it is about to create. Those of this process and of the `finished` ones (crash
    /// GC's dead instances) go whatever their age.
    pub(super) async fn release_all_unused(&self, docker: &Docker, finished: &HashSet<InstanceId>) {
        let names: Vec<String> = match self.engine {
            Engine::Docker => {
                let filters =
                    HashMap::from([("label".to_owned(), vec![label::NETWORK.to_owned()])]);
                let options = ListNetworksOptionsBuilder::default()
                    .filters(&filters)
                    .build();
                let now = chrono::Utc::now();
                match docker.list_networks(Some(options)).await {
                    Ok(networks) => networks
                        .into_iter()
                        .filter(|n| {
                            let maker = n.labels.as_ref().and_then(|l| l.get(label::INSTANCE));
                            let maker_done = maker.is_some_and(|m| {
                                finished.iter().any(|i| i.as_str() == m)
                                    || self.instance.get().is_some_and(|own| own.as_str() == m)
                            });
                            maker_done || !is_young(n.created.as_deref(), now)
                        })
                        .filter_map(|n| n.name)
                        .collect(),
                    Err(error) => {
                        warn!(error = %describe(&error), "could not list this server's networks");
                        return;
                    }
                }
            }
            Engine::Podman => self
                .gates
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .keys()
                .cloned()
                .collect(),
        };
        let mut names = names;
        if self.socket_wired() {
            names.extend(egress_volumes(docker).await);
        }
        self.release(docker, names.iter().map(String::as_str)).await;
    }

    /// Removes network `name` (every network of that name, on Docker) when no container in
    /// any state is on it: a stopped container still needs its network to start again, and
    /// the engine would let the network be removed under it.
    async fn remove_if_unused(&self, docker: &Docker, name: &str) -> Result<(), BackendError> {
        if self.socket_wired() && name.starts_with(EGRESS_NETWORK_PREFIX) {
            return self.remove_volume_if_unused(docker, name).await;
        }
        let networks = match self.engine {
            Engine::Docker => find(docker, name).await?,
            Engine::Podman => vec![name.to_owned()],
        };
        for network in networks {
            if in_use(docker, &network).await? {
                continue;
            }
            if name.starts_with(EGRESS_NETWORK_PREFIX) {
                // The proxy goes with its network's last computer.
                self.proxies
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
                    .remove(name);
                remove_proxy_container(docker, name).await;
            }
            match docker.remove_network(&network).await {
                Ok(()) => info!(network = name, "network removed with its last computer"),
                // Gone already, or a container joined it meanwhile (another process).
                Err(e) if matches!(status_of(&e), Some(403 | 404 | 409)) => {
                    debug!(network = name, error = %describe(&e), "network not removed");
                }
                Err(e) => {
                    return Err(BackendError::Provider(format!(
                        "Docker could not remove network '{name}': {}",
                        describe(&e)
                    )));
                }
            }
        }
        Ok(())
    }

    /// [`Wiring::Socket`]: removes the proxy of volume `name` and then the volume, when no
    /// container but the proxy mounts it.
    async fn remove_volume_if_unused(
        &self,
        docker: &Docker,
        name: &str,
    ) -> Result<(), BackendError> {
        if mounted(docker, name).await? {
            return Ok(());
        }
        self.proxies
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .remove(name);
        remove_proxy_container(docker, name).await;
        match docker
            .remove_volume(name, None::<RemoveVolumeOptions>)
            .await
        {
            Ok(()) => info!(
                volume = name,
                "egress volume removed with its last computer"
            ),
            // Gone already, or mounted again meanwhile (another process).
            Err(e) if matches!(status_of(&e), Some(404 | 409)) => {
                debug!(volume = name, error = %describe(&e), "egress volume not removed");
            }
            Err(e) => {
                return Err(BackendError::Provider(format!(
                    "the engine could not remove volume '{name}': {}",
                    describe(&e)
                )));
            }
        }
        Ok(())
    }
}

/// [`Wiring::Socket`]: the volume holding the proxy's socket for one principal's computers,
/// made when missing (an existing one is kept: its computers mount it).
async fn ensure_volume(
    docker: &Docker,
    name: &str,
    owner: Option<&Principal>,
) -> Result<(), BackendError> {
    let mut labels = HashMap::from([
        (label::MANAGED.to_owned(), "true".to_owned()),
        (egress::PROXY_LABEL.to_owned(), name.to_owned()),
    ]);
    if let Some(owner) = owner {
        labels.insert(label::OWNER.to_owned(), owner.to_string());
    }
    let request = VolumeCreateRequest {
        name: Some(name.to_owned()),
        labels: Some(labels),
        ..Default::default()
    };
    match docker.create_volume(request).await {
        Ok(_) => Ok(()),
        Err(e) if already_exists(&e) => Ok(()),
        Err(e) => Err(BackendError::Provider(format!(
            "the engine could not create volume '{name}' for the egress proxy: {}",
            describe(&e)
        ))),
    }
}

/// The egress volumes ([`Wiring::Socket`]) on the engine, by name.
async fn egress_volumes(docker: &Docker) -> Vec<String> {
    let filters = HashMap::from([("label".to_owned(), vec![egress::PROXY_LABEL.to_owned()])]);
    let options = ListVolumesOptionsBuilder::default()
        .filters(&filters)
        .build();
    match docker.list_volumes(Some(options)).await {
        Ok(list) => list
            .volumes
            .into_iter()
            .flatten()
            .map(|v| v.name)
            .filter(|name| name.starts_with(EGRESS_NETWORK_PREFIX))
            .collect(),
        Err(error) => {
            warn!(error = %describe(&error), "could not list the egress volumes");
            Vec::new()
        }
    }
}

/// `kilntainers-net-<the principal's digest tag>` ([`Principal::digest_tag`]).
/// How long a new network is left alone by the sweeps of other servers: longer than any
/// server takes from making a network to creating and starting its computer on it.
const YOUNG_NETWORK: chrono::TimeDelta = chrono::TimeDelta::seconds(120);

/// Whether a network created at `created` (the engine's RFC 3339 time) is younger than
/// [`YOUNG_NETWORK`]; a time that does not parse counts as old.
fn is_young(created: Option<&str>, now: chrono::DateTime<chrono::Utc>) -> bool {
    created
        .and_then(|c| chrono::DateTime::parse_from_rfc3339(c).ok())
        .is_some_and(|c| now.signed_duration_since(c) < YOUNG_NETWORK)
}

pub(super) fn principal_network(owner: &Principal) -> String {
    format!("{PRINCIPAL_NETWORK_PREFIX}{}", owner.digest_tag())
}

fn is_ours(name: &str) -> bool {
    name == POOL_NETWORK
        || name.starts_with(PRINCIPAL_NETWORK_PREFIX)
        || name.starts_with(EGRESS_NETWORK_PREFIX)
}

/// Removes the proxy container of egress network `network`, if there is one.
async fn remove_proxy_container(docker: &Docker, network: &str) {
    let options = RemoveContainerOptionsBuilder::default().force(true).build();
    match docker
        .remove_container(&egress::proxy_name(network), Some(options))
        .await
    {
        Ok(()) => info!(network, "egress proxy removed"),
        Err(e) if status_of(&e) == Some(404) => {}
        Err(e) => warn!(network, error = %describe(&e), "could not remove an egress proxy"),
    }
}

/// The address, computer and recorded policy of each container on egress network `network`
/// (the proxy itself excluded).
async fn recorded_policies(
    docker: &Docker,
    network: &str,
    wiring: Wiring,
) -> Result<Vec<(IpAddr, Attached)>, BackendError> {
    let joined = match wiring {
        Wiring::Network => "network",
        Wiring::Socket => "volume",
    };
    let filters = HashMap::from([
        (joined.to_owned(), vec![network.to_owned()]),
        ("label".to_owned(), vec![egress::POLICY_LABEL.to_owned()]),
    ]);
    let options = ListContainersOptionsBuilder::default()
        .all(true)
        .filters(&filters)
        .build();
    let mut found = Vec::new();
    for summary in super::list_containers(docker, options).await? {
        let token = summary
            .labels
            .as_ref()
            .and_then(|l| l.get(egress::TOKEN_LABEL))
            .filter(|t| egress::is_token(t))
            .cloned();
        let address = match wiring {
            Wiring::Network => summary
                .network_settings
                .as_ref()
                .and_then(|s| s.networks.as_ref())
                .and_then(|n| n.get(network))
                .and_then(|e| e.ip_address.as_deref())
                .and_then(|ip| ip.parse::<IpAddr>().ok()),
            Wiring::Socket => summary
                .id
                .as_deref()
                .and_then(egress::socket_key)
                .filter(|_| token.is_some()),
        };
        let policy = summary
            .labels
            .as_ref()
            .and_then(|l| l.get(egress::POLICY_LABEL))
            .and_then(|text| EgressPolicy::from_label(text).ok());
        let computer_id = summary.labels.as_ref().and_then(|labels| {
            summary
                .names
                .iter()
                .flatten()
                .filter_map(|name| super::claimed_id(labels, name))
                .find_map(|raw| ComputerId::parse_stored(raw).ok())
        });
        if let (Some(address), Some(policy), Some(computer_id), Some(container)) =
            (address, policy, computer_id, summary.id.clone())
        {
            let attached = Attached {
                computer_id,
                container,
                policy,
                token,
            };
            found.push((address, attached));
        }
    }
    Ok(found)
}

/// The ids of this server's networks named exactly `name` (the engine's filter matches
/// substrings).
async fn find(docker: &Docker, name: &str) -> Result<Vec<String>, BackendError> {
    let filters = HashMap::from([
        ("name".to_owned(), vec![name.to_owned()]),
        ("label".to_owned(), vec![label::NETWORK.to_owned()]),
    ]);
    let options = ListNetworksOptionsBuilder::default()
        .filters(&filters)
        .build();
    let networks = docker.list_networks(Some(options)).await.map_err(|e| {
        BackendError::Provider(format!("Docker network listing failed: {}", describe(&e)))
    })?;
    Ok(networks
        .into_iter()
        .filter(|n| n.name.as_deref() == Some(name))
        .filter_map(|n| n.id)
        .collect())
}

/// Whether any container, in any state, is on network `network` (a name or an id); an egress
/// proxy does not count, as it exists for the others.
async fn in_use(docker: &Docker, network: &str) -> Result<bool, BackendError> {
    used_by_a_computer(docker, "network", network).await
}

/// Whether any container, in any state, mounts volume `name`; the proxy does not count.
async fn mounted(docker: &Docker, name: &str) -> Result<bool, BackendError> {
    used_by_a_computer(docker, "volume", name).await
}

/// Whether any container but an egress proxy matches the list filter `key=value`.
async fn used_by_a_computer(docker: &Docker, key: &str, value: &str) -> Result<bool, BackendError> {
    let filters = HashMap::from([(key.to_owned(), vec![value.to_owned()])]);
    let options = ListContainersOptionsBuilder::default()
        .all(true)
        .filters(&filters)
        .build();
    Ok(super::list_containers(docker, options)
        .await?
        .iter()
        .any(|c| {
            c.labels
                .as_ref()
                .is_none_or(|l| !l.contains_key(egress::PROXY_LABEL))
        }))
}

/// A network of that name exists: Docker answers 409, Podman 500 with "already used".
fn already_exists(error: &bollard::errors::Error) -> bool {
    status_of(error) == Some(409)
        || (status_of(error).is_some() && describe(error).contains("already"))
}

fn create_failed(name: &str, detail: &str) -> BackendError {
    let mut message = format!("Docker could not create network '{name}': {detail}");
    // Docker's default address pools hold about 30 bridge networks.
    if detail.contains("address pool") || detail.contains("non-overlapping") {
        message.push_str(
            "\nEach principal's computers get a network of their own, and the engine has no address range left for another. Give the engine more ranges (\"default-address-pools\" in /etc/docker/daemon.json, e.g. {\"base\": \"10.128.0.0/9\", \"size\": 24}) or remove unused networks (docker network prune).",
        );
    }
    BackendError::Provider(message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_network_is_young_for_two_minutes_after_its_creation() {
        let now = chrono::DateTime::parse_from_rfc3339("2026-12-07T21:10:28Z")
            .unwrap()
            .to_utc();
        // Docker's form (nanoseconds, UTC) and an offset, as other engines write it.
        assert!(is_young(Some("2026-12-07T21:09:00.123456789Z"), now));
        assert!(is_young(Some("2026-12-07T22:09:00+01:00"), now));
        assert!(!is_young(Some("2026-12-07T21:08:27Z"), now));
        assert!(!is_young(Some("yesterday"), now));
        assert!(!is_young(None, now));
    }

    #[test]
    fn a_principal_network_is_named_by_a_hash_of_the_principal() {
        let alice = Principal::parse("alice").unwrap();
        let name = principal_network(&alice);
        // sha256("alice") = 2bd806c9...
        assert_eq!(name, "kilntainers-net-2bd806c97f0e00af");
        assert!(is_ours(&name));
        assert!(is_ours(POOL_NETWORK));
        assert!(!is_ours("bridge"));
        assert_ne!(
            principal_network(&Principal::default_principal()),
            principal_network(&alice)
        );
    }
}
