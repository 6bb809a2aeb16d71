//! In-memory fakes of the seams, for tests of the reconcile core.
//!
//! - [`FakeCluster`] is one election shared by several [`FakeCoordinator`]s.
//!   The test chooses who leads and when; leases run on tokio's clock (so a
//!   paused-time test can advance past them); observations to a node can be
//!   lost ([`FakeCluster::set_deaf`]). Like a real lease-based election, it
//!   refuses to elect a new leader while the previous leader's lease is
//!   still valid — that is the property the gate's deadline check relies on.
//! - [`FenceScript`] hands out [`FakeFencer`]s that succeed, fail or hang on
//!   command, and logs every attempt.
//! - [`MemoryEngine`] is a [`WriterEngine`] over a byte vector that logs the
//!   term of every write it accepts.
//! - [`MemoryInSync`] is an in-sync set in memory whose commits fail on
//!   command, as a deposed writer's would.
//! - [`MemoryCopy`] is a node's own replica for the read gate
//!   ([`super::LocalCopy`]), whose membership in the in-sync set the test
//!   sets.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use tokio::sync::watch;
use tokio::time::Instant;

use super::{
    Coordinator, FenceError, Fencer, HaError, InSyncError, InSyncTracker, Leadership, Lease,
    LocalCopy, ReplicaState, ReplicaStatus, Writer, WriterEngine,
};
use crate::ids::{NodeId, Term};
use crate::volume::{Access, Bond, Change, Device, DeviceError, check_request};

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// Why [`FakeCluster::elect`] refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ElectError {
    /// The current leader's lease has not run out.
    #[error("the lease of term {term} is valid for another {remaining:?}")]
    LeaseValid { term: Term, remaining: Duration },
    /// No such node joined the fake cluster.
    #[error("unknown node {0}")]
    UnknownNode(NodeId),
}

struct FakeNode {
    tx: watch::Sender<Leadership>,
    deaf: bool,
}

#[derive(Default)]
struct ClusterState {
    term: Term,
    leader: Option<NodeId>,
    /// The last lease granted to each node; it may have run out.
    leases: HashMap<NodeId, Lease>,
    promoted: Option<Writer>,
    nodes: BTreeMap<NodeId, FakeNode>,
    fail_promotions: bool,
    fail_prev_writer: bool,
    resigns: u64,
    /// Every transfer asked for: to whom, and when.
    transfers: Vec<(NodeId, Instant)>,
}

impl ClusterState {
    fn observation_for(&self, id: NodeId, now: Instant) -> Leadership {
        let is_self = self.leader == Some(id)
            && self
                .leases
                .get(&id)
                .is_some_and(|lease| lease.covers(self.term, now));
        Leadership {
            leader: self.leader,
            is_self,
            term: self.term,
        }
    }

    fn notify(&self) {
        let now = Instant::now();
        for (id, node) in &self.nodes {
            if !node.deaf {
                node.tx.send_replace(self.observation_for(*id, now));
            }
        }
    }

    fn leader_lease(&self) -> Option<Lease> {
        self.leader
            .as_ref()
            .and_then(|leader| self.leases.get(leader))
            .copied()
    }
}

/// One fake election shared by several coordinators. See the module docs.
#[derive(Clone)]
pub struct FakeCluster {
    state: Arc<Mutex<ClusterState>>,
    lease: Duration,
}

impl FakeCluster {
    /// A cluster whose leases last `lease` from each grant or renewal.
    pub fn new(lease: Duration) -> Self {
        Self {
            state: Arc::default(),
            lease,
        }
    }

    /// Registers node `id` and returns its coordinator.
    pub fn coordinator(&self, id: NodeId) -> Arc<FakeCoordinator> {
        let mut state = lock(&self.state);
        let now = Instant::now();
        let (tx, _) = watch::channel(state.observation_for(id, now));
        state.nodes.insert(id, FakeNode { tx, deaf: false });
        Arc::new(FakeCoordinator {
            id,
            cluster: self.clone(),
        })
    }

    /// Elects `id` for a new term, granting it a fresh lease, and notifies
    /// every node that hears. Refused while the current leader's lease is
    /// valid. Returns the new term.
    pub fn elect(&self, id: NodeId) -> Result<Term, ElectError> {
        let mut state = lock(&self.state);
        let now = Instant::now();
        if let Some(lease) = state.leader_lease() {
            if now < lease.deadline {
                return Err(ElectError::LeaseValid {
                    term: lease.term,
                    remaining: lease.deadline - now,
                });
            }
        }
        if !state.nodes.contains_key(&id) {
            return Err(ElectError::UnknownNode(id));
        }
        state.term = state.term.next();
        state.leader = Some(id);
        let lease = Lease {
            term: state.term,
            deadline: now + self.lease,
        };
        state.leases.insert(id, lease);
        state.notify();
        Ok(state.term)
    }

    /// Extends the current leader's lease by a full lease from now, without
    /// an observation (as a leader's heartbeats do).
    pub fn renew(&self) {
        let mut state = lock(&self.state);
        let deadline = Instant::now() + self.lease;
        let term = state.term;
        if let Some(leader) = state.leader {
            if let Some(lease) = state.leases.get_mut(&leader) {
                if lease.term == term {
                    lease.deadline = deadline;
                }
            }
        }
    }

    /// Ends the current leader's lease now. With `notify`, every node that
    /// hears learns there is no leader; without, the loss goes unobserved
    /// and only the lease deadline tells.
    pub fn expire(&self, notify: bool) {
        let mut state = lock(&self.state);
        let now = Instant::now();
        if let Some(leader) = state.leader {
            if let Some(lease) = state.leases.get_mut(&leader) {
                lease.deadline = lease.deadline.min(now);
            }
        }
        if notify {
            state.leader = None;
            state.notify();
        }
    }

    /// Loses (`true`) or restores (`false`) the observations sent to `id`.
    /// On restore the node gets the current observation.
    pub fn set_deaf(&self, id: NodeId, deaf: bool) {
        let mut state = lock(&self.state);
        let now = Instant::now();
        let observation = state.observation_for(id, now);
        if let Some(node) = state.nodes.get_mut(&id) {
            node.deaf = deaf;
            if !deaf {
                node.tx.send_replace(observation);
            }
        }
    }

    /// Sends every hearing node its current observation again.
    pub fn republish(&self) {
        lock(&self.state).notify();
    }

    /// Makes `record_promotion` fail (`true`) or work again.
    pub fn set_fail_promotions(&self, fail: bool) {
        lock(&self.state).fail_promotions = fail;
    }

    /// Makes `prev_writer` fail (`true`) or work again.
    pub fn set_fail_prev_writer(&self, fail: bool) {
        lock(&self.state).fail_prev_writer = fail;
    }

    /// Closes every node's observation stream, as a coordinator shutting
    /// down does.
    pub fn shut_down(&self) {
        lock(&self.state).nodes.clear();
    }

    /// The last promoted writer.
    pub fn promoted(&self) -> Option<Writer> {
        lock(&self.state).promoted.clone()
    }

    /// The current leader and term.
    pub fn leader(&self) -> (Option<NodeId>, Term) {
        let state = lock(&self.state);
        (state.leader, state.term)
    }

    /// The current leader's lease deadline.
    pub fn lease_deadline(&self) -> Option<Instant> {
        lock(&self.state).leader_lease().map(|lease| lease.deadline)
    }

    /// How many times a leader resigned.
    pub fn resigns(&self) -> u64 {
        lock(&self.state).resigns
    }

    /// Every transfer a leader asked for: to whom, and when.
    pub fn transfers(&self) -> Vec<(NodeId, Instant)> {
        lock(&self.state).transfers.clone()
    }
}

/// One node's view of a [`FakeCluster`].
pub struct FakeCoordinator {
    id: NodeId,
    cluster: FakeCluster,
}

impl FakeCoordinator {
    /// A receiver of this node's observations; already closed once the
    /// cluster has shut down.
    fn subscribe(&self) -> watch::Receiver<Leadership> {
        match lock(&self.cluster.state).nodes.get(&self.id) {
            Some(node) => node.tx.subscribe(),
            None => watch::channel(Leadership::default()).1,
        }
    }
}

#[async_trait]
impl Coordinator for FakeCoordinator {
    fn node_id(&self) -> NodeId {
        self.id
    }

    async fn campaign(&self) -> Result<(), HaError> {
        let mut rx = self.subscribe();
        loop {
            if rx.borrow_and_update().is_self && self.lease().is_some() {
                return Ok(());
            }
            rx.changed()
                .await
                .map_err(|_| HaError::Coordinator("cluster shut down".into()))?;
        }
    }

    async fn resign(&self) -> Result<(), HaError> {
        let mut state = lock(&self.cluster.state);
        if state.leader == Some(self.id) {
            let now = Instant::now();
            if let Some(lease) = state.leases.get_mut(&self.id) {
                lease.deadline = lease.deadline.min(now);
            }
            state.leader = None;
            state.resigns += 1;
            state.notify();
        }
        Ok(())
    }

    async fn transfer_to(&self, to: NodeId) -> Result<(), HaError> {
        {
            let mut state = lock(&self.cluster.state);
            if state.leader != Some(self.id) {
                return Err(HaError::NotLeader);
            }
            state.transfers.push((to, Instant::now()));
        }
        self.resign().await
    }

    fn observe(&self) -> watch::Receiver<Leadership> {
        self.subscribe()
    }

    fn sole_voter(&self) -> bool {
        lock(&self.cluster.state).nodes.len() <= 1
    }

    async fn members(&self) -> Result<Vec<NodeId>, HaError> {
        Ok(lock(&self.cluster.state).nodes.keys().cloned().collect())
    }

    fn lease(&self) -> Option<Lease> {
        lock(&self.cluster.state).leases.get(&self.id).copied()
    }

    async fn prev_writer(&self, _term: Term) -> Result<Option<Writer>, HaError> {
        let state = lock(&self.cluster.state);
        if state.fail_prev_writer {
            return Err(HaError::Coordinator("state machine unavailable".into()));
        }
        Ok(state.promoted.clone())
    }

    async fn record_promotion(&self, term: Term) -> Result<(), HaError> {
        let mut state = lock(&self.cluster.state);
        if state.fail_promotions {
            return Err(HaError::Coordinator("promotion could not commit".into()));
        }
        let leads = state.leader == Some(self.id)
            && state.term == term
            && state
                .leases
                .get(&self.id)
                .is_some_and(|lease| lease.covers(term, Instant::now()));
        if !leads {
            return Err(HaError::NotLeader);
        }
        let again = state
            .promoted
            .as_ref()
            .is_some_and(|w| w.term == term && w.node == self.id);
        if let Some(recorded) = state.promoted.as_ref().filter(|w| w.term >= term && !again) {
            return Err(HaError::Coordinator(format!(
                "writer {} of term {} is recorded; term {term} cannot be promoted again",
                recorded.node, recorded.term
            )));
        }
        state.promoted = Some(Writer {
            node: self.id,
            term,
        });
        Ok(())
    }
}

/// What a [`FakeFencer`] does when asked to fence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FenceBehavior {
    /// Fences and returns Ok.
    #[default]
    Succeed,
    /// Returns an error.
    Fail,
    /// Never returns.
    Hang,
}

/// One fence attempt, as logged by a [`FenceScript`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FenceRecord {
    /// The node that fenced.
    pub node: NodeId,
    /// The writer it fenced.
    pub prev: Option<Writer>,
    /// The term it fenced for.
    pub term: Term,
    /// Whether it succeeded.
    pub ok: bool,
}

/// Scripts the behaviour of several [`FakeFencer`]s and logs their attempts.
#[derive(Default)]
pub struct FenceScript {
    behavior: Mutex<HashMap<NodeId, FenceBehavior>>,
    delay: Mutex<Duration>,
    log: Mutex<Vec<FenceRecord>>,
}

impl FenceScript {
    /// A script where every fence succeeds at once.
    pub fn new() -> Arc<Self> {
        Arc::default()
    }

    /// A fencer for node `node`.
    pub fn fencer(self: &Arc<Self>, node: NodeId) -> Arc<FakeFencer> {
        Arc::new(FakeFencer {
            node,
            script: Arc::clone(self),
        })
    }

    /// Sets what `node`'s fencer does from now on.
    pub fn set(&self, node: NodeId, behavior: FenceBehavior) {
        lock(&self.behavior).insert(node, behavior);
    }

    /// Makes every fence take `delay` before it acts.
    pub fn set_delay(&self, delay: Duration) {
        *lock(&self.delay) = delay;
    }

    /// Every attempt so far.
    pub fn log(&self) -> Vec<FenceRecord> {
        lock(&self.log).clone()
    }

    /// Whether `node` fenced successfully for `term`.
    pub fn fenced(&self, node: NodeId, term: Term) -> bool {
        lock(&self.log)
            .iter()
            .any(|r| r.ok && r.node == node && r.term == term)
    }
}

/// A fencer whose behaviour a [`FenceScript`] decides.
pub struct FakeFencer {
    node: NodeId,
    script: Arc<FenceScript>,
}

#[async_trait]
impl Fencer for FakeFencer {
    async fn fence(&self, prev_writer: Option<&Writer>, term: Term) -> Result<(), FenceError> {
        let delay = *lock(&self.script.delay);
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        let behavior = lock(&self.script.behavior)
            .get(&self.node)
            .copied()
            .unwrap_or_default();
        if behavior == FenceBehavior::Hang {
            std::future::pending::<()>().await;
        }
        let ok = behavior == FenceBehavior::Succeed;
        lock(&self.script.log).push(FenceRecord {
            node: self.node,
            prev: prev_writer.cloned(),
            term,
            ok,
        });
        if ok {
            Ok(())
        } else {
            // As if no replica took the term.
            Err(FenceError::TooFewFenced {
                term,
                fenced: 0,
                replicas: 1,
                need: 1,
            })
        }
    }
}

/// A [`WriterEngine`] over memory that logs each accepted write's term.
pub struct MemoryEngine {
    data: Mutex<Vec<u8>>,
    term: Mutex<Option<Term>>,
    writes: Mutex<Vec<(Term, u64)>>,
    delay: Mutex<Duration>,
    activate_delay: Mutex<Duration>,
    fail_activate: AtomicBool,
    /// Errors the next writes fail with, one each, before they touch data.
    fail_writes: Mutex<std::collections::VecDeque<DeviceError>>,
    /// While set, every write fails short of replicas (the gate holds it).
    short: AtomicBool,
}

impl MemoryEngine {
    /// An engine of `size` zero bytes.
    pub fn new(size: usize) -> Arc<Self> {
        Arc::new(Self {
            data: Mutex::new(vec![0; size]),
            term: Mutex::new(None),
            writes: Mutex::default(),
            delay: Mutex::default(),
            activate_delay: Mutex::default(),
            fail_activate: AtomicBool::new(false),
            fail_writes: Mutex::default(),
            short: AtomicBool::new(false),
        })
    }

    /// While `short`, every write fails with too few in-sync replicas, as
    /// below `min_in_sync` (the gate holds such writes, C2).
    pub fn set_short(&self, short: bool) {
        self.short.store(short, Ordering::SeqCst);
    }

    /// The active term.
    pub fn term(&self) -> Option<Term> {
        *lock(&self.term)
    }

    /// `(term, offset)` of every accepted write.
    pub fn writes(&self) -> Vec<(Term, u64)> {
        lock(&self.writes).clone()
    }

    /// Makes each write take `delay` (to hold writes in flight).
    pub fn set_delay(&self, delay: Duration) {
        *lock(&self.delay) = delay;
    }

    /// Makes each activation take `delay`.
    pub fn set_activate_delay(&self, delay: Duration) {
        *lock(&self.activate_delay) = delay;
    }

    /// Makes `activate` fail (`true`) or work again.
    /// The next writes fail with `errors`, one each, in order.
    pub fn fail_next_writes(&self, errors: impl IntoIterator<Item = DeviceError>) {
        lock(&self.fail_writes).extend(errors);
    }

    pub fn set_fail_activate(&self, fail: bool) {
        self.fail_activate.store(fail, Ordering::SeqCst);
    }
}

#[async_trait]
impl Device for MemoryEngine {
    /// Blocks of 4 KiB that hold only zeroes count as holes, as in a
    /// sparse file.
    async fn allocation(
        &self,
        offset: u64,
        len: u64,
    ) -> Result<Vec<crate::volume::Extent>, DeviceError> {
        const BLOCK: u64 = 4096;
        let data = lock(&self.data);
        crate::volume::check_span(offset, len, data.len() as u64)?;
        let mut runs: Vec<crate::volume::Extent> = Vec::new();
        let (mut at, end) = (offset, offset + len);
        while at < end {
            let next = ((at / BLOCK + 1) * BLOCK).min(end);
            let hole = data[at as usize..next as usize].iter().all(|b| *b == 0);
            match runs.last_mut() {
                Some(last) if last.hole == hole => last.len += next - at,
                _ => runs.push(crate::volume::Extent {
                    len: next - at,
                    hole,
                }),
            }
            at = next;
        }
        Ok(runs)
    }

    async fn read_at(&self, offset: u64, len: u64) -> Result<Bytes, DeviceError> {
        let data = lock(&self.data);
        check_request(offset, len, data.len() as u64)?;
        Ok(Bytes::copy_from_slice(
            &data[offset as usize..(offset + len) as usize],
        ))
    }

    async fn write_at(&self, offset: u64, bytes: Bytes, _fua: bool) -> Result<(), DeviceError> {
        let term = self.term().ok_or(DeviceError::Inactive)?;
        if let Some(err) = lock(&self.fail_writes).pop_front() {
            return Err(err);
        }
        if self.short.load(Ordering::SeqCst) {
            return Err(DeviceError::InsufficientReplicas { have: 1, need: 2 });
        }
        let delay = *lock(&self.delay);
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        let mut data = lock(&self.data);
        check_request(offset, bytes.len() as u64, data.len() as u64)?;
        data[offset as usize..offset as usize + bytes.len()].copy_from_slice(&bytes);
        lock(&self.writes).push((term, offset));
        Ok(())
    }

    async fn discard(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        self.term().ok_or(DeviceError::Inactive)?;
        let mut data = lock(&self.data);
        let end = offset
            .checked_add(len)
            .filter(|end| *end <= data.len() as u64)
            .ok_or(crate::volume::RangeError::OutOfRange {
                offset,
                len,
                size: data.len() as u64,
            })?;
        data[offset as usize..end as usize].fill(0);
        Ok(())
    }

    async fn flush(&self) -> Result<(), DeviceError> {
        self.term().map(|_| ()).ok_or(DeviceError::Inactive)
    }

    async fn change(&self, change: Change, _: &Bond) -> Result<(), DeviceError> {
        change.run_once(self).await
    }

    fn size(&self) -> u64 {
        lock(&self.data).len() as u64
    }

    fn is_writable(&self) -> bool {
        self.term().is_some()
    }

    fn access(&self) -> Access {
        match self.term() {
            Some(term) => Access::ReadWrite { term },
            None => Access::ReadOnly,
        }
    }
}

#[async_trait]
impl WriterEngine for MemoryEngine {
    async fn activate(&self, term: Term) -> Result<(), DeviceError> {
        let delay = *lock(&self.activate_delay);
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        if self.fail_activate.load(Ordering::SeqCst) {
            return Err(DeviceError::Io("activation refused".into()));
        }
        *lock(&self.term) = Some(term);
        Ok(())
    }

    fn deactivate(&self) {
        *lock(&self.term) = None;
    }

    async fn settle(&self) -> Result<(), DeviceError> {
        self.term().map(|_| ()).ok_or(DeviceError::Inactive)
    }

    fn replicas(&self) -> Vec<ReplicaStatus> {
        vec![ReplicaStatus {
            id: NodeId::default(),
            state: ReplicaState::InSync,
            local: true,
        }]
    }
}

/// A node's own replica over a byte vector, in the in-sync set or not as
/// the test says. See the module docs.
pub struct MemoryCopy {
    data: Mutex<Vec<u8>>,
    in_sync: AtomicBool,
}

impl MemoryCopy {
    /// A copy holding `data`, in sync.
    pub fn new(data: Vec<u8>) -> Arc<Self> {
        Arc::new(Self {
            data: Mutex::new(data),
            in_sync: AtomicBool::new(true),
        })
    }

    /// Puts the copy in the committed in-sync set (`true`) or out of it.
    pub fn set_in_sync(&self, in_sync: bool) {
        self.in_sync.store(in_sync, Ordering::SeqCst);
    }
}

#[async_trait]
impl LocalCopy for MemoryCopy {
    fn in_sync(&self) -> bool {
        self.in_sync.load(Ordering::SeqCst)
    }

    async fn read(&self, offset: u64, len: u64) -> Result<Bytes, DeviceError> {
        let data = lock(&self.data);
        check_request(offset, len, data.len() as u64)?;
        Ok(Bytes::copy_from_slice(
            &data[offset as usize..(offset + len) as usize],
        ))
    }
}

/// An in-sync set kept in memory, for a single process and for tests.
/// The Raft coordinator provides the durable, committed one.
pub struct MemoryInSync {
    set: Mutex<BTreeSet<NodeId>>,
    fail: std::sync::atomic::AtomicBool,
    /// The committed size once a resize committed (none: the config's).
    size: Mutex<Option<u64>>,
    /// The writer whose changes commit, once one is recorded (none: any).
    writer: Mutex<Option<Term>>,
}

impl MemoryInSync {
    /// Starts with `members` in sync.
    pub fn new<I, S>(members: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<NodeId>,
    {
        Self {
            set: Mutex::new(members.into_iter().map(Into::into).collect()),
            fail: std::sync::atomic::AtomicBool::new(false),
            size: Mutex::new(None),
            writer: Mutex::new(None),
        }
    }

    /// Records `term` as the writer's: from now on a change on behalf of
    /// any other term is refused, as Raft refuses a deposed leader's.
    pub fn set_writer(&self, term: Term) {
        *self.writer.lock().unwrap_or_else(|p| p.into_inner()) = Some(term);
    }

    /// Makes every later commit (remove, add, resize) fail, as a deposed
    /// writer's commit would.
    pub fn fail_removals(&self, fail: bool) {
        self.fail.store(fail, std::sync::atomic::Ordering::SeqCst);
    }

    /// Applies `change` on behalf of the writer of `term` unless commits
    /// fail on command or another writer is recorded; the set after it.
    fn commit(
        &self,
        term: Term,
        change: impl FnOnce(&mut BTreeSet<NodeId>),
    ) -> Result<BTreeSet<NodeId>, InSyncError> {
        if self.fail.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(InSyncError::Refused("the fake refuses on command".into()));
        }
        let writer = *self.writer.lock().unwrap_or_else(|p| p.into_inner());
        if writer.is_some_and(|writer| writer != term) {
            return Err(InSyncError::Refused(format!(
                "{term} is not the writer's term"
            )));
        }
        let mut set = self.lock();
        change(&mut set);
        Ok(set.clone())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeSet<NodeId>> {
        self.set
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[async_trait]
impl InSyncTracker for MemoryInSync {
    async fn in_sync(&self) -> Result<BTreeSet<NodeId>, InSyncError> {
        Ok(self.lock().clone())
    }
    async fn remove(
        &self,
        term: Term,
        replicas: &BTreeSet<NodeId>,
    ) -> Result<BTreeSet<NodeId>, InSyncError> {
        self.commit(term, |set| set.retain(|member| !replicas.contains(member)))
    }
    async fn add(
        &self,
        term: Term,
        replicas: &BTreeSet<NodeId>,
    ) -> Result<BTreeSet<NodeId>, InSyncError> {
        self.commit(term, |set| set.extend(replicas.iter().cloned()))
    }
    async fn volume_size(&self) -> Result<Option<u64>, InSyncError> {
        Ok(*self.size.lock().unwrap_or_else(|p| p.into_inner()))
    }
    async fn resize(&self, term: Term, size: u64) -> Result<(), InSyncError> {
        self.commit(term, |_| ())?;
        let mut committed = self.size.lock().unwrap_or_else(|p| p.into_inner());
        if committed.is_some_and(|now| size < now) {
            return Err(InSyncError::Refused(format!("cannot shrink to {size}")));
        }
        *committed = Some(size);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn memory_in_sync_removes_and_refuses_on_command() {
        let set = MemoryInSync::new([NodeId(1), NodeId(2), NodeId(3)]);
        let removed: BTreeSet<NodeId> = [NodeId(2)].into();
        assert_eq!(set.remove(Term(1), &removed).await.unwrap().len(), 2);
        set.fail_removals(true);
        assert!(set.remove(Term(1), &removed).await.is_err());
        assert_eq!(set.in_sync().await.unwrap().len(), 2);
    }

    #[tokio::test]
    async fn memory_in_sync_refuses_a_deposed_writers_changes() {
        let set = MemoryInSync::new([NodeId(1), NodeId(2), NodeId(3)]);
        let removed: BTreeSet<NodeId> = [NodeId(2)].into();
        set.set_writer(Term(2));
        assert!(set.remove(Term(1), &removed).await.is_err());
        assert!(set.add(Term(1), &removed).await.is_err());
        assert_eq!(set.in_sync().await.unwrap().len(), 3);
        assert_eq!(set.remove(Term(2), &removed).await.unwrap().len(), 2);
    }
}
