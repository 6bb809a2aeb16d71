//! The node's small HTTP listener: metrics and health for load balancers
//! and monitoring.
//!
//! - `GET /metrics`: Prometheus text format. Each volume this node runs a
//!   copy of (the configured one and the table's) has its own series,
//!   labelled `volume`: role, term and leader of its group, gate, lease,
//!   the data path's counters and write-latency histogram, replica states
//!   and fence floors, rebuilds, scrub, held I/O, fence and promotion
//!   counters. What the node has once is not labelled by volume:
//!   membership, security, NBD connections and the cluster group's Raft
//!   log (log index, applied index, per-peer replication lag).
//! - `GET /health/leader`: 200 only on the active writer (fenced, gate open,
//!   lease valid) of the configured volume, 503 elsewhere — what a load
//!   balancer or a client-side router checks, like Patroni's `/primary`.
//! - `GET /health/leader/NAME`: the same for volume `NAME` (the configured
//!   one or one of the table): 200 only on its active writer, 503 on its
//!   other copies (and while this node's copy does not run yet), 404 on a
//!   node that holds no copy of it, with the nodes that do in the body. A
//!   load balancer checks one backend per node and volume this way.
//! - `GET /health/live`: 200 while the process serves requests.
//!
//! Nothing here changes state; every answer is computed from the node's
//! parts when asked.

use std::sync::Arc;

use axum::Router;
use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use tokio::net::TcpListener;

use crate::api::admin::{LOOKUP_WAIT, NotHere, VolumeWriters, leader_source};
use crate::api::status::{NodeStatus, NodeView, VolumeFigures};
use crate::ha::ReplicaState;
use crate::metrics::{Kind, Text, load};
use crate::replica::ReplicaInfo;

/// What the routes read: the node's view, and where the writers of the
/// table's volumes are read (none: only the configured volume is known).
#[derive(Clone)]
pub struct Health {
    pub view: Arc<NodeView>,
    pub writers: Option<Arc<dyn VolumeWriters>>,
}

/// The routes over a node's view.
pub fn router(health: Health) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/health/leader", get(leader))
        .route("/health/leader/{name}", get(volume_leader))
        .route("/health/live", get(live))
        .with_state(health)
}

/// Serves the routes on `listener` until `stop` resolves.
pub async fn serve(
    listener: TcpListener,
    health: Health,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(health))
        .with_graceful_shutdown(stop)
        .await
}

async fn leader(State(health): State<Health>) -> impl IntoResponse {
    writer_answer(health.view.is_active_writer())
}

/// 200 or 503, by whether this node writes the volume now.
fn writer_answer(writing: bool) -> (StatusCode, String) {
    if writing {
        (StatusCode::OK, "active writer\n".into())
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "not the active writer\n".into(),
        )
    }
}

async fn volume_leader(
    State(health): State<Health>,
    Path(name): Path<String>,
) -> impl IntoResponse {
    let found = leader_source(&health.view, health.writers.as_deref(), &name, LOOKUP_WAIT).await;
    match found {
        Ok((source, _)) => writer_answer(source.is_active_writer()),
        Err(err @ (NotHere::Elsewhere { .. } | NotHere::Unknown(_))) => {
            (StatusCode::NOT_FOUND, format!("{err}\n"))
        }
        Err(err @ (NotHere::NotRunning(_) | NotHere::Busy)) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not the active writer: {err}\n"),
        ),
    }
}

async fn live() -> impl IntoResponse {
    (StatusCode::OK, "live\n")
}

async fn metrics(State(health): State<Health>) -> impl IntoResponse {
    let body = render(&health.view.status().await);
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        body,
    )
}

/// A per-volume series: its name, kind, help and how its value is read
/// from a volume's figures.
type VolumeSeries = (&'static str, Kind, &'static str, fn(&VolumeFigures) -> f64);

/// The per-volume series with one value each, labelled `volume`.
const VOLUME_SERIES: [VolumeSeries; 25] = [
    (
        "replica_ha_io_suspended",
        Kind::Gauge,
        "1 while writes are held because too few replicas are in sync.",
        |v| f64::from(u8::from(v.suspended.is_some())),
    ),
    (
        "replica_ha_io_suspended_requests",
        Kind::Gauge,
        "Writes and flushes held because too few replicas are in sync.",
        |v| v.suspended.as_ref().map_or(0, |s| s.waiting) as f64,
    ),
    (
        "replica_ha_io_suspended_seconds",
        Kind::Gauge,
        "How long writes have been held without a break.",
        |v| {
            v.suspended
                .as_ref()
                .map_or(0.0, |s| s.for_how_long.as_secs_f64())
        },
    ),
    (
        "replica_ha_scrub_running",
        Kind::Gauge,
        "1 while the writer's scrub compares the in-sync replicas.",
        |v| f64::from(u8::from(v.scrub.running)),
    ),
    (
        "replica_ha_scrub_progress_ratio",
        Kind::Gauge,
        "How far the running (or last) scrub pass got, 0 to 1.",
        |v| v.scrub.done as f64 / v.scrub.total.max(1) as f64,
    ),
    (
        "replica_ha_scrub_passes_total",
        Kind::Counter,
        "Scrub passes finished over the whole volume since start.",
        |v| v.scrub.passes as f64,
    ),
    (
        "replica_ha_scrub_last_finished_timestamp_seconds",
        Kind::Gauge,
        "When the last scrub pass finished (Unix time; 0: none yet).",
        |v| {
            v.scrub.last_finished.map_or(0.0, |t| {
                t.duration_since(std::time::UNIX_EPOCH)
                    .map_or(0.0, |d| d.as_secs_f64())
            })
        },
    ),
    (
        "replica_ha_scrub_last_checked_extents",
        Kind::Gauge,
        "Extents the last scrub pass compared.",
        |v| v.scrub.last_checked as f64,
    ),
    (
        "replica_ha_scrub_differences_found_total",
        Kind::Counter,
        "Extents whose in-sync copies differed, found by the scrub since start.",
        |v| v.scrub.found as f64,
    ),
    (
        "replica_ha_scrub_differences_repaired_total",
        Kind::Counter,
        "Differing extents the scrub repaired since start.",
        |v| v.scrub.repaired as f64,
    ),
    (
        "replica_ha_scrub_unchecked_extents_total",
        Kind::Counter,
        "Extents the scrub could not compare (a replica did not answer) since start.",
        |v| v.scrub.unchecked as f64,
    ),
    (
        "replica_ha_term",
        Kind::Gauge,
        "The current term of the volume's Raft group (its fencing token).",
        |v| v.term.0 as f64,
    ),
    (
        "replica_ha_raft_leader",
        Kind::Gauge,
        "The leader of the volume's Raft group as this node knows it (0 if none).",
        |v| v.leader.map_or(0, |id| id.0) as f64,
    ),
    (
        "replica_ha_gate_open",
        Kind::Gauge,
        "1 while this node is the volume's active writer.",
        |v| f64::from(u8::from(v.gate_open)),
    ),
    (
        "replica_ha_lease_remaining_seconds",
        Kind::Gauge,
        "Time left on this node's leader lease of the volume's group (0 without one).",
        |v| v.lease_remaining.map_or(0.0, |d| d.as_secs_f64()),
    ),
    (
        "replica_ha_promotions_total",
        Kind::Counter,
        "Promotions to active writer since start.",
        |v| v.promotions as f64,
    ),
    (
        "replica_ha_fence_failures_total",
        Kind::Counter,
        "Failed or timed-out fence attempts since start.",
        |v| v.fence_failures as f64,
    ),
    (
        "replica_ha_volume_size_bytes",
        Kind::Gauge,
        "The volume's committed size (it grows with `replica-ha resize`).",
        |v| v.size as f64,
    ),
    (
        "replica_ha_writes_total",
        Kind::Counter,
        "Acknowledged writes.",
        |v| load(&v.io.writes),
    ),
    (
        "replica_ha_write_bytes_total",
        Kind::Counter,
        "Bytes of acknowledged writes.",
        |v| load(&v.io.write_bytes),
    ),
    (
        "replica_ha_reads_total",
        Kind::Counter,
        "Served reads.",
        |v| load(&v.io.reads),
    ),
    (
        "replica_ha_read_bytes_total",
        Kind::Counter,
        "Bytes of served reads.",
        |v| load(&v.io.read_bytes),
    ),
    (
        "replica_ha_flushes_total",
        Kind::Counter,
        "Acknowledged flushes.",
        |v| load(&v.io.flushes),
    ),
    (
        "replica_ha_io_errors_total",
        Kind::Counter,
        "Failed data-path requests, any cause.",
        |v| load(&v.io.errors),
    ),
    (
        "replica_ha_writes_refused_total",
        Kind::Counter,
        "Writes refused because this node is not the volume's active writer.",
        |v| load(&v.io.refused),
    ),
];

/// The `/metrics` document of `status`: the node's own series unlabelled
/// (or labelled by what they count), then each volume's, labelled
/// `volume` (see the module docs).
pub fn render(status: &NodeStatus) -> String {
    let mut text = Text::default();
    node_series(&mut text, status);
    volume_series(&mut text, &status.facts.id.to_string(), &status.running());
    text.finish()
}

/// What the node has once, whatever volumes it runs: its membership, its
/// security, its NBD listener and the cluster group's Raft log.
fn node_series(text: &mut Text, status: &NodeStatus) {
    let node = status.facts.id.to_string();
    text.family(
        "replica_ha_member",
        Kind::Gauge,
        "1 while this node is a member of the cluster; 0, with the reason, while it is not (S8: \
         a replaced disk waits to be re-added, a new node to be added).",
    );
    let incarnation = status.facts.member.incarnation().to_string();
    let reason = status.not_member.as_deref().unwrap_or("");
    text.sample(
        "replica_ha_member",
        &[
            ("node", &node),
            ("incarnation", &incarnation),
            ("reason", reason),
        ],
        u8::from(status.not_member.is_none()),
    );
    text.single(
        "replica_ha_insecure",
        Kind::Gauge,
        "1 while this node runs without TLS (insecure = true): nothing is authenticated.",
        u8::from(!status.facts.tls),
    );
    let nbd = &status.nbd;
    text.single(
        "replica_ha_nbd_connections",
        Kind::Gauge,
        "Open NBD connections.",
        load(&nbd.open),
    )
    .single(
        "replica_ha_nbd_connections_total",
        Kind::Counter,
        "Accepted NBD connections.",
        load(&nbd.accepted),
    )
    .single(
        "replica_ha_nbd_connection_errors_total",
        Kind::Counter,
        "NBD connections ended by a protocol or I/O error.",
        load(&nbd.failed),
    );
    let last_log = status.log.last_log;
    text.single(
        "replica_ha_raft_last_log_index",
        Kind::Gauge,
        "Index of the last entry of the cluster group's Raft log.",
        last_log as f64,
    )
    .single(
        "replica_ha_raft_last_applied_index",
        Kind::Gauge,
        "Index of the last applied entry of the cluster group's Raft log.",
        status.log.last_applied as f64,
    );
    if let Some(replication) = &status.log.replication {
        text.family(
            "replica_ha_raft_replication_lag",
            Kind::Gauge,
            "Cluster group log entries each follower is behind the leader (leader only).",
        );
        for (peer, matched) in replication {
            let lag = last_log.saturating_sub(*matched);
            text.sample(
                "replica_ha_raft_replication_lag",
                &[("peer", &peer.to_string())],
                lag as f64,
            );
        }
    }
}

/// Each volume's series, labelled `volume`: its role, gate, term, lease,
/// data path, scrub, and every copy's state, figures and rebuild.
fn volume_series(text: &mut Text, node: &str, volumes: &[(&str, &VolumeFigures)]) {
    text.family(
        "replica_ha_role",
        Kind::Gauge,
        "1 for the controller's current role for the volume.",
    );
    for (volume, figures) in volumes {
        for role in ["follower", "fence_pending", "leader"] {
            let value = u8::from(figures.role.as_str() == role);
            let labels = [("volume", *volume), ("node", node), ("role", role)];
            text.sample("replica_ha_role", &labels, value);
        }
    }
    for (name, kind, help, value) in VOLUME_SERIES {
        text.family(name, kind, help);
        for (volume, figures) in volumes {
            text.sample(name, &[("volume", volume)], value(figures));
        }
    }
    text.family(
        "replica_ha_write_latency_seconds",
        Kind::Histogram,
        "Latency of acknowledged writes (replicated to the in-sync set).",
    );
    for (volume, figures) in volumes {
        text.observations(
            "replica_ha_write_latency_seconds",
            &[("volume", volume)],
            &figures.io.write_latency,
        );
    }
    replica_series(text, volumes);
}

/// Each copy of each volume, labelled `volume` and `replica`.
fn replica_series(text: &mut Text, volumes: &[(&str, &VolumeFigures)]) {
    text.family(
        "replica_ha_replica_state",
        Kind::Gauge,
        "1 for each replica's state.",
    );
    for (volume, figures) in volumes {
        for report in &figures.replicas {
            let id = report.id.to_string();
            for state in [
                ReplicaState::InSync,
                ReplicaState::Degraded,
                ReplicaState::Rebuilding,
                ReplicaState::Offline,
            ] {
                let labels = [
                    ("volume", *volume),
                    ("replica", &id),
                    ("state", state.as_str()),
                ];
                text.sample(
                    "replica_ha_replica_state",
                    &labels,
                    u8::from(report.state == state),
                );
            }
        }
    }
    type Field = fn(&ReplicaInfo) -> u64;
    let per_replica: [(&str, Kind, &str, Field); 4] = [
        (
            "replica_ha_replica_fence_floor",
            Kind::Gauge,
            "Each reachable replica's durable fence floor.",
            |i| i.floor.0,
        ),
        (
            "replica_ha_replica_dirty_extents",
            Kind::Gauge,
            "Dirty (term, extent) marks each reachable replica holds.",
            |i| i.dirty_extents,
        ),
        (
            "replica_ha_replica_stale_accepts",
            Kind::Gauge,
            "Requests each reachable replica admitted below its fence floor (must be 0).",
            |i| i.stale_accepts,
        ),
        (
            "replica_ha_replica_first_touch_marks_total",
            Kind::Counter,
            "Extents a write, discard or copy had to mark itself on each reachable replica since \
             it started, each after a metadata flush (S6's first-touch cost; marks ahead are not \
             counted).",
            |i| i.first_touch_marks,
        ),
    ];
    for (name, kind, help, value) in per_replica {
        text.family(name, kind, help);
        for (volume, figures) in volumes {
            for report in &figures.replicas {
                if let Ok(info) = &report.info {
                    let labels = [("volume", *volume), ("replica", &report.id.to_string())];
                    text.sample(name, &labels, value(info) as f64);
                }
            }
        }
    }
    text.family("replica_ha_resync_bytes", Kind::Gauge, "The latest resync of each replica by this node: bytes compared (done), to compare (total: the volume, or the extents its missed-write map names), copied.");
    text.family(
        "replica_ha_resync_full",
        Kind::Gauge,
        "Whether the latest resync of each replica compares every extent (1) or only those its missed-write map names (0).",
    );
    text.family(
        "replica_ha_resync_eta_seconds",
        Kind::Gauge,
        "Estimated time left of each running resync.",
    );
    for (volume, figures) in volumes {
        for report in &figures.replicas {
            let Some(p) = &report.resync else {
                continue;
            };
            let id = report.id.to_string();
            for (kind, value) in [("done", p.done), ("total", p.total), ("copied", p.copied)] {
                let labels = [("volume", *volume), ("replica", &id), ("kind", kind)];
                text.sample("replica_ha_resync_bytes", &labels, value as f64);
            }
            let labels = [("volume", *volume), ("replica", &id)];
            text.sample(
                "replica_ha_resync_full",
                &labels,
                f64::from(u8::from(p.full)),
            );
            if p.running {
                text.sample("replica_ha_resync_eta_seconds", &labels, p.eta);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Arc;

    use super::render;
    use crate::api::status::{NodeFacts, NodeStatus, VolumeFigures, VolumeReport};
    use crate::ha::Role;
    use crate::ids::{GroupId, Incarnation, MemberId, NodeId};

    /// What node 1 sees of a volume whose copies on nodes 1 and 2 are in
    /// sync.
    fn figures(role: Role, term: u64) -> VolumeFigures {
        VolumeFigures::sample(role, term, &[1, 2])
    }

    /// Node 1, writer of its configured volume `vol0`, holding a copy of
    /// table volume `db` (written by node 2) and none of `logs`.
    fn node_with_volumes() -> NodeStatus {
        let report = |name: &str, group: u64, figures: Option<VolumeFigures>| VolumeReport {
            name: name.into(),
            group: GroupId(group),
            size: 4 << 20,
            min_in_sync: 2,
            placement: vec![NodeId(2), NodeId(3)],
            figures,
        };
        NodeStatus {
            facts: NodeFacts {
                id: NodeId(1),
                member: MemberId::new(NodeId(1), Incarnation(7)),
                data: "127.0.0.1:7101".parse().unwrap(),
                cluster_id: "c1".into(),
                volume: "vol0".into(),
                size: 4 << 20,
                min_in_sync: 2,
                nbd: None,
                peers: BTreeMap::new(),
                tls: true,
                data_dir: "/nonexistent".into(),
            },
            raft_state: "leader".into(),
            log: Default::default(),
            applied_index: 0,
            live: vec![NodeId(1)],
            not_member: None,
            cluster_uuid: None,
            nbd: Arc::default(),
            own: figures(Role::Leader, 7),
            table: vec![
                report("db", 1, Some(figures(Role::Follower, 3))),
                report("logs", 2, None),
            ],
        }
    }

    #[test]
    fn each_volume_run_here_has_its_own_series_and_the_node_has_its_own_once() {
        let text = render(&node_with_volumes());
        for line in [
            "replica_ha_insecure 0\n",
            "replica_ha_nbd_connections 0\n",
            "replica_ha_raft_last_log_index 0\n",
            "replica_ha_gate_open{volume=\"vol0\"} 1\n",
            "replica_ha_gate_open{volume=\"db\"} 0\n",
            "replica_ha_term{volume=\"vol0\"} 7\n",
            "replica_ha_term{volume=\"db\"} 3\n",
            "replica_ha_role{volume=\"db\",node=\"1\",role=\"follower\"} 1\n",
            "replica_ha_replica_state{volume=\"db\",replica=\"2\",state=\"in_sync\"} 1\n",
            "replica_ha_replica_fence_floor{volume=\"vol0\",replica=\"1\"} 0\n",
            "replica_ha_write_latency_seconds_count{volume=\"db\"} 0\n",
            "replica_ha_writes_total{volume=\"vol0\"} 0\n",
        ] {
            assert!(text.contains(line), "no {line:?} in\n{text}");
        }
        assert!(
            !text.contains("volume=\"logs\""),
            "a volume without a copy here has no series:\n{text}"
        );
        for declared in text.lines().filter(|l| l.starts_with("# TYPE ")) {
            let family = format!("{declared}\n");
            assert_eq!(text.matches(&family).count(), 1, "{declared} twice");
        }
    }
}
