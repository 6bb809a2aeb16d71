//! The embedded Raft coordinator across real `replica-ha node` processes on
//! 127.0.0.1: election, failover after SIGKILL, a partitioned leader giving
//! up its lease before anyone else takes one, transfer, full restart, and
//! configuration errors.

mod common;

use std::process::Command;
use std::time::Duration;

use common::cluster::{BIN, Cluster, free_port};
use tokio::time::Instant;

const ELECTION: Duration = Duration::from_secs(15);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_elect_exactly_one_leader_and_agree_on_its_term() {
    let _serial = common::cluster::one_cluster_at_a_time().await;
    let cluster = Cluster::start(3).await;
    let (leader, term) = cluster.wait_for_leader(&[1, 2, 3], ELECTION).await;
    assert!(term >= 1);
    for id in [1, 2, 3] {
        let status = cluster.status(id).await.expect("status");
        assert_eq!(status.leader, leader, "node {id}");
        assert_eq!(status.term, term, "node {id}");
        assert_eq!(status.is_self, id == leader, "node {id}");
        assert_eq!(status.cluster_id, "test-cluster");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_of_the_leader_elects_another_with_a_greater_term_and_the_old_one_rejoins() {
    let _serial = common::cluster::one_cluster_at_a_time().await;
    let mut cluster = Cluster::start(3).await;
    let (old, old_term) = cluster.wait_for_leader(&[1, 2, 3], ELECTION).await;
    cluster.kill(old);
    let rest: Vec<u64> = [1, 2, 3].into_iter().filter(|id| *id != old).collect();
    let (new, new_term) = cluster.wait_for_leader(&rest, ELECTION).await;
    assert_ne!(new, old);
    assert!(new_term > old_term, "{new_term} > {old_term}");

    cluster.spawn(old);
    let deadline = Instant::now() + ELECTION;
    loop {
        if let Some(status) = cluster.status(old).await {
            if status.leader != 0 && !status.is_self && status.term >= new_term {
                assert_eq!(status.raft_state, "follower");
                break;
            }
        }
        assert!(Instant::now() < deadline, "node {old} did not rejoin");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// S4 across processes: a leader cut off from both peers reports it is no
/// longer leader before either peer reports itself leader.
///
/// A status reply says what held at some moment while the call was open,
/// and a call to a node whose peers are cut off takes a few hundred
/// milliseconds (its replicas' floors time out). So the check is the one
/// the samples can prove: once a peer has reported itself leader, a status
/// call to the old leader that starts after that must find it no longer
/// leading. (Comparing the replies' arrival times instead failed now and
/// then without any overlap: the old leader's "leader" sample could be
/// taken just before its lease ran out and arrive after a fast election.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_leader_drops_its_lease_before_a_new_leader_takes_one() {
    let _serial = common::cluster::one_cluster_at_a_time().await;
    let cluster = Cluster::start_with_proxies(3).await;
    let (old, _) = cluster.wait_for_leader(&[1, 2, 3], ELECTION).await;
    let others: Vec<u64> = [1, 2, 3].into_iter().filter(|id| *id != old).collect();
    cluster.isolate(old, true);
    let cut = Instant::now();

    // When a call to the old leader that found it no longer leading began.
    let mut old_gave_up = None;
    // When a call that found a peer leading returned, and which peer.
    let mut new_took_over = None;
    let deadline = cut + ELECTION;
    while new_took_over.is_none() {
        assert!(
            Instant::now() < deadline,
            "no new leader after the partition"
        );
        let asked = Instant::now();
        let old_status = cluster
            .status(old)
            .await
            .expect("old leader answers its admin port");
        if !old_status.is_self && old_gave_up.is_none() {
            old_gave_up = Some(asked);
        }
        for id in &others {
            if cluster.status(*id).await.is_some_and(|s| s.is_self) {
                new_took_over = Some((Instant::now(), *id));
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (took_over, new) = new_took_over.unwrap();
    let asked = Instant::now();
    let old_status = cluster
        .status(old)
        .await
        .expect("old leader answers its admin port");
    assert!(
        !old_status.is_self,
        "node {old} still reports its lease ({} ms left) after node {new} reported itself leader",
        old_status.lease_remaining_ms
    );
    let gave_up = old_gave_up.unwrap_or(asked);
    eprintln!(
        "lease dropped by {:?} after the cut; new leader by {:?} after",
        gave_up - cut,
        took_over - cut
    );

    cluster.isolate(old, false);
    cluster.wait_for_leader(&[1, 2, 3], ELECTION).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leadership_transfers_to_a_named_node() {
    let _serial = common::cluster::one_cluster_at_a_time().await;
    let cluster = Cluster::start(3).await;
    let (leader, term) = cluster.wait_for_leader(&[1, 2, 3], ELECTION).await;
    let target = if leader == 3 { 2 } else { 3 };
    let out = Command::new(BIN)
        .args([
            "transfer",
            "--addr",
            &cluster.addrs[&leader].to_string(),
            "--to",
            &target.to_string(),
        ])
        .args(cluster.cli_tls("admin"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (now, new_term) = cluster.wait_for_leader(&[1, 2, 3], ELECTION).await;
    assert_eq!(now, target);
    assert!(new_term > term);

    // Asking a follower to transfer is refused with a clear error.
    let follower = [1, 2, 3].into_iter().find(|id| *id != target).unwrap();
    let out = Command::new(BIN)
        .args([
            "transfer",
            "--addr",
            &cluster.addrs[&follower].to_string(),
            "--to",
            &follower.to_string(),
        ])
        .args(cluster.cli_tls("admin"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not the active writer"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_restart_keeps_the_cluster_and_terms_keep_rising() {
    let _serial = common::cluster::one_cluster_at_a_time().await;
    let mut cluster = Cluster::start(3).await;
    let (_, first_term) = cluster.wait_for_leader(&[1, 2, 3], ELECTION).await;
    for id in [1, 2, 3] {
        assert!(cluster.log(id).contains("node started"));
    }
    let bootstraps = bootstraps_logged(&cluster);
    assert_eq!(bootstraps, 1, "only the founder forms the cluster");

    for id in [1, 2, 3] {
        let status = cluster.terminate(id);
        assert!(
            status.success(),
            "node {id} exit status {status:?} after SIGTERM"
        );
    }
    for id in [1, 2, 3] {
        cluster.spawn(id);
    }
    // Terms never go back. (openraft restores a node whose persisted vote
    // made it leader as leader of that same term, so the term need not
    // rise when the last leader comes back first.)
    let (_, second_term) = cluster.wait_for_leader(&[1, 2, 3], ELECTION).await;
    assert!(second_term >= first_term, "{second_term} >= {first_term}");
    let after = bootstraps_logged(&cluster);
    assert_eq!(after, bootstraps, "a restart must not bootstrap again");
    // The replicated control state survived and every node agrees on it.
    // (Promotions during the sequential shutdown fence and drop nodes that
    // were already down, so the in-sync set may have shrunk; it only grows
    // back through resync.)
    let deadline = Instant::now() + ELECTION;
    loop {
        let mut states = Vec::new();
        for id in [1, 2, 3] {
            let status = cluster.status(id).await.unwrap();
            assert_eq!(status.cluster_id, "test-cluster");
            assert_eq!(status.volume_size, 16 << 20);
            states.push((status.in_sync, status.last_applied));
        }
        if states.iter().all(|s| *s == states[0]) {
            assert!(!states[0].0.is_empty());
            break;
        }
        assert!(Instant::now() < deadline, "nodes never agreed: {states:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// How many times any node logged that it bootstrapped the membership.
fn bootstraps_logged(cluster: &Cluster) -> usize {
    cluster
        .ids
        .iter()
        .map(|id| cluster.log(*id).matches("formed the cluster").count())
        .sum()
}

fn node_error(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(BIN).arg("node").args(args).output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

#[test]
fn configuration_errors_exit_2_with_one_clear_line() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("d").display().to_string();
    let listen = format!("127.0.0.1:{}", free_port());
    let base = |extra: &[&str]| {
        let mut args = vec!["--id", "1", "--listen", &listen, "--data-dir", &data];
        args.extend_from_slice(extra);
        args.iter().map(|s| s.to_string()).collect::<Vec<_>>()
    };
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            base(&["--peer", "1=127.0.0.1:1", "--peer", "1=127.0.0.1:2"]),
            "duplicate peer id 1",
        ),
        (
            base(&["--peer", "2=127.0.0.1:2", "--peer", "3=127.0.0.1:3"]),
            "id 1 is not in the peer list",
        ),
        (
            base(&["--peer", "1=127.0.0.1:1", "--min-in-sync", "2"]),
            "min_in_sync 2 must be between 1 and the number of nodes (1)",
        ),
        (base(&["--peer", "1=not-an-address"]), "not HOST:PORT"),
    ];
    for (args, expected) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, stderr) = node_error(&args);
        assert_eq!(code, Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    }
    let config = dir.path().join("bad.toml");
    std::fs::write(&config, "id = 1\nbogus = 3\n").unwrap();
    let (code, stderr) = node_error(&["--config", config.to_str().unwrap()]);
    assert_eq!(code, Some(2));
    assert!(stderr.contains("bogus"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_dir_of_another_cluster_is_refused() {
    let _serial = common::cluster::one_cluster_at_a_time().await;
    let mut cluster = Cluster::start(1).await;
    cluster.wait_for_leader(&[1], ELECTION).await;
    assert!(cluster.terminate(1).success());
    cluster.cluster_id = "another-cluster".into();
    let out = Command::new(BIN).args(cluster.args(1)).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("belongs to cluster \"test-cluster\""),
        "{stderr}"
    );
}

/// Pre-vote: a follower cut off for a while does not raise the term, so
/// when it comes back the leader keeps leading in the same term.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_healed_partitioned_follower_does_not_disturb_the_leader() {
    let _serial = common::cluster::one_cluster_at_a_time().await;
    let cluster = Cluster::start_with_proxies(3).await;
    // Start from a settled cluster: the volume config and the first
    // promotion committed. Before that, log entries whose fsync outlasts
    // openraft's 50 ms AppendEntries deadline on a busy disk (CI, right
    // after a build) can cost the first leader its lease, which is not
    // what this test is about.
    cluster.wait_for_writer(&[1, 2, 3], ELECTION * 2).await;
    let (leader, term) = cluster.wait_for_leader(&[1, 2, 3], ELECTION).await;
    let follower = [1, 2, 3].into_iter().find(|id| *id != leader).unwrap();
    cluster.isolate(follower, true);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let cut_off = cluster.status(follower).await.unwrap();
    assert!(
        cut_off.term <= term,
        "the cut-off follower raised its term to {}",
        cut_off.term
    );
    cluster.isolate(follower, false);
    let deadline = Instant::now() + ELECTION;
    loop {
        let status = cluster.status(follower).await.unwrap();
        if status.leader == leader {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the follower never rejoined: {status:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (after, after_term) = cluster.wait_for_leader(&[1, 2, 3], ELECTION).await;
    assert_eq!((after, after_term), (leader, term));
}

/// Each (node, term)'s writable interval from the gate journals, in wall
/// nanoseconds: from `open` to the latest `until` of its `open`/`admit`
/// lines, cut at its `close` (the rule of the fault campaign's checker).
fn gate_intervals(cluster: &Cluster) -> Vec<(u64, u64, u64, u64)> {
    use std::collections::BTreeMap;
    let field = |line: &str, key: &str| -> Option<u64> {
        line.split(' ')
            .find_map(|part| part.strip_prefix(key)?.strip_prefix('='))
            .and_then(|value| value.parse().ok())
    };
    let mut all: BTreeMap<(u64, u64), (u64, u64, Option<u64>)> = BTreeMap::new();
    for id in &cluster.ids {
        let text = std::fs::read_to_string(cluster.journal_path(*id)).unwrap_or_default();
        for line in text.lines() {
            let (Some(term), Some(at)) = (field(line, "term"), field(line, "at")) else {
                continue;
            };
            let until = field(line, "until").unwrap_or(at);
            let entry = all.entry((*id, term)).or_insert((at, at, None));
            match line.split(' ').next() {
                Some("open") | Some("admit") => {
                    entry.0 = entry.0.min(at);
                    entry.1 = entry.1.max(at).max(until);
                }
                Some("close") => entry.2 = Some(entry.2.map_or(at, |c: u64| c.min(at))),
                _ => {}
            }
        }
    }
    all.into_iter()
        .map(|((node, term), (start, end, close))| {
            (
                node,
                term,
                start,
                close.map_or(end, |c| end.min(c)).max(start),
            )
        })
        .collect()
}

/// S4, the lease from send times: a leader frozen (SIGSTOP) for 2 s while
/// clients keep writes queued on it finds, when it wakes, a lease that ran
/// out at its last real quorum acknowledgement. No timer wake may renew it:
/// its status never shows a lease of the old term again, and its gate
/// journal shows no write admitted into the next writer's interval.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_leader_wakes_without_a_lease_and_its_gate_never_overlaps_the_next() {
    use replica_ha::proto::admin::WriteRequest;
    use replica_ha::proto::admin::admin_client::AdminClient;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    let _serial = common::cluster::one_cluster_at_a_time().await;
    let cluster = Cluster::start(3).await;
    let (old, old_term) = cluster.wait_for_writer(&[1, 2, 3], ELECTION * 2).await;
    let others: Vec<u64> = [1, 2, 3].into_iter().filter(|id| *id != old).collect();

    // Clients that keep writing to the old writer, so that requests are
    // queued on it while it is frozen and arrive the moment it wakes.
    let stop = Arc::new(AtomicBool::new(false));
    let mut clients = Vec::new();
    for n in 0..4u64 {
        let channel = cluster.channel(old);
        let stop = Arc::clone(&stop);
        clients.push(tokio::spawn(async move {
            let mut client = AdminClient::new(channel);
            while !stop.load(Ordering::SeqCst) {
                let mut request = tonic::Request::new(WriteRequest {
                    offset: n * 4096,
                    data: bytes::Bytes::from(vec![n as u8; 4096]),
                    fua: false,
                });
                request.set_timeout(Duration::from_secs(5));
                if client.write(request).await.is_err() {
                    tokio::task::yield_now().await;
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;

    cluster.pause(old);
    let frozen = Instant::now();
    let (new, new_term) = cluster.wait_for_writer(&others, ELECTION).await;
    assert!(new_term > old_term, "{new_term} > {old_term}");
    tokio::time::sleep_until(frozen + Duration::from_secs(2)).await;
    cluster.resume(old);

    // The old leader's last real acknowledgement came before the freeze,
    // more than 2 s ago: any lease of its old term it reports is renewed.
    let watch_until = Instant::now() + Duration::from_secs(1);
    let mut renewed = Vec::new();
    while Instant::now() < watch_until {
        if let Some(status) = cluster.status(old).await {
            if status.term == old_term && status.lease_remaining_ms > 0 {
                renewed.push(status.lease_remaining_ms);
            }
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    stop.store(true, Ordering::SeqCst);
    for client in clients {
        let _ = tokio::time::timeout(Duration::from_secs(6), client).await;
    }
    assert!(
        renewed.is_empty(),
        "node {old} reported a lease of term {old_term} after waking: {renewed:?} ms"
    );

    let intervals = gate_intervals(&cluster);
    let old_gate = intervals
        .iter()
        .find(|i| (i.0, i.1) == (old, old_term))
        .expect("the old writer's gate was open");
    let new_gate = intervals
        .iter()
        .find(|i| (i.0, i.1) == (new, new_term))
        .expect("the new writer's gate was open");
    assert!(
        old_gate.3 <= new_gate.2,
        "gates overlap by {} µs: old {old_gate:?}, new {new_gate:?}",
        (old_gate.3 - new_gate.2) / 1000
    );
}

/// One stint per term, with real processes: the writer is frozen a little
/// longer than its lease but not long enough for an election, several
/// times. Each time its lease lapses and then comes back at the same term;
/// it must never open its gate twice for one term (it resigns for a fresh
/// term instead), and the cluster keeps taking writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_whose_lease_lapses_never_reopens_the_same_term() {
    let _serial = common::cluster::one_cluster_at_a_time().await;
    let cluster = Cluster::start(3).await;
    for _ in 0..5 {
        let (writer, _) = cluster.wait_for_writer(&[1, 2, 3], ELECTION * 4).await;
        cluster
            .write(writer, 0, bytes::Bytes::from(vec![7u8; 4096]))
            .await
            .unwrap();
        cluster.pause(writer);
        // Past the 250 ms lease, short of the followers' 450 ms + jitter.
        tokio::time::sleep(Duration::from_millis(330)).await;
        cluster.resume(writer);
        // Let it notice, and resign or go on.
        tokio::time::sleep(Duration::from_millis(600)).await;
    }
    let (writer, _) = cluster.wait_for_writer(&[1, 2, 3], ELECTION * 4).await;
    cluster
        .write(writer, 0, bytes::Bytes::from(vec![8u8; 4096]))
        .await
        .unwrap();
    let resigned: usize = [1, 2, 3]
        .iter()
        .map(|id| cluster.log(*id).matches("earlier stint").count())
        .sum();
    eprintln!("same-term re-promotions refused (resigned for a fresh term): {resigned}");
    for id in [1, 2, 3] {
        let journal = std::fs::read_to_string(cluster.journal_path(id)).unwrap_or_default();
        let mut opened = std::collections::BTreeSet::new();
        for line in journal.lines().filter(|l| l.starts_with("open ")) {
            let term = line
                .split_whitespace()
                .nth(1)
                .unwrap_or_default()
                .to_string();
            assert!(
                opened.insert(term.clone()),
                "node {id} opened its gate twice at {term}:\n{journal}"
            );
        }
    }
}

/// A sole voter's lease, which no acknowledgement renews, is renewed in
/// time all the same: at rest it never runs out, so its writer is never
/// demoted and promoted again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sole_voter_at_rest_keeps_its_lease_and_its_one_promotion() {
    let _serial = common::cluster::one_cluster_at_a_time().await;
    let cluster = Cluster::start(1).await;
    let (writer, term) = cluster.wait_for_writer(&[1], ELECTION).await;
    let first = cluster.status(writer).await.unwrap();
    // Looked at again and again over two seconds (eight leases): the same
    // term, the same promotion, the gate open every time.
    let until = tokio::time::Instant::now() + Duration::from_secs(2);
    while tokio::time::Instant::now() < until {
        let now = cluster.status(writer).await.unwrap();
        assert_eq!((now.term, now.promotions), (term, first.promotions));
        assert!(now.gate_open, "the gate closed at rest");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        !cluster.log(writer).contains("the lease ran out"),
        "{}",
        cluster.log(writer)
    );
}

/// A sole voter whose lease lapses and returns at the same term has no one
/// to hand over to: it promotes again at that term (its replica is the only
/// one) and keeps taking writes, with no stuck fence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sole_voter_whose_lease_lapses_keeps_writing() {
    let _serial = common::cluster::one_cluster_at_a_time().await;
    let cluster = Cluster::start(1).await;
    for round in 0..3u8 {
        let (writer, _) = cluster.wait_for_writer(&[1], ELECTION).await;
        cluster
            .write(writer, 0, bytes::Bytes::from(vec![round; 4096]))
            .await
            .unwrap();
        cluster.pause(writer);
        tokio::time::sleep(Duration::from_millis(330)).await;
        cluster.resume(writer);
    }
    let (writer, _) = cluster.wait_for_writer(&[1], ELECTION).await;
    cluster
        .write(writer, 0, bytes::Bytes::from(vec![9u8; 4096]))
        .await
        .unwrap();
    assert!(cluster.read(writer, 0, 4096).await.unwrap() == vec![9u8; 4096]);
}
