//! The file tools on WASM computers (docs/files.md, "Backends"): their host directory, reached
//! through the same cap-std root as commands ([`super::fs::Root`]), on the blocking pool. No
//! path, `..` or symlink leads out; such a path is refused, never followed.

use async_trait::async_trait;

use super::WasmBackend;
use super::fs::Root;
use kilntainers_backend::files::{FileError, FileOpError, FileSystem, Listing, ReadAnswer};
use kilntainers_backend::{BackendError, SandboxRef};

impl WasmBackend {
    /// Runs `operation` on the computer's root, off the async threads.
    async fn on_root<T: Send + 'static>(
        &self,
        sandbox: &SandboxRef,
        operation: impl FnOnce(&Root) -> Result<T, FileError> + Send + 'static,
    ) -> Result<T, FileOpError> {
        let Some(root_path) = Self::real_root(&self.dir_of(sandbox)?) else {
            return Err(BackendError::Vanished(sandbox.computer_id.clone()).into());
        };
        let ran = tokio::task::spawn_blocking(move || {
            let root = Root::open(&root_path)
                .map_err(|e| FileOpError::Backend(super::provider(e.to_string())))?;
            operation(&root).map_err(FileOpError::File)
        })
        .await;
        ran.unwrap_or_else(|e| Err(super::provider(e.to_string()).into()))
    }
}

#[async_trait]
impl FileSystem for WasmBackend {
    async fn read(
        &self,
        sandbox: &SandboxRef,
        path: &str,
        offset: u64,
        length: u64,
    ) -> Result<ReadAnswer, FileOpError> {
        let path = path.to_owned();
        self.on_root(sandbox, move |root| root.read_page(&path, offset, length))
            .await
    }

    async fn write(
        &self,
        sandbox: &SandboxRef,
        path: &str,
        bytes: &[u8],
        append: bool,
        mode: Option<u32>,
    ) -> Result<u64, FileOpError> {
        let path = path.to_owned();
        let bytes = bytes.to_vec();
        self.on_root(sandbox, move |root| {
            root.write_file(&path, &bytes, append, mode)
        })
        .await
    }

    async fn list(
        &self,
        sandbox: &SandboxRef,
        path: &str,
        depth: u8,
    ) -> Result<Listing, FileOpError> {
        let path = path.to_owned();
        self.on_root(sandbox, move |root| root.list_tree(&path, depth))
            .await
    }
}
