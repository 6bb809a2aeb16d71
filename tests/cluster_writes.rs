//! The replicated write path across real node processes on loopback: one
//! writer at a time, fenced by term (S1–S3), acknowledged writes surviving
//! the loss of the writer (S5), and degraded operation.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::cluster::Cluster;
use replica_ha::ids::{NodeId, Term};
use replica_ha::proto::replica as pb;
use replica_ha::proto::replica::replica_client::ReplicaClient;
use replica_ha::replica::{ReplicaError, Stamp};
use replica_ha::volume::RangeError;
use tokio::time::Instant;
use tonic::Code;

const WAIT: Duration = Duration::from_secs(20);

fn block(tag: u64) -> Bytes {
    let mut data = vec![0u8; 4096];
    for (i, chunk) in data.chunks_mut(8).enumerate() {
        chunk.copy_from_slice(&(tag.wrapping_mul(1_000_003) + i as u64).to_le_bytes());
    }
    Bytes::from(data)
}

fn replica_client(cluster: &Cluster, id: u64) -> ReplicaClient<tonic::transport::Channel> {
    ReplicaClient::new(cluster.peer_channel(id))
}

async fn volume(cluster: &Cluster, id: u64) -> Option<pb::VolumeRef> {
    Some(cluster.volume_ref(id).await)
}

/// What node `id`'s own replica holds at `offset` (read straight from its
/// block channel, not through any engine).
async fn on_replica(cluster: &Cluster, id: u64, offset: u64) -> Bytes {
    cluster
        .block_client(id)
        .await
        .read(offset, 4096)
        .await
        .unwrap()
}

/// The main split-brain case: the writer is paused past its lease, another
/// node is promoted and writes; the old writer resumes and tries to write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_writer_that_resumes_cannot_write_after_the_new_writer_fenced() {
    let _serial = common::cluster::one_cluster_at_a_time().await;
    let cluster = Cluster::start(3).await;
    let (old, old_term) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    // The volume under test is not the only one.
    cluster.add_volumes(&["other", "more"], WAIT).await;
    cluster.write(old, 0, block(1)).await.unwrap();

    cluster.pause(old);
    let others: Vec<u64> = [1, 2, 3].into_iter().filter(|id| *id != old).collect();
    let (new, new_term) = cluster.wait_for_writer(&others, WAIT).await;
    assert!(new_term > old_term);
    cluster.write(new, 0, block(2)).await.unwrap();

    cluster.resume(old);
    // Every write the old writer tries after resuming is refused.
    let until = Instant::now() + Duration::from_secs(2);
    let mut attempts = 0;
    while Instant::now() < until {
        let outcome = cluster.write(old, 0, block(3)).await;
        if outcome.is_ok() {
            // Which term took it: a fenced old term would break S1; the
            // old node elected again in a later term would not.
            let status = cluster.status(old).await;
            let seen = status.map(|s| (s.term, s.role, s.gate_open));
            panic!(
                "the old writer's write was acknowledged (old term {old_term}, new {new_term}; \
                 node {old} now: (term, role, gate open) {seen:?})"
            );
        }
        attempts += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(attempts > 10);
    // Writes stamped with the old term are refused by every fenced replica;
    // enough replicas are fenced to shut the old writer out.
    let mut fenced = Vec::new();
    for id in [1, 2, 3] {
        let status = cluster.status(id).await.unwrap();
        if status.fence_floor >= new_term {
            fenced.push(id);
        }
    }
    assert!(fenced.len() >= 2, "fenced replicas: {fenced:?}");
    for id in &fenced {
        let refused = cluster
            .block_client(*id)
            .await
            .write(Stamp::from(Term(old_term)), 0, block(4), false)
            .await
            .unwrap_err();
        assert!(
            matches!(refused, ReplicaError::StaleTerm { .. }),
            "replica {id}: {refused:?}"
        );
        assert!(refused.to_string().contains("stale term"), "{refused}");
    }
    // No byte the old writer sent after the fence is anywhere, and every
    // in-sync replica holds the new writer's data.
    let in_sync = cluster.status(new).await.unwrap().in_sync;
    for id in [1, 2, 3] {
        let data = on_replica(&cluster, id, 0).await;
        assert!(
            data != block(3) && data != block(4),
            "replica {id} holds a stale write"
        );
        if in_sync.contains(&id.to_string()) {
            assert!(
                data == block(2),
                "in-sync replica {id} lacks the new writer's data"
            );
        }
    }
    let status = cluster.status(old).await.unwrap();
    assert!(!status.gate_open);
    // The replicas' own audit: none admitted a request below its floor.
    for replica in &cluster.status(new).await.unwrap().replicas {
        if replica.reachable {
            assert_eq!(replica.stale_accepts, 0, "replica {} audit", replica.id);
        }
    }
}

/// S5: every write acknowledged before the writer is killed reads back from
/// the next writer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_writes_survive_a_sigkill_of_the_writer() {
    let _serial = common::cluster::one_cluster_at_a_time().await;
    let mut cluster = Cluster::start(3).await;
    let (old, _) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    // The volume under test is not the only one.
    cluster.add_volumes(&["other", "more"], WAIT).await;
    let mut acked = Vec::new();
    for i in 0..40u64 {
        if cluster.write(old, i * 4096, block(100 + i)).await.is_ok() {
            acked.push(i);
        }
    }
    // Kill it while writes are in flight.
    let in_flight = {
        let channel = cluster.channel(old);
        tokio::spawn(async move {
            let mut client = replica_ha::proto::admin::admin_client::AdminClient::new(channel);
            let mut acked = Vec::new();
            for i in 40..400u64 {
                let request = replica_ha::proto::admin::WriteRequest {
                    offset: i * 4096,
                    data: block(100 + i),
                    fua: false,
                };
                match client.write(request).await {
                    Ok(_) => acked.push(i),
                    Err(_) => break,
                }
            }
            acked
        })
    };
    tokio::time::sleep(Duration::from_millis(150)).await;
    cluster.kill(old);
    acked.extend(in_flight.await.unwrap());
    assert!(
        acked.len() > 40,
        "too few writes before the kill: {}",
        acked.len()
    );

    let others: Vec<u64> = [1, 2, 3].into_iter().filter(|id| *id != old).collect();
    let (new, _) = cluster.wait_for_writer(&others, WAIT).await;
    for i in &acked {
        let data = cluster.read(new, i * 4096, 4096).await.unwrap();
        assert!(data == block(100 + i), "acknowledged block {i} lost");
    }
}

/// One replica down: writes continue once the shrink is committed. Two
/// down: writes fail with a clear error, nothing is acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_continue_with_one_replica_down_and_fail_with_two() {
    let _serial = common::cluster::one_cluster_at_a_time().await;
    let mut cluster = Cluster::start(3).await;
    let (writer, _) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    let followers: Vec<u64> = [1, 2, 3].into_iter().filter(|id| *id != writer).collect();
    cluster.write(writer, 0, block(1)).await.unwrap();

    cluster.kill(followers[0]);
    cluster.write(writer, 4096, block(2)).await.unwrap();
    let status = cluster.status(writer).await.unwrap();
    assert_eq!(status.in_sync.len(), 2, "{status:?}");
    assert!(!status.in_sync.contains(&followers[0].to_string()));

    cluster.kill(followers[1]);
    let err = cluster.write(writer, 8192, block(3)).await.unwrap_err();
    assert!(
        err.message().contains("in-sync")
            || err.message().contains("lease")
            || err.message().contains("leader"),
        "{err:?}"
    );
    // The in-sync set never went below min_in_sync.
    let deadline = Instant::now() + WAIT;
    while let Some(status) = cluster.status(writer).await {
        if status.in_sync.len() >= 2 || Instant::now() > deadline {
            assert_eq!(status.in_sync.len(), 2, "{status:?}");
            break;
        }
    }
}

/// The replica service listens apart from Raft, by default on a port the
/// OS picks, and peers ask each node where. A follower that comes back on
/// another port is found again: the writer rebuilds it and it is back in
/// sync, without any address configured.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_back_on_another_data_port_is_found_and_rebuilt() {
    let _serial = common::cluster::one_cluster_at_a_time().await;
    let mut cluster = Cluster::new(3);
    cluster.os_chosen_data_ports = true;
    for id in cluster.ids.clone() {
        cluster.spawn(id);
    }
    let (writer, _) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    let follower = [1, 2, 3].into_iter().find(|id| *id != writer).unwrap();
    cluster.write(writer, 0, block(1)).await.unwrap();
    let before = cluster.status(follower).await.unwrap().data_address;
    assert!(!before.is_empty());
    assert_ne!(before, cluster.addrs[&follower].to_string());

    // Restart it until the OS hands it another port (almost always at
    // once), writing meanwhile so that it has something to catch up on.
    let mut after = before.clone();
    for attempt in 0..5u64 {
        cluster.kill(follower);
        cluster
            .write(writer, 4096 * (attempt + 1), block(10 + attempt))
            .await
            .unwrap();
        cluster.spawn(follower);
        let deadline = Instant::now() + WAIT;
        after = loop {
            if let Some(status) = cluster.status(follower).await {
                break status.data_address;
            }
            assert!(
                Instant::now() < deadline,
                "node {follower} did not come back"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        if after != before {
            break;
        }
    }
    assert_ne!(after, before, "the OS gave the same port five times");

    let deadline = Instant::now() + WAIT * 3;
    loop {
        let status = cluster.status(writer).await;
        let back = status.as_ref().is_some_and(|s| {
            s.replicas
                .iter()
                .any(|r| r.id == follower.to_string() && r.state == "in_sync" && r.reachable)
        });
        if back {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "node {follower} never came back in sync: {status:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    cluster.write(writer, 1 << 20, block(99)).await.unwrap();
}

/// A proxied cluster started with `extra` arguments.
async fn proxied(extra: &[&str]) -> Cluster {
    let mut cluster = Cluster::new(3);
    cluster
        .extra_args
        .extend(extra.iter().map(|a| a.to_string()));
    cluster.add_proxies().await;
    for id in cluster.ids.clone() {
        cluster.spawn(id);
    }
    cluster
}

/// A write through `id`'s gate that may take up to `within`.
async fn slow_write(
    cluster: &Cluster,
    id: u64,
    offset: u64,
    tag: u64,
    within: Duration,
) -> Result<(), tonic::Status> {
    let mut request = tonic::Request::new(replica_ha::proto::admin::WriteRequest {
        offset,
        data: block(tag),
        fua: true,
    });
    request.set_timeout(within);
    cluster.admin(id).write(request).await.map(|_| ())
}

/// Leaves the writer with one follower down and the other's replica
/// unreachable (its data link cut, Raft still up): one in-sync copy of the
/// two needed. Returns (writer, the cut follower).
async fn one_copy_short(cluster: &mut Cluster) -> (u64, u64) {
    let (writer, _) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    let followers: Vec<u64> = [1, 2, 3].into_iter().filter(|id| *id != writer).collect();
    cluster.write(writer, 0, block(1)).await.unwrap();
    cluster.kill(followers[0]);
    cluster.write(writer, 4096, block(2)).await.unwrap();
    cluster.block_data(writer, followers[1], true);
    (writer, followers[1])
}

/// Design C2, degraded not failed: below `min_in_sync` a write is held,
/// not failed, and `status` says so; it completes once a replica answers
/// again, and reads back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn below_min_in_sync_a_write_waits_and_completes_when_a_replica_returns() {
    let _serial = common::cluster::one_cluster_at_a_time().await;
    let mut cluster = proxied(&["--suspend-timeout", "60"]).await;
    let (writer, cut) = one_copy_short(&mut cluster).await;
    let held = tokio::spawn({
        let channel = cluster.channel(writer);
        async move {
            let mut request = tonic::Request::new(replica_ha::proto::admin::WriteRequest {
                offset: 8192,
                data: block(3),
                fua: true,
            });
            request.set_timeout(Duration::from_secs(50));
            replica_ha::proto::admin::admin_client::AdminClient::new(channel)
                .write(request)
                .await
                .map(|_| ())
        }
    });
    let deadline = Instant::now() + WAIT;
    let status = loop {
        let status = cluster.status(writer).await;
        if let Some(status) = status.filter(|s| s.io_suspended_requests > 0) {
            break status;
        }
        assert!(Instant::now() < deadline, "the write was never held");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(status.io_suspended_why.contains("in-sync"), "{status:?}");
    assert!(!held.is_finished(), "the held write was answered");
    assert!(cluster.log(writer).contains("I/O suspended"));
    // Reads go on meanwhile.
    assert_eq!(cluster.read(writer, 0, 4096).await.unwrap(), block(1));

    cluster.block_data(writer, cut, false);
    held.await
        .unwrap()
        .expect("the held write completes once the replica is back");
    assert_eq!(cluster.read(writer, 8192, 4096).await.unwrap(), block(3));
    let status = cluster.status(writer).await.unwrap();
    assert_eq!(status.io_suspended_requests, 0, "{status:?}");
    assert!(cluster.log(writer).contains("I/O resumed"));
}

/// With a short `suspend_timeout`, a held write fails after that time,
/// and not before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_write_fails_after_the_suspend_timeout_and_not_before() {
    let _serial = common::cluster::one_cluster_at_a_time().await;
    let mut cluster = proxied(&["--suspend-timeout", "3"]).await;
    let (writer, _) = one_copy_short(&mut cluster).await;
    let started = Instant::now();
    let err = slow_write(&cluster, writer, 8192, 3, Duration::from_secs(30))
        .await
        .unwrap_err();
    let took = started.elapsed();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(err.message().contains("in-sync"), "{err:?}");
    assert!(took >= Duration::from_secs(3), "failed after {took:?}");
    assert!(took < Duration::from_secs(10), "failed only after {took:?}");
}

/// S6: the writer is killed during concurrent overlapping writes that have
/// reached one follower but not the other (the writer's link to the second
/// is cut, so they wait there, unacknowledged). Once the next writer is
/// promoted, every in-sync replica is byte-identical.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_sync_replicas_converge_after_the_writer_dies_mid_write() {
    let _serial = common::cluster::one_cluster_at_a_time().await;
    let mut cluster = Cluster::start_with_proxies(3).await;
    let (old, _) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    // The volume under test is not the only one.
    cluster.add_volumes(&["other", "more"], WAIT).await;
    let followers: Vec<u64> = [1, 2, 3].into_iter().filter(|id| *id != old).collect();
    cluster.block(old, followers[1], true);
    let mut writers = Vec::new();
    for worker in 0..4u64 {
        let channel = cluster.channel(old);
        writers.push(tokio::spawn(async move {
            let mut client = replica_ha::proto::admin::admin_client::AdminClient::new(channel);
            for i in 0..2000u64 {
                // Overlapping: every worker cycles over the same 64 blocks.
                let request = replica_ha::proto::admin::WriteRequest {
                    offset: ((i * 7 + worker * 13) % 64) * 4096 + (1 << 20),
                    data: block(worker * 10_000 + i),
                    fua: false,
                };
                if client.write(request).await.is_err() {
                    break;
                }
            }
        }));
    }
    // Less than the replica timeout: no shrink can have been committed.
    tokio::time::sleep(Duration::from_millis(300)).await;
    cluster.kill(old);
    cluster.block(old, followers[1], false);
    for writer in writers {
        writer.await.unwrap();
    }
    let others: Vec<u64> = [1, 2, 3].into_iter().filter(|id| *id != old).collect();
    let (new, _) = cluster.wait_for_writer(&others, WAIT).await;
    let in_sync: Vec<u64> = cluster
        .status(new)
        .await
        .unwrap()
        .in_sync
        .iter()
        .map(|id| id.parse().unwrap())
        .collect();
    assert!(in_sync.len() >= 2, "{in_sync:?}");
    // Compare extent digests (BLAKE3) of the whole volume.
    let mut first: Option<Vec<Bytes>> = None;
    for id in &in_sync {
        let digests = replica_client(&cluster, *id)
            .digest(pb::DigestRequest {
                volume: volume(&cluster, *id).await,
                offset: 0,
                length: 16 << 20,
            })
            .await
            .unwrap()
            .into_inner()
            .digests;
        assert_eq!(digests.len(), 16);
        match &first {
            None => first = Some(digests),
            Some(expected) => {
                for (i, (a, b)) in expected.iter().zip(&digests).enumerate() {
                    assert!(a == b, "extent {i} differs on replica {id}");
                }
            }
        }
    }
}

/// Bad requests to a node's block channel: each gets its refusal and the
/// replica's data is unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_replica_requests_to_a_node_change_nothing() {
    let _serial = common::cluster::one_cluster_at_a_time().await;
    let cluster = Cluster::start(3).await;
    let (writer, term) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    cluster.write(writer, 0, block(7)).await.unwrap();
    let target = [1, 2, 3].into_iter().find(|id| *id != writer).unwrap();
    // Another cluster's link is refused at its hello.
    let foreign = common::blocks::BlockClient::connect(
        &cluster.node_transport(target),
        &cluster.data_addrs[&target].to_string(),
        replica_ha::net::Expect::Node(NodeId(target)),
        "another-cluster",
        cluster.volume_ref(target).await.incarnation,
    )
    .await;
    let foreign = foreign.err().expect("another cluster's link was taken");
    assert!(foreign.to_string().contains("cluster"), "{foreign}");
    // And another cluster's control call: a fence far above the floor.
    let refused = replica_client(&cluster, target)
        .fence(pb::FenceRequest {
            volume: Some(pb::VolumeRef {
                cluster_id: "another-cluster".into(),
                ..cluster.volume_ref(target).await
            }),
            term: term + 5,
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    let client = cluster.block_client(target).await;
    let size = 16u64 << 20;
    let at = |term: u64| Stamp::from(Term(term));
    let stale = client.write(at(term - 1), 0, block(9), false).await;
    assert!(
        matches!(stale, Err(ReplicaError::StaleTerm { .. })),
        "{stale:?}"
    );
    let beyond = client.write(at(term), size - 1024, block(9), false).await;
    assert!(
        matches!(
            beyond,
            Err(ReplicaError::Range(RangeError::OutOfRange { .. }))
        ),
        "{beyond:?}"
    );
    let huge = Bytes::from(vec![9u8; (32 << 20) + 4096]);
    let oversized = client.write(at(term), 0, huge, false).await;
    assert!(
        matches!(
            oversized,
            Err(ReplicaError::Range(RangeError::TooLarge { .. }))
        ),
        "{oversized:?}"
    );
    // S8: meant for another incarnation of the node (a replaced disk).
    let incarnation = cluster.volume_ref(target).await.incarnation;
    let replaced = client
        .naming(incarnation ^ 1)
        .write(at(term + 5), 0, block(9), false)
        .await;
    assert!(
        matches!(replaced, Err(ReplicaError::IdentityMismatch(_))),
        "{replaced:?}"
    );
    assert!(on_replica(&cluster, target, 0).await == block(7));
    assert_eq!(cluster.status(target).await.unwrap().fence_floor, term);
}

/// S6 kept cheap: the writer retires the marks of what it wrote once that is
/// durable on every in-sync replica, during its term, so a failover
/// converges only the hot set, not all that the term ever wrote.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_writer_retires_its_marks_during_the_term() {
    let _serial = common::cluster::one_cluster_at_a_time().await;
    let cluster = Cluster::start(3).await;
    let (writer, _) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    for extent in 0..12u64 {
        cluster
            .write(writer, extent << 20, block(extent))
            .await
            .unwrap();
    }
    let marks = || async {
        let status = cluster.status(writer).await.unwrap();
        status
            .replicas
            .iter()
            .map(|r| (r.id.clone(), r.dirty_extents))
            .collect::<Vec<_>>()
    };
    let deadline = Instant::now() + WAIT;
    loop {
        let now = marks().await;
        if now.iter().all(|(_, count)| *count == 0) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "marks still held after the writes went quiet: {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
