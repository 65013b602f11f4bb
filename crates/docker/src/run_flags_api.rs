//! Maps parsed `--docker-run-flag` settings ([`RunFlags`]) onto bollard's container create body
//! (docs/decisions.md, "Docker run flags").
//!
//! This file owns only the translation to Engine API fields; parsing and validation live in
//! `kilntainers_docker::run_flags`, and the rest of the create body (image, keep-alive command, labels, the
//! server's own limits) is built by the create path before this runs. Merging never discards what
//! the caller set: lists are appended to, maps inserted into, and a scalar is replaced only when the
//! user gave that flag. `--platform` is not a body field; the caller passes `RunFlags::platform`
//! as the create option itself.

use std::collections::{BTreeMap, HashMap};

use bollard::models::{
    ContainerCreateBody, DeviceMapping, DeviceRequest, HostConfig, Mount, MountType,
    ResourcesUlimits,
};

use crate::run_flags::{DeviceSpec, Gpus, MountKind, MountSpec, RunFlags, Ulimit};

/// Merges `flags` into `body`, creating `body.host_config` when it is absent.
pub(crate) fn apply_run_flags(flags: &RunFlags, body: &mut ContainerCreateBody) {
    apply_config_fields(flags, body);
    let host = body.host_config.get_or_insert_with(HostConfig::default);
    apply_host_fields(flags, host);
}

/// Fields of the top-level container config (`Config.*` in docker's terms).
fn apply_config_fields(flags: &RunFlags, body: &mut ContainerCreateBody) {
    append(&mut body.env, flags.env.iter().cloned());
    override_with(&mut body.user, flags.user.as_ref());
    override_with(&mut body.working_dir, flags.workdir.as_ref());
    override_with(&mut body.hostname, flags.hostname.as_ref());
    insert_all(&mut body.labels, &flags.labels);
}

fn apply_host_fields(flags: &RunFlags, host: &mut HostConfig) {
    override_with(&mut host.pids_limit, flags.pids_limit.as_ref());
    append(&mut host.security_opt, flags.security_opts.iter().cloned());
    append(&mut host.cap_add, flags.cap_add.iter().cloned());
    append(&mut host.cap_drop, flags.cap_drop.iter().cloned());
    override_with(&mut host.readonly_rootfs, flags.read_only.as_ref());
    insert_all(&mut host.tmpfs, &flags.tmpfs);
    override_with(&mut host.runtime, flags.runtime.as_ref());
    append(&mut host.ulimits, flags.ulimits.iter().map(ulimit_to_api));
    override_with(&mut host.shm_size, flags.shm_size.as_ref());
    override_with(&mut host.memory_swap, flags.memory_swap.as_ref());
    override_with(&mut host.cpuset_cpus, flags.cpuset_cpus.as_ref());
    override_with(&mut host.cpu_shares, flags.cpu_shares.as_ref());
    append(&mut host.binds, flags.volumes.iter().cloned());
    append(&mut host.mounts, flags.mounts.iter().map(mount_to_api));
    override_with(&mut host.network_mode, flags.network.as_ref());
    append(&mut host.dns, flags.dns.iter().cloned());
    append(&mut host.extra_hosts, flags.extra_hosts.iter().cloned());
    override_with(&mut host.privileged, flags.privileged.as_ref());
    override_with(&mut host.init, flags.init.as_ref());
    append(&mut host.devices, flags.devices.iter().map(device_to_api));
    append(&mut host.device_requests, flags.gpus.map(gpu_request));
}

/// Replaces `target` only when the user gave a value, so server defaults survive otherwise.
fn override_with<T: Clone>(target: &mut Option<T>, value: Option<&T>) {
    if let Some(value) = value {
        *target = Some(value.clone());
    }
}

/// Appends `items`, leaving `target` untouched (possibly `None`) when there is nothing to add so
/// the request does not grow empty arrays.
fn append<T>(target: &mut Option<Vec<T>>, items: impl IntoIterator<Item = T>) {
    let mut items = items.into_iter().peekable();
    if items.peek().is_some() {
        target.get_or_insert_with(Vec::new).extend(items);
    }
}

fn insert_all(target: &mut Option<HashMap<String, String>>, entries: &BTreeMap<String, String>) {
    if !entries.is_empty() {
        let map = target.get_or_insert_with(HashMap::new);
        map.extend(
            entries
                .iter()
                .map(|(key, value)| (key.clone(), value.clone())),
        );
    }
}

fn ulimit_to_api(ulimit: &Ulimit) -> ResourcesUlimits {
    ResourcesUlimits {
        name: Some(ulimit.name.clone()),
        soft: Some(ulimit.soft),
        hard: Some(ulimit.hard),
    }
}

fn mount_to_api(spec: &MountSpec) -> Mount {
    let typ = match spec.kind {
        MountKind::Bind => MountType::BIND,
        MountKind::Volume => MountType::VOLUME,
        MountKind::Tmpfs => MountType::TMPFS,
    };
    Mount {
        typ: Some(typ),
        source: spec.source.clone(),
        target: Some(spec.target.clone()),
        // Omitted rather than `false`, as the docker CLI sends it.
        read_only: spec.read_only.then_some(true),
        ..Mount::default()
    }
}

fn device_to_api(spec: &DeviceSpec) -> DeviceMapping {
    DeviceMapping {
        path_on_host: Some(spec.host_path.clone()),
        path_in_container: Some(spec.target_path.clone()),
        cgroup_permissions: Some(spec.permissions.clone()),
    }
}

/// What `docker run --gpus` sends: an empty driver lets the daemon pick the GPU driver (nvidia),
/// and a count of -1 means every GPU.
fn gpu_request(gpus: Gpus) -> DeviceRequest {
    let count = match gpus {
        Gpus::All => -1,
        Gpus::Count(count) => count,
    };
    DeviceRequest {
        driver: Some(String::new()),
        count: Some(count),
        capabilities: Some(vec![vec!["gpu".to_owned()]]),
        ..DeviceRequest::default()
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;
    use crate::run_flags::parse_run_flags;

    fn flags(values: &[&str]) -> RunFlags {
        let values: Vec<String> = values.iter().map(|value| (*value).to_owned()).collect();
        match parse_run_flags(&values, false) {
            Ok(flags) => flags,
            Err(error) => panic!("{values:?} should parse, got: {error}"),
        }
    }

    fn body_json(body: &ContainerCreateBody) -> Value {
        match serde_json::to_value(body) {
            Ok(value) => value,
            Err(error) => panic!("create body should serialize: {error}"),
        }
    }

    fn applied(values: &[&str], mut body: ContainerCreateBody) -> Value {
        apply_run_flags(&flags(values), &mut body);
        body_json(&body)
    }

    #[test]
    fn no_flags_only_add_an_empty_host_config() {
        assert_eq!(
            applied(&[], ContainerCreateBody::default()),
            json!({"HostConfig": {}})
        );
    }

    #[test]
    fn config_and_host_fields_land_in_their_places() {
        let value = applied(
            &[
                "-e A=1 -u 1000 -w /work -h box -l team=ml",
                "--pids-limit=256 --read-only --tmpfs /scratch:size=100m --runtime runsc",
                "--shm-size 64m --memory-swap=-1 --cpuset-cpus 0-1 --cpu-shares 512",
                "--network my-net --dns 1.1.1.1 --add-host db:10.0.0.5 --privileged --init",
                "-v /host:/data:ro --cap-add NET_ADMIN --cap-drop MKNOD",
            ],
            ContainerCreateBody::default(),
        );
        assert_eq!(
            value,
            json!({
                "Env": ["A=1"],
                "User": "1000",
                "WorkingDir": "/work",
                "Hostname": "box",
                "Labels": {"team": "ml"},
                "HostConfig": {
                    "PidsLimit": 256,
                    "ReadonlyRootfs": true,
                    "Tmpfs": {"/scratch": "size=100m"},
                    "Runtime": "runsc",
                    "ShmSize": 64 * 1024 * 1024,
                    "MemorySwap": -1,
                    "CpusetCpus": "0-1",
                    "CpuShares": 512,
                    "NetworkMode": "my-net",
                    "Dns": ["1.1.1.1"],
                    "ExtraHosts": ["db:10.0.0.5"],
                    "Privileged": true,
                    "Init": true,
                    "Binds": ["/host:/data:ro"],
                    "CapAdd": ["NET_ADMIN"],
                    "CapDrop": ["MKNOD"],
                }
            })
        );
    }

    #[test]
    fn ulimits_mounts_devices_and_gpus() {
        let value = applied(
            &[
                "--ulimit nofile=1024:2048",
                "--mount type=bind,src=/host,dst=/data,readonly --mount type=tmpfs,dst=/t",
                "--device /dev/fuse --gpus all",
            ],
            ContainerCreateBody::default(),
        );
        assert_eq!(
            value["HostConfig"],
            json!({
                "Ulimits": [{"Name": "nofile", "Soft": 1024, "Hard": 2048}],
                "Mounts": [
                    {"Type": "bind", "Source": "/host", "Target": "/data", "ReadOnly": true},
                    {"Type": "tmpfs", "Target": "/t"},
                ],
                "Devices": [{
                    "PathOnHost": "/dev/fuse",
                    "PathInContainer": "/dev/fuse",
                    "CgroupPermissions": "rwm",
                }],
                "DeviceRequests": [{"Driver": "", "Count": -1, "Capabilities": [["gpu"]]}],
            })
        );
        let counted = applied(&["--gpus 2"], ContainerCreateBody::default());
        assert_eq!(
            counted["HostConfig"]["DeviceRequests"][0]["Count"],
            json!(2)
        );
    }

    #[test]
    fn merges_into_what_the_server_already_set() {
        let body = ContainerCreateBody {
            env: Some(vec!["SERVER=1".to_owned()]),
            labels: Some(HashMap::from([(
                "kilntainers".to_owned(),
                "true".to_owned(),
            )])),
            host_config: Some(HostConfig {
                pids_limit: Some(4096),
                memory: Some(512),
                security_opt: Some(vec!["no-new-privileges:true".to_owned()]),
                network_mode: Some("bridge".to_owned()),
                ..HostConfig::default()
            }),
            ..ContainerCreateBody::default()
        };
        let value = applied(
            &["-e USER_VAR=2 -l team=ml --pids-limit 64 --security-opt seccomp=unconfined"],
            body,
        );
        assert_eq!(
            value,
            json!({
                "Env": ["SERVER=1", "USER_VAR=2"],
                "Labels": {"kilntainers": "true", "team": "ml"},
                "HostConfig": {
                    "PidsLimit": 64,
                    "Memory": 512,
                    "SecurityOpt": ["no-new-privileges:true", "seccomp=unconfined"],
                    "NetworkMode": "bridge",
                }
            })
        );
    }

    #[test]
    fn platform_stays_out_of_the_body() {
        let value = applied(&["--platform linux/arm64"], ContainerCreateBody::default());
        assert_eq!(value, json!({"HostConfig": {}}));
    }
}
