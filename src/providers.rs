//! Chooses and builds the backend `--backend` names: the one module that names a provider
//! crate, so the backend API knows none of them and a new provider is one crate, one cargo
//! feature and one arm here. Above `backends` and `config`, below everything that holds a
//! backend.

use std::sync::Arc;

use crate::backends::{Backend, BackendError, Common};
use crate::cli::BackendKind;
use crate::config::Config;

/// Builds the backend `--backend` selected. The only place that names concrete backends; a
/// backend left out of this build is an error, never a silent fallback to another one.
pub fn build(config: &Config) -> Result<Arc<dyn Backend>, BackendError> {
    let common = Common {
        shell: config.shell.clone(),
        network: config.network,
        default_timeout_secs: config.limits.default_timeout_secs,
        egress: config.egress.clone(),
        secrets: config.secret_book.clone(),
    };
    match config.backend {
        BackendKind::Docker => Ok(Arc::new(kilntainers_docker::DockerBackend::new(
            &config.docker,
            &common,
        )?)),
        #[cfg(feature = "fly")]
        BackendKind::Fly => Ok(Arc::new(kilntainers_fly::FlyBackend::new(
            &config.fly,
            &common,
        )?)),
        #[cfg(feature = "e2b")]
        BackendKind::E2b => Ok(Arc::new(kilntainers_e2b::E2bBackend::new(
            &config.e2b,
            &common,
        )?)),
        #[cfg(feature = "modal")]
        BackendKind::Modal => Ok(Arc::new(kilntainers_modal::ModalBackend::new(
            &config.modal,
            &common,
        ))),
        #[cfg(feature = "wasm")]
        BackendKind::Wasm | BackendKind::GoBusybox => {
            Ok(Arc::new(kilntainers_wasm::WasmBackend::new(&config.wasm)?))
        }
        #[cfg(feature = "kubernetes")]
        BackendKind::Kubernetes => Ok(Arc::new(kilntainers_kubernetes::KubernetesBackend::new(
            &config.kubernetes,
            &common,
        )?)),
        #[cfg(not(feature = "fly"))]
        kind @ BackendKind::Fly => Err(not_built(kind)),
        #[cfg(not(feature = "e2b"))]
        kind @ BackendKind::E2b => Err(not_built(kind)),
        #[cfg(not(feature = "modal"))]
        kind @ BackendKind::Modal => Err(not_built(kind)),
        #[cfg(not(feature = "kubernetes"))]
        kind @ BackendKind::Kubernetes => Err(not_built(kind)),
        #[cfg(not(feature = "wasm"))]
        kind @ (BackendKind::Wasm | BackendKind::GoBusybox) => Err(not_built(kind)),
    }
}

/// The error for a backend this build left out (config refuses it earlier; this keeps the
/// match exhaustive without a fallback).
#[cfg(not(all(
    feature = "fly",
    feature = "e2b",
    feature = "modal",
    feature = "wasm",
    feature = "kubernetes"
)))]
fn not_built(kind: BackendKind) -> BackendError {
    BackendError::Unavailable(kind.not_built().unwrap_or_default())
}
