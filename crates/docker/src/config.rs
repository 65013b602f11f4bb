//! The Docker/Podman section of the configuration: what the server's flags and the engine's
//! environment variables resolve to (the server's `config` module reads them, in the documented
//! order), as plain data this backend is built from. Where the engine is and how to talk to it
//! (docs/decisions.md, "Docker and Podman", "Connection"), and the run flags ([`RunFlags`]).

use std::path::PathBuf;
use std::time::Duration;

use crate::run_flags::RunFlags;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    Docker,
    Podman,
}

impl Engine {
    pub fn display_name(self) -> &'static str {
        match self {
            Self::Docker => "Docker",
            Self::Podman => "Podman",
        }
    }
}

#[derive(Debug, Clone)]
pub struct DockerConfig {
    pub engine: Engine,
    /// Where the engine is and whether TLS is used ([`engine`]).
    pub connection: EngineConnection,
    /// `--pull-timeout`: an image pull with no progress for this long is given up.
    pub pull_timeout: Duration,
    pub image: String,
    pub nano_cpus: Option<i64>,
    pub memory_bytes: Option<i64>,
    pub run_flags: RunFlags,
    /// `None` = unlimited (the flag's 0).
    pub pids_limit: Option<i64>,
    pub security_opts: Vec<String>,
    pub runtime: Option<String>,
    /// `--exec-helper on`: commands go through the resident helper where it can run.
    pub exec_helper: bool,
    /// `--warm-pool`: started spares kept for temporary computers; 0 = no pool.
    pub warm_pool: usize,
    /// Which network a new computer joins (docs/auth.md, "Network").
    pub network: ComputerNetwork,
    /// The server's state dir: where the hosts people allowed per computer are kept
    /// (docs/egress.md, "Ask-to-allow"); `None` without a home directory.
    pub state_dir: Option<std::path::PathBuf>,
}

/// Which network a new container joins (docs/auth.md, "Network").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ComputerNetwork {
    /// `--no-network`: no network at all.
    Disabled,
    /// The engine's default network, or the one the run flags' `--network` names: the
    /// single-user default, as the Python reference does.
    EngineDefault,
    /// One network per principal, made on first use and removed with the principal's last
    /// computer: whenever more than one principal can exist (named tokens or OAuth), so that
    /// one principal's computers can neither reach nor impersonate another's.
    PerPrincipal,
}

impl ComputerNetwork {
    /// The network for the flags given: `enabled` is `--network`, `principals` whether more
    /// than one principal can exist, `operator_network` whether the run flags name a network.
    pub fn choose(enabled: bool, principals: bool, operator_network: bool) -> Self {
        match (enabled, principals && !operator_network) {
            (false, _) => Self::Disabled,
            (true, false) => Self::EngineDefault,
            (true, true) => Self::PerPrincipal,
        }
    }
}

/// The Docker engine's socket when nothing else is named.
pub const DOCKER_DEFAULT_SOCKET: &str = "unix:///var/run/docker.sock";

/// Where the engine is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineAddress {
    /// `--docker-host`; for Docker also `DOCKER_HOST` or the default socket.
    Fixed(String),
    /// Podman without `--docker-host`: its sockets in order of preference, the first that
    /// exists when the server connects (a service started after the server is still found).
    FirstExisting(Vec<String>),
}

/// The files of a verified TLS connection to the engine, each checked readable at startup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineTls {
    /// The CA that signed the engine's certificate; the only one trusted for it.
    pub ca: PathBuf,
    /// This client's certificate and key, which the engine asks for.
    pub cert: PathBuf,
    pub key: PathBuf,
    /// The directory they came from, for messages.
    pub dir: PathBuf,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineConnection {
    pub address: EngineAddress,
    /// `Some` for an `https://` address, and for a `tcp://` one when TLS verification is asked
    /// for; never for unix sockets or `ssh://` (the docker CLI ignores TLS settings there too).
    pub tls: Option<EngineTls>,
}

impl EngineConnection {
    /// `--backend` is not docker: nothing is connected, so nothing is checked.
    pub fn unused() -> Self {
        Self {
            address: EngineAddress::Fixed(DOCKER_DEFAULT_SOCKET.to_owned()),
            tls: None,
        }
    }
}

/// The address's scheme, lower case (`unix`, `tcp`, `https`, …); empty without one.
pub fn scheme(host: &str) -> String {
    host.split_once("://")
        .map(|(s, _)| s.to_ascii_lowercase())
        .unwrap_or_default()
}
