//! The WASM backends against the real wasmtime runtime: go-busybox (fetched through the
//! server's own pip path into a cache shared by the whole test run) for the command
//! interpreter, escapes, limits and lifecycle; small WAT modules for fuel, memory, exit codes,
//! stdin and traps. A module that cannot be obtained fails the tests with the server's error.
//! The module cache and the per-test [`Place`] live in `common::wasm`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kilntainers_wasm::WasmBackend;
use kilntainers_wasm::fetch;
use mcp_sandbox_computer_vm_for_ai::backends::{Backend, CreateSpec, NoProgress, SandboxRef};
use mcp_sandbox_computer_vm_for_ai::exec::{self, ExecOutcome, ExecRequest, Program};
use mcp_sandbox_computer_vm_for_ai::ids::{ComputerId, ExecId, InstanceId};
use tokio_util::sync::CancellationToken;

use crate::common::wasm::Place;

async fn create(backend: &dyn Backend, id: &str, temporary: bool) -> SandboxRef {
    backend
        .create(
            &CreateSpec {
                computer_id: ComputerId::parse(id).unwrap(),
                temporary,
                image: None,
                instance: InstanceId::random(),
                owner: None,
                egress: None,
            },
            &NoProgress,
        )
        .await
        .unwrap()
}

#[derive(Debug)]
struct Res {
    stdout: String,
    stderr: String,
    code: i64,
}

async fn run(
    backend: &dyn Backend,
    sandbox: &SandboxRef,
    program: Program,
    stdin: Option<&str>,
    wd: Option<&str>,
    timeout: u64,
) -> Result<Res, String> {
    let request = ExecRequest {
        program,
        stdin: stdin.map(str::to_owned),
        working_dir: wd.map(str::to_owned),
        timeout_secs: timeout,
    };
    let outcome = exec::run(
        backend,
        sandbox,
        "/bin/bash",
        &request,
        ExecId::random(),
        10_000,
        &mcp_sandbox_computer_vm_for_ai::backends::NoProgress,
        &CancellationToken::new(),
    )
    .await
    .map_err(|e| e.to_string())?;
    Ok(match outcome {
        ExecOutcome::Completed {
            stdout,
            stderr,
            exit_code,
            ..
        } => Res {
            stdout: String::from_utf8_lossy(&stdout).into_owned(),
            stderr: String::from_utf8_lossy(&stderr).into_owned(),
            code: exit_code,
        },
        ExecOutcome::TimedOut { timeout_secs, .. } => Res {
            stdout: String::new(),
            stderr: ExecOutcome::timeout_notice(timeout_secs),
            code: 124,
        },
        ExecOutcome::OutputLimitExceeded { limit, .. } => Res {
            stdout: String::new(),
            stderr: ExecOutcome::output_limit_notice(limit),
            code: 1,
        },
        ExecOutcome::OutOfFuel { fuel, .. } => Res {
            stdout: String::new(),
            stderr: ExecOutcome::out_of_fuel_notice(fuel),
            code: 124,
        },
    })
}

async fn sh(backend: &dyn Backend, sandbox: &SandboxRef, command: &str) -> Res {
    run(
        backend,
        sandbox,
        Program::Shell(command.into()),
        None,
        None,
        30,
    )
    .await
    .unwrap()
}

fn args(list: &[&str]) -> Program {
    Program::Args(list.iter().map(|s| (*s).to_owned()).collect())
}

#[tokio::test]
async fn busybox_command_strings() {
    let place = Place::new();
    let b = place.busybox(&[]);
    let s = create(b.as_ref(), "cmds", true).await;
    let r = sh(b.as_ref(), &s, "echo hi | tr a-z A-Z").await;
    assert_eq!((r.stdout.as_str(), r.code), ("HI\n", 0), "{}", r.stderr);
    // go-busybox has no `seq` applet (and its awk panics under TinyGo); printf makes the
    // numbers.
    let numbers: Vec<String> = (1..=100).map(|n| n.to_string()).collect();
    let r = sh(
        b.as_ref(),
        &s,
        &format!("printf '%s\\n' {} | sort -rn | head -3", numbers.join(" ")),
    )
    .await;
    assert_eq!(r.stdout, "100\n99\n98\n", "{}", r.stderr);
    let r = sh(
        b.as_ref(),
        &s,
        "mkdir -p a/b && echo x > a/b/f && cat a/b/f",
    )
    .await;
    assert_eq!((r.stdout.as_str(), r.code), ("x\n", 0), "{}", r.stderr);
    let r = sh(
        b.as_ref(),
        &s,
        "echo one > f; echo two >> f; cat < f; cat missing 2>&1; echo err >&2",
    )
    .await;
    assert!(r.stdout.starts_with("one\ntwo\n"), "{}", r.stdout);
    assert!(r.stdout.contains("missing"), "{}", r.stdout);
    assert_eq!(r.stderr, "err\n");
    let r = sh(b.as_ref(), &s, "cat missing 2>/dev/null; echo $?").await;
    assert_ne!(r.stdout.trim(), "0");
    assert_eq!(r.stderr, "");
    let r = sh(
        b.as_ref(),
        &s,
        "false && echo no || echo yes; true && echo and",
    )
    .await;
    assert_eq!(r.stdout, "yes\nand\n");
    let r = sh(b.as_ref(), &s, "false || false").await;
    assert_eq!(r.code, 1);
    let r = sh(b.as_ref(), &s, "ls nope && echo never").await;
    assert_ne!(r.code, 0);
    assert!(!r.stdout.contains("never"));
    let r = sh(
        b.as_ref(),
        &s,
        "X='a b'; echo \"$X\" ${X} 'lit $X' a$; Y=/a cd $Y; pwd",
    )
    .await;
    assert_eq!(r.stdout, "a b a b lit $X a$\n/\n", "{}", r.stderr);
    let r = sh(b.as_ref(), &s, "D=a; cd $D && ls").await;
    assert_eq!(r.stdout, "b\n", "{}", r.stderr);
    let r = sh(b.as_ref(), &s, "echo > g1.txt; echo > g2.txt; echo > .hidden.txt; echo *.txt && echo '*.txt' && echo nomatch*").await;
    assert_eq!(r.stdout, "g1.txt g2.txt\n*.txt\nnomatch*\n");
    let r = sh(b.as_ref(), &s, "cd a/b && pwd && cat f && cd /nope").await;
    assert_eq!(r.stdout, "/a/b\nx\n");
    assert_eq!(r.code, 1);
    let r = sh(b.as_ref(), &s, "echo $(id)").await;
    assert_eq!(
        (r.stderr.as_str(), r.code),
        (
            "kilntainers: unsupported shell syntax: $(...) (command substitution)\n",
            2
        )
    );
    let r = sh(b.as_ref(), &s, "echo 'open").await;
    assert_eq!(
        (r.stderr.as_str(), r.code),
        ("kilntainers: syntax error: unterminated single quote\n", 2)
    );
    let r = sh(b.as_ref(), &s, "exit 5").await;
    assert_eq!(r.code, 5);
    let r = run(
        b.as_ref(),
        &s,
        Program::Shell("cat | wc -c".into()),
        Some("12345"),
        None,
        30,
    )
    .await
    .unwrap();
    assert_eq!(r.stdout.trim(), "5");
    let r = run(b.as_ref(), &s, args(&["ls", "a"]), None, None, 30)
        .await
        .unwrap();
    assert_eq!(r.stdout, "b\n");
    b.remove(&s).await.unwrap();
}

#[tokio::test]
async fn busybox_escapes_stay_inside_the_root() {
    let place = Place::new();
    let b = place.busybox(&[]);
    let s = create(b.as_ref(), "escape", true).await;
    let root = private_dir(&place).join(s.sandbox_id.as_str()).join("root");
    // `..` in working_directory is clamped at the root.
    let r = run(b.as_ref(), &s, args(&["pwd"]), None, Some("/../../x"), 30)
        .await
        .unwrap();
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(root.join("x").is_dir());
    assert!(!place.base.join("tmp").join("x").exists());
    // Absolute paths see the computer only.
    let r = sh(b.as_ref(), &s, "ls /").await;
    assert_eq!(r.stdout.split_whitespace().collect::<Vec<_>>(), vec!["x"]);
    let r = sh(
        b.as_ref(),
        &s,
        "cat /etc/passwd; cat ../../../../etc/passwd",
    )
    .await;
    assert!(!r.stdout.contains("root:"), "{}", r.stdout);
    // A symlink planted on the host side (or made by the guest) cannot lead out.
    std::os::unix::fs::symlink("/etc", root.join("etc-link")).unwrap();
    std::os::unix::fs::symlink("../..", root.join("up")).unwrap();
    let r = sh(
        b.as_ref(),
        &s,
        "cat etc-link/passwd; cat up/home/x 2>&1; echo hi > up/escaped.txt",
    )
    .await;
    assert!(!r.stdout.contains("root:"), "{}", r.stdout);
    assert!(!place.base.join("escaped.txt").exists());
    assert!(!place.base.join("tmp/escaped.txt").exists());
    for wd in ["/etc-link", "/up", "/up/home"] {
        let e = run(b.as_ref(), &s, args(&["pwd"]), None, Some(wd), 30)
            .await
            .unwrap_err();
        assert_eq!(
            e,
            format!("working_directory '{wd}' resolves outside the computer.")
        );
    }
    let r = sh(b.as_ref(), &s, "cd /up").await;
    assert_eq!(r.code, 1);
    let r = sh(b.as_ref(), &s, "echo *").await;
    assert!(!r.stdout.contains("passwd"));
    b.remove(&s).await.unwrap();
    assert!(!root.exists());
}

#[tokio::test]
async fn busybox_limits() {
    let place = Place::new();
    // The same limit as `run` gives the exec policy, so pipeline buffers share it.
    let b = place.busybox(&["--output-limit", "10000"]);
    let s = create(b.as_ref(), "limits", true).await;
    // An endless loop ends at the timeout (yes | ... never finishes its first stage).
    let started = Instant::now();
    let r = run(b.as_ref(), &s, args(&["sleep", "30"]), None, None, 1)
        .await
        .unwrap();
    assert_eq!(
        (r.code, r.stderr.as_str()),
        (124, "[kilntainers: command timed out after 1s]")
    );
    assert!(
        started.elapsed() < Duration::from_millis(1500),
        "{:?}",
        started.elapsed()
    );
    let started = Instant::now();
    let flood = "y\n".repeat(50_000);
    let r = run(b.as_ref(), &s, args(&["cat"]), Some(&flood), None, 5)
        .await
        .unwrap();
    assert_eq!(r.code, 1, "{}", r.stderr); // flood: 10 000 byte limit
    assert!(
        r.stderr
            .starts_with("[kilntainers: output limit exceeded (10000 bytes)")
    );
    assert!(started.elapsed() < Duration::from_secs(2));
    let r = run(
        b.as_ref(),
        &s,
        Program::Shell("cat | head -2".into()),
        Some("y\ny\ny\ny\n"),
        None,
        5,
    )
    .await
    .unwrap();
    assert_eq!(r.stdout, "y\ny\n");
    let r = run(
        b.as_ref(),
        &s,
        Program::Shell("cat | cat | wc -l".into()),
        Some(&flood),
        None,
        5,
    )
    .await
    .unwrap();
    assert!(
        r.stderr.starts_with("[kilntainers: output limit exceeded"),
        "intermediate buffers are bounded: {}",
        r.stderr
    );
    b.remove(&s).await.unwrap();
    // Fuel works for ordinary commands and stops runaway ones.
    let b = place.busybox(&["--wasm-fuel", "50000000000"]);
    let s = create(b.as_ref(), "fuel", true).await;
    assert_eq!(sh(b.as_ref(), &s, "echo fuelled").await.stdout, "fuelled\n");
    b.remove(&s).await.unwrap();
    let b = place.busybox(&["--wasm-fuel", "1000"]);
    let s = create(b.as_ref(), "nofuel", true).await;
    let r = sh(b.as_ref(), &s, "ls -R / >/dev/null").await;
    assert_eq!(
        (r.code, r.stderr.as_str()),
        (
            124,
            "[kilntainers: command ran out of fuel (--wasm-fuel 1000)]"
        )
    );
    b.remove(&s).await.unwrap();
}

#[tokio::test]
async fn busybox_permanent_computers_survive_and_lifecycle_works() {
    let place = Place::new();
    let b = place.busybox(&[]);
    let s = create(b.as_ref(), "keeper", false).await;
    assert_eq!(s.sandbox_id.as_str(), "kilntainers-wasm-keeper");
    sh(b.as_ref(), &s, "echo kept > k").await;
    drop(b);
    // A new server finds it by id.
    let b = place.busybox(&[]);
    let id = ComputerId::parse("keeper").unwrap();
    let found = b.lookup(&id).await.unwrap().unwrap();
    assert!(!found.sandbox.temporary);
    assert_eq!(
        sh(b.as_ref(), &found.sandbox, "cat k").await.stdout,
        "kept\n"
    );
    let listed = b.list().await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].sandbox.computer_id, id);
    let restarted = b.restart(&found.sandbox).await.unwrap();
    assert!(restarted.state_preserved);
    assert_eq!(
        sh(b.as_ref(), &found.sandbox, "cat k").await.stdout,
        "kept\n"
    );
    let meta: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            place
                .base
                .join("home/state/wasm/go_busybox/keeper/meta.json"),
        )
        .unwrap(),
    )
    .unwrap();
    assert_eq!(meta["backend"], "go_busybox");
    assert_eq!(meta["module_sha256"], fetch::PINNED_SHA256);
    // Factory reset = remove + create: the root is empty again.
    b.remove(&found.sandbox).await.unwrap();
    let fresh = create(b.as_ref(), "keeper", false).await;
    assert_ne!(sh(b.as_ref(), &fresh, "cat k").await.code, 0);
    b.remove(&fresh).await.unwrap();
    assert!(b.lookup(&id).await.unwrap().is_none());
    assert!(b.list().await.unwrap().is_empty());
}

#[tokio::test]
async fn busybox_description_lists_real_applets() {
    let place = Place::new();
    let b = place.busybox(&[]);
    b.prepare().await;
    let text = b.tool_instructions();
    let line = text
        .lines()
        .find(|l| l.starts_with("Available commands: "))
        .unwrap();
    for applet in ["cat", "ls", "sort", "head", "tr", "printf"] {
        assert!(
            line.contains(&format!(" {applet},")) || line.contains(&format!(" {applet}.")),
            "{line}"
        );
    }
    assert!(!line.contains("Currently"));
    assert!(
        line.starts_with("Available commands: ash, awk, cat,"),
        "sorted: {line}"
    );
}

const EXIT_7: &str = r#"(module
  (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
  (memory (export "memory") 1)
  (func (export "_start") (call $exit (i32.const 7))))"#;

const SPIN: &str =
    r#"(module (memory (export "memory") 1) (func (export "_start") (loop $l (br $l))))"#;

const GROW: &str = r#"(module
  (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
  (memory (export "memory") 1)
  (func (export "_start")
    (if (i32.eq (memory.grow (i32.const 100)) (i32.const -1)) (then (call $exit (i32.const 3))))))"#;

const ECHO: &str = r#"(module
  (import "wasi_snapshot_preview1" "fd_read" (func $read (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_write" (func $write (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (func (export "_start") (local $n i32)
    (loop $again
      (i32.store (i32.const 0) (i32.const 64))
      (i32.store (i32.const 4) (i32.const 1024))
      (drop (call $read (i32.const 0) (i32.const 0) (i32.const 1) (i32.const 8)))
      (local.set $n (i32.load (i32.const 8)))
      (if (i32.gt_u (local.get $n) (i32.const 0))
        (then
          (i32.store (i32.const 16) (i32.const 64))
          (i32.store (i32.const 20) (local.get $n))
          (drop (call $write (i32.const 1) (i32.const 16) (i32.const 1) (i32.const 24)))
          (br $again))))))"#;

const FLOOD: &str = r#"(module
  (import "wasi_snapshot_preview1" "fd_write" (func $write (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (func (export "_start")
    (i32.store (i32.const 0) (i32.const 64))
    (i32.store (i32.const 4) (i32.const 4096))
    (loop $l (drop (call $write (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 8))) (br $l))))"#;

const TRAP: &str = r#"(module (memory (export "memory") 1) (func (export "_start") unreachable))"#;
const NO_START: &str = r#"(module (memory (export "memory") 1) (func (export "main")))"#;

#[tokio::test]
async fn custom_modules() {
    let place = Place::new();
    let b = place.custom(EXIT_7, &[]);
    let s = create(b.as_ref(), "exit", true).await;
    assert_eq!(
        run(b.as_ref(), &s, args(&["x"]), None, None, 10)
            .await
            .unwrap()
            .code,
        7
    );
    // Without a shell configured, command mode is refused with the reference text.
    let e = run(b.as_ref(), &s, Program::Shell("ls".into()), None, None, 10)
        .await
        .unwrap_err();
    assert!(
        e.starts_with("This WASM backend does not support command mode (no shell configured)."),
        "{e}"
    );

    let b = place.custom(ECHO, &[]);
    let s = create(b.as_ref(), "echo", true).await;
    let r = run(b.as_ref(), &s, args(&["x"]), Some("hello stdin"), None, 10)
        .await
        .unwrap();
    assert_eq!((r.stdout.as_str(), r.code), ("hello stdin", 0));

    let b = place.custom(SPIN, &["--wasm-fuel", "100000"]);
    let s = create(b.as_ref(), "spin", true).await;
    let started = Instant::now();
    let r = run(b.as_ref(), &s, args(&["x"]), None, None, 30)
        .await
        .unwrap();
    assert_eq!(
        (r.code, r.stderr.as_str()),
        (
            124,
            "[kilntainers: command ran out of fuel (--wasm-fuel 100000)]"
        )
    );
    assert!(started.elapsed() < Duration::from_secs(5));

    let b = place.custom(SPIN, &[]);
    let s = create(b.as_ref(), "spin2", true).await;
    let started = Instant::now();
    let r = run(b.as_ref(), &s, args(&["x"]), None, None, 1)
        .await
        .unwrap();
    assert_eq!(
        (r.code, r.stderr.as_str()),
        (124, "[kilntainers: command timed out after 1s]")
    );
    assert!(started.elapsed() < Duration::from_millis(1500));

    let b = place.custom(GROW, &["--wasm-max-memory", "2"]);
    let s = create(b.as_ref(), "grow", true).await;
    assert_eq!(
        run(b.as_ref(), &s, args(&["x"]), None, None, 10)
            .await
            .unwrap()
            .code,
        3
    );
    let b = place.custom(GROW, &[]);
    let s = create(b.as_ref(), "grow2", true).await;
    assert_eq!(
        run(b.as_ref(), &s, args(&["x"]), None, None, 10)
            .await
            .unwrap()
            .code,
        0
    );

    let b = place.custom(FLOOD, &[]);
    let s = create(b.as_ref(), "flood", true).await;
    let r = run(b.as_ref(), &s, args(&["x"]), None, None, 10)
        .await
        .unwrap();
    assert!(
        r.stderr
            .starts_with("[kilntainers: output limit exceeded (10000 bytes)"),
        "{}",
        r.stderr
    );

    let b = place.custom(TRAP, &[]);
    let s = create(b.as_ref(), "trap", true).await;
    let r = run(b.as_ref(), &s, args(&["x"]), None, None, 10)
        .await
        .unwrap();
    assert_eq!(r.code, 1);
    assert!(
        r.stderr.starts_with("[kilntainers: WASM trap: "),
        "{}",
        r.stderr
    );
    assert!(r.stderr.ends_with("]\n"));

    let b = place.custom(NO_START, &[]);
    let e = b.validate().await.unwrap_err().to_string();
    assert_eq!(
        e,
        "WASM module does not export a '_start' function. Only WASI command modules are supported."
    );
    let missing = WasmBackend::new(
        &place
            .config(&["--backend", "wasm", "--wasm-path", "/nonexistent/m.wasm"])
            .wasm,
    )
    .unwrap();
    assert_eq!(
        missing.validate().await.unwrap_err().to_string(),
        "WASM file not found: '/nonexistent/m.wasm'"
    );
    let _ = Path::new("/");
}

/// A computer directory as the backend writes it, planted by hand with `root` a symlink.
fn plant(dir: &Path, id: &str, temporary: bool, backend: &str, target: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let meta = serde_json::json!({
        "computer_id": id, "temporary": temporary, "backend": backend, "image": "m.wasm",
        "module_sha256": "0", "created_at": "2026-01-01T00:00:00Z",
        "instance": InstanceId::random().as_str(),
    });
    std::fs::write(dir.join("meta.json"), meta.to_string()).unwrap();
    std::os::unix::fs::symlink(target, dir.join("root")).unwrap();
}

fn private_dir(place: &Place) -> PathBuf {
    kilntainers_wasm::private_dir::private_temp_dir(&place.base.join("tmp")).unwrap()
}

// See: issue 15
#[tokio::test]
async fn issue_15_planted_computers_with_symlinked_roots_are_never_used() {
    use std::os::unix::fs::MetadataExt;
    let place = Place::new();
    let victim = place.base.join("victim-home");
    std::fs::create_dir_all(&victim).unwrap();
    std::fs::write(victim.join("secret"), "s3cret").unwrap();
    let b = place.custom(EXIT_7, &[]);
    // Another user plants a computer in the shared temp dir, as the old layout kept them.
    plant(
        &place.base.join("tmp/kilntainers-wasm-planted1"),
        "planted-shared",
        true,
        "wasm",
        &victim,
    );
    // A real computer of ours, then one planted next to it in the private dir.
    let ours = create(b.as_ref(), "ours", true).await;
    plant(
        &private_dir(&place).join("kilntainers-wasm-planted2"),
        "planted-private",
        true,
        "wasm",
        &victim,
    );
    let listed: Vec<String> = b
        .list()
        .await
        .unwrap()
        .into_iter()
        .map(|c| c.sandbox.computer_id.as_str().to_owned())
        .collect();
    assert_eq!(listed, ["ours"]);
    for id in ["planted-shared", "planted-private"] {
        let found = b.lookup(&ComputerId::parse(id).unwrap()).await.unwrap();
        assert!(found.is_none(), "{id} was found: {found:?}");
    }
    // A permanent computer whose root was swapped for a symlink is not run in.
    let keeper = create(b.as_ref(), "keeper", false).await;
    let root = place.base.join("home/state/wasm/wasm/keeper/root");
    std::fs::remove_dir(&root).unwrap();
    std::os::unix::fs::symlink(&victim, &root).unwrap();
    let refused = run(b.as_ref(), &keeper, args(&["x"]), None, None, 10).await;
    assert!(refused.is_err(), "ran in a symlinked root: {refused:?}");
    assert!(b.ensure_running(&keeper).await.is_err());
    // Removing it removes the link, never the victim's files.
    b.remove(&keeper).await.unwrap();
    assert_eq!(
        std::fs::read_to_string(victim.join("secret")).unwrap(),
        "s3cret"
    );
    // Our own computer still works, and its directories are private.
    assert_eq!(
        run(b.as_ref(), &ours, args(&["x"]), None, None, 10)
            .await
            .unwrap()
            .code,
        7
    );
    let dir = private_dir(&place).join(ours.sandbox_id.as_str());
    for path in [private_dir(&place), dir.clone(), dir.join("root")] {
        let meta = std::fs::symlink_metadata(&path).unwrap();
        assert_eq!(meta.mode() & 0o7777, 0o700, "{}", path.display());
    }
}

// See: issue 15
#[tokio::test]
async fn issue_15_a_private_dir_that_is_not_ours_alone_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let place = Place::new();
    let module = place.base.join("m.wasm");
    std::fs::write(&module, wat::parse_str(EXIT_7).unwrap()).unwrap();
    let module = module.to_str().unwrap().to_owned();
    let config = place.config(&["--backend", "wasm", "--wasm-path", module.as_str()]);
    let dir = private_dir(&place);
    let refused = |why: &str| match WasmBackend::new(&config.wasm) {
        Ok(_) => panic!("{why}: accepted"),
        Err(e) => e.to_string(),
    };
    // Open to others.
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let text = refused("mode 0755");
    assert!(text.contains("its mode is 0755"), "{text}");
    // A symlink to a directory elsewhere.
    std::fs::remove_dir(&dir).unwrap();
    let elsewhere = place.base.join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    std::os::unix::fs::symlink(&elsewhere, &dir).unwrap();
    let text = refused("symlink");
    assert!(text.contains("is a symbolic link"), "{text}");
    std::fs::remove_file(&dir).unwrap();
    // Owned by another user (only root can hand a directory to someone else).
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    let as_root = std::process::Command::new("chown")
        .args(["12345:12345", dir.to_str().unwrap()])
        .status()
        .is_ok_and(|s| s.success());
    if as_root {
        let text = refused("foreign owner");
        assert!(text.contains("belongs to uid 12345"), "{text}");
    }
    std::fs::remove_dir(&dir).unwrap();
    // A clean start makes it 0700 on first use and leaves nothing behind.
    let b = WasmBackend::new(&config.wasm).unwrap();
    let s = create(&b, "fresh", true).await;
    assert!(dir.is_dir());
    b.remove(&s).await.unwrap();
    assert!(
        !dir.exists(),
        "the empty private dir is removed with the last computer"
    );
}
