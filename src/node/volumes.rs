//! Volume changes through the cluster group (group 0): what `volume
//! create` and `volume delete` do on the node that leads it, and the
//! table `volume list` shows.
//!
//! Creation, on the leader:
//! 1. The request is completed with the defaults (3 copies, or every node
//!    when there are fewer; `min_in_sync` 2, or 1 for a single copy) and
//!    checked against the table as it stands, so that a bad name, size or
//!    copy count gets its own error before anything is proposed.
//! 2. Every member of the cluster group is asked (`Node.Hello`) for its
//!    room and what its build knows. A member that answers without
//!    [`FEATURE_GROUPS`] would fail to apply the table entry (and would take
//!    another group's messages for group 0's), so nothing is created while
//!    one does. Before the first volume of the table, every member must
//!    answer; after it, every member has said so once, and one that does
//!    not answer now is only left out of the placement.
//! 3. `CreateVolume` is committed in the leader's term, with the offers;
//!    applying it places the copies and records the founders
//!    ([`crate::raft::volume_table`]), the same on every node. A client
//!    that asks again gets the same volume (idempotent by name).
//!
//! Growth (`volume resize`) runs on the volume's writer and is recorded in
//! the table by the cluster group's leader: see [`sizes`].

mod moves;
mod sizes;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use openraft::ServerState;

use super::hello::{FEATURE_GROUPS, FEATURES, free_bytes};
use super::host::HostedVolumes;
use crate::api::admin::{VolumeChanges, VolumeError, VolumeState};
use crate::ha::HaError;
use crate::ids::{GroupId, MemberId, NodeId, Term, VolumeId};
use crate::net::Transport;
use crate::raft::volume_table::{Offer, VolumeEntry, VolumeRequest};
use crate::raft::{RaftCoordinator, Request};
use crate::replica::peer::channels::{hello, hello_counting};

/// How long a member may take to say how much room it has.
const OFFER_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a change waits for the cluster group to have a leader.
const ELECTION_WAIT: Duration = Duration::from_secs(3);

/// The default copy count, when the cluster has that many nodes.
pub const DEFAULT_COPIES: usize = 3;

/// The default `min_in_sync`, when the volume has that many copies.
pub const DEFAULT_MIN_IN_SYNC: usize = 2;

/// The volume table's changes on this node; see the module docs.
pub struct VolumeTableChanges {
    /// The cluster group's coordinator.
    cluster: Arc<RaftCoordinator>,
    transport: Transport,
    cluster_id: String,
    /// This node's data dir: its own room.
    data_dir: PathBuf,
    /// Every node's gRPC address from this node's peer list: where it
    /// reaches a member now, before the address the membership recorded
    /// (a node restarted on another port, an upgrade's new addresses),
    /// as [`crate::raft::network::PeerBook::address`] dials.
    configured: BTreeMap<NodeId, String>,
    /// The table's volumes this node runs.
    hosted: HostedVolumes,
    /// Whether this node writes the cluster group's own volume now.
    own_writing: Option<Box<dyn Fn() -> bool + Send + Sync>>,
}

impl VolumeTableChanges {
    /// The changes made through `cluster` (group 0's coordinator).
    pub fn new(
        cluster: Arc<RaftCoordinator>,
        transport: Transport,
        cluster_id: String,
        data_dir: PathBuf,
        configured: BTreeMap<NodeId, String>,
        hosted: HostedVolumes,
    ) -> Self {
        Self {
            cluster,
            transport,
            cluster_id,
            data_dir,
            configured,
            hosted,
            own_writing: None,
        }
    }

    /// Tells whether this node writes the cluster group's own volume by
    /// `writing`.
    pub fn with_own_writer(mut self, writing: impl Fn() -> bool + Send + Sync + 'static) -> Self {
        self.own_writing = Some(Box::new(writing));
        self
    }

    /// The voters of the cluster group with their gRPC addresses: the
    /// peer list's, else the membership's record (a node added at run
    /// time).
    fn members(&self) -> BTreeMap<MemberId, String> {
        let applied = self.cluster.state_machine().current();
        let membership = applied.membership.membership();
        membership
            .nodes()
            .filter(|(member, _)| membership.voter_ids().any(|voter| voter == **member))
            .map(|(member, node)| {
                let addr = self
                    .configured
                    .get(&member.node())
                    .cloned()
                    .unwrap_or_else(|| node.addr.clone());
                (*member, addr)
            })
            .collect()
    }

    /// Every voter's gRPC address, by node (see [`Self::members`]).
    fn addresses(&self) -> BTreeMap<NodeId, String> {
        let members = self.members().into_iter();
        members
            .map(|(member, addr)| (member.node(), addr))
            .collect()
    }

    /// The term this node leads the cluster group in, or who leads it.
    /// While no leader is known (an election), waits up to
    /// [`ELECTION_WAIT`] for one.
    async fn leading(&self) -> Result<Term, VolumeError> {
        let _ = self
            .cluster
            .raft()
            .wait(Some(ELECTION_WAIT))
            .metrics(|m| m.current_leader.is_some(), "a cluster leader")
            .await;
        let metrics = self.cluster.raft().metrics().borrow().clone();
        let me = self.cluster.member();
        if metrics.state == ServerState::Leader && metrics.current_leader == Some(me) {
            return Ok(Term(metrics.current_term));
        }
        let leader = metrics.current_leader.map(|leader| {
            let addr = self.members().get(&leader).cloned().unwrap_or_default();
            (leader.node(), addr)
        });
        Err(VolumeError::NotLeader(
            leader.filter(|(_, addr)| !addr.is_empty()),
        ))
    }

    /// Every member's offer of room (see the module docs, step 2).
    async fn offers(
        &self,
        members: &BTreeMap<MemberId, String>,
    ) -> Result<Vec<Offer>, VolumeError> {
        let first = self
            .cluster
            .state_machine()
            .current()
            .control
            .volumes
            .is_empty();
        let mut offers = Vec::new();
        for (member, answer) in self.answers(members).await {
            let free = match answer {
                Ok((features, _)) if features & FEATURE_GROUPS == 0 => {
                    return Err(VolumeError::Refused(format!(
                        "node {} runs an earlier build that knows no volume groups; upgrade \
                         every node before creating volumes",
                        member.node()
                    )));
                }
                Ok((_, free)) => free,
                Err(why) if first => {
                    return Err(VolumeError::Refused(format!(
                        "node {} did not answer ({why}); before the first volume is created \
                         every member must say that it knows volume groups",
                        member.node()
                    )));
                }
                Err(why) => {
                    tracing::info!(node = %member.node(), %why, "left out of the placement");
                    None
                }
            };
            offers.push(Offer { member, free });
        }
        Ok(offers)
    }

    /// What each of `members` says of itself (`Node.Hello`): the features
    /// its build knows and its free bytes, or why it did not answer.
    async fn answers(
        &self,
        members: &BTreeMap<MemberId, String>,
    ) -> Vec<(MemberId, Result<(u64, Option<u64>), String>)> {
        let me = self.cluster.member();
        let asks = members.iter().map(|(member, addr)| async move {
            if *member == me {
                return (*member, Ok((FEATURES, free_bytes(&self.data_dir))));
            }
            let reply = hello(
                &self.transport,
                &self.cluster_id,
                me.node(),
                member.node(),
                addr,
                OFFER_TIMEOUT,
            )
            .await;
            let answer = reply.map_err(|err| err.to_string()).and_then(|reply| {
                match MemberId(reply.member) == *member {
                    true => Ok((reply.features, Some(reply.free_bytes))),
                    false => Err(format!(
                        "it runs as {}, not as the member {member} the cluster names",
                        MemberId(reply.member)
                    )),
                }
            });
            (*member, answer)
        });
        futures::future::join_all(asks).await
    }

    /// Refuses to delete `entry` while a node that holds a copy serves it
    /// to an NBD client, or cannot say whether it does.
    async fn refuse_if_in_use(&self, entry: &VolumeEntry) -> Result<(), VolumeError> {
        let me = self.cluster.member();
        let members = self.members();
        let asks = members
            .iter()
            .filter(|(member, _)| entry.placement.contains(&member.node()))
            .map(|(member, addr)| async move {
                let node = member.node();
                let counted = hello_counting(
                    &self.transport,
                    &self.cluster_id,
                    me.node(),
                    (node, addr),
                    OFFER_TIMEOUT,
                    &entry.id.0,
                )
                .await;
                (node, counted.map(|reply| reply.sessions))
            });
        for (node, counted) in futures::future::join_all(asks).await {
            let why = match counted {
                Ok(0) => continue,
                Ok(clients) => format!("{clients} NBD client(s) use it on node {node}"),
                Err(err) => format!("node {node} cannot say whether a client uses it ({err})"),
            };
            return Err(VolumeError::Refused(format!(
                "volume {} is not deleted: {why}; disconnect them, or delete with --force",
                entry.id
            )));
        }
        Ok(())
    }

    /// Commits `request` in `term`; a refusal is the table's.
    async fn commit(
        &self,
        term: Term,
        request: Request,
    ) -> Result<crate::raft::Response, VolumeError> {
        self.cluster
            .commit(term, request)
            .await
            .map_err(|err| match err {
                HaError::Refused(why) => VolumeError::Refused(why),
                other => VolumeError::Failed(format!(
                    "the change was not committed ({other}); ask again"
                )),
            })
    }
}

/// `request` with its defaults filled in, for a cluster of `nodes` nodes.
pub fn with_defaults(mut request: VolumeRequest, nodes: usize) -> VolumeRequest {
    if request.copies == 0 {
        request.copies = DEFAULT_COPIES.min(nodes.max(1));
    }
    if request.min_in_sync == 0 {
        request.min_in_sync = DEFAULT_MIN_IN_SYNC.min(request.copies);
    }
    request
}

#[async_trait::async_trait]
impl VolumeChanges for VolumeTableChanges {
    async fn list(&self) -> Vec<VolumeState> {
        let applied = self.cluster.state_machine().current();
        let hosted = self.hosted.views().await;
        let status = self.cluster.status();
        let own = applied.control.volume.as_ref().map(|spec| {
            let members: Vec<_> = self.members().into_keys().collect();
            VolumeEntry {
                id: VolumeId(spec.name.clone()),
                size: applied.control.volume_size().unwrap_or(spec.size),
                copies: members.len(),
                min_in_sync: spec.min_in_sync,
                placement: members.iter().map(|m| m.node()).collect(),
                founders: Default::default(),
                group: GroupId::FIRST,
                preferred: None,
            }
        });
        let own = own.map(|entry| VolumeState {
            entry,
            leader: status.leader,
            term: status.term.0,
            writing: self.own_writing.as_ref().is_some_and(|writing| writing()),
        });
        let preferred = applied.control.volumes.preferred_writers();
        let table = applied.control.volumes.volumes().map(|entry| {
            let seen = hosted
                .get(&entry.id)
                .filter(|view| view.group == entry.group);
            VolumeState {
                // A volume the build before made has its preference
                // computed (see `raft::volume_table`).
                entry: VolumeEntry {
                    preferred: preferred.get(&entry.id).copied(),
                    ..entry.clone()
                },
                leader: seen.and_then(|view| view.leader),
                term: seen.map_or(0, |view| view.term),
                writing: seen.is_some_and(|view| view.writing),
            }
        });
        own.into_iter().chain(table).collect()
    }

    async fn create(&self, request: VolumeRequest) -> Result<(VolumeEntry, bool), VolumeError> {
        let term = self.leading().await?;
        let joint = self
            .cluster
            .state_machine()
            .current()
            .membership
            .membership()
            .get_joint_config()
            .len()
            > 1;
        if joint {
            // Both incarnations of a replaced node are voters meanwhile;
            // the old one must not become a founder.
            return Err(VolumeError::Refused(
                "a membership change is in progress; create the volume once it is done".into(),
            ));
        }
        let members = self.members();
        let request = with_defaults(request, members.len());
        let control = self.cluster.state_machine().current().control;
        if control
            .volume
            .as_ref()
            .is_some_and(|v| v.name == request.name)
        {
            return Err(VolumeError::ClusterVolume(request.name));
        }
        // The table's own checks first, with every member assumed to have
        // room: a bad request gets its own error before anyone is asked.
        let assumed: Vec<_> = members
            .keys()
            .map(|member| Offer {
                member: *member,
                free: Some(u64::MAX),
            })
            .collect();
        control.volumes.clone().create(&request, &assumed)?;
        let offers = self.offers(&members).await?;
        let mut check = control.volumes.clone();
        check.create(&request, &offers)?;
        let response = self
            .commit(
                term,
                Request::CreateVolume {
                    volume: request,
                    offers,
                },
            )
            .await?;
        let volume = response
            .volume
            .ok_or_else(|| VolumeError::Failed("the table returned no volume".into()))?;
        Ok((volume, response.created))
    }

    async fn delete(&self, name: VolumeId, force: bool) -> Result<VolumeEntry, VolumeError> {
        let term = self.leading().await?;
        let control = self.cluster.state_machine().current().control;
        if control.volume.as_ref().is_some_and(|v| v.name == name.0) {
            return Err(VolumeError::Refused(format!(
                "volume {name} is the cluster group's own and cannot be deleted"
            )));
        }
        let Some(entry) = control.volumes.get(&name) else {
            return Err(crate::raft::volume_table::TableError::Unknown(name).into());
        };
        if !force {
            self.refuse_if_in_use(entry).await?;
        }
        let response = self.commit(term, Request::DeleteVolume { name }).await?;
        response
            .volume
            .ok_or_else(|| VolumeError::Failed("the table returned no volume".into()))
    }

    async fn resize(&self, name: VolumeId, size: u64) -> Result<(u64, u64), VolumeError> {
        self.grow(name, size).await
    }

    async fn move_copy(
        &self,
        name: VolumeId,
        from: NodeId,
        to: NodeId,
    ) -> Result<VolumeEntry, VolumeError> {
        self.move_copy_now(name, from, to).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn asked(copies: usize, min_in_sync: usize) -> VolumeRequest {
        VolumeRequest {
            name: "v".into(),
            size: 4096,
            copies,
            min_in_sync,
        }
    }

    #[test]
    fn defaults_are_three_copies_and_two_in_sync_or_what_the_cluster_has() {
        let filled = |copies, min, nodes| {
            let r = with_defaults(asked(copies, min), nodes);
            (r.copies, r.min_in_sync)
        };
        assert_eq!(filled(0, 0, 5), (3, 2));
        assert_eq!(filled(0, 0, 2), (2, 2));
        assert_eq!(filled(0, 0, 1), (1, 1));
        assert_eq!(filled(5, 0, 5), (5, 2));
        assert_eq!(filled(2, 1, 5), (2, 1));
    }
}
