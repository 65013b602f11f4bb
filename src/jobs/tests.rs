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
    let listed = listing(text.as_bytes(), 10);
    assert!(!listed.truncated);
    let jobs = listed.jobs;
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

// See: issue 30 (item 2)
#[test]
fn issue_30_a_listing_flood_is_read_only_to_the_row_limit() {
    let row = |n: u32| format!("J j-{n:08x}\n{{}}\nrunning\n0\n");
    let flood: String = (0..100_000).map(row).collect();
    let listed = listing(flood.as_bytes(), 64);
    assert_eq!(listed.jobs.len(), 64);
    assert!(listed.truncated);
    // Each id once, and a claimed total above what came is a cut listing too.
    let twice = format!("{}{}T 1\n", row(1), row(1));
    let listed = listing(twice.as_bytes(), 64);
    assert_eq!((listed.jobs.len(), listed.truncated), (1, false));
    let claimed = format!("{}T 5\n", row(1));
    assert!(listing(claimed.as_bytes(), 64).truncated);
    assert_eq!(list_rows(1), 64);
    assert_eq!(list_rows(100), 100);
    assert_eq!(list_rows(u32::MAX), 128);
}

fn job_service() -> Arc<Jobs> {
    Jobs::new(
        crate::backends::fake::FakeBackend::new(),
        "/bin/sh".to_owned(),
        JobSettings {
            max_jobs: 16,
            default_timeout_secs: 0,
            log_limit: 1 << 20,
            output_limit: 1 << 20,
        },
    )
}

// See: issue 30 (item 2)
#[test]
fn issue_30_the_job_index_is_keyed_by_computer_bounded_and_dropped_with_it() {
    let jobs = job_service();
    let (a, b) = (
        ComputerId::parse("a").unwrap(),
        ComputerId::parse("b").unwrap(),
    );
    let job = JobId::parse("j-0000000a").unwrap();
    jobs.remember(&b, &job);
    // Another computer holding (or claiming) the same id does not replace the first.
    jobs.remember(&a, &job);
    let mut holders = jobs.computers_of(&job);
    holders.sort();
    assert_eq!(holders, [a.clone(), b.clone()]);
    jobs.set_cursor(7, &a, &job, 5);
    jobs.set_cursor(7, &b, &job, 9);
    assert_eq!((jobs.cursor(7, &a, &job), jobs.cursor(7, &b, &job)), (5, 9));
    // Bounded per computer: the oldest is forgotten first.
    for n in 0..KNOWN_JOBS_PER_COMPUTER as u32 + 10 {
        jobs.remember(&a, &JobId::parse(&format!("j-1{n:07x}")).unwrap());
    }
    assert_eq!(jobs.computers_of(&job), std::slice::from_ref(&b));
    assert_eq!(lock(&jobs.index)[&a].len(), KNOWN_JOBS_PER_COMPUTER);
    // Removing a computer forgets its jobs and every place in them.
    jobs.forget_computer(&a);
    assert!(!lock(&jobs.index).contains_key(&a));
    assert_eq!((jobs.cursor(7, &a, &job), jobs.cursor(7, &b, &job)), (0, 9));
    jobs.forget_computer(&b);
    assert!(lock(&jobs.index).is_empty() && lock(&jobs.cursors).is_empty());
}
