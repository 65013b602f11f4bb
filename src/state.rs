//! Files under the state dir `~/.mcp-sandbox-computer-vm-for-ai/`: this process's instance
//! lock, the discovery of other instances' locks for crash GC (docs/decisions.md, "Crash recovery"), and the
//! access token generated for an HTTP listener started without one. (The WASM backends' private
//! directory under the shared temp dir is their crate's, `kilntainers_wasm::private_dir`.)
//!
//! Uses only the backend API's ids and `Secret`: it knows neither providers nor MCP. The OS
//! releases an advisory lock when its process dies however it dies, so "lockable" means "dead".

use std::fs::{self, File, TryLockError};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::ids::InstanceId;
use crate::secret::Secret;

pub const STATE_DIR_NAME: &str = ".mcp-sandbox-computer-vm-for-ai";

/// `$HOME/.mcp-sandbox-computer-vm-for-ai`.
pub fn state_dir() -> Option<PathBuf> {
    std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .map(|home| PathBuf::from(home).join(STATE_DIR_NAME))
}

fn instances_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("instances")
}

/// This process's exclusively locked `instances/<id>.lock`; removed on drop unless
/// [`InstanceLock::keep_for_collection`] was called.
pub struct InstanceLock {
    path: PathBuf,
    keep: bool,
    /// Holding the open file holds the lock.
    _file: File,
}

impl InstanceLock {
    /// Creates and locks the file. The lock is taken on a temporary name and then renamed into
    /// place, so another server's GC can never see our lock file unlocked.
    pub fn acquire(state_dir: &Path, instance: &InstanceId, backend: &str) -> io::Result<Self> {
        let dir = instances_dir(state_dir);
        fs::create_dir_all(&dir)?;
        let path = dir.join(format!("{instance}.lock"));
        let staging = dir.join(format!(".{instance}.lock.new"));
        let mut file = File::create(&staging)?;
        file.try_lock().map_err(io::Error::other)?;
        let content = serde_json::json!({
            "instance_id": instance.as_str(),
            "pid": std::process::id(),
            "started_at": unix_seconds(),
            "backend": backend,
            "version": env!("CARGO_PKG_VERSION"),
        });
        file.write_all(content.to_string().as_bytes())?;
        fs::rename(&staging, &path)?;
        Ok(Self {
            path,
            keep: false,
            _file: file,
        })
    }
}

impl InstanceLock {
    /// Leaves the file in place at exit: cleanup did not finish, and the next server that finds
    /// it unlocked collects this instance's leftovers (docs/decisions.md, "Constants").
    pub fn keep_for_collection(&mut self) {
        self.keep = true;
    }
}

impl Drop for InstanceLock {
    fn drop(&mut self) {
        if !self.keep {
            let _ = fs::remove_file(&self.path);
        }
    }
}

/// Another instance's lock file that we could lock: that instance is dead. Keeping the file
/// open keeps it locked while its computers are collected; [`DeadInstance::forget`] deletes it.
pub struct DeadInstance {
    pub id: InstanceId,
    path: PathBuf,
    _file: File,
}

impl DeadInstance {
    pub fn forget(self) {
        let _ = fs::remove_file(&self.path);
    }
}

/// Lock files of instances other than `me` whose process is gone.
pub fn dead_instances(state_dir: &Path, me: &InstanceId) -> Vec<DeadInstance> {
    let Ok(entries) = fs::read_dir(instances_dir(state_dir)) else {
        return Vec::new();
    };
    let mut dead = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        let Some(id) = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_suffix(".lock"))
            .and_then(InstanceId::parse)
        else {
            continue;
        };
        if &id == me {
            continue;
        }
        let Ok(file) = File::options().read(true).write(true).open(&path) else {
            continue;
        };
        match file.try_lock() {
            Ok(()) => dead.push(DeadInstance {
                id,
                path,
                _file: file,
            }),
            Err(TryLockError::WouldBlock) => {}
            Err(TryLockError::Error(_)) => {}
        }
    }
    dead
}

/// Random bytes in a generated access token: 256 bits, beyond guessing over any network.
const GENERATED_TOKEN_BYTES: usize = 32;

/// The access token generated for the HTTP listener on one port, kept in
/// `http-token-<port>` (0600) so that only this user's processes can read it. Each start writes a
/// fresh one; the file is removed on drop unless another server has replaced it since.
#[derive(Debug)]
pub struct GeneratedToken {
    path: PathBuf,
    token: Secret,
}

impl GeneratedToken {
    /// Generates a token from the OS random source and writes it to `http-token-<port>` in
    /// `state_dir`. The file is created under a fresh name with `O_EXCL` and mode 0600 (never
    /// readable by others, not even for a moment, and never a file or symlink planted there)
    /// and then renamed over the final name, which replaces a stale file of a dead server.
    pub fn create(state_dir: &Path, port: u16) -> io::Result<Self> {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(state_dir)?;
        let token = random_hex(GENERATED_TOKEN_BYTES)?;
        let path = state_dir.join(format!("http-token-{port}"));
        let staging = state_dir.join(format!(".http-token-{port}.{}.new", random_hex(8)?));
        let mut file = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&staging)?;
        let written = file
            .write_all(token.as_bytes())
            .and_then(|()| file.sync_all())
            .and_then(|()| fs::rename(&staging, &path));
        if let Err(error) = written {
            let _ = fs::remove_file(&staging);
            return Err(error);
        }
        Ok(Self {
            path,
            token: Secret::new(token),
        })
    }

    /// Where the token is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The token itself: for the authentication check only.
    pub fn secret(&self) -> &Secret {
        &self.token
    }
}

impl Drop for GeneratedToken {
    fn drop(&mut self) {
        // Another server on the same port and HOME may have replaced the file since.
        if fs::read_to_string(&self.path).is_ok_and(|content| content == self.token.expose()) {
            let _ = fs::remove_file(&self.path);
        }
    }
}

/// `bytes` bytes from the kernel's random source, hex-encoded.
fn random_hex(bytes: usize) -> io::Result<String> {
    let mut buffer = vec![0_u8; bytes];
    File::open("/dev/urandom")?.read_exact(&mut buffer)?;
    Ok(buffer.iter().map(|byte| format!("{byte:02x}")).collect())
}

fn unix_seconds() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// What secrets brokering keeps in `secrets/` (docs/secrets.md, "The CA"): the key placeholders
/// are derived with, and the CA the egress proxy mints certificates for bound hosts from.
pub struct BrokerMaterial {
    pub placeholder_key: [u8; 32],
    pub ca_cert_pem: String,
    pub ca_key_pem: Secret,
}

/// The CA's name, as computers' trust stores show it.
const CA_COMMON_NAME: &str = "mcp-sandbox-computer-vm-for-ai secrets broker CA";
/// One file (0600) holds the CA's certificate and key, and another the placeholder key: each
/// written whole under a fresh name and linked into place, so concurrent first starts agree on
/// one and a crash never leaves half of one.
const CA_FILE: &str = "broker-ca.pem";
const PLACEHOLDER_KEY_FILE: &str = "placeholder.key";

/// Reads the broker's material from `<state_dir>/secrets/`, creating what is missing once.
pub fn broker_material(state_dir: &Path) -> io::Result<BrokerMaterial> {
    let dir = state_dir.join("secrets");
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dir)?;
    let key_hex = read_or_create(&dir.join(PLACEHOLDER_KEY_FILE), || random_hex(32))?;
    let placeholder_key = parse_key(key_hex.trim()).ok_or_else(|| {
        io::Error::other(format!(
            "{} is not 64 hex digits; remove it to make a new one",
            dir.join(PLACEHOLDER_KEY_FILE).display()
        ))
    })?;
    let ca_path = dir.join(CA_FILE);
    let pem = read_or_create(&ca_path, new_ca_pem)?;
    let (cert, key) = split_ca_pem(&pem).ok_or_else(|| {
        io::Error::other(format!(
            "{} does not hold a certificate and a private key; remove it to make a new CA (computers then trust the new one from their next start)",
            ca_path.display()
        ))
    })?;
    Ok(BrokerMaterial {
        placeholder_key,
        ca_cert_pem: cert,
        ca_key_pem: Secret::new(key),
    })
}

/// Brokering without a state dir: material for this process only.
pub fn ephemeral_broker_material() -> io::Result<BrokerMaterial> {
    let key = parse_key(&random_hex(32)?).ok_or_else(|| io::Error::other("bad random key"))?;
    let pem = new_ca_pem()?;
    let (cert, ca_key) = split_ca_pem(&pem).ok_or_else(|| io::Error::other("bad new CA"))?;
    Ok(BrokerMaterial {
        placeholder_key: key,
        ca_cert_pem: cert,
        ca_key_pem: Secret::new(ca_key),
    })
}

fn parse_key(hex: &str) -> Option<[u8; 32]> {
    if hex.len() != 64 {
        return None;
    }
    let mut key = [0u8; 32];
    for (i, byte) in key.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(key)
}

/// The file's content; when it does not exist, `make`'s, written 0600 under a fresh name and
/// hard-linked into place (a concurrent creator's file wins, and is what is returned).
fn read_or_create(path: &Path, make: impl FnOnce() -> io::Result<String>) -> io::Result<String> {
    match fs::read_to_string(path) {
        Ok(text) => return Ok(text),
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        Err(_) => {}
    }
    let content = make()?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let staging = path.with_file_name(format!(".{name}.{}.new", random_hex(8)?));
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&staging)?;
    let linked = file
        .write_all(content.as_bytes())
        .and_then(|()| file.sync_all())
        .and_then(|()| fs::hard_link(&staging, path));
    let _ = fs::remove_file(&staging);
    match linked {
        Ok(()) => Ok(content),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => fs::read_to_string(path),
        Err(e) => Err(e),
    }
}

/// A new self-signed CA (ECDSA P-256, ten years), certificate then key, as PEM.
fn new_ca_pem() -> io::Result<String> {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};
    let failed = |e: rcgen::Error| io::Error::other(format!("cannot make the broker CA: {e}"));
    let key = KeyPair::generate().map_err(failed)?;
    let mut params = CertificateParams::new(Vec::<String>::new()).map_err(failed)?;
    params
        .distinguished_name
        .push(DnType::CommonName, CA_COMMON_NAME);
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let now = std::time::SystemTime::now();
    params.not_before = (now - std::time::Duration::from_secs(24 * 3600)).into();
    params.not_after = (now + std::time::Duration::from_secs(10 * 365 * 24 * 3600)).into();
    let cert = params.self_signed(&key).map_err(failed)?;
    Ok(format!("{}{}", cert.pem(), key.serialize_pem()))
}

/// The certificate block and the key block of a CA file.
fn split_ca_pem(pem: &str) -> Option<(String, String)> {
    const CERT_END: &str = "-----END CERTIFICATE-----";
    let start = pem.find("-----BEGIN CERTIFICATE-----")?;
    let end = pem.find(CERT_END)? + CERT_END.len();
    let key_start = pem.find("-----BEGIN PRIVATE KEY-----")?;
    let cert = format!("{}\n", &pem[start..end]);
    let key = pem[key_start..].trim_end().to_owned() + "\n";
    Some((cert, key))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_held_lock_is_alive_and_a_released_one_is_dead() {
        let dir =
            std::env::temp_dir().join(format!("kilntainers-state-test-{}", InstanceId::random()));
        let alive = InstanceId::random();
        let gone = InstanceId::random();
        let me = InstanceId::random();
        let _alive_lock = InstanceLock::acquire(&dir, &alive, "docker").unwrap();
        let gone_lock = InstanceLock::acquire(&dir, &gone, "docker").unwrap();
        // Simulate a crash: the lock is released but the file stays.
        let gone_path = gone_lock.path.clone();
        std::mem::forget(gone_lock._file.try_clone().unwrap());
        drop(gone_lock);
        File::create(&gone_path).unwrap();
        let dead: Vec<InstanceId> = dead_instances(&dir, &me)
            .into_iter()
            .map(|d| d.id)
            .collect();
        assert_eq!(dead, vec![gone]);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn generated_token_file_is_private_fresh_and_removed_on_drop() {
        use std::os::unix::fs::PermissionsExt;
        let dir =
            std::env::temp_dir().join(format!("kilntainers-token-test-{}", InstanceId::random()));
        let first = GeneratedToken::create(&dir, 8435).unwrap();
        let path = first.path().to_owned();
        assert_eq!(path, dir.join("http-token-8435"));
        let meta = fs::symlink_metadata(&path).unwrap();
        assert!(meta.is_file());
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        assert_eq!(fs::read_to_string(&path).unwrap(), first.secret().expose());
        assert_eq!(first.secret().expose().len(), 64);
        assert!(
            first
                .secret()
                .expose()
                .bytes()
                .all(|b| b.is_ascii_hexdigit())
        );
        assert!(!format!("{first:?}").contains(first.secret().expose()));
        // A second server on the same port replaces the file; the first one's drop keeps it.
        let second = GeneratedToken::create(&dir, 8435).unwrap();
        assert_ne!(first.secret(), second.secret());
        drop(first);
        assert_eq!(fs::read_to_string(&path).unwrap(), second.secret().expose());
        drop(second);
        assert!(!path.exists());
        // No staging file is left behind.
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 0);
        // A symlink planted at the name is replaced, never followed.
        let victim =
            std::env::temp_dir().join(format!("kilntainers-victim-{}", InstanceId::random()));
        fs::write(&victim, "keep").unwrap();
        std::os::unix::fs::symlink(&victim, &path).unwrap();
        let third = GeneratedToken::create(&dir, 8435).unwrap();
        assert!(fs::symlink_metadata(&path).unwrap().is_file());
        assert_eq!(fs::read_to_string(&victim).unwrap(), "keep");
        drop(third);
        fs::remove_file(&victim).unwrap();
        fs::remove_dir_all(&dir).unwrap();
    }
}
