//! Files under the state dir `~/.mcp-sandbox-computer-vm-for-ai/`: this process's instance
//! lock, and the discovery of other instances' locks for crash GC (`lifecycle.md` §9).
//!
//! A leaf module: it knows neither providers nor MCP. The OS releases an advisory lock when its
//! process dies however it dies, so "lockable" means "dead".

use std::fs::{self, File, TryLockError};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use crate::ids::InstanceId;

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
    /// it unlocked collects this instance's leftovers (lifecycle.md §10).
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
}
