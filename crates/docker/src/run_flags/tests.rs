//! Unit tests of `run_flags`.

use super::*;

fn parsed(values: &[&str]) -> RunFlags {
    parsed_with(values, false)
}

fn parsed_with(values: &[&str], no_network: bool) -> RunFlags {
    let values: Vec<String> = values.iter().map(|value| (*value).to_owned()).collect();
    match parse_run_flags(&values, no_network) {
        Ok(flags) => flags,
        Err(error) => panic!("{values:?} should parse, got: {error}"),
    }
}

fn error_text(values: &[&str]) -> String {
    error_text_with(values, false)
}

fn error_text_with(values: &[&str], no_network: bool) -> String {
    let values: Vec<String> = values.iter().map(|value| (*value).to_owned()).collect();
    match parse_run_flags(&values, no_network) {
        Ok(flags) => panic!("{values:?} should fail, got {flags:?}"),
        Err(error) => error.to_string(),
    }
}

const LIST: &str = "--pids-limit, --security-opt, --cap-add, --cap-drop, --read-only, --tmpfs, \
    --env, --user, --workdir, --hostname, --label, --runtime, --ulimit, --shm-size, \
    --memory-swap, --cpuset-cpus, --cpu-shares, --volume, --mount, --network, --dns, \
    --add-host, --privileged, --init, --device, --gpus, --platform";

#[test]
fn no_values_give_defaults() {
    assert_eq!(parsed(&[]), RunFlags::default());
    assert_eq!(parsed(&["", "   "]), RunFlags::default());
}

#[test]
fn supported_list_follows_the_spec_table() {
    assert_eq!(supported_flags_list(), LIST);
}

#[test]
fn pids_limit_in_both_forms_last_wins() {
    assert_eq!(parsed(&["--pids-limit=256"]).pids_limit, Some(256));
    assert_eq!(parsed(&["--pids-limit 128"]).pids_limit, Some(128));
    assert_eq!(
        parsed(&["--pids-limit=1", "--pids-limit 2"]).pids_limit,
        Some(2)
    );
    assert_eq!(parsed(&["--pids-limit=-1"]).pids_limit, Some(-1));
}

#[test]
fn net_raw_comes_back_only_when_the_run_flags_say_so() {
    assert!(!parsed(&[]).grants_net_raw());
    assert!(!parsed(&["--cap-add NET_ADMIN"]).grants_net_raw());
    assert!(parsed(&["--cap-add=NET_RAW"]).grants_net_raw());
    assert!(parsed(&["--cap-add cap_net_raw"]).grants_net_raw());
    assert!(parsed(&["--cap-add ALL"]).grants_net_raw());
    assert!(parsed(&["--privileged"]).grants_net_raw());
}

#[test]
fn list_flags_accumulate() {
    let flags = parsed(&[
        "--security-opt seccomp=unconfined --security-opt=apparmor=unconfined",
        "--cap-add NET_ADMIN --cap-add=SYS_PTRACE --cap-drop ALL",
        "--cap-drop=MKNOD",
    ]);
    assert_eq!(
        flags.security_opts,
        ["seccomp=unconfined", "apparmor=unconfined"]
    );
    assert_eq!(flags.cap_add, ["NET_ADMIN", "SYS_PTRACE"]);
    assert_eq!(flags.cap_drop, ["ALL", "MKNOD"]);
    assert!(!flags.grants_net_raw());
}

#[test]
fn switches_accept_explicit_values() {
    let flags = parsed(&["--read-only --privileged --init"]);
    assert_eq!(
        (flags.read_only, flags.privileged, flags.init),
        (Some(true), Some(true), Some(true))
    );
    let flags = parsed(&[
        "--read-only",
        "--read-only=false --privileged=FALSE --init=1",
    ]);
    assert_eq!(
        (flags.read_only, flags.privileged, flags.init),
        (Some(false), Some(false), Some(true))
    );
}

#[test]
fn tmpfs_with_and_without_options() {
    let flags = parsed(&[
        "--tmpfs /scratch:size=100m",
        "--tmpfs=/run",
        "--tmpfs /tmp:rw,noexec",
    ]);
    let expected: BTreeMap<String, String> = [
        ("/scratch", "size=100m"),
        ("/run", ""),
        ("/tmp", "rw,noexec"),
    ]
    .into_iter()
    .map(|(path, options)| (path.to_owned(), options.to_owned()))
    .collect();
    assert_eq!(flags.tmpfs, expected);
}

#[test]
fn env_short_long_and_quoted() {
    let flags = parsed(&[
        "-e A=1 --env B=2 --env=C=3 -e=D=4",
        "-e 'GREETING=hello world' --env \"EMPTY=\"",
    ]);
    assert_eq!(
        flags.env,
        ["A=1", "B=2", "C=3", "D=4", "GREETING=hello world", "EMPTY="]
    );
}

#[test]
fn identity_scalars_in_all_forms() {
    let flags = parsed(&["-u 1000:1000 -w /work -h box --runtime runsc --platform linux/arm64"]);
    assert_eq!(flags.user.as_deref(), Some("1000:1000"));
    assert_eq!(flags.workdir.as_deref(), Some("/work"));
    assert_eq!(flags.hostname.as_deref(), Some("box"));
    assert_eq!(flags.runtime.as_deref(), Some("runsc"));
    assert_eq!(flags.platform.as_deref(), Some("linux/arm64"));
    let flags = parsed(&[
        "--user=nobody --workdir=/srv --hostname=h2 --runtime=runc --platform=linux/amd64",
    ]);
    assert_eq!(flags.user.as_deref(), Some("nobody"));
    assert_eq!(flags.workdir.as_deref(), Some("/srv"));
    assert_eq!(flags.hostname.as_deref(), Some("h2"));
    assert_eq!(flags.runtime.as_deref(), Some("runc"));
    assert_eq!(flags.platform.as_deref(), Some("linux/amd64"));
}

#[test]
fn labels_in_all_forms() {
    let flags = parsed(&["-l team=ml --label=env=dev --label 'note=two words' -l empty="]);
    let expected: BTreeMap<String, String> = [
        ("team", "ml"),
        ("env", "dev"),
        ("note", "two words"),
        ("empty", ""),
    ]
    .into_iter()
    .map(|(key, value)| (key.to_owned(), value.to_owned()))
    .collect();
    assert_eq!(flags.labels, expected);
}

#[test]
fn reserved_label_keys_are_rejected() {
    assert_eq!(
        error_text(&["--label kilntainers.computer-id=x"]),
        "Invalid --docker-run-flag '--label': label key 'kilntainers.computer-id' is reserved."
    );
    assert_eq!(
        error_text(&["-l=kilntainers=true"]),
        "Invalid --docker-run-flag '-l=kilntainers=true': label key 'kilntainers' is reserved."
    );
}

#[test]
fn ulimits_default_hard_and_replace_by_name() {
    let flags = parsed(&[
        "--ulimit nofile=1024:2048 --ulimit=nproc=512",
        "--ulimit nofile=4096",
    ]);
    assert_eq!(
        flags.ulimits,
        [
            Ulimit {
                name: "nofile".to_owned(),
                soft: 4096,
                hard: 4096
            },
            Ulimit {
                name: "nproc".to_owned(),
                soft: 512,
                hard: 512
            },
        ]
    );
    assert_eq!(parsed(&["--ulimit core=-1"]).ulimits[0].hard, -1);
}

#[test]
fn sizes_for_shm_and_swap() {
    let flags = parsed(&["--shm-size 512m --memory-swap=1g"]);
    assert_eq!(flags.shm_size, Some(512 * 1024 * 1024));
    assert_eq!(flags.memory_swap, Some(1024 * 1024 * 1024));
    assert_eq!(parsed(&["--memory-swap -1"]).memory_swap, Some(-1));
    assert_eq!(
        parsed(&["--shm-size=64MB"]).shm_size,
        Some(64 * 1024 * 1024)
    );
}

#[test]
fn cpu_settings() {
    let flags = parsed(&["--cpuset-cpus 0-3,6 --cpu-shares=512"]);
    assert_eq!(flags.cpuset_cpus.as_deref(), Some("0-3,6"));
    assert_eq!(flags.cpu_shares, Some(512));
    let flags = parsed(&["--cpuset-cpus=1 --cpu-shares 0"]);
    assert_eq!(flags.cpuset_cpus.as_deref(), Some("1"));
    assert_eq!(flags.cpu_shares, Some(0));
}

#[test]
fn volumes_in_all_forms() {
    let flags = parsed(&["-v /host:/data --volume=cache:/cache:ro --volume '/my dir:/in'"]);
    assert_eq!(
        flags.volumes,
        ["/host:/data", "cache:/cache:ro", "/my dir:/in"]
    );
}

#[test]
fn mounts_accept_every_key_spelling() {
    let flags = parsed(&[
        "--mount type=bind,source=/host,target=/data,readonly",
        "--mount=type=volume,src=cache,dst=/cache,ro=false",
        "--mount type=tmpfs,destination=/scratch",
        "--mount Type=BIND,Src=/a,Destination=/b,RO=true",
        "--mount dst=/anon",
    ]);
    let mount = |kind, source: Option<&str>, target: &str, read_only| MountSpec {
        kind,
        source: source.map(str::to_owned),
        target: target.to_owned(),
        read_only,
    };
    assert_eq!(
        flags.mounts,
        [
            mount(MountKind::Bind, Some("/host"), "/data", true),
            mount(MountKind::Volume, Some("cache"), "/cache", false),
            mount(MountKind::Tmpfs, None, "/scratch", false),
            mount(MountKind::Bind, Some("/a"), "/b", true),
            mount(MountKind::Volume, None, "/anon", false),
        ]
    );
}

#[test]
fn network_in_all_forms() {
    assert_eq!(
        parsed(&["--network my-net"]).network.as_deref(),
        Some("my-net")
    );
    assert_eq!(parsed(&["--net=host"]).network.as_deref(), Some("host"));
    assert_eq!(
        parsed(&["--net bridge", "--network=other"])
            .network
            .as_deref(),
        Some("other")
    );
}

#[test]
fn network_conflicts_with_no_network() {
    assert_eq!(
        error_text_with(&["--network=host"], true),
        "--docker-run-flag '--network=host' conflicts with --no-network."
    );
    assert_eq!(
        error_text_with(&["--net bridge"], true),
        "--docker-run-flag '--net' conflicts with --no-network."
    );
    // `none` is what --no-network asks for anyway, so it agrees rather than conflicts.
    assert_eq!(
        parsed_with(&["--network none"], true).network.as_deref(),
        Some("none")
    );
}

#[test]
fn dns_and_extra_hosts() {
    let flags = parsed(&[
        "--dns 1.1.1.1 --dns=2001:4860:4860::8888",
        "--add-host db:10.0.0.5 --add-host=gw:host-gateway --add-host v6=[::1]",
    ]);
    assert_eq!(flags.dns, ["1.1.1.1", "2001:4860:4860::8888"]);
    assert_eq!(
        flags.extra_hosts,
        ["db:10.0.0.5", "gw:host-gateway", "v6:::1"]
    );
}

#[test]
fn devices_fill_docker_defaults() {
    let flags = parsed(&[
        "--device /dev/fuse --device=/dev/sda:r --device /dev/a:/dev/b --device /dev/c:/dev/d:rw",
    ]);
    let device = |host: &str, target: &str, permissions: &str| DeviceSpec {
        host_path: host.to_owned(),
        target_path: target.to_owned(),
        permissions: permissions.to_owned(),
    };
    assert_eq!(
        flags.devices,
        [
            device("/dev/fuse", "/dev/fuse", "rwm"),
            device("/dev/sda", "/dev/sda", "r"),
            device("/dev/a", "/dev/b", "rwm"),
            device("/dev/c", "/dev/d", "rw"),
        ]
    );
}

#[test]
fn gpus_all_or_count() {
    assert_eq!(parsed(&["--gpus all"]).gpus, Some(Gpus::All));
    assert_eq!(parsed(&["--gpus=2"]).gpus, Some(Gpus::Count(2)));
}

#[test]
fn values_may_span_several_flags_in_one_value() {
    let flags = parsed(&["--read-only --tmpfs /tmp --pids-limit 64 -u 1000"]);
    assert_eq!(flags.read_only, Some(true));
    assert!(flags.tmpfs.contains_key("/tmp"));
    assert_eq!(flags.pids_limit, Some(64));
    assert_eq!(flags.user.as_deref(), Some("1000"));
}

#[test]
fn unsupported_message_is_exact() {
    assert_eq!(
        error_text(&["--memory=1g"]),
        format!("Unsupported --docker-run-flag '--memory=1g'. Supported flags: {LIST}.")
    );
    assert_eq!(
        error_text(&["--read-only stray"]),
        format!("Unsupported --docker-run-flag 'stray'. Supported flags: {LIST}.")
    );
    assert_eq!(
        error_text(&["-eK=V"]),
        format!("Unsupported --docker-run-flag '-eK=V'. Supported flags: {LIST}.")
    );
}

#[test]
fn managed_flags_are_refused_with_a_reason() {
    for token in [
        "--rm",
        "-d",
        "--detach",
        "--name",
        "--name=x",
        "--entrypoint",
        "-i",
        "-t",
        "-it",
        "--interactive",
        "--tty",
        "--restart=always",
    ] {
        assert_eq!(
            error_text(&[token]),
            format!("Invalid --docker-run-flag '{token}': the server manages this itself.")
        );
    }
}

#[test]
fn invalid_messages_are_exact() {
    #[rustfmt::skip]
    let cases = [
        ("--pids-limit", "Invalid --docker-run-flag '--pids-limit': missing value."),
        ("--pids-limit=", "Invalid --docker-run-flag '--pids-limit=': missing value."),
        ("--tmpfs \"/x", "Invalid --docker-run-flag '--tmpfs \"/x': unbalanced quotes."),
        ("--pids-limit=abc", "Invalid --docker-run-flag '--pids-limit=abc': expected a whole number, got 'abc'."),
        ("--cpu-shares -5", "Invalid --docker-run-flag '--cpu-shares': expected a non-negative whole number, got '-5'."),
        ("--shm-size 12q", "Invalid --docker-run-flag '--shm-size': expected a size like \"512m\" or \"1g\", got '12q'."),
        ("--memory-swap=-2", "Invalid --docker-run-flag '--memory-swap=-2': expected a size like \"512m\" or \"1g\", or -1 for unlimited, got '-2'."),
        ("--read-only=maybe", "Invalid --docker-run-flag '--read-only=maybe': expected true or false, got 'maybe'."),
        ("-e NOVALUE", "Invalid --docker-run-flag '-e': expected KEY=VALUE, got 'NOVALUE'."),
        ("--label =x", "Invalid --docker-run-flag '--label': expected KEY=VALUE, got '=x'."),
        ("--workdir rel", "Invalid --docker-run-flag '--workdir': expected an absolute path, got 'rel'."),
        ("--tmpfs scratch", "Invalid --docker-run-flag '--tmpfs': expected PATH[:OPTIONS] with an absolute PATH, got 'scratch'."),
        ("--ulimit nofile", "Invalid --docker-run-flag '--ulimit': expected NAME=SOFT[:HARD] with whole-number limits, got 'nofile'."),
        ("--ulimit nofile=a:b", "Invalid --docker-run-flag '--ulimit': expected NAME=SOFT[:HARD] with whole-number limits, got 'nofile=a:b'."),
        ("--ulimit files=1", "Invalid --docker-run-flag '--ulimit': unknown ulimit 'files'; expected one of core, cpu, data, fsize, locks, memlock, msgqueue, nice, nofile, nproc, rss, rtprio, rttime, sigpending, stack."),
        ("--ulimit nofile=10:5", "Invalid --docker-run-flag '--ulimit': ulimit soft limit 10 is above hard limit 5."),
        ("--cpuset-cpus a-b", "Invalid --docker-run-flag '--cpuset-cpus': expected a CPU list like \"0-3,6\", got 'a-b'."),
        ("-v /only", "Invalid --docker-run-flag '-v': expected SOURCE:DESTINATION[:OPTIONS] with an absolute DESTINATION, got '/only'."),
        ("--volume a:rel", "Invalid --docker-run-flag '--volume': expected SOURCE:DESTINATION[:OPTIONS] with an absolute DESTINATION, got 'a:rel'."),
        ("--mount type=nfs,dst=/x", "Invalid --docker-run-flag '--mount': expected mount type bind, volume or tmpfs, got 'nfs'."),
        ("--mount type=bind,dst=/x,bind-propagation=shared", "Invalid --docker-run-flag '--mount': unknown mount field 'bind-propagation=shared'; expected type, source/src, destination/dst/target, readonly/ro."),
        ("--mount type=bind,src=/a", "Invalid --docker-run-flag '--mount': expected an absolute destination in 'type=bind,src=/a'."),
        ("--mount type=bind,dst=/x", "Invalid --docker-run-flag '--mount': a bind mount needs a source in 'type=bind,dst=/x'."),
        ("--mount type=tmpfs,src=/a,dst=/x", "Invalid --docker-run-flag '--mount': a tmpfs mount takes no source in 'type=tmpfs,src=/a,dst=/x'."),
        ("--mount dst=/x,ro=perhaps", "Invalid --docker-run-flag '--mount': expected readonly=true or readonly=false, got 'ro=perhaps'."),
        ("--dns example.com", "Invalid --docker-run-flag '--dns': expected an IP address, got 'example.com'."),
        ("--add-host db", "Invalid --docker-run-flag '--add-host': expected HOST:IP, got 'db'."),
        ("--add-host=db:nowhere", "Invalid --docker-run-flag '--add-host=db:nowhere': expected HOST:IP, got 'db:nowhere'."),
        ("--device dev/fuse", "Invalid --docker-run-flag '--device': expected absolute device paths, got 'dev/fuse'."),
        ("--device /a:/b:rwx", "Invalid --docker-run-flag '--device': expected SRC[:DST[:PERMS]], got '/a:/b:rwx'."),
        ("--gpus 0", "Invalid --docker-run-flag '--gpus': expected 'all' or a positive number of GPUs, got '0'."),
    ];
    for (value, expected) in cases {
        assert_eq!(error_text(&[value]), expected, "for {value:?}");
    }
}

#[test]
fn a_value_never_spills_into_the_next_docker_run_flag() {
    assert_eq!(
        error_text(&["--env", "A=1"]),
        "Invalid --docker-run-flag '--env': missing value."
    );
}

#[test]
fn first_error_wins() {
    assert_eq!(
        error_text(&["--pids-limit=x --rm"]),
        "Invalid --docker-run-flag '--pids-limit=x': expected a whole number, got 'x'."
    );
}

#[test]
fn parse_size_grammar() {
    const MIB: i64 = 1024 * 1024;
    assert_eq!(parse_size("0"), Some(0));
    assert_eq!(parse_size("100"), Some(100));
    assert_eq!(parse_size("100b"), Some(100));
    assert_eq!(parse_size("1k"), Some(1024));
    assert_eq!(parse_size("2KB"), Some(2048));
    assert_eq!(parse_size("512m"), Some(512 * MIB));
    assert_eq!(parse_size("512Mb"), Some(512 * MIB));
    assert_eq!(parse_size("1g"), Some(1024 * MIB));
    assert_eq!(parse_size("2GB"), Some(2048 * MIB));
    assert_eq!(parse_size("1t"), Some(1024 * 1024 * MIB));
    assert_eq!(parse_size("1Tb"), Some(1024 * 1024 * MIB));
    assert_eq!(parse_size("1.5g"), Some(1536 * MIB));
    assert_eq!(parse_size("0.5k"), Some(512));
    assert_eq!(parse_size("1.5b"), Some(1));
    assert_eq!(parse_size("0.333333333333333333333333k"), Some(341));
    assert_eq!(parse_size("8191.99999999t"), Some(9_007_199_254_729_996));
}

#[test]
fn parse_size_rejects_everything_else() {
    for text in [
        "",
        "m",
        "-1",
        "+1",
        "-1g",
        "1 g",
        " 1g",
        "1g ",
        "1.",
        ".5",
        "1.5.3",
        "1x",
        "1gib",
        "1p",
        "1e3",
        "9223372036854775808",
        "8388608t",
        "99999999999999999999999999999999999999999",
    ] {
        assert_eq!(parse_size(text), None, "for {text:?}");
    }
    assert_eq!(parse_size("9223372036854775807"), Some(i64::MAX));
}
