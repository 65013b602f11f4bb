//! Unit tests of the job service: what the scripts answer is parsed and distrusted as it
//! should be. The scripts themselves run for real in the backend contract suite and the
//! black-box tests.

use super::parse::{listing, snapshot};
use super::*;

fn answer(state: &str, stdin: &str, plan: &str, stdout: &str) -> Vec<u8> {
    format!("{state}\n{stdin}\n{plan}\n{{\"started_ms\":1000}}\n{stdout}").into_bytes()
}

#[test]
fn a_running_read_returns_both_streams_and_the_next_offset() {
    let got = snapshot(
        &answer("running", "1", "0 0 4 3 7", "out\n"),
        b"er\n".to_vec(),
        0,
        5000,
    )
    .unwrap();
    assert!(got.running && got.stdin_open && !got.more);
    assert_eq!(
        (got.stdout.as_slice(), got.stderr.as_slice()),
        (&b"out\n"[..], &b"er\n"[..])
    );
    assert_eq!(
        (got.next_since, got.exit_code, got.elapsed_ms),
        (7, None, 4000)
    );
}

#[test]
fn an_ended_read_carries_the_code_and_the_end_time() {
    let got = snapshot(
        &answer("ended 3 2026-12-03T10:00:00Z 7", "0", "5 0 2 0 10", "ab"),
        Vec::new(),
        5,
        99_000,
    )
    .unwrap();
    assert_eq!((got.running, got.exit_code), (false, Some(3)));
    assert_eq!((got.next_since, got.more, got.elapsed_ms), (7, true, 6000));
    let restarted = snapshot(
        &answer("ended - 2026-12-03T10:00:00Z 7", "0", "0 0 0 0 0", ""),
        Vec::new(),
        0,
        0,
    )
    .unwrap();
    assert_eq!((restarted.running, restarted.exit_code), (false, None));
}

#[test]
fn a_character_cut_by_the_cap_waits_for_the_next_read() {
    // "é" is two bytes; the cap let only its first through.
    let mut stdout = answer("running", "0", "0 0 3 0 4", "ab");
    stdout.push(0xC3);
    let got = snapshot(&stdout, Vec::new(), 0, 0).unwrap();
    assert_eq!(got.stdout, b"ab");
    assert_eq!((got.next_since, got.more), (2, true));
}

#[test]
fn hostile_answers_are_not_trusted() {
    assert_eq!(snapshot(b"missing\n", Vec::new(), 0, 0), None);
    assert_eq!(snapshot(b"running\n1\n", Vec::new(), 0, 0), None);
    // More bytes than the plan announced are cut to the plan.
    let got = snapshot(
        &answer("running", "0", "0 0 2 1 3", "abcdef"),
        b"xyz".to_vec(),
        0,
        0,
    )
    .unwrap();
    assert_eq!(
        (got.stdout.as_slice(), got.stderr.as_slice()),
        (&b"ab"[..], &b"x"[..])
    );
}

#[test]
fn listings_parse_and_skip_garbage() {
    let text = "J j-0000000a\n{\"command\":\"sleep 9\",\"started_at\":\"2026-12-03T10:00:00Z\",\"started_ms\":5}\nrunning\n12\n\
                J ../etc\nnoise\n\
                J j-0000000b\nnot json\n0 2026-12-03T10:01:00Z 60\n0\n";
    let jobs = listing(text.as_bytes());
    assert_eq!(jobs.len(), 2);
    assert_eq!(jobs[0].job_id.as_str(), "j-0000000a");
    assert_eq!((jobs[0].running, jobs[0].output_bytes), (true, 12));
    assert_eq!(jobs[0].command, "sleep 9");
    assert_eq!(
        (
            jobs[1].running,
            jobs[1].exit_code,
            jobs[1].ended_at.as_deref()
        ),
        (false, Some(0), Some("2026-12-03T10:01:00Z"))
    );
}

#[test]
fn argv_jobs_are_quoted_for_the_shell() {
    assert_eq!(
        shell_words(&["echo".into(), "it's".into(), "a b".into()]),
        r"'echo' 'it'\''s' 'a b'"
    );
    assert_eq!(command_preview(&"x".repeat(300)).len(), 200);
    assert_eq!(Signal::parse("sigkill"), Some(Signal::Kill));
    assert_eq!(Signal::parse("STOP"), None);
}
