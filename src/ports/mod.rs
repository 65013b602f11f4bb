//! Port forwarders (docs/files.md, "Ports"): `port_url`'s loopback listener per (computer,
//! port), and the one way this process opens a connection to a port in a computer, which the
//! forwarders and the HTTP transport's `/computers/<id>/ports/<port>/` route share.
//!
//! A forwarder accepts on `127.0.0.1:<ephemeral>` and, for each connection, finds the computer
//! again by id (so it keeps working across restarts and factory resets) and asks the backend
//! for a stream to the port. It lives until the registry removes the computer, or the process
//! ends. It never starts or creates a computer: a stopped one refuses connections.
//!
//! **Architecture invariant:** no MCP or HTTP types here; providers only through `dyn Backend`.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::{CancellationToken, DropGuard};
use tracing::{debug, info};

use crate::backends::{BackendError, PortRoute, PortStream, SandboxRef};
use crate::ids::ComputerId;
use crate::registry::{Registry, RegistryError, Removal};

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
    /// This process's forwarder on the loopback address.
    Forwarded(SocketAddr),
    /// The provider's URL; `public` = anyone who has it reaches the port.
    Provider { url: String, public: bool },
}

struct Forwarder {
    address: SocketAddr,
    /// Stops the accept loop and every connection it carries when dropped.
    _stop: DropGuard,
}

pub struct Ports {
    registry: Arc<Registry>,
    forwarders: Mutex<HashMap<(ComputerId, u16), Forwarder>>,
}

impl Ports {
    pub fn new(registry: Arc<Registry>) -> Arc<Self> {
        let ports = Arc::new(Self {
            registry: registry.clone(),
            forwarders: Mutex::new(HashMap::new()),
        });
        let weak: Weak<Self> = Arc::downgrade(&ports);
        // A forwarder finds the computer again by id, so it outlives a factory reset.
        registry.on_removed(Box::new(move |id, how| {
            if let (Some(ports), Removal::Gone) = (weak.upgrade(), how) {
                ports.close(id);
            }
        }));
        ports
    }

    fn forwarders(&self) -> MutexGuard<'_, HashMap<(ComputerId, u16), Forwarder>> {
        self.forwarders
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The URL of `port` in `sandbox`, starting its forwarder when the backend forwards; an
    /// error when nothing accepts a connection on the port now.
    pub async fn url(&self, sandbox: &SandboxRef, port: u16) -> Result<PortUrl, PortError> {
        match self.registry.backend().port_route(sandbox, port).await? {
            PortRoute::Provider { url, public } => Ok(PortUrl::Provider { url, public }),
            PortRoute::Forwarded => {
                // One connection first, so a port nothing listens on is an answer the agent
                // can act on now rather than a page that fails later.
                drop(self.registry.backend().connect_port(sandbox, port).await?);
                let key = (sandbox.computer_id.clone(), port);
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

    /// Ends every forwarder of a computer that is gone.
    fn close(&self, id: &ComputerId) {
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
    Ok(registry.backend().connect_port(&sandbox, port).await?)
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
