//! `--secrets-store PATH` (docs/secrets-onboarding.md, "The store"): the secrets people entered
//! through the `secret_request` page, kept across restarts, encrypted at rest with AES-256-GCM
//! under a key in `PATH.key`. Without the flag they live in memory only, and this module is not
//! used.
//!
//! The file is rewritten whole on every change (a temporary file, then a rename, so a crash
//! leaves the old file or the new one), each time under a fresh random nonce; it holds every
//! principal's secrets, so the store keeps a copy of what it last wrote to rewrite from. The
//! key file is made on first use (32 random bytes, 0600) and refused when group or others can
//! read it: whoever reads it reads every stored value.
//!
//! Sits below `config`, which opens it at startup and hands what it loaded to the
//! `SecretBook`; it knows the brokering vocabulary and nothing of MCP or HTTP. No error or log
//! line carries a value.

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

use aws_lc_rs::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use kilntainers_backend::brokering::{BrokeredSecret, HeaderTemplate, SecretName, check_value};
use kilntainers_backend::egress::Pattern;

use crate::ids::Principal;
use crate::secret::Secret;

/// What every store file starts with; also the data authenticated with each encryption, so a
/// file of another format or version is refused rather than misread.
const MAGIC: &[u8] = b"kilntainers-secrets-store v1\n";
/// The key's length: AES-256.
const KEY_BYTES: usize = 32;
/// Largest store file read: 64 principals' worth of 64 secrets of 16 KiB is far below it.
const MAX_STORE_BYTES: u64 = 256 * 1024 * 1024;

/// Why the store cannot be opened or written; messages name the file, never a value.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot read or write {path}: {source}")]
    Io { path: String, source: io::Error },
    #[error(
        "{path} is mode {mode:04o}; it is the key to every stored secret, so only its owner may read it: chmod 600 '{path}'"
    )]
    KeyReadable { path: String, mode: u32 },
    #[error(
        "{path} is not a key of {KEY_BYTES} bytes; remove it only together with the store it encrypts"
    )]
    KeyLength { path: String },
    #[error("{path} is not a secrets store (it does not start as one does)")]
    NotAStore { path: String },
    #[error(
        "cannot decrypt {path} with {key}: the key is not the one the store was written with, or the file is damaged"
    )]
    Decrypt { path: String, key: String },
    #[error("{path} decrypts, but its content is not valid: {why}")]
    Content { path: String, why: String },
    #[error("cannot encrypt the secrets store")]
    Encrypt,
    #[error("cannot draw random bytes for the secrets store")]
    Random,
}

fn io_error(path: &Path) -> impl FnOnce(io::Error) -> StoreError + '_ {
    move |source| StoreError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// One stored secret, as the plaintext holds it.
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Stored {
    name: String,
    hosts: Vec<String>,
    header: String,
    value: String,
}

/// The plaintext: each principal's secrets.
#[derive(serde::Serialize, serde::Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct Contents {
    principals: BTreeMap<String, Vec<Stored>>,
}

/// An open store: where it lives, its key, and what it last wrote.
pub struct SecretsStore {
    path: PathBuf,
    key: LessSafeKey,
    contents: Mutex<Contents>,
}

impl std::fmt::Debug for SecretsStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecretsStore")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// Secrets as the `SecretBook` takes them, per principal.
pub type Loaded = HashMap<Principal, Vec<BrokeredSecret>>;

/// `PATH.key`.
pub fn key_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".key");
    PathBuf::from(name)
}

impl SecretsStore {
    /// Opens the store at `path` (its key made on first use) and reads what it holds; a
    /// missing store file is an empty store.
    pub fn open(path: &Path) -> Result<(Self, Loaded), StoreError> {
        let key_bytes = read_or_create_key(&key_path(path))?;
        let key = UnboundKey::new(&AES_256_GCM, &key_bytes)
            .map(LessSafeKey::new)
            .map_err(|_| StoreError::KeyLength {
                path: key_path(path).display().to_string(),
            })?;
        let contents = match read_bounded(path) {
            Ok(bytes) => decrypt(&key, path, bytes)?,
            Err(error) if error.kind() == io::ErrorKind::NotFound => Contents::default(),
            Err(error) => return Err(io_error(path)(error)),
        };
        let loaded = to_secrets(&contents).map_err(|why| StoreError::Content {
            path: path.display().to_string(),
            why,
        })?;
        let store = Self {
            path: path.to_owned(),
            key,
            contents: Mutex::new(contents),
        };
        Ok((store, loaded))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Records `principal`'s secrets as they now are and rewrites the file.
    pub fn save(
        &self,
        principal: &Principal,
        secrets: &[BrokeredSecret],
    ) -> Result<(), StoreError> {
        let mut contents = self.contents.lock().unwrap_or_else(PoisonError::into_inner);
        let stored: Vec<Stored> = secrets
            .iter()
            .map(|s| Stored {
                name: s.name.to_string(),
                hosts: s.hosts.iter().map(ToString::to_string).collect(),
                header: s.header.as_str().to_owned(),
                value: s.value.expose().to_owned(),
            })
            .collect();
        if stored.is_empty() {
            contents.principals.remove(principal.as_str());
        } else {
            contents
                .principals
                .insert(principal.as_str().to_owned(), stored);
        }
        let sealed = encrypt(&self.key, &contents)?;
        write_replacing(&self.path, &sealed)
    }
}

/// The key file's 32 bytes; made (0600, exclusively) when it does not exist.
fn read_or_create_key(path: &Path) -> Result<[u8; KEY_BYTES], StoreError> {
    let shown = || path.display().to_string();
    match fs::metadata(path) {
        Ok(metadata) => {
            let mode = metadata.permissions().mode() & 0o777;
            if mode & 0o077 != 0 {
                return Err(StoreError::KeyReadable {
                    path: shown(),
                    mode,
                });
            }
            let bytes = fs::read(path).map_err(io_error(path))?;
            <[u8; KEY_BYTES]>::try_from(bytes.as_slice())
                .map_err(|_| StoreError::KeyLength { path: shown() })
        }
        Err(error) if error.kind() == io::ErrorKind::NotFound => {
            let mut key = [0u8; KEY_BYTES];
            aws_lc_rs::rand::fill(&mut key).map_err(|_| StoreError::Random)?;
            let created = OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(path);
            match created {
                Ok(mut file) => {
                    file.write_all(&key)
                        .and_then(|()| file.sync_all())
                        .map_err(io_error(path))?;
                    Ok(key)
                }
                // Another process made it first: its key is the one.
                Err(error) if error.kind() == io::ErrorKind::AlreadyExists => {
                    read_or_create_key(path)
                }
                Err(error) => Err(io_error(path)(error)),
            }
        }
        Err(error) => Err(io_error(path)(error)),
    }
}

fn read_bounded(path: &Path) -> io::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    fs::File::open(path)?
        .take(MAX_STORE_BYTES + 1)
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_STORE_BYTES {
        return Err(io::Error::other("larger than any store this server writes"));
    }
    Ok(bytes)
}

/// `MAGIC || nonce || ciphertext and tag`.
fn encrypt(key: &LessSafeKey, contents: &Contents) -> Result<Vec<u8>, StoreError> {
    let mut nonce = [0u8; NONCE_LEN];
    aws_lc_rs::rand::fill(&mut nonce).map_err(|_| StoreError::Random)?;
    let mut sealed = serde_json::to_vec(contents).map_err(|_| StoreError::Encrypt)?;
    key.seal_in_place_append_tag(
        Nonce::assume_unique_for_key(nonce),
        Aad::from(MAGIC),
        &mut sealed,
    )
    .map_err(|_| StoreError::Encrypt)?;
    let mut out = Vec::with_capacity(MAGIC.len() + NONCE_LEN + sealed.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&nonce);
    out.extend_from_slice(&sealed);
    Ok(out)
}

fn decrypt(key: &LessSafeKey, path: &Path, bytes: Vec<u8>) -> Result<Contents, StoreError> {
    let shown = path.display().to_string();
    let Some(rest) = bytes.strip_prefix(MAGIC) else {
        return Err(StoreError::NotAStore { path: shown });
    };
    if rest.len() < NONCE_LEN {
        return Err(StoreError::NotAStore { path: shown });
    }
    let (nonce, sealed) = rest.split_at(NONCE_LEN);
    let nonce = Nonce::try_assume_unique_for_key(nonce).map_err(|_| StoreError::NotAStore {
        path: shown.clone(),
    })?;
    let mut sealed = sealed.to_vec();
    let plain = key
        .open_in_place(nonce, Aad::from(MAGIC), &mut sealed)
        .map_err(|_| StoreError::Decrypt {
            path: shown.clone(),
            key: key_path(path).display().to_string(),
        })?;
    // serde's messages may quote the text, which holds values: say that, not what.
    serde_json::from_slice(plain).map_err(|_| StoreError::Content {
        path: shown,
        why: "not the JSON this server writes".to_owned(),
    })
}

/// The plaintext, checked by the rules the flags and the tool keep.
fn to_secrets(contents: &Contents) -> Result<Loaded, String> {
    let mut loaded = Loaded::new();
    for (principal, stored) in &contents.principals {
        let Some(owner) = Principal::parse(principal) else {
            return Err(format!("'{principal}' is not a principal"));
        };
        let mut secrets = Vec::with_capacity(stored.len());
        for entry in stored {
            let name = SecretName::parse(&entry.name).map_err(|e| e.to_string())?;
            let hosts = entry
                .hosts
                .iter()
                .map(|h| Pattern::parse(h).map_err(|e| format!("secret {name}: host '{h}': {e}")))
                .collect::<Result<Vec<_>, _>>()?;
            if hosts.is_empty() {
                return Err(format!("secret {name} has no hosts"));
            }
            let header =
                HeaderTemplate::parse(&entry.header).map_err(|e| format!("secret {name}: {e}"))?;
            check_value(&entry.value).map_err(|e| format!("secret {name}: {e}"))?;
            secrets.push(BrokeredSecret {
                name,
                hosts,
                header,
                value: Secret::new(entry.value.clone()),
            });
        }
        loaded.insert(owner, secrets);
    }
    Ok(loaded)
}

/// Writes `bytes` to a fresh 0600 file beside `path`, then renames it over `path`.
fn write_replacing(path: &Path, bytes: &[u8]) -> Result<(), StoreError> {
    let mut name = path.as_os_str().to_owned();
    name.push(format!(".{}.tmp", std::process::id()));
    let staging = PathBuf::from(name);
    let written = (|| {
        let mut file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&staging)?;
        // An older staging file may have had another mode.
        file.set_permissions(fs::Permissions::from_mode(0o600))?;
        file.write_all(bytes)?;
        file.sync_all()?;
        fs::rename(&staging, path)
    })();
    if written.is_err() {
        let _ = fs::remove_file(&staging);
    }
    written.map_err(io_error(path))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(name: &str, host: &str, value: &str) -> BrokeredSecret {
        BrokeredSecret {
            name: SecretName::parse(name).unwrap(),
            hosts: vec![Pattern::parse(host).unwrap()],
            header: HeaderTemplate::parse("X-Api-Key: {}").unwrap(),
            value: Secret::new(value),
        }
    }

    fn mode(path: &Path) -> u32 {
        fs::metadata(path).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn secrets_come_back_after_a_reopen_and_the_file_holds_no_value() {
        let dir = tempdir();
        let path = dir.join("store");
        let (store, loaded) = SecretsStore::open(&path).unwrap();
        assert!(loaded.is_empty());
        let alice = Principal::parse("alice").unwrap();
        let bob = Principal::parse("bob").unwrap();
        store
            .save(
                &alice,
                &[secret("GITHUB_TOKEN", "api.github.com", "ghp_value_one")],
            )
            .unwrap();
        store
            .save(&bob, &[secret("OTHER", "*.example.com", "value-of-bob")])
            .unwrap();
        assert_eq!(mode(&path), 0o600);
        assert_eq!(mode(&key_path(&path)), 0o600);
        let raw = fs::read(&path).unwrap();
        assert!(raw.starts_with(MAGIC));
        let text = String::from_utf8_lossy(&raw);
        assert!(!text.contains("ghp_value_one") && !text.contains("GITHUB_TOKEN"));

        let (_again, loaded) = SecretsStore::open(&path).unwrap();
        let of_alice = &loaded[&alice];
        assert_eq!(of_alice.len(), 1);
        assert_eq!(of_alice[0].name.as_str(), "GITHUB_TOKEN");
        assert_eq!(of_alice[0].value.expose(), "ghp_value_one");
        assert_eq!(of_alice[0].hosts_text(), "api.github.com");
        assert_eq!(of_alice[0].header.as_str(), "X-Api-Key: {}");
        assert_eq!(loaded[&bob][0].value.expose(), "value-of-bob");

        // Each write draws a new nonce: the same contents never encrypt alike.
        store
            .save(&bob, &[secret("OTHER", "*.example.com", "value-of-bob")])
            .unwrap();
        assert_ne!(fs::read(&path).unwrap(), {
            store
                .save(&bob, &[secret("OTHER", "*.example.com", "value-of-bob")])
                .unwrap();
            fs::read(&path).unwrap()
        });
        // A principal left without secrets leaves the file.
        store.save(&bob, &[]).unwrap();
        let (_, loaded) = SecretsStore::open(&path).unwrap();
        assert!(!loaded.contains_key(&bob) && loaded.contains_key(&alice));
    }

    #[test]
    fn a_wrong_key_or_a_damaged_file_fails_clearly() {
        let dir = tempdir();
        let path = dir.join("store");
        let (store, _) = SecretsStore::open(&path).unwrap();
        let alice = Principal::parse("alice").unwrap();
        store
            .save(&alice, &[secret("A", "a.test", "sk-secret-a")])
            .unwrap();
        let key = key_path(&path);
        fs::write(&key, [9u8; KEY_BYTES]).unwrap();
        let error = SecretsStore::open(&path).unwrap_err();
        assert!(matches!(error, StoreError::Decrypt { .. }), "{error}");
        assert!(
            error
                .to_string()
                .contains("not the one the store was written with")
        );
        assert!(!error.to_string().contains("sk-secret-a"));

        fs::write(&key, [1u8; 5]).unwrap();
        assert!(matches!(
            SecretsStore::open(&path).unwrap_err(),
            StoreError::KeyLength { .. }
        ));
        fs::write(&path, b"something else").unwrap();
        fs::write(&key, [1u8; KEY_BYTES]).unwrap();
        assert!(matches!(
            SecretsStore::open(&path).unwrap_err(),
            StoreError::NotAStore { .. }
        ));
    }

    #[test]
    fn a_key_others_can_read_is_refused() {
        let dir = tempdir();
        let path = dir.join("store");
        let key = key_path(&path);
        fs::write(&key, [3u8; KEY_BYTES]).unwrap();
        fs::set_permissions(&key, fs::Permissions::from_mode(0o640)).unwrap();
        let error = SecretsStore::open(&path).unwrap_err();
        assert!(
            matches!(error, StoreError::KeyReadable { mode: 0o640, .. }),
            "{error}"
        );
        assert!(error.to_string().contains("chmod 600"));
        fs::set_permissions(&key, fs::Permissions::from_mode(0o600)).unwrap();
        assert!(SecretsStore::open(&path).is_ok());
    }

    /// A fresh directory under the system temp dir, removed when dropped.
    struct TempDir(PathBuf);

    impl TempDir {
        fn join(&self, name: &str) -> PathBuf {
            self.0.join(name)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn tempdir() -> TempDir {
        let dir = std::env::temp_dir().join(format!(
            "kilntainers-store-test-{}-{}",
            std::process::id(),
            rand::random::<u64>()
        ));
        fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}
