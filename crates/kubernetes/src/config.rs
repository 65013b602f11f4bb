//! The Kubernetes backend's section (docs/kubernetes.md, "Options"): plain data the server's
//! `config::kubernetes` builds from the `--k8s-*` flags, and the parsing of a Kubernetes
//! quantity for `--k8s-storage`. No environment is read here; kubeconfig discovery happens
//! when the backend connects ([`crate::KubernetesBackend::check_startup`]).

/// `--k8s-mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModeChoice {
    /// Not given: sandbox mode when the agent-sandbox `Sandbox` CRD is served, else pod mode
    /// (docs/kubernetes.md, "Modes").
    Auto,
    /// Plain Pods and PersistentVolumeClaims.
    Pod,
    /// The agent-sandbox CRDs: `Sandbox`, and `SandboxClaim` from a warm pool.
    Sandbox,
}

/// Everything the Kubernetes backend is built from.
#[derive(Debug, Clone)]
pub struct KubernetesConfig {
    /// `--k8s-namespace`; `None` = the kubeconfig context's namespace, the in-cluster one, or
    /// `default`.
    pub namespace: Option<String>,
    /// `--k8s-context`; `None` = the kubeconfig's current context, or in-cluster configuration.
    pub context: Option<String>,
    pub mode: ModeChoice,
    /// `--k8s-storage` as the API server reads it (`10Gi`); `None` = `0`, no PVC.
    pub storage: Option<String>,
    /// `--k8s-service-account`; `None` = the namespace's `default`, with no token mounted.
    pub service_account: Option<String>,
    /// `--k8s-template` (sandbox mode): the `SandboxTemplate` whose pod template the
    /// Sandboxes are made from, instead of one built from `--image` and friends.
    pub template: Option<String>,
    /// `--k8s-warm-pool` (sandbox mode): the `SandboxWarmPool` temporary computers are
    /// claimed from.
    pub warm_pool: Option<String>,
    /// `--image`.
    pub image: String,
    /// `--cpu` as a Kubernetes CPU quantity (`1.5`), the pod's request and limit.
    pub cpu: Option<String>,
    /// `--memory` in bytes, the pod's request and limit.
    pub memory_bytes: Option<i64>,
    /// `--runtime` → the pod's `runtimeClassName` (`gvisor`, `kata-fc`, …).
    pub runtime: Option<String>,
    /// `--exec-helper`: commands through one long-lived exec of the helper per computer
    /// (docs/kubernetes.md, "Exec"), else one `pods/exec` per command.
    pub exec_helper: bool,
    /// `--warm-pool` (pod mode): started spare Pods kept for temporary computers.
    pub spares: usize,
    /// A kubeconfig file to read instead of kube's discovery (`KUBECONFIG`, `~/.kube/config`,
    /// in-cluster); no flag sets it. Tests point it at the fake API server, since `KUBECONFIG`
    /// is one value for the whole test process.
    pub kubeconfig: Option<std::path::PathBuf>,
}

/// The default `--k8s-storage`.
pub const DEFAULT_STORAGE: &str = "10Gi";

/// Why a `--k8s-storage` value is refused; the text completes the flag's error line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "--k8s-storage must be a Kubernetes quantity such as 10Gi, 500Mi or 1G, or 0 for no volume; got '{0}'."
)]
pub struct InvalidStorage(pub String);

/// Reads a `--k8s-storage` value: `0` means no PVC (`None`); otherwise a positive whole
/// number with an optional binary (`Ki`…`Ei`) or decimal (`k`, `M`…`E`) suffix, which the
/// API server accepts as a storage request. Fractions and exponents are valid quantities too,
/// but a volume size written that way is almost always a typo, so they are refused.
pub fn parse_storage(raw: &str) -> Result<Option<String>, InvalidStorage> {
    let text = raw.trim();
    let refuse = || InvalidStorage(raw.to_owned());
    let digits = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    if digits == 0 || digits > 18 {
        return Err(refuse());
    }
    let number: u64 = text[..digits].parse().map_err(|_| refuse())?;
    let suffix = &text[digits..];
    const SUFFIXES: [&str; 13] = [
        "", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "k", "M", "G", "T", "P", "E",
    ];
    if !SUFFIXES.contains(&suffix) {
        return Err(refuse());
    }
    Ok((number != 0).then(|| format!("{number}{suffix}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn storage_sizes_parse_as_the_api_server_reads_them() {
        assert_eq!(parse_storage("10Gi"), Ok(Some("10Gi".to_owned())));
        assert_eq!(parse_storage(" 500Mi "), Ok(Some("500Mi".to_owned())));
        assert_eq!(parse_storage("1G"), Ok(Some("1G".to_owned())));
        assert_eq!(
            parse_storage("1073741824"),
            Ok(Some("1073741824".to_owned()))
        );
        assert_eq!(parse_storage("0"), Ok(None));
        assert_eq!(parse_storage("0Gi"), Ok(None));
        for bad in [
            "", "Gi", "10GB", "10gi", "-1Gi", "1.5Gi", "1e9", "ten", "10 Gi",
        ] {
            assert_eq!(
                parse_storage(bad),
                Err(InvalidStorage(bad.to_owned())),
                "{bad}"
            );
        }
    }

    #[test]
    fn the_refusal_names_the_flag_and_the_value() {
        assert_eq!(
            parse_storage("10GB").unwrap_err().to_string(),
            "--k8s-storage must be a Kubernetes quantity such as 10Gi, 500Mi or 1G, or 0 for no volume; got '10GB'."
        );
    }
}
