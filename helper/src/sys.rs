//! The helper's only foreign calls, `poll`, `kill` and `recv`, behind safe wrappers: std has no
//! way to wait on several pipes with a timeout, to signal a process group or (on stable) to peek
//! at a Unix socket, and the helper takes no dependencies (it is compiled with plain `rustc`).
//! This is the crate's only `unsafe`. The tests add `prctl`, to stand in for a computer's PID 1.

use std::ffi::{c_int, c_short, c_ulong, c_void};
use std::io;
use std::os::fd::AsRawFd;
use std::time::Duration;

pub(crate) const POLLIN: c_short = 0x1;
pub(crate) const POLLOUT: c_short = 0x4;
pub(crate) const POLLHUP: c_short = 0x10;
const SIGKILL: c_int = 9;
const MSG_PEEK: c_int = 0x2;
const MSG_DONTWAIT: c_int = 0x40;

/// `struct pollfd`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct PollFd {
    pub fd: c_int,
    pub events: c_short,
    pub revents: c_short,
}

impl PollFd {
    pub(crate) fn new(fd: c_int, events: c_short) -> Self {
        Self {
            fd,
            events,
            revents: 0,
        }
    }
}

// SAFETY: these are the C library's own declarations on Linux (glibc and musl agree). `kill`
// takes plain integers and touches none of our memory, so it is declared safe to call; `poll`
// reads and writes `nfds` entries at `fds`, which `poll_fds` guarantees; `recv` writes at most
// `len` bytes at `buf`, which `peek_now` guarantees.
unsafe extern "C" {
    safe fn kill(pid: c_int, sig: c_int) -> c_int;
    fn poll(fds: *mut PollFd, nfds: c_ulong, timeout: c_int) -> c_int;
    fn recv(fd: c_int, buf: *mut c_void, len: usize, flags: c_int) -> isize;
    #[cfg(test)]
    fn prctl(option: c_int, ...) -> c_int;
}

/// Makes this process the one its descendants' orphans are reparented to, as PID 1 is in a
/// computer: the tests run the helper on a host, where the kill sweep's orphan rule must see
/// only what the tests started.
#[cfg(test)]
pub(crate) fn become_child_subreaper() {
    const PR_SET_CHILD_SUBREAPER: c_int = 36;
    // SAFETY: this option takes one integer argument and touches none of our memory.
    let done = unsafe { prctl(PR_SET_CHILD_SUBREAPER, c_ulong::from(1u8)) };
    assert_eq!(
        done,
        0,
        "prctl(PR_SET_CHILD_SUBREAPER): {}",
        io::Error::last_os_error()
    );
}

/// Waits until one of `fds` is ready or `timeout` passes; returns how many are ready.
pub(crate) fn poll_fds(fds: &mut [PollFd], timeout: Duration) -> io::Result<usize> {
    // Rounded up, so a sub-millisecond remainder waits instead of spinning.
    let millis = c_int::try_from(timeout.as_micros().div_ceil(1000)).unwrap_or(c_int::MAX);
    // SAFETY: `fds` is an exclusively borrowed slice of `fds.len()` initialised entries, and
    // poll writes nothing but their `revents`.
    let ready = unsafe { poll(fds.as_mut_ptr(), fds.len() as c_ulong, millis) };
    if ready < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ready as usize)
    }
}

/// Copies what `socket` has waiting to be read into `buffer`, without taking it off the socket
/// and without waiting; `Ok(0)` when nothing is waiting or the peer has closed.
pub(crate) fn peek_now(socket: &impl AsRawFd, buffer: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buffer` is an exclusively borrowed slice, and recv writes at most its length.
    let read = unsafe {
        recv(
            socket.as_raw_fd(),
            buffer.as_mut_ptr().cast(),
            buffer.len(),
            MSG_PEEK | MSG_DONTWAIT,
        )
    };
    match read {
        n if n >= 0 => Ok(n as usize),
        _ => match io::Error::last_os_error() {
            e if e.kind() == io::ErrorKind::WouldBlock => Ok(0),
            e => Err(e),
        },
    }
}

/// SIGKILL to a command's whole process group. The guard keeps a bogus id (0 or 1) from
/// turning into kill(0), our own group, or kill(-1), every process we may signal.
pub(crate) fn kill_group(pgid: i32) {
    if pgid > 1 {
        kill(-pgid, SIGKILL);
    }
}

/// SIGKILL to one process, never to PID 1, a bogus id or the helper itself.
pub(crate) fn kill_process(pid: i32) {
    if pid > 1 && u32::try_from(pid).is_ok_and(|pid| pid != std::process::id()) {
        kill(pid, SIGKILL);
    }
}
