//! Port routes (docs/files.md, "Ports"): what `port_url` hands out for a port in a computer, and
//! the one way this process opens a connection to such a port, which every route shares.
//!
//! Two kinds of route, by transport:
//!
//! - **Over stdio**, a loopback forwarder per (computer, port): it accepts on
//!   `127.0.0.1:<ephemeral>` and, for each connection, finds the computer again by id (so it keeps
//!   working across restarts and factory resets) and asks the backend for a stream to the port.
//! - **Over HTTP**, no listener of its own: a [`PortKey`], 128 random bits that name the port's
//!   own origin on the HTTP listener (`p<port>-<key>.localhost`, served by the transport's port
//!   proxy). A loopback forwarder would take no credential, and anything that reaches the
//!   machine's loopback (a computer with host networking, a neighbouring container) could use
//!   it; the key is the credential, and a host name of its own keeps the port's pages off the
//!   server's origin.
//!
//! Both live until the registry removes the computer, or the process ends. Neither starts or
//! creates a computer: a stopped one refuses connections.
//!
//! **Architecture invariant:** no MCP or HTTP types here; providers only through `dyn Backend`.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError, Weak};

use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::{CancellationToken, DropGuard};
use tracing::{debug, info};

use crate::backends::{BackendError, PortRoute, PortStream, SandboxRef};
use crate::ids::ComputerId;
use crate::registry::{AwakeGuard, Registry, RegistryError, Removal};

/// Connections one forwarder carries at once; each may hold a Docker exec, so a page that
/// opens hundreds of sockets cannot pile up work in the engine.
const CONNECTIONS_PER_FORWARDER: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum PortError {
    #[error("Computer '{}' was not found.", .0.slug())]
    NotFound(ComputerId),
    #[error("Cannot listen on a loopback port for the forwarder: {0}")]
    Listen(std::io::Error),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    Registry(RegistryError),
}

impl From<RegistryError> for PortError {
    fn from(error: RegistryError) -> Self {
        match error {
            RegistryError::NotFound(id) => Self::NotFound(id),
            RegistryError::Backend(error) => Self::Backend(error),
            other => Self::Registry(other),
        }
    }
}

/// Where `port_url` sends a browser.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PortUrl {
    /// This process's forwarder on the loopback address (stdio).
    Forwarded(SocketAddr),
    /// The URL of the port's own origin on the HTTP listener, its key in the host name.
    Origin(String),
    /// The provider's URL; `public` = anyone who has it reaches the port.
    Provider { url: String, public: bool },
}

/// The unguessable name of one (computer, port) on the HTTP listener: 128 bits from the
/// thread's CSPRNG as 32 lowercase hex digits, so that the host label `p<port>-<key>` fits
/// DNS's 63 bytes.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct PortKey(String);

impl PortKey {
    const LEN: usize = 32;

    fn random() -> Self {
        Self(format!("{:032x}", rand::random::<u128>()))
    }

    /// The first label of the port's host name.
    fn label(&self, port: u16) -> String {
        format!("p{port}-{}", self.0)
    }

    /// The port and key of a host name's first label (`p<port>-<key>`), else `None`.
    fn from_label(label: &str) -> Option<(u16, Self)> {
        let (port, key) = label.strip_prefix('p')?.split_once('-')?;
        let port = port.parse().ok()?;
        let key_ok =
            key.len() == Self::LEN && key.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
        key_ok.then(|| (port, Self(key.to_owned())))
    }
}

/// Where the HTTP listener serves ports' own origins: `http://p<port>-<key>.<domain>:<port>/`.
#[derive(Debug, Clone)]
pub struct OriginNames {
    /// `localhost` (browsers resolve its subdomains to loopback themselves), or the name the
    /// listener is bound to.
    pub domain: String,
    pub listener_port: u16,
}

/// The keys handed out, both ways.
#[derive(Default)]
struct Origins {
    by_key: HashMap<PortKey, (ComputerId, u16)>,
    by_port: HashMap<(ComputerId, u16), PortKey>,
}

struct Forwarder {
    address: SocketAddr,
    /// Stops the accept loop and every connection it carries when dropped.
    _stop: DropGuard,
}

pub struct Ports {
    registry: Arc<Registry>,
    forwarders: Mutex<HashMap<(ComputerId, u16), Forwarder>>,
    /// Set by the HTTP transport: ports get keys, never forwarders.
    over_http: OnceLock<OriginNames>,
    origins: Mutex<Origins>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every step under these locks leaves the maps consistent; a panic elsewhere must not
    // stop the routes.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Ports {
    pub fn new(registry: Arc<Registry>) -> Arc<Self> {
        let ports = Arc::new(Self {
            registry: registry.clone(),
            forwarders: Mutex::new(HashMap::new()),
            over_http: OnceLock::new(),
            origins: Mutex::new(Origins::default()),
        });
        let weak: Weak<Self> = Arc::downgrade(&ports);
        // A forwarder finds the computer again by id, so it outlives a factory reset; a
        // rollback closes it (docs/checkpoints.md).
        registry.on_removed(Box::new(move |id, how| {
            if let (Some(ports), Removal::Gone | Removal::RolledBack) = (weak.upgrade(), how) {
                ports.close(id);
            }
        }));
        ports
    }

    fn forwarders(&self) -> MutexGuard<'_, HashMap<(ComputerId, u16), Forwarder>> {
        lock(&self.forwarders)
    }

    /// From now on ports get origins of their own on the HTTP listener, and no loopback
    /// forwarder is started.
    pub fn route_over_http(&self, names: OriginNames) {
        let _ = self.over_http.set(names);
    }

    /// The computer and port a request's host name (port and case removed) stands for, while
    /// the computer lives: its first label must be `p<port>-<key>` of a key handed out.
    pub fn origin_of_host(&self, host: &str) -> Option<(ComputerId, u16)> {
        let (label, _) = host.split_once('.')?;
        let (port, key) = PortKey::from_label(label)?;
        lock(&self.origins)
            .by_key
            .get(&key)
            .filter(|(_, known)| *known == port)
            .cloned()
    }

    /// The route to `port` in `sandbox`: the provider's URL, or (after one test connection,
    /// so a port nothing listens on is an error now) the port's key over HTTP or its
    /// forwarder over stdio.
    pub async fn url(&self, sandbox: &SandboxRef, port: u16) -> Result<PortUrl, PortError> {
        match self.registry.backend().port_route(sandbox, port).await? {
            PortRoute::Provider { url, public } => Ok(PortUrl::Provider { url, public }),
            PortRoute::Forwarded => {
                // One connection first, so a port nothing listens on is an answer the agent
                // can act on now rather than a page that fails later.
                drop(self.registry.backend().connect_port(sandbox, port).await?);
                let key = (sandbox.computer_id.clone(), port);
                if let Some(names) = self.over_http.get() {
                    let label = self.key_for(key).label(port);
                    return Ok(PortUrl::Origin(format!(
                        "http://{label}.{}:{}/",
                        names.domain, names.listener_port
                    )));
                }
                if let Some(forwarder) = self.forwarders().get(&key) {
                    return Ok(PortUrl::Forwarded(forwarder.address));
                }
                let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
                    .await
                    .map_err(PortError::Listen)?;
                let address = listener.local_addr().map_err(PortError::Listen)?;
                let mut forwarders = self.forwarders();
                // Two calls may race to the first forwarder; the first one in stays.
                if let Some(forwarder) = forwarders.get(&key) {
                    return Ok(PortUrl::Forwarded(forwarder.address));
                }
                let stop = CancellationToken::new();
                tokio::spawn(forward(
                    listener,
                    self.registry.clone(),
                    key.clone(),
                    stop.clone(),
                ));
                info!(computer_id = %key.0, port, %address, "port forwarder started");
                forwarders.insert(
                    key,
                    Forwarder {
                        address,
                        _stop: stop.drop_guard(),
                    },
                );
                Ok(PortUrl::Forwarded(address))
            }
        }
    }

    /// The key of a port, the same for every call while its computer lives.
    fn key_for(&self, port: (ComputerId, u16)) -> PortKey {
        let mut origins = lock(&self.origins);
        if let Some(existing) = origins.by_port.get(&port) {
            return existing.clone();
        }
        let key = PortKey::random();
        origins.by_key.insert(key.clone(), port.clone());
        origins.by_port.insert(port, key.clone());
        key
    }

    /// Ends every forwarder and key of a computer that is gone.
    fn close(&self, id: &ComputerId) {
        {
            let mut origins = lock(&self.origins);
            origins.by_port.retain(|(computer, _), _| computer != id);
            origins.by_key.retain(|_, (computer, _)| computer != id);
        }
        let closed: Vec<Forwarder> = {
            let mut forwarders = self.forwarders();
            let keys: Vec<_> = forwarders
                .keys()
                .filter(|(c, _)| c == id)
                .cloned()
                .collect();
            keys.iter().filter_map(|k| forwarders.remove(k)).collect()
        };
        if !closed.is_empty() {
            info!(computer_id = %id, count = closed.len(), "port forwarders closed");
        }
    }

    /// One connection to `port` in the computer `id`, which must exist (never created).
    pub async fn connect(
        &self,
        id: &ComputerId,
        port: u16,
    ) -> Result<Box<dyn PortStream>, PortError> {
        connect(&self.registry, id, port).await
    }
}

async fn connect(
    registry: &Registry,
    id: &ComputerId,
    port: u16,
) -> Result<Box<dyn PortStream>, PortError> {
    let sandbox = registry.find(id).await?;
    let stream = registry.backend().connect_port(&sandbox, port).await?;
    Ok(Box::new(Awake {
        stream,
        _guard: registry.keep_awake(&sandbox),
    }))
}

/// A connection to a port, holding its computer awake while open (docs/idle-stop.md: an open
/// port forward is use).
struct Awake {
    stream: Box<dyn PortStream>,
    _guard: AwakeGuard,
}

impl tokio::io::AsyncRead for Awake {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for Awake {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

async fn forward(
    listener: TcpListener,
    registry: Arc<Registry>,
    (id, port): (ComputerId, u16),
    stop: CancellationToken,
) {
    let room = Arc::new(tokio::sync::Semaphore::new(CONNECTIONS_PER_FORWARDER));
    loop {
        // `biased`: once the computer is gone, nothing more is accepted or carried.
        let permit = tokio::select! {
            biased;
            () = stop.cancelled() => return,
            permit = room.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => return,
            },
        };
        let accepted = tokio::select! {
            biased;
            () = stop.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        let Ok((client, _)) = accepted else {
            continue;
        };
        let (registry, id, stop) = (registry.clone(), id.clone(), stop.clone());
        tokio::spawn(async move {
            tokio::select! {
                biased;
                () = stop.cancelled() => {}
                () = carry(client, &registry, &id, port) => {}
            }
            drop(permit);
        });
    }
}

/// Copies one accepted connection to the port and back until either side ends.
async fn carry(mut client: TcpStream, registry: &Registry, id: &ComputerId, port: u16) {
    let _ = client.set_nodelay(true);
    match connect(registry, id, port).await {
        Ok(mut upstream) => {
            let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
        }
        // The browser sees the connection close; the reason is for the operator.
        Err(error) => debug!(computer_id = %id, port, %error, "forwarded connection refused"),
    }
}

#[cfg(test)]
mod tests;
