//! Commands through envd's process service (`process.Process`, Connect protocol, JSON codec).
//!
//! The message types below are written by hand from the field names and types of envd's
//! published `process.proto` (`StartRequest`, `ProcessConfig`, `ProcessEvent` with its
//! `start`/`data`/`end`/`keepalive` events, `SendInputRequest`, `CloseStdinRequest`,
//! `SendSignalRequest`, `ProcessSelector`), in proto3-JSON form: lowerCamelCase names, `bytes`
//! as base64, enums by name, and **default values omitted** — an `end` event without
//! `exitCode` means exit code 0, and one without `exited` means `false`.
//!
//! `Start` is server-streaming: one request envelope, then envelopes of events until an
//! end-of-stream envelope. Stdin goes through unary `SendInput` calls (≤ 64 KiB each) once the
//! `start` event has named the pid, then `CloseStdin`, concurrently with reading the output so a
//! command that writes while it reads cannot deadlock. Output is pushed into the sink as it
//! decodes, so the sink's limit bounds memory whatever envd sends.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use super::connect::{ConnectError, Decoder, Frame, envelope};
use crate::config::ENVD_PORT;
use kilntainers_backend::rest::bounded_text;
use kilntainers_backend::{ExecEnd, OutputSink, SinkControl, Stream};

/// Stdin is sent in pieces of at most this size (docs/decisions.md, "E2B sandboxes").
const STDIN_CHUNK: usize = 64 * 1024;
/// The keep-alive interval we ask envd for, in seconds (the official SDKs' value): envd sends a
/// `keepalive` event this often so proxies do not cut a quiet stream.
const KEEPALIVE_SECS: &str = "50";
/// Connect codes with which envd refuses to start a program it cannot run (`exec.Cmd.Start`
/// failing): reported like a shell reports a missing command.
const CANNOT_START: [&str; 5] = [
    "internal",
    "unknown",
    "invalid_argument",
    "failed_precondition",
    "not_found",
];
/// The shell's "command not found" code.
const CANNOT_START_CODE: i64 = 127;
/// Bound for the unary calls (input, close, signal): they return at once.
const UNARY_TIMEOUT: Duration = Duration::from_secs(30);

/// `ProcessConfig`.
#[derive(Debug, Serialize)]
struct ProcessConfig<'a> {
    cmd: &'a str,
    args: &'a [String],
    envs: &'a BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cwd: Option<&'a str>,
}

/// `StartRequest` (no `pty`, no `tag`). `stdin` exists from envd 0.3.0 on and is left out for
/// older ones, as the official SDK does.
#[derive(Debug, Serialize)]
struct StartRequest<'a> {
    process: ProcessConfig<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stdin: Option<bool>,
}

/// A sandbox's envd release, from `envdVersion` of the control plane's answers. The official
/// SDK changes behaviour by it (`packages/js-sdk/src/envd/versions.ts`): `stdin` on `Start`
/// needs 0.3.0, acting as the template's default user without naming one needs 0.4.0 (older
/// ones are told the user in `Authorization: Basic <user>:`), and `CloseStdin` needs 0.5.2.
/// An absent or unreadable version counts as current.
/// See: issue 32 (item 5)
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct EnvdVersion(pub u32, pub u32, pub u32);

impl EnvdVersion {
    /// What we assume when the control plane names no version.
    pub(super) const CURRENT: Self = Self(u32::MAX, 0, 0);
    const STDIN: Self = Self(0, 3, 0);
    const DEFAULT_USER: Self = Self(0, 4, 0);
    const CLOSE_STDIN: Self = Self(0, 5, 2);
    /// The user older envd must be told: the one E2B templates run commands as.
    const OLD_DEFAULT_USER: &'static str = "user";

    pub(super) fn parse(text: Option<&str>) -> Self {
        let Some(text) = text else {
            return Self::CURRENT;
        };
        let mut parts = text.trim().trim_start_matches('v').split(['.', '-', '+']);
        let mut next = || parts.next().and_then(|p| p.parse::<u32>().ok());
        match (next(), next(), next()) {
            (Some(major), Some(minor), patch) => Self(major, minor, patch.unwrap_or(0)),
            _ => Self::CURRENT,
        }
    }

    /// `Authorization: Basic <user>:` for envd older than 0.4.0, which needs the user named.
    pub(super) fn user_header(self) -> Option<String> {
        (self < Self::DEFAULT_USER).then(|| {
            format!(
                "Basic {}",
                BASE64.encode(format!("{}:", Self::OLD_DEFAULT_USER))
            )
        })
    }

    /// Why a command with stdin cannot run on this envd, if it cannot.
    fn stdin_refusal(self) -> Option<String> {
        (self < Self::CLOSE_STDIN).then(|| {
            format!(
                "this sandbox's envd ({self}) is older than 0.5.2 and cannot close a command's stdin, so input cannot be given; rebuild the E2B template (e2b template build) to get a current envd"
            )
        })
    }
}

impl std::fmt::Display for EnvdVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if *self == Self::CURRENT {
            f.write_str("current")
        } else {
            write!(f, "{}.{}.{}", self.0, self.1, self.2)
        }
    }
}

/// `ProcessSelector` by pid.
#[derive(Debug, Serialize)]
struct Selector {
    pid: u32,
}

#[derive(Debug, Serialize)]
struct ProcessInput {
    stdin: String,
}

#[derive(Debug, Serialize)]
struct SendInputRequest {
    process: Selector,
    input: ProcessInput,
}

#[derive(Debug, Serialize)]
struct CloseStdinRequest {
    process: Selector,
}

#[derive(Debug, Serialize)]
struct SendSignalRequest {
    process: Selector,
    signal: &'static str,
}

#[derive(Debug, Default, Deserialize)]
struct StartResponse {
    #[serde(default)]
    event: Option<ProcessEvent>,
}

#[derive(Debug, Default, Deserialize)]
struct ProcessEvent {
    #[serde(default)]
    start: Option<StartEvent>,
    #[serde(default)]
    data: Option<DataEvent>,
    #[serde(default)]
    end: Option<EndEvent>,
    #[serde(default)]
    keepalive: Option<serde_json::Value>,
}

#[derive(Debug, Default, Deserialize)]
struct StartEvent {
    #[serde(default)]
    pid: u32,
}

#[derive(Debug, Default, Deserialize)]
struct DataEvent {
    #[serde(default)]
    stdout: Option<String>,
    #[serde(default)]
    stderr: Option<String>,
    #[serde(default)]
    pty: Option<String>,
}

/// `EndEvent`: every field may be missing (proto3 omits defaults).
#[derive(Debug, Default, Clone, Deserialize, PartialEq, Eq)]
pub(super) struct EndEvent {
    #[serde(rename = "exitCode", default)]
    pub exit_code: i64,
    #[serde(default)]
    pub exited: bool,
    #[serde(default)]
    pub status: String,
    #[serde(default)]
    pub error: Option<String>,
}

impl EndEvent {
    /// The exit code to report. A process ended by a signal has `exited: false` and envd's
    /// `exitCode` -1 with a Go status like `signal: killed`; report it as 128 + signal, like a
    /// shell would.
    pub(super) fn code(&self) -> i64 {
        if self.exited || self.exit_code >= 0 && !self.status.starts_with("signal: ") {
            return self.exit_code;
        }
        let signal = match self.status.trim_start_matches("signal: ") {
            "hangup" => 1,
            "interrupt" => 2,
            "quit" => 3,
            "aborted" => 6,
            "killed" => 9,
            "segmentation fault" => 11,
            "broken pipe" => 13,
            "alarm clock" => 14,
            "terminated" => 15,
            _ => return self.exit_code,
        };
        128 + signal
    }
}

/// Why a `Start` did not produce an outcome.
#[derive(Debug, Clone)]
pub(super) enum RunError {
    /// envd could not be reached, or the stream broke; `started` = the `start` event had come.
    Unreachable { started: bool, detail: String },
    /// envd refused the access token.
    Auth(String),
    /// envd answered with an error.
    Failed { started: bool, detail: String },
}

/// One sandbox's envd, as seen from here.
pub(super) struct Envd<'a> {
    pub http: &'a reqwest::Client,
    /// Base URL without a trailing slash.
    pub base: String,
    pub sandbox_id: &'a str,
    pub token: Option<&'a str>,
    pub version: EnvdVersion,
}

/// What to run.
pub(super) struct Command<'a> {
    pub argv: &'a [String],
    pub envs: &'a BTreeMap<String, String>,
    pub cwd: Option<&'a str>,
    pub stdin: Option<&'a [u8]>,
    /// Sent as `Connect-Timeout-Ms`: envd ends the call (and the process) after it.
    pub deadline: Duration,
}

type StdinTask<'a> = Pin<Box<dyn Future<Output = Result<(), RunError>> + Send + 'a>>;

impl Envd<'_> {
    fn request(&self, method: &str) -> reqwest::RequestBuilder {
        self.routed(
            self.http
                .post(format!("{}/process.Process/{method}", self.base))
                .header("Connect-Protocol-Version", "1"),
        )
    }

    /// The headers every envd request carries: which sandbox and port the proxy routes it to,
    /// and the sandbox's access token. From envd 0.4.0 on no user is named (no `Authorization`
    /// user, no `username`), so envd acts as the sandbox's default user for commands and files
    /// alike; older envd is told that user in `Authorization: Basic`, as the official SDK does.
    pub(super) fn routed(&self, request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        let mut request = request
            .header("E2b-Sandbox-Id", self.sandbox_id)
            .header("E2b-Sandbox-Port", ENVD_PORT.to_string());
        if let Some(user) = self.version.user_header() {
            request = request.header(reqwest::header::AUTHORIZATION, user);
        }
        match self.token {
            Some(token) => request.header("X-Access-Token", token),
            None => request,
        }
    }

    /// One unary call with a JSON body; Connect errors come back as a non-200 status.
    async fn unary<T: Serialize>(&self, method: &str, body: &T) -> Result<(), RunError> {
        let call = format!("process.Process/{method}");
        let response = self
            .request(method)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .timeout(UNARY_TIMEOUT)
            .json(body)
            .send()
            .await
            .map_err(|e| RunError::Unreachable {
                started: true,
                detail: format!("{call} failed: {}", envd_transport(&e)),
            })?;
        let status = response.status().as_u16();
        if status == 200 {
            return Ok(());
        }
        let text = bounded_text(response).await;
        let error: ConnectError = serde_json::from_str(&text).unwrap_or(ConnectError {
            code: String::new(),
            message: text.trim().to_owned(),
        });
        Err(classify_status(status, &call, &error, true))
    }

    /// `SendSignal {process: {pid}, signal: SIGNAL_SIGKILL}`.
    pub(super) async fn kill(&self, pid: u32) -> Result<(), RunError> {
        self.unary(
            "SendSignal",
            &SendSignalRequest {
                process: Selector { pid },
                signal: "SIGNAL_SIGKILL",
            },
        )
        .await
    }

    async fn send_stdin(&self, pid: u32, data: &[u8]) -> Result<(), RunError> {
        for piece in data.chunks(STDIN_CHUNK) {
            self.unary(
                "SendInput",
                &SendInputRequest {
                    process: Selector { pid },
                    input: ProcessInput {
                        stdin: BASE64.encode(piece),
                    },
                },
            )
            .await?;
        }
        self.unary(
            "CloseStdin",
            &CloseStdinRequest {
                process: Selector { pid },
            },
        )
        .await
    }

    /// Runs `command`, pushing output into `sink`. `on_pid` learns the pid as soon as envd
    /// names it (the caller needs it to signal the process later).
    pub(super) async fn run(
        &self,
        command: &Command<'_>,
        sink: &mut dyn OutputSink,
        cancel: &CancellationToken,
        on_pid: &mut (dyn FnMut(u32) + Send),
    ) -> Result<ExecEnd, RunError> {
        let Some((cmd, args)) = command.argv.split_first() else {
            return Err(RunError::Failed {
                started: false,
                detail: "empty command".to_owned(),
            });
        };
        if command.stdin.is_some()
            && let Some(detail) = self.version.stdin_refusal()
        {
            return Err(RunError::Failed {
                started: false,
                detail,
            });
        }
        let body = StartRequest {
            process: ProcessConfig {
                cmd,
                args,
                envs: command.envs,
                cwd: command.cwd,
            },
            stdin: (self.version >= EnvdVersion::STDIN).then_some(command.stdin.is_some()),
        };
        let json = serde_json::to_vec(&body).map_err(|e| RunError::Failed {
            started: false,
            detail: e.to_string(),
        })?;
        let sent = self
            .request("Start")
            .header(reqwest::header::CONTENT_TYPE, "application/connect+json")
            .header(
                "Connect-Timeout-Ms",
                command.deadline.as_millis().to_string(),
            )
            .header("Keepalive-Ping-Interval", KEEPALIVE_SECS)
            .body(envelope(&json))
            .send();
        let response = tokio::select! {
            sent = sent => sent,
            () = cancel.cancelled() => return Ok(ExecEnd::StoppedBySink),
        };
        let mut response = response.map_err(|e| RunError::Unreachable {
            started: false,
            detail: format!("process.Process/Start failed: {}", envd_transport(&e)),
        })?;
        let status = response.status().as_u16();
        if status != 200 {
            let text = bounded_text(response).await;
            let error: ConnectError = serde_json::from_str(&text).unwrap_or(ConnectError {
                code: String::new(),
                message: text.trim().chars().take(300).collect(),
            });
            return Err(classify_status(
                status,
                "process.Process/Start",
                &error,
                false,
            ));
        }

        let mut decoder = Decoder::default();
        let mut pid: Option<u32> = None;
        let mut end: Option<EndEvent> = None;
        let mut stdin_task: Option<StdinTask<'_>> = None;
        loop {
            let chunk = tokio::select! {
                result = async {
                    match stdin_task.as_mut() {
                        Some(task) => task.await,
                        None => std::future::pending().await,
                    }
                } => {
                    stdin_task = None;
                    result?;
                    continue;
                }
                chunk = response.chunk() => chunk,
                () = cancel.cancelled() => return Ok(ExecEnd::StoppedBySink),
            };
            let chunk = match chunk {
                Ok(Some(chunk)) => chunk,
                Ok(None) => {
                    let detail = match decoder.pending() {
                        0 => "the output stream ended without an end-of-stream message".to_owned(),
                        n => format!("the output stream ended inside a message ({n} bytes left)"),
                    };
                    return Err(RunError::Unreachable {
                        started: pid.is_some(),
                        detail,
                    });
                }
                Err(e) => {
                    return Err(RunError::Unreachable {
                        started: pid.is_some(),
                        detail: format!("the output stream broke: {}", envd_transport(&e)),
                    });
                }
            };
            decoder.feed(&chunk);
            loop {
                let frame = decoder.next_frame().map_err(|e| RunError::Failed {
                    started: pid.is_some(),
                    detail: e.to_string(),
                })?;
                let Some(frame) = frame else { break };
                match frame {
                    Frame::Message(bytes) => {
                        let message: StartResponse =
                            serde_json::from_slice(&bytes).map_err(|e| RunError::Failed {
                                started: pid.is_some(),
                                detail: format!("unreadable process event ({e})"),
                            })?;
                        let Some(event) = message.event else { continue };
                        if let Some(start) = event.start {
                            pid = Some(start.pid);
                            on_pid(start.pid);
                            if let Some(data) = command.stdin {
                                stdin_task = Some(Box::pin(self.send_stdin(start.pid, data)));
                            }
                        }
                        if let Some(data) = event.data {
                            for (stream, text) in [
                                (Stream::Stdout, data.stdout),
                                (Stream::Stderr, data.stderr),
                                (Stream::Stdout, data.pty),
                            ] {
                                let Some(text) = text else { continue };
                                let bytes = BASE64.decode(text.as_bytes()).map_err(|e| {
                                    RunError::Failed {
                                        started: true,
                                        detail: format!("output is not base64 ({e})"),
                                    }
                                })?;
                                if sink.push(stream, &bytes) == SinkControl::Stop {
                                    return Ok(ExecEnd::StoppedBySink);
                                }
                            }
                        }
                        if let Some(ended) = event.end {
                            end = Some(ended);
                        }
                        let _ = event.keepalive;
                    }
                    Frame::End(error) => {
                        return match (error, end) {
                            (None, Some(end)) => Ok(ExecEnd::Exited(end.code())),
                            (None, None) => Err(RunError::Failed {
                                started: pid.is_some(),
                                detail: "the stream ended without an end event".to_owned(),
                            }),
                            (Some(error), Some(end)) if pid.is_some() && error.code.is_empty() => {
                                Ok(ExecEnd::Exited(end.code()))
                            }
                            // envd could not start the program (missing executable or
                            // working directory): a normal result, as a shell would give it.
                            (Some(error), None)
                                if pid.is_none() && CANNOT_START.contains(&error.code.as_str()) =>
                            {
                                let text = format!("{}\n", error.message);
                                let _ = sink.push(Stream::Stderr, text.as_bytes());
                                Ok(ExecEnd::Exited(CANNOT_START_CODE))
                            }
                            (Some(error), _) => Err(classify_connect(&error, pid.is_some())),
                        };
                    }
                }
            }
        }
    }
}

/// Maps a Connect error code.
fn classify_connect(error: &ConnectError, started: bool) -> RunError {
    match error.code.as_str() {
        "unauthenticated" | "permission_denied" => {
            RunError::Auth(format!("envd refused the access token ({error})"))
        }
        "unavailable" => RunError::Unreachable {
            started,
            detail: format!("envd is unavailable ({error})"),
        },
        _ => RunError::Failed {
            started,
            detail: error.to_string(),
        },
    }
}

/// Maps a non-200 HTTP answer: 401/403 are the token; 502-504 and a plain 404 come from the
/// sandbox proxy (no such sandbox, or not running); anything else is envd's own error.
fn classify_status(status: u16, call: &str, error: &ConnectError, started: bool) -> RunError {
    match status {
        401 | 403 => RunError::Auth(format!("{call} was refused (HTTP {status}): {error}")),
        502..=504 => RunError::Unreachable {
            started,
            detail: format!("{call} returned HTTP {status}: {error}"),
        },
        404 if error.code.is_empty() => RunError::Unreachable {
            started,
            detail: format!("{call} returned HTTP {status}: {error}"),
        },
        _ => RunError::Failed {
            started,
            detail: format!("{call} returned HTTP {status}: {error}"),
        },
    }
}

/// A failed envd connection in a few words.
pub(super) fn envd_transport(error: &reqwest::Error) -> String {
    kilntainers_backend::rest::describe_transport(error, "envd")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn omitted_exit_code_means_zero_and_signals_become_128_plus() {
        let end: EndEvent =
            serde_json::from_str(r#"{"exited":true,"status":"exit status 0"}"#).unwrap();
        assert_eq!(end.code(), 0);
        let end: EndEvent = serde_json::from_str("{}").unwrap();
        assert_eq!(end.code(), 0);
        let end: EndEvent =
            serde_json::from_str(r#"{"exitCode":3,"exited":true,"status":"exit status 3"}"#)
                .unwrap();
        assert_eq!(end.code(), 3);
        let end: EndEvent =
            serde_json::from_str(r#"{"exitCode":-1,"status":"signal: killed"}"#).unwrap();
        assert_eq!(end.code(), 137);
        let end: EndEvent =
            serde_json::from_str(r#"{"exitCode":-1,"status":"signal: odd"}"#).unwrap();
        assert_eq!(end.code(), -1);
    }

    #[test]
    fn issue_32_envd_versions_decide_user_stdin_and_close_stdin() {
        // See: issue 32 (item 5)
        assert_eq!(EnvdVersion::parse(Some("0.2.0")), EnvdVersion(0, 2, 0));
        assert_eq!(
            EnvdVersion::parse(Some("v0.5.2-beta")),
            EnvdVersion(0, 5, 2)
        );
        assert_eq!(EnvdVersion::parse(Some("0.4")), EnvdVersion(0, 4, 0));
        assert_eq!(EnvdVersion::parse(None), EnvdVersion::CURRENT);
        assert_eq!(EnvdVersion::parse(Some("garbage")), EnvdVersion::CURRENT);
        // "user:" in base64, below 0.4.0 only.
        assert_eq!(
            EnvdVersion(0, 3, 9).user_header().as_deref(),
            Some("Basic dXNlcjo=")
        );
        assert_eq!(EnvdVersion(0, 4, 0).user_header(), None);
        assert!(EnvdVersion(0, 5, 1).stdin_refusal().is_some());
        assert_eq!(EnvdVersion(0, 5, 2).stdin_refusal(), None);
        assert_eq!(EnvdVersion::CURRENT.stdin_refusal(), None);
    }

    #[test]
    fn request_shapes_follow_the_proto_names() {
        let envs = BTreeMap::from([("KILNTAINERS_EXEC_ID".to_owned(), "x".to_owned())]);
        let args = vec!["-c".to_owned(), "echo hi".to_owned()];
        let body = serde_json::to_value(StartRequest {
            process: ProcessConfig {
                cmd: "/bin/sh",
                args: &args,
                envs: &envs,
                cwd: None,
            },
            stdin: Some(false),
        })
        .unwrap();
        assert_eq!(
            body,
            serde_json::json!({"process": {"cmd": "/bin/sh", "args": ["-c", "echo hi"],
                "envs": {"KILNTAINERS_EXEC_ID": "x"}}, "stdin": false})
        );
        let input = serde_json::to_value(SendInputRequest {
            process: Selector { pid: 7 },
            input: ProcessInput {
                stdin: BASE64.encode(b"hi"),
            },
        })
        .unwrap();
        assert_eq!(
            input,
            serde_json::json!({"process": {"pid": 7}, "input": {"stdin": "aGk="}})
        );
        let signal = serde_json::to_value(SendSignalRequest {
            process: Selector { pid: 7 },
            signal: "SIGNAL_SIGKILL",
        })
        .unwrap();
        assert_eq!(
            signal,
            serde_json::json!({"process": {"pid": 7}, "signal": "SIGNAL_SIGKILL"})
        );
    }
}
