//! The node's small HTTP listener: metrics and health for load balancers
//! and monitoring.
//!
//! - `GET /metrics`: Prometheus text format — role, term, gate, lease, the
//!   data path's counters and write-latency histogram, replica states and
//!   fence floors, fence and promotion counters, NBD connections, and Raft's
//!   own figures (log index, applied index, per-peer replication lag).
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
use crate::api::status::{NodeStatus, NodeView};
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

/// The `/metrics` document of `status`.
pub fn render(status: &NodeStatus) -> String {
    let mut text = Text::default();
    let node = status.facts.id.to_string();

    text.family(
        "replica_ha_role",
        Kind::Gauge,
        "1 for the controller's current role.",
    );
    for role in ["follower", "fence_pending", "leader"] {
        let value = u8::from(status.role.as_str() == role);
        text.sample("replica_ha_role", &[("node", &node), ("role", role)], value);
    }
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
    let held = status.suspended.as_ref();
    text.single(
        "replica_ha_io_suspended",
        Kind::Gauge,
        "1 while writes are held because too few replicas are in sync.",
        u8::from(held.is_some()),
    )
    .single(
        "replica_ha_io_suspended_requests",
        Kind::Gauge,
        "Writes and flushes held because too few replicas are in sync.",
        held.map_or(0, |s| s.waiting) as f64,
    )
    .single(
        "replica_ha_io_suspended_seconds",
        Kind::Gauge,
        "How long writes have been held without a break.",
        held.map_or(0.0, |s| s.for_how_long.as_secs_f64()),
    )
    .single(
        "replica_ha_scrub_running",
        Kind::Gauge,
        "1 while the writer's scrub compares the in-sync replicas.",
        u8::from(status.scrub.running),
    )
    .single(
        "replica_ha_scrub_progress_ratio",
        Kind::Gauge,
        "How far the running (or last) scrub pass got, 0 to 1.",
        status.scrub.done as f64 / status.scrub.total.max(1) as f64,
    )
    .single(
        "replica_ha_scrub_passes_total",
        Kind::Counter,
        "Scrub passes finished over the whole volume since start.",
        status.scrub.passes as f64,
    )
    .single(
        "replica_ha_scrub_last_finished_timestamp_seconds",
        Kind::Gauge,
        "When the last scrub pass finished (Unix time; 0: none yet).",
        status.scrub.last_finished.map_or(0.0, |t| {
            t.duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64())
        }),
    )
    .single(
        "replica_ha_scrub_last_checked_extents",
        Kind::Gauge,
        "Extents the last scrub pass compared.",
        status.scrub.last_checked as f64,
    )
    .single(
        "replica_ha_scrub_differences_found_total",
        Kind::Counter,
        "Extents whose in-sync copies differed, found by the scrub since start.",
        status.scrub.found as f64,
    )
    .single(
        "replica_ha_scrub_differences_repaired_total",
        Kind::Counter,
        "Differing extents the scrub repaired since start.",
        status.scrub.repaired as f64,
    )
    .single(
        "replica_ha_scrub_unchecked_extents_total",
        Kind::Counter,
        "Extents the scrub could not compare (a replica did not answer) since start.",
        status.scrub.unchecked as f64,
    )
    .single(
        "replica_ha_insecure",
        Kind::Gauge,
        "1 while this node runs without TLS (insecure = true): nothing is authenticated.",
        u8::from(!status.facts.tls),
    )
    .single(
        "replica_ha_term",
        Kind::Gauge,
        "The current Raft term (the fencing token).",
        status.term.0 as f64,
    )
    .single(
        "replica_ha_gate_open",
        Kind::Gauge,
        "1 while this node is the active writer.",
        u8::from(status.gate_open),
    )
    .single(
        "replica_ha_lease_remaining_seconds",
        Kind::Gauge,
        "Time left on this node's leader lease (0 without one).",
        status.lease_remaining.map_or(0.0, |d| d.as_secs_f64()),
    )
    .single(
        "replica_ha_promotions_total",
        Kind::Counter,
        "Promotions to active writer since start.",
        status.promotions as f64,
    )
    .single(
        "replica_ha_fence_failures_total",
        Kind::Counter,
        "Failed or timed-out fence attempts since start.",
        status.fence_failures as f64,
    )
    .single(
        "replica_ha_volume_size_bytes",
        Kind::Gauge,
        "The volume's committed size (it grows with `replica-ha resize`).",
        status.size as f64,
    );

    let io = &status.io;
    text.single(
        "replica_ha_writes_total",
        Kind::Counter,
        "Acknowledged writes.",
        load(&io.writes),
    )
    .single(
        "replica_ha_write_bytes_total",
        Kind::Counter,
        "Bytes of acknowledged writes.",
        load(&io.write_bytes),
    )
    .single(
        "replica_ha_reads_total",
        Kind::Counter,
        "Served reads.",
        load(&io.reads),
    )
    .single(
        "replica_ha_read_bytes_total",
        Kind::Counter,
        "Bytes of served reads.",
        load(&io.read_bytes),
    )
    .single(
        "replica_ha_flushes_total",
        Kind::Counter,
        "Acknowledged flushes.",
        load(&io.flushes),
    )
    .single(
        "replica_ha_io_errors_total",
        Kind::Counter,
        "Failed data-path requests, any cause.",
        load(&io.errors),
    )
    .single(
        "replica_ha_writes_refused_total",
        Kind::Counter,
        "Writes refused because this node is not the active writer.",
        load(&io.refused),
    )
    .histogram(
        "replica_ha_write_latency_seconds",
        "Latency of acknowledged writes (replicated to the in-sync set).",
        &io.write_latency,
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

    let reports = &status.replicas;
    text.family(
        "replica_ha_replica_state",
        Kind::Gauge,
        "1 for each replica's state.",
    );
    for report in reports {
        for state in [
            ReplicaState::InSync,
            ReplicaState::Degraded,
            ReplicaState::Rebuilding,
            ReplicaState::Offline,
        ] {
            let id = report.id.to_string();
            let labels = [("replica", id.as_str()), ("state", state.as_str())];
            text.sample(
                "replica_ha_replica_state",
                &labels,
                u8::from(report.state == state),
            );
        }
    }
    let infos: Vec<(String, ReplicaInfo)> = reports
        .iter()
        .filter_map(|r| r.info.as_ref().ok().map(|info| (r.id.to_string(), *info)))
        .collect();
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
        for (id, info) in &infos {
            text.sample(name, &[("replica", id)], value(info) as f64);
        }
    }

    text.family("replica_ha_resync_bytes", Kind::Gauge, "The latest resync of each replica by this node: bytes compared (done), to compare (total: the volume, or the extents its missed-write map names), copied.");
    for report in reports {
        if let Some(p) = &report.resync {
            for (kind, value) in [("done", p.done), ("total", p.total), ("copied", p.copied)] {
                text.sample(
                    "replica_ha_resync_bytes",
                    &[("replica", &report.id.to_string()), ("kind", kind)],
                    value as f64,
                );
            }
        }
    }
    text.family(
        "replica_ha_resync_full",
        Kind::Gauge,
        "Whether the latest resync of each replica compares every extent (1) or only those its missed-write map names (0).",
    );
    for report in reports {
        if let Some(p) = &report.resync {
            text.sample(
                "replica_ha_resync_full",
                &[("replica", &report.id.to_string())],
                f64::from(u8::from(p.full)),
            );
        }
    }
    text.family(
        "replica_ha_resync_eta_seconds",
        Kind::Gauge,
        "Estimated time left of each running resync.",
    );
    for report in reports {
        if let Some(p) = report.resync.filter(|p| p.running) {
            text.sample(
                "replica_ha_resync_eta_seconds",
                &[("replica", &report.id.to_string())],
                p.eta,
            );
        }
    }

    let last_log = status.log.last_log;
    text.single(
        "replica_ha_raft_last_log_index",
        Kind::Gauge,
        "Index of the last Raft log entry.",
        last_log as f64,
    )
    .single(
        "replica_ha_raft_last_applied_index",
        Kind::Gauge,
        "Index of the last applied Raft entry.",
        status.log.last_applied as f64,
    )
    .single(
        "replica_ha_raft_leader",
        Kind::Gauge,
        "The Raft leader's node id as this node knows it (0 if none).",
        status.leader.map_or(0, |id| id.0) as f64,
    );
    if let Some(replication) = &status.log.replication {
        text.family(
            "replica_ha_raft_replication_lag",
            Kind::Gauge,
            "Log entries each follower is behind the leader (leader only).",
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
    text.finish()
}
