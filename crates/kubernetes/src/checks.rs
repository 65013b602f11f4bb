//! The startup checks (docs/kubernetes.md, "Startup checks"): the kubeconfig (an unknown
//! context is refused by name), the API server reachable, the namespace present, and every
//! permission the backend uses granted, each asked with one `SelfSubjectAccessReview`; the
//! refusal lists all that are missing and points at `deploy/kubernetes/`. In sandbox mode
//! also the agent-sandbox CRDs served, and `--k8s-template` / `--k8s-warm-pool` present.

use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
};
use k8s_openapi::api::core::v1::Namespace;
use kube::api::PostParams;
use kube::config::{KubeConfigOptions, Kubeconfig, KubeconfigError};
use kube::{Api, Client};

use crate::config::{KubernetesConfig, ModeChoice};
use crate::exec::cap;
use crate::sandbox::{PodTemplate, SandboxTemplate, SandboxWarmPool};

/// The mode the backend runs in, once `--k8s-mode` and the cluster are known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Pod,
    Sandbox,
}

/// One permission the backend uses: `verb` on `resource[/subresource]` in the namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Permission {
    pub verb: &'static str,
    /// The API group; empty for core objects.
    pub group: &'static str,
    pub resource: &'static str,
    pub subresource: Option<&'static str>,
}

impl std::fmt::Display for Permission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.verb, self.resource)?;
        if !self.group.is_empty() {
            write!(f, ".{}", self.group)?;
        }
        match self.subresource {
            Some(sub) => write!(f, "/{sub}"),
            None => Ok(()),
        }
    }
}

const fn on(verb: &'static str, resource: &'static str) -> Permission {
    Permission {
        verb,
        group: "",
        resource,
        subresource: None,
    }
}

const fn sub(verb: &'static str, resource: &'static str, subresource: &'static str) -> Permission {
    Permission {
        verb,
        group: "",
        resource,
        subresource: Some(subresource),
    }
}

const fn crd(verb: &'static str, group: &'static str, resource: &'static str) -> Permission {
    Permission {
        verb,
        group,
        resource,
        subresource: None,
    }
}

const SANDBOXES: &str = "agents.x-k8s.io";
const EXTENSIONS: &str = "extensions.agents.x-k8s.io";
const NETWORKING: &str = "networking.k8s.io";

/// What pod mode does with Pods. Exec and port-forward upgrade a GET to a WebSocket: API
/// servers up to 1.34 authorize that as `get`, later ones as `create` (the
/// AuthorizePodWebsocketUpgradeCreatePermission gate), so both are needed across versions.
const POD_PERMISSIONS: [Permission; 8] = [
    on("create", "pods"),
    on("get", "pods"),
    on("list", "pods"),
    on("delete", "pods"),
    sub("create", "pods", "exec"),
    sub("get", "pods", "exec"),
    sub("create", "pods", "portforward"),
    sub("get", "pods", "portforward"),
];

/// What pod mode does with a permanent computer's home volume (not needed with
/// `--k8s-storage 0`).
const CLAIM_PERMISSIONS: [Permission; 4] = [
    on("create", "persistentvolumeclaims"),
    on("get", "persistentvolumeclaims"),
    on("list", "persistentvolumeclaims"),
    on("delete", "persistentvolumeclaims"),
];

/// What sandbox mode does with Sandboxes (suspend and resume are a patch).
const SANDBOX_PERMISSIONS: [Permission; 5] = [
    crd("create", SANDBOXES, "sandboxes"),
    crd("get", SANDBOXES, "sandboxes"),
    crd("list", SANDBOXES, "sandboxes"),
    crd("delete", SANDBOXES, "sandboxes"),
    crd("patch", SANDBOXES, "sandboxes"),
];

/// What sandbox mode does with claims, with `--k8s-warm-pool`.
const SANDBOX_CLAIM_PERMISSIONS: [Permission; 5] = [
    crd("create", EXTENSIONS, "sandboxclaims"),
    crd("get", EXTENSIONS, "sandboxclaims"),
    crd("list", EXTENSIONS, "sandboxclaims"),
    crd("delete", EXTENSIONS, "sandboxclaims"),
    crd("get", EXTENSIONS, "sandboxwarmpools"),
];

/// What the server does with the computers' NetworkPolicies, when its egress policy needs them
/// (docs/kubernetes.md, "Egress").
const NETWORK_POLICY_PERMISSIONS: [Permission; 4] = [
    crd("create", NETWORKING, "networkpolicies"),
    crd("get", NETWORKING, "networkpolicies"),
    crd("list", NETWORKING, "networkpolicies"),
    crd("delete", NETWORKING, "networkpolicies"),
];

/// Every permission the backend checks at startup with this configuration in `mode`, with
/// `network_policies` when the server's egress policy is kept by NetworkPolicies.
pub fn required(config: &KubernetesConfig, mode: Mode, network_policies: bool) -> Vec<Permission> {
    let mut all = required_for_computers(config, mode);
    if network_policies {
        all.extend(NETWORK_POLICY_PERMISSIONS);
    }
    all
}

fn required_for_computers(config: &KubernetesConfig, mode: Mode) -> Vec<Permission> {
    match mode {
        Mode::Pod => {
            let mut all = POD_PERMISSIONS.to_vec();
            if config.storage.is_some() {
                all.extend(CLAIM_PERMISSIONS);
            }
            if config.spares > 0 {
                // A spare becomes a computer by a patch of its labels and annotations.
                all.push(on("patch", "pods"));
            }
            all
        }
        Mode::Sandbox => {
            // The controller makes the Pods and the home PVCs; the server reads Pods and runs
            // commands in them, and deletes a home PVC itself on factory reset.
            let mut all: Vec<Permission> = POD_PERMISSIONS
                .iter()
                .filter(|p| p.verb != "create" || p.subresource.is_some())
                .filter(|p| p.verb != "delete")
                .copied()
                .collect();
            all.extend(SANDBOX_PERMISSIONS);
            if config.storage.is_some() {
                all.extend(
                    CLAIM_PERMISSIONS
                        .iter()
                        .filter(|p| p.verb == "get" || p.verb == "delete"),
                );
            }
            if config.warm_pool.is_some() {
                all.extend(SANDBOX_CLAIM_PERMISSIONS);
            }
            if config.template.is_some() {
                all.push(crd("get", EXTENSIONS, "sandboxtemplates"));
            }
            all
        }
    }
}

/// Why the backend cannot start; each text says what to do.
#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    #[error(
        "Kubernetes context '{0}' is not in the kubeconfig (KUBECONFIG, else ~/.kube/config); check --k8s-context (KILNTAINERS_K8S_CONTEXT)."
    )]
    UnknownContext(String),
    #[error("Cannot load the Kubernetes configuration: {0}")]
    Config(String),
    #[error(
        "Cannot reach the Kubernetes API server at {url}: {detail}. Check the kubeconfig's server address and that the cluster is running."
    )]
    Unreachable { url: String, detail: String },
    #[error(
        "Kubernetes namespace '{0}' does not exist; create it or choose another with --k8s-namespace (KILNTAINERS_K8S_NAMESPACE)."
    )]
    NoNamespace(String),
    #[error(
        "The Kubernetes credentials lack permissions this server needs in namespace '{namespace}': {}. Apply the Role in deploy/kubernetes/rbac.yaml (docs/kubernetes.md) to the account the server runs as.",
        .missing.join(", ")
    )]
    Missing {
        namespace: String,
        missing: Vec<String>,
    },
    #[error("Kubernetes API server at {url}: {detail}")]
    Api { url: String, detail: String },
    #[error(
        "--k8s-mode sandbox needs the agent-sandbox CRDs (agents.x-k8s.io/v1beta1 Sandbox), which this cluster does not serve; install agent-sandbox or use --k8s-mode pod (docs/kubernetes.md, \"Modes\")."
    )]
    NoSandboxCrd,
    #[error(
        "{flag} belongs to sandbox mode, but this cluster does not serve the agent-sandbox CRDs, so computers are plain Pods (pod mode); remove {flag} or install agent-sandbox (docs/kubernetes.md, \"Modes\")."
    )]
    SandboxOnly { flag: &'static str },
    #[error(
        "--warm-pool (KILNTAINERS_WARM_POOL) keeps spare Pods in pod mode only, and this cluster serves the agent-sandbox CRDs, so computers are Sandboxes (sandbox mode): spare computers come from an agent-sandbox SandboxWarmPool there; name it with --k8s-warm-pool, or choose --k8s-mode pod, or remove --warm-pool (docs/kubernetes.md, \"Warm pool\")."
    )]
    PoolInSandboxMode,
    #[error(
        "The {kind} '{name}' ({flag}) does not exist in Kubernetes namespace '{namespace}'; create it or check the name."
    )]
    NoSuchSource {
        kind: &'static str,
        name: String,
        flag: &'static str,
        namespace: String,
    },
}

/// Loads the kubeconfig (or the in-cluster configuration) as `--k8s-context` says.
pub async fn load(config: &KubernetesConfig) -> Result<kube::Config, StartupError> {
    let options = KubeConfigOptions {
        context: config.context.clone(),
        ..KubeConfigOptions::default()
    };
    let unknown_context = |e: KubeconfigError| match (e, &config.context) {
        (KubeconfigError::LoadContext(_), Some(context)) => {
            StartupError::UnknownContext(context.clone())
        }
        (other, _) => StartupError::Config(other.to_string()),
    };
    if let Some(path) = &config.kubeconfig {
        let file = Kubeconfig::read_from(path).map_err(unknown_context)?;
        return kube::Config::from_custom_kubeconfig(file, &options)
            .await
            .map_err(unknown_context);
    }
    match &config.context {
        Some(context) => kube::Config::from_kubeconfig(&KubeConfigOptions {
            context: Some(context.clone()),
            ..KubeConfigOptions::default()
        })
        .await
        .map_err(|e| match e {
            KubeconfigError::LoadContext(_) => StartupError::UnknownContext(context.clone()),
            other => StartupError::Config(other.to_string()),
        }),
        None => kube::Config::infer()
            .await
            .map_err(|e| StartupError::Config(e.to_string())),
    }
}

/// The API server answers, the namespace exists, every permission is granted.
pub async fn check(
    client: &Client,
    url: &str,
    namespace: &str,
    config: &KubernetesConfig,
    mode: Mode,
    network_policies: bool,
) -> Result<(), StartupError> {
    client
        .apiserver_version()
        .await
        .map_err(|e| StartupError::Unreachable {
            url: url.to_owned(),
            detail: cap(&e.to_string()),
        })?;
    // Reading a Namespace is cluster-wide, which a namespaced Role cannot grant: without it
    // the check is skipped (docs/kubernetes.md, "RBAC"), and a missing namespace shows at the
    // first create.
    match Api::<Namespace>::all(client.clone()).get(namespace).await {
        Ok(_) => {}
        Err(kube::Error::Api(status)) if status.code == 404 => {
            return Err(StartupError::NoNamespace(namespace.to_owned()));
        }
        Err(kube::Error::Api(status)) if status.code == 403 => {
            tracing::info!(
                namespace,
                "may not read the Namespace object; its existence is not checked"
            );
        }
        Err(e) => {
            return Err(StartupError::Api {
                url: url.to_owned(),
                detail: cap(&e.to_string()),
            });
        }
    }
    let reviews = Api::<SelfSubjectAccessReview>::all(client.clone());
    let mut missing = Vec::new();
    for permission in required(config, mode, network_policies) {
        let review = SelfSubjectAccessReview {
            spec: SelfSubjectAccessReviewSpec {
                resource_attributes: Some(ResourceAttributes {
                    namespace: Some(namespace.to_owned()),
                    verb: Some(permission.verb.to_owned()),
                    group: (!permission.group.is_empty()).then(|| permission.group.to_owned()),
                    resource: Some(permission.resource.to_owned()),
                    subresource: permission.subresource.map(str::to_owned),
                    ..ResourceAttributes::default()
                }),
                ..SelfSubjectAccessReviewSpec::default()
            },
            ..SelfSubjectAccessReview::default()
        };
        let answer = reviews
            .create(&PostParams::default(), &review)
            .await
            .map_err(|e| StartupError::Api {
                url: url.to_owned(),
                detail: format!("access review failed: {}", cap(&e.to_string())),
            })?;
        if !answer.status.is_some_and(|s| s.allowed) {
            missing.push(permission.to_string());
        }
    }
    if missing.is_empty() {
        Ok(())
    } else {
        Err(StartupError::Missing {
            namespace: namespace.to_owned(),
            missing,
        })
    }
}

/// Whether the agent-sandbox `Sandbox` CRD is served (sandbox mode's precondition).
pub async fn sandbox_crd_served(client: &Client) -> bool {
    client
        .list_api_group_resources("agents.x-k8s.io/v1beta1")
        .await
        .is_ok_and(|list| list.resources.iter().any(|r| r.name == "sandboxes"))
}

/// The mode `--k8s-mode` and the cluster give; the sandbox-only flags refused in pod mode.
pub async fn mode(client: &Client, config: &KubernetesConfig) -> Result<Mode, StartupError> {
    let mode = match config.mode {
        ModeChoice::Pod => Mode::Pod,
        ModeChoice::Sandbox if sandbox_crd_served(client).await => Mode::Sandbox,
        ModeChoice::Sandbox => return Err(StartupError::NoSandboxCrd),
        ModeChoice::Auto if sandbox_crd_served(client).await => Mode::Sandbox,
        ModeChoice::Auto => Mode::Pod,
    };
    if mode == Mode::Sandbox && config.spares > 0 {
        return Err(StartupError::PoolInSandboxMode);
    }
    if mode == Mode::Pod {
        for (flag, given) in [
            ("--k8s-template", &config.template),
            ("--k8s-warm-pool", &config.warm_pool),
        ] {
            if given.is_some() {
                return Err(StartupError::SandboxOnly { flag });
            }
        }
    }
    Ok(mode)
}

/// In sandbox mode: `--k8s-warm-pool` exists, and `--k8s-template`'s pod template (read once
/// here; the Sandboxes this server makes start from it).
pub async fn sandbox_sources(
    client: &Client,
    url: &str,
    namespace: &str,
    config: &KubernetesConfig,
) -> Result<Option<PodTemplate>, StartupError> {
    let missing = |kind, name: &String, flag| StartupError::NoSuchSource {
        kind,
        name: name.clone(),
        flag,
        namespace: namespace.to_owned(),
    };
    let api_error = |e: kube::Error| StartupError::Api {
        url: url.to_owned(),
        detail: cap(&e.to_string()),
    };
    if let Some(pool) = &config.warm_pool {
        Api::<SandboxWarmPool>::namespaced(client.clone(), namespace)
            .get_opt(pool)
            .await
            .map_err(api_error)?
            .ok_or_else(|| missing("SandboxWarmPool", pool, "--k8s-warm-pool"))?;
    }
    let Some(template) = &config.template else {
        return Ok(None);
    };
    let found = Api::<SandboxTemplate>::namespaced(client.clone(), namespace)
        .get_opt(template)
        .await
        .map_err(api_error)?
        .ok_or_else(|| missing("SandboxTemplate", template, "--k8s-template"))?;
    Ok(Some(found.spec.pod_template))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModeChoice;

    fn config(storage: Option<&str>) -> KubernetesConfig {
        KubernetesConfig {
            namespace: None,
            context: None,
            mode: ModeChoice::Auto,
            storage: storage.map(str::to_owned),
            service_account: None,
            template: None,
            warm_pool: None,
            image: "busybox".to_owned(),
            cpu: None,
            memory_bytes: None,
            runtime: None,
            exec_helper: true,
            spares: 0,
            kubeconfig: None,
        }
    }

    #[test]
    fn volumes_need_claim_permissions_only_when_there_are_volumes() {
        let with = required(&config(Some("10Gi")), Mode::Pod, false);
        let without = required(&config(None), Mode::Pod, false);
        assert!(with.contains(&on("create", "persistentvolumeclaims")));
        assert!(
            !without
                .iter()
                .any(|p| p.resource == "persistentvolumeclaims")
        );
        assert!(without.contains(&sub("create", "pods", "exec")));
        assert_eq!(
            sub("create", "pods", "exec").to_string(),
            "create pods/exec"
        );
    }

    #[test]
    fn a_pod_mode_warm_pool_needs_patch_on_pods() {
        let mut pooled = config(None);
        pooled.spares = 2;
        assert!(required(&pooled, Mode::Pod, false).contains(&on("patch", "pods")));
        assert!(!required(&config(None), Mode::Pod, false).contains(&on("patch", "pods")));
    }

    #[test]
    fn sandbox_mode_asks_for_the_crd_verbs_and_not_for_making_pods() {
        let mut with_pool = config(Some("10Gi"));
        with_pool.warm_pool = Some("pool".to_owned());
        let all = required(&with_pool, Mode::Sandbox, false);
        assert!(all.contains(&crd("patch", SANDBOXES, "sandboxes")));
        assert!(all.contains(&crd("create", EXTENSIONS, "sandboxclaims")));
        assert!(!all.contains(&on("create", "pods")));
        assert!(!all.contains(&on("create", "persistentvolumeclaims")));
        assert!(all.contains(&on("delete", "persistentvolumeclaims")));
        assert!(all.contains(&sub("create", "pods", "exec")));
        assert_eq!(
            crd("patch", SANDBOXES, "sandboxes").to_string(),
            "patch sandboxes.agents.x-k8s.io"
        );
        let plain = required(&config(None), Mode::Sandbox, false);
        assert!(!plain.iter().any(|p| p.resource == "sandboxclaims"));
    }

    #[test]
    fn network_policies_are_asked_for_only_when_the_egress_policy_needs_them() {
        for mode in [Mode::Pod, Mode::Sandbox] {
            let open = required(&config(None), mode, false);
            assert!(!open.iter().any(|p| p.resource == "networkpolicies"));
            let filtered = required(&config(None), mode, true);
            assert!(filtered.contains(&crd("create", NETWORKING, "networkpolicies")));
            assert!(filtered.contains(&crd("delete", NETWORKING, "networkpolicies")));
        }
        assert_eq!(
            crd("create", NETWORKING, "networkpolicies").to_string(),
            "create networkpolicies.networking.k8s.io"
        );
    }

    #[test]
    fn the_refusal_lists_every_missing_permission_and_the_manifest() {
        let text = StartupError::Missing {
            namespace: "ns".to_owned(),
            missing: vec!["create pods".to_owned(), "create pods/exec".to_owned()],
        }
        .to_string();
        assert!(
            text.contains("'ns': create pods, create pods/exec."),
            "{text}"
        );
        assert!(text.contains("deploy/kubernetes/rbac.yaml"), "{text}");
    }
}
