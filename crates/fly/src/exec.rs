//! Commands through the Machines exec endpoint (docs/decisions.md, "Fly operations" exec rows).
//!
//! The endpoint takes an argv, an optional stdin string and a server-side timeout, and answers
//! once, when the command has ended, with `{stdout, stderr, exit_code, exit_signal}` — HTTP 200
//! even when the command failed. It has no environment or working-directory fields, so the argv
//! is wrapped: `<shell> -lc "export KILNTAINERS_EXEC_ID=<uuid>; cd -- '<wd>' && exec <argv>"`.
//! `exec` makes the tagged process replace the wrapper, so the whole tree (the command's own
//! shell included) carries the tag the kill sweep looks for; without stdin the command reads
//! `/dev/null`. Stdin travels in the request body, never on a command line.
//!
//! Fly buffers the output, but we still read the answer as it arrives and decode the two
//! strings incrementally ([`ResponseDecoder`]), pushing bytes into the sink as they decode: the
//! sink enforces the output limit and memory stays bounded by it, whatever Fly sends.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::FlyInner;
use super::api::ApiError;
use super::machines::Machines;
use kilntainers_backend::posix::quote;
use kilntainers_backend::{
    BackendError, ExecEnd, ExecSpec, OutputSink, SandboxRef, SinkControl, Stream,
};

/// Server-side bound sent with every user command. `ExecSpec` does not carry the call's
/// timeout (the exec layer enforces it and then runs the kill sweep), so this is only a
/// backstop against commands outliving every client: one hour, above any sensible call timeout.
pub(super) const EXEC_SERVER_TIMEOUT_SECS: u64 = 3600;
/// How much decoded output is gathered before it is handed to the sink in one push.
const PUSH_CHUNK: usize = 64 * 1024;

/// The wrapper script run by `<shell> -lc` (see the module text).
pub(super) fn wrapper_script(spec: &ExecSpec) -> String {
    let mut script = format!("export {}; ", spec.exec_id.env_entry());
    if let Some(dir) = &spec.working_dir {
        script.push_str(&format!("cd -- {} && ", quote(dir)));
    }
    script.push_str("exec");
    for word in &spec.argv {
        script.push(' ');
        script.push_str(&quote(word));
    }
    if spec.stdin.is_none() {
        script.push_str(" </dev/null");
    }
    script
}

/// The exec request body for a user command.
pub(super) fn request_body(shell: &str, spec: &ExecSpec) -> serde_json::Value {
    let mut body = serde_json::json!({
        "command": [shell, "-lc", wrapper_script(spec)],
        "timeout": EXEC_SERVER_TIMEOUT_SECS,
    });
    if let Some(stdin) = &spec.stdin {
        // Stdin comes from a JSON string argument, so it is UTF-8 already.
        body["stdin"] = serde_json::Value::String(String::from_utf8_lossy(stdin).into_owned());
    }
    body
}

/// Runs a user command (the trait's `exec`).
pub(super) async fn exec(
    backend: &FlyInner,
    sandbox: &SandboxRef,
    spec: &ExecSpec,
    sink: &mut dyn OutputSink,
    cancel: &CancellationToken,
) -> Result<ExecEnd, BackendError> {
    let body = request_body(&backend.shell, spec);
    run(backend, sandbox, &body, None, sink, cancel).await
}

/// What an internal exec (readiness, kill sweep) produced.
pub(super) struct Collected {
    pub exit_code: i64,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

/// Runs `argv` as is (no wrapper, no tag) and collects up to `cap` bytes of output.
pub(super) async fn run_simple(
    backend: &FlyInner,
    sandbox: &SandboxRef,
    argv: Vec<String>,
    limit: Duration,
) -> Result<Collected, BackendError> {
    const CAP: usize = 64 * 1024;
    let body = serde_json::json!({ "command": argv, "timeout": limit.as_secs().max(1) });
    let mut sink = Collect {
        stdout: Vec::new(),
        stderr: Vec::new(),
        cap: CAP,
    };
    let ended = tokio::time::timeout(
        limit,
        run(
            backend,
            sandbox,
            &body,
            Some(limit),
            &mut sink,
            &CancellationToken::new(),
        ),
    )
    .await
    .map_err(|_| {
        BackendError::Provider(format!(
            "Fly exec in Machine {} did not answer within {}s",
            sandbox.sandbox_id,
            limit.as_secs()
        ))
    })??;
    let exit_code = match ended {
        ExecEnd::Exited(code) => code,
        ExecEnd::StoppedBySink | ExecEnd::OutOfFuel(_) => 0,
    };
    Ok(Collected {
        exit_code,
        stdout: sink.stdout,
        stderr: sink.stderr,
    })
}

struct Collect {
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    cap: usize,
}

impl OutputSink for Collect {
    fn push(&mut self, stream: Stream, bytes: &[u8]) -> SinkControl {
        let buffer = match stream {
            Stream::Stdout => &mut self.stdout,
            Stream::Stderr => &mut self.stderr,
        };
        let room = self.cap.saturating_sub(buffer.len());
        buffer.extend_from_slice(&bytes[..bytes.len().min(room)]);
        SinkControl::Continue
    }
}

async fn run(
    backend: &FlyInner,
    sandbox: &SandboxRef,
    body: &serde_json::Value,
    timeout: Option<Duration>,
    sink: &mut dyn OutputSink,
    cancel: &CancellationToken,
) -> Result<ExecEnd, BackendError> {
    let app = backend.app().await?;
    let machines = Machines {
        api: &backend.api,
        app: &app,
    };
    let sent = tokio::select! {
        sent = machines.exec(sandbox.sandbox_id.as_str(), body, timeout) => sent,
        // The caller stopped listening (timeout or cancel); it runs the kill sweep itself.
        () = cancel.cancelled() => return Ok(ExecEnd::StoppedBySink),
    };
    let mut response = match sent {
        Ok(response) => response,
        Err(error) => return Err(classify(&machines, sandbox, error, false).await),
    };
    let mut decoder = ResponseDecoder::default();
    loop {
        let chunk = tokio::select! {
            chunk = response.chunk() => chunk,
            () = cancel.cancelled() => return Ok(ExecEnd::StoppedBySink),
        };
        let chunk = match chunk {
            Ok(Some(chunk)) => chunk,
            Ok(None) => break,
            Err(error) => {
                let error = ApiError::Transport {
                    call: format!("POST /v1/apps/{app}/machines/{}/exec", sandbox.sandbox_id),
                    detail: error.to_string(),
                };
                return Err(classify(&machines, sandbox, error, true).await);
            }
        };
        let mut stopped = false;
        decoder
            .feed(&chunk, &mut |stream, bytes| {
                if !stopped && sink.push(stream, bytes) == SinkControl::Stop {
                    stopped = true;
                }
                if stopped {
                    SinkControl::Stop
                } else {
                    SinkControl::Continue
                }
            })
            .map_err(|e| bad_answer(sandbox, e))?;
        if stopped {
            return Ok(ExecEnd::StoppedBySink);
        }
    }
    let status = decoder.finish().map_err(|e| bad_answer(sandbox, e))?;
    Ok(ExecEnd::Exited(status.exit_code()))
}

fn bad_answer(sandbox: &SandboxRef, detail: DecodeError) -> BackendError {
    BackendError::Provider(format!(
        "Fly exec in Machine {} (computer '{}') returned an unreadable answer: {detail}",
        sandbox.sandbox_id, sandbox.computer_id
    ))
}

/// Works out why an exec failed: the Machine is gone, stopped (or died under the command), or
/// the call itself failed.
async fn classify(
    machines: &Machines<'_>,
    sandbox: &SandboxRef,
    error: ApiError,
    during: bool,
) -> BackendError {
    if let ApiError::Auth(text) = error {
        return BackendError::Unavailable(text);
    }
    match machines.get(sandbox.sandbox_id.as_str()).await {
        Ok(None) => BackendError::Vanished(sandbox.computer_id.clone()),
        Ok(Some(machine)) if machine.is_gone() => {
            BackendError::Vanished(sandbox.computer_id.clone())
        }
        Ok(Some(machine)) if machine.state != "started" => {
            if during {
                BackendError::DiedDuringExec(sandbox.sandbox_id.clone())
            } else {
                BackendError::NotRunning(sandbox.sandbox_id.clone())
            }
        }
        _ => BackendError::Provider(format!(
            "Fly exec in Machine {} (computer '{}') failed: {}",
            sandbox.sandbox_id,
            sandbox.computer_id,
            error.detail()
        )),
    }
}

/// The scalar fields of an exec answer.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct ExitStatus {
    pub exit_code: Option<i64>,
    pub exit_signal: Option<i64>,
}

impl ExitStatus {
    /// `exit_code`, or 128+signal when only a signal ended the command (docs/decisions.md, "Fly operations").
    /// A missing code is 0: Go omits zero values.
    pub(super) fn exit_code(self) -> i64 {
        match (self.exit_code, self.exit_signal) {
            (None | Some(-1), Some(signal)) if signal > 0 => 128 + signal,
            (code, _) => code.unwrap_or(0),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum DecodeError {
    #[error("not a JSON object at byte {0}")]
    Syntax(usize),
    #[error("the answer ended early")]
    Truncated,
    #[error("field '{0}' is not a number")]
    NotANumber(String),
}

/// Where the bytes of the string being decoded go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    Key,
    Output(Stream),
    Skip,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Start,
    KeyOrEnd,
    KeyNext,
    Colon,
    Value,
    Str(Target),
    Scalar,
    Nested {
        depth: u32,
        in_string: bool,
        escaped: bool,
    },
    CommaOrEnd,
    Done,
}

/// Escape handling inside a JSON string, across chunk boundaries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Escape {
    None,
    Backslash,
    Unicode { digits: u8, value: u32 },
}

/// Incremental decoder for `{"stdout": "...", "stderr": "...", "exit_code": n, ...}`: output
/// bytes are emitted as they decode, other fields are skipped, the two numbers are kept.
#[derive(Debug)]
pub(super) struct ResponseDecoder {
    state: State,
    escape: Escape,
    high_surrogate: Option<u32>,
    key: String,
    scalar: String,
    out: Vec<u8>,
    offset: usize,
    status: ExitStatus,
}

impl Default for ResponseDecoder {
    fn default() -> Self {
        Self {
            state: State::Start,
            escape: Escape::None,
            high_surrogate: None,
            key: String::new(),
            scalar: String::new(),
            out: Vec::new(),
            offset: 0,
            status: ExitStatus::default(),
        }
    }
}

/// Longest key or scalar we keep; the fields we read are short, longer ones are not ours.
const MAX_TOKEN: usize = 256;

impl ResponseDecoder {
    /// Decodes one chunk; `emit` receives output and may ask to stop (then decoding stops).
    pub(super) fn feed(
        &mut self,
        chunk: &[u8],
        emit: &mut dyn FnMut(Stream, &[u8]) -> SinkControl,
    ) -> Result<SinkControl, DecodeError> {
        for &byte in chunk {
            if self.step(byte, emit)? == SinkControl::Stop {
                return Ok(SinkControl::Stop);
            }
            self.offset += 1;
        }
        Ok(self.flush(emit))
    }

    /// The scalar fields, once the whole object has been read.
    pub(super) fn finish(self) -> Result<ExitStatus, DecodeError> {
        match self.state {
            State::Done => Ok(self.status),
            _ => Err(DecodeError::Truncated),
        }
    }

    fn flush(&mut self, emit: &mut dyn FnMut(Stream, &[u8]) -> SinkControl) -> SinkControl {
        if let State::Str(Target::Output(stream)) = self.state
            && !self.out.is_empty()
        {
            let control = emit(stream, &self.out);
            self.out.clear();
            return control;
        }
        SinkControl::Continue
    }

    fn syntax(&self) -> DecodeError {
        DecodeError::Syntax(self.offset)
    }

    fn step(
        &mut self,
        byte: u8,
        emit: &mut dyn FnMut(Stream, &[u8]) -> SinkControl,
    ) -> Result<SinkControl, DecodeError> {
        let whitespace = matches!(byte, b' ' | b'\t' | b'\n' | b'\r');
        match self.state {
            State::Start if whitespace => {}
            State::Start if byte == b'{' => self.state = State::KeyOrEnd,
            State::KeyOrEnd | State::KeyNext if whitespace => {}
            State::KeyOrEnd if byte == b'}' => self.state = State::Done,
            State::KeyOrEnd | State::KeyNext if byte == b'"' => {
                self.key.clear();
                self.state = State::Str(Target::Key);
            }
            State::Colon if whitespace => {}
            State::Colon if byte == b':' => self.state = State::Value,
            State::Value if whitespace => {}
            State::Value => match byte {
                b'"' => {
                    let target = match self.key.as_str() {
                        "stdout" => Target::Output(Stream::Stdout),
                        "stderr" => Target::Output(Stream::Stderr),
                        _ => Target::Skip,
                    };
                    self.state = State::Str(target);
                }
                b'{' | b'[' => {
                    self.state = State::Nested {
                        depth: 1,
                        in_string: false,
                        escaped: false,
                    }
                }
                b'-' | b'0'..=b'9' | b't' | b'f' | b'n' => {
                    self.scalar.clear();
                    self.scalar.push(char::from(byte));
                    self.state = State::Scalar;
                }
                _ => return Err(self.syntax()),
            },
            State::Str(target) => return self.string_byte(target, byte, emit),
            State::Scalar => {
                if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'+' | b'.') {
                    if self.scalar.len() < MAX_TOKEN {
                        self.scalar.push(char::from(byte));
                    }
                } else {
                    self.end_scalar()?;
                    self.state = State::CommaOrEnd;
                    return self.step(byte, emit);
                }
            }
            State::Nested {
                depth,
                in_string,
                escaped,
            } => {
                self.state = match (in_string, escaped, byte) {
                    (true, true, _) => State::Nested {
                        depth,
                        in_string,
                        escaped: false,
                    },
                    (true, false, b'\\') => State::Nested {
                        depth,
                        in_string,
                        escaped: true,
                    },
                    (true, false, b'"') | (false, _, b'"') => State::Nested {
                        depth,
                        in_string: !in_string,
                        escaped: false,
                    },
                    (false, _, b'{' | b'[') => State::Nested {
                        depth: depth + 1,
                        in_string,
                        escaped,
                    },
                    (false, _, b'}' | b']') if depth == 1 => State::CommaOrEnd,
                    (false, _, b'}' | b']') => State::Nested {
                        depth: depth - 1,
                        in_string,
                        escaped,
                    },
                    _ => self.state,
                };
            }
            State::CommaOrEnd if whitespace => {}
            State::CommaOrEnd if byte == b',' => self.state = State::KeyNext,
            State::CommaOrEnd if byte == b'}' => self.state = State::Done,
            State::Done if whitespace => {}
            _ => return Err(self.syntax()),
        }
        Ok(SinkControl::Continue)
    }

    fn end_scalar(&mut self) -> Result<(), DecodeError> {
        let slot = match self.key.as_str() {
            "exit_code" => &mut self.status.exit_code,
            "exit_signal" => &mut self.status.exit_signal,
            _ => return Ok(()),
        };
        *slot = match self.scalar.as_str() {
            "null" => None,
            text => Some(
                text.parse::<i64>()
                    .or_else(|_| text.parse::<f64>().map(|f| f as i64))
                    .map_err(|_| DecodeError::NotANumber(self.key.clone()))?,
            ),
        };
        Ok(())
    }

    fn string_byte(
        &mut self,
        target: Target,
        byte: u8,
        emit: &mut dyn FnMut(Stream, &[u8]) -> SinkControl,
    ) -> Result<SinkControl, DecodeError> {
        match self.escape {
            Escape::None => match byte {
                b'"' => {
                    let control = self.flush(emit);
                    self.state = match target {
                        Target::Key => State::Colon,
                        _ => State::CommaOrEnd,
                    };
                    return Ok(control);
                }
                b'\\' => self.escape = Escape::Backslash,
                _ => self.put(target, &[byte]),
            },
            Escape::Backslash => {
                self.escape = Escape::None;
                let decoded = match byte {
                    b'"' => b'"',
                    b'\\' => b'\\',
                    b'/' => b'/',
                    b'b' => 0x08,
                    b'f' => 0x0c,
                    b'n' => b'\n',
                    b'r' => b'\r',
                    b't' => b'\t',
                    b'u' => {
                        self.escape = Escape::Unicode {
                            digits: 0,
                            value: 0,
                        };
                        return Ok(SinkControl::Continue);
                    }
                    _ => return Err(self.syntax()),
                };
                self.put(target, &[decoded]);
            }
            Escape::Unicode { digits, value } => {
                let digit = char::from(byte).to_digit(16).ok_or_else(|| self.syntax())?;
                let value = value * 16 + digit;
                if digits < 3 {
                    self.escape = Escape::Unicode {
                        digits: digits + 1,
                        value,
                    };
                } else {
                    self.escape = Escape::None;
                    self.code_unit(target, value);
                }
            }
        }
        if self.out.len() >= PUSH_CHUNK {
            return Ok(self.flush(emit));
        }
        Ok(SinkControl::Continue)
    }

    /// One `\uXXXX` unit: pairs surrogates, replaces lone ones with U+FFFD.
    fn code_unit(&mut self, target: Target, unit: u32) {
        let scalar = match (self.high_surrogate.take(), unit) {
            (None, 0xD800..=0xDBFF) => {
                self.high_surrogate = Some(unit);
                return;
            }
            (Some(high), 0xDC00..=0xDFFF) => 0x10000 + ((high - 0xD800) << 10) + (unit - 0xDC00),
            (Some(_), 0xD800..=0xDBFF) => {
                self.put_char(target, char::REPLACEMENT_CHARACTER);
                self.high_surrogate = Some(unit);
                return;
            }
            (Some(_), other) => {
                self.put_char(target, char::REPLACEMENT_CHARACTER);
                other
            }
            (None, other) => other,
        };
        self.put_char(
            target,
            char::from_u32(scalar).unwrap_or(char::REPLACEMENT_CHARACTER),
        );
    }

    fn put_char(&mut self, target: Target, c: char) {
        let mut buffer = [0u8; 4];
        self.put(target, c.encode_utf8(&mut buffer).as_bytes());
    }

    fn put(&mut self, target: Target, bytes: &[u8]) {
        if self.high_surrogate.take().is_some() {
            // A high surrogate not followed by a low one.
            let mut buffer = [0u8; 4];
            let replacement = char::REPLACEMENT_CHARACTER.encode_utf8(&mut buffer);
            self.put(target, replacement.as_bytes());
        }
        match target {
            Target::Key => {
                if self.key.len() < MAX_TOKEN {
                    self.key.push_str(&String::from_utf8_lossy(bytes));
                }
            }
            Target::Output(_) => self.out.extend_from_slice(bytes),
            Target::Skip => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kilntainers_backend::ids::ExecId;

    fn decode_in_chunks(
        body: &[u8],
        size: usize,
    ) -> (Vec<u8>, Vec<u8>, Result<ExitStatus, DecodeError>) {
        let mut decoder = ResponseDecoder::default();
        let (mut out, mut err) = (Vec::new(), Vec::new());
        for chunk in body.chunks(size) {
            let fed = decoder.feed(chunk, &mut |stream, bytes| {
                match stream {
                    Stream::Stdout => out.extend_from_slice(bytes),
                    Stream::Stderr => err.extend_from_slice(bytes),
                }
                SinkControl::Continue
            });
            if let Err(e) = fed {
                return (out, err, Err(e));
            }
        }
        (out, err, decoder.finish())
    }

    #[test]
    fn decodes_any_chunking() {
        let body = serde_json::json!({
            "stderr": "warn \"x\"\n",
            "extra": {"a": [1, "}", {"b": "\\"}]},
            "stdout": "héllo\t\u{1F600}\u{0001}/",
            "exit_code": 3,
            "exit_signal": null,
        })
        .to_string();
        for size in [1, 2, 3, 7, 64, 4096] {
            let (out, err, status) = decode_in_chunks(body.as_bytes(), size);
            assert_eq!(String::from_utf8(out).unwrap(), "héllo\t\u{1F600}\u{0001}/");
            assert_eq!(err, b"warn \"x\"\n");
            assert_eq!(status.unwrap().exit_code(), 3);
        }
    }

    #[test]
    fn escaped_unicode_and_surrogates() {
        let body = br#"{"stdout":"\u00e9\ud83d\ude00\ud800x","exit_code":0}"#;
        let (out, _, status) = decode_in_chunks(body, 1);
        assert_eq!(String::from_utf8(out).unwrap(), "é😀\u{FFFD}x");
        assert_eq!(status.unwrap().exit_code(), 0);
    }

    #[test]
    fn exit_code_rules() {
        let status = |code, signal| ExitStatus {
            exit_code: code,
            exit_signal: signal,
        };
        assert_eq!(status(None, None).exit_code(), 0);
        assert_eq!(status(Some(2), Some(0)).exit_code(), 2);
        assert_eq!(status(None, Some(9)).exit_code(), 137);
        assert_eq!(status(Some(-1), Some(15)).exit_code(), 143);
        assert_eq!(status(Some(1), Some(9)).exit_code(), 1);
    }

    #[test]
    fn truncated_and_malformed_answers() {
        let (_, _, status) = decode_in_chunks(br#"{"stdout":"abc"#, 4);
        assert_eq!(status, Err(DecodeError::Truncated));
        let (_, _, status) = decode_in_chunks(b"[1]", 4);
        assert!(matches!(status, Err(DecodeError::Syntax(0))));
        let (_, _, status) = decode_in_chunks(br#"{"exit_code":1x}"#, 4);
        assert_eq!(status, Err(DecodeError::NotANumber("exit_code".into())));
    }

    #[test]
    fn stop_is_honoured_mid_string() {
        let body = format!(r#"{{"stdout":"{}","exit_code":0}}"#, "a".repeat(200_000));
        let mut decoder = ResponseDecoder::default();
        let mut seen = 0;
        let control = decoder
            .feed(body.as_bytes(), &mut |_, bytes| {
                seen += bytes.len();
                SinkControl::Stop
            })
            .unwrap();
        assert_eq!(control, SinkControl::Stop);
        assert_eq!(seen, PUSH_CHUNK);
    }

    #[test]
    fn wrapper_script_tags_cds_and_quotes() {
        let exec_id = ExecId::random();
        let spec = ExecSpec {
            argv: vec!["/bin/sh".into(), "-c".into(), "echo 'hi'; pwd".into()],
            stdin: None,
            working_dir: Some("/tmp/it's".into()),
            exec_id: exec_id.clone(),
            command: None,
        };
        assert_eq!(
            wrapper_script(&spec),
            format!(
                "export KILNTAINERS_EXEC_ID={}; cd -- '/tmp/it'\\''s' && exec '/bin/sh' '-c' 'echo '\\''hi'\\''; pwd' </dev/null",
                exec_id.as_str()
            )
        );
        let with_stdin = ExecSpec {
            stdin: Some(b"data".to_vec()),
            working_dir: None,
            ..spec
        };
        let body = request_body("/bin/bash", &with_stdin);
        assert_eq!(body["command"][0], "/bin/bash");
        assert_eq!(body["command"][1], "-lc");
        assert_eq!(body["stdin"], "data");
        assert_eq!(body["timeout"], EXEC_SERVER_TIMEOUT_SECS);
        assert!(!body["command"][2].as_str().unwrap().contains("cd --"));
    }
}
