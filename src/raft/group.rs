//! One Raft group on a node: its openraft instance over the group's trees
//! of the node's Raft Db ([`super::storage`]), its [`Peers`] over the
//! node's [`PeerBook`] (its own lease clock, S4), and its
//! [`RaftCoordinator`] (its writer's term and lease). Every group of a node
//! is started the same way, on the node's Raft runtime; the group's
//! failure detector ([`super::detector`]) is the caller's to run.

use std::sync::Arc;
use std::time::Duration;

use super::network::{Network, PeerBook, Peers};
use super::storage::RaftDb;
use super::{LogStore, MemberId, Raft, RaftCoordinator, RaftTiming, StateMachine};
use crate::ids::GroupId;

/// A running Raft group; see the module docs.
pub struct RaftGroup {
    /// The group's id.
    pub id: GroupId,
    /// Its openraft instance.
    pub raft: Raft,
    /// Its peers: its lease clock over the node's book.
    pub peers: Arc<Peers>,
    /// Its coordinator: the writer's term and lease.
    pub coordinator: Arc<RaftCoordinator>,
}

impl RaftGroup {
    /// Starts group `id` of member `member` on `runtime` (Raft's, see
    /// [`super::runtime`]), over `db` and
    /// `node`; once openraft has loaded a stored membership, if there is
    /// one (so that a peer asking whether this node has Raft state gets
    /// the truth at once).
    pub async fn start(
        id: GroupId,
        member: MemberId,
        db: &RaftDb,
        node: Arc<PeerBook>,
        timing: RaftTiming,
        runtime: &tokio::runtime::Handle,
    ) -> Result<Self, String> {
        let log_store = LogStore::of_group(db, id).map_err(|e| e.to_string())?;
        let state_machine = StateMachine::of_group(db, id)?;
        let peers = Peers::of_group(node, id, timing.election_max);
        let config = timing
            .raft_config(peers.cluster_id())
            .map_err(|e| format!("raft timing: {e}"))?;
        // Inside Raft's runtime, so the core and replication tasks that
        // openraft spawns live there.
        let raft = runtime
            .spawn({
                let network = Network::new(Arc::clone(&peers));
                let state_machine = state_machine.clone();
                async move {
                    Raft::new(member, Arc::new(config), network, log_store, state_machine).await
                }
            })
            .await
            .map_err(|e| format!("raft runtime task: {e}"))?
            .map_err(|e| format!("raft: {e}"))?;
        // openraft's metrics show the stored membership only once its core
        // has reported, so wait for that when there is state to show.
        if raft.is_initialized().await.map_err(|e| e.to_string())? {
            raft.wait(Some(Duration::from_secs(5)))
                .metrics(
                    |m| m.membership_config.membership().nodes().next().is_some(),
                    "the stored membership",
                )
                .await
                .map_err(|err| format!("Raft did not load its membership: {err}"))?;
        }
        let coordinator = {
            // The lease watcher is spawned here: on Raft's runtime.
            let _on_raft = runtime.enter();
            RaftCoordinator::start(raft.clone(), state_machine, Arc::clone(&peers), timing)
        };
        Ok(Self {
            id,
            raft,
            peers,
            coordinator,
        })
    }
}
