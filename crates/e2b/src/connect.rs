//! The Connect protocol's streaming framing with the JSON codec, as envd speaks it: every
//! message is an envelope `[flags u8][length u32 big-endian][JSON]`; flag `0x02` marks the
//! end-of-stream envelope, whose JSON is `{error?: {code, message}, metadata?}`. Unary calls
//! are plain `application/json` requests; their errors are a non-200 status with
//! `{code, message}`. Hand-written from the Connect protocol specification.

use serde::Deserialize;

/// End-of-stream flag bit.
const END_STREAM: u8 = 0x02;
/// Compression flag bit; we never ask for compression, so a compressed frame is an error.
const COMPRESSED: u8 = 0x01;
/// Largest envelope accepted. envd sends output in small chunks (tens of KiB); anything this big
/// is a broken stream, and refusing it keeps memory bounded.
pub(super) const MAX_ENVELOPE: usize = 4 * 1024 * 1024;

/// One request envelope around `json`.
pub(super) fn envelope(json: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(json.len() + 5);
    out.push(0);
    out.extend_from_slice(&u32::try_from(json.len()).unwrap_or(u32::MAX).to_be_bytes());
    out.extend_from_slice(json);
    out
}

/// A Connect error (`{code, message}`), from an end-of-stream envelope or a unary answer.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub(super) struct ConnectError {
    #[serde(default)]
    pub code: String,
    #[serde(default)]
    pub message: String,
}

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.code.is_empty(), self.message.is_empty()) {
            (true, _) => write!(f, "{}", self.message),
            (false, true) => write!(f, "{}", self.code),
            (false, false) => write!(f, "{}: {}", self.code, self.message),
        }
    }
}

#[derive(Debug, Deserialize)]
struct EndOfStream {
    #[serde(default)]
    error: Option<ConnectError>,
}

/// A decoded frame.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Frame {
    Message(Vec<u8>),
    /// The stream ended; `Some` when it ended with an error.
    End(Option<ConnectError>),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum FrameError {
    #[error("envelope of {0} bytes exceeds the limit")]
    TooLarge(usize),
    #[error("compressed envelope, but no compression was negotiated")]
    Compressed,
    #[error("unreadable end-of-stream message ({0})")]
    BadEnd(String),
}

/// Incremental decoder: feed it body chunks as they arrive, take frames out.
#[derive(Debug, Default)]
pub(super) struct Decoder {
    buffer: Vec<u8>,
}

impl Decoder {
    pub(super) fn feed(&mut self, chunk: &[u8]) {
        self.buffer.extend_from_slice(chunk);
    }

    /// The next complete frame, if one is buffered.
    pub(super) fn next_frame(&mut self) -> Result<Option<Frame>, FrameError> {
        if self.buffer.len() < 5 {
            return Ok(None);
        }
        let flags = self.buffer[0];
        let length = u32::from_be_bytes([
            self.buffer[1],
            self.buffer[2],
            self.buffer[3],
            self.buffer[4],
        ]) as usize;
        if length > MAX_ENVELOPE {
            return Err(FrameError::TooLarge(length));
        }
        if self.buffer.len() < 5 + length {
            return Ok(None);
        }
        let payload: Vec<u8> = self.buffer[5..5 + length].to_vec();
        self.buffer.drain(..5 + length);
        if flags & COMPRESSED != 0 {
            return Err(FrameError::Compressed);
        }
        if flags & END_STREAM != 0 {
            let end: EndOfStream = if payload.is_empty() {
                EndOfStream { error: None }
            } else {
                serde_json::from_slice(&payload).map_err(|e| FrameError::BadEnd(e.to_string()))?
            };
            return Ok(Some(Frame::End(end.error)));
        }
        Ok(Some(Frame::Message(payload)))
    }

    /// Bytes left that do not form a whole frame (non-zero after the body ended = truncated).
    pub(super) fn pending(&self) -> usize {
        self.buffer.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(flags: u8, json: &str) -> Vec<u8> {
        let mut out = vec![flags];
        out.extend_from_slice(&(json.len() as u32).to_be_bytes());
        out.extend_from_slice(json.as_bytes());
        out
    }

    #[test]
    fn frames_split_across_chunks_are_reassembled() {
        let mut bytes = frame(0, r#"{"a":1}"#);
        bytes.extend(frame(
            2,
            r#"{"error":{"code":"not_found","message":"gone"}}"#,
        ));
        let mut decoder = Decoder::default();
        let mut frames = Vec::new();
        for byte in bytes {
            decoder.feed(&[byte]);
            while let Some(frame) = decoder.next_frame().unwrap() {
                frames.push(frame);
            }
        }
        assert_eq!(
            frames,
            vec![
                Frame::Message(br#"{"a":1}"#.to_vec()),
                Frame::End(Some(ConnectError {
                    code: "not_found".into(),
                    message: "gone".into()
                }))
            ]
        );
        assert_eq!(decoder.pending(), 0);
    }

    #[test]
    fn empty_end_of_stream_and_limits() {
        let mut decoder = Decoder::default();
        decoder.feed(&frame(2, "{}"));
        assert_eq!(decoder.next_frame().unwrap(), Some(Frame::End(None)));
        decoder.feed(&[0, 0xff, 0, 0, 0]);
        assert!(matches!(decoder.next_frame(), Err(FrameError::TooLarge(_))));
        let mut decoder = Decoder::default();
        decoder.feed(&frame(1, "{}"));
        assert_eq!(decoder.next_frame(), Err(FrameError::Compressed));
        assert_eq!(envelope(b"{}"), frame(0, "{}"));
    }
}
