//! Embedded Raft: how the nodes elect their writer among themselves.
//!
//! The nodes run one openraft group over gRPC. Raft is touched only on
//! elections, promotions and in-sync changes: **no data write goes through
//! it**. Its state machine holds control data only ([`ControlState`]): the
//! cluster's identity and volume config, the last promoted writer and the
//! in-sync set.
//!
//! ## Why the term is a fencing token
//! openraft runs in standard leader-id mode (the `single-term-leader`
//! feature): a term has at most one leader, so the leader's term names one
//! writer and is a valid fencing token for the replicas (S2).
//!
//! ## The lease (S4)
//! openraft never steps a leader cut off from its quorum down by itself, so
//! [`RaftCoordinator`] keeps a lease of its own, **from send times**: the
//! lease of term T ends at the *send time* of the newest request of this
//! leader (an AppendEntries, heartbeat or append; not a vote request) that a
//! quorum — this node included — accepted in T, plus
//! `election_timeout_min − margin`. [`network`] records, per peer, the
//! instant taken just before sending each such request whose reply shows the
//! peer accepted our vote; the coordinator takes the quorum-th newest of
//! those for T. The deadline is therefore an absolute instant that only a
//! new acknowledgement moves: a stalled Raft core, a frozen process or a
//! timer that fires with nothing new reported cannot extend it.
//!
//! Why it holds: a peer that accepted a request sent at `s` did so at or
//! after `s`, and from then on it neither campaigns ([`detector`]: not
//! before `election_timeout_max` after its last leader contact, which it
//! records on exactly the replies we count) nor grants a vote to anyone
//! else (openraft's own vote lease, `election_timeout_max` after it
//! accepted the leader) until `s + election_timeout_min` at the earliest.
//! Every majority that could elect a new leader shares a node with the
//! acking quorum, so no new leader exists before `s +
//! election_timeout_min`. Why `_min` and not `_max`: a follower may itself
//! become the candidate, and openraft's own timer (were it on) could fire
//! after only `election_timeout_min`. The margin is slack for the peers'
//! clocks running fast against ours and their timers firing early; there
//! is no "reading delay" to cover, since no reported age is ever added to
//! the reader's clock.
//!
//! The heartbeat interval appears nowhere in this bound: heartbeats only
//! give the quorum something to acknowledge, so their rate sets how often
//! the deadline can move forward (and so how late an answer may come
//! before the lease runs out between two), never how far. Likewise the
//! coordinator recomputing the lease on every acknowledgement, vote,
//! state or membership change and at the deadline, rather than at every
//! turn of openraft's loop, changes when it looks, not what it computes.
//!
//! A node forgets when it last heard a leader when it restarts, so a node
//! neither votes nor campaigns during its first `election_timeout_max`
//! (see [`network`]). A node whose persisted vote made it leader is
//! restored by openraft as leader of that same term at start-up; that is
//! safe (the term still has one leader) and its lease again needs fresh
//! quorum acknowledgements, but it means a full restart need not raise the
//! term: terms never go back, they do not always go up. A writer never
//! writes twice at one term, though: a node that finds itself the recorded
//! writer of the very term it leads resigns for a fresh one (see
//! [`crate::ha::Controller`]; a sole voter excepted), and the state machine
//! refuses a `Promote` of another node at a recorded term.
//!
//! ## Layout
//! - [`log_store`]: the sled log (entries, vote, committed, purged); every
//!   append and vote is flushed before it is acknowledged (S7).
//! - [`state_machine`]: the control state and snapshots, in the same sled Db.
//! - [`group`]: one Raft group on a node (openraft, its peers, its
//!   coordinator), started the same way for every group.
//! - [`storage`]: the node's Raft Db shared by its groups: a set of trees
//!   per group and one grouped flusher.
//! - [`volume_table`]: the cluster's volume table (names, sizes, copies,
//!   placement, each volume's group), pure logic for the cluster group.
//! - [`network`]: the tonic client and server for Raft's RPCs.
//! - [`detector`]: the failure detector that starts elections.
//! - [`heartbeat`]: the node's one heartbeat clock, which has every group
//!   it leads send its heartbeats at once (they travel together).
//! - [`coordinator`]: [`RaftCoordinator`], the `Coordinator` and
//!   `InSyncTracker` of the core.
//! - [`runtime`]: the threads all of the above run on, apart from the data
//!   plane, so that no heartbeat waits behind a data write (see there).

pub mod coordinator;
pub mod detector;
pub mod group;
pub mod heartbeat;
pub mod log_store;
pub mod network;
pub mod runtime;
pub mod state_machine;
pub mod storage;
pub mod volume_table;

use std::collections::BTreeSet;
use std::io::Cursor;

use serde::{Deserialize, Serialize};

use crate::ids::{GroupId, VolumeId};
use crate::volume::VolumeSpec;
use volume_table::{Offer, VolumeEntry, VolumeRequest, VolumeTable};

pub use coordinator::{RaftCoordinator, RaftTiming};
pub use log_store::LogStore;
pub use state_machine::StateMachine;
pub use storage::RaftDb;

pub use crate::ids::{Incarnation, MemberId, NodeId, Term};

openraft::declare_raft_types!(
    /// The openraft type configuration of replica-ha. Raft names its
    /// members by [`MemberId`] (node and incarnation, S8), and keeps each
    /// member's address in the membership.
    pub TypeConfig:
        D = Request,
        R = Response,
        NodeId = MemberId,
        Node = MemberNode,
        Entry = openraft::Entry<TypeConfig>,
        SnapshotData = Cursor<Vec<u8>>,
        AsyncRuntime = openraft::TokioRuntime,
);

/// What the membership records of a member besides its id: where its gRPC
/// listener is. Empty for the members of a cluster formed from the peer
/// list before addresses were recorded (the peer list then has it); the
/// serialised form of openraft's `EmptyNode`, `{}`, reads as that.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberNode {
    /// `HOST:PORT` of the member's gRPC listener.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub addr: String,
}

impl std::fmt::Display for MemberNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.addr)
    }
}

/// The openraft instance of a node.
pub type Raft = openraft::Raft<TypeConfig>;

/// A promoted writer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriterRecord {
    /// Its node id.
    pub node: NodeId,
    /// The term it writes with.
    pub term: Term,
}

/// A change to the control state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    /// Fixes the cluster's volume config and the first in-sync set (every
    /// replica). Only the first is applied; a later one that differs fails.
    Init {
        /// The config.
        volume: VolumeSpec,
        /// Every replica's node id.
        replicas: BTreeSet<NodeId>,
        /// The cluster's uuid, drawn by the first leader (empty in an
        /// entry written before there were uuids).
        #[serde(default, skip_serializing_if = "String::is_empty")]
        uuid: String,
    },
    /// Records `node` as the writer of `term`. Refused if a writer of this
    /// or a newer term is already recorded: each term has one stint.
    Promote(WriterRecord),
    /// Removes replicas from the in-sync set on behalf of the writer of
    /// `term`. Refused for a writer older than the recorded one.
    ShrinkInSync {
        /// The writer's term.
        term: Term,
        /// The replicas to remove.
        remove: BTreeSet<NodeId>,
    },
    /// Returns rebuilt replicas to the in-sync set on behalf of the writer
    /// of `term`. Refused unless `term` is the recorded writer's own term:
    /// only the writer that rebuilt them knows they hold every write it
    /// acknowledged (S5).
    GrowInSync {
        /// The writer's term.
        term: Term,
        /// The replicas to add.
        add: BTreeSet<NodeId>,
    },
    /// Grows the volume to `size` bytes on behalf of the writer of `term`,
    /// which has grown every in-sync replica first. Refused unless `term`
    /// is the recorded writer's, or if `size` is below the committed size
    /// (a volume never shrinks).
    Resize {
        /// The writer's term.
        term: Term,
        /// The new size in bytes.
        size: u64,
    },
    /// Creates a volume in the cluster group's table ([`volume_table`]),
    /// placed over the members' `offers`. Idempotent by name; the name of
    /// the volume the cluster group itself carries is taken.
    CreateVolume {
        /// What the operator asked for.
        volume: VolumeRequest,
        /// Every member's room, as the leader gathered it.
        offers: Vec<Offer>,
    },
    /// Removes a volume from the cluster group's table.
    DeleteVolume {
        /// Its name.
        name: VolumeId,
    },
    /// Moves volume `name`'s copy from node `from` to node `to` in the
    /// cluster group's table (`volume move`, or a removed node's copies);
    /// `free` is `to`'s room as the leader asked it. The volume's group
    /// follows the new placement (see `node::placement`).
    MoveVolume {
        /// Its name.
        name: VolumeId,
        /// The node whose copy leaves.
        from: NodeId,
        /// The node that gets a copy.
        to: NodeId,
        /// `to`'s free bytes; none when it did not say.
        free: Option<u64>,
    },
    /// Records in the cluster group's table that volume `name` of group
    /// `group` grew to `size` bytes, once its own group committed that
    /// size ([`Request::Resize`] there). Refused for another group's
    /// volume of that name, and below the recorded size.
    ResizeVolume {
        /// Its name.
        name: VolumeId,
        /// Its group.
        group: GroupId,
        /// The size its group committed.
        size: u64,
    },
}

/// What applying a [`Request`] did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Response {
    /// Whether the request was applied.
    pub applied: bool,
    /// Why not, if it was not.
    pub refused: Option<String>,
    /// The in-sync set after the request.
    pub in_sync: BTreeSet<NodeId>,
    /// The volume a `CreateVolume` created or found, or a `DeleteVolume`
    /// removed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume: Option<VolumeEntry>,
    /// Whether a `CreateVolume` created the volume now (not found it).
    #[serde(default)]
    pub created: bool,
}

impl Response {
    /// An entry that was applied and changed nothing a response reports.
    pub fn done(control: &ControlState) -> Self {
        Self {
            applied: true,
            in_sync: control.in_sync.clone(),
            ..Self::default()
        }
    }
}

/// The replicated control data. See the module docs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct ControlState {
    /// The volume config, once the first leader has fixed it.
    pub volume: Option<VolumeSpec>,
    /// The last promoted writer.
    pub writer: Option<WriterRecord>,
    /// The replicas that hold every acknowledged write.
    pub in_sync: BTreeSet<NodeId>,
    /// The cluster's uuid, fixed with the volume config at the first
    /// bootstrap (none for a cluster formed before there were uuids).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    /// The volume's size once it has been resized online; until then the
    /// size is the one the volume config was created with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
    /// The volume table: every volume but the one this group carries
    /// (cluster group only; see [`volume_table`]).
    #[serde(default, skip_serializing_if = "VolumeTable::is_pristine")]
    pub volumes: VolumeTable,
}

impl ControlState {
    /// The volume's committed size: the last resize's, else the size the
    /// volume was created with (none before the volume config is fixed).
    pub fn volume_size(&self) -> Option<u64> {
        self.size.or(self.volume.as_ref().map(|v| v.size))
    }

    /// Applies `request`; pure, so every node computes the same result.
    pub fn apply(&mut self, request: &Request) -> Response {
        let (mut volume, mut created) = (None, false);
        let refused = match request {
            Request::Init {
                volume,
                replicas,
                uuid,
            } => match &self.volume {
                None => {
                    self.volume = Some(volume.clone());
                    self.in_sync = replicas.clone();
                    self.uuid = (!uuid.is_empty()).then(|| uuid.clone());
                    None
                }
                Some(existing) if existing == volume => None,
                Some(existing) => {
                    Some(format!("the cluster is already configured as {existing:?}"))
                }
            },
            Request::Promote(writer) => match self.writer {
                // The same node again at its recorded term: a sole voter
                // (see the controller); any other node, or an older term,
                // is refused.
                Some(current) if current == *writer => None,
                Some(current) if current.term >= writer.term => Some(format!(
                    "writer {} of term {} is recorded; term {} cannot be promoted (again)",
                    current.node, current.term, writer.term
                )),
                _ => {
                    self.writer = Some(*writer);
                    None
                }
            },
            Request::ShrinkInSync { term, remove } => match self.writer {
                Some(current) if current.term > *term => Some(format!(
                    "writer of term {term} was superseded by term {}",
                    current.term
                )),
                _ => {
                    self.in_sync.retain(|id| !remove.contains(id));
                    None
                }
            },
            Request::GrowInSync { term, add } => match self.writer {
                Some(current) if current.term == *term => {
                    self.in_sync.extend(add.iter().copied());
                    None
                }
                current => Some(format!(
                    "only the writer of term {term} may grow the in-sync set; the recorded writer is {current:?}"
                )),
            },
            Request::Resize { term, size } => match (self.writer, self.volume_size()) {
                (Some(current), _) if current.term != *term => Some(format!(
                    "only the writer of term {term} may resize the volume; the recorded writer is {current:?}"
                )),
                (_, None) => Some("the volume config is not fixed yet".into()),
                (_, Some(now)) if *size < now => Some(format!(
                    "the volume is {now} bytes; it cannot shrink to {size}"
                )),
                (None, _) => Some("no writer is recorded".into()),
                (Some(_), Some(_)) => {
                    self.size = Some(*size);
                    None
                }
            },
            Request::CreateVolume {
                volume: asked,
                offers,
            } => match self.carries(&asked.name) {
                true => Some(format!(
                    "volume {} is the cluster group's own (the nodes' configured volume)",
                    asked.name
                )),
                false => match self.volumes.create(asked, offers) {
                    Ok((entry, now)) => {
                        (volume, created) = (Some(entry.clone()), now);
                        None
                    }
                    Err(err) => Some(err.to_string()),
                },
            },
            Request::DeleteVolume { name } => match self.carries(&name.0) {
                true => Some(format!(
                    "volume {name} is the cluster group's own and cannot be deleted"
                )),
                false => match self.volumes.delete(name) {
                    Ok(entry) => {
                        volume = Some(entry);
                        None
                    }
                    Err(err) => Some(err.to_string()),
                },
            },
            Request::MoveVolume {
                name,
                from,
                to,
                free,
            } => match self.volumes.move_copy(name, *from, *to, *free) {
                Ok(entry) => {
                    volume = Some(entry.clone());
                    None
                }
                Err(err) => Some(err.to_string()),
            },
            Request::ResizeVolume { name, group, size } => {
                match self.volumes.grow(name, *group, *size) {
                    Ok(entry) => {
                        volume = Some(entry.clone());
                        None
                    }
                    Err(err) => Some(err.to_string()),
                }
            }
        };
        Response {
            applied: refused.is_none(),
            refused,
            in_sync: self.in_sync.clone(),
            volume,
            created,
        }
    }

    /// Whether `name` is the volume this group carries itself.
    fn carries(&self, name: &str) -> bool {
        self.volume.as_ref().is_some_and(|v| v.name == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn volume(size: u64) -> VolumeSpec {
        VolumeSpec::new("c", "v", size, 2)
    }

    #[test]
    fn a_control_state_and_an_init_entry_of_the_older_format_still_read() {
        let state = r#"{"volume":{"cluster_id":"c","volume":"v","size":4096,"min_in_sync":2},"writer":{"node":1,"term":4},"in_sync":[1,2]}"#;
        let state: ControlState = serde_json::from_str(state).unwrap();
        assert_eq!(state.volume, Some(volume(4096)));
        assert_eq!(
            state.writer,
            Some(WriterRecord {
                node: NodeId(1),
                term: Term(4)
            })
        );
        let init = r#"{"Init":{"volume":{"cluster_id":"c","volume":"v","size":4096,"min_in_sync":2},"replicas":[1,2,3]}}"#;
        let init: Request = serde_json::from_str(init).unwrap();
        assert!(matches!(init, Request::Init { volume: v, .. } if v == volume(4096)));
    }

    #[test]
    fn terms_keep_the_bare_number_in_log_entries() {
        let promote = Request::Promote(WriterRecord {
            node: NodeId(1),
            term: Term(4),
        });
        let text = r#"{"Promote":{"node":1,"term":4}}"#;
        assert_eq!(serde_json::to_string(&promote).unwrap(), text);
        assert_eq!(serde_json::from_str::<Request>(text).unwrap(), promote);
        let shrink = Request::ShrinkInSync {
            term: Term(4),
            remove: [NodeId(3)].into(),
        };
        let text = r#"{"ShrinkInSync":{"term":4,"remove":[3]}}"#;
        assert_eq!(serde_json::to_string(&shrink).unwrap(), text);
        assert_eq!(serde_json::from_str::<Request>(text).unwrap(), shrink);
    }

    #[test]
    fn only_the_recorded_writer_grows_the_volume_and_it_never_shrinks() {
        let mut state = ControlState::default();
        let resize = |term, size| Request::Resize {
            term: Term(term),
            size,
        };
        assert!(!state.apply(&resize(4, 8192)).applied, "no volume yet");
        state.apply(&Request::Init {
            volume: volume(4096),
            replicas: [NodeId(1)].into(),
            uuid: String::new(),
        });
        state.apply(&Request::Promote(WriterRecord {
            node: NodeId(1),
            term: Term(4),
        }));
        assert_eq!(state.volume_size(), Some(4096));
        let older = state.apply(&resize(3, 8192));
        assert!(older.refused.unwrap().contains("only the writer of term 3"));
        assert!(state.apply(&resize(4, 8192)).applied);
        assert_eq!(state.volume_size(), Some(8192));
        let shrink = state.apply(&resize(4, 4096));
        assert!(shrink.refused.unwrap().contains("cannot shrink"));
        assert_eq!(state.volume_size(), Some(8192));
        // The same size again is no change, and allowed (a retry).
        assert!(state.apply(&resize(4, 8192)).applied);
        // The created size stays what the config is checked against.
        assert_eq!(state.volume.as_ref().map(|v| v.size), Some(4096));
    }

    #[test]
    fn a_volume_recorded_without_an_extent_size_reads_with_the_default() {
        let old = r#"{"cluster_id":"c","volume":"v","size":4096,"min_in_sync":2}"#;
        let spec: VolumeSpec = serde_json::from_str(old).unwrap();
        assert_eq!(spec, volume(4096));
    }

    #[test]
    fn only_the_recorded_writer_grows_the_in_sync_set() {
        let mut state = ControlState::default();
        state.apply(&Request::Init {
            volume: volume(4096),
            replicas: [NodeId(1), NodeId(2), NodeId(3)].into(),
            uuid: String::new(),
        });
        state.apply(&Request::Promote(WriterRecord {
            node: NodeId(1),
            term: Term(4),
        }));
        state.apply(&Request::ShrinkInSync {
            term: Term(4),
            remove: [NodeId(3)].into(),
        });
        for stale in [Term(3), Term(5)] {
            let grow = Request::GrowInSync {
                term: stale,
                add: [NodeId(3)].into(),
            };
            assert!(!state.apply(&grow).applied, "term {stale}");
        }
        assert_eq!(state.in_sync, [NodeId(1), NodeId(2)].into());
        let grow = Request::GrowInSync {
            term: Term(4),
            add: [NodeId(3)].into(),
        };
        assert_eq!(
            state.apply(&grow).in_sync,
            [NodeId(1), NodeId(2), NodeId(3)].into()
        );
    }

    #[test]
    fn the_first_init_wins_and_a_different_one_is_refused() {
        let mut state = ControlState::default();
        let init = Request::Init {
            volume: volume(4096),
            replicas: [NodeId(1), NodeId(2), NodeId(3)].into(),
            uuid: String::new(),
        };
        assert!(state.apply(&init).applied);
        assert!(state.apply(&init).applied, "the same init is idempotent");
        let other = Request::Init {
            volume: volume(8192),
            replicas: [NodeId(1), NodeId(2), NodeId(3)].into(),
            uuid: String::new(),
        };
        let response = state.apply(&other);
        assert!(!response.applied);
        assert_eq!(state.volume, Some(volume(4096)));
    }

    #[test]
    fn promotions_and_shrinks_from_an_older_writer_are_refused() {
        let mut state = ControlState::default();
        state.apply(&Request::Init {
            volume: volume(4096),
            replicas: [NodeId(1), NodeId(2), NodeId(3)].into(),
            uuid: String::new(),
        });
        assert!(
            state
                .apply(&Request::Promote(WriterRecord {
                    node: NodeId(1),
                    term: Term(5)
                }))
                .applied
        );
        assert!(
            !state
                .apply(&Request::Promote(WriterRecord {
                    node: NodeId(2),
                    term: Term(4)
                }))
                .applied
        );
        assert!(
            !state
                .apply(&Request::Promote(WriterRecord {
                    node: NodeId(3),
                    term: Term(5)
                }))
                .applied,
            "another node at a recorded term"
        );
        let stale = Request::ShrinkInSync {
            term: Term(4),
            remove: [NodeId(3)].into(),
        };
        assert!(!state.apply(&stale).applied);
        assert_eq!(state.in_sync, [NodeId(1), NodeId(2), NodeId(3)].into());
        let shrink = Request::ShrinkInSync {
            term: Term(5),
            remove: [NodeId(3)].into(),
        };
        assert_eq!(state.apply(&shrink).in_sync, [NodeId(1), NodeId(2)].into());
    }

    fn offers() -> Vec<Offer> {
        (1..=3)
            .map(|n| Offer {
                member: MemberId::new(NodeId(n), Incarnation(n)),
                free: Some(1 << 40),
            })
            .collect()
    }

    fn create(name: &str) -> Request {
        Request::CreateVolume {
            volume: VolumeRequest {
                name: name.into(),
                size: 1 << 30,
                copies: 3,
                min_in_sync: 2,
            },
            offers: offers(),
        }
    }

    #[test]
    fn the_cluster_group_keeps_the_volume_table_and_its_own_volume_is_taken() {
        let mut state = ControlState::default();
        state.apply(&Request::Init {
            volume: volume(4096),
            replicas: [NodeId(1), NodeId(2), NodeId(3)].into(),
            uuid: String::new(),
        });
        let taken = state.apply(&create("v"));
        assert!(taken.refused.unwrap().contains("cluster group's own"));
        let made = state.apply(&create("db"));
        assert!(made.applied && made.created);
        let entry = made.volume.unwrap();
        assert_eq!(entry.group, volume_table::FIRST_NEW_GROUP);
        assert_eq!(entry.founders.len(), 3);
        let again = state.apply(&create("db"));
        assert!(again.applied && !again.created, "idempotent by name");
        assert_eq!(again.volume, Some(entry.clone()));
        // A size its group committed is recorded; the group's own volume
        // is no entry of the table.
        let grow = |name: &str, size| Request::ResizeVolume {
            name: VolumeId(name.into()),
            group: entry.group,
            size,
        };
        let grown = state.apply(&grow("db", 2 << 30));
        assert_eq!(grown.volume.map(|v| v.size), Some(2 << 30));
        assert!(!state.apply(&grow("db", 1 << 30)).applied, "never shrinks");
        assert!(!state.apply(&grow("v", 1 << 30)).applied);
        let text = r#"{"ResizeVolume":{"name":"db","group":1,"size":4096}}"#;
        assert!(matches!(
            serde_json::from_str::<Request>(text).unwrap(),
            Request::ResizeVolume { size: 4096, .. }
        ));
        let own = state.apply(&Request::DeleteVolume {
            name: VolumeId("v".into()),
        });
        assert!(!own.applied);
        let gone = state.apply(&Request::DeleteVolume {
            name: VolumeId("db".into()),
        });
        assert!(gone.applied);
        assert!(state.volumes.is_empty());
        // A table emptied by deletions still knows the groups it gave out:
        // restored from its written form, it gives the next volume a new
        // group, the same as on a node that never restarted.
        let restored: ControlState =
            serde_json::from_str(&serde_json::to_string(&state).unwrap()).unwrap();
        assert_eq!(restored, state);
        let mut restored = restored;
        let next = restored.apply(&create("db2")).volume.unwrap().group;
        assert_eq!(next, GroupId(2));
        // A table that never had a volume is not written: the state reads
        // as before.
        let text = serde_json::to_string(&ControlState::default()).unwrap();
        assert!(!text.contains("volumes"), "{text}");
    }
}
