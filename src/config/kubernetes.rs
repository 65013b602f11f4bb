//! The `--k8s-*` settings as one typed section (docs/kubernetes.md, "Options"). clap has
//! applied the `KILNTAINERS_K8S_*` fallbacks; this refuses the sandbox-mode flags with
//! `--k8s-mode pod` and a storage size that does not parse, each with a message naming the
//! flag (in automatic mode the backend refuses them at startup when it chooses pod mode). The kubeconfig is read by the backend when it
//! connects, since finding it (and an unknown context) is part of its startup checks.

pub use kilntainers_kubernetes::config::*;

use super::ConfigError;
use crate::cli::{Cli, K8sModeChoice};

/// A sandbox-mode flag given with `--k8s-mode pod`.
fn pod_mode_refusal(flag: &str) -> ConfigError {
    ConfigError(format!(
        "{flag} belongs to sandbox mode (the agent-sandbox CRDs), but --k8s-mode is pod; remove {flag} or use --k8s-mode sandbox (docs/kubernetes.md, \"Modes\")."
    ))
}

/// Builds the section; `docker` supplies the flags both backends share, already checked.
pub fn from_cli(
    cli: &Cli,
    docker: &crate::config::DockerConfig,
) -> Result<KubernetesConfig, ConfigError> {
    let k8s = &cli.kubernetes;
    let mode = match k8s.k8s_mode {
        None => ModeChoice::Auto,
        Some(K8sModeChoice::Pod) => ModeChoice::Pod,
        Some(K8sModeChoice::Sandbox) => ModeChoice::Sandbox,
    };
    let storage = parse_storage(&k8s.k8s_storage).map_err(|e| ConfigError(e.to_string()))?;
    let non_empty = |v: &Option<String>| v.clone().filter(|s| !s.trim().is_empty());
    let template = non_empty(&k8s.k8s_template);
    let warm_pool = non_empty(&k8s.k8s_warm_pool);
    if mode == ModeChoice::Pod {
        if template.is_some() {
            return Err(pod_mode_refusal("--k8s-template"));
        }
        if warm_pool.is_some() {
            return Err(pod_mode_refusal("--k8s-warm-pool"));
        }
    }
    Ok(KubernetesConfig {
        namespace: non_empty(&k8s.k8s_namespace),
        context: non_empty(&k8s.k8s_context),
        mode,
        storage,
        service_account: non_empty(&k8s.k8s_service_account),
        template,
        warm_pool,
        image: docker.image.clone(),
        cpu: cli.docker.cpu.as_ref().map(|c| c.trim().to_owned()),
        memory_bytes: docker.memory_bytes,
        runtime: docker.runtime.clone(),
        exec_helper: docker.exec_helper,
        spares: docker.warm_pool,
        kubeconfig: None,
    })
}

#[cfg(test)]
mod tests {
    use super::super::test_cli as cli;
    use super::*;
    use crate::config::{Config, process_env};

    fn config(args: &[&str]) -> Result<Config, ConfigError> {
        let mut all = vec!["--backend", "k8s"];
        all.extend_from_slice(args);
        Config::from_cli(&cli(&all), process_env)
    }

    #[test]
    fn k8s_is_kubernetes_and_storage_defaults_to_ten_gibibytes() {
        let config = config(&[]).unwrap();
        assert_eq!(config.backend.name(), "kubernetes");
        assert_eq!(config.kubernetes.storage.as_deref(), Some("10Gi"));
        assert_eq!(config.kubernetes.mode, ModeChoice::Auto);
    }

    #[test]
    fn sandbox_flags_in_pod_mode_and_bad_sizes_are_refused_by_name() {
        let sandbox = config(&["--k8s-mode", "sandbox", "--k8s-warm-pool", "pool"]).unwrap();
        assert_eq!(sandbox.kubernetes.mode, ModeChoice::Sandbox);
        assert_eq!(sandbox.kubernetes.warm_pool.as_deref(), Some("pool"));
        let error = config(&["--k8s-mode", "pod", "--k8s-template", "t"])
            .unwrap_err()
            .0;
        assert!(
            error.starts_with("--k8s-template belongs to sandbox mode"),
            "{error}"
        );
        // `--warm-pool` keeps spare Pods in pod mode; sandbox mode is refused (in auto mode at
        // startup, once the cluster says which mode it is).
        let error = config(&["--warm-pool", "2", "--k8s-mode", "sandbox"])
            .unwrap_err()
            .0;
        assert!(error.contains("--k8s-warm-pool"), "{error}");
        let error = config(&["--warm-pool", "2", "--k8s-warm-pool", "p"])
            .unwrap_err()
            .0;
        assert!(
            error.starts_with(
                "--warm-pool (KILNTAINERS_WARM_POOL) keeps spare Pods in pod mode only"
            ),
            "{error}"
        );
        let pooled = config(&["--warm-pool", "2", "--k8s-mode", "pod"]).unwrap();
        assert_eq!(pooled.kubernetes.spares, 2);
        assert_eq!(config(&["--warm-pool", "2"]).unwrap().kubernetes.spares, 2);
        let error = config(&["--k8s-storage", "10GB"]).unwrap_err().0;
        assert!(error.starts_with("--k8s-storage must be"), "{error}");
        let none = config(&["--k8s-storage", "0", "--k8s-mode", "pod"]).unwrap();
        assert_eq!(none.kubernetes.storage, None);
        assert_eq!(none.kubernetes.mode, ModeChoice::Pod);
    }

    #[test]
    fn shared_flags_reach_the_pod() {
        let config = config(&[
            "--cpu",
            "1.5",
            "--memory",
            "512m",
            "--runtime",
            "gvisor",
            "--image",
            "busybox",
        ])
        .unwrap();
        let k8s = &config.kubernetes;
        assert_eq!(k8s.cpu.as_deref(), Some("1.5"));
        assert_eq!(k8s.memory_bytes, Some(512 * 1024 * 1024));
        assert_eq!(k8s.runtime.as_deref(), Some("gvisor"));
        assert_eq!(k8s.image, "busybox");
    }
}
