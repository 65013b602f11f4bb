//! Bounded output collection: counts stdout+stderr bytes together while they stream and asks
//! the backend to stop once the limit is crossed, so a command that prints forever costs at
//! most limit + one chunk of memory (docs/decisions.md, "Killing a command").

use crate::backends::{OutputSink, SinkControl, Stream};

pub struct LimitedSink {
    limit: u64,
    seen: u64,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
}

impl LimitedSink {
    pub fn new(limit: u64) -> Self {
        Self {
            limit,
            seen: 0,
            stdout: Vec::new(),
            stderr: Vec::new(),
        }
    }

    /// True once more than `limit` bytes arrived (exactly `limit` is still fine).
    pub fn overflowed(&self) -> bool {
        self.seen > self.limit
    }

    pub fn into_output(self) -> (Vec<u8>, Vec<u8>) {
        (self.stdout, self.stderr)
    }
}

impl OutputSink for LimitedSink {
    fn push(&mut self, stream: Stream, bytes: &[u8]) -> SinkControl {
        self.seen = self.seen.saturating_add(bytes.len() as u64);
        if self.overflowed() {
            // Nothing collected will be returned; free it now.
            self.stdout = Vec::new();
            self.stderr = Vec::new();
            return SinkControl::Stop;
        }
        match stream {
            Stream::Stdout => self.stdout.extend_from_slice(bytes),
            Stream::Stderr => self.stderr.extend_from_slice(bytes),
        }
        SinkControl::Continue
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exactly_at_limit_is_kept() {
        let mut sink = LimitedSink::new(4);
        assert_eq!(sink.push(Stream::Stdout, b"ab"), SinkControl::Continue);
        assert_eq!(sink.push(Stream::Stderr, b"cd"), SinkControl::Continue);
        assert!(!sink.overflowed());
        assert_eq!(sink.into_output(), (b"ab".to_vec(), b"cd".to_vec()));
    }

    #[test]
    fn one_byte_over_stops_and_drops() {
        let mut sink = LimitedSink::new(4);
        sink.push(Stream::Stdout, b"abcd");
        assert_eq!(sink.push(Stream::Stderr, b"e"), SinkControl::Stop);
        assert!(sink.overflowed());
        assert_eq!(sink.into_output(), (Vec::new(), Vec::new()));
    }
}
