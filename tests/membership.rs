//! S8 (no amnesia) and membership changes, with real node processes: a node
//! whose data dir is lost never votes as its former self and waits to be
//! replaced; replace, add and remove work under a writing client without
//! losing an acknowledged write; refused changes say why.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::cluster::Cluster;
use common::load::{assert_identical, check_acked, pattern, start_client};
use tokio::sync::watch;
use tokio::time::Instant;

const WAIT: Duration = Duration::from_secs(30);

/// Node `id` is not a member and says why, starting with `reason`.
async fn wait_not_member(cluster: &Cluster, id: u64, reason: &str) {
    cluster
        .wait_status(id, WAIT, &format!("\"{reason}…\""), |s| {
            s.not_member.starts_with(reason)
        })
        .await;
}

/// The scenario: a follower misses acknowledged writes; the writer
/// dies and the other follower, the only other holder of those writes,
/// loses its disk. The stale follower and the wiped node must not make a
/// writer; once the old writer returns, the writes are there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wiped_node_never_lends_its_former_vote_to_a_stale_follower() {
    let _serial = common::cluster::one_cluster_at_a_time().await;
    let mut cluster = Cluster::start(3).await;
    let (writer, _) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    let others: Vec<u64> = [1, 2, 3].into_iter().filter(|id| *id != writer).collect();
    let (stale, holder) = (others[0], others[1]);
    cluster.kill(stale);
    // 4 MiB, acknowledged by the writer and the holder only.
    let written: Vec<Bytes> = (0..4u64)
        .map(|i| Bytes::from(vec![0xa0 + i as u8; 1 << 20]))
        .collect();
    for (i, data) in written.iter().enumerate() {
        cluster
            .write(writer, (i as u64) << 20, data.clone())
            .await
            .unwrap();
    }
    cluster.kill(writer);
    cluster.kill(holder);
    cluster.wipe(holder);
    cluster.spawn(holder);
    cluster.spawn(stale);
    wait_not_member(&cluster, holder, "replaced disk: waiting to be re-added").await;
    // Several election rounds: nobody opens a write gate.
    let watch_until = Instant::now() + Duration::from_secs(4);
    while Instant::now() < watch_until {
        for id in [stale, holder] {
            if let Some(status) = cluster.status(id).await {
                assert!(
                    !status.gate_open,
                    "node {id} opened its write gate without the acknowledged data: {status:?}"
                );
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let status = cluster.status(holder).await.unwrap();
    assert!(
        status
            .not_member
            .contains(&format!("members replace --id {holder}")),
        "{status:?}"
    );
    // The old writer returns: the acknowledged writes are on whichever
    // node then writes.
    cluster.spawn(writer);
    let (now, _) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    assert_ne!(now, holder, "the wiped node became the writer");
    for (i, data) in written.iter().enumerate() {
        let read = cluster.read(now, (i as u64) << 20, 1 << 20).await.unwrap();
        assert!(read == *data, "MiB {i} is lost on node {now}");
    }
}

/// A single follower's data dir wiped: it does not bootstrap or vote, its
/// status says it waits; `members replace` brings it back, rebuilt in
/// full, while a client writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wiped_follower_waits_and_members_replace_rebuilds_it() {
    let _serial = common::cluster::one_cluster_at_a_time().await;
    let mut cluster = Cluster::start(3).await;
    let (writer, term) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    let wiped = [1, 2, 3].into_iter().find(|id| *id != writer).unwrap();
    let (stop, client) = start_client(&cluster, &[1, 2, 3]);
    cluster.wait_for_writes(writer, 50, WAIT).await;
    let uuid = cluster.status(writer).await.unwrap().cluster_uuid;
    assert_eq!(uuid.len(), 36, "the cluster has a uuid: {uuid:?}");
    let incarnation = wipe_and_wait(&mut cluster, wiped).await;
    // The writer carries on without it.
    let (still, still_term) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    assert_eq!((still, still_term), (writer, term));
    cluster.wait_for_writes(writer, 50, WAIT).await;
    replace_and_rebuild(&cluster, writer, wiped).await;
    assert_eq!(
        cluster.status(wiped).await.unwrap().cluster_uuid,
        uuid,
        "the new incarnation joined the same cluster"
    );
    cluster.wait_for_writes(writer, 50, WAIT).await;
    stop.send_replace(true);
    let acked = client.await.unwrap();
    check_acked(&cluster, writer, &acked).await;
    assert_identical(&cluster, &[1, 2, 3]).await;
    let (ok, out, _) = cluster.cli(writer, &["members"]).await;
    assert!(ok);
    let line = out
        .lines()
        .find(|l| l.starts_with(&wiped.to_string()))
        .unwrap_or_default();
    assert!(
        line.contains(&format!("{incarnation:010x}")) && line.contains("voter"),
        "{out}"
    );
}

/// At `min_in_sync` equal to the members (3 of 3), a lost disk leaves too
/// few in sync to acknowledge a write. `members replace` must go on all
/// the same, for it is what brings the third copy back: the writes held
/// meanwhile then complete, and none acknowledged is lost. (The engine
/// test `a_replaced_copy_leaves_the_in_sync_set_below_min_in_sync_and_
/// writes_wait` pins the replace's own removal below `min_in_sync`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replace_goes_on_when_every_member_must_be_in_sync() {
    let _serial = common::cluster::one_cluster_at_a_time().await;
    let mut cluster = Cluster::new(3);
    cluster
        .extra_args
        .extend(["--min-in-sync".into(), "3".into()]);
    for id in [1, 2, 3] {
        cluster.spawn(id);
    }
    let (writer, term) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    let wiped = [1, 2, 3].into_iter().find(|id| *id != writer).unwrap();
    let (stop, client) = start_client(&cluster, &[1, 2, 3]);
    cluster.wait_for_writes(writer, 50, WAIT).await;
    // The writer may drop the lost copy before the replace, as one that
    // restarted (its store's session changed), or the replace drops it:
    // either way below min_in_sync, and writes wait meanwhile.
    wipe_and_wait(&mut cluster, wiped).await;
    replace_and_rebuild(&cluster, writer, wiped).await;
    assert_eq!(
        cluster.wait_for_writer(&[1, 2, 3], WAIT).await,
        (writer, term),
        "the replace changed no writer"
    );
    cluster.wait_for_writes(writer, 50, WAIT).await;
    stop.send_replace(true);
    let acked = client.await.unwrap();
    check_acked(&cluster, writer, &acked).await;
    assert_identical(&cluster, &[1, 2, 3]).await;
}

/// Kills node `id`, wipes its data dir and starts it again; waits until
/// it says it waits to be re-added, as a new incarnation that took part in
/// no vote. Returns that incarnation.
async fn wipe_and_wait(cluster: &mut Cluster, id: u64) -> u64 {
    let before = cluster.status(id).await.unwrap().incarnation;
    cluster.kill(id);
    cluster.wipe(id);
    cluster.spawn(id);
    wait_not_member(cluster, id, "replaced disk: waiting to be re-added").await;
    let waiting = cluster.status(id).await.unwrap();
    assert_ne!(
        waiting.incarnation, before,
        "a new data dir, a new incarnation"
    );
    assert_eq!(waiting.term, 0, "the waiting node took no part in any vote");
    waiting.incarnation
}

/// `members replace --id ID` on `writer`, then waits until node `id` is a
/// member again and `writer` counts it in sync.
async fn replace_and_rebuild(cluster: &Cluster, writer: u64, id: u64) {
    let (ok, out, err) = cluster
        .cli(writer, &["members", "replace", "--id", &id.to_string()])
        .await;
    assert!(ok, "members replace failed: {out}{err}");
    assert!(out.contains("rebuilt in full"), "{out}");
    cluster
        .wait_status(id, WAIT, "a member again", |s| s.not_member.is_empty())
        .await;
    cluster.wait_in_sync(writer, id, true, WAIT).await;
}

/// Grow from three nodes to five and shrink back to three while a client
/// writes: nothing acknowledged is lost and the replicas end identical.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grow_to_five_and_shrink_to_three_under_a_writing_client() {
    let _serial = common::cluster::one_cluster_at_a_time().await;
    let mut cluster = Cluster::new(5);
    cluster.founders = Some(vec![1, 2, 3]);
    // Nodes 4 and 5 list five peers, whose default min_in_sync would be 3.
    cluster
        .extra_args
        .extend(["--min-in-sync".into(), "2".into()]);
    for id in [1, 2, 3] {
        cluster.spawn(id);
    }
    let (writer, _) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    let (stop, client) = start_client(&cluster, &[1, 2, 3]);
    for id in [4, 5] {
        cluster.spawn(id);
        wait_not_member(&cluster, id, "new node: waiting to be added").await;
    }
    for id in [4u64, 5] {
        let addr = cluster.addrs[&id].to_string();
        let (ok, out, err) = cluster
            .cli(
                writer,
                &["members", "add", "--id", &id.to_string(), "--addr", &addr],
            )
            .await;
        assert!(ok, "members add {id}: {out}{err}");
        cluster.wait_in_sync(writer, id, true, WAIT).await;
    }
    let (ok, out, _) = cluster.cli(writer, &["members"]).await;
    assert!(ok);
    assert_eq!(
        out.lines()
            .filter(|l| l.contains("voter") || l.contains("leader"))
            .count(),
        5,
        "{out}"
    );
    cluster.wait_for_writes(writer, 50, WAIT).await;
    for id in [5u64, 4] {
        let (ok, out, err) = cluster
            .cli(writer, &["members", "remove", "--id", &id.to_string()])
            .await;
        assert!(ok, "members remove {id}: {out}{err}");
        cluster.wait_in_sync(writer, id, false, WAIT).await;
    }
    let deadline = Instant::now() + WAIT;
    while cluster.member_ids(writer).await != [1, 2, 3] {
        assert!(
            Instant::now() < deadline,
            "{:?}",
            cluster.member_ids(writer).await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    cluster.wait_for_writes(writer, 50, WAIT).await;
    stop.send_replace(true);
    let acked = client.await.unwrap();
    check_acked(&cluster, writer, &acked).await;
    assert_identical(&cluster, &[1, 2, 3]).await;
    let (_, out, _) = cluster.cli(writer, &["members"]).await;
    assert_eq!(out.lines().count(), 4, "a header and three members: {out}");
    // #21: the maps opened when 4 and 5 left the in-sync set are closed
    // once they are no longer members.
    for id in [1u64, 2, 3] {
        let deadline = Instant::now() + WAIT;
        loop {
            let maps = cluster.missed_maps(id).await;
            if !maps.iter().any(|node| *node == 4 || *node == 5) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "node {id} still keeps maps of {maps:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Removing the writer's own node moves leadership first: the client sees
/// one change of writer, and the removed node no longer counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_the_writers_node_hands_over_first() {
    let _serial = common::cluster::one_cluster_at_a_time().await;
    let cluster = Cluster::start(3).await;
    let (writer, _) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    let (stop, client) = start_client(&cluster, &[1, 2, 3]);
    cluster.wait_for_writes(writer, 50, WAIT).await;
    // Who writes, sampled while the removal runs.
    let (done, mut finished) = watch::channel(false);
    let sampler = async {
        let mut seen: Vec<u64> = Vec::new();
        while !*finished.borrow_and_update() {
            for id in [1, 2, 3] {
                if let Some(s) = cluster.status(id).await {
                    if s.gate_open && seen.last() != Some(&id) {
                        seen.push(id);
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        seen
    };
    let remove = async {
        let out = cluster
            .cli(writer, &["members", "remove", "--id", &writer.to_string()])
            .await;
        done.send_replace(true);
        out
    };
    let (mut seen, (ok, out, err)) = tokio::join!(sampler, remove);
    assert!(ok, "members remove --id {writer}: {out}{err}");
    assert!(out.contains("leadership moved to node"), "{out}");
    // The sampler may have stopped before it saw the new writer's gate.
    let (new, _) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    if seen.last() != Some(&new) {
        seen.push(new);
    }
    assert_ne!(new, writer);
    assert_eq!(seen, [writer, new], "one change of writer, no more");
    let deadline = Instant::now() + WAIT;
    while cluster.member_ids(new).await.len() != 2 {
        assert!(
            Instant::now() < deadline,
            "{:?}",
            cluster.member_ids(new).await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    cluster.wait_for_writes(new, 50, WAIT).await;
    stop.send_replace(true);
    let acked = client.await.unwrap();
    check_acked(&cluster, new, &acked).await;
    let rest: Vec<u64> = [1, 2, 3].into_iter().filter(|id| *id != writer).collect();
    assert_identical(&cluster, &rest).await;
    assert_eq!(cluster.member_ids(new).await, rest);
}

/// Each refused change gives its error and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_membership_changes_say_why() {
    let _serial = common::cluster::one_cluster_at_a_time().await;
    let mut cluster = Cluster::new(4);
    cluster.founders = Some(vec![1, 2, 3]);
    cluster
        .extra_args
        .extend(["--min-in-sync".into(), "3".into()]);
    for id in [1, 2, 3] {
        cluster.spawn(id);
    }
    let (writer, _) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    let follower = [1, 2, 3].into_iter().find(|id| *id != writer).unwrap();
    let follower_id = follower.to_string();
    let cases: [(&[&str], &str); 5] = [
        (
            &["members", "remove", "--id", "9"],
            "node 9 is not a member",
        ),
        (
            &["members", "replace", "--id", "9"],
            "node 9 is not a member",
        ),
        (
            &["members", "remove", "--id", &follower_id],
            "fewer than min_in_sync",
        ),
        (
            &["members", "replace", "--id", &follower_id],
            "has no new incarnation waiting",
        ),
        (
            &[
                "members",
                "add",
                "--id",
                &follower_id,
                "--addr",
                "127.0.0.1:1",
            ],
            "is a member already",
        ),
    ];
    for (args, expect) in cases {
        let (ok, out, err) = cluster.cli(writer, args).await;
        assert!(!ok, "{args:?} was not refused: {out}");
        assert!(err.contains(expect), "{args:?}: {err}");
    }
    let (ok, _, err) = cluster
        .cli(follower, &["members", "remove", "--id", "9"])
        .await;
    assert!(!ok && err.contains("only the writer"), "{err}");
    // A second change while one runs: adding node 4, which is not running,
    // waits for it to announce itself.
    let addr = cluster.addrs[&4].to_string();
    let first = async {
        cluster
            .cli(writer, &["members", "add", "--id", "4", "--addr", &addr])
            .await
    };
    let second = async {
        tokio::time::sleep(Duration::from_secs(2)).await;
        cluster
            .cli(writer, &["members", "remove", "--id", "9"])
            .await
    };
    let ((first_ok, _, first_err), (second_ok, _, second_err)) = tokio::join!(first, second);
    assert!(
        !first_ok && first_err.contains("did not announce itself"),
        "{first_err}"
    );
    assert!(
        !second_ok && second_err.contains("membership change is in progress"),
        "{second_err}"
    );
    let (_, out, _) = cluster.cli(writer, &["members"]).await;
    assert_eq!(out.lines().count(), 4, "nothing changed: {out}");
}

/// With `auto_replace`, the writer brings a wiped follower back by itself
/// once its old incarnation has been silent long enough.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_replace_brings_a_wiped_follower_back_by_itself() {
    let _serial = common::cluster::one_cluster_at_a_time().await;
    let mut cluster = Cluster::new(3);
    cluster.extra_args.extend([
        "--auto-replace".into(),
        "--auto-replace-after".into(),
        "2".into(),
    ]);
    for id in [1, 2, 3] {
        cluster.spawn(id);
    }
    let (writer, _) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    let wiped = [1, 2, 3].into_iter().find(|id| *id != writer).unwrap();
    cluster.write(writer, 0, pattern(1)).await.unwrap();
    cluster.kill(wiped);
    cluster.wipe(wiped);
    let died = Instant::now();
    cluster.spawn(wiped);
    cluster
        .wait_status(wiped, WAIT, "a member again", |s| s.not_member.is_empty())
        .await;
    assert!(
        died.elapsed() >= Duration::from_secs(2),
        "replaced before the old incarnation was silent for auto_replace_after"
    );
    cluster.wait_in_sync(writer, wiped, true, WAIT).await;
    assert!(cluster.log(writer).contains("auto_replace: replacing"));
    assert_identical(&cluster, &[1, 2, 3]).await;
}

/// A node whose replica directory is gone while its Raft state is there
/// refuses to start (exit 2, saying what to do), rather than count an
/// empty copy as the one it held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_replica_dir_with_raft_state_intact_refuses_to_start() {
    let _serial = common::cluster::one_cluster_at_a_time().await;
    let mut cluster = Cluster::start(3).await;
    let (writer, _) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    let lost = [1, 2, 3].into_iter().find(|id| *id != writer).unwrap();
    cluster.write(writer, 0, pattern(3)).await.unwrap();
    cluster.kill(lost);
    std::fs::remove_dir_all(cluster.data_dir(lost).join("replica")).unwrap();
    cluster.spawn(lost);
    let deadline = Instant::now() + WAIT;
    let status = loop {
        if let Some((_, status)) = cluster.exited().into_iter().find(|(id, _)| *id == lost) {
            break status;
        }
        assert!(Instant::now() < deadline, "node {lost} kept running");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(status.code(), Some(2));
    let log = cluster.log(lost);
    assert!(
        log.contains("is missing but this node's Raft state is there"),
        "{log}"
    );
    assert!(
        log.contains(&format!("members replace --id {lost}")),
        "{log}"
    );
}
