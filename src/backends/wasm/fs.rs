//! Paths inside a computer's root (docs/decisions.md, "WASM paths"): every host-side file operation on
//! behalf of a command goes through a cap-std handle on the root, so `..`, absolute symlinks and
//! symlinks pointing outside cannot reach the host. Guest paths are normalised lexically first
//! (clamped at `/`), then resolved by cap-std, which refuses any escape.

use std::io;
use std::path::{Path, PathBuf};

use cap_std::ambient_authority;
use cap_std::fs::{Dir, OpenOptions};

/// The root directory of one computer, opened once per command line.
pub struct Root {
    host: PathBuf,
    dir: Dir,
}

fn rel(guest_abs: &str) -> &str {
    let rel = guest_abs.trim_start_matches('/');
    if rel.is_empty() { "." } else { rel }
}

/// cap-std reports an escape as PermissionDenied "a path led outside of the filesystem".
fn escaped(error: &io::Error) -> bool {
    error.to_string().contains("outside of the filesystem")
}

/// The words a shell would print for a failed file operation.
pub fn describe(error: &io::Error) -> String {
    if escaped(error) {
        return "Permission denied (the path leads outside the computer)".into();
    }
    match error.kind() {
        io::ErrorKind::NotFound => "No such file or directory".into(),
        io::ErrorKind::IsADirectory => "Is a directory".into(),
        io::ErrorKind::NotADirectory => "Not a directory".into(),
        io::ErrorKind::PermissionDenied => "Permission denied".into(),
        io::ErrorKind::AlreadyExists => "File exists".into(),
        _ => error.to_string(),
    }
}

impl Root {
    pub fn open(host: &Path) -> io::Result<Self> {
        Ok(Self {
            host: host.to_owned(),
            dir: Dir::open_ambient_dir(host, ambient_authority())?,
        })
    }

    pub fn host_path(&self) -> &Path {
        &self.host
    }

    /// The `working_directory` of an exec: created if missing, then resolved to the host path
    /// of the real directory (symlinks followed inside the root only).
    pub fn working_dir(&self, wd: &str, guest_abs: &str) -> Result<PathBuf, String> {
        let outside = || format!("working_directory '{wd}' resolves outside the computer.");
        // cap-std does not follow a symlink while creating, so a link to outside shows up as
        // "File exists" here and as an escape when resolved below.
        let created = self.dir.create_dir_all(rel(guest_abs));
        match self.resolve_dir(guest_abs) {
            Ok(path) => Ok(path),
            Err(error) if escaped(&error) => Err(outside()),
            Err(error) => match created {
                Err(create_error) if escaped(&create_error) => Err(outside()),
                Err(create_error) => Err(format!(
                    "working_directory '{wd}': {}",
                    describe(&create_error)
                )),
                Ok(()) => Err(format!("working_directory '{wd}': {}", describe(&error))),
            },
        }
    }

    /// The host path of an existing directory inside the root, with symlinks resolved by
    /// cap-std (so the path handed to the WASI preopen contains no symlink at all).
    pub fn resolve_dir(&self, guest_abs: &str) -> io::Result<PathBuf> {
        let relative = rel(guest_abs);
        self.dir.open_dir(relative)?;
        let canonical = self.dir.canonicalize(relative)?;
        Ok(self.host.join(canonical))
    }

    pub fn open_output(&self, guest_abs: &str, append: bool) -> io::Result<std::fs::File> {
        let mut options = OpenOptions::new();
        options.write(true).create(true);
        if append {
            options.append(true);
        } else {
            options.truncate(true);
        }
        Ok(self.dir.open_with(rel(guest_abs), &options)?.into_std())
    }

    pub fn read(&self, guest_abs: &str) -> io::Result<Vec<u8>> {
        self.dir.read(rel(guest_abs))
    }

    pub fn list(&self, guest_abs: &str) -> Option<Vec<String>> {
        let entries = self.dir.read_dir(rel(guest_abs)).ok()?;
        Some(
            entries
                .filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect(),
        )
    }
}

/// Empties a directory without following symlinks out of it (factory reset).
pub fn empty_dir(path: &Path) -> io::Result<()> {
    for entry in std::fs::read_dir(path)? {
        let entry = entry?;
        let kind = entry.file_type()?;
        if kind.is_dir() {
            std::fs::remove_dir_all(entry.path())?;
        } else {
            std::fs::remove_file(entry.path())?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_root() -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("kilntainers-fs-test-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn symlinks_out_of_the_root_are_refused() {
        let base = temp_root();
        let root_path = base.join("root");
        std::fs::create_dir_all(&root_path).unwrap();
        std::fs::create_dir_all(base.join("outside")).unwrap();
        std::os::unix::fs::symlink("/", root_path.join("abs")).unwrap();
        std::os::unix::fs::symlink("../outside", root_path.join("rel")).unwrap();
        std::fs::create_dir_all(root_path.join("inner")).unwrap();
        std::os::unix::fs::symlink("inner", root_path.join("ok")).unwrap();
        let root = Root::open(&root_path).unwrap();
        for wd in ["/abs", "/abs/tmp", "/rel", "/rel/x"] {
            assert_eq!(
                root.working_dir(wd, wd).unwrap_err(),
                format!("working_directory '{wd}' resolves outside the computer.")
            );
        }
        assert!(!base.join("outside/x").exists());
        assert_eq!(
            root.working_dir("/ok", "/ok").unwrap(),
            root_path.join("inner")
        );
        assert_eq!(
            root.working_dir("/new/dir", "/new/dir").unwrap(),
            root_path.join("new/dir")
        );
        assert!(
            root.open_output("/abs/etc/kilntainers-test", false)
                .is_err()
        );
        assert!(root.read("/rel/../../etc/passwd").is_err());
        std::fs::remove_dir_all(&base).unwrap();
    }
}
