//! Chooses and builds the backend `--backend` names: the one module that names every provider,
//! so the [`Backend`] trait's module knows none of them and a new provider is one arm here plus
//! its own module. Above `backends` and `config`, below everything that holds a backend.

use std::sync::Arc;

use crate::backends::{self, Backend, BackendError};
use crate::cli::BackendKind;
use crate::config::Config;

/// Builds the backend `--backend` selected. The only place that names concrete backends; a
/// backend left out of this build is an error, never a silent fallback to another one.
pub fn build(config: &Config) -> Result<Arc<dyn Backend>, BackendError> {
    match config.backend {
        BackendKind::Docker => Ok(Arc::new(backends::docker::DockerBackend::new(config)?)),
        #[cfg(feature = "fly")]
        BackendKind::Fly => Ok(Arc::new(backends::fly::FlyBackend::new(config)?)),
        #[cfg(feature = "e2b")]
        BackendKind::E2b => Ok(Arc::new(backends::e2b::E2bBackend::new(config)?)),
        #[cfg(feature = "modal")]
        BackendKind::Modal => Ok(Arc::new(backends::modal::ModalBackend::new(config))),
        #[cfg(feature = "wasm")]
        BackendKind::Wasm | BackendKind::GoBusybox => {
            Ok(Arc::new(backends::wasm::WasmBackend::new(config)?))
        }
        #[cfg(not(feature = "fly"))]
        kind @ BackendKind::Fly => Err(not_built(kind)),
        #[cfg(not(feature = "e2b"))]
        kind @ BackendKind::E2b => Err(not_built(kind)),
        #[cfg(not(feature = "modal"))]
        kind @ BackendKind::Modal => Err(not_built(kind)),
        #[cfg(not(feature = "wasm"))]
        kind @ (BackendKind::Wasm | BackendKind::GoBusybox) => Err(not_built(kind)),
    }
}

/// The error for a backend this build left out (config refuses it earlier; this keeps the
/// match exhaustive without a fallback).
#[cfg(not(all(feature = "fly", feature = "e2b", feature = "modal", feature = "wasm")))]
fn not_built(kind: BackendKind) -> BackendError {
    BackendError::Unavailable(kind.not_built().unwrap_or_default())
}
