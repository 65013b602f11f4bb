//! TLS termination for bound hosts with rustls (the `Terminator` of
//! `kilntainers_helper::egress::tls`). Per connection: answer the computer's ClientHello (already
//! read by the proxy) with a leaf certificate for the host, minted from the server's CA and
//! cached; read the first request head and have the proxy rewrite it (its refusals become a
//! 403 inside TLS); connect to the host over TLS, checking its certificate against Mozilla's
//! roots (webpki-roots) and the server's extra roots; send the rewritten head; then copy both
//! ways. ALPN offers and accepts `http/1.1` only, so the head rewrite always sees HTTP/1.
//!
//! The work runs on a small tokio runtime of its own: the proxy's connection threads have small
//! stacks (64 KiB) and only wait here for their connection to end, which keeps the proxy's
//! connection caps in force. Crypto is aws-lc-rs, as everywhere in the workspace.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use kilntainers_helper::egress::http::MAX_HEAD;
use kilntainers_helper::egress::tls::{
    ClientStream, Rewrite, Terminator, TlsJob, refusal_response,
};
use kilntainers_helper::egress::{HANDSHAKE_TIMEOUT, IDLE_TIMEOUT};
use rcgen::{
    CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::time::timeout;
use tokio_rustls::{TlsAcceptor, TlsConnector};

/// Leaf certificates kept, one per host; the oldest goes first.
const MAX_LEAVES: usize = 256;
/// A leaf is valid from an hour before it is minted (clocks of computers and proxy may differ
/// a little) to a day after; it is re-minted once half that day has passed, so a cached one
/// is never close to expiry. Short, since the proxy mints again at no cost.
const LEAF_BACKDATE: time::Duration = time::Duration::hours(1);
const LEAF_VALIDITY: time::Duration = time::Duration::days(1);
const LEAF_REUSE: Duration = Duration::from_secs(12 * 3600);
/// Most worker threads of the terminator's runtime.
const MAX_WORKERS: usize = 4;
/// One direction's copy buffer.
const COPY_BUFFER: usize = 16 * 1024;
/// The only ALPN protocol offered and accepted.
const HTTP1: &[u8] = b"http/1.1";

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

/// The CA and the leaves minted from it.
struct Ca {
    issuer: Issuer<'static, KeyPair>,
    leaves: Mutex<Leaves>,
}

#[derive(Default)]
struct Leaves {
    by_host: HashMap<String, (Instant, Arc<ServerConfig>)>,
    order: VecDeque<String>,
}

impl Ca {
    fn new(cert_pem: &str, key_pem: &str) -> Result<Self, String> {
        // rcgen's errors name what failed to parse, never the key's bytes.
        let key = KeyPair::from_pem(key_pem).map_err(|e| format!("unreadable CA key: {e}"))?;
        let issuer = Issuer::from_ca_cert_pem(cert_pem, key)
            .map_err(|e| format!("unreadable CA certificate: {e}"))?;
        Ok(Self {
            issuer,
            leaves: Mutex::new(Leaves::default()),
        })
    }

    /// The server side's configuration for `host`, cached.
    fn config_for(&self, host: &str) -> Result<Arc<ServerConfig>, String> {
        if let Some((minted, config)) = lock(&self.leaves).by_host.get(host)
            && minted.elapsed() < LEAF_REUSE
        {
            return Ok(config.clone());
        }
        let config = Arc::new(self.mint(host)?);
        let mut leaves = lock(&self.leaves);
        if leaves
            .by_host
            .insert(host.to_owned(), (Instant::now(), config.clone()))
            .is_none()
        {
            leaves.order.push_back(host.to_owned());
        }
        while leaves.order.len() > MAX_LEAVES {
            if let Some(oldest) = leaves.order.pop_front() {
                leaves.by_host.remove(&oldest);
            }
        }
        Ok(config)
    }

    fn mint(&self, host: &str) -> Result<ServerConfig, String> {
        let failed = |e: rcgen::Error| format!("cannot mint a certificate for {host}: {e}");
        // A name becomes a DNS SAN, an address an IP SAN.
        let mut params = CertificateParams::new(vec![host.to_owned()]).map_err(failed)?;
        let mut name = DistinguishedName::new();
        name.push(DnType::CommonName, host);
        params.distinguished_name = name;
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        let now = time::OffsetDateTime::now_utc();
        params.not_before = now - LEAF_BACKDATE;
        params.not_after = now + LEAF_VALIDITY;
        let key = KeyPair::generate().map_err(failed)?;
        let cert = params.signed_by(&key, &self.issuer).map_err(failed)?;
        let key_der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let mut config = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_no_client_auth()
            .with_single_cert(vec![cert.der().clone()], key_der)
            .map_err(|e| format!("cannot use the certificate for {host}: {e}"))?;
        config.alpn_protocols = vec![HTTP1.to_vec()];
        Ok(config)
    }
}

/// The upstream side's configuration: Mozilla's roots and `extra`.
fn client_config(extra: &[CertificateDer<'static>]) -> Result<ClientConfig, String> {
    let mut roots = RootCertStore::from_iter(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    let (_, ignored) = roots.add_parsable_certificates(extra.iter().cloned());
    if ignored > 0 {
        return Err(format!("{ignored} of the extra roots are not usable"));
    }
    let mut config = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![HTTP1.to_vec()];
    Ok(config)
}

/// The broker's terminator.
pub struct RustlsTerminator {
    runtime: tokio::runtime::Runtime,
    ca: RwLock<Option<Arc<Ca>>>,
    upstream: RwLock<Arc<ClientConfig>>,
}

impl RustlsTerminator {
    pub fn new() -> io::Result<Self> {
        let workers = std::thread::available_parallelism()
            .map_or(1, usize::from)
            .min(MAX_WORKERS);
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers)
            .thread_name("kilntainers-tls")
            .enable_all()
            .build()?;
        let upstream = client_config(&[]).map_err(io::Error::other)?;
        Ok(Self {
            runtime,
            ca: RwLock::new(None),
            upstream: RwLock::new(Arc::new(upstream)),
        })
    }
}

impl Terminator for RustlsTerminator {
    fn serve(&self, job: TlsJob) -> Result<(), String> {
        let ca = self
            .ca
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .ok_or("the proxy has no CA to terminate TLS with")?;
        let upstream = self
            .upstream
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let (done, outcome) = std::sync::mpsc::sync_channel(1);
        // The connection's future (TLS state on both sides, buffers) is tens of KiB: it is
        // made on a worker's stack and boxed there, never on this thread's small one, which
        // only moves a few pointers into the task.
        self.runtime.spawn(async move {
            let outcome = Box::pin(serve(job, ca, upstream)).await;
            let _ = done.send(outcome);
        });
        // Dropped unsent only if the task panicked: the connection just ends.
        outcome.recv().unwrap_or(Ok(()))
    }

    fn set_ca(&self, cert_pem: &str, key_pem: &str) -> Result<(), String> {
        let ca = Ca::new(cert_pem, key_pem)?;
        // Minting once here finds a CA that cannot sign before any computer meets it.
        ca.mint("ca-check.invalid")?;
        *self.ca.write().unwrap_or_else(PoisonError::into_inner) = Some(Arc::new(ca));
        Ok(())
    }

    fn set_roots(&self, pem: &str) -> Result<(), String> {
        let extra = CertificateDer::pem_slice_iter(pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("unreadable PEM bundle: {e}"))?;
        if extra.is_empty() {
            return Err("no certificate in the bundle".to_owned());
        }
        let config = client_config(&extra)?;
        *self
            .upstream
            .write()
            .unwrap_or_else(PoisonError::into_inner) = Arc::new(config);
        Ok(())
    }
}

/// Anything the TLS layers run over.
trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// The client's stream with the bytes the proxy already read from it put back in front.
struct Replayed {
    first: Vec<u8>,
    at: usize,
    inner: Box<dyn Io>,
}

impl AsyncRead for Replayed {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.at < self.first.len() {
            let n = buf.remaining().min(self.first.len() - self.at);
            let at = self.at;
            buf.put_slice(&self.first[at..at + n]);
            self.at += n;
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for Replayed {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

fn into_tokio(client: ClientStream) -> io::Result<Box<dyn Io>> {
    client.set_nonblocking(true)?;
    Ok(match client {
        ClientStream::Tcp(s) => Box::new(tokio::net::TcpStream::from_std(s)?),
        ClientStream::Unix(s) => Box::new(tokio::net::UnixStream::from_std(s)?),
    })
}

/// The first request head (through its blank line), and what came after it; without a blank
/// line in [`MAX_HEAD`] bytes or before the client's end, what there was (the rewrite refuses
/// it). `None` when the client sent nothing.
async fn read_head(client: &mut (impl AsyncRead + Unpin)) -> Option<(Vec<u8>, Vec<u8>)> {
    let mut data = Vec::with_capacity(2048);
    let mut chunk = [0u8; 2048];
    loop {
        if let Some(end) = data.windows(4).position(|w| w == b"\r\n\r\n") {
            let rest = data.split_off(end + 4);
            return Some((data, rest));
        }
        if data.len() >= MAX_HEAD {
            return Some((data, Vec::new()));
        }
        let room = (MAX_HEAD - data.len()).min(chunk.len());
        match client.read(&mut chunk[..room]).await {
            Ok(0) | Err(_) if data.is_empty() => return None,
            Ok(0) | Err(_) => return Some((data, Vec::new())),
            Ok(n) => data.extend_from_slice(&chunk[..n]),
        }
    }
}

/// Answers a refused request inside TLS, and passes the reason on.
async fn refuse(
    client: &mut (impl AsyncWrite + Unpin),
    host: &str,
    port: u16,
    reason: String,
) -> Result<(), String> {
    let shown = if host.contains(':') {
        format!("[{host}]")
    } else {
        host.to_owned()
    };
    let _ = client
        .write_all(&refusal_response(&shown, port, &reason))
        .await;
    let _ = client.shutdown().await;
    Err(reason)
}

/// Why the upstream handshake failed, as the refusal says it.
fn upstream_failure(host: &str, error: &io::Error) -> String {
    match error
        .get_ref()
        .and_then(|e| e.downcast_ref::<rustls::Error>())
    {
        Some(rustls::Error::InvalidCertificate(why)) => {
            format!("upstream certificate for {host} is not trusted: {why}")
        }
        _ => format!("no TLS with {host}: {error}"),
    }
}

async fn serve(job: TlsJob, ca: Arc<Ca>, upstream: Arc<ClientConfig>) -> Result<(), String> {
    let TlsJob {
        host,
        port,
        client,
        hello,
        upstream: upstream_tcp,
        rewrite,
    } = job;
    let config = ca.config_for(&host)?;
    let Ok(client) = into_tokio(client) else {
        return Ok(());
    };
    let replayed = Replayed {
        first: hello,
        at: 0,
        inner: client,
    };
    // Both the handshake and the first head within the proxy's handshake time.
    let accepted = timeout(HANDSHAKE_TIMEOUT, async {
        let mut tls = TlsAcceptor::from(config).accept(replayed).await.ok()?;
        let head = read_head(&mut tls).await?;
        Some((tls, head))
    })
    .await;
    // A client that hangs up, stalls or rejects the leaf certificate: nothing to report.
    let Ok(Some((mut client, (head, rest)))) = accepted else {
        return Ok(());
    };
    let head = match run_rewrite(&rewrite, &head) {
        Ok(head) => head,
        Err(reason) => return refuse(&mut client, &host, port, reason).await,
    };
    let Ok(name) = ServerName::try_from(host.clone()) else {
        return refuse(&mut client, &host, port, "not a server name".to_owned()).await;
    };
    let connected = async {
        upstream_tcp.set_nonblocking(true)?;
        let tcp = tokio::net::TcpStream::from_std(upstream_tcp)?;
        TlsConnector::from(upstream).connect(name, tcp).await
    };
    let mut server = match timeout(HANDSHAKE_TIMEOUT, connected).await {
        Ok(Ok(server)) => server,
        Ok(Err(e)) => return refuse(&mut client, &host, port, upstream_failure(&host, &e)).await,
        Err(_) => {
            let reason = format!("no TLS handshake from {host} in time");
            return refuse(&mut client, &host, port, reason).await;
        }
    };
    if write_flushed(&mut server, &head).await.is_err()
        || write_flushed(&mut server, &rest).await.is_err()
    {
        return Ok(());
    }
    let (client_read, client_write) = tokio::io::split(client);
    let (server_read, server_write) = tokio::io::split(server);
    tokio::join!(
        pipe(client_read, server_write),
        pipe(server_read, client_write)
    );
    Ok(())
}

fn run_rewrite(rewrite: &Rewrite, head: &[u8]) -> Result<Vec<u8>, String> {
    rewrite(head)
}

/// Writes all of `data` and flushes it. A TLS stream's `write_all` can end with the last
/// records still in rustls's buffer when the socket was full; they leave only on the next write
/// or a flush, and when the other side has nothing more to send there is no next write. Without
/// the flush, a large request body stalled a few records short of its end under load.
async fn write_flushed(to: &mut (impl AsyncWrite + Unpin), data: &[u8]) -> io::Result<()> {
    to.write_all(data).await?;
    to.flush().await
}

/// Copies one way until the end, an error or [`IDLE_TIMEOUT`] without a byte, then passes the
/// end on.
pub(super) async fn pipe(mut from: impl AsyncRead + Unpin, mut to: impl AsyncWrite + Unpin) {
    let mut buffer = vec![0u8; COPY_BUFFER];
    loop {
        match timeout(IDLE_TIMEOUT, from.read(&mut buffer)).await {
            Ok(Ok(n)) if n > 0 => {
                if write_flushed(&mut to, &buffer[..n]).await.is_err() {
                    break;
                }
            }
            _ => break,
        }
    }
    let _ = to.shutdown().await;
}
