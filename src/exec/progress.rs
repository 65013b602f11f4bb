//! Liveness of a running command for `notifications/progress` (docs/jobs.md, "Progress of
//! foreground calls"): the last complete line of its output, kept as it streams, reported
//! once a second with the seconds elapsed. Hosts that reset their timeout on progress keep
//! the call alive, and a person sees what the command is doing.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::backends::{OutputSink, Progress, SinkControl, Stream};

/// How often progress is reported.
pub const EVERY: Duration = Duration::from_secs(1);

/// The longest line reported, in characters.
const MAX_LINE_CHARS: usize = 200;

/// A partial line is kept only up to this many bytes: a command printing one endless line
/// costs no more than this.
const MAX_PARTIAL_BYTES: usize = 4096;

/// The last complete output line, shared between the sink and the reporter.
#[derive(Default, Clone)]
pub struct LastLine(Arc<Mutex<String>>);

impl LastLine {
    fn set(&self, line: &[u8]) {
        let text: String = String::from_utf8_lossy(line)
            .trim_end_matches('\r')
            .chars()
            .take(MAX_LINE_CHARS)
            .collect();
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = text;
    }

    pub fn report(&self, progress: &dyn Progress, elapsed: Duration) {
        let line = self.0.lock().unwrap_or_else(|p| p.into_inner()).clone();
        progress.report(elapsed.as_secs() as f64, None, line);
    }
}

/// Passes output on to `inner` and notes each complete line.
pub struct LineTap<'a> {
    inner: &'a mut dyn OutputSink,
    last: &'a LastLine,
    partial: [Vec<u8>; 2],
}

impl<'a> LineTap<'a> {
    pub fn new(inner: &'a mut dyn OutputSink, last: &'a LastLine) -> Self {
        Self {
            inner,
            last,
            partial: [Vec::new(), Vec::new()],
        }
    }
}

impl OutputSink for LineTap<'_> {
    fn push(&mut self, stream: Stream, bytes: &[u8]) -> SinkControl {
        let partial = &mut self.partial[usize::from(stream == Stream::Stderr)];
        let mut rest = bytes;
        while let Some(end) = rest.iter().position(|&b| b == b'\n') {
            partial.extend_from_slice(&rest[..end]);
            if !partial.is_empty() {
                self.last.set(partial);
            }
            partial.clear();
            rest = &rest[end + 1..];
        }
        let room = MAX_PARTIAL_BYTES.saturating_sub(partial.len());
        partial.extend_from_slice(&rest[..rest.len().min(room)]);
        self.inner.push(stream, bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exec::limits::LimitedSink;

    #[test]
    fn the_last_complete_line_of_either_stream_is_kept_and_cut() {
        let last = LastLine::default();
        let mut sink = LimitedSink::new(1 << 20);
        let mut tap = LineTap::new(&mut sink, &last);
        tap.push(Stream::Stdout, b"first\nsec");
        assert_eq!(*last.0.lock().unwrap(), "first");
        tap.push(Stream::Stderr, b"warn\n");
        assert_eq!(*last.0.lock().unwrap(), "warn");
        tap.push(Stream::Stdout, b"ond\r\n\n");
        assert_eq!(*last.0.lock().unwrap(), "second");
        tap.push(Stream::Stdout, format!("{}\n", "x".repeat(300)).as_bytes());
        assert_eq!(last.0.lock().unwrap().chars().count(), 200);
        drop(tap);
        assert_eq!(
            sink.into_output().0.len(),
            "first\nsecond\r\n\n".len() + 301
        );
    }
}
