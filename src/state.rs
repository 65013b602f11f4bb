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
