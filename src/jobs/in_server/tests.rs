//! Unit tests of `in_server`.

use super::*;

const MIB: usize = 1024 * 1024;

fn job(computer: &str, n: u32) -> Arc<Job> {
    Arc::new(Job {
        id: JobId::parse(&format!("j-{n:08x}")).unwrap(),
        computer: ComputerId::parse(computer).unwrap(),
        command: String::new(),
        started_ms: u64::from(n),
        log_limit: 64 * MIB as u64,
        output: Mutex::default(),
        changed: Notify::new(),
        stop: CancellationToken::new(),
    })
}

/// A job of `computer` that printed `mib` MiB and ended.
fn ended(store: &mut Store, computer: &str, n: u32, mib: usize) -> Arc<Job> {
    let job = job(computer, n);
    store.add(job.clone(), 64);
    store.keep(&job, Stream::Stdout, &vec![b'x'; mib * MIB]);
    store.finish(&job, Some(0), None);
    job
}

fn kept(store: &Store, computer: &str) -> Vec<u32> {
    let computer = ComputerId::parse(computer).unwrap();
    store
        .computers
        .get(&computer)
        .map_or_else(Vec::new, |kept| {
            kept.jobs
                .iter()
                .map(|entry| u32::from_str_radix(&entry.job.id.as_str()[2..], 16).unwrap())
                .collect()
        })
}

fn charged_sum(store: &Store) -> u64 {
    store
        .computers
        .values()
        .flat_map(|kept| kept.jobs.iter().map(|entry| entry.charged))
        .sum()
}

#[test]
fn a_computer_over_its_budget_gives_up_its_own_oldest_ended_jobs() {
    let mut store = Store::default();
    for n in 0..4 {
        ended(&mut store, "a", n, 5);
    }
    ended(&mut store, "b", 9, 1);
    // 4 x 5 MiB does not fit in 16 MiB: the first job went to make room for the fourth.
    assert_eq!(kept(&store, "a"), [1, 2, 3]);
    assert_eq!(kept(&store, "b"), [9]);
    assert!(
        store
            .computers
            .values()
            .all(|kept| kept.bytes <= KEPT_BYTES_PER_COMPUTER)
    );
    assert_eq!(store.bytes, charged_sum(&store));
}

#[test]
fn the_server_over_its_budget_takes_from_the_computer_keeping_most() {
    let mut store = Store::default();
    // a keeps 15 MiB, b, c and d 14 MiB each: 57 MiB.
    ended(&mut store, "a", 0, 8);
    ended(&mut store, "a", 1, 7);
    for (n, computer) in [(10, "b"), (20, "c"), (30, "d")] {
        ended(&mut store, computer, n, 7);
        ended(&mut store, computer, n + 1, 7);
    }
    // 15 MiB more from e: a, the largest, gives up its oldest job first; that is not
    // enough, and then b, c and d are the largest at 14 MiB: one of them gives up 7 MiB.
    ended(&mut store, "e", 40, 15);
    assert_eq!(kept(&store, "a"), [1]);
    assert_eq!(kept(&store, "e"), [40]);
    let others: usize = ["b", "c", "d"].iter().map(|c| kept(&store, c).len()).sum();
    assert_eq!(others, 5);
    assert!(store.bytes <= KEPT_BYTES_TOTAL);
    assert_eq!(store.bytes, charged_sum(&store));
}

#[test]
fn a_running_job_is_never_evicted_and_what_does_not_fit_is_counted() {
    let mut store = Store::default();
    let running = job("a", 1);
    store.add(running.clone(), 64);
    store.keep(&running, Stream::Stdout, &vec![b'x'; 10 * MIB]);
    let other = job("a", 2);
    store.add(other.clone(), 64);
    store.keep(&other, Stream::Stderr, &vec![b'y'; 10 * MIB]);
    assert_eq!(kept(&store, "a"), [1, 2]);
    let output = lock(&other.output);
    let fits = KEPT_BYTES_PER_COMPUTER - 10 * MIB as u64 - 2 * ORDER_ENTRY_BYTES;
    assert_eq!(output.stderr.len() as u64, fits);
    assert_eq!(output.over_budget, [0, 10 * MIB as u64 - fits]);
    drop(output);
    store.finish(&other, Some(0), None);
    let output = lock(&other.output);
    let text = String::from_utf8_lossy(&output.stderr[fits as usize..]).into_owned();
    assert_eq!(
        text,
        format!(
            "\n[kilntainers: the server keeps no more job output for this computer; {} further bytes of this stream were not kept]\n",
            10 * MIB as u64 - fits
        )
    );
    drop(output);
    assert_eq!(store.bytes, charged_sum(&store));
}

#[test]
fn tiny_chunks_are_charged_for_their_order_entries() {
    let mut store = Store::default();
    let job = job("a", 1);
    store.add(job.clone(), 64);
    for _ in 0..1000 {
        store.keep(&job, Stream::Stdout, b"o");
        store.keep(&job, Stream::Stdout, b"o");
        store.keep(&job, Stream::Stderr, b"e");
    }
    let output = lock(&job.output);
    // Runs of one stream share an entry.
    assert_eq!(output.order.len(), 2000);
    assert_eq!(output.total(), 3000);
    assert_eq!(store.bytes, 3000 + 2000 * ORDER_ENTRY_BYTES);
}

#[test]
fn past_the_cap_on_kept_jobs_the_oldest_ended_go_and_running_stay() {
    let mut store = Store::default();
    let first = job("a", 0);
    store.add(first.clone(), 3);
    for n in 1..6 {
        let job = job("a", n);
        store.add(job.clone(), 3);
        store.finish(&job, Some(0), None);
    }
    assert_eq!(kept(&store, "a"), [0, 4, 5]);
    store.forget(&ComputerId::parse("a").unwrap());
    assert!(first.stop.is_cancelled());
    assert_eq!((store.bytes, store.computers.len()), (0, 0));
}

#[test]
fn the_log_limit_still_holds_per_stream() {
    let mut store = Store::default();
    let job = Arc::new(Job {
        log_limit: 10,
        ..Arc::into_inner(job("a", 1)).unwrap()
    });
    store.add(job.clone(), 64);
    store.keep(&job, Stream::Stdout, b"0123456789abc");
    store.finish(&job, Some(0), None);
    let output = lock(&job.output);
    assert_eq!(
        String::from_utf8_lossy(&output.stdout),
        "0123456789\n[kilntainers: job log limit reached; 3 further bytes of this stream were not kept]\n"
    );
}
