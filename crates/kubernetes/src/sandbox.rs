//! The agent-sandbox resources sandbox mode uses (docs/kubernetes.md, "Mapping (sandbox
//! mode)"), as typed serde structs with hand-written [`kube::Resource`] impls: `Sandbox`
//! (`agents.x-k8s.io/v1beta1`), `SandboxClaim`, `SandboxTemplate` and `SandboxWarmPool`
//! (`extensions.agents.x-k8s.io/v1beta1`). Only the fields the backend writes or reads are
//! declared; the shapes follow the vendored CRDs in `tests/provider-definitions/kubernetes/`,
//! against which the fake checks every body. Also the builders of the objects a computer is
//! made of, and which Pod is behind a Sandbox.

use std::borrow::Cow;
use std::collections::BTreeMap;

use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::core::v1::{PersistentVolumeClaimSpec, PodSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};

use crate::objects::{HOME_VOLUME, Recipe};

/// The annotation agent-sandbox puts on a Sandbox whose Pod it adopted from a warm pool (the
/// Pod then keeps its own name); without it the Pod has the Sandbox's name.
pub const POD_NAME_ANNOTATION: &str = "agents.x-k8s.io/pod-name";
const SANDBOX_GROUP: &str = "agents.x-k8s.io";
const EXTENSIONS_GROUP: &str = "extensions.agents.x-k8s.io";
const VERSION: &str = "v1beta1";

/// `operatingMode` values (the v1beta1 CRD's enum; v1alpha1's `replicas` is not used).
pub const RUNNING: &str = "Running";
pub const SUSPENDED: &str = "Suspended";

/// Implements [`kube::Resource`] for a namespaced agent-sandbox type with a `metadata` field.
macro_rules! resource {
    ($type:ty, $kind:literal, $group:expr, $plural:literal) => {
        impl kube::Resource for $type {
            type DynamicType = ();
            type Scope = NamespaceResourceScope;

            fn kind(_: &()) -> Cow<'_, str> {
                Cow::Borrowed($kind)
            }
            fn group(_: &()) -> Cow<'_, str> {
                Cow::Borrowed($group)
            }
            fn version(_: &()) -> Cow<'_, str> {
                Cow::Borrowed(VERSION)
            }
            fn plural(_: &()) -> Cow<'_, str> {
                Cow::Borrowed($plural)
            }
            fn meta(&self) -> &ObjectMeta {
                &self.metadata
            }
            fn meta_mut(&mut self) -> &mut ObjectMeta {
                &mut self.metadata
            }
        }
    };
}

/// The labels and annotations of a Sandbox's Pod (the CRD's `PodMetadata`: nothing else).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct PodMetadata {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub annotations: Option<BTreeMap<String, String>>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct PodTemplate {
    #[serde(default)]
    pub metadata: PodMetadata,
    pub spec: PodSpec,
}

/// A `volumeClaimTemplates` entry; the controller names the PVC `<name>-<sandbox>`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct VolumeClaimTemplate {
    pub metadata: VolumeClaimMetadata,
    pub spec: PersistentVolumeClaimSpec,
}

/// The PVC's metadata; ours carries the computer's labels and annotations, so the volume
/// reads back as the computer's like every other object of it.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct VolumeClaimMetadata {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub annotations: Option<BTreeMap<String, String>>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxSpec {
    pub pod_template: PodTemplate,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volume_claim_templates: Vec<VolumeClaimTemplate>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operating_mode: Option<String>,
    /// RFC 3339; the controller deletes (or, by policy, retains) the Sandbox then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shutdown_time: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shutdown_policy: Option<String>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    #[serde(rename = "type")]
    pub type_: String,
    pub status: String,
    #[serde(default)]
    pub reason: Option<String>,
    #[serde(default)]
    pub message: Option<String>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SandboxStatus {
    #[serde(default)]
    pub conditions: Vec<Condition>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Sandbox {
    pub metadata: ObjectMeta,
    pub spec: SandboxSpec,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<SandboxStatus>,
}
resource!(Sandbox, "Sandbox", SANDBOX_GROUP, "sandboxes");

impl Sandbox {
    /// The name of the Pod behind this Sandbox (the CRD's contract: the pod-name annotation
    /// when the Pod was adopted from a warm pool, else the Sandbox's own name).
    pub fn pod_name(&self) -> Option<String> {
        self.metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(POD_NAME_ANNOTATION))
            .cloned()
            .or_else(|| self.metadata.name.clone())
    }

    /// Whether the Sandbox is asked to be suspended.
    pub fn suspended(&self) -> bool {
        self.spec.operating_mode.as_deref() == Some(SUSPENDED)
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct NameRef {
    pub name: String,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimLifecycle {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shutdown_time: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shutdown_policy: Option<String>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxClaimSpec {
    /// v1beta1 claims name a warm pool (required); the pool names the template.
    pub warm_pool_ref: NameRef,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lifecycle: Option<ClaimLifecycle>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub additional_pod_metadata: Option<PodMetadata>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ClaimedSandbox {
    #[serde(default)]
    pub name: Option<String>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SandboxClaimStatus {
    #[serde(default)]
    pub sandbox: Option<ClaimedSandbox>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SandboxClaim {
    pub metadata: ObjectMeta,
    pub spec: SandboxClaimSpec,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<SandboxClaimStatus>,
}
resource!(
    SandboxClaim,
    "SandboxClaim",
    EXTENSIONS_GROUP,
    "sandboxclaims"
);

impl SandboxClaim {
    /// The Sandbox the controller bound to this claim, once it has.
    pub fn sandbox_name(&self) -> Option<&str> {
        self.status
            .as_ref()
            .and_then(|s| s.sandbox.as_ref())
            .and_then(|s| s.name.as_deref())
            .filter(|n| !n.is_empty())
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxTemplateSpec {
    pub pod_template: PodTemplate,
}

/// Read only: `--k8s-template`'s pod template is the base of the Sandboxes this server makes.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SandboxTemplate {
    pub metadata: ObjectMeta,
    pub spec: SandboxTemplateSpec,
}
resource!(
    SandboxTemplate,
    "SandboxTemplate",
    EXTENSIONS_GROUP,
    "sandboxtemplates"
);

/// Read only: `--k8s-warm-pool` must exist at startup.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SandboxWarmPool {
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: serde_json::Map<String, serde_json::Value>,
}
resource!(
    SandboxWarmPool,
    "SandboxWarmPool",
    EXTENSIONS_GROUP,
    "sandboxwarmpools"
);

/// The name agent-sandbox gives the PVC of `volumeClaimTemplates` entry `template` of
/// Sandbox `sandbox`.
pub fn claim_of_template(template: &str, sandbox: &str) -> String {
    format!("{template}-{sandbox}")
}

impl Recipe {
    /// The computer as a Sandbox: `pod` (pod mode's Pod spec, or `--k8s-template`'s) under
    /// our labels and annotations; a `home` volume claim template of `storage` when given;
    /// a temporary one shuts down (and is deleted) at `shutdown_time`.
    pub fn sandbox(
        &self,
        pod: PodSpec,
        storage: Option<&str>,
        shutdown_time: Option<String>,
    ) -> Sandbox {
        let metadata = self.object_metadata();
        Sandbox {
            spec: SandboxSpec {
                pod_template: PodTemplate {
                    metadata: PodMetadata {
                        labels: metadata.labels.clone(),
                        annotations: metadata.annotations.clone(),
                    },
                    spec: pod,
                },
                volume_claim_templates: storage
                    .map(|size| VolumeClaimTemplate {
                        metadata: VolumeClaimMetadata {
                            name: HOME_VOLUME.to_owned(),
                            labels: metadata.labels.clone(),
                            annotations: metadata.annotations.clone(),
                        },
                        spec: crate::objects::home_claim_spec(size),
                    })
                    .into_iter()
                    .collect(),
                operating_mode: Some(RUNNING.to_owned()),
                shutdown_policy: shutdown_time.as_ref().map(|_| "Delete".to_owned()),
                shutdown_time,
            },
            metadata,
            status: None,
        }
    }

    /// A temporary computer claimed from `warm_pool`, deleted by the controller at
    /// `shutdown_time` if no server is left to.
    pub fn claim(&self, warm_pool: &str, shutdown_time: String) -> SandboxClaim {
        let metadata = self.object_metadata();
        SandboxClaim {
            spec: SandboxClaimSpec {
                warm_pool_ref: NameRef {
                    name: warm_pool.to_owned(),
                },
                lifecycle: Some(ClaimLifecycle {
                    shutdown_time: Some(shutdown_time),
                    shutdown_policy: Some("Delete".to_owned()),
                }),
                additional_pod_metadata: Some(PodMetadata {
                    labels: metadata.labels.clone(),
                    annotations: metadata.annotations.clone(),
                }),
            },
            metadata,
            status: None,
        }
    }
}

/// The merge patch that sets a Sandbox's `operatingMode` (suspend, resume).
pub fn operating_mode_patch(mode: &str) -> serde_json::Value {
    serde_json::json!({ "spec": { "operatingMode": mode } })
}

/// RFC 3339 time `secs` from now (the Sandbox's and claim's `shutdownTime`).
pub fn shutdown_time_in(secs: i64) -> String {
    (chrono::Utc::now() + chrono::Duration::seconds(secs))
        .to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kilntainers_backend::ids::ComputerId;
    use kube::Resource;

    fn recipe(temporary: bool) -> Recipe {
        Recipe {
            computer_id: ComputerId::parse("box").unwrap(),
            temporary,
            image: "busybox".to_owned(),
            instance: temporary.then(|| "0123456789abcdef".to_owned()),
            owner: None,
            egress: None,
        }
    }

    #[test]
    fn a_permanent_sandbox_has_a_home_template_and_no_shutdown() {
        let sandbox = recipe(false).sandbox(PodSpec::default(), Some("1Gi"), None);
        assert_eq!(Sandbox::api_version(&()), "agents.x-k8s.io/v1beta1");
        assert_eq!(sandbox.spec.volume_claim_templates[0].metadata.name, "home");
        assert_eq!(sandbox.spec.shutdown_time, None);
        assert_eq!(
            Recipe::read(&sandbox.metadata, "other"),
            Some(recipe(false))
        );
        let body = serde_json::to_value(&sandbox).unwrap();
        assert_eq!(body["spec"]["operatingMode"], "Running");
        assert!(body["spec"]["podTemplate"]["metadata"]["labels"].is_object());
        assert_eq!(sandbox.pod_name().as_deref(), Some("box"));
    }

    #[test]
    fn a_claim_names_its_warm_pool_and_shuts_down() {
        let claim = recipe(true).claim("pool", shutdown_time_in(60));
        let body = serde_json::to_value(&claim).unwrap();
        assert_eq!(body["spec"]["warmPoolRef"]["name"], "pool");
        assert_eq!(body["spec"]["lifecycle"]["shutdownPolicy"], "Delete");
        assert!(
            body["spec"]["lifecycle"]["shutdownTime"]
                .as_str()
                .unwrap()
                .ends_with('Z')
        );
        assert_eq!(
            SandboxClaim::url_path(&(), Some("ns")),
            "/apis/extensions.agents.x-k8s.io/v1beta1/namespaces/ns/sandboxclaims"
        );
    }
}
