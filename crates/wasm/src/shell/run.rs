//! Executes a parsed command string (docs/decisions.md, "The go_busybox command interpreter".) by chaining applet runs through a
//! [`Host`]: lists and `&&`/`||`, pipelines buffered stage by stage, redirections, builtins,
//! variables and globs. The host owns everything real (running the module, files, the output
//! limit); this module only decides what runs with which input and output, so it is tested with
//! a fake host.

use std::collections::BTreeMap;

use async_trait::async_trait;

use super::parse::{AndOr, Command, Connector, Part, Pipeline, RedirectKind, Script, Word};

/// Where one stream of one command goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Out {
    /// The exec's stdout / stderr.
    Stdout,
    Stderr,
    /// The buffer feeding the next pipeline stage.
    Pipe,
    /// `/dev/null`.
    Null,
    /// A file the host opened for this command line ([`Host::open_output`]).
    File(usize),
}

/// The host stopped the whole command line (output limit, fuel, timeout); it knows why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Aborted;

/// What the interpreter needs from the computer. Paths are absolute, normalised guest paths.
#[async_trait]
pub trait Host: Send {
    /// Runs one applet (`argv[0]` is the applet name) and returns its exit status.
    async fn run(
        &mut self,
        argv: Vec<String>,
        env: Vec<(String, String)>,
        cwd: &str,
        stdin: Vec<u8>,
        stdout: Out,
        stderr: Out,
    ) -> Result<i32, Aborted>;
    /// Takes what was written to [`Out::Pipe`] since the last call.
    fn take_pipe(&mut self) -> Vec<u8>;
    fn write(&mut self, out: &Out, bytes: &[u8]) -> Result<(), Aborted>;
    /// Creates/truncates (or appends to) a file; the error text is shown to the user.
    fn open_output(&mut self, path: &str, append: bool) -> Result<usize, String>;
    fn read_input(&mut self, path: &str) -> Result<Vec<u8>, String>;
    /// Whether `path` is a directory inside the computer; the error text is shown to the user.
    fn check_dir(&mut self, path: &str) -> Result<(), String>;
    /// Names in a directory (no `.`/`..`); `None` when it cannot be read.
    fn list_dir(&mut self, path: &str) -> Option<Vec<String>>;
}

/// Lexical normalisation: `.` dropped, `..` pops, clamped at `/` (`/../../x` = `/x`).
pub fn normalize(cwd: &str, path: &str) -> String {
    let mut parts: Vec<&str> = Vec::new();
    let joined = if path.starts_with('/') {
        path.to_owned()
    } else {
        format!("{cwd}/{path}")
    };
    for piece in joined.split('/') {
        match piece {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            other => parts.push(other),
        }
    }
    format!("/{}", parts.join("/"))
}

enum Flow {
    Next,
    Exit(i32),
}

/// One command string's execution state: variables, working directory, last status.
pub struct Interpreter<'h, H: Host> {
    host: &'h mut H,
    base_env: Vec<(String, String)>,
    vars: BTreeMap<String, String>,
    cwd: String,
    status: i32,
    stdin: Option<Vec<u8>>,
}

impl<'h, H: Host> Interpreter<'h, H> {
    /// `base_env` is the computer's environment (`PWD` is replaced per command); `stdin` goes
    /// to the first command that runs.
    pub fn new(
        host: &'h mut H,
        base_env: Vec<(String, String)>,
        cwd: String,
        stdin: Option<Vec<u8>>,
    ) -> Self {
        Self {
            host,
            base_env,
            vars: BTreeMap::new(),
            cwd,
            status: 0,
            stdin,
        }
    }

    /// Runs the script; the result is the exit status of the command line.
    pub async fn run(&mut self, script: &Script) -> Result<i32, Aborted> {
        for and_or in script {
            if let Flow::Exit(code) = self.and_or(and_or).await? {
                return Ok(code);
            }
        }
        Ok(self.status)
    }

    async fn and_or(&mut self, list: &AndOr) -> Result<Flow, Aborted> {
        if let Flow::Exit(code) = self.pipeline(&list.first).await? {
            return Ok(Flow::Exit(code));
        }
        for (connector, pipeline) in &list.rest {
            let run = match connector {
                Connector::And => self.status == 0,
                Connector::Or => self.status != 0,
            };
            if run && let Flow::Exit(code) = self.pipeline(pipeline).await? {
                return Ok(Flow::Exit(code));
            }
        }
        Ok(Flow::Next)
    }

    async fn pipeline(&mut self, pipeline: &Pipeline) -> Result<Flow, Aborted> {
        let count = pipeline.commands.len();
        let mut input = self.stdin.take().unwrap_or_default();
        let mut status = 0;
        for (index, command) in pipeline.commands.iter().enumerate() {
            let last = index + 1 == count;
            let stdout = if last { Out::Stdout } else { Out::Pipe };
            match self.command(command, input, stdout, count == 1).await? {
                Flow::Exit(code) => return Ok(Flow::Exit(code)),
                Flow::Next => status = self.status,
            }
            input = if last {
                Vec::new()
            } else {
                self.host.take_pipe()
            };
        }
        self.status = if pipeline.negated {
            i32::from(status == 0)
        } else {
            status
        };
        Ok(Flow::Next)
    }

    fn value(&self, name: &str) -> String {
        if let Some(value) = self.vars.get(name) {
            return value.clone();
        }
        if name == "PWD" {
            return self.cwd.clone();
        }
        self.base_env
            .iter()
            .rev()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    }

    /// Expands a word into fields of `(char, glob-active)`: variables substituted, unquoted
    /// expansions split on blanks.
    fn fields(&self, word: &Word) -> Vec<Vec<(char, bool)>> {
        let mut fields = Vec::new();
        let mut current: Option<Vec<(char, bool)>> = None;
        for part in &word.0 {
            let (text, quoted, from_expansion) = match part {
                Part::Lit { text, quoted } => (text.clone(), *quoted, false),
                Part::Var { name, quoted } => (self.value(name), *quoted, true),
                Part::Status { quoted } => (self.status.to_string(), *quoted, true),
            };
            if from_expansion && !quoted {
                for c in text.chars() {
                    if c.is_whitespace() {
                        if let Some(field) = current.take() {
                            fields.push(field);
                        }
                    } else {
                        current.get_or_insert_with(Vec::new).push((c, false));
                    }
                }
            } else {
                current
                    .get_or_insert_with(Vec::new)
                    .extend(text.chars().map(|c| (c, !quoted)));
            }
        }
        fields.extend(current);
        fields
    }

    /// A word as one string (assignments, redirection targets): no splitting, no globbing.
    fn single(&self, word: &Word) -> String {
        word.0
            .iter()
            .map(|part| match part {
                Part::Lit { text, .. } => text.clone(),
                Part::Var { name, .. } => self.value(name),
                Part::Status { .. } => self.status.to_string(),
            })
            .collect()
    }

    fn argv(&mut self, words: &[Word]) -> Vec<String> {
        let mut argv = Vec::new();
        for word in words {
            for field in self.fields(word) {
                let is_glob = field
                    .iter()
                    .any(|(c, active)| *active && matches!(c, '*' | '?' | '['));
                let literal: String = field.iter().map(|(c, _)| *c).collect();
                if is_glob {
                    let matches = self.glob(&field);
                    if matches.is_empty() {
                        argv.push(literal);
                    } else {
                        argv.extend(matches);
                    }
                } else {
                    argv.push(literal);
                }
            }
        }
        argv
    }

    /// Expands a glob field against the computer's files, component by component; sorted.
    fn glob(&mut self, field: &[(char, bool)]) -> Vec<String> {
        let mut components: Vec<Vec<(char, bool)>> = vec![Vec::new()];
        for &(c, active) in field {
            if c == '/' {
                components.push(Vec::new());
            } else if let Some(last) = components.last_mut() {
                last.push((c, active));
            }
        }
        let absolute = field.first().is_some_and(|(c, _)| *c == '/');
        // (shown to the command, absolute guest path)
        let mut candidates = vec![(
            if absolute {
                "/".to_owned()
            } else {
                String::new()
            },
            if absolute {
                "/".to_owned()
            } else {
                self.cwd.clone()
            },
        )];
        for component in &components {
            if component.is_empty() {
                continue;
            }
            let text: String = component.iter().map(|(c, _)| *c).collect();
            let active = component
                .iter()
                .any(|(c, a)| *a && matches!(c, '*' | '?' | '['));
            let mut next = Vec::new();
            for (shown, dir) in &candidates {
                let join = |name: &str| {
                    let shown = if shown.is_empty() || shown.ends_with('/') {
                        format!("{shown}{name}")
                    } else {
                        format!("{shown}/{name}")
                    };
                    (shown, normalize(dir, name))
                };
                if !active {
                    let exists = text == "."
                        || text == ".."
                        || self
                            .host
                            .list_dir(dir)
                            .is_some_and(|names| names.contains(&text));
                    if exists {
                        next.push(join(&text));
                    }
                    continue;
                }
                let pattern_text: String = component
                    .iter()
                    .map(|&(c, a)| {
                        if a {
                            c.to_string()
                        } else {
                            glob::Pattern::escape(&c.to_string())
                        }
                    })
                    .collect();
                let Ok(pattern) = glob::Pattern::new(&pattern_text) else {
                    return Vec::new();
                };
                let options = glob::MatchOptions {
                    case_sensitive: true,
                    require_literal_separator: true,
                    require_literal_leading_dot: true,
                };
                let mut names = self.host.list_dir(dir).unwrap_or_default();
                names.sort();
                for name in names {
                    if pattern.matches_with(&name, options) {
                        next.push(join(&name));
                    }
                }
            }
            candidates = next;
            if candidates.is_empty() {
                return Vec::new();
            }
        }
        let mut shown: Vec<String> = candidates.into_iter().map(|(shown, _)| shown).collect();
        shown.sort();
        shown
    }

    async fn command(
        &mut self,
        command: &Command,
        stdin: Vec<u8>,
        default_out: Out,
        alone: bool,
    ) -> Result<Flow, Aborted> {
        let argv = self.argv(&command.words);
        let assignments: Vec<(String, String)> = command
            .assignments
            .iter()
            .map(|(name, value)| (name.clone(), self.single(value)))
            .collect();

        // Redirections, left to right.
        let mut input = stdin;
        let mut out = default_out;
        let mut err = Out::Stderr;
        for redirect in &command.redirects {
            let target = self.single(&redirect.target);
            let result = match redirect.kind {
                RedirectKind::Dup(to) => {
                    let copy = if to == 1 { out.clone() } else { err.clone() };
                    Ok(Some(copy))
                }
                RedirectKind::Input if target == "/dev/null" => {
                    input = Vec::new();
                    Ok(None)
                }
                RedirectKind::Input => {
                    let path = normalize(&self.cwd, &target);
                    self.host.read_input(&path).map(|data| {
                        input = data;
                        None
                    })
                }
                RedirectKind::Output | RedirectKind::Append if target == "/dev/null" => {
                    Ok(Some(Out::Null))
                }
                RedirectKind::Output | RedirectKind::Append => {
                    let path = normalize(&self.cwd, &target);
                    self.host
                        .open_output(&path, redirect.kind == RedirectKind::Append)
                        .map(|id| Some(Out::File(id)))
                }
            };
            match result {
                Ok(Some(target_out)) => {
                    if redirect.fd == 2 {
                        err = target_out;
                    } else {
                        out = target_out;
                    }
                }
                Ok(None) => {}
                Err(message) => {
                    self.host.write(
                        &err,
                        format!("kilntainers: {target}: {message}\n").as_bytes(),
                    )?;
                    self.status = 1;
                    return Ok(Flow::Next);
                }
            }
        }

        let Some(name) = argv.first() else {
            // Bare assignments set shell variables for the rest of the call.
            for (name, value) in assignments {
                self.vars.insert(name, value);
            }
            self.status = 0;
            return Ok(Flow::Next);
        };
        let name = name.rsplit('/').next().unwrap_or(name).to_owned();
        match name.as_str() {
            "true" | ":" => self.status = 0,
            "false" => self.status = 1,
            "pwd" => {
                let line = format!("{}\n", self.cwd);
                self.host.write(&out, line.as_bytes())?;
                self.status = 0;
            }
            "cd" => {
                let target = argv.get(1).map_or("/", String::as_str);
                let path = normalize(&self.cwd, target);
                match self.host.check_dir(&path) {
                    Ok(()) => {
                        if alone {
                            self.cwd = path;
                        }
                        self.status = 0;
                    }
                    Err(message) => {
                        self.host.write(
                            &err,
                            format!("kilntainers: cd: {target}: {message}\n").as_bytes(),
                        )?;
                        self.status = 1;
                    }
                }
            }
            "exit" => {
                let code = match argv.get(1) {
                    None => self.status,
                    Some(text) => match text.parse::<i64>() {
                        Ok(n) => (n & 0xff) as i32,
                        Err(_) => {
                            self.host.write(
                                &err,
                                format!("kilntainers: exit: {text}: numeric argument required\n")
                                    .as_bytes(),
                            )?;
                            2
                        }
                    },
                };
                self.status = code;
                if alone {
                    return Ok(Flow::Exit(code));
                }
            }
            _ => {
                let mut env: Vec<(String, String)> = self
                    .base_env
                    .iter()
                    .filter(|(k, _)| k != "PWD" && !assignments.iter().any(|(a, _)| a == k))
                    .cloned()
                    .collect();
                env.push(("PWD".into(), self.cwd.clone()));
                env.extend(assignments);
                let mut argv = argv;
                argv[0] = name.clone();
                let cwd = self.cwd.clone();
                self.status = self.host.run(argv, env, &cwd, input, out, err).await?;
            }
        }
        Ok(Flow::Next)
    }
}

#[cfg(test)]
mod tests;
