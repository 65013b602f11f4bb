//! The egress proxy beside Docker and Podman computers (docs/egress.md, "The proxy"): its image,
//! built on the engine from the binary this server carries (the broker when the build has one,
//! else the helper; no registry involved); the
//! internal network it guards; its container; and the server's end of its control channel.
//!
//! One proxy serves one internal network and tells computers apart by source address. The
//! server talks to it through the engine (an attached container's stdin and stdout), so this
//! works against a remote engine and from a server that runs in a container. Everything read
//! from the proxy is capped: it shares a network with hostile computers.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use bollard::Docker;
use bollard::models::{
    ContainerCreateBody, EndpointSettings, HostConfig, Mount, MountType, NetworkConnectRequest,
    NetworkCreateRequest, NetworkingConfig,
};
use bollard::query_parameters::{
    AttachContainerOptionsBuilder, CreateContainerOptionsBuilder, CreateImageOptionsBuilder,
    InspectContainerOptions, StartContainerOptions,
};
use futures_util::StreamExt;
use tokio::io::AsyncWriteExt;
use tracing::{debug, warn};

use super::describe;
use crate::helper::{binary, broker};
use kilntainers_backend::BackendError;
use kilntainers_backend::brokering::SecretBook;
use kilntainers_backend::egress::{
    ASK_TIMEOUT, Denial, DeniedEntry, EgressAnswer, EgressMode, EgressPolicy, EgressQuestion,
    EgressSettings, Pattern, reasons,
};
use kilntainers_backend::ids::ComputerId;
use kilntainers_backend::labels::docker as label;

/// Repository of the proxy's image (under `localhost/`, which Podman gives imported images and
/// Docker takes as it is); the tag is the hash of the proxy binary's bytes, so a server
/// finds the image it built and servers of different versions never share one.
pub(crate) const IMAGE_REPO: &str = "localhost/kilntainers-egress-proxy";
/// Label on the proxy's image, container and internal network: the internal network's name.
pub(crate) const PROXY_LABEL: &str = "kilntainers.egress-proxy";
/// A computer's recorded policy.
pub(crate) const POLICY_LABEL: &str = label::EGRESS;
/// The proxy's HTTP(S) proxy port (helper/src/egress).
pub(crate) const PROXY_PORT: u16 = 3128;
/// The binary's path in the proxy's image, the broker's too (it takes the helper's
/// `egress-proxy` arguments), so the container's entrypoint is the same for both.
const BINARY_PATH: &str = "kilntainers-helper";
/// Bridge option that leaves the host without an address on the internal network, so a
/// computer cannot reach the engine host's services there (docs/egress.md, "The proxy").
const INHIBIT_IPV4: &str = "com.docker.network.bridge.inhibit_ipv4";
/// The proxy's memory: its connections are capped (1024, one 64 KiB thread and two 16 KiB
/// buffers each), so this bounds a hostile computer's reach, not a normal load.
const MEMORY_BYTES: i64 = 256 * 1024 * 1024;
/// Threads: one per connection and one per direction of a tunnel, under the proxy's caps.
const PIDS_LIMIT: i64 = 4096;
/// Longest line read from the proxy; the proxy caps what it writes well below this, so a
/// longer line means something is wrong and is dropped whole.
pub(crate) const MAX_LINE_FROM_PROXY: usize = 4096;
/// Refusals kept per computer for `computer_network`; older ones are dropped first.
pub(crate) const DENIALS_KEPT: usize = 100;

/// A socket-wired computer's token (`crate::networks::Wiring::Socket`): 32 lowercase hex
/// digits its relay names it by to the proxy. On the container only, which the computer cannot
/// read; a computer that reads its own relay's environment learns nothing it could use as
/// another computer.
pub(crate) const TOKEN_LABEL: &str = "kilntainers.egress-token";
/// Where the proxy's volume is mounted, in the proxy (read-write) and in computers (read-only).
pub(crate) const SOCKET_DIR: &str = "/run/kilntainers-egress";
/// The proxy's socket, inside [`SOCKET_DIR`].
pub(crate) const SOCKET_PATH: &str = "/run/kilntainers-egress/proxy.sock";
/// The environment variable the relay reads its token from.
pub(crate) const TOKEN_ENV: &str = "KILNTAINERS_EGRESS_TOKEN";
/// Where a socket-wired computer's relay listens, and so its proxy settings point.
pub(crate) const RELAY_HOST: &str = "127.0.0.1";

/// How long the relay may take to listen.
pub(crate) const RELAY_START_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(15);

/// A new random token for a socket-wired computer.
pub(crate) fn new_token() -> String {
    let bytes: [u8; 16] = rand::random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether `text` has the shape of a token (so a label edited by hand is never sent on).
pub(crate) fn is_token(text: &str) -> bool {
    text.len() == 32 && text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// The key a socket-wired computer's policy is filed under at the proxy, in place of an
/// address: an IPv6 unique-local address made from the container's id (stable across
/// restarts and server processes, distinct per container, never a real destination).
pub(crate) fn socket_key(container_id: &str) -> Option<IpAddr> {
    if container_id.len() < 30 || !container_id.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let mut bytes = [0u8; 16];
    bytes[0] = 0xfd;
    for (at, byte) in bytes.iter_mut().enumerate().skip(1) {
        let pair = &container_id[(at - 1) * 2..at * 2];
        *byte = u8::from_str_radix(pair, 16).ok()?;
    }
    Some(IpAddr::from(bytes))
}

/// The relay's command line in a socket-wired computer (run as root through the engine, with
/// [`TOKEN_ENV`] set): it writes the resolver, starts listening in the background and returns
/// once it listens, or at once when it runs already.
pub(crate) fn relay_argv(helper_path: &str) -> Vec<String> {
    vec![
        helper_path.to_owned(),
        "egress-relay".to_owned(),
        SOCKET_PATH.to_owned(),
        "--resolv-conf".to_owned(),
        "--background".to_owned(),
    ]
}

/// Whether runsc's `runtimeArgs` let a sandbox connect to a Unix socket from the host (a
/// mounted volume's): `--host-uds` with `open` or `all` (`create` alone only binds).
pub(crate) fn runsc_reaches_sockets(args: &[String]) -> bool {
    let mut value = None;
    let mut words = args.iter();
    while let Some(word) = words.next() {
        let word = word.trim_start_matches('-');
        if let Some(v) = word.strip_prefix("host-uds=") {
            value = Some(v.to_owned());
        } else if word == "host-uds" {
            value = words.next().cloned();
        } else if word == "fsgofer-host-uds" || word == "fsgofer-host-uds=true" {
            value = Some("all".to_owned());
        }
    }
    matches!(value.as_deref(), Some("open" | "all"))
}

/// The proxy's binary: the broker (TLS termination for secrets brokering) when this build
/// has one, else the helper.
fn proxy_binary() -> &'static [u8] {
    match broker::bytes() {
        [] => binary::bytes(),
        broker => broker,
    }
}

/// A hash of [`proxy_binary`], in hex: the image's tag.
static PROXY_HASH: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    use std::hash::{Hash, Hasher};
    // SipHash with fixed keys, as for the helper's copies: stable for the same bytes.
    let mut hasher = std::hash::DefaultHasher::new();
    proxy_binary().hash(&mut hasher);
    format!("{:016x}", hasher.finish())
});

/// `repo:tag` of this server's proxy image.
pub(crate) fn image() -> String {
    format!("{IMAGE_REPO}:{}", *PROXY_HASH)
}

/// The root filesystem of the proxy's image: the proxy's binary alone.
pub(crate) fn image_archive() -> std::io::Result<Vec<u8>> {
    let bytes = proxy_binary();
    let mut builder = tar::Builder::new(Vec::with_capacity(bytes.len() + 1024));
    let mut file = tar::Header::new_gnu();
    file.set_entry_type(tar::EntryType::Regular);
    file.set_mode(0o755);
    file.set_size(bytes.len() as u64);
    builder.append_data(&mut file, BINARY_PATH, bytes)?;
    builder.into_inner()
}

/// The `docker import` changes: a label only. The entrypoint is set on the container, since
/// Podman's import does not apply an exec-form `ENTRYPOINT`.
fn image_changes() -> Vec<String> {
    vec![format!("LABEL {PROXY_LABEL}=image")]
}

/// Imports the proxy image unless the engine has it already.
pub(crate) async fn ensure_image(docker: &Docker) -> Result<String, BackendError> {
    let image = image();
    if docker.inspect_image(&image).await.is_ok() {
        return Ok(image);
    }
    broker::broker_available()
        .or_else(|_| binary::available())
        .map_err(|why| {
            BackendError::Provider(format!("cannot build the egress proxy's image: {why}"))
        })?;
    let archive = image_archive()
        .map_err(|e| BackendError::Provider(format!("cannot pack the egress proxy: {e}")))?;
    let options = CreateImageOptionsBuilder::default()
        .from_src("-")
        // The tag inside `repo`: Podman ignores the separate `tag` of an import.
        .repo(&image)
        .changes(image_changes())
        .build();
    let mut progress = docker.create_image(
        Some(options),
        Some(bollard::body_full(archive.into())),
        None,
    );
    while let Some(step) = progress.next().await {
        step.map_err(|e| {
            BackendError::Provider(format!(
                "cannot build the egress proxy's image: {}",
                describe(&e)
            ))
        })?;
    }
    debug!(%image, "built the egress proxy's image");
    Ok(image)
}

/// The internal network a proxy guards: no route out, no host address on its bridge.
pub(crate) fn network_request(name: &str, owner: Option<&str>) -> NetworkCreateRequest {
    let mut labels = HashMap::from([
        (label::MANAGED.to_owned(), "true".to_owned()),
        (PROXY_LABEL.to_owned(), name.to_owned()),
    ]);
    if let Some(owner) = owner {
        labels.insert(label::OWNER.to_owned(), owner.to_owned());
    }
    NetworkCreateRequest {
        name: name.to_owned(),
        driver: Some("bridge".to_owned()),
        internal: Some(true),
        options: Some(HashMap::from([(
            INHIBIT_IPV4.to_owned(),
            "true".to_owned(),
        )])),
        labels: Some(labels),
        ..Default::default()
    }
}

/// The proxy container's name for an internal network.
pub(crate) fn proxy_name(network: &str) -> String {
    format!("{network}-proxy")
}

/// The proxy's command line after its entrypoint (the helper's `egress-proxy` options).
pub(crate) fn proxy_args(settings: &EgressSettings, socket: bool) -> Vec<String> {
    let mut args = Vec::new();
    if socket {
        args.extend(["--socket".to_owned(), SOCKET_PATH.to_owned()]);
    }
    if let Some(dns) = settings.dns {
        args.extend(["--dns".to_owned(), dns.to_string()]);
    }
    for (host, ip) in &settings.resolve {
        args.extend(["--resolve".to_owned(), format!("{host}={ip}")]);
    }
    args
}

/// The proxy container: on the internal network, stdin open for the control channel, no
/// capability but binding 53/80/443, read-only, memory and threads capped.
///
/// With `socket_volume` (`crate::networks::Wiring::Socket`), `network` is the upstream network
/// and the volume is mounted at [`SOCKET_DIR`], where the proxy makes its socket.
pub(crate) fn proxy_body(
    image: &str,
    network: &str,
    settings: &EgressSettings,
    socket_volume: Option<&str>,
) -> ContainerCreateBody {
    let labels = HashMap::from([(
        PROXY_LABEL.to_owned(),
        socket_volume.unwrap_or(network).to_owned(),
    )]);
    let mounts = socket_volume.map(|volume| {
        vec![Mount {
            target: Some(SOCKET_DIR.to_owned()),
            source: Some(volume.to_owned()),
            typ: Some(MountType::VOLUME),
            read_only: Some(false),
            ..Default::default()
        }]
    });
    ContainerCreateBody {
        image: Some(image.to_owned()),
        entrypoint: Some(vec![format!("/{BINARY_PATH}"), "egress-proxy".to_owned()]),
        cmd: Some(proxy_args(settings, socket_volume.is_some())),
        labels: Some(labels),
        open_stdin: Some(true),
        stdin_once: Some(false),
        attach_stdin: Some(true),
        attach_stdout: Some(true),
        attach_stderr: Some(true),
        tty: Some(false),
        host_config: Some(HostConfig {
            network_mode: Some(network.to_owned()),
            memory: Some(MEMORY_BYTES),
            pids_limit: Some(PIDS_LIMIT),
            readonly_rootfs: Some(true),
            cap_drop: Some(vec!["ALL".to_owned()]),
            cap_add: Some(vec!["NET_BIND_SERVICE".to_owned()]),
            security_opt: Some(vec!["no-new-privileges".to_owned()]),
            mounts,
            ..Default::default()
        }),
        networking_config: Some(NetworkingConfig {
            endpoints_config: Some(HashMap::from([(
                network.to_owned(),
                EndpointSettings::default(),
            )])),
        }),
        ..Default::default()
    }
}

/// The control line that gives a computer its policy (helper/src/egress/control.rs).
pub(crate) fn policy_line(computer: IpAddr, policy: &EgressPolicy) -> String {
    let list = |patterns: &[Pattern]| {
        patterns
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(",")
    };
    let mode = match policy.mode {
        EgressMode::Open => "open",
        EgressMode::Allowlist => "allowlist",
        EgressMode::None => "none",
    };
    format!(
        "policy {computer} {mode} ask={} private={} allow={} deny={}\n",
        u8::from(policy.ask),
        u8::from(policy.allow_private),
        list(&policy.allow),
        list(&policy.deny),
    )
}

/// The name a warm-pool spare's environment gives the proxy: a spare is made before its
/// owner's network (and so its proxy's address) is known, and the name is pointed at the
/// address when it is handed out ([`SPARE_NETWORK_FIXUP`]).
pub(crate) const PROXY_HOST: &str = "kilntainers-egress-proxy";

/// The proxy's host as a URL names it: an address (IPv6 in brackets) or [`PROXY_HOST`].
pub(crate) fn proxy_url_host(proxy: IpAddr) -> String {
    match proxy {
        IpAddr::V6(ip) => format!("[{ip}]"),
        IpAddr::V4(ip) => ip.to_string(),
    }
}

/// What a computer behind the proxy has in its environment: programs that honour proxy
/// settings use the proxy's port; the rest reach allowed names on 80 and 443 through its DNS.
pub(crate) fn proxy_env(host: &str) -> Vec<String> {
    let url = format!("http://{host}:{PROXY_PORT}");
    let mut env = Vec::new();
    for key in ["HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"] {
        env.push(format!("{key}={url}"));
        env.push(format!("{}={url}", key.to_ascii_lowercase()));
    }
    env.push("NO_PROXY=localhost,127.0.0.1,::1".to_owned());
    env.push("no_proxy=localhost,127.0.0.1,::1".to_owned());
    env
}

/// Run as root in a computer born a warm-pool spare, each time it is attached behind a proxy
/// (docs/warm-pool.md, "Egress"): `$1` is the proxy's address, `$2` [`PROXY_HOST`]. The
/// engine writes both files again when the container starts. Neither is a safeguard (the
/// computer reaches nothing but the proxy whatever they say); they make names resolve as on a
/// computer made behind the proxy.
pub(crate) const SPARE_NETWORK_FIXUP: &str = r#"printf 'nameserver %s\n' "$1" > /etc/resolv.conf && hosts=$(while IFS= read -r l; do case "$l" in *" $2") ;; *) printf '%s\n' "$l" ;; esac; done < /etc/hosts) && printf '%s\n%s %s\n' "$hosts" "$1" "$2" > /etc/hosts"#;

/// Passes a command's output on and notes whether its stderr ends a line, so that refusal
/// lines start on a line of their own.
pub(crate) struct WatchedSink<'a> {
    inner: &'a mut dyn kilntainers_backend::OutputSink,
    stderr_ends_line: bool,
}

impl<'a> WatchedSink<'a> {
    pub(crate) fn new(inner: &'a mut dyn kilntainers_backend::OutputSink) -> Self {
        Self {
            inner,
            stderr_ends_line: true,
        }
    }

    pub(crate) fn at_line_start(&self) -> bool {
        self.stderr_ends_line
    }
}

impl kilntainers_backend::OutputSink for WatchedSink<'_> {
    fn push(
        &mut self,
        stream: kilntainers_backend::Stream,
        bytes: &[u8],
    ) -> kilntainers_backend::SinkControl {
        if stream == kilntainers_backend::Stream::Stderr
            && let Some(last) = bytes.last()
        {
            self.stderr_ends_line = *last == b'\n';
        }
        self.inner.push(stream, bytes)
    }
}

/// How the proxy's refusal of a placeholder sent to a host its secret is not bound to begins
/// (`carries the secret NAME to a host it is not bound to`): such a refusal is an attempt to
/// exfiltrate, and goes to the audit log too.
pub(crate) const SECRET_REFUSAL_PREFIX: &str = "carries the secret ";

/// What one line from the proxy says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Event {
    Ready,
    Denied(IpAddr, Denial),
    Ask {
        id: u64,
        computer: IpAddr,
        host: String,
        port: u16,
    },
    /// The answer to `sync <id>`: every refusal written before it has been read.
    Synced(u64),
}

/// Reads one line from the proxy (without its newline); `None` for anything else, which the
/// caller logs and skips. Hosts and reasons are already cleaned by the proxy; they are checked
/// again here (printable ASCII only), since the proxy's output is not trusted to be well formed.
pub(crate) fn parse_event(line: &str) -> Option<Event> {
    if line.len() > MAX_LINE_FROM_PROXY || !line.bytes().all(|b| (0x20..0x7f).contains(&b)) {
        return None;
    }
    let mut words = line.splitn(5, ' ');
    match words.next()? {
        // `ready tls` from the broker (it can terminate TLS), `ready` from the helper.
        "ready" if matches!(words.next(), None | Some("tls")) && words.next().is_none() => {
            Some(Event::Ready)
        }
        "synced" => {
            let id = words.next()?.parse().ok()?;
            words.next().is_none().then_some(Event::Synced(id))
        }
        "denied" => {
            let computer = words.next()?.parse().ok()?;
            let host = words.next()?.to_owned();
            let port = words.next()?.parse().ok()?;
            let reason = words.next()?.to_owned();
            Some(Event::Denied(computer, Denial { host, port, reason }))
        }
        "ask" => {
            let id = words.next()?.parse().ok()?;
            let computer = words.next()?.parse().ok()?;
            let host = words.next()?.to_owned();
            let port = words.next()?.parse().ok()?;
            Some(Event::Ask {
                id,
                computer,
                host,
                port,
            })
        }
        _ => None,
    }
}

/// Splits a byte stream from the proxy into lines, dropping any line longer than
/// [`MAX_LINE_FROM_PROXY`] whole (its rest included) and holding at most that much.
#[derive(Default)]
pub(crate) struct Lines {
    pending: Vec<u8>,
    /// Inside a line already too long: skip to its end.
    skipping: bool,
}

impl Lines {
    pub(crate) fn push(&mut self, mut bytes: &[u8], mut line: impl FnMut(&str)) {
        while !bytes.is_empty() {
            let (chunk, ended) = match bytes.iter().position(|&b| b == b'\n') {
                Some(at) => (&bytes[..at], true),
                None => (bytes, false),
            };
            bytes = &bytes[(chunk.len() + usize::from(ended))..];
            if !self.skipping {
                if self.pending.len() + chunk.len() > MAX_LINE_FROM_PROXY {
                    self.pending.clear();
                    self.skipping = true;
                } else {
                    self.pending.extend_from_slice(chunk);
                }
            }
            if ended {
                if !self.skipping {
                    line(&String::from_utf8_lossy(&self.pending));
                }
                self.pending.clear();
                self.skipping = false;
            }
        }
    }
}

/// The last refusals of each computer on one proxy, oldest first, [`DENIALS_KEPT`] each, with
/// when this server recorded them; and the last [`DENIALS_KEPT`] distinct ones with their
/// counts, for `computer_network`.
#[derive(Default)]
pub(crate) struct DenialLog {
    /// Each refusal with the Unix time in milliseconds it was recorded at.
    by_computer: HashMap<IpAddr, VecDeque<(u64, Denial)>>,
    distinct: HashMap<IpAddr, VecDeque<DeniedEntry>>,
    /// Count of refusals ever recorded per computer, so a reader can ask for "since".
    counts: HashMap<IpAddr, u64>,
}

/// Now, in Unix milliseconds (the clock job windows are given in).
fn now_unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl DenialLog {
    pub(crate) fn record(&mut self, computer: IpAddr, denial: Denial) {
        self.record_at(computer, denial, now_unix_ms());
    }

    pub(crate) fn record_at(&mut self, computer: IpAddr, denial: Denial, now_ms: u64) {
        let now = kilntainers_backend::clock::rfc3339_utc(
            i64::try_from(now_ms / 1000).unwrap_or(i64::MAX),
        );
        let distinct = self.distinct.entry(computer).or_default();
        let same = distinct.iter().position(|e| {
            e.host == denial.host && e.port == denial.port && e.reason == denial.reason
        });
        let mut entry = match same.and_then(|at| distinct.remove(at)) {
            Some(entry) => entry,
            None => DeniedEntry {
                host: denial.host.clone(),
                port: denial.port,
                reason: denial.reason.clone(),
                count: 0,
                first_at: now.clone(),
                last_at: String::new(),
            },
        };
        entry.count += 1;
        entry.last_at = now;
        if distinct.len() == DENIALS_KEPT {
            distinct.pop_front();
        }
        distinct.push_back(entry);
        let log = self.by_computer.entry(computer).or_default();
        if log.len() == DENIALS_KEPT {
            log.pop_front();
        }
        log.push_back((now_ms, denial));
        *self.counts.entry(computer).or_default() += 1;
    }

    /// How many refusals `computer` has had in all (a mark for [`Self::since`]).
    pub(crate) fn count(&self, computer: IpAddr) -> u64 {
        self.counts.get(&computer).copied().unwrap_or(0)
    }

    /// The refusals recorded after `mark` (at most [`DENIALS_KEPT`]).
    pub(crate) fn since(&self, computer: IpAddr, mark: u64) -> Vec<Denial> {
        let total = self.count(computer);
        let Some(log) = self.by_computer.get(&computer) else {
            return Vec::new();
        };
        let new = usize::try_from(total.saturating_sub(mark)).unwrap_or(usize::MAX);
        log.iter()
            .skip(log.len().saturating_sub(new))
            .map(|(_, denial)| denial.clone())
            .collect()
    }

    /// The refusals recorded from `from_ms` to `to_ms` (Unix milliseconds, both included; at
    /// most [`DENIALS_KEPT`]): a job's, which ran outside any exec this server watched.
    pub(crate) fn between(&self, computer: IpAddr, from_ms: u64, to_ms: u64) -> Vec<Denial> {
        self.by_computer
            .get(&computer)
            .into_iter()
            .flatten()
            .filter(|(at, _)| (from_ms..=to_ms).contains(at))
            .map(|(_, denial)| denial.clone())
            .collect()
    }

    /// The distinct refusals of `computer`, least recently refused first.
    pub(crate) fn distinct(&self, computer: IpAddr) -> Vec<DeniedEntry> {
        self.distinct
            .get(&computer)
            .map(|d| d.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// Forgets a removed computer (its address may be given to another).
    pub(crate) fn forget(&mut self, computer: IpAddr) {
        self.by_computer.remove(&computer);
        self.distinct.remove(&computer);
        self.counts.remove(&computer);
    }
}

/// The proxy's stdin, shared by the server's calls and the answers to its questions.
type Input = Arc<tokio::sync::Mutex<std::pin::Pin<Box<dyn tokio::io::AsyncWrite + Send>>>>;

/// A running proxy and this server's end of its control channel.
pub(crate) struct Proxy {
    /// The proxy's address on the internal network: the computers' DNS server and proxy.
    pub address: IpAddr,
    input: Input,
    pub denials: Arc<Mutex<DenialLog>>,
    syncs: Arc<Syncs>,
    /// The computers behind it by address, with the policy each was given.
    computers: Arc<Mutex<HashMap<IpAddr, Attached>>>,
    /// Set when the control channel's output ended: the container stopped or was replaced
    /// (by another server process on the same engine, docs/egress.md, "Docker wiring").
    ended: Arc<std::sync::atomic::AtomicBool>,
    /// The secrets its computers get (docs/secrets.md).
    secrets: SecretBook,
}

/// A computer behind a proxy: who it is and the policy the proxy has for it.
#[derive(Debug, Clone)]
pub(crate) struct Attached {
    pub computer_id: ComputerId,
    /// The container's full id: the key of its grants.
    pub container: String,
    pub policy: EgressPolicy,
    /// A socket-wired computer's token, given to the proxy with its policy.
    pub token: Option<String>,
}

/// Where a proxy's questions go (docs/egress.md, "Ask-to-allow"): to the server, and the
/// hosts allowed for a computer by the person, kept outside the computer.
#[derive(Clone)]
pub(crate) struct Asking {
    pub questions: tokio::sync::mpsc::Sender<EgressQuestion>,
    pub grants: Grants,
}

/// Questions handed to the server and not yet taken; past that they are refused at once.
pub(crate) const QUESTIONS_QUEUED: usize = 64;

/// The hosts a person allowed for a computer (`allow for this computer`), one file per
/// container under the state dir, `egress-grants/<container id>`, one pattern a line. The
/// `kilntainers.egress` label cannot change on a container, and nothing inside the computer may
/// hold its own policy, so they live beside the server's other state and are read whenever the
/// recorded policy is: after a restart of the server or the computer they still apply.
#[derive(Debug, Clone, Default)]
pub(crate) struct Grants {
    dir: Option<std::path::PathBuf>,
}

/// Grants kept per computer; more are refused (each answer adds one).
pub(crate) const MAX_GRANTS: usize = 256;

impl Grants {
    pub(crate) fn new(state_dir: Option<&std::path::Path>) -> Self {
        Self {
            dir: state_dir.map(|d| d.join("egress-grants")),
        }
    }

    fn path(&self, container: &str) -> Option<std::path::PathBuf> {
        // A container id is hex; anything else is never a file name here.
        if container.is_empty() || !container.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        self.dir.as_ref().map(|d| d.join(container))
    }

    /// The patterns granted to `container`; unreadable lines are skipped.
    pub(crate) fn load(&self, container: &str) -> Vec<Pattern> {
        let Some(text) = self
            .path(container)
            .and_then(|p| std::fs::read_to_string(p).ok())
        else {
            return Vec::new();
        };
        text.lines()
            .filter_map(|line| Pattern::parse(line.trim()).ok())
            .take(MAX_GRANTS)
            .collect()
    }

    /// Adds `pattern` to `container`'s grants.
    pub(crate) fn add(&self, container: &str, pattern: &Pattern) -> Result<(), String> {
        let path = self
            .path(container)
            .ok_or("the server has no state directory to keep it in")?;
        let mut patterns = self.load(container);
        if patterns.contains(pattern) {
            return Ok(());
        }
        if patterns.len() >= MAX_GRANTS {
            return Err(format!(
                "this computer has {MAX_GRANTS} hosts allowed already"
            ));
        }
        patterns.push(pattern.clone());
        Self::store(&path, &patterns)
    }

    /// Takes `pattern` out of `container`'s grants; whether it was one of them.
    pub(crate) fn revoke(&self, container: &str, pattern: &Pattern) -> Result<bool, String> {
        let path = self
            .path(container)
            .ok_or("the server has no state directory to keep it in")?;
        let mut patterns = self.load(container);
        let before = patterns.len();
        patterns.retain(|p| p != pattern);
        if patterns.len() == before {
            return Ok(false);
        }
        Self::store(&path, &patterns).map(|()| true)
    }

    /// Writes `patterns` whole to a temporary file, then renames it over `path`.
    fn store(path: &std::path::Path, patterns: &[Pattern]) -> Result<(), String> {
        let text: String = patterns.iter().map(|p| format!("{p}\n")).collect();
        let dir = path.parent().ok_or("no directory")?;
        std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
        let temporary = path.with_extension("new");
        std::fs::write(&temporary, text).map_err(|e| e.to_string())?;
        std::fs::rename(&temporary, path).map_err(|e| e.to_string())
    }

    /// Forgets a removed container's grants.
    pub(crate) fn remove(&self, container: &str) {
        if let Some(path) = self.path(container) {
            let _ = std::fs::remove_file(path);
        }
    }

    /// `policy` with `container`'s grants added to its allow rules.
    pub(crate) fn apply(&self, container: &str, mut policy: EgressPolicy) -> EgressPolicy {
        for pattern in self.load(container) {
            if !policy.allow.contains(&pattern) {
                policy.allow.push(pattern);
            }
        }
        policy
    }
}

/// `sync` round trips under way, by id.
#[derive(Default)]
struct Syncs {
    next: std::sync::atomic::AtomicU64,
    waiting: Mutex<HashMap<u64, tokio::sync::oneshot::Sender<()>>>,
}

/// Longest wait for a `sync` answer: past it a command's refusal lines may miss the last ones.
const SYNC_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);
/// How long after a job's recorded end a refusal read by this process still counts as the
/// job's: [`SYNC_TIMEOUT`], as long as a `sync` may wait (refusals are timed when read, not
/// when made).
pub(crate) const REFUSAL_READ_DELAY_MS: u64 = SYNC_TIMEOUT.as_millis() as u64;
/// `sync` round trips waiting at once; more are not sent (the lines are then best effort).
const MAX_SYNCS: usize = 1024;

impl Proxy {
    /// Creates and starts the proxy of `network` (which exists), joins it to the upstream
    /// network, attaches to it and waits for `ready`.
    ///
    /// [`crate::networks::Wiring::Socket`]: `network` names the volume of the proxy's socket,
    /// and the proxy is on the upstream network only.
    pub(crate) async fn start(
        docker: &Docker,
        network: &str,
        settings: &EgressSettings,
        default_upstream: &str,
        asking: Option<Asking>,
        wiring: crate::networks::Wiring,
        secrets: SecretBook,
    ) -> Result<Self, BackendError> {
        let socket = wiring == crate::networks::Wiring::Socket;
        let failed = |what: &str, e: &bollard::errors::Error| {
            BackendError::Provider(format!(
                "cannot start the egress proxy of network {network}: {what}: {}",
                describe(e)
            ))
        };
        let image = ensure_image(docker).await?;
        let name = proxy_name(network);
        let options = CreateContainerOptionsBuilder::default().name(&name).build();
        let upstream = settings
            .upstream_network
            .as_deref()
            .unwrap_or(default_upstream);
        let body = if socket {
            proxy_body(&image, upstream, settings, Some(network))
        } else {
            proxy_body(&image, network, settings, None)
        };
        let created = docker
            .create_container(Some(options), body)
            .await
            .map_err(|e| failed("create", &e))?;
        if !socket {
            docker
                .connect_network(
                    upstream,
                    NetworkConnectRequest {
                        container: created.id.clone(),
                        ..Default::default()
                    },
                )
                .await
                .map_err(|e| failed("join the upstream network", &e))?;
        }
        let attach = AttachContainerOptionsBuilder::default()
            .stdin(true)
            .stdout(true)
            .stderr(true)
            .stream(true)
            .build();
        let attached = docker
            .attach_container(&created.id, Some(attach))
            .await
            .map_err(|e| failed("attach", &e))?;
        docker
            .start_container(&created.id, None::<StartContainerOptions>)
            .await
            .map_err(|e| failed("start", &e))?;
        let inspect = docker
            .inspect_container(&created.id, None::<InspectContainerOptions>)
            .await
            .map_err(|e| failed("inspect", &e))?;
        // Socket-wired computers find the proxy at their relay, on their own loopback.
        let relay = socket.then(|| IpAddr::from([127, 0, 0, 1]));
        let address = inspect
            .network_settings
            .and_then(|s| s.networks)
            .and_then(|n| n.get(network).and_then(|e| e.ip_address.clone()))
            .and_then(|ip| ip.parse::<IpAddr>().ok())
            .or(relay)
            .ok_or_else(|| {
                BackendError::Provider(format!(
                    "the egress proxy of network {network} got no address on it"
                ))
            })?;
        let denials = Arc::new(Mutex::new(DenialLog::default()));
        let syncs = Arc::new(Syncs::default());
        let input: Input = Arc::new(tokio::sync::Mutex::new(attached.input));
        let computers = Arc::new(Mutex::new(HashMap::new()));
        let ended = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        tokio::spawn(read_events(
            attached.output,
            name.clone(),
            Shared {
                denials: Arc::clone(&denials),
                syncs: Arc::clone(&syncs),
                input: Arc::clone(&input),
                computers: Arc::clone(&computers),
                asking,
            },
            ready_tx,
            Arc::clone(&ended),
        ));
        let proxy = Self {
            address,
            input,
            denials,
            syncs,
            computers,
            ended,
            secrets,
        };
        let setup = crate::brokering::proxy_setup_lines(
            &proxy.secrets,
            settings.upstream_ca_pem.as_deref(),
        );
        proxy.send(&format!("address {address}\n{setup}")).await?;
        match tokio::time::timeout(std::time::Duration::from_secs(10), ready_rx).await {
            Ok(Ok(())) => Ok(proxy),
            _ => Err(BackendError::Provider(format!(
                "the egress proxy of network {network} did not report ready"
            ))),
        }
    }

    /// A proxy whose control input is `input`, for tests of what the server sends.
    #[cfg(test)]
    pub(crate) fn for_tests(input: Input) -> Self {
        Self {
            address: IpAddr::from([127, 0, 0, 1]),
            input,
            denials: Arc::default(),
            syncs: Arc::default(),
            computers: Arc::default(),
            ended: Arc::default(),
            secrets: SecretBook::default(),
        }
    }

    /// Whether the control channel still reads the proxy's output; once it does not, nothing
    /// sent reaches a proxy and no refusal comes back, so the proxy must be started again.
    pub(crate) fn is_connected(&self) -> bool {
        !self.ended.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Writes one control line.
    pub(crate) async fn send(&self, line: &str) -> Result<(), BackendError> {
        send(&self.input, line).await
    }

    /// Waits until every refusal the proxy made before now has been read (a `sync` round
    /// trip), at most [`SYNC_TIMEOUT`]; `false` when it could not tell.
    pub(crate) async fn sync(&self) -> bool {
        let id = self
            .syncs
            .next
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (tx, rx) = tokio::sync::oneshot::channel();
        {
            let mut waiting = self
                .syncs
                .waiting
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if waiting.len() >= MAX_SYNCS {
                return false;
            }
            waiting.insert(id, tx);
        }
        let answered = self.send(&format!("sync {id}\n")).await.is_ok()
            && matches!(tokio::time::timeout(SYNC_TIMEOUT, rx).await, Ok(Ok(())));
        self.syncs
            .waiting
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&id);
        answered
    }

    /// Gives the computer at `address` its policy, and remembers who it is for its questions.
    pub(crate) async fn attach(
        &self,
        address: IpAddr,
        attached: Attached,
    ) -> Result<(), BackendError> {
        let policy = crate::brokering::with_bound_hosts(
            &self.secrets,
            &attached.computer_id,
            attached.policy.clone(),
        );
        // The secrets before the policy, so the first connection the policy admits finds them.
        let mut line =
            crate::brokering::secret_lines(&self.secrets, address, &attached.computer_id);
        line.push_str(&policy_line(address, &policy));
        if let Some(token) = attached.token.as_deref().filter(|t| is_token(t)) {
            // Before the policy, so the relay's first connection is never one without it.
            line = format!("token {address} {token}\n{line}");
        }
        self.computers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(address, attached);
        self.send(&line).await
    }

    /// Gives every computer behind this proxy its policy and secrets again (the secret book
    /// changed), then waits until the proxy has read them.
    pub(crate) async fn reattach_all(&self) -> Result<(), BackendError> {
        let computers: Vec<(IpAddr, Attached)> = self
            .computers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .map(|(address, attached)| (*address, attached.clone()))
            .collect();
        for (address, attached) in computers {
            self.attach(address, attached).await?;
        }
        self.sync().await;
        Ok(())
    }

    /// Forgets a removed computer.
    pub(crate) async fn forget(&self, computer: IpAddr) -> Result<(), BackendError> {
        self.denials
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .forget(computer);
        self.computers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&computer);
        self.send(&format!("forget {computer}\n")).await
    }
}

/// Writes one control line to a proxy.
async fn send(input: &Input, line: &str) -> Result<(), BackendError> {
    let mut input = input.lock().await;
    input
        .write_all(line.as_bytes())
        .await
        .and(input.flush().await)
        .map_err(|e| BackendError::Provider(format!("the egress proxy is unreachable: {e}")))
}

/// What the reader of a proxy's output shares with the proxy.
struct Shared {
    denials: Arc<Mutex<DenialLog>>,
    syncs: Arc<Syncs>,
    input: Input,
    computers: Arc<Mutex<HashMap<IpAddr, Attached>>>,
    asking: Option<Asking>,
}

/// One question from the proxy, as the server will answer it: handed to the server (through
/// [`Asking::questions`]) and its answer written back as `answer <id> …`. `allow for this
/// computer` is granted (kept, and the policy sent again) before the answer lets the
/// connection through.
async fn answer_question(shared: Arc<Shared>, id: u64, address: IpAddr, host: String, port: u16) {
    let attached = shared
        .computers
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .get(&address)
        .cloned();
    let answer = match (attached, &shared.asking) {
        (Some(attached), Some(asking)) => {
            let (question, answered) =
                EgressQuestion::new(attached.computer_id.clone(), host.clone(), port);
            let answer = match asking.questions.try_send(question) {
                Err(_) => EgressAnswer::Refuse(reasons::TOO_MANY.to_owned()),
                Ok(()) => match tokio::time::timeout(ASK_TIMEOUT, answered).await {
                    Ok(Ok(answer)) => answer,
                    _ => EgressAnswer::Refuse(reasons::NO_ANSWER.to_owned()),
                },
            };
            if answer == EgressAnswer::ForComputer {
                grant(&shared, asking, &attached, address, &host, port).await
            } else {
                answer
            }
        }
        _ => EgressAnswer::Refuse(reasons::NO_SESSION.to_owned()),
    };
    let line = match answer {
        EgressAnswer::Once => format!("answer {id} once\n"),
        EgressAnswer::ForComputer => format!("answer {id} computer\n"),
        EgressAnswer::Refuse(reason) => format!("answer {id} refuse {reason}\n"),
    };
    if let Err(error) = send(&shared.input, &line).await {
        warn!(%error, "could not answer the egress proxy's question");
    }
}

/// `allow for this computer`: keeps `host:port` with the computer's grants and sends the proxy
/// its widened policy; when that fails, the connection is refused with the reason.
async fn grant(
    shared: &Shared,
    asking: &Asking,
    attached: &Attached,
    address: IpAddr,
    host: &str,
    port: u16,
) -> EgressAnswer {
    let pattern = match kilntainers_backend::egress::pattern_for(host, port) {
        Ok(pattern) => pattern,
        Err(e) => return EgressAnswer::Refuse(format!("cannot allow it: {e}")),
    };
    if let Err(why) = asking.grants.add(&attached.container, &pattern) {
        return EgressAnswer::Refuse(format!("cannot allow it for this computer: {why}"));
    }
    let policy = {
        let mut computers = shared
            .computers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(current) = computers.get_mut(&address) else {
            return EgressAnswer::Refuse(reasons::NO_SESSION.to_owned());
        };
        if !current.policy.allow.contains(&pattern) {
            current.policy.allow.push(pattern);
        }
        current.policy.clone()
    };
    if let Err(error) = send(&shared.input, &policy_line(address, &policy)).await {
        return EgressAnswer::Refuse(error.to_string());
    }
    EgressAnswer::ForComputer
}

/// Reads the proxy's output until it ends: stdout lines are events, stderr is logged.
async fn read_events(
    mut output: std::pin::Pin<
        Box<
            dyn futures_util::Stream<
                    Item = Result<bollard::container::LogOutput, bollard::errors::Error>,
                > + Send,
        >,
    >,
    name: String,
    shared: Shared,
    ready: tokio::sync::oneshot::Sender<()>,
    ended: Arc<std::sync::atomic::AtomicBool>,
) {
    let shared = Arc::new(shared);
    let mut ready = Some(ready);
    let mut lines = Lines::default();
    let mut errors = Lines::default();
    while let Some(Ok(frame)) = output.next().await {
        match frame {
            bollard::container::LogOutput::StdOut { message } => {
                lines.push(&message, |line| match parse_event(line) {
                    Some(Event::Ready) => {
                        if let Some(ready) = ready.take() {
                            let _ = ready.send(());
                        }
                    }
                    Some(Event::Denied(computer, denial)) => {
                        if denial.reason.starts_with(SECRET_REFUSAL_PREFIX) {
                            let computer_id = shared
                                .computers
                                .lock()
                                .unwrap_or_else(std::sync::PoisonError::into_inner)
                                .get(&computer)
                                .map(|a| a.computer_id.to_string())
                                .unwrap_or_default();
                            warn!(target: "kilntainers::audit", %computer_id, host = %denial.host, port = denial.port, reason = %denial.reason, "secret exfiltration attempt refused");
                        }
                        shared
                            .denials
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .record(computer, denial);
                    }
                    Some(Event::Synced(id)) => {
                        let waiter = shared
                            .syncs
                            .waiting
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .remove(&id);
                        if let Some(waiter) = waiter {
                            let _ = waiter.send(());
                        }
                    }
                    Some(Event::Ask {
                        id,
                        computer,
                        host,
                        port,
                    }) => {
                        tokio::spawn(answer_question(
                            Arc::clone(&shared),
                            id,
                            computer,
                            host,
                            port,
                        ));
                    }
                    None => warn!(proxy = %name, "unreadable line from the egress proxy"),
                });
            }
            bollard::container::LogOutput::StdErr { message } => {
                errors.push(&message, |line| debug!(proxy = %name, "{line}"));
            }
            _ => {}
        }
    }
    ended.store(true, std::sync::atomic::Ordering::Release);
    debug!(proxy = %name, "the egress proxy's output ended");
}

#[cfg(test)]
#[path = "egress_tests.rs"]
mod tests;
