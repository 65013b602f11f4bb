//! The Kubernetes objects of one computer in pod mode (docs/kubernetes.md, "Mapping"), as
//! plain functions of the computer's facts: the object name (the computer id as a DNS-1123
//! label), the labels this server selects by and the annotations it reads back, the Pod spec
//! and the home PersistentVolumeClaim. Nothing here talks to the API server.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Capabilities, Container, PersistentVolumeClaim, PersistentVolumeClaimSpec,
    PersistentVolumeClaimVolumeSource, Pod, PodSpec, ResourceRequirements, SeccompProfile,
    SecurityContext, Volume, VolumeMount, VolumeResourceRequirements,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::config::KubernetesConfig;
use kilntainers_backend::egress::{EgressPolicy, LabelError};
use kilntainers_backend::ids::ComputerId;
use kilntainers_backend::labels::{self, kubernetes as keys};
use kilntainers_backend::posix;

/// The computer's one container.
pub const CONTAINER: &str = "computer";
/// The home volume's name in the Pod spec (and of a Sandbox's volume claim template).
pub const HOME_VOLUME: &str = "home";
/// Where a permanent computer's PVC is mounted: the home of the user the default images run
/// as (root). Everything outside it comes from the image again when the Pod is recreated.
pub const HOME_PATH: &str = "/root";
/// Longest Kubernetes object name that is a DNS-1123 label (Pods' names must be one for the
/// Pod's hostname).
const MAX_NAME: usize = 63;
/// `activeDeadlineSeconds` of a temporary computer's Pod: the cluster ends it after a day
/// even if no server is left to delete it (crash GC takes it sooner when a server starts).
/// A session that holds a temporary computer for longer loses it; permanent computers have
/// no deadline.
pub const TEMPORARY_DEADLINE_SECS: i64 = 24 * 3600;

/// The Pod's and PVC's name: the slug for the `default` principal, `<slug>-<owner tag>` for
/// another one (dots are not allowed in a DNS-1123 label), the slug shortened so the whole
/// stays within 63 characters. The full computer id is in an annotation and is compared on
/// every read, so a name another computer already holds is never taken for this one.
pub fn object_name(id: &ComputerId) -> String {
    match id.as_str().split_once('.') {
        None => id.as_str().to_owned(),
        Some((slug, tag)) => {
            let room = MAX_NAME.saturating_sub(tag.len() + 1);
            let cut = slug.get(..room.min(slug.len())).unwrap_or(slug);
            format!("{}-{tag}", cut.trim_end_matches('-'))
        }
    }
}

/// What a computer's objects say about it, read back from their labels and annotations.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recipe {
    pub computer_id: ComputerId,
    pub temporary: bool,
    pub image: String,
    /// The creating server's instance, on temporary computers (crash GC).
    pub instance: Option<String>,
    /// The owner principal as this server wrote it.
    pub owner: Option<String>,
    /// The egress policy recorded at creation ([`EgressPolicy::to_label`]'s text), when it has
    /// rules; read back with [`Recipe::egress_policy`].
    ///
    /// [`EgressPolicy::to_label`]: kilntainers_backend::egress::EgressPolicy::to_label
    pub egress: Option<String>,
}

impl Recipe {
    /// The recipe recorded on `meta`, when it is a computer of this server's (managed label
    /// and a computer-id annotation that parses).
    pub fn read(meta: &ObjectMeta, default_image: &str) -> Option<Recipe> {
        let labels = meta.labels.as_ref()?;
        if labels.get(keys::MANAGED).map(String::as_str) != Some("true") {
            return None;
        }
        let annotations = meta.annotations.as_ref()?;
        let computer_id = ComputerId::parse_stored(annotations.get(keys::COMPUTER_ID)?).ok()?;
        Some(Recipe {
            computer_id,
            temporary: labels::parse_temporary(labels.get(keys::TEMPORARY).map(String::as_str)),
            image: annotations
                .get(keys::IMAGE)
                .cloned()
                .unwrap_or_else(|| default_image.to_owned()),
            instance: labels.get(keys::INSTANCE).cloned(),
            owner: annotations.get(keys::OWNER).cloned(),
            egress: annotations.get(keys::EGRESS).cloned(),
        })
    }

    /// The recorded egress policy; one that cannot be read is an error for this computer,
    /// never an open computer.
    pub fn egress_policy(&self) -> Result<Option<EgressPolicy>, LabelError> {
        self.egress
            .as_deref()
            .map(EgressPolicy::from_label)
            .transpose()
    }

    /// Labels (what the server selects by) and annotations (what it reads back, free-form).
    pub fn object_metadata(&self) -> ObjectMeta {
        let mut labels = BTreeMap::from([
            (keys::MANAGED.to_owned(), "true".to_owned()),
            (
                keys::TEMPORARY.to_owned(),
                labels::format_bool(self.temporary).to_owned(),
            ),
        ]);
        if let Some(instance) = &self.instance {
            labels.insert(keys::INSTANCE.to_owned(), instance.clone());
        }
        labels.insert(keys::NAME.to_owned(), object_name(&self.computer_id));
        let mut annotations = BTreeMap::from([
            (keys::COMPUTER_ID.to_owned(), self.computer_id.to_string()),
            (keys::IMAGE.to_owned(), self.image.clone()),
        ]);
        if let Some(owner) = &self.owner {
            annotations.insert(keys::OWNER.to_owned(), owner.clone());
        }
        if let Some(egress) = &self.egress {
            annotations.insert(keys::EGRESS.to_owned(), egress.clone());
        }
        ObjectMeta {
            name: Some(object_name(&self.computer_id)),
            labels: Some(labels),
            annotations: Some(annotations),
            ..ObjectMeta::default()
        }
    }

    /// The computer's Pod: the keep-alive as PID 1, no service-account token, no service
    /// environment, no privilege escalation, the runtime class of `--runtime`, `--cpu` and
    /// `--memory` as request and limit, the home PVC when `with_home`, and the safety-net
    /// deadline on a temporary computer.
    pub fn pod(&self, config: &KubernetesConfig, shell: &str, with_home: bool) -> Pod {
        let home = if with_home {
            Home::Claim(object_name(&self.computer_id))
        } else {
            Home::None
        };
        Pod {
            metadata: self.object_metadata(),
            spec: Some(self.pod_spec(config, shell, home)),
            ..Pod::default()
        }
    }

    /// The Pod spec of [`Recipe::pod`], which sandbox mode uses as a Sandbox's pod template.
    pub fn pod_spec(&self, config: &KubernetesConfig, shell: &str, home: Home) -> PodSpec {
        let mut resources = BTreeMap::new();
        if let Some(cpu) = &config.cpu {
            resources.insert("cpu".to_owned(), Quantity(cpu.clone()));
        }
        if let Some(bytes) = config.memory_bytes {
            resources.insert("memory".to_owned(), Quantity(bytes.to_string()));
        }
        let resources = (!resources.is_empty()).then(|| ResourceRequirements {
            limits: Some(resources.clone()),
            requests: Some(resources),
            ..ResourceRequirements::default()
        });
        let container = Container {
            name: CONTAINER.to_owned(),
            image: Some(self.image.clone()),
            command: Some(posix::keep_alive_argv(shell)),
            resources,
            security_context: Some(SecurityContext {
                allow_privilege_escalation: Some(false),
                capabilities: Some(Capabilities {
                    drop: Some(vec!["NET_RAW".to_owned()]),
                    ..Capabilities::default()
                }),
                seccomp_profile: Some(SeccompProfile {
                    type_: "RuntimeDefault".to_owned(),
                    ..SeccompProfile::default()
                }),
                ..SecurityContext::default()
            }),
            volume_mounts: (home != Home::None).then(|| vec![home_mount()]),
            ..Container::default()
        };
        let claim = match home {
            Home::Claim(claim) => Some(claim),
            Home::None | Home::FromTemplate => None,
        };
        PodSpec {
            containers: vec![container],
            restart_policy: Some("Never".to_owned()),
            automount_service_account_token: Some(false),
            enable_service_links: Some(false),
            service_account_name: config.service_account.clone(),
            runtime_class_name: config.runtime.clone(),
            active_deadline_seconds: self.temporary.then_some(TEMPORARY_DEADLINE_SECS),
            termination_grace_period_seconds: Some(0),
            volumes: claim.map(|claim| {
                vec![Volume {
                    name: HOME_VOLUME.to_owned(),
                    persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                        claim_name: claim,
                        ..PersistentVolumeClaimVolumeSource::default()
                    }),
                    ..Volume::default()
                }]
            }),
            ..PodSpec::default()
        }
    }

    /// A permanent computer's home volume of `size`, one node at a time.
    pub fn home_claim(&self, size: &str) -> PersistentVolumeClaim {
        PersistentVolumeClaim {
            metadata: self.object_metadata(),
            spec: Some(home_claim_spec(size)),
            ..PersistentVolumeClaim::default()
        }
    }
}

/// Where a computer's home comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Home {
    None,
    /// Pod mode: the PVC of this name.
    Claim(String),
    /// Sandbox mode: the Sandbox's `home` volume claim template, whose volume the
    /// agent-sandbox controller adds to the Pod; the spec only mounts it.
    FromTemplate,
}

/// The home volume mounted at [`HOME_PATH`].
pub fn home_mount() -> VolumeMount {
    VolumeMount {
        name: HOME_VOLUME.to_owned(),
        mount_path: HOME_PATH.to_owned(),
        ..VolumeMount::default()
    }
}

/// A home volume of `size`, one node at a time.
pub fn home_claim_spec(size: &str) -> PersistentVolumeClaimSpec {
    PersistentVolumeClaimSpec {
        access_modes: Some(vec!["ReadWriteOnce".to_owned()]),
        resources: Some(VolumeResourceRequirements {
            requests: Some(BTreeMap::from([(
                "storage".to_owned(),
                Quantity(size.to_owned()),
            )])),
            ..VolumeResourceRequirements::default()
        }),
        ..PersistentVolumeClaimSpec::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModeChoice;
    use kilntainers_backend::ids::Principal;

    fn config() -> KubernetesConfig {
        KubernetesConfig {
            namespace: None,
            context: None,
            mode: ModeChoice::Auto,
            storage: Some("10Gi".to_owned()),
            service_account: None,
            template: None,
            warm_pool: None,
            image: "busybox".to_owned(),
            cpu: Some("1.5".to_owned()),
            memory_bytes: Some(512 * 1024 * 1024),
            runtime: Some("gvisor".to_owned()),
            exec_helper: true,
            spares: 0,
            kubeconfig: None,
        }
    }

    #[test]
    fn names_are_dns_labels_and_keep_principals_apart() {
        let plain = ComputerId::parse("dev-box").unwrap();
        assert_eq!(object_name(&plain), "dev-box");
        let alice = plain.owned_by(&Principal::named("alice").unwrap());
        let name = object_name(&alice);
        assert_ne!(name, "dev-box");
        assert!(name.starts_with("dev-box-"), "{name}");
        let long = ComputerId::parse(&"a".repeat(63))
            .unwrap()
            .owned_by(&Principal::named("bob").unwrap());
        let name = object_name(&long);
        assert_eq!(name.len(), 63);
        assert!(
            name.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        );
    }

    #[test]
    fn the_pod_carries_no_credentials_and_reads_back_as_its_recipe() {
        let recipe = Recipe {
            computer_id: ComputerId::parse("box").unwrap(),
            temporary: true,
            image: "busybox".to_owned(),
            instance: Some("0123456789abcdef".to_owned()),
            owner: Some("alice".to_owned()),
            egress: Some(
                EgressPolicy {
                    mode: kilntainers_backend::egress::EgressMode::None,
                    ..EgressPolicy::open()
                }
                .to_label(),
            ),
        };
        let pod = recipe.pod(&config(), "/bin/sh", false);
        assert_eq!(pod.metadata.labels.as_ref().unwrap()[keys::NAME], "box");
        let spec = pod.spec.as_ref().unwrap();
        assert_eq!(spec.automount_service_account_token, Some(false));
        assert_eq!(spec.enable_service_links, Some(false));
        assert_eq!(spec.runtime_class_name.as_deref(), Some("gvisor"));
        assert_eq!(spec.active_deadline_seconds, Some(TEMPORARY_DEADLINE_SECS));
        assert!(spec.containers[0].env.is_none());
        assert!(spec.volumes.is_none());
        assert_eq!(Recipe::read(&pod.metadata, "other"), Some(recipe.clone()));
        let permanent = Recipe {
            temporary: false,
            instance: None,
            ..recipe
        };
        let pod = permanent.pod(&config(), "/bin/sh", true);
        let spec = pod.spec.as_ref().unwrap();
        assert_eq!(spec.active_deadline_seconds, None);
        assert_eq!(
            spec.volumes.as_ref().unwrap()[0]
                .persistent_volume_claim
                .as_ref()
                .unwrap()
                .claim_name,
            "box"
        );
        let claim = permanent.home_claim("10Gi");
        assert_eq!(Recipe::read(&claim.metadata, "other"), Some(permanent));
    }
}
