//! `replica-ha status --json`: a status reply as one JSON object, for
//! scripts (`cluster/up` looks for `"active":true`; the tests read
//! `role`, `active`, `reads`, `replicas`, ...).
//!
//! The object is a contract: keys, nesting and value types stay as they
//! are, and a new fact is a new key. `volumes` lists every volume, the
//! configured one first (empty from a node of an earlier build), each
//! with its `replicas` as the top level has them. An id or time that a reply gives as 0
//! for "none" (the leader, the previous writer, the last scrub) is `null`;
//! a part that means something only in some states (held I/O, an
//! unreachable replica's figures, a rebuild) is `null` in the others,
//! never left out. The keys come out sorted, at every level, and the
//! object on one line.

use serde::Serialize;

use crate::proto::admin::{ReplicaStatus, StatusReply, VolumeStatus};

/// The JSON view of one status reply; [`StatusJson::new`] maps the reply
/// onto it, and its `Display` is the line `status --json` prints.
#[derive(Debug, Serialize)]
pub struct StatusJson<'a> {
    node_id: u64,
    cluster_id: &'a str,
    raft_state: &'a str,
    term: u64,
    leader: Option<u64>,
    is_self: bool,
    lease_remaining_ms: u64,
    members: &'a [u64],
    /// Hex, ten digits, as the table shows it.
    incarnation: String,
    cluster_uuid: Option<&'a str>,
    not_member: Option<&'a str>,
    prev_writer: Option<u64>,
    prev_writer_term: u64,
    in_sync: &'a [String],
    volume_size: u64,
    min_in_sync: u64,
    last_applied: u64,
    role: &'a str,
    /// Whether the write gate is open (the reply's `gate_open`).
    active: bool,
    fence_floor: u64,
    fence_failures: u64,
    promotions: u64,
    volume: &'a str,
    nbd_address: &'a str,
    security: &'a str,
    /// "flowing" or "suspended".
    io: &'static str,
    io_suspended: Option<SuspendedJson<'a>>,
    data_address: &'a str,
    scrub: ScrubJson,
    /// "served" or "refused".
    reads: &'static str,
    reads_refused: Option<&'a str>,
    replicas: Vec<ReplicaJson<'a>>,
    /// Every volume, the configured one first (empty from a node of an
    /// earlier build).
    volumes: Vec<VolumeJson<'a>>,
}

/// One volume as the node sees it; what only a node that runs a copy
/// knows (term, writer, role, copies' states) is `null` or empty on one
/// that does not.
#[derive(Debug, Serialize)]
struct VolumeJson<'a> {
    name: &'a str,
    group: u64,
    size: u64,
    min_in_sync: u64,
    placement: &'a [u64],
    /// "running", "starting" or "elsewhere".
    here: &'a str,
    term: Option<u64>,
    leader: Option<u64>,
    /// Whether this node writes it now.
    writing: bool,
    role: Option<&'a str>,
    in_sync: &'a [String],
    replicas: Vec<ReplicaJson<'a>>,
    io_suspended: Option<SuspendedJson<'a>>,
}

/// I/O held below `min_in_sync`.
#[derive(Debug, Serialize)]
struct SuspendedJson<'a> {
    requests: u64,
    seconds: f64,
    why: &'a str,
}

/// The node's scrub, running or last.
#[derive(Debug, Serialize)]
struct ScrubJson {
    running: bool,
    done_bytes: u64,
    total_bytes: u64,
    passes: u64,
    last_finished_unix: Option<u64>,
    last_checked_extents: u64,
    last_found: u64,
    last_repaired: u64,
    found: u64,
    repaired: u64,
    rate_bytes_per_second: u64,
}

/// One replica; its figures are `null` when it did not answer.
#[derive(Debug, Serialize)]
struct ReplicaJson<'a> {
    id: &'a str,
    state: &'a str,
    local: bool,
    reachable: bool,
    fence_floor: Option<u64>,
    dirty_extents: Option<u64>,
    stale_accepts: Option<u64>,
    first_touch_marks: Option<u64>,
    error: Option<&'a str>,
    resync: Option<ResyncJson>,
}

/// A replica's latest rebuild by this node.
#[derive(Debug, Serialize)]
struct ResyncJson {
    running: bool,
    done_bytes: u64,
    total_bytes: u64,
    copied_bytes: u64,
    rate_bytes_per_second: f64,
    eta_seconds: f64,
}

/// `Some(value)` where a reply's 0 means "none".
fn unless_zero(value: u64) -> Option<u64> {
    (value != 0).then_some(value)
}

/// Held I/O, where a reply says `requests` wait.
fn suspended<'a>(requests: u64, seconds: f64, why: &'a str) -> Option<SuspendedJson<'a>> {
    (requests > 0).then_some(SuspendedJson {
        requests,
        seconds,
        why,
    })
}

/// `Some(text)` where a reply's "" means "none".
fn unless_empty(text: &str) -> Option<&str> {
    (!text.is_empty()).then_some(text)
}

impl<'a> StatusJson<'a> {
    /// The view of `reply`.
    pub fn new(reply: &'a StatusReply) -> Self {
        let suspended = reply.io_suspended_requests > 0;
        Self {
            node_id: reply.node_id,
            cluster_id: &reply.cluster_id,
            raft_state: &reply.raft_state,
            term: reply.term,
            leader: unless_zero(reply.leader),
            is_self: reply.is_self,
            lease_remaining_ms: reply.lease_remaining_ms,
            members: &reply.members,
            incarnation: format!("{:010x}", reply.incarnation),
            cluster_uuid: unless_empty(&reply.cluster_uuid),
            not_member: unless_empty(&reply.not_member),
            prev_writer: unless_zero(reply.prev_writer),
            prev_writer_term: reply.prev_writer_term,
            in_sync: &reply.in_sync,
            volume_size: reply.volume_size,
            min_in_sync: reply.min_in_sync,
            last_applied: reply.last_applied,
            role: &reply.role,
            active: reply.gate_open,
            fence_floor: reply.fence_floor,
            fence_failures: reply.fence_failures,
            promotions: reply.promotions,
            volume: &reply.volume,
            nbd_address: &reply.nbd_address,
            security: &reply.security,
            io: if suspended { "suspended" } else { "flowing" },
            io_suspended: self::suspended(
                reply.io_suspended_requests,
                reply.io_suspended_seconds,
                &reply.io_suspended_why,
            ),
            data_address: &reply.data_address,
            scrub: ScrubJson {
                running: reply.scrub_running,
                done_bytes: reply.scrub_done_bytes,
                total_bytes: reply.scrub_total_bytes,
                passes: reply.scrub_passes,
                last_finished_unix: unless_zero(reply.scrub_last_finished_unix),
                last_checked_extents: reply.scrub_last_checked_extents,
                last_found: reply.scrub_last_found,
                last_repaired: reply.scrub_last_repaired,
                found: reply.scrub_found,
                repaired: reply.scrub_repaired,
                rate_bytes_per_second: reply.scrub_rate_bytes_per_second,
            },
            reads: if reply.reads_served {
                "served"
            } else {
                "refused"
            },
            reads_refused: (!reply.reads_served).then_some(reply.reads_refused.as_str()),
            replicas: reply.replicas.iter().map(ReplicaJson::new).collect(),
            volumes: reply.volumes.iter().map(VolumeJson::new).collect(),
        }
    }
}

impl<'a> VolumeJson<'a> {
    fn new(v: &'a VolumeStatus) -> Self {
        Self {
            name: &v.name,
            group: v.group,
            size: v.size,
            min_in_sync: v.min_in_sync,
            placement: &v.placement,
            here: &v.here,
            term: unless_zero(v.term),
            leader: unless_zero(v.leader),
            writing: v.writing,
            role: unless_empty(&v.role),
            in_sync: &v.in_sync,
            replicas: v.replicas.iter().map(ReplicaJson::new).collect(),
            io_suspended: suspended(
                v.io_suspended_requests,
                v.io_suspended_seconds,
                &v.io_suspended_why,
            ),
        }
    }
}

impl<'a> ReplicaJson<'a> {
    fn new(r: &'a ReplicaStatus) -> Self {
        let answered = |value: u64| r.reachable.then_some(value);
        Self {
            id: &r.id,
            state: &r.state,
            local: r.local,
            reachable: r.reachable,
            fence_floor: answered(r.fence_floor),
            dirty_extents: answered(r.dirty_extents),
            stale_accepts: answered(r.stale_accepts),
            first_touch_marks: answered(r.first_touch_marks),
            error: unless_empty(&r.error),
            resync: (r.resync_total_bytes > 0).then_some(ResyncJson {
                running: r.resync_running,
                done_bytes: r.resync_done_bytes,
                total_bytes: r.resync_total_bytes,
                copied_bytes: r.resync_copied_bytes,
                rate_bytes_per_second: r.resync_rate_bytes_per_second,
                eta_seconds: r.resync_eta_seconds,
            }),
        }
    }
}

impl std::fmt::Display for StatusJson<'_> {
    /// One line. The view goes through `serde_json::Value`, whose maps keep
    /// their keys sorted, so the order is that of the keys' names and not
    /// of the fields above.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let value = serde_json::to_value(self).map_err(|_| std::fmt::Error)?;
        write!(f, "{value}")
    }
}

#[cfg(test)]
mod tests {
    use super::StatusJson;
    use crate::api::status::samples::{busy_writer, waiting_node};

    #[test]
    fn a_busy_writer_keeps_every_key_nesting_and_type_of_the_json() {
        assert_eq!(
            StatusJson::new(&busy_writer()).to_string(),
            r#"{"active":true,"cluster_id":"c1","cluster_uuid":"5f0c9a1e-0000-4000-8000-000000000001","data_address":"127.0.0.1:7101","fence_failures":1,"fence_floor":7,"in_sync":["1","2"],"incarnation":"0000abc123","io":"suspended","io_suspended":{"requests":3,"seconds":1.25,"why":"1 in-sync replica of the 2 needed; waiting for node 2's rebuild, 41%"},"is_self":true,"last_applied":42,"leader":1,"lease_remaining_ms":812,"members":[1,2,3],"min_in_sync":2,"nbd_address":"127.0.0.1:10809","node_id":1,"not_member":null,"prev_writer":1,"prev_writer_term":7,"promotions":3,"raft_state":"leader","reads":"served","reads_refused":null,"replicas":[{"dirty_extents":4,"error":null,"fence_floor":7,"first_touch_marks":9,"id":"1","local":true,"reachable":true,"resync":null,"stale_accepts":0,"state":"in_sync"},{"dirty_extents":0,"error":null,"fence_floor":7,"first_touch_marks":0,"id":"2","local":false,"reachable":true,"resync":{"copied_bytes":4194304,"done_bytes":104857600,"eta_seconds":1.5,"rate_bytes_per_second":134217728.0,"running":true,"total_bytes":251658240},"stale_accepts":2,"state":"rebuilding"},{"dirty_extents":null,"error":"no answer within 300ms","fence_floor":null,"first_touch_marks":null,"id":"3","local":false,"reachable":false,"resync":{"copied_bytes":3145728,"done_bytes":16777216,"eta_seconds":0.0,"rate_bytes_per_second":0.0,"running":false,"total_bytes":16777216},"stale_accepts":null,"state":"offline"}],"role":"leader","scrub":{"done_bytes":6291456,"found":2,"last_checked_extents":64,"last_finished_unix":1796000000,"last_found":1,"last_repaired":1,"passes":5,"rate_bytes_per_second":4194304,"repaired":2,"running":true,"total_bytes":16777216},"security":"mutual TLS","term":7,"volume":"vol0","volume_size":16777216,"volumes":[{"group":0,"here":"running","in_sync":["1","2"],"io_suspended":{"requests":3,"seconds":1.25,"why":"1 in-sync replica of the 2 needed; waiting for node 2's rebuild, 41%"},"leader":1,"min_in_sync":2,"name":"vol0","placement":[1,2,3],"replicas":[{"dirty_extents":4,"error":null,"fence_floor":7,"first_touch_marks":9,"id":"1","local":true,"reachable":true,"resync":null,"stale_accepts":0,"state":"in_sync"},{"dirty_extents":0,"error":null,"fence_floor":7,"first_touch_marks":0,"id":"2","local":false,"reachable":true,"resync":{"copied_bytes":4194304,"done_bytes":104857600,"eta_seconds":1.5,"rate_bytes_per_second":134217728.0,"running":true,"total_bytes":251658240},"stale_accepts":2,"state":"rebuilding"},{"dirty_extents":null,"error":"no answer within 300ms","fence_floor":null,"first_touch_marks":null,"id":"3","local":false,"reachable":false,"resync":{"copied_bytes":3145728,"done_bytes":16777216,"eta_seconds":0.0,"rate_bytes_per_second":0.0,"running":false,"total_bytes":16777216},"stale_accepts":null,"state":"offline"}],"role":"leader","size":16777216,"term":7,"writing":true},{"group":1,"here":"running","in_sync":["1","2"],"io_suspended":null,"leader":2,"min_in_sync":2,"name":"db","placement":[1,2,4],"replicas":[{"dirty_extents":0,"error":null,"fence_floor":3,"first_touch_marks":0,"id":"1","local":true,"reachable":true,"resync":null,"stale_accepts":0,"state":"in_sync"},{"dirty_extents":0,"error":null,"fence_floor":3,"first_touch_marks":0,"id":"2","local":false,"reachable":true,"resync":null,"stale_accepts":0,"state":"in_sync"},{"dirty_extents":null,"error":null,"fence_floor":null,"first_touch_marks":null,"id":"4","local":false,"reachable":false,"resync":null,"stale_accepts":null,"state":"missing"}],"role":"follower","size":4194304,"term":3,"writing":false},{"group":2,"here":"elsewhere","in_sync":[],"io_suspended":null,"leader":null,"min_in_sync":2,"name":"logs","placement":[2,3,4],"replicas":[],"role":null,"size":8388608,"term":null,"writing":false},{"group":3,"here":"starting","in_sync":[],"io_suspended":null,"leader":null,"min_in_sync":2,"name":"new","placement":[1,3,4],"replicas":[],"role":null,"size":4194304,"term":null,"writing":false}]}"#
        );
    }

    #[test]
    fn a_waiting_node_has_the_same_keys_with_nulls_for_what_it_lacks() {
        assert_eq!(
            StatusJson::new(&waiting_node()).to_string(),
            r#"{"active":false,"cluster_id":"c1","cluster_uuid":null,"data_address":"127.0.0.1:7103","fence_failures":0,"fence_floor":0,"in_sync":[],"incarnation":"000000001f","io":"flowing","io_suspended":null,"is_self":false,"last_applied":0,"leader":null,"lease_remaining_ms":0,"members":[],"min_in_sync":0,"nbd_address":"","node_id":3,"not_member":"replaced disk: waiting to be re-added (`replica-ha members replace --id 3`)","prev_writer":null,"prev_writer_term":0,"promotions":0,"raft_state":"learner","reads":"refused","reads_refused":"replica not in sync","replicas":[],"role":"follower","scrub":{"done_bytes":0,"found":0,"last_checked_extents":0,"last_finished_unix":null,"last_found":0,"last_repaired":0,"passes":0,"rate_bytes_per_second":0,"repaired":0,"running":false,"total_bytes":0},"security":"insecure","term":0,"volume":"vol0","volume_size":0,"volumes":[]}"#
        );
    }
}
