//! The per-user private directory the WebAssembly backends keep their computers in under the
//! shared temp dir (`<tmp>/kilntainers-wasm-<euid>`): made 0700, and refused at startup and at
//! every use when someone else made it, opened it up, or planted a symlink in its place.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use kilntainers_backend::ids::InstanceId;

/// Name prefix of the per-user private directory under the OS temp dir.
const PRIVATE_DIR_PREFIX: &str = "kilntainers-wasm-";

/// Why the private directory cannot be trusted or made. The text is the startup/tool error.
#[derive(Debug, thiserror::Error)]
pub enum PrivateDirError {
    #[error("Cannot use the private directory '{}': {source}", .path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "Refusing the private directory '{}': it is a symbolic link, not a directory of this user. Remove it and start again.",
        .path.display()
    )]
    Symlink { path: PathBuf },
    #[error(
        "Refusing the private directory '{}': it is not a directory. Remove it and start again.",
        .path.display()
    )]
    NotDirectory { path: PathBuf },
    #[error(
        "Refusing the private directory '{}': it belongs to uid {owner}, not to this user (uid {me}); another local user may have planted it. Remove it and start again.",
        .path.display()
    )]
    NotOurs { path: PathBuf, owner: u32, me: u32 },
    #[error(
        "Refusing the private directory '{}': its mode is {mode:04o}, so other users can reach it; it must be 0700. Remove it (or chmod 700 it) and start again.",
        .path.display()
    )]
    Open { path: PathBuf, mode: u32 },
}

/// `<base>/kilntainers-wasm-<euid>`: one private directory per user under the shared temp dir.
pub fn private_temp_dir(base: &Path) -> Result<PathBuf, PrivateDirError> {
    let uid = effective_uid(base).map_err(|source| PrivateDirError::Io {
        path: base.to_owned(),
        source,
    })?;
    Ok(base.join(format!("{PRIVATE_DIR_PREFIX}{uid}")))
}

/// Checks the private directory without creating it: `Ok(false)` when it does not exist yet.
pub fn check_private_dir(dir: &Path) -> Result<bool, PrivateDirError> {
    use std::os::unix::fs::MetadataExt;
    let io_error = |source| PrivateDirError::Io {
        path: dir.to_owned(),
        source,
    };
    // lstat: a symlink is judged as itself, never by what it points to.
    let meta = match fs::symlink_metadata(dir) {
        Ok(meta) => meta,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(io_error(e)),
    };
    if meta.file_type().is_symlink() {
        return Err(PrivateDirError::Symlink {
            path: dir.to_owned(),
        });
    }
    if !meta.is_dir() {
        return Err(PrivateDirError::NotDirectory {
            path: dir.to_owned(),
        });
    }
    let parent = dir.parent().unwrap_or(dir);
    let me = effective_uid(parent).map_err(io_error)?;
    if meta.uid() != me {
        return Err(PrivateDirError::NotOurs {
            path: dir.to_owned(),
            owner: meta.uid(),
            me,
        });
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(PrivateDirError::Open {
            path: dir.to_owned(),
            mode,
        });
    }
    Ok(true)
}

/// Creates the private directory 0700 when it is missing, then checks it as
/// [`check_private_dir`] does (whoever created it, the check decides).
pub fn ensure_private_dir(dir: &Path) -> Result<(), PrivateDirError> {
    use std::os::unix::fs::DirBuilderExt;
    if check_private_dir(dir)? {
        return Ok(());
    }
    match fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        // Another server of ours (or someone else: the check below tells) made it first.
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(source) => {
            return Err(PrivateDirError::Io {
                path: dir.to_owned(),
                source,
            });
        }
    }
    match check_private_dir(dir)? {
        true => Ok(()),
        false => Err(PrivateDirError::Io {
            path: dir.to_owned(),
            source: io::Error::from(io::ErrorKind::NotFound),
        }),
    }
}

/// Creates one directory (not its parents) with mode 0700, whatever the umask allows others.
pub fn create_private_subdir(dir: &Path) -> io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    fs::DirBuilder::new().mode(0o700).create(dir)
}

/// This process's effective uid: from `/proc/self/status` on Linux, else the owner of a file
/// created for the purpose in `probe_dir` (files are created with the effective uid).
fn effective_uid(probe_dir: &Path) -> io::Result<u32> {
    use std::os::unix::fs::MetadataExt;
    if let Ok(status) = fs::read_to_string("/proc/self/status")
        && let Some(line) = status.lines().find(|l| l.starts_with("Uid:"))
        && let Some(euid) = line.split_whitespace().nth(2)
        && let Ok(euid) = euid.parse()
    {
        return Ok(euid);
    }
    let probe = probe_dir.join(format!(".kilntainers-uid-probe-{}", InstanceId::random()));
    let file = fs::File::options()
        .write(true)
        .create_new(true)
        .open(&probe)?;
    let uid = file.metadata().map(|m| m.uid());
    let _ = fs::remove_file(&probe);
    uid
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn issue_15_the_private_dir_is_made_0700_and_checked() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let base =
            std::env::temp_dir().join(format!("kilntainers-private-test-{}", InstanceId::random()));
        fs::create_dir_all(&base).unwrap();
        let dir = private_temp_dir(&base).unwrap();
        assert!(!check_private_dir(&dir).unwrap());
        ensure_private_dir(&dir).unwrap();
        let meta = fs::symlink_metadata(&dir).unwrap();
        assert_eq!(meta.mode() & 0o7777, 0o700);
        assert_eq!(meta.uid(), effective_uid(&base).unwrap());
        // Group or other bits: refused, not repaired behind the user's back.
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o755)).unwrap();
        assert!(matches!(
            ensure_private_dir(&dir),
            Err(PrivateDirError::Open { mode: 0o755, .. })
        ));
        fs::remove_dir(&dir).unwrap();
        // A symlink planted in its place (to a directory we own) is refused too.
        let elsewhere = base.join("elsewhere");
        create_private_subdir(&elsewhere).unwrap();
        std::os::unix::fs::symlink(&elsewhere, &dir).unwrap();
        assert!(matches!(
            ensure_private_dir(&dir),
            Err(PrivateDirError::Symlink { .. })
        ));
        fs::remove_dir_all(&base).unwrap();
    }
}
