//! The startup checks (docs/kubernetes.md, "Startup checks"): the kubeconfig (an unknown
//! context is refused by name), the API server reachable, the namespace present, and every
//! permission the backend uses granted, each asked with one `SelfSubjectAccessReview`; the
//! refusal lists all that are missing and points at `deploy/kubernetes/`.

use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
};
use k8s_openapi::api::core::v1::Namespace;
use kube::api::PostParams;
use kube::config::{KubeConfigOptions, Kubeconfig, KubeconfigError};
use kube::{Api, Client};

use crate::config::KubernetesConfig;
use crate::exec::cap;

/// One permission the backend uses: `verb` on `resource[/subresource]` in the namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Permission {
    pub verb: &'static str,
    pub resource: &'static str,
    pub subresource: Option<&'static str>,
}

impl std::fmt::Display for Permission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.subresource {
            Some(sub) => write!(f, "{} {}/{sub}", self.verb, self.resource),
            None => write!(f, "{} {}", self.verb, self.resource),
        }
    }
}

const fn on(verb: &'static str, resource: &'static str) -> Permission {
    Permission {
        verb,
        resource,
        subresource: None,
    }
}

const fn sub(verb: &'static str, resource: &'static str, subresource: &'static str) -> Permission {
    Permission {
        verb,
        resource,
        subresource: Some(subresource),
    }
}

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

/// Every permission the backend checks at startup with this configuration.
pub fn required(config: &KubernetesConfig) -> Vec<Permission> {
    let mut all = POD_PERMISSIONS.to_vec();
    if config.storage.is_some() {
        all.extend(CLAIM_PERMISSIONS);
    }
    all
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
    for permission in required(config) {
        let review = SelfSubjectAccessReview {
            spec: SelfSubjectAccessReviewSpec {
                resource_attributes: Some(ResourceAttributes {
                    namespace: Some(namespace.to_owned()),
                    verb: Some(permission.verb.to_owned()),
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
            image: "busybox".to_owned(),
            cpu: None,
            memory_bytes: None,
            runtime: None,
            kubeconfig: None,
        }
    }

    #[test]
    fn volumes_need_claim_permissions_only_when_there_are_volumes() {
        let with = required(&config(Some("10Gi")));
        let without = required(&config(None));
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
