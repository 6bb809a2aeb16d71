//! Sample status replies for the renderings' tests: one of a busy writer
//! (every optional part present) and one of a node with next to nothing
//! to say (every optional part absent).

use crate::proto::admin::{ReplicaStatus, StatusReply, VolumeStatus};

/// A writer with everything to show: a running scrub, held I/O, a replica
/// rebuilding, one unreachable and one rebuilt earlier; and besides the
/// configured volume, a table volume it holds a copy of (one of whose
/// copies its replica set lacks), one it holds none of, and one whose
/// copy here is starting.
pub(super) fn busy_writer() -> StatusReply {
    let mut reply = configured_writer();
    let configured = VolumeStatus {
        name: reply.volume.clone(),
        group: 0,
        size: reply.volume_size,
        min_in_sync: reply.min_in_sync,
        placement: vec![1, 2, 3],
        here: "running".into(),
        term: reply.term,
        leader: reply.leader,
        writing: true,
        role: reply.role.clone(),
        in_sync: reply.in_sync.clone(),
        replicas: reply.replicas.clone(),
        io_suspended_requests: reply.io_suspended_requests,
        io_suspended_seconds: reply.io_suspended_seconds,
        io_suspended_why: reply.io_suspended_why.clone(),
    };
    let in_sync = |id: &str, local: bool| ReplicaStatus {
        id: id.into(),
        state: "in_sync".into(),
        local,
        reachable: true,
        fence_floor: 3,
        ..Default::default()
    };
    let held_here = VolumeStatus {
        name: "db".into(),
        group: 1,
        size: 4 << 20,
        min_in_sync: 2,
        placement: vec![1, 2, 4],
        here: "running".into(),
        term: 3,
        leader: 2,
        role: "follower".into(),
        in_sync: vec!["1".into(), "2".into()],
        replicas: vec![
            in_sync("1", true),
            in_sync("2", false),
            ReplicaStatus {
                id: "4".into(),
                state: "missing".into(),
                ..Default::default()
            },
        ],
        ..Default::default()
    };
    let elsewhere = VolumeStatus {
        name: "logs".into(),
        group: 2,
        size: 8 << 20,
        min_in_sync: 2,
        placement: vec![2, 3, 4],
        here: "elsewhere".into(),
        ..Default::default()
    };
    let starting = VolumeStatus {
        name: "new".into(),
        group: 3,
        size: 4 << 20,
        min_in_sync: 2,
        placement: vec![1, 3, 4],
        here: "starting".into(),
        ..Default::default()
    };
    reply.volumes = vec![configured, held_here, elsewhere, starting];
    reply
}

/// The busy writer's reply as a node of an earlier build sends it: the
/// configured volume only, no volumes section.
pub(super) fn configured_writer() -> StatusReply {
    StatusReply {
        node_id: 1,
        cluster_id: "c1".into(),
        raft_state: "leader".into(),
        term: 7,
        leader: 1,
        is_self: true,
        lease_remaining_ms: 812,
        members: vec![1, 2, 3],
        prev_writer: 1,
        prev_writer_term: 7,
        in_sync: vec!["1".into(), "2".into()],
        volume_size: 16 << 20,
        min_in_sync: 2,
        last_applied: 42,
        role: "leader".into(),
        gate_open: true,
        fence_floor: 7,
        fence_failures: 1,
        promotions: 3,
        replicas: vec![
            ReplicaStatus {
                id: "1".into(),
                state: "in_sync".into(),
                local: true,
                reachable: true,
                fence_floor: 7,
                dirty_extents: 4,
                stale_accepts: 0,
                first_touch_marks: 9,
                ..Default::default()
            },
            ReplicaStatus {
                id: "2".into(),
                state: "rebuilding".into(),
                reachable: true,
                fence_floor: 7,
                resync_done_bytes: 100 << 20,
                resync_total_bytes: 240 << 20,
                resync_copied_bytes: 4 << 20,
                resync_rate_bytes_per_second: 128.0 * 1048576.0,
                resync_eta_seconds: 1.5,
                resync_running: true,
                resync_full: true,
                stale_accepts: 2,
                ..Default::default()
            },
            ReplicaStatus {
                id: "3".into(),
                state: "offline".into(),
                error: "no answer within 300ms".into(),
                resync_total_bytes: 16 << 20,
                resync_done_bytes: 16 << 20,
                resync_copied_bytes: 3 << 20,
                ..Default::default()
            },
        ],
        volume: "vol0".into(),
        nbd_address: "127.0.0.1:10809".into(),
        reads_served: true,
        reads_refused: String::new(),
        security: "mutual TLS".into(),
        data_address: "127.0.0.1:7101".into(),
        io_suspended_requests: 3,
        io_suspended_seconds: 1.25,
        io_suspended_why: "1 in-sync replica of the 2 needed; waiting for node 2's rebuild, 41%"
            .into(),
        scrub_running: true,
        scrub_done_bytes: 6 << 20,
        scrub_total_bytes: 16 << 20,
        scrub_last_finished_unix: 1_796_000_000,
        scrub_last_checked_extents: 64,
        scrub_last_found: 1,
        scrub_last_repaired: 1,
        scrub_found: 2,
        scrub_repaired: 2,
        scrub_passes: 5,
        scrub_rate_bytes_per_second: 4 << 20,
        writes_total: 1000,
        write_bytes_total: 4 << 20,
        incarnation: 0xabc123,
        member: 77,
        not_member: String::new(),
        cluster_uuid: "5f0c9a1e-0000-4000-8000-000000000001".into(),
        volumes: Vec::new(),
    }
}

/// A node that waits to be re-added: no leader known, reads refused, no
/// replica report, nothing optional set.
pub(super) fn waiting_node() -> StatusReply {
    StatusReply {
        node_id: 3,
        cluster_id: "c1".into(),
        raft_state: "learner".into(),
        role: "follower".into(),
        volume: "vol0".into(),
        reads_served: false,
        reads_refused: "replica not in sync".into(),
        security: "insecure".into(),
        data_address: "127.0.0.1:7103".into(),
        incarnation: 0x1f,
        not_member: "replaced disk: waiting to be re-added (`replica-ha members replace --id 3`)"
            .into(),
        ..Default::default()
    }
}
