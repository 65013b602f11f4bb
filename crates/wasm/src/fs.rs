//! Paths inside a computer's root (docs/decisions.md, "WASM paths"): every host-side file operation on
//! behalf of a command goes through a cap-std handle on the root, so `..`, absolute symlinks and
//! symlinks pointing outside cannot reach the host. Guest paths are normalised lexically first
//! (clamped at `/`), then resolved by cap-std, which refuses any escape.

use std::io::{self, Read as _, Seek as _, SeekFrom, Write as _};
use std::path::{Path, PathBuf};

use cap_std::ambient_authority;
use cap_std::fs::{Dir, Metadata, MetadataExt as _, OpenOptions, Permissions, PermissionsExt as _};

use kilntainers_backend::files::{self, Entry, EntryKind, FileError, Listing, ReadAnswer};

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

/// The file tools' operations on the root (docs/files.md, "Backends"): the same answers as the
/// shell programs give in a container, with cap-std refusing any path that leads outside.
impl Root {
    /// At most `length` bytes of the file at `guest_abs` from `offset`, and its size.
    pub fn read_page(
        &self,
        guest_abs: &str,
        offset: u64,
        length: u64,
    ) -> Result<ReadAnswer, FileError> {
        let relative = rel(guest_abs);
        let metadata = self
            .dir
            .metadata(relative)
            .map_err(|e| file_error(&e, guest_abs))?;
        if metadata.is_dir() {
            return Err(FileError::IsDirectory(guest_abs.to_owned()));
        }
        if !metadata.is_file() {
            return Err(FileError::NotRegular(guest_abs.to_owned()));
        }
        let read = || -> io::Result<Vec<u8>> {
            let mut file = self.dir.open(relative)?.into_std();
            file.seek(SeekFrom::Start(offset))?;
            let mut bytes = Vec::new();
            file.take(length).read_to_end(&mut bytes)?;
            Ok(bytes)
        };
        let bytes = read().map_err(|e| file_error(&e, guest_abs))?;
        Ok(ReadAnswer {
            size: metadata.len(),
            bytes,
        })
    }

    /// Writes `bytes` to `guest_abs` (replacing it atomically through a temporary file beside
    /// it, or appending), creating parent directories; returns the size afterwards.
    pub fn write_file(
        &self,
        guest_abs: &str,
        bytes: &[u8],
        append: bool,
        mode: Option<u32>,
    ) -> Result<u64, FileError> {
        let relative = rel(guest_abs);
        let failed = |e: &io::Error| write_error(e, guest_abs);
        match self.dir.metadata(relative) {
            Ok(metadata) if metadata.is_dir() => {
                return Err(FileError::WriteToDirectory(guest_abs.to_owned()));
            }
            Err(e) if escaped(&e) => return Err(FileError::Outside(guest_abs.to_owned())),
            _ => {}
        }
        if let Some((parent, _)) = relative.rsplit_once('/') {
            self.dir.create_dir_all(parent).map_err(|e| failed(&e))?;
        }
        if append {
            let mut options = OpenOptions::new();
            options.append(true).create(true);
            let file = self
                .dir
                .open_with(relative, &options)
                .map_err(|e| failed(&e))?;
            let mut file = file.into_std();
            file.write_all(bytes).map_err(|e| failed(&e))?;
            if let Some(mode) = mode {
                file.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(mode))
                    .map_err(|e| failed(&e))?;
            }
            return file.metadata().map(|m| m.len()).map_err(|e| failed(&e));
        }
        // A replaced file keeps its permission bits, as `mv` over it would not.
        let kept = self
            .dir
            .metadata(relative)
            .ok()
            .filter(Metadata::is_file)
            .map(|m| m.mode() & 0o7777);
        let temporary = files::temporary_path(guest_abs, rand::random());
        let temporary = rel(&temporary);
        let written = (|| -> io::Result<()> {
            let mut options = OpenOptions::new();
            options.write(true).create_new(true);
            let file = self.dir.open_with(temporary, &options)?;
            file.set_permissions(Permissions::from_mode(mode.or(kept).unwrap_or(0o644)))?;
            let mut file = file.into_std();
            file.write_all(bytes)?;
            file.sync_data()?;
            self.dir.rename(temporary, &self.dir, relative)
        })();
        if let Err(error) = written {
            let _ = self.dir.remove_file(temporary);
            return Err(failed(&error));
        }
        Ok(bytes.len() as u64)
    }

    /// The entries under `guest_abs` to `depth` levels (symlinks listed, never followed),
    /// sorted by path; at most [`files::LIST_LIMIT`] and whether there were more.
    pub fn list_tree(&self, guest_abs: &str, depth: u8) -> Result<Listing, FileError> {
        let relative = rel(guest_abs);
        let own = self
            .dir
            .symlink_metadata(relative)
            .map_err(|e| file_error(&e, guest_abs))?;
        let base = guest_abs.trim_end_matches('/');
        let mut entries = Vec::new();
        if !self.dir.metadata(relative).is_ok_and(|m| m.is_dir()) {
            entries.push(entry(
                if base.is_empty() { "/" } else { base }.to_owned(),
                &own,
            ));
            return Ok(Listing {
                entries,
                truncated: false,
            });
        }
        // Depth-first like `find`, stopping once one entry more than the limit is known.
        let mut pending = vec![(relative.to_owned(), base.to_owned(), 1u8)];
        let wanted = files::LIST_LIMIT + 1;
        while let Some((dir_rel, dir_guest, level)) = pending.pop() {
            let Ok(read) = self.dir.read_dir(&dir_rel) else {
                if level == 1 {
                    return Err(FileError::PermissionDenied(guest_abs.to_owned()));
                }
                continue;
            };
            for item in read.filter_map(Result::ok) {
                if entries.len() >= wanted {
                    break;
                }
                let name = item.file_name().to_string_lossy().into_owned();
                let Ok(metadata) = item.metadata() else {
                    continue;
                };
                let child_guest = format!("{dir_guest}/{name}");
                if metadata.is_dir() && level < depth {
                    let child_rel = if dir_rel == "." {
                        name.clone()
                    } else {
                        format!("{dir_rel}/{name}")
                    };
                    pending.push((child_rel, child_guest.clone(), level + 1));
                }
                entries.push(entry(child_guest, &metadata));
            }
        }
        let truncated = entries.len() > files::LIST_LIMIT;
        entries.sort_by(|a, b| a.path.cmp(&b.path));
        entries.truncate(files::LIST_LIMIT);
        Ok(Listing { entries, truncated })
    }
}

fn entry(path: String, metadata: &Metadata) -> Entry {
    let kind = if metadata.is_symlink() {
        EntryKind::Symlink
    } else if metadata.is_dir() {
        EntryKind::Dir
    } else if metadata.is_file() {
        EntryKind::File
    } else {
        EntryKind::Other
    };
    let modified = metadata
        .modified()
        .ok()
        .and_then(|t| t.into_std().duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
    Entry {
        path,
        kind,
        size: metadata.len(),
        mode: format!("{:04o}", metadata.mode() & 0o7777),
        modified,
    }
}

/// A failed read or list, in the file tools' words.
fn file_error(error: &io::Error, guest_abs: &str) -> FileError {
    let path = guest_abs.to_owned();
    if escaped(error) {
        return FileError::Outside(path);
    }
    match error.kind() {
        io::ErrorKind::NotFound | io::ErrorKind::NotADirectory => FileError::NotFound(path),
        io::ErrorKind::IsADirectory => FileError::IsDirectory(path),
        io::ErrorKind::PermissionDenied => FileError::PermissionDenied(path),
        _ => FileError::ReadFailed {
            path,
            reason: describe(error),
        },
    }
}

/// A failed write, in the file tools' words.
fn write_error(error: &io::Error, guest_abs: &str) -> FileError {
    if escaped(error) {
        return FileError::Outside(guest_abs.to_owned());
    }
    FileError::WriteFailed {
        path: guest_abs.to_owned(),
        reason: describe(error),
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

    #[test]
    fn file_tools_round_trip_inside_the_root() {
        let base = temp_root();
        let root_path = base.join("root");
        std::fs::create_dir_all(&root_path).unwrap();
        let root = Root::open(&root_path).unwrap();
        let bytes: Vec<u8> = (0..=255u8).cycle().take(70_000).collect();
        assert_eq!(
            root.write_file("/a/b/data.bin", &bytes, false, None)
                .unwrap(),
            70_000
        );
        let page = root.read_page("/a/b/data.bin", 65_536, 10_000).unwrap();
        assert_eq!(page.size, 70_000);
        assert_eq!(page.bytes, bytes[65_536..]);
        assert_eq!(
            root.write_file("/a/b/data.bin", b"xyz", true, Some(0o600))
                .unwrap(),
            70_003
        );
        root.write_file("/a/script", b"#!/bin/sh\n", false, Some(0o755))
            .unwrap();
        // A replaced file keeps its mode.
        root.write_file("/a/script", b"#!/bin/sh\ntrue\n", false, None)
            .unwrap();
        std::os::unix::fs::symlink("b", root_path.join("a/link")).unwrap();
        let listing = root.list_tree("/a", 2).unwrap();
        let seen: Vec<(&str, String, &str)> = listing
            .entries
            .iter()
            .map(|e| (e.path.as_str(), e.kind.to_string(), e.mode.as_str()))
            .collect();
        assert_eq!(
            seen,
            [
                ("/a/b", "dir".to_owned(), "0755"),
                ("/a/b/data.bin", "file".to_owned(), "0600"),
                ("/a/link", "symlink".to_owned(), "0777"),
                ("/a/script", "file".to_owned(), "0755"),
            ]
        );
        assert_eq!(root.list_tree("/a", 1).unwrap().entries.len(), 3);
        assert_eq!(
            root.read_page("/a", 0, 1),
            Err(FileError::IsDirectory("/a".into()))
        );
        assert_eq!(
            root.read_page("/nope", 0, 1),
            Err(FileError::NotFound("/nope".into()))
        );
        assert_eq!(
            root.write_file("/a/b", b"x", false, None),
            Err(FileError::WriteToDirectory("/a/b".into()))
        );
        let names: Vec<_> = std::fs::read_dir(root_path.join("a/b"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["data.bin"], "no temporary file is left behind");
        std::fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn file_tools_never_leave_the_root() {
        let base = temp_root();
        let root_path = base.join("root");
        std::fs::create_dir_all(&root_path).unwrap();
        std::fs::create_dir_all(base.join("outside")).unwrap();
        std::fs::write(base.join("outside/secret"), b"host secret").unwrap();
        std::os::unix::fs::symlink("/", root_path.join("abs")).unwrap();
        std::os::unix::fs::symlink("../outside", root_path.join("rel")).unwrap();
        std::os::unix::fs::symlink("../outside/secret", root_path.join("leak")).unwrap();
        let root = Root::open(&root_path).unwrap();
        let outside = |path: &str| FileError::Outside(path.into());
        for path in [
            "/abs/etc/hostname",
            "/rel/secret",
            "/leak",
            "/../outside/secret",
        ] {
            assert_eq!(root.read_page(path, 0, 100), Err(outside(path)), "{path}");
        }
        for (path, append) in [
            ("/rel/new", false),
            ("/rel/secret", true),
            ("/leak", false),
            ("/leak", true),
            ("/abs/tmp/x", false),
            ("/../outside/new", false),
        ] {
            assert_eq!(
                root.write_file(path, b"planted", append, None),
                Err(outside(path)),
                "{path}"
            );
        }
        assert_eq!(
            std::fs::read(base.join("outside/secret")).unwrap(),
            b"host secret"
        );
        assert!(!base.join("outside/new").exists());
        let names: Vec<_> = std::fs::read_dir(base.join("outside"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["secret"]);
        // A listing shows the link itself and never what is behind it.
        let listing = root.list_tree("/rel", 3).unwrap();
        assert_eq!(listing.entries.len(), 1);
        assert_eq!(listing.entries[0].kind, EntryKind::Symlink);
        assert_eq!(
            root.list_tree("/../outside", 1),
            Err(FileError::Outside("/../outside".into()))
        );
        std::fs::remove_dir_all(&base).unwrap();
    }
}
