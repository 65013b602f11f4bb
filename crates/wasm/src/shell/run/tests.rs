//! Unit tests of `run`.

use super::super::parse::parse;
use super::*;
use std::collections::BTreeMap;

/// Files are a map of absolute path → content; directories are implied by prefixes plus
/// an explicit set. Applets: echo, cat, upper, fail, env-of NAME.
#[derive(Default)]
struct Fake {
    files: BTreeMap<String, Vec<u8>>,
    dirs: Vec<String>,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    pipe: Vec<u8>,
    open: Vec<(String, Vec<u8>)>,
    ran: Vec<Vec<String>>,
    cwds: Vec<String>,
}

impl Fake {
    fn sink(&mut self, out: &Out) -> &mut Vec<u8> {
        match out {
            Out::Stdout => &mut self.stdout,
            Out::Stderr => &mut self.stderr,
            Out::Pipe => &mut self.pipe,
            Out::Null => &mut self.open[0].1,
            Out::File(id) => &mut self.open[*id].1,
        }
    }
}

#[async_trait]
impl Host for Fake {
    async fn run(
        &mut self,
        argv: Vec<String>,
        env: Vec<(String, String)>,
        cwd: &str,
        stdin: Vec<u8>,
        stdout: Out,
        stderr: Out,
    ) -> Result<i32, Aborted> {
        self.ran.push(argv.clone());
        self.cwds.push(cwd.to_owned());
        let (out, err, code): (Vec<u8>, Vec<u8>, i32) = match argv[0].as_str() {
            "echo" => (format!("{}\n", argv[1..].join(" ")).into_bytes(), vec![], 0),
            "cat" => (stdin, vec![], 0),
            "upper" => (stdin.to_ascii_uppercase(), vec![], 0),
            "fail" => (vec![], b"failed\n".to_vec(), 3),
            "env-of" => {
                let v = env
                    .iter()
                    .rev()
                    .find(|(k, _)| *k == argv[1])
                    .map(|(_, v)| v.clone());
                (
                    format!("{}\n", v.unwrap_or_default()).into_bytes(),
                    vec![],
                    0,
                )
            }
            "abort" => return Err(Aborted),
            other => (vec![], format!("{other}: not found\n").into_bytes(), 127),
        };
        self.sink(&stdout).extend(out);
        self.sink(&stderr).extend(err);
        Ok(code)
    }
    fn take_pipe(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.pipe)
    }
    fn write(&mut self, out: &Out, bytes: &[u8]) -> Result<(), Aborted> {
        self.sink(out).extend_from_slice(bytes);
        Ok(())
    }
    fn open_output(&mut self, path: &str, append: bool) -> Result<usize, String> {
        if path.starts_with("/missing/") {
            return Err("No such file or directory".into());
        }
        let existing = if append {
            self.files.get(path).cloned().unwrap_or_default()
        } else {
            Vec::new()
        };
        self.open.push((path.to_owned(), existing));
        Ok(self.open.len() - 1)
    }
    fn read_input(&mut self, path: &str) -> Result<Vec<u8>, String> {
        self.files
            .get(path)
            .cloned()
            .ok_or_else(|| "No such file or directory".into())
    }
    fn check_dir(&mut self, path: &str) -> Result<(), String> {
        if path == "/" || self.dirs.iter().any(|d| d == path) {
            Ok(())
        } else {
            Err("No such file or directory".into())
        }
    }
    fn list_dir(&mut self, path: &str) -> Option<Vec<String>> {
        let prefix = if path == "/" {
            "/".to_owned()
        } else {
            format!("{path}/")
        };
        let mut names: Vec<String> = self
            .files
            .keys()
            .chain(self.dirs.iter())
            .filter_map(|p| p.strip_prefix(&prefix))
            .filter(|rest| !rest.is_empty() && !rest.contains('/'))
            .map(str::to_owned)
            .collect();
        names.dedup();
        Some(names)
    }
}

async fn run(fake: &mut Fake, source: &str, stdin: Option<&str>) -> i32 {
    let script = parse(source).unwrap();
    // index 0 of `open` is the /dev/null sink
    if fake.open.is_empty() {
        fake.open.push(("/dev/null".into(), Vec::new()));
    }
    let env = vec![("HOME".into(), "/".into()), ("PATH".into(), "/bin".into())];
    Interpreter::new(fake, env, "/".into(), stdin.map(|s| s.as_bytes().to_vec()))
        .run(&script)
        .await
        .unwrap()
}

fn out(fake: &Fake) -> String {
    String::from_utf8_lossy(&fake.stdout).into_owned()
}

#[test]
fn normalize_clamps_at_root() {
    assert_eq!(normalize("/", "/../../x"), "/x");
    assert_eq!(normalize("/a/b", "../c/./d"), "/a/c/d");
    assert_eq!(normalize("/a", ".."), "/");
    assert_eq!(normalize("/a", "../../.."), "/");
    assert_eq!(normalize("/", ""), "/");
}

#[tokio::test]
async fn pipelines_pass_output_along() {
    let mut fake = Fake::default();
    assert_eq!(run(&mut fake, "echo hi | upper | cat", None).await, 0);
    assert_eq!(out(&fake), "HI\n");
}

#[tokio::test]
async fn and_or_short_circuit_and_status() {
    let mut fake = Fake::default();
    assert_eq!(run(&mut fake, "fail && echo no || echo yes", None).await, 0);
    assert_eq!(out(&fake), "yes\n");
    let mut fake = Fake::default();
    assert_eq!(run(&mut fake, "echo a; fail", None).await, 3);
    assert_eq!(run(&mut fake, "fail; echo $?", None).await, 0);
    assert!(out(&fake).ends_with("3\n"));
    let mut fake = Fake::default();
    assert_eq!(run(&mut fake, "! fail", None).await, 0);
    assert_eq!(run(&mut fake, "! true", None).await, 1);
    assert_eq!(run(&mut fake, "fail | cat", None).await, 0);
}

#[tokio::test]
async fn redirections() {
    let mut fake = Fake::default();
    assert_eq!(
        run(&mut fake, "echo x > /f 2>&1; fail 2>&1 >/g", None).await,
        3
    );
    assert_eq!(fake.open[1], ("/f".into(), b"x\n".to_vec()));
    // 2>&1 before >/g: stderr still goes to the old stdout.
    assert_eq!(out(&fake), "failed\n");
    let mut fake = Fake::default();
    run(&mut fake, "fail > /o 2>&1", None).await;
    assert_eq!(fake.open[1].1, b"failed\n");
    let mut fake = Fake::default();
    run(&mut fake, "fail 2>/dev/null", None).await;
    assert!(fake.stderr.is_empty());
    let mut fake = Fake::default();
    run(&mut fake, "echo e >&2", None).await;
    assert_eq!(fake.stderr, b"e\n");
    let mut fake = Fake::default();
    fake.files.insert("/in".into(), b"data".to_vec());
    run(&mut fake, "upper < in", None).await;
    assert_eq!(out(&fake), "DATA");
    let mut fake = Fake::default();
    assert_eq!(
        run(&mut fake, "echo a > /missing/x && echo no", None).await,
        1
    );
    assert_eq!(
        fake.stderr,
        b"kilntainers: /missing/x: No such file or directory\n"
    );
    assert!(fake.ran.is_empty());
    let mut fake = Fake::default();
    fake.files.insert("/log".into(), b"1\n".to_vec());
    run(&mut fake, "echo 2 >> log", None).await;
    assert_eq!(fake.open[1].1, b"1\n2\n");
}

#[tokio::test]
async fn variables() {
    let mut fake = Fake::default();
    run(&mut fake, "X=1; echo $X ${X}y \"$X z\" '$X' $NOPE a$", None).await;
    assert_eq!(out(&fake), "1 1y 1 z $X a$\n");
    let mut fake = Fake::default();
    run(&mut fake, "Y=2 env-of Y; env-of Y; echo $HOME", None).await;
    assert_eq!(out(&fake), "2\n\n/\n");
    let mut fake = Fake::default();
    run(&mut fake, "V='a  b'; echo $V; echo \"$V\"", None).await;
    assert_eq!(fake.ran[0], vec!["echo", "a", "b"]);
    assert_eq!(fake.ran[1], vec!["echo", "a  b"]);
    let mut fake = Fake::default();
    run(&mut fake, "echo $EMPTY x", None).await;
    assert_eq!(fake.ran[0], vec!["echo", "x"]);
}

#[tokio::test]
async fn builtins() {
    let mut fake = Fake::default();
    fake.dirs.push("/a".into());
    assert_eq!(
        run(&mut fake, "cd a && pwd && env-of PWD && cd /nope", None).await,
        1
    );
    assert_eq!(out(&fake), "/a\n/a\n");
    assert_eq!(
        fake.stderr,
        b"kilntainers: cd: /nope: No such file or directory\n"
    );
    let mut fake = Fake::default();
    assert_eq!(run(&mut fake, "echo a; exit 7; echo b", None).await, 7);
    assert_eq!(out(&fake), "a\n");
    let mut fake = Fake::default();
    run(&mut fake, "/bin/echo hi", None).await;
    assert_eq!(fake.ran[0], vec!["echo", "hi"]);
}

#[tokio::test]
async fn stdin_goes_to_the_first_command_only() {
    let mut fake = Fake::default();
    run(&mut fake, "cat; cat", Some("in")).await;
    assert_eq!(out(&fake), "in");
}

#[tokio::test]
async fn globs() {
    let mut fake = Fake::default();
    for f in ["/b.txt", "/a.txt", "/.h.txt", "/d/x.txt", "/c.md"] {
        fake.files.insert(f.into(), Vec::new());
    }
    fake.dirs.push("/d".into());
    run(
        &mut fake,
        "echo *.txt; echo '*.txt'; echo *.none; echo .*.txt",
        None,
    )
    .await;
    assert_eq!(fake.ran[0], vec!["echo", "a.txt", "b.txt"]);
    assert_eq!(fake.ran[1], vec!["echo", "*.txt"]);
    assert_eq!(fake.ran[2], vec!["echo", "*.none"]);
    assert_eq!(fake.ran[3], vec!["echo", ".h.txt"]);
    run(&mut fake, "echo d/*.txt /?.md [ab].txt", None).await;
    assert_eq!(
        fake.ran[4],
        vec!["echo", "d/x.txt", "/c.md", "a.txt", "b.txt"]
    );
    run(&mut fake, "echo \\*.txt", None).await;
    assert_eq!(fake.ran[5], vec!["echo", "*.txt"]);
}

#[tokio::test]
async fn abort_stops_everything() {
    let mut fake = Fake::default();
    let script = parse("abort; echo after").unwrap();
    let result = Interpreter::new(&mut fake, vec![], "/".into(), None)
        .run(&script)
        .await;
    assert_eq!(result, Err(Aborted));
    assert_eq!(fake.ran.len(), 1);
}
