//! A scriptable in-memory [`Backend`] for unit tests of the layers above the trait. Compiled
//! only under `cfg(test)`, so it is never part of a build that ships.
//!
//! Computers are entries in a map. Every call is logged in order (a [`Call`]) and can be
//! counted per computer ([`Counts`]). Delays ([`Op`]) run on tokio's clock, so a test under
//! paused time stays instant and deterministic. Tests script what each exec does
//! ([`ExecScript`]: exit code and output chunks, hang until cancelled, wait for a gate, fail),
//! and can stop or remove a computer behind the caller's back.
//!
//! The fake keeps the provider rules the layers above rely on: an exec on a stopped computer is
//! `NotRunning`, on a missing computer or an outdated incarnation `Vanished`; `restart` gives a
//! new incarnation (`sandbox_id`); `remove` of a missing computer succeeds. Every running
//! computer has an echo server on [`ECHO_PORT`] and nothing on other ports.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::{
    Backend, BackendError, ComputerInfo, CreateSpec, ExecEnd, ExecSpec, Found, IdleStop,
    IdleStopped, OutputSink, PortRoute, PortStream, Progress, Restarted, SandboxRef, SinkControl,
    Stream,
};
use crate::checkpoints::{
    CheckpointName, CheckpointRecord, CheckpointSet, Checkpoints, FromCheckpoint, NewCheckpoint,
    lineage_after,
};
use crate::ids::{ComputerId, ExecId, InstanceId, SandboxId};

/// How long [`FakeBackend::wait_until`] and [`within`] wait, in tokio time, before they fail the
/// test: long
/// enough for any scripted delay, and instant under paused time.
/// The port on which every running fake computer echoes what it is sent.
pub const ECHO_PORT: u16 = 7;

const WAIT_LIMIT: Duration = Duration::from_secs(24 * 3600);

/// Awaits `work`, failing the test after [`WAIT_LIMIT`] of tokio time: under paused time a
/// deadlock then ends the test at once instead of hanging it.
pub async fn within<T>(work: impl Future<Output = T>) -> T {
    match tokio::time::timeout(WAIT_LIMIT, work).await {
        Ok(done) => done,
        Err(_) => panic!("still not done after {WAIT_LIMIT:?} of tokio time: deadlocked"),
    }
}

/// One backend call, in the order the calls arrived.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    Create(ComputerId),
    Lookup(ComputerId),
    EnsureRunning(ComputerId),
    /// A restart began.
    Restart(ComputerId),
    /// A restart returned.
    Restarted(ComputerId),
    /// A removal began.
    Remove(ComputerId),
    /// A removal returned, successfully or not.
    Removed(ComputerId),
    ExecStart {
        computer: ComputerId,
        sandbox_id: SandboxId,
        command: String,
        exec_id: ExecId,
    },
    /// One chunk of output pushed into the sink.
    Output(ComputerId),
    /// The exec returned, or its future was dropped.
    ExecEnd {
        computer: ComputerId,
        command: String,
    },
    KillExec {
        computer: ComputerId,
        exec_id: ExecId,
    },
    /// Stopped by `--idle-stop`.
    StopIdle(ComputerId),
}

impl Call {
    pub fn computer(&self) -> &ComputerId {
        match self {
            Self::Create(id)
            | Self::Lookup(id)
            | Self::EnsureRunning(id)
            | Self::Restart(id)
            | Self::Restarted(id)
            | Self::Remove(id)
            | Self::Removed(id)
            | Self::Output(id)
            | Self::StopIdle(id) => id,
            Self::ExecStart { computer, .. }
            | Self::ExecEnd { computer, .. }
            | Self::KillExec { computer, .. } => computer,
        }
    }
}

/// Calls per computer. `remove`, `restart` and `exec` count calls begun.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub create: usize,
    pub lookup: usize,
    pub ensure_running: usize,
    pub restart: usize,
    pub remove: usize,
    pub exec: usize,
    pub kill_exec: usize,
    pub stop_idle: usize,
}

/// Calls that can be given a delay.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    Create,
    Lookup,
    EnsureRunning,
    Restart,
    Remove,
    Exec,
    KillExec,
}

/// What one exec does, once its computer is found running.
#[derive(Debug, Clone)]
pub enum ExecScript {
    /// Pushes the chunks (stopping early when the sink says stop), then exits with `code`.
    Exit {
        code: i64,
        chunks: Vec<(Stream, Vec<u8>)>,
    },
    /// Runs until the exec's cancellation token fires (unless the future is dropped first),
    /// then reports `StoppedBySink`, as a backend that noticed the cancel itself would.
    Hang,
    /// Waits until `release` is notified, then exits 0.
    Gate(Arc<Notify>),
    /// Fails as on a computer that stopped, whatever the computer's real state (checked first,
    /// so it also fires on a computer that is gone).
    NotRunning,
    /// The computer disappears provider-side during the command.
    Vanish,
    /// Fails with this error.
    Fail(BackendError),
}

impl ExecScript {
    pub fn exit(code: i64) -> Self {
        Self::Exit {
            code,
            chunks: Vec::new(),
        }
    }

    pub fn output(code: i64, chunks: &[(Stream, &[u8])]) -> Self {
        Self::Exit {
            code,
            chunks: chunks
                .iter()
                .map(|(stream, bytes)| (*stream, bytes.to_vec()))
                .collect(),
        }
    }
}

struct Computer {
    sandbox: SandboxRef,
    running: bool,
}

#[derive(Default)]
struct State {
    computers: HashMap<ComputerId, Computer>,
    log: Vec<Call>,
    delays: HashMap<Op, Duration>,
    /// Scripts for execs on one computer, used before the shared queue.
    scripts_for: HashMap<ComputerId, VecDeque<ExecScript>>,
    /// Scripts for execs on any computer, in call order; an empty queue means exit 0.
    scripts: VecDeque<ExecScript>,
    /// Removals still to fail, per computer.
    failing_removes: HashMap<ComputerId, usize>,
    /// Creations still to fail, per computer.
    failing_creates: HashMap<ComputerId, usize>,
    /// Inventory listings still to fail.
    failing_lists: usize,
    /// Computers another server is working on, as a backend that can see it reports.
    held_elsewhere: std::collections::HashSet<ComputerId>,
    next_incarnation: u64,
    /// Checkpoints per computer, oldest first, and each computer's present lineage.
    checkpoints: HashMap<ComputerId, CheckpointSet>,
    /// Set by [`FakeBackend::without_checkpoints`]: the backend has none (like Fly).
    no_checkpoints: bool,
}

impl State {
    fn new_sandbox_id(&mut self) -> SandboxId {
        self.next_incarnation += 1;
        SandboxId::new(format!("sb{}", self.next_incarnation))
    }
}

#[derive(Default)]
pub struct FakeBackend {
    state: Mutex<State>,
    /// Notified after every logged call.
    changed: Notify,
}

impl FakeBackend {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn record(&self, call: Call) {
        self.state().log.push(call);
        self.changed.notify_waiters();
    }

    async fn delay(&self, op: Op) {
        let delay = self.state().delays.get(&op).copied();
        if let Some(delay) = delay {
            tokio::time::sleep(delay).await;
        }
    }

    /// Makes every later `op` call wait `delay` (tokio time) before it acts.
    pub fn set_delay(&self, op: Op, delay: Duration) {
        self.state().delays.insert(op, delay);
    }

    /// Queues what the next exec on any computer does (after those scripted per computer).
    pub fn script_exec(&self, script: ExecScript) {
        self.state().scripts.push_back(script);
    }

    /// Queues what the next exec on `id` does.
    pub fn script_exec_on(&self, id: &ComputerId, script: ExecScript) {
        self.state()
            .scripts_for
            .entry(id.clone())
            .or_default()
            .push_back(script);
    }

    /// Makes the next `times` removals of `id` fail with a provider error.
    pub fn fail_removes(&self, id: &ComputerId, times: usize) {
        self.state().failing_removes.insert(id.clone(), times);
    }

    /// Makes the next `times` creations of `id` fail with a provider error (a failed pull).
    pub fn fail_creates(&self, id: &ComputerId, times: usize) {
        self.state().failing_creates.insert(id.clone(), times);
    }

    /// Makes this backend one without checkpoints.
    pub fn without_checkpoints(&self) {
        self.state().no_checkpoints = true;
    }

    /// The checkpoints the fake holds for `id`, oldest first.
    pub fn checkpoint_names(&self, id: &ComputerId) -> Vec<String> {
        self.state()
            .checkpoints
            .get(id)
            .map(|set| {
                set.checkpoints
                    .iter()
                    .map(|c| c.name.as_str().to_owned())
                    .collect()
            })
            .unwrap_or_default()
    }

    pub fn fail_lists(&self, times: usize) {
        self.state().failing_lists = times;
    }

    /// Adds a computer as if another server (or an earlier run) had created it.
    pub fn insert(&self, id: &ComputerId, temporary: bool, running: bool) -> SandboxRef {
        let mut state = self.state();
        let sandbox = SandboxRef {
            computer_id: id.clone(),
            sandbox_id: state.new_sandbox_id(),
            temporary,
            image: "fake-image".to_owned(),
        };
        state.computers.insert(
            id.clone(),
            Computer {
                sandbox: sandbox.clone(),
                running,
            },
        );
        sandbox
    }

    /// Makes `id` look busy with another server's work to [`Backend::stop_idle`] (or not).
    pub fn set_held_elsewhere(&self, id: &ComputerId, held: bool) {
        let mut state = self.state();
        if held {
            state.held_elsewhere.insert(id.clone());
        } else {
            state.held_elsewhere.remove(id);
        }
    }

    /// Stops the computer provider-side (it still exists).
    pub fn stop(&self, id: &ComputerId) {
        if let Some(computer) = self.state().computers.get_mut(id) {
            computer.running = false;
        }
    }

    /// Removes the computer provider-side without telling anyone.
    pub fn vanish(&self, id: &ComputerId) {
        self.state().computers.remove(id);
    }

    pub fn exists(&self, id: &ComputerId) -> bool {
        self.state().computers.contains_key(id)
    }

    pub fn is_running(&self, id: &ComputerId) -> bool {
        self.state().computers.get(id).is_some_and(|c| c.running)
    }

    /// Every call so far, in order.
    pub fn log(&self) -> Vec<Call> {
        self.state().log.clone()
    }

    pub fn counts(&self, id: &ComputerId) -> Counts {
        let mut counts = Counts::default();
        for call in self.state().log.iter().filter(|c| c.computer() == id) {
            match call {
                Call::Create(_) => counts.create += 1,
                Call::Lookup(_) => counts.lookup += 1,
                Call::EnsureRunning(_) => counts.ensure_running += 1,
                Call::Restart(_) => counts.restart += 1,
                Call::Remove(_) => counts.remove += 1,
                Call::ExecStart { .. } => counts.exec += 1,
                Call::KillExec { .. } => counts.kill_exec += 1,
                Call::StopIdle(_) => counts.stop_idle += 1,
                Call::Restarted(_) | Call::Removed(_) | Call::Output(_) | Call::ExecEnd { .. } => {}
            }
        }
        counts
    }

    /// The computers ever named in a call.
    pub fn computers_seen(&self) -> HashSet<ComputerId> {
        self.state()
            .log
            .iter()
            .map(|c| c.computer().clone())
            .collect()
    }

    /// Waits until `done` holds for the log. Fails the test after [`WAIT_LIMIT`] of tokio time,
    /// so a wrong expectation ends the test instead of hanging it.
    pub async fn wait_until(&self, mut done: impl FnMut(&[Call]) -> bool) {
        let wait = async {
            loop {
                let notified = self.changed.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if done(&self.state().log) {
                    return;
                }
                notified.await;
            }
        };
        if tokio::time::timeout(WAIT_LIMIT, wait).await.is_err() {
            panic!(
                "the fake backend never saw the expected calls: {:#?}",
                self.log()
            );
        }
    }

    /// The computer behind `sandbox`, checked for the exec rules above.
    fn check_runnable(&self, sandbox: &SandboxRef) -> Result<(), BackendError> {
        let state = self.state();
        match state.computers.get(&sandbox.computer_id) {
            Some(c) if c.sandbox.sandbox_id != sandbox.sandbox_id => {
                Err(BackendError::Vanished(sandbox.computer_id.clone()))
            }
            Some(c) if !c.running => Err(BackendError::NotRunning(sandbox.sandbox_id.clone())),
            Some(_) => Ok(()),
            None => Err(BackendError::Vanished(sandbox.computer_id.clone())),
        }
    }

    fn next_script(&self, id: &ComputerId) -> ExecScript {
        let mut state = self.state();
        if let Some(script) = state.scripts_for.get_mut(id).and_then(VecDeque::pop_front) {
            return script;
        }
        state.scripts.pop_front().unwrap_or(ExecScript::exit(0))
    }
}

/// Logs the end of an exec even when its future is dropped mid-way.
struct ExecEndGuard<'a> {
    backend: &'a FakeBackend,
    computer: ComputerId,
    command: String,
}

impl Drop for ExecEndGuard<'_> {
    fn drop(&mut self) {
        self.backend.record(Call::ExecEnd {
            computer: self.computer.clone(),
            command: std::mem::take(&mut self.command),
        });
    }
}

#[async_trait]
impl Backend for FakeBackend {
    fn kind(&self) -> &'static str {
        "fake"
    }

    fn tool_instructions(&self) -> String {
        String::new()
    }

    async fn validate(&self) -> Result<(), BackendError> {
        Ok(())
    }

    fn checkpoints(&self) -> Option<&dyn Checkpoints> {
        if self.state().no_checkpoints {
            None
        } else {
            Some(self)
        }
    }

    async fn create(
        &self,
        spec: &CreateSpec,
        _progress: &dyn Progress,
    ) -> Result<SandboxRef, BackendError> {
        self.record(Call::Create(spec.computer_id.clone()));
        self.delay(Op::Create).await;
        let mut state = self.state();
        if let Some(left) = state.failing_creates.get_mut(&spec.computer_id)
            && *left > 0
        {
            *left -= 1;
            return Err(BackendError::Provider(format!(
                "could not create '{}'",
                spec.computer_id
            )));
        }
        if let Some(existing) = state.computers.get(&spec.computer_id) {
            // A name conflict attaches, as the real backends do.
            return Ok(existing.sandbox.clone());
        }
        let sandbox = SandboxRef {
            computer_id: spec.computer_id.clone(),
            sandbox_id: state.new_sandbox_id(),
            temporary: spec.temporary,
            image: spec
                .image
                .clone()
                .unwrap_or_else(|| "fake-image".to_owned()),
        };
        state.computers.insert(
            spec.computer_id.clone(),
            Computer {
                sandbox: sandbox.clone(),
                running: true,
            },
        );
        Ok(sandbox)
    }

    async fn lookup(&self, id: &ComputerId) -> Result<Option<Found>, BackendError> {
        self.record(Call::Lookup(id.clone()));
        self.delay(Op::Lookup).await;
        Ok(self.state().computers.get(id).map(|c| Found {
            sandbox: c.sandbox.clone(),
            running: c.running,
        }))
    }

    async fn ensure_running(&self, sandbox: &SandboxRef) -> Result<SandboxRef, BackendError> {
        self.record(Call::EnsureRunning(sandbox.computer_id.clone()));
        self.delay(Op::EnsureRunning).await;
        match self.state().computers.get_mut(&sandbox.computer_id) {
            Some(computer) => {
                computer.running = true;
                Ok(computer.sandbox.clone())
            }
            None => Err(BackendError::Vanished(sandbox.computer_id.clone())),
        }
    }

    async fn list(&self) -> Result<Vec<ComputerInfo>, BackendError> {
        let mut state = self.state();
        if state.failing_lists > 0 {
            state.failing_lists -= 1;
            return Err(BackendError::Provider("inventory unavailable.".to_owned()));
        }
        Ok(state
            .computers
            .values()
            .map(|c| ComputerInfo {
                sandbox: c.sandbox.clone(),
                state: if c.running { "running" } else { "exited" }.to_owned(),
                created_at: None,
            })
            .collect())
    }

    async fn restart(&self, sandbox: &SandboxRef) -> Result<Restarted, BackendError> {
        let id = sandbox.computer_id.clone();
        self.record(Call::Restart(id.clone()));
        self.delay(Op::Restart).await;
        let result = {
            let mut state = self.state();
            let sandbox_id = state.new_sandbox_id();
            match state.computers.get_mut(&id) {
                Some(computer) => {
                    computer.sandbox.sandbox_id = sandbox_id;
                    computer.running = true;
                    Ok(Restarted {
                        sandbox: computer.sandbox.clone(),
                        state_preserved: false,
                    })
                }
                None => Err(BackendError::Vanished(id.clone())),
            }
        };
        self.record(Call::Restarted(id));
        result
    }

    fn idle_stop(&self) -> IdleStop {
        IdleStop::Stops
    }

    async fn stop_idle(&self, sandbox: &SandboxRef) -> Result<IdleStopped, BackendError> {
        let id = sandbox.computer_id.clone();
        let result = {
            let mut state = self.state();
            let held = state.held_elsewhere.contains(&id);
            match state.computers.get_mut(&id) {
                Some(_) if held => Ok(IdleStopped::InUseElsewhere),
                Some(computer) => {
                    computer.running = false;
                    Ok(IdleStopped::Stopped)
                }
                None => Err(BackendError::Vanished(id.clone())),
            }
        };
        self.record(Call::StopIdle(id));
        result
    }

    async fn remove(&self, sandbox: &SandboxRef) -> Result<(), BackendError> {
        let id = sandbox.computer_id.clone();
        self.record(Call::Remove(id.clone()));
        self.delay(Op::Remove).await;
        let result = {
            let mut state = self.state();
            match state.failing_removes.get_mut(&id) {
                Some(left) if *left > 0 => {
                    *left -= 1;
                    Err(BackendError::Provider(format!("could not remove '{id}'")))
                }
                _ => {
                    state.computers.remove(&id);
                    Ok(())
                }
            }
        };
        self.record(Call::Removed(id));
        result
    }

    async fn exec(
        &self,
        sandbox: &SandboxRef,
        spec: &ExecSpec,
        sink: &mut dyn OutputSink,
        cancel: &CancellationToken,
    ) -> Result<ExecEnd, BackendError> {
        let computer = sandbox.computer_id.clone();
        let command = spec.command.clone().unwrap_or_else(|| spec.argv.join(" "));
        self.record(Call::ExecStart {
            computer: computer.clone(),
            sandbox_id: sandbox.sandbox_id.clone(),
            command: command.clone(),
            exec_id: spec.exec_id.clone(),
        });
        let _end = ExecEndGuard {
            backend: self,
            computer: computer.clone(),
            command,
        };
        let script = self.next_script(&computer);
        if matches!(script, ExecScript::NotRunning) {
            // Scripted: whatever the computer's state, as when it stops just as the exec starts.
            return Err(BackendError::NotRunning(sandbox.sandbox_id.clone()));
        }
        self.check_runnable(sandbox)?;
        self.delay(Op::Exec).await;
        match script {
            ExecScript::Exit { code, chunks } => {
                for (stream, bytes) in chunks {
                    self.record(Call::Output(computer.clone()));
                    if sink.push(stream, &bytes) == SinkControl::Stop {
                        return Ok(ExecEnd::StoppedBySink);
                    }
                }
                Ok(ExecEnd::Exited(code))
            }
            ExecScript::Hang => {
                cancel.cancelled().await;
                Ok(ExecEnd::StoppedBySink)
            }
            ExecScript::Gate(release) => {
                release.notified().await;
                Ok(ExecEnd::Exited(0))
            }
            ExecScript::NotRunning => unreachable!("answered before the computer check"),
            ExecScript::Vanish => {
                self.vanish(&computer);
                Err(BackendError::Vanished(computer))
            }
            ExecScript::Fail(error) => Err(error),
        }
    }

    async fn port_route(&self, _: &SandboxRef, _: u16) -> Result<PortRoute, BackendError> {
        Ok(PortRoute::Forwarded)
    }

    async fn connect_port(
        &self,
        sandbox: &SandboxRef,
        port: u16,
    ) -> Result<Box<dyn PortStream>, BackendError> {
        match self.state().computers.get(&sandbox.computer_id) {
            None => return Err(BackendError::Vanished(sandbox.computer_id.clone())),
            Some(computer) if !computer.running => {
                return Err(BackendError::NotRunning(sandbox.sandbox_id.clone()));
            }
            Some(_) => {}
        }
        if port != ECHO_PORT {
            return Err(BackendError::Provider(format!("nothing on port {port}")));
        }
        let (ours, theirs) = tokio::io::duplex(4096);
        tokio::spawn(async move {
            let (mut from, mut to) = tokio::io::split(theirs);
            let _ = tokio::io::copy(&mut from, &mut to).await;
        });
        Ok(Box::new(ours))
    }

    async fn kill_exec(&self, sandbox: &SandboxRef, exec_id: &ExecId) -> Result<(), BackendError> {
        self.record(Call::KillExec {
            computer: sandbox.computer_id.clone(),
            exec_id: exec_id.clone(),
        });
        self.delay(Op::KillExec).await;
        Ok(())
    }

    async fn collect_orphans(
        &self,
        _dead: &HashSet<InstanceId>,
    ) -> Result<Vec<ComputerId>, BackendError> {
        Ok(Vec::new())
    }
}

/// Checkpoints as entries in a map; a rollback or fork is a new incarnation.
#[async_trait]
impl Checkpoints for FakeBackend {
    async fn checkpoint(
        &self,
        sandbox: &SandboxRef,
        new: &NewCheckpoint,
    ) -> Result<CheckpointRecord, BackendError> {
        let mut state = self.state();
        if !state.computers.contains_key(&sandbox.computer_id) {
            return Err(BackendError::Vanished(sandbox.computer_id.clone()));
        }
        let record = CheckpointRecord {
            name: new.name.clone(),
            lineage: new.lineage.clone(),
            created_at: crate::clock::now_rfc3339(),
            size_bytes: Some(0),
            memory: false,
            note: new.note.clone(),
        };
        let set = state
            .checkpoints
            .entry(sandbox.computer_id.clone())
            .or_default();
        set.checkpoints.push(record.clone());
        set.lineage = lineage_after(&new.name, &new.lineage);
        Ok(record)
    }

    async fn checkpoints(&self, id: &ComputerId) -> Result<CheckpointSet, BackendError> {
        Ok(self
            .state()
            .checkpoints
            .get(id)
            .cloned()
            .unwrap_or_default())
    }

    async fn rollback(
        &self,
        sandbox: &SandboxRef,
        from: FromCheckpoint<'_>,
        _spec: &CreateSpec,
        _progress: &dyn Progress,
    ) -> Result<SandboxRef, BackendError> {
        let id = sandbox.computer_id.clone();
        self.record(Call::Remove(id.clone()));
        let mut state = self.state();
        let sandbox_id = state.new_sandbox_id();
        let lineage = lineage_after(&from.checkpoint.name, &from.checkpoint.lineage);
        state.checkpoints.entry(id.clone()).or_default().lineage = lineage;
        match state.computers.get_mut(&id) {
            Some(computer) => {
                computer.sandbox.sandbox_id = sandbox_id;
                computer.running = true;
                Ok(computer.sandbox.clone())
            }
            None => Err(BackendError::Vanished(id)),
        }
    }

    async fn fork(
        &self,
        source: &SandboxRef,
        from: FromCheckpoint<'_>,
        spec: &CreateSpec,
        _progress: &dyn Progress,
    ) -> Result<SandboxRef, BackendError> {
        self.record(Call::Create(spec.computer_id.clone()));
        let mut state = self.state();
        if let Some(left) = state.failing_creates.get_mut(&spec.computer_id)
            && *left > 0
        {
            *left -= 1;
            return Err(BackendError::Provider(format!(
                "could not create '{}'",
                spec.computer_id
            )));
        }
        let sandbox = SandboxRef {
            computer_id: spec.computer_id.clone(),
            sandbox_id: state.new_sandbox_id(),
            temporary: spec.temporary,
            image: source.image.clone(),
        };
        state.computers.insert(
            spec.computer_id.clone(),
            Computer {
                sandbox: sandbox.clone(),
                running: true,
            },
        );
        let mut copy = from.checkpoint.clone();
        copy.lineage.clear();
        state.checkpoints.insert(
            spec.computer_id.clone(),
            CheckpointSet {
                lineage: vec![copy.name.clone()],
                checkpoints: vec![copy],
            },
        );
        Ok(sandbox)
    }

    async fn delete(&self, id: &ComputerId, name: &CheckpointName) -> Result<(), BackendError> {
        if let Some(set) = self.state().checkpoints.get_mut(id) {
            set.checkpoints.retain(|c| &c.name != name);
        }
        Ok(())
    }

    async fn forget(&self, id: &ComputerId) -> Result<(), BackendError> {
        self.state().checkpoints.remove(id);
        Ok(())
    }
}
