//! The role-abuse client (S9): while a schedule runs, it keeps trying to
//! write through NBD with certificates that must not write — the cluster's
//! `viewer` client certificate, and the node certificate of a node that is
//! not a member (id 9, signed by the cluster's own CA, as a removed node's
//! would be). Every node is tried in turn, whatever its role then, so the
//! writer's export and the followers' both face it, through failovers and
//! restarts.
//!
//! A viewer must get a read-only export and `EPERM` for a write it sends
//! anyway; a non-member must be refused at the handshake. Anything else —
//! a writable export, a write answered with success, a stranger served —
//! is a violation, and so is the marker it writes found in the volume
//! (the checker's lost-write rule sees that one: it lands on a client's
//! block).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use replica_ha::certs::TlsFiles;
use replica_ha::ids::NodeId;
use replica_ha::nbd::wire::{EPERM, TFLAG_READ_ONLY};
use replica_ha::net::tls::Party;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::common::cluster::Cluster;
use super::common::nbd_tls;

/// How often the client tries.
const EVERY: Duration = Duration::from_millis(250);
/// How long one handshake or write may take before it counts as refused.
const LIMIT: Duration = Duration::from_secs(2);
/// The node id of the stranger: never a member of a campaign's cluster.
const STRANGER: NodeId = NodeId(9);

/// What the client found (see the module docs).
#[derive(Debug, Default)]
pub struct Findings {
    /// Handshakes tried.
    pub attempts: u64,
    /// Writes a viewer sent on a read-only export and saw refused.
    pub refused_writes: u64,
    /// What must never happen, in words.
    pub violations: Vec<String>,
}

pub struct Abuse {
    stop: watch::Sender<bool>,
    task: JoinHandle<Findings>,
}

impl Abuse {
    /// Starts trying every node of `nbd` with `cluster`'s certificates;
    /// writes go to `offset`.
    pub fn start(cluster: &Cluster, nbd: BTreeMap<u64, SocketAddr>, offset: u64) -> Abuse {
        replica_ha::certs::issue_node(&cluster.certs, STRANGER, &[], 30)
            .expect("a stranger's node certificate");
        let viewer = nbd_tls::client_config(
            cluster,
            TlsFiles::for_client(&cluster.certs, "viewer"),
            Party::Client,
        );
        let stranger = nbd_tls::client_config(
            cluster,
            TlsFiles::for_node(&cluster.certs, STRANGER),
            Party::Node(STRANGER),
        );
        let (stop, mut stopped) = watch::channel(false);
        let task = tokio::spawn(async move {
            let mut findings = Findings::default();
            let nodes: Vec<(u64, SocketAddr)> = nbd.into_iter().collect();
            let mut turn = 0usize;
            loop {
                let (node, addr) = nodes[turn % nodes.len()];
                turn += 1;
                as_viewer(node, addr, Arc::clone(&viewer), offset, &mut findings).await;
                as_stranger(node, addr, Arc::clone(&stranger), &mut findings).await;
                tokio::select! {
                    _ = stopped.wait_for(|stop| *stop) => return findings,
                    () = tokio::time::sleep(EVERY) => {}
                }
            }
        });
        Abuse { stop, task }
    }

    /// Stops the client and returns what it found.
    pub async fn stop(self) -> Findings {
        self.stop.send_replace(true);
        self.task.await.expect("the abuse client")
    }
}

/// A viewer's session: read-only, and its write refused.
async fn as_viewer(
    node: u64,
    addr: SocketAddr,
    config: Arc<rustls::ClientConfig>,
    offset: u64,
    findings: &mut Findings,
) {
    findings.attempts += 1;
    // Refused (a node down, or a follower out of sync): nothing written.
    let Ok(mut session) = nbd_tls::open(addr, config, LIMIT).await else {
        return;
    };
    if session.export.flags & TFLAG_READ_ONLY == 0 {
        findings
            .violations
            .push(format!("node {node} offered a viewer a writable export"));
    }
    let marker = Bytes::from(vec![0xAB; 4096]);
    match nbd_tls::write(&mut session, offset, marker, LIMIT).await {
        Some(EPERM) => findings.refused_writes += 1,
        Some(0) => findings
            .violations
            .push(format!("node {node} took a viewer's write")),
        // Another error, or no reply: nothing was acknowledged.
        _ => {}
    }
}

/// A non-member node: refused at the handshake.
async fn as_stranger(
    node: u64,
    addr: SocketAddr,
    config: Arc<rustls::ClientConfig>,
    findings: &mut Findings,
) {
    findings.attempts += 1;
    if nbd_tls::open(addr, config, LIMIT).await.is_ok() {
        findings.violations.push(format!(
            "node {node} served node {STRANGER}, which is not a member"
        ));
    }
}
