//! Unit tests of `config`.

use super::*;

fn config(args: &[&str]) -> Result<Config, String> {
    let cli = Cli::from_test_args(args)?;
    Config::from_cli(&cli, process_env).map_err(|e| e.0)
}

#[test]
fn defaults() {
    let c = config(&[]).unwrap();
    assert_eq!(c.docker.image, DEFAULT_IMAGE);
    assert_eq!(c.limits.default_timeout_secs, 120);
    assert_eq!(c.limits.output_limit, 2_097_152);
    assert_eq!(c.docker.pids_limit, Some(4096));
    assert_eq!(c.docker.warm_pool, 0);
    assert_eq!(c.docker.security_opts, vec!["no-new-privileges:true"]);
    assert!(c.network);
    assert_eq!(c.docker.network, ComputerNetwork::EngineDefault);
    assert!(!c.lifecycle_tools);
}

#[test]
fn a_network_per_principal_only_when_several_principals_can_exist() {
    use ComputerNetwork::*;
    assert_eq!(ComputerNetwork::choose(true, false, false), EngineDefault);
    assert_eq!(ComputerNetwork::choose(true, true, false), PerPrincipal);
    // The operator's `--network` and `--no-network` win.
    assert_eq!(ComputerNetwork::choose(true, true, true), EngineDefault);
    assert_eq!(ComputerNetwork::choose(false, true, false), Disabled);
    assert_eq!(config(&["--no-network"]).unwrap().docker.network, Disabled);
}

#[test]
fn stdio_rejects_http_only_flags_but_accepts_defaults() {
    assert!(config(&["--host", "127.0.0.1", "--port", "8435"]).is_ok());
    assert_eq!(
        config(&["--port", "9000"]).unwrap_err(),
        "--port is only valid with --transport http. In stdio mode, there is no HTTP server to bind."
    );
    assert!(
        config(&["--session-timeout", "5"])
            .unwrap_err()
            .starts_with("--session-timeout is only valid")
    );
}

#[test]
fn value_checks() {
    assert_eq!(
        config(&["--timeout", "0"]).unwrap_err(),
        "--timeout must be at least 1 second."
    );
    assert_eq!(
        config(&["--output-limit", "0"]).unwrap_err(),
        "--output-limit must be at least 1 byte."
    );
    assert_eq!(
        config(&["--transport", "http", "--port", "70000"]).unwrap_err(),
        "--port must be between 1 and 65535."
    );
    assert!(
        config(&["--transport", "http", "--host", "0.0.0.0"])
            .unwrap_err()
            .starts_with("A non-loopback")
    );
    assert!(
        config(&[
            "--transport",
            "http",
            "--host",
            "0.0.0.0",
            "--auth-token",
            "t"
        ])
        .is_ok()
    );
    assert_eq!(
        config(&["--engine", "lxc"]).unwrap_err(),
        "--engine must be 'docker' or 'podman'; got 'lxc'. Other engines can be used through --docker-host with a Docker-compatible API socket."
    );
    assert_eq!(
        config(&["--cpu", "abc"]).unwrap_err(),
        "--cpu must be a positive number like \"1.5\"; got 'abc'."
    );
    assert_eq!(
        config(&["--memory", "lots"]).unwrap_err(),
        "--memory must be a size like \"512m\" or \"2g\"; got 'lots'."
    );
    assert_eq!(
        config(&["--cpu", "1.5"]).unwrap().docker.nano_cpus,
        Some(1_500_000_000)
    );
    assert_eq!(
        config(&["--memory", "512m"]).unwrap().docker.memory_bytes,
        Some(512 << 20)
    );
}

#[test]
fn dashboard_client_id_needs_the_issuer_and_printable_text() {
    let http = [
        "--transport",
        "http",
        "--oauth-issuer",
        "http://127.0.0.1:9",
    ];
    let with = |id: &str| config(&[&http[..], &["--oauth-dashboard-client-id", id]].concat());
    let Transport::Http(named) = with(" dash-board ").unwrap().transport else {
        panic!("not HTTP");
    };
    let oauth = named.oauth.unwrap();
    assert_eq!(oauth.dashboard_client_id.as_deref(), Some("dash-board"));
    let Transport::Http(unnamed) = config(&http).unwrap().transport else {
        panic!("not HTTP");
    };
    assert_eq!(unnamed.oauth.unwrap().dashboard_client_id, None);
    for bad in ["  ", "tab\there", "é"] {
        assert_eq!(
            with(bad).unwrap_err(),
            "--oauth-dashboard-client-id must be a client id of printable ASCII characters."
        );
    }
    assert_eq!(
        config(&["--transport", "http", "--oauth-dashboard-client-id", "x"]).unwrap_err(),
        "--oauth-dashboard-client-id needs --oauth-issuer."
    );
}

#[test]
fn issuer_has_no_query_or_fragment() {
    // See: issue 30
    for bad in [
        "https://id.example.com/#x",
        "https://id.example.com/?tenant=a",
    ] {
        let error = config(&["--transport", "http", "--oauth-issuer", bad]).unwrap_err();
        assert!(
            error.contains("without a query or fragment"),
            "{bad}: {error}"
        );
    }
}

#[test]
fn timeout_is_at_most_a_week() {
    assert!(config(&["--timeout", "604800"]).is_ok());
    assert_eq!(
        config(&["--timeout", "604801"]).unwrap_err(),
        "--timeout must be at most 604800 seconds (one week)."
    );
}

#[test]
fn job_settings_default_and_are_checked() {
    let c = config(&[]).unwrap();
    assert!(!c.jobs.enabled);
    assert_eq!(
        (
            c.jobs.max_jobs,
            c.jobs.default_timeout_secs,
            c.jobs.log_limit
        ),
        (16, 0, 67_108_864)
    );
    let c = config(&["--job-tools", "--max-jobs", "3", "--job-timeout", "60"]).unwrap();
    assert!(c.jobs.enabled);
    assert_eq!((c.jobs.max_jobs, c.jobs.default_timeout_secs), (3, 60));
    assert_eq!(
        config(&["--max-jobs", "0"]).unwrap_err(),
        "--max-jobs must be at least 1."
    );
    assert_eq!(
        config(&["--job-timeout", "-1"]).unwrap_err(),
        "--job-timeout must be between 0 (no limit) and 604800 seconds."
    );
    assert_eq!(
        config(&["--job-log-limit", "1000"]).unwrap_err(),
        "--job-log-limit must be at least 1048576 bytes (1 MiB)."
    );
    assert!(switch_on(Some(" TRUE ")) && !switch_on(Some("1")) && !switch_on(None));
}

#[test]
fn any_host_needs_authentication() {
    let refused = "--allowed-host '*' turns off the Host check, so /mcp needs authentication. Set KILNTAINERS_AUTH_TOKEN/--auth-token, or drop --allow-unauthenticated-http to use a generated token.";
    assert_eq!(
        config(&[
            "--transport",
            "http",
            "--allowed-host",
            "*",
            "--allow-unauthenticated-http"
        ])
        .unwrap_err(),
        refused
    );
    // With a configured or a generated token the Host check may be off.
    assert!(
        config(&[
            "--transport",
            "http",
            "--allowed-host",
            "*",
            "--auth-token",
            "t"
        ])
        .is_ok()
    );
    let generated = config(&["--transport", "http", "--allowed-host", "*"]).unwrap();
    let Transport::Http(http) = generated.transport else {
        panic!("http transport expected");
    };
    assert!(http.auth_token.is_none() && !http.allow_unauthenticated);
}

#[test]
fn lifecycle_switch_needs_exactly_true() {
    let cli = Cli::from_test_args(&[]).unwrap();
    for (value, on) in [
        (" True ", true),
        ("true", true),
        ("1", false),
        ("yes", false),
        ("", false),
    ] {
        assert_eq!(
            Config::from_cli(&cli, |name| {
                (name == "ENABLE_LIFECYCLE_TOOLS").then(|| value.to_owned())
            })
            .unwrap()
            .lifecycle_tools,
            on,
            "{value:?}"
        );
    }
}

#[test]
fn both_description_flags_conflict() {
    assert!(
        config(&[
            "--tool-instruction-override",
            "a",
            "--extended-tool-instruction",
            "b"
        ])
        .unwrap_err()
        .starts_with("Cannot use both")
    );
}

// See: issue 15
#[test]
#[cfg(all(feature = "fly", feature = "e2b", feature = "modal", feature = "wasm"))]
fn issue_15_no_debug_output_of_a_config_shows_a_token() {
    let tokens = [
        "tok-auth-1111",
        "tok-fly-2222",
        "tok-e2b-3333",
        "tok-modal-4444",
    ];
    let cli = test_cli(&[
        "--transport",
        "http",
        "--auth-token",
        tokens[0],
        "--fly-token",
        tokens[1],
        "--e2b-api-key",
        tokens[2],
        "--modal-token-secret",
        tokens[3],
    ]);
    let config = Config::from_cli(&cli, process_env).unwrap();
    // The tokens are in there (the test would prove nothing if they had been dropped)...
    let Transport::Http(http) = &config.transport else {
        panic!("http expected")
    };
    assert_eq!(
        http.auth_token.as_ref().map(Secret::expose),
        Some(tokens[0])
    );
    assert_eq!(
        config.fly.tokens.flag.as_ref().map(Secret::expose),
        Some(tokens[1])
    );
    assert_eq!(
        config.e2b.api_key.as_ref().map(Secret::expose),
        Some(tokens[2])
    );
    assert_eq!(
        config.modal.tokens.flag_secret.as_ref().map(Secret::expose),
        Some(tokens[3])
    );
    // ...and no Debug form shows them, plain or pretty, whole or by section.
    let shown = [
        format!("{config:?}"),
        format!("{config:#?}"),
        format!("{:?}", config.transport),
        format!("{http:?}"),
        format!("{:?}", config.fly),
        format!("{:?}", config.e2b),
        format!("{:?}", config.modal),
        format!("{:?}", config.docker),
        format!("{:?}", config.wasm),
        format!("{cli:?}"),
    ];
    for text in &shown {
        for token in tokens {
            assert!(!text.contains(token), "{token} in {text}");
        }
    }
}

#[test]
fn idle_stop_durations() {
    assert_eq!(config(&[]).unwrap().idle_stop, None);
    let parsed = |raw: &str| config(&[&format!("--idle-stop={raw}")]).map(|c| c.idle_stop);
    assert_eq!(parsed("0"), Ok(None));
    assert_eq!(parsed("3s"), Ok(Some(Duration::from_secs(3))));
    assert_eq!(parsed("90"), Ok(Some(Duration::from_secs(90))));
    assert_eq!(parsed("30m"), Ok(Some(Duration::from_secs(1800))));
    assert_eq!(parsed("1h30m"), Ok(Some(Duration::from_secs(5400))));
    assert_eq!(parsed("2d"), Ok(Some(Duration::from_secs(172_800))));
    assert_eq!(parsed("30d"), Ok(Some(Duration::from_secs(2_592_000))));
    for malformed in [
        "",
        "abc",
        "5x",
        "m",
        "30m1h",
        "1h1h",
        "-5m",
        "1.5h",
        "5 m",
        "99999999999999999999s",
    ] {
        assert_eq!(
            parsed(malformed).unwrap_err(),
            format!(
                "--idle-stop must be a duration such as 90s, 30m, 2h or 1h30m, or 0 to never stop; got '{malformed}'."
            ),
        );
    }
    for out_of_range in ["0s", "00", "31d", "721h"] {
        assert_eq!(
            parsed(out_of_range).unwrap_err(),
            format!(
                "--idle-stop must be between 1s and 30d (or 0 to never stop); got '{out_of_range}'."
            ),
        );
    }
}

#[test]
fn task_settings_default_and_are_checked() {
    // See: issue 36
    let c = config(&[]).unwrap();
    assert_eq!(c.tasks.after, Duration::from_secs(5));
    assert_eq!(c.tasks.ttl, Duration::from_secs(3600));
    let c = config(&["--task-after", "0", "--task-ttl", "90s"]).unwrap();
    assert_eq!(
        (c.tasks.after, c.tasks.ttl),
        (Duration::ZERO, Duration::from_secs(90))
    );
    let c = config(&["--task-after=3600", "--task-ttl=7d"]).unwrap();
    assert_eq!(
        (c.tasks.after, c.tasks.ttl),
        (Duration::from_secs(3600), Duration::from_secs(604_800))
    );
    for out_of_range in ["-1", "3601"] {
        assert_eq!(
            config(&[&format!("--task-after={out_of_range}")]).unwrap_err(),
            format!("--task-after must be between 0 and 3600 seconds; got {out_of_range}.")
        );
    }
    assert!(
        config(&["--task-after", "5s"])
            .unwrap_err()
            .contains("invalid value '5s' for '--task-after <SECONDS>'")
    );
    for malformed in ["", "soon", "1h1h", "-5m", "1.5h"] {
        assert_eq!(
            config(&[&format!("--task-ttl={malformed}")]).unwrap_err(),
            format!("--task-ttl must be a duration such as 90s, 30m, 1h or 2d; got '{malformed}'.")
        );
    }
    for out_of_range in ["0", "0s", "8d", "169h"] {
        assert_eq!(
            config(&[&format!("--task-ttl={out_of_range}")]).unwrap_err(),
            format!("--task-ttl must be between 1s and 7d; got '{out_of_range}'.")
        );
    }
}
