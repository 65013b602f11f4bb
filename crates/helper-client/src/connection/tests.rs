//! Unit tests of `connection`.

//! Fake helpers on fake attached streams: what a root user in a computer can put in the
//! helper's place (see: issue 15).

use std::sync::Arc;

use futures_util::stream;

use super::*;
use kilntainers_backend::ids::ExecId;

fn stdout(bytes: Vec<u8>) -> Result<Chunk, String> {
    Ok(Chunk::Stdout(bytes.into()))
}

fn hello() -> Vec<u8> {
    let mut frame = Vec::new();
    Event::Hello {
        version: wire::PROTOCOL_VERSION,
        pid: 7,
    }
    .encode(&mut frame);
    frame
}

fn output_frame(id: u32, len: usize) -> Vec<u8> {
    let mut frame = Vec::new();
    Event::Output {
        id,
        stream: OutputStream::Stdout,
        data: vec![b'o'; len],
    }
    .encode(&mut frame);
    frame
}

fn spec() -> ExecSpec {
    ExecSpec {
        argv: vec!["true".into()],
        stdin: None,
        working_dir: None,
        exec_id: ExecId::random(),
        command: None,
    }
}

/// Counts output and stops after `stop_after` bytes, like the exec layer's limit.
struct Counting {
    bytes: usize,
    stop_after: usize,
}

impl OutputSink for Counting {
    fn push(&mut self, _: Stream, bytes: &[u8]) -> SinkControl {
        self.bytes += bytes.len();
        if self.bytes >= self.stop_after {
            SinkControl::Stop
        } else {
            SinkControl::Continue
        }
    }
}

async fn connect(output: Output) -> Result<Arc<Connection>, ConnectError> {
    let input = Box::pin(tokio::io::sink());
    Connection::over(Attached { output, input }, "c").await
}

fn broken_reason(result: Result<Arc<Connection>, ConnectError>) -> String {
    match result {
        Err(ConnectError::Unusable {
            reason,
            broken: true,
            ..
        }) => reason,
        Err(other) => panic!("not judged broken: {other:?}"),
        Ok(_) => panic!("connected to a fake helper"),
    }
}

async fn wait_broken(connection: &Connection) -> String {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(reason) = connection.broken() {
            return reason;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never judged broken"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn issue_15_a_fake_that_prints_100_mb_before_hello_is_broken_and_little_is_kept() {
    // See: issue 15. Lines with raw newlines, as a forged log would need.
    let piece = b"2026-01-01T00:00:00Z ERROR forged line\n".repeat(400);
    let pieces = 100 * 1024 * 1024 / piece.len();
    let read = Arc::new(AtomicU32::new(0));
    let counter = read.clone();
    let flood = stream::iter(std::iter::repeat_n(piece, pieces)).map(move |p| {
        counter.fetch_add(1, Ordering::Relaxed);
        stdout(p)
    });
    let reason = broken_reason(connect(Box::pin(flood)).await);
    assert!(
        reason.len() < 2 * HANDSHAKE_KEPT,
        "{} bytes kept",
        reason.len()
    );
    assert!(!reason.contains('\n'), "raw newline in {reason:?}");
    assert!(reason.contains("instead of answering"), "{reason}");
    // Reading stopped at the bound, far before the 100 MB.
    let pieces_read = read.load(Ordering::Relaxed) as usize;
    assert!(
        pieces_read * 16_000 < 4 * HANDSHAKE_LIMIT,
        "{pieces_read} pieces read"
    );
}

#[tokio::test]
async fn issue_15_a_fake_that_never_answers_is_broken_within_the_hello_timeout() {
    // See: issue 15 (`exec sleep 600` in the helper's place).
    let started = tokio::time::Instant::now();
    let reason = broken_reason(connect(Box::pin(stream::pending::<Result<Chunk, String>>())).await);
    assert!(reason.contains("did not answer"), "{reason}");
    assert!(started.elapsed() < HELLO_TIMEOUT + Duration::from_secs(2));
}

#[tokio::test]
async fn issue_15_an_event_frame_longer_than_a_chunk_breaks_the_connection() {
    // See: issue 15. The header alone decides; the 8 MiB never need to arrive.
    let mut bytes = hello();
    bytes.extend_from_slice(&(wire::MAX_PAYLOAD as u32).to_be_bytes());
    let output = stream::iter(vec![stdout(bytes)]).chain(stream::pending());
    let connection = connect(Box::pin(output)).await.unwrap();
    let reason = wait_broken(&connection).await;
    assert!(reason.contains("out of range"), "{reason}");
}

#[tokio::test]
async fn issue_15_hello_then_a_flood_of_frames_breaks_the_connection() {
    // See: issue 15. Output nobody asked for (no command yet) and unasked answers.
    for flood in [output_frame(1, 10), {
        let mut pong = Vec::new();
        Event::Pong { id: 0 }.encode(&mut pong);
        pong
    }] {
        let output = stream::iter(vec![stdout(hello())])
            .chain(stream::repeat_with(move || stdout(flood.repeat(100))));
        let connection = connect(Box::pin(output)).await.unwrap();
        let reason = wait_broken(&connection).await;
        assert!(
            reason.contains("unknown command") || reason.contains("unasked"),
            "{reason}"
        );
    }
}

#[tokio::test]
async fn issue_15_output_beyond_the_granted_credit_breaks_the_connection() {
    // See: issue 15. The fake floods command 1 regardless of credit; the server stops
    // consuming (its output limit) and so stops granting, and the overrun is caught.
    let output = stream::iter(vec![stdout(hello())])
        .chain(stream::repeat_with(|| stdout(output_frame(1, wire::CHUNK))));
    let connection = connect(Box::pin(output)).await.unwrap();
    let mut sink = Counting {
        bytes: 0,
        stop_after: 3 * wire::WINDOW as usize,
    };
    let cancel = CancellationToken::new();
    let end = connection.run(&spec(), &[], &mut sink, &cancel).await;
    let reason = match end {
        Ok(ExecEnd::StoppedBySink) => wait_broken(&connection).await,
        Err(Lost(reason)) => reason,
        Ok(other) => panic!("{other:?}"),
    };
    assert!(reason.contains("credit"), "{reason}");
    let routes = connection.routes();
    assert!(routes.received <= routes.granted + wire::MAX_EVENT_PAYLOAD as u64);
}

#[tokio::test]
async fn issue_15_a_helper_that_stops_reading_its_input_is_broken_after_the_stall_timeout() {
    // See: issue 15. Room for the Hello, then nothing is ever read.
    let (input, _never_read) = tokio::io::duplex(64);
    let output = stream::iter(vec![stdout(hello())]).chain(stream::pending());
    let attached = Attached {
        output: Box::pin(output),
        input: Box::pin(input),
    };
    let connection = Connection::over(attached, "c").await.unwrap();
    let mut spec = spec();
    spec.stdin = Some(vec![b'i'; 2 * 1024 * 1024]);
    let mut sink = Counting {
        bytes: 0,
        stop_after: usize::MAX,
    };
    let started = tokio::time::Instant::now();
    let end = connection
        .run(&spec, &[], &mut sink, &CancellationToken::new())
        .await;
    assert!(matches!(end, Err(Lost(_))), "{end:?}");
    assert!(started.elapsed() < STALL_TIMEOUT + Duration::from_secs(3));
    assert!(wait_broken(&connection).await.contains("stopped reading"));
}
