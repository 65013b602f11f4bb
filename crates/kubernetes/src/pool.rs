//! `--warm-pool N` in pod mode (docs/kubernetes.md, "Warm pool"): started spare Pods of the
//! configured image, their readiness checked and the exec helper put in, handed out as
//! temporary computers. A Pod cannot be renamed, so a spare keeps its name
//! (`kilntainers-spare-<hex>`) and becomes a computer by a merge patch of its labels and
//! annotations: the `kilntainers.name` label the computer's lookups and NetworkPolicy select by,
//! and the computer id, owner and egress annotations its recipe is read from. Lookups that find
//! no Pod by the computer's name then find it by those labels ([`KubernetesBackend::pod_of`]).
//!
//! A spare only becomes a computer with no egress rules: a NetworkPolicy that starts selecting
//! a Pod when its labels change is applied by the network plugin some time after, and a
//! computer must never run without its policy. A server whose own egress policy has rules
//! therefore keeps no pool, and says so at startup.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Patch, PatchParams, PostParams};
use rand::RngExt;
use tokio::sync::Notify;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::objects::{Recipe, object_name};
use crate::{KubernetesBackend, api_error, pod_runs};
use kilntainers_backend::ids::{ComputerId, InstanceId};
use kilntainers_backend::labels::kubernetes as keys;
use kilntainers_backend::{BackendError, SandboxRef, WarmPoolSize};

/// What a waiting spare's computer id (and so its Pod's name) starts with. Its own id, never
/// a computer's: lists and lookups leave such a Pod out while it carries the pooled label.
pub(crate) const SPARE_PREFIX: &str = "kilntainers-spare-";
/// The first wait after a spare could not be made, doubled per failure in a row up to
/// [`MAX_RETRY_DELAY`], so a missing image or a refusing cluster is not hammered.
const FIRST_RETRY_DELAY: Duration = Duration::from_secs(1);
const MAX_RETRY_DELAY: Duration = Duration::from_secs(60);

/// A started spare: its recipe (its own spare id) and the Pod it runs in.
struct Spare {
    recipe: Recipe,
    sandbox: SandboxRef,
    pod: String,
}

#[derive(Default)]
struct PoolState {
    ready: VecDeque<Spare>,
    /// No more spares are made or handed out (shutdown).
    closing: bool,
}

pub(crate) struct WarmPool {
    target: usize,
    state: Mutex<PoolState>,
    /// Wakes the keeper: a spare was taken, or the pool is closing.
    wake: Notify,
    /// Held by the keeper while it runs, so [`WarmPool::release`] can wait for its last fill.
    keeper: tokio::sync::Mutex<()>,
}

/// Whether a Pod with `recipe` and `labels` is a spare still waiting for its computer (not one
/// handed out, and not a computer whose id merely starts like a spare's).
pub(crate) fn is_waiting_spare(recipe: &Recipe, labels: Option<&BTreeMap<String, String>>) -> bool {
    recipe.computer_id.as_str().starts_with(SPARE_PREFIX)
        && labels
            .and_then(|l| l.get(keys::POOLED))
            .is_some_and(|v| v == "true")
}

impl WarmPool {
    pub(crate) fn new(target: usize) -> Self {
        Self {
            target,
            state: Mutex::new(PoolState::default()),
            wake: Notify::new(),
            keeper: tokio::sync::Mutex::new(()),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, PoolState> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// `None` when there is no pool.
    pub(crate) fn size(&self) -> Option<WarmPoolSize> {
        (self.target > 0).then(|| WarmPoolSize {
            ready: self.state().ready.len(),
            target: self.target,
        })
    }

    /// Makes spares one at a time until the pool is full, again whenever one is taken, until
    /// the pool closes. A spare being made when it closes is finished and joins the ready
    /// ones, which [`WarmPool::release`] removes.
    pub(crate) async fn keep(&self, backend: &KubernetesBackend, instance: &InstanceId) {
        if self.target == 0 {
            return;
        }
        let _keeping = self.keeper.lock().await;
        let mut failures: u32 = 0;
        loop {
            let (closing, ready) = {
                let state = self.state();
                (state.closing, state.ready.len())
            };
            if closing {
                break;
            }
            if ready >= self.target {
                self.wake.notified().await;
                continue;
            }
            match backend.make_spare(instance).await {
                Ok(spare) => {
                    failures = 0;
                    debug!(pod = %spare.pod, "warm-pool spare ready");
                    self.state().ready.push_back(spare);
                }
                Err(error) => {
                    failures = failures.saturating_add(1);
                    let delay = FIRST_RETRY_DELAY
                        .saturating_mul(1 << failures.min(7).saturating_sub(1))
                        .min(MAX_RETRY_DELAY);
                    warn!(%error, retry_in_secs = delay.as_secs(), "could not make a warm-pool spare");
                    let until = Instant::now() + delay;
                    tokio::select! {
                        () = tokio::time::sleep_until(until) => {}
                        () = self.wake.notified() => {}
                    }
                }
            }
        }
    }

    /// A ready spare made a temporary computer of `recipe`, when one is ready and fit for it;
    /// `None` = make the computer as without a pool.
    pub(crate) async fn take(
        &self,
        backend: &KubernetesBackend,
        recipe: &Recipe,
    ) -> Option<SandboxRef> {
        if self.target == 0
            || !recipe.temporary
            || recipe.egress.is_some()
            || recipe.image != backend.config.image
        {
            return None;
        }
        loop {
            let spare = {
                let mut state = self.state();
                if state.closing {
                    return None;
                }
                state.ready.pop_front()
            }?;
            self.wake.notify_one();
            match backend.adopt(&spare, recipe).await {
                Ok(Some(sandbox)) => return Some(sandbox),
                // Not fit to be a computer (gone, ended, another Pod): removed, next one.
                Ok(None) => backend.remove_spare(&spare).await,
                // The cluster refused the hand-over: the computer is made as without a pool.
                Err(error) => {
                    warn!(pod = %spare.pod, %error, "could not hand out a warm-pool spare");
                    backend.remove_spare(&spare).await;
                    return None;
                }
            }
        }
    }

    /// Shutdown: stops refilling, waits for a spare being made, and removes every spare.
    pub(crate) async fn release(&self, backend: &KubernetesBackend) -> Result<(), BackendError> {
        if self.target == 0 {
            return Ok(());
        }
        self.state().closing = true;
        self.wake.notify_one();
        let _keeper_done = self.keeper.lock().await;
        let spares: Vec<Spare> = self.state().ready.drain(..).collect();
        let mut failed = 0;
        for spare in &spares {
            if let Err(error) = backend.remove_computer(&spare.recipe.computer_id).await {
                warn!(pod = %spare.pod, %error, "could not remove a warm-pool spare");
                failed += 1;
            }
        }
        if failed > 0 {
            return Err(BackendError::Provider(format!(
                "{failed} warm-pool spare Pod(s) could not be removed; the next server's crash GC removes them."
            )));
        }
        Ok(())
    }
}

impl KubernetesBackend {
    /// Makes one spare: a temporary computer of the configured image under a spare id of its
    /// own, with the pooled label, run and checked as any computer (the helper is put in during
    /// readiness).
    async fn make_spare(&self, instance: &InstanceId) -> Result<Spare, BackendError> {
        let cluster = self.cluster().await?;
        let suffix: u64 = rand::rng().random();
        let id = ComputerId::parse(&format!("{SPARE_PREFIX}{suffix:016x}"))
            .map_err(|_| BackendError::Provider("a spare id is not a slug".to_owned()))?;
        let recipe = Recipe {
            computer_id: id.clone(),
            temporary: true,
            image: self.config.image.clone(),
            instance: Some(instance.as_str().to_owned()),
            owner: None,
            egress: None,
        };
        let mut pod: Pod = recipe.pod(&self.config, &self.shell, false);
        pod.metadata
            .labels
            .get_or_insert_with(BTreeMap::new)
            .insert(keys::POOLED.to_owned(), "true".to_owned());
        cluster
            .pods
            .create(&PostParams::default(), &pod)
            .await
            .map_err(|e| api_error(cluster, "Creating a warm-pool spare Pod", e))?;
        let made = async {
            let sandbox = self.wait_running(&id).await?;
            self.readiness(&sandbox).await?;
            Ok::<_, BackendError>(sandbox)
        }
        .await;
        match made {
            Ok(sandbox) => Ok(Spare {
                recipe,
                sandbox,
                pod: object_name(&id),
            }),
            Err(error) => {
                // Never leave a half-made spare behind.
                let _ = self.remove_computer(&id).await;
                Err(error)
            }
        }
    }

    /// Makes `spare` the computer of `recipe`: checks it still runs as the Pod it was made as
    /// (`Ok(None)` when not), then patches its labels and annotations in one merge patch.
    async fn adopt(
        &self,
        spare: &Spare,
        recipe: &Recipe,
    ) -> Result<Option<SandboxRef>, BackendError> {
        let cluster = self.cluster().await?;
        let id = &recipe.computer_id;
        let current = cluster
            .pods
            .get_opt(&spare.pod)
            .await
            .map_err(|e| api_error(cluster, "Reading a warm-pool spare Pod", e))?;
        let fit = current.as_ref().is_some_and(|pod| {
            pod_runs(pod)
                && pod.metadata.uid.as_deref() == Some(spare.sandbox.sandbox_id.as_str())
                && Recipe::read(&pod.metadata, &self.config.image)
                    .is_some_and(|r| r.computer_id == spare.recipe.computer_id)
        });
        if !fit {
            info!(pod = %spare.pod, "warm-pool spare no longer fit; removed");
            return Ok(None);
        }
        let meta = recipe.object_metadata();
        let mut labels = meta.labels.unwrap_or_default();
        labels.insert(keys::POOLED.to_owned(), "true".to_owned());
        let patch = serde_json::json!({
            "metadata": {
                "labels": labels,
                "annotations": meta.annotations.unwrap_or_default(),
            }
        });
        let patched = cluster
            .pods
            .patch(&spare.pod, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(|e| {
                api_error(
                    cluster,
                    &format!("Handing a warm-pool spare to computer '{id}'"),
                    e,
                )
            })?;
        self.adopted_pods().insert(id.clone(), spare.pod.clone());
        info!(computer_id = %id, pod = %spare.pod, "warm-pool spare handed out");
        Ok(Some(Self::sandbox_of(recipe, &patched.metadata)))
    }

    async fn remove_spare(&self, spare: &Spare) {
        if let Err(error) = self.remove_computer(&spare.recipe.computer_id).await {
            warn!(pod = %spare.pod, %error, "could not remove a warm-pool spare");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recipe(id: &str) -> Recipe {
        Recipe {
            computer_id: ComputerId::parse(id).unwrap(),
            temporary: true,
            image: "busybox".to_owned(),
            instance: None,
            owner: None,
            egress: None,
        }
    }

    #[test]
    fn only_a_pooled_pod_under_a_spare_id_is_a_waiting_spare() {
        let pooled = BTreeMap::from([(keys::POOLED.to_owned(), "true".to_owned())]);
        let spare = recipe("kilntainers-spare-0123456789abcdef");
        assert!(is_waiting_spare(&spare, Some(&pooled)));
        // Handed out: the recipe is the computer's.
        assert!(!is_waiting_spare(&recipe("box"), Some(&pooled)));
        // A user's computer that happens to be named like a spare.
        assert!(!is_waiting_spare(&spare, None));
        assert!(!is_waiting_spare(&spare, Some(&BTreeMap::new())));
    }
}
