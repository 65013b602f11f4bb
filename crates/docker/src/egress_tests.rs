//! Tests of the Docker side of the egress proxy: the control lines it writes, what it reads
//! back (hostile or broken output included), the denial log's bounds, and, against a real
//! engine when `KILNTAINERS_TEST_EGRESS_DOCKER=1`, the proxy's image, network and container.

use super::*;

fn pattern(text: &str) -> Pattern {
    Pattern::parse(text).unwrap()
}

#[test]
fn a_policy_line_names_every_rule_in_the_proxys_syntax() {
    let policy = EgressPolicy {
        mode: EgressMode::Allowlist,
        allow: vec![
            pattern("Bücher.Example."),
            pattern("*.allowed.test:8443"),
            pattern("203.0.113.7/24"),
            pattern("[2001:db8::1]:22"),
            pattern("2001:db8::/32"),
        ],
        deny: vec![pattern("bad.allowed.test")],
        ask: true,
        allow_private: false,
    };
    assert_eq!(
        policy_line("172.30.0.5".parse().unwrap(), &policy),
        "policy 172.30.0.5 allowlist ask=1 private=0 allow=xn--bcher-kva.example,*.allowed.test:8443,203.0.113.0/24,[2001:db8::1]:22,2001:db8::/32 deny=bad.allowed.test\n"
    );
    assert_eq!(
        policy_line("fd00::5".parse().unwrap(), &EgressPolicy::open()),
        "policy fd00::5 open ask=0 private=0 allow= deny=\n"
    );
}

#[test]
fn events_are_read_strictly() {
    assert_eq!(parse_event("ready"), Some(Event::Ready));
    assert_eq!(parse_event("ready tls"), Some(Event::Ready));
    assert_eq!(parse_event("ready tls x"), None);
    assert_eq!(parse_event("ready x"), None);
    assert_eq!(parse_event("synced 3"), Some(Event::Synced(3)));
    assert_eq!(
        parse_event("denied 172.30.0.5 other.test 443 not in this computer's allow-list"),
        Some(Event::Denied(
            "172.30.0.5".parse().unwrap(),
            Denial {
                host: "other.test".to_owned(),
                port: 443,
                reason: "not in this computer's allow-list".to_owned(),
            }
        ))
    );
    assert_eq!(
        parse_event("ask 7 172.30.0.5 new.test 443"),
        Some(Event::Ask {
            id: 7,
            computer: "172.30.0.5".parse().unwrap(),
            host: "new.test".to_owned(),
            port: 443,
        })
    );
    for bad in [
        "",
        "ready now",
        "synced",
        "synced 3 4",
        "denied",
        "denied 172.30.0.5 other.test",
        "denied 172.30.0.5 other.test 443",
        "denied not-an-ip other.test 443 why",
        "denied 172.30.0.5 other.test 99999 why",
        "denied 172.30.0.5 other.test 443 why\u{1b}[2J",
        "ask x 172.30.0.5 new.test 443",
        "hello",
    ] {
        assert_eq!(parse_event(bad), None, "{bad:?}");
    }
    let long = format!(
        "denied 172.30.0.5 {} 443 why",
        "a".repeat(MAX_LINE_FROM_PROXY)
    );
    assert_eq!(parse_event(&long), None);
}

#[test]
fn lines_are_split_across_frames_and_overlong_ones_dropped_whole() {
    let mut lines = Lines::default();
    let mut seen = Vec::new();
    lines.push(b"rea", |l| seen.push(l.to_owned()));
    lines.push(b"dy\nden", |l| seen.push(l.to_owned()));
    let flood = vec![b'x'; 3 * MAX_LINE_FROM_PROXY];
    lines.push(&flood, |l| seen.push(l.to_owned()));
    lines.push(&flood, |l| seen.push(l.to_owned()));
    assert!(lines.pending.len() <= MAX_LINE_FROM_PROXY);
    lines.push(b"tail\nready\n", |l| seen.push(l.to_owned()));
    assert_eq!(seen, ["ready", "ready"]);
}

#[test]
fn the_denial_log_keeps_the_last_ones_and_answers_since_a_mark() {
    let mut log = DenialLog::default();
    let a: IpAddr = "172.30.0.5".parse().unwrap();
    let b: IpAddr = "172.30.0.6".parse().unwrap();
    let denial = |n: u16| Denial {
        host: "h.test".to_owned(),
        port: n,
        reason: "r".to_owned(),
    };
    let mark = log.count(a);
    log.record(a, denial(1));
    log.record(b, denial(2));
    log.record(a, denial(3));
    assert_eq!(log.since(a, mark), [denial(1), denial(3)]);
    assert_eq!(log.since(a, log.count(a)), []);
    for n in 0..(DENIALS_KEPT as u16 * 2) {
        log.record(a, denial(n));
    }
    let all = log.since(a, 0);
    assert_eq!(all.len(), DENIALS_KEPT);
    assert_eq!(all.last(), Some(&denial(DENIALS_KEPT as u16 * 2 - 1)));
    let distinct = log.distinct(a);
    assert_eq!(distinct.len(), DENIALS_KEPT);
    log.forget(a);
    assert_eq!(log.count(a), 0);
    assert!(log.distinct(a).is_empty());
    assert_eq!(log.since(b, 0), [denial(2)]);
}

#[test]
fn distinct_refusals_count_up_and_move_to_the_end() {
    let mut log = DenialLog::default();
    let a: IpAddr = "172.30.0.5".parse().unwrap();
    let denial = |host: &str| Denial {
        host: host.to_owned(),
        port: 443,
        reason: "r".to_owned(),
    };
    // 2026-01-01T00:00:00Z and two seconds after.
    let at = |secs: u64| (1_767_225_600 + secs) * 1000;
    log.record_at(a, denial("x.test"), at(0));
    log.record_at(a, denial("y.test"), at(1));
    log.record_at(a, denial("x.test"), at(2));
    let entries = log.distinct(a);
    assert_eq!(
        entries
            .iter()
            .map(|e| (
                e.host.as_str(),
                e.count,
                e.first_at.as_str(),
                e.last_at.as_str()
            ))
            .collect::<Vec<_>>(),
        [
            ("y.test", 1, "2026-01-01T00:00:01Z", "2026-01-01T00:00:01Z"),
            ("x.test", 2, "2026-01-01T00:00:00Z", "2026-01-01T00:00:02Z"),
        ]
    );
}

#[test]
fn a_jobs_refusals_are_those_recorded_within_its_lifetime() {
    let mut log = DenialLog::default();
    let (a, b): (IpAddr, IpAddr) = ("172.30.0.5".parse().unwrap(), "172.30.0.6".parse().unwrap());
    let denial = |host: &str| Denial {
        host: host.to_owned(),
        port: 80,
        reason: "r".to_owned(),
    };
    log.record_at(a, denial("before.test"), 999);
    log.record_at(a, denial("first.test"), 1000);
    log.record_at(b, denial("neighbour.test"), 1500);
    log.record_at(a, denial("last.test"), 2000);
    log.record_at(a, denial("after.test"), 2001);
    assert_eq!(
        log.between(a, 1000, 2000),
        [denial("first.test"), denial("last.test")]
    );
    assert_eq!(log.between(b, 0, u64::MAX), [denial("neighbour.test")]);
    assert!(log.between(a, 3000, 4000).is_empty());
}

#[test]
fn the_image_holds_the_proxy_binary_alone_and_is_named_by_its_hash() {
    let bytes = image_archive().unwrap();
    let mut archive = tar::Archive::new(bytes.as_slice());
    let paths: Vec<String> = archive
        .entries()
        .unwrap()
        .map(|e| e.unwrap().path().unwrap().display().to_string())
        .collect();
    assert_eq!(paths, [BINARY_PATH]);
    assert_eq!(image(), format!("{IMAGE_REPO}:{}", *PROXY_HASH));
    // The broker when the build has one (it does: helper::broker's test), named by its hash.
    assert!(!broker::bytes().is_empty());
    assert_ne!(*PROXY_HASH, *binary::HASH);
}

#[test]
fn the_proxy_container_is_confined_and_its_network_internal() {
    let settings = EgressSettings {
        dns: Some("198.18.0.53:53".parse().unwrap()),
        resolve: vec![("allowed.test".to_owned(), "198.18.0.10".parse().unwrap())],
        ..Default::default()
    };
    let body = proxy_body("img", "kilntainers-net-x", &settings, None);
    assert_eq!(
        body.cmd.unwrap(),
        [
            "--dns",
            "198.18.0.53:53",
            "--resolve",
            "allowed.test=198.18.0.10"
        ]
    );
    let host = body.host_config.unwrap();
    assert_eq!(host.network_mode.as_deref(), Some("kilntainers-net-x"));
    assert_eq!(host.cap_drop.unwrap(), ["ALL"]);
    assert_eq!(host.readonly_rootfs, Some(true));
    assert!(host.memory.is_some() && host.pids_limit.is_some());
    assert_eq!(body.open_stdin, Some(true));
    let network = network_request("kilntainers-net-x", None);
    assert_eq!(network.internal, Some(true));
    assert_eq!(
        network
            .options
            .unwrap()
            .get(INHIBIT_IPV4)
            .map(String::as_str),
        Some("true")
    );
}

/// Against the local engine: builds the image, starts a proxy on a fresh internal network, and
/// has a computer-like container on it ask for a host its policy does not allow.
#[tokio::test]
async fn a_real_proxy_refuses_and_reports_it() {
    if std::env::var_os("KILNTAINERS_TEST_EGRESS_DOCKER").is_none() {
        eprintln!("skipped: set KILNTAINERS_TEST_EGRESS_DOCKER=1 to run against the local engine");
        return;
    }
    let docker = Docker::connect_with_local_defaults().unwrap();
    let network = format!("kilntainers-egresstest-{}", std::process::id());
    docker
        .create_network(network_request(&network, None))
        .await
        .unwrap();
    let result = std::panic::AssertUnwindSafe(exercise(&docker, &network));
    let outcome = futures_util::FutureExt::catch_unwind(result).await;
    let _ = docker
        .remove_container(
            &proxy_name(&network),
            Some(
                bollard::query_parameters::RemoveContainerOptionsBuilder::default()
                    .force(true)
                    .build(),
            ),
        )
        .await;
    let _ = docker
        .remove_container(
            &format!("{network}-client"),
            Some(
                bollard::query_parameters::RemoveContainerOptionsBuilder::default()
                    .force(true)
                    .build(),
            ),
        )
        .await;
    let _ = docker.remove_network(&network).await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

async fn exercise(docker: &Docker, network: &str) {
    let proxy = Proxy::start(
        docker,
        network,
        &EgressSettings::default(),
        "bridge",
        None,
        crate::networks::Wiring::Network,
        Default::default(),
    )
    .await
    .unwrap();
    let client = format!("{network}-client");
    let body = ContainerCreateBody {
        image: Some("sandbox-busybox:full".to_owned()),
        cmd: Some(vec!["sleep".to_owned(), "60".to_owned()]),
        host_config: Some(HostConfig {
            network_mode: Some(network.to_owned()),
            dns: Some(vec![proxy.address.to_string()]),
            ..Default::default()
        }),
        ..Default::default()
    };
    let options = CreateContainerOptionsBuilder::default()
        .name(&client)
        .build();
    docker.create_container(Some(options), body).await.unwrap();
    docker
        .start_container(&client, None::<StartContainerOptions>)
        .await
        .unwrap();
    let inspect = docker
        .inspect_container(&client, None::<InspectContainerOptions>)
        .await
        .unwrap();
    let inspect_id = inspect.id.clone().unwrap_or_default();
    let address: IpAddr = inspect.network_settings.unwrap().networks.unwrap()[network]
        .ip_address
        .clone()
        .unwrap()
        .parse()
        .unwrap();
    let policy = EgressPolicy {
        mode: EgressMode::Allowlist,
        allow: vec![pattern("allowed.test")],
        ..EgressPolicy::open()
    };
    let attached = Attached {
        computer_id: ComputerId::parse("client").unwrap(),
        container: inspect_id.clone(),
        policy,
        token: None,
    };
    proxy.attach(address, attached).await.unwrap();
    // Through the proxy port, as a program honouring HTTP_PROXY would.
    // Through the proxy port, as a program honouring HTTP_PROXY would (busybox `nc`).
    let request = format!(
        "printf 'GET http://other.test/ HTTP/1.1\\r\\nHost: other.test\\r\\n\\r\\n' | nc -w 5 {} 3128",
        proxy.address
    );
    let out = run(docker, &client, &["sh", "-c", &request]).await;
    assert!(
        out.contains("kilntainers: network access to other.test:80 was blocked"),
        "{out}"
    );
    // Names: the allowed one resolves to the proxy, any other is NXDOMAIN.
    let out = run(docker, &client, &["nslookup", "allowed.test"]).await;
    assert!(out.contains(&proxy.address.to_string()), "{out}");
    let out = run(docker, &client, &["nslookup", "other.test"]).await;
    assert!(out.contains("NXDOMAIN"), "{out}");
    let mut denials = Vec::new();
    for _ in 0..50 {
        denials = proxy.denials.lock().unwrap().since(address, 0);
        if !denials.is_empty() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(
        denials.first().map(Denial::stderr_line).as_deref(),
        Some(
            "[kilntainers: network access to other.test:80 was blocked: not in this computer's allow-list]"
        )
    );
}

/// Runs a command in a container and returns its stdout and stderr together.
async fn run(docker: &Docker, container: &str, cmd: &[&str]) -> String {
    let exec = docker
        .create_exec(
            container,
            bollard::models::ExecConfig {
                cmd: Some(cmd.iter().map(|s| (*s).to_owned()).collect()),
                attach_stdout: Some(true),
                attach_stderr: Some(true),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let mut text = String::new();
    if let bollard::exec::StartExecResults::Attached { mut output, .. } =
        docker.start_exec(&exec.id, None).await.unwrap()
    {
        while let Some(Ok(chunk)) = output.next().await {
            text.push_str(&chunk.to_string());
        }
    }
    text
}

/// A fresh directory under the system's temporary one, removed by the caller.
fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "kilntainers-egress-test-{name}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[test]
fn grants_are_kept_per_container_outside_it_and_applied_to_its_policy() {
    let dir = scratch("grants");
    let grants = Grants::new(Some(&dir));
    let container = "0123456789abcdef";
    assert!(grants.load(container).is_empty());
    grants.add(container, &pattern("other.test:443")).unwrap();
    grants.add(container, &pattern("other.test:443")).unwrap();
    grants.add(container, &pattern("[2001:db8::1]:22")).unwrap();
    assert_eq!(
        grants.load(container),
        vec![pattern("other.test:443"), pattern("[2001:db8::1]:22")]
    );
    // Another container has none; a name that is not a container id is never a path.
    assert!(grants.load("fedcba9876543210").is_empty());
    assert!(grants.add("../x", &pattern("a.test")).is_err());
    let policy = EgressPolicy {
        mode: EgressMode::Allowlist,
        allow: vec![pattern("allowed.test"), pattern("other.test:443")],
        deny: vec![],
        ask: true,
        allow_private: false,
    };
    let applied = grants.apply(container, policy.clone());
    assert_eq!(
        applied.allow,
        vec![
            pattern("allowed.test"),
            pattern("other.test:443"),
            pattern("[2001:db8::1]:22")
        ]
    );
    // A person takes one back: only a granted rule is revoked.
    assert!(
        grants
            .revoke(container, &pattern("[2001:db8::1]:22"))
            .unwrap()
    );
    assert!(!grants.revoke(container, &pattern("allowed.test")).unwrap());
    assert_eq!(grants.load(container), vec![pattern("other.test:443")]);
    grants.remove(container);
    assert_eq!(grants.apply(container, policy.clone()), policy);
    // Without a state dir nothing can be kept, and saying so is the answer.
    assert!(
        Grants::new(None)
            .add(container, &pattern("a.test"))
            .is_err()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Reads the lines a proxy would get, as they come.
async fn read_lines(
    reader: &mut (impl tokio::io::AsyncBufReadExt + Unpin),
    count: usize,
) -> Vec<String> {
    let mut lines = Vec::new();
    for _ in 0..count {
        let mut line = String::new();
        reader.read_line(&mut line).await.unwrap();
        lines.push(line);
    }
    lines
}

fn shared_with(
    computer: IpAddr,
    asking: Option<Asking>,
) -> (Arc<Shared>, tokio::io::BufReader<tokio::io::DuplexStream>) {
    let (ours, theirs) = tokio::io::duplex(64 * 1024);
    let input: Input = Arc::new(tokio::sync::Mutex::new(Box::pin(ours)));
    let attached = Attached {
        computer_id: ComputerId::parse("dev-box").unwrap(),
        container: "0123456789abcdef".to_owned(),
        policy: EgressPolicy {
            mode: EgressMode::Allowlist,
            allow: vec![pattern("allowed.test")],
            deny: vec![],
            ask: true,
            allow_private: false,
        },
        token: None,
    };
    let shared = Shared {
        denials: Arc::default(),
        syncs: Arc::default(),
        input,
        computers: Arc::new(Mutex::new(HashMap::from([(computer, attached)]))),
        asking,
    };
    (Arc::new(shared), tokio::io::BufReader::new(theirs))
}

#[tokio::test]
async fn a_question_goes_to_the_server_and_its_answer_back_to_the_proxy() {
    let dir = scratch("answers");
    let computer: IpAddr = "172.30.0.5".parse().unwrap();
    let (tx, mut questions) = tokio::sync::mpsc::channel(4);
    let asking = Asking {
        questions: tx,
        grants: Grants::new(Some(&dir)),
    };
    let (shared, mut proxy) = shared_with(computer, Some(asking));

    // allow for this computer: the widened policy first, then the answer.
    let task = tokio::spawn(answer_question(
        Arc::clone(&shared),
        7,
        computer,
        "other.test".to_owned(),
        443,
    ));
    let question = questions.recv().await.unwrap();
    assert_eq!(
        (
            question.computer_id.as_str(),
            question.host.as_str(),
            question.port
        ),
        ("dev-box", "other.test", 443)
    );
    question.answer(EgressAnswer::ForComputer);
    task.await.unwrap();
    assert_eq!(
        read_lines(&mut proxy, 2).await,
        [
            "policy 172.30.0.5 allowlist ask=1 private=0 allow=allowed.test,other.test:443 deny=\n",
            "answer 7 computer\n"
        ]
    );
    assert_eq!(
        Grants::new(Some(&dir)).load("0123456789abcdef"),
        vec![pattern("other.test:443")]
    );

    // The server's refusal carries its reason; a question the server drops is no answer.
    let task = tokio::spawn(answer_question(
        Arc::clone(&shared),
        8,
        computer,
        "third.test".to_owned(),
        80,
    ));
    questions
        .recv()
        .await
        .unwrap()
        .answer(EgressAnswer::Refuse(reasons::NO_ELICITATION.to_owned()));
    task.await.unwrap();
    let task = tokio::spawn(answer_question(
        Arc::clone(&shared),
        9,
        computer,
        "third.test".to_owned(),
        80,
    ));
    drop(questions.recv().await.unwrap());
    task.await.unwrap();
    assert_eq!(
        read_lines(&mut proxy, 2).await,
        [
            format!("answer 8 refuse {}\n", reasons::NO_ELICITATION),
            format!("answer 9 refuse {}\n", reasons::NO_ANSWER),
        ]
    );

    // An address the proxy has no computer for is refused without asking.
    let task = tokio::spawn(answer_question(
        Arc::clone(&shared),
        10,
        "172.30.0.9".parse().unwrap(),
        "x.test".to_owned(),
        80,
    ));
    task.await.unwrap();
    assert_eq!(
        read_lines(&mut proxy, 1).await,
        [format!("answer 10 refuse {}\n", reasons::NO_SESSION)]
    );
    assert!(questions.try_recv().is_err());
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn without_a_server_to_ask_questions_are_refused() {
    let computer: IpAddr = "172.30.0.5".parse().unwrap();
    let (shared, mut proxy) = shared_with(computer, None);
    answer_question(shared, 3, computer, "other.test".to_owned(), 80).await;
    assert_eq!(
        read_lines(&mut proxy, 1).await,
        [format!("answer 3 refuse {}\n", reasons::NO_SESSION)]
    );
}

#[test]
fn a_socket_wired_proxy_mounts_its_volume_and_lives_on_the_upstream_network() {
    let body = proxy_body(
        "img",
        "bridge",
        &EgressSettings::default(),
        Some("kilntainers-egress-x"),
    );
    assert_eq!(body.cmd.unwrap(), ["--socket", SOCKET_PATH]);
    let host = body.host_config.unwrap();
    assert_eq!(host.network_mode.as_deref(), Some("bridge"));
    let mounts = host.mounts.unwrap();
    assert_eq!(mounts.len(), 1);
    assert_eq!(mounts[0].source.as_deref(), Some("kilntainers-egress-x"));
    assert_eq!(mounts[0].target.as_deref(), Some(SOCKET_DIR));
    assert_eq!(mounts[0].read_only, Some(false));
    assert_eq!(
        body.labels.unwrap().get(PROXY_LABEL).map(String::as_str),
        Some("kilntainers-egress-x")
    );
}

#[test]
fn tokens_and_socket_keys_have_one_shape() {
    let token = new_token();
    assert!(is_token(&token), "{token}");
    assert_ne!(token, new_token());
    for bad in [
        "",
        "ABCDEF0123456789abcdef0123456789",
        "0123",
        "g123456789abcdef0123456789abcdef",
    ] {
        assert!(!is_token(bad), "{bad}");
    }
    let id = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
    let key = socket_key(id).unwrap();
    assert_eq!(key.to_string(), "fd01:2345:6789:abcd:ef01:2345:6789:abcd");
    assert_eq!(socket_key(id), Some(key), "stable");
    assert_ne!(socket_key(&id.replace('0', "1")), Some(key));
    assert_eq!(socket_key("not-hex"), None);
    assert_eq!(socket_key("0123"), None);
}

#[tokio::test]
async fn a_socket_wired_computer_gets_its_token_before_its_policy() {
    use tokio::io::AsyncBufReadExt;
    let (ours, theirs) = tokio::io::duplex(64 * 1024);
    let input: Input = Arc::new(tokio::sync::Mutex::new(Box::pin(ours)));
    let proxy = Proxy::for_tests(input);
    let key = socket_key("0123456789abcdef0123456789abcdef01234567").unwrap();
    let token = new_token();
    let attached = Attached {
        computer_id: ComputerId::parse("dev-box").unwrap(),
        container: "0123456789abcdef".to_owned(),
        policy: EgressPolicy::open(),
        token: Some(token.clone()),
    };
    proxy.attach(key, attached).await.unwrap();
    drop(proxy);
    let mut lines = tokio::io::BufReader::new(theirs).lines();
    assert_eq!(
        lines.next_line().await.unwrap().unwrap(),
        format!("token {key} {token}")
    );
    assert!(
        lines
            .next_line()
            .await
            .unwrap()
            .unwrap()
            .starts_with(&format!("policy {key} open "))
    );
}

#[test]
fn runsc_reaches_sockets_only_when_host_uds_allows_opening() {
    let args = |list: &[&str]| list.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    assert!(runsc_reaches_sockets(&args(&[
        "--network=none",
        "--host-uds=open"
    ])));
    assert!(runsc_reaches_sockets(&args(&["--host-uds", "all"])));
    assert!(runsc_reaches_sockets(&args(&["-fsgofer-host-uds"])));
    assert!(!runsc_reaches_sockets(&args(&["--network=none"])));
    assert!(!runsc_reaches_sockets(&args(&["--host-uds=create"])));
    assert!(!runsc_reaches_sockets(&args(&[
        "--host-uds=open",
        "--host-uds=none"
    ])));
}
