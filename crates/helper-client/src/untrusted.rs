//! Text that comes from inside a computer on its way into the server's log: a root user there
//! can replace the helper or write to its stderr through `/proc/<pid>/fd/2`, so every byte is
//! hostile. [`printable`] caps and escapes one piece (no raw newline can forge a log line, no
//! terminal escape reaches whoever reads the log), and [`StderrLog`] turns the helper's stderr
//! into a few log lines per second with a byte budget, past which the helper counts as broken.

use std::time::{Duration, Instant};

use tracing::warn;

/// Longest piece of one helper stderr line that reaches the log. The real helper's messages
/// are one short sentence; anything longer is cut, with its size said.
const LINE_KEPT: usize = 256;
/// Helper stderr lines logged per [`RATE_WINDOW`]; the rest are counted and summarised in one
/// line. The real helper writes a line only when something went badly wrong.
const LINES_PER_WINDOW: u32 = 5;
/// The rate limit's window.
const RATE_WINDOW: Duration = Duration::from_secs(1);
/// Bytes of stderr one helper connection may write in its whole life. The real helper writes
/// a few hundred bytes at most (fatal errors only); more is an attack on the host's disk and
/// CPU, so the connection is dropped rather than read on.
const STDERR_BUDGET: usize = 256 * 1024;

/// `bytes` as one log-safe line: at most `kept` bytes, invalid UTF-8 replaced, control
/// characters escaped (`\n`, `\u{1b}`), and the full size said when it was cut.
pub fn printable(bytes: &[u8], kept: usize) -> String {
    let head = &bytes[..bytes.len().min(kept)];
    let mut out = String::with_capacity(head.len() + 16);
    for c in String::from_utf8_lossy(head).chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    if bytes.len() > kept {
        out.push_str(&format!("… ({} bytes in all)", bytes.len()));
    }
    out
}

/// One helper connection's stderr, turned into rate-limited log lines.
pub(super) struct StderrLog {
    sandbox: String,
    spent: usize,
    window_start: Instant,
    logged_in_window: u32,
    suppressed: u64,
}

impl StderrLog {
    pub(super) fn new(sandbox: &str) -> Self {
        Self {
            sandbox: sandbox.to_owned(),
            spent: 0,
            window_start: Instant::now(),
            logged_in_window: 0,
            suppressed: 0,
        }
    }

    /// Logs what the helper wrote; `Err(reason)` once it has written more than its budget.
    pub(super) fn write(&mut self, message: &[u8]) -> Result<(), String> {
        self.spent = self.spent.saturating_add(message.len());
        if self.spent > STDERR_BUDGET {
            return Err(format!(
                "the helper wrote more than {} KiB to its stderr",
                STDERR_BUDGET / 1024
            ));
        }
        for line in message.split(|b| *b == b'\n') {
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            self.line(line);
        }
        Ok(())
    }

    fn line(&mut self, line: &[u8]) {
        let now = Instant::now();
        if now.duration_since(self.window_start) >= RATE_WINDOW {
            self.flush();
            self.window_start = now;
            self.logged_in_window = 0;
        }
        if self.logged_in_window < LINES_PER_WINDOW {
            self.logged_in_window += 1;
            warn!(sandbox = %self.sandbox, "exec helper: {}", printable(line, LINE_KEPT));
        } else {
            self.suppressed += 1;
        }
    }

    /// Says how many lines were left out since the last time.
    pub(super) fn flush(&mut self) {
        if self.suppressed > 0 {
            warn!(
                sandbox = %self.sandbox,
                "exec helper: {} more stderr lines suppressed",
                self.suppressed
            );
            self.suppressed = 0;
        }
    }
}

impl Drop for StderrLog {
    fn drop(&mut self) {
        self.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn printable_escapes_controls_and_cuts_long_text() {
        assert_eq!(printable(b"a\nb\x1b[31m", 100), "a\\nb\\u{1b}[31m");
        let long = vec![b'x'; 5000];
        let text = printable(&long, 10);
        assert_eq!(text, "xxxxxxxxxx… (5000 bytes in all)");
        assert!(!printable(b"\xff\r\n", 10).contains(['\r', '\n']));
    }

    #[test]
    fn stderr_past_its_budget_breaks_the_helper() {
        let mut log = StderrLog::new("c");
        let line = vec![b'y'; 1023];
        let mut written = 0;
        let verdict = loop {
            let mut message = line.clone();
            message.push(b'\n');
            written += message.len();
            if let Err(reason) = log.write(&message) {
                break reason;
            }
            assert!(written <= STDERR_BUDGET, "{written} bytes accepted");
        };
        assert!(verdict.contains("stderr"), "{verdict}");
        assert!(written > STDERR_BUDGET);
        // Only a handful of lines were logged; the rest were counted.
        assert_eq!(log.logged_in_window, LINES_PER_WINDOW);
        assert!(log.suppressed > 100, "{}", log.suppressed);
    }
}
