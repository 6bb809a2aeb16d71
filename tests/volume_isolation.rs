//! Volumes of one cluster do not touch each other (#38, "How it is
//! shown"), with real node processes: each table volume has a Raft group
//! of its own, whose leader is its writer and whose term is its fencing
//! token, so
//! - the loss of one volume's writer leaves another volume's writer
//!   writing, in the same term, its client seeing no error; and no
//!   acknowledged write of either volume is lost (S5);
//! - a write to one volume lands only in that volume's copies, and a new
//!   writer's fence of one volume raises only that volume's floors (S2,
//!   S3 per volume: a floor is checked against the terms of its own group
//!   only);
//! - a copy moved to another node (`volume move`) is rebuilt there before
//!   the old one leaves, also when the old one's node writes the volume;
//!   and a replaced disk's new incarnation gets its copies back.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use common::cluster::Cluster;
use common::load::{BLOCK, pattern};
use replica_ha::nbd::client as nbd;
use replica_ha::nbd::wire::{Command, Request};
use replica_ha::proto::admin::{VolumeInfo, VolumeListRequest};
use replica_ha::proto::replica as pb;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;
use tokio::time::Instant;

const WAIT: Duration = Duration::from_secs(30);
/// What the tests read and write at a time, through NBD or from a copy.
const CHUNK: u64 = 1 << 20;

/// Volume `name` as node `id` lists it; `None` if the node does not
/// answer or lists no such volume.
async fn listed(cluster: &Cluster, id: u64, name: &str) -> Option<VolumeInfo> {
    let mut request = tonic::Request::new(VolumeListRequest {});
    request.set_timeout(Duration::from_secs(2));
    let reply = cluster.admin(id).list_volumes(request).await.ok()?;
    reply
        .into_inner()
        .volumes
        .into_iter()
        .find(|v| v.name == name)
}

/// Polls until every node of `among` names the same writer of volume
/// `name`, in the same term, one that `wanted` accepts and that says it
/// writes the volume now; returns the volume as that writer lists it.
async fn wait_writer(
    cluster: &Cluster,
    among: &[u64],
    name: &str,
    wanted: impl Fn(u64) -> bool,
) -> VolumeInfo {
    let deadline = Instant::now() + WAIT;
    loop {
        let mut seen = Vec::new();
        for id in among {
            seen.push(listed(cluster, *id, name).await.map(|v| (v.leader, v.term)));
        }
        if let Some(Some((writer, term))) = seen.first().copied() {
            let agreed = seen.iter().all(|s| *s == Some((writer, term)));
            if agreed && writer != 0 && wanted(writer) {
                let own = listed(cluster, writer, name).await;
                if let Some(own) = own.filter(|v| v.writing && v.term == term) {
                    return own;
                }
            }
        }
        assert!(
            Instant::now() < deadline,
            "no agreed writer of {name} as wanted among {among:?}: (writer, term) {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Creates table volumes `names`, `size` bytes and three copies each.
async fn create(cluster: &Cluster, names: &[&str], size: &str) {
    for name in names {
        let (ok, out, err) = cluster
            .cli(1, &["volume", "create", name, "--size", size])
            .await;
        assert!(ok, "volume create {name}: {out} {err}");
    }
}

/// Opens volume `name` through node `id`'s NBD listener (plain, on
/// loopback, as `qemu-io` does in tests/volumes.rs).
async fn open(cluster: &Cluster, id: u64, name: &str) -> nbd::Connection {
    let addr = cluster.nbd_addrs[&id].to_string();
    nbd::connect(&addr, name, None)
        .await
        .unwrap_or_else(|err| panic!("open {name} on node {id}: {err}"))
}

/// Sends one NBD request (with `payload` for a write) and waits, up to
/// [`WAIT`], for its answer: the error code, or what went wrong.
async fn call(
    conn: &mut nbd::Connection,
    command: Command,
    offset: u64,
    len: u64,
    payload: Option<&Bytes>,
) -> Result<(), String> {
    let request = Request {
        flags: 0,
        command,
        cookie: offset,
        offset,
        len: len as u32,
    };
    let answer = async {
        nbd::send(&mut conn.writer, &request, payload).await?;
        conn.writer.flush().await?;
        nbd::receive(&mut conn.reader).await
    };
    match tokio::time::timeout(WAIT, answer).await {
        Err(_) => Err(format!("no answer within {WAIT:?}")),
        Ok(Err(err)) => Err(err.to_string()),
        Ok(Ok((_, cookie))) if cookie != offset => Err(format!("answer to {cookie}")),
        Ok(Ok((0, _))) => Ok(()),
        Ok(Ok((error, _))) => Err(format!("NBD error {error}")),
    }
}

/// The first `len` bytes of volume `name`, read through node `id`'s NBD
/// export.
async fn export_image(cluster: &Cluster, id: u64, name: &str, len: u64) -> Vec<u8> {
    let mut conn = open(cluster, id, name).await;
    let mut image = vec![0u8; len as usize];
    for offset in (0..len).step_by(CHUNK as usize) {
        let part = CHUNK.min(len - offset);
        call(&mut conn, Command::Read, offset, part, None)
            .await
            .unwrap_or_else(|err| panic!("read {name} at {offset} through node {id}: {err}"));
        let into = &mut image[offset as usize..(offset + part) as usize];
        conn.reader.read_exact(into).await.unwrap();
    }
    image
}

/// The first `len` bytes of node `id`'s own copy of volume `name` (of
/// Raft group `group`), read straight from its block channel, not through
/// any writer.
async fn copy_image(cluster: &Cluster, id: u64, name: &str, group: u64, len: u64) -> Vec<u8> {
    let copy = cluster.copy_client(id, name, group).await;
    let mut image = Vec::with_capacity(len as usize);
    for offset in (0..len).step_by(CHUNK as usize) {
        let part = copy
            .read(offset, CHUNK.min(len - offset))
            .await
            .unwrap_or_else(|err| panic!("read node {id}'s copy of {name}: {err}"));
        image.extend_from_slice(&part);
    }
    image
}

/// What node `id`'s copy of volume `name` (group `group`) says of itself:
/// its fence floor and the floor's generation.
async fn floor(cluster: &Cluster, id: u64, name: &str, group: u64) -> (u64, u64) {
    let volume = cluster.volume_ref_of(id, name, group).await;
    let reply = pb::replica_client::ReplicaClient::new(cluster.peer_channel(id))
        .status(pb::StatusRequest {
            volume: Some(volume),
        })
        .await
        .unwrap_or_else(|err| panic!("status of node {id}'s copy of {name}: {err}"))
        .into_inner();
    (reply.floor, reply.generation)
}

/// What a writing client saw.
struct Written {
    /// Each acknowledged block, by offset.
    acked: BTreeMap<u64, Bytes>,
    /// When each write was acknowledged, in order.
    times: Vec<Instant>,
    /// The error that stopped the client, if one did.
    error: Option<String>,
}

impl Written {
    /// The longest time between two consecutive acknowledgements, and
    /// when the second came.
    fn longest_gap(&self) -> (Duration, Instant) {
        self.times
            .windows(2)
            .map(|pair| (pair[1] - pair[0], pair[1]))
            .max()
            .expect("two acknowledged writes at least")
    }
}

/// A client of volume `name` through node `id`'s NBD export: writes block
/// after block, one at a time, each once to its own offset (block `i`
/// holds `pattern(salt + i)`), until `stop` or the first error, which
/// ends it. `acked` counts the acknowledged writes.
async fn write_blocks(
    mut conn: nbd::Connection,
    salt: u64,
    mut stop: watch::Receiver<bool>,
    acked: watch::Sender<usize>,
) -> Written {
    let mut written = Written {
        acked: BTreeMap::new(),
        times: Vec::new(),
        error: None,
    };
    for i in 0..conn.export.size / BLOCK {
        if *stop.borrow_and_update() {
            return written;
        }
        let (offset, data) = (i * BLOCK, pattern(salt + i));
        if let Err(err) = call(&mut conn, Command::Write, offset, BLOCK, Some(&data)).await {
            written.error = Some(format!("write at {offset}: {err}"));
            return written;
        }
        written.acked.insert(offset, data);
        written.times.push(Instant::now());
        acked.send_replace(written.acked.len());
        // As tests/common/load.rs: a steady stream, not a flood that
        // would starve two cores' worth of Raft heartbeats.
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    written.error = Some("the volume is full: make it larger".into());
    written
}

/// A running [`write_blocks`] client.
struct Client {
    name: String,
    stop: watch::Sender<bool>,
    acked: watch::Receiver<usize>,
    task: tokio::task::JoinHandle<Written>,
}

impl Client {
    /// Starts [`write_blocks`] on volume `name` through node `id`.
    async fn start(cluster: &Cluster, id: u64, name: &str, salt: u64) -> Client {
        let conn = open(cluster, id, name).await;
        let (stop, stopped) = watch::channel(false);
        let (count, acked) = watch::channel(0);
        Client {
            name: name.into(),
            stop,
            acked,
            task: tokio::spawn(write_blocks(conn, salt, stopped, count)),
        }
    }

    /// How many writes it has had acknowledged so far.
    fn count(&self) -> usize {
        *self.acked.borrow()
    }

    /// Waits until it has had `at_least` writes acknowledged; fails
    /// saying `when`, with the client's error if it stopped.
    async fn wait_acked(&mut self, when: &str, at_least: usize) {
        let reached = tokio::time::timeout(WAIT, self.acked.wait_for(|n| *n >= at_least))
            .await
            .is_ok_and(|seen| seen.is_ok());
        if !reached {
            let count = self.count();
            let error = match self.task.is_finished() {
                true => (&mut self.task).await.unwrap().error,
                false => None,
            };
            panic!(
                "{}'s client {when}: {count} acknowledged writes, not {at_least}; stopped by \
                 {error:?}",
                self.name
            );
        }
    }

    /// Stops it and returns what it saw.
    async fn stop(self) -> Written {
        self.stop.send_replace(true);
        self.task.await.unwrap()
    }
}

/// Every acknowledged block of `written` is in `image` (`whose` names
/// where it was read).
fn assert_holds(whose: &str, image: &[u8], written: &Written) {
    assert!(!written.acked.is_empty(), "{whose}: nothing was written");
    for (offset, data) in &written.acked {
        let at = *offset as usize..(*offset + BLOCK) as usize;
        assert!(
            image[at] == data[..],
            "{whose} lost the acknowledged block at {offset}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_writes_on_without_error_or_new_term_while_another_volumes_writer_is_killed() {
    let _serial = common::cluster::one_cluster_at_a_time().await;
    let mut cluster = Cluster::start_with(3, &["--size", "16MiB", "--balance-interval", "1"]).await;
    cluster.wait_for_leader(&[1, 2, 3], WAIT).await;
    create(&cluster, &["a", "b"], "16MiB").await;
    // The balancer hands group 1's volume to node 1 and group 2's to
    // node 2 (VolumeTable::preferred_writers): two writers on two nodes.
    let a = wait_writer(&cluster, &[1, 2, 3], "a", |w| w == 1).await;
    let b = wait_writer(&cluster, &[1, 2, 3], "b", |w| w == 2).await;
    // The node about to die leads the cluster group as well: B must not
    // wait on that group's election either.
    let (leader, _) = cluster.wait_for_leader(&[1, 2, 3], WAIT).await;
    if leader != 1 {
        let (ok, out, err) = cluster.cli(leader, &["transfer", "--to", "1"]).await;
        assert!(ok, "transfer the cluster group to node 1: {out} {err}");
        let (leader, _) = cluster.wait_for_leader(&[1, 2, 3], WAIT).await;
        assert_eq!(leader, 1);
    }

    let mut client_a = Client::start(&cluster, 1, "a", 0).await;
    let mut client_b = Client::start(&cluster, 2, "b", 1 << 32).await;
    client_a.wait_acked("before the kill", 50).await;
    client_b.wait_acked("before the kill", 50).await;

    let killed_at = Instant::now();
    cluster.kill(1);
    // A fails over (its client, whose writer died, stops at its error)...
    let a_after = wait_writer(&cluster, &[2, 3], "a", |w| w != 1).await;
    assert!(a_after.term > a.term, "{a_after:?} after {a:?}");
    let failed_over_at = Instant::now();
    // ... while B's client goes on: it has written well past the failover.
    let past = client_b.count() + 200;
    client_b.wait_acked("after a's failover", past).await;
    let (written_a, written_b) = (client_a.stop().await, client_b.stop().await);

    // B: no error, the same writer in the same term on both nodes left,
    // and no pause that would mean it waited on A or on the cluster group.
    assert_eq!(written_b.error, None, "b's client saw an error");
    for id in [2, 3] {
        let now = listed(&cluster, id, "b").await.expect("b listed");
        assert_eq!(
            (now.leader, now.term),
            (b.leader, b.term),
            "node {id} lists another writer or term of b"
        );
    }
    // A's failover took an election timeout at least, as would any wait
    // on an election: a new writer of B, or a new leader of the cluster
    // group (which the killed node led). B's own part of the kill,
    // dropping its copy on the dead node (whose connections the kernel
    // reset), is a commit in B's group. So B's longest pause stays below
    // the failover it lived through, unless B waited on an election.
    let failover = failed_over_at - killed_at;
    let (gap, gap_at) = written_b.longest_gap();
    eprintln!(
        "b: {} writes, the longest gap {gap:?}, ending {:?} after the kill; a: failed over in \
         {failover:?}, {} writes, then {:?}",
        written_b.acked.len(),
        gap_at.saturating_duration_since(killed_at),
        written_a.acked.len(),
        written_a.error
    );
    assert!(
        written_b.times.first() < Some(&killed_at)
            && written_b.times.last() > Some(&failed_over_at),
        "b's client did not write across the kill and a's failover"
    );
    assert!(
        gap < failover,
        "b's client waited {gap:?} for an acknowledgement, not less than a's failover \
         ({failover:?})"
    );

    // Neither volume lost an acknowledged write: each reads back through
    // its writer and from every copy left (both in sync: neither writer
    // lost any but the killed node's).
    for (name, group, writer, written) in [
        ("a", a.group, a_after.leader, &written_a),
        ("b", b.group, b.leader, &written_b),
    ] {
        let len = *written.acked.keys().last().unwrap() + BLOCK;
        let image = export_image(&cluster, writer, name, len).await;
        assert_holds(
            &format!("{name} through its writer {writer}"),
            &image,
            written,
        );
        for id in [2, 3] {
            let image = copy_image(&cluster, id, name, group, len).await;
            assert_holds(&format!("node {id}'s copy of {name}"), &image, written);
        }
    }
}

/// Fills the first `len` bytes of volume `name` with `byte` through its
/// writer's NBD export, and flushes. Should the writer change meanwhile
/// (a busy machine can cost a writer its lease), it fills again through
/// the next one, as a client that follows the writer would.
async fn fill(cluster: &Cluster, name: &str, len: u64, byte: u8) {
    fill_among(cluster, &[1, 2, 3], name, len, byte).await
}

/// [`fill`], with the writer agreed among the nodes `among`.
async fn fill_among(cluster: &Cluster, among: &[u64], name: &str, len: u64, byte: u8) {
    let data = Bytes::from(vec![byte; CHUNK as usize]);
    let mut tries = 3;
    loop {
        let writer = wait_writer(cluster, among, name, |_| true).await.leader;
        let mut conn = open(cluster, writer, name).await;
        let mut done = Ok(());
        for offset in (0..len).step_by(CHUNK as usize) {
            done = done.and(call(&mut conn, Command::Write, offset, CHUNK, Some(&data)).await);
        }
        let done = done.and(call(&mut conn, Command::Flush, 0, 0, None).await);
        tries -= 1;
        match done {
            Ok(()) => return,
            Err(err) if tries > 0 => eprintln!("fill {name} through node {writer}: {err}; again"),
            Err(err) => panic!("fill {name} through node {writer}: {err}"),
        }
    }
}

/// Which runs of bytes `image` holds, as "offset+length: byte": a short
/// account for a failure message.
fn runs(image: &[u8]) -> Vec<String> {
    let mut runs: Vec<(usize, usize, u8)> = Vec::new();
    for (at, byte) in image.iter().enumerate() {
        match runs.last_mut() {
            Some((_, len, last)) if last == byte => *len += 1,
            _ => runs.push((at, 1, *byte)),
        }
    }
    runs.iter()
        .map(|(at, len, byte)| format!("{at}+{len}: {byte:#04x}"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_to_one_volume_never_lands_in_another_and_its_fence_leaves_the_other_alone() {
    let _serial = common::cluster::one_cluster_at_a_time().await;
    // No balancer: the only writer that moves is the one the test moves.
    let cluster = Cluster::start_with(3, &["--size", "16MiB", "--balance-interval", "0"]).await;
    cluster.wait_for_leader(&[1, 2, 3], WAIT).await;
    const LEN: u64 = 4 << 20;
    create(&cluster, &["a", "b"], "4MiB").await;
    let a = wait_writer(&cluster, &[1, 2, 3], "a", |_| true).await;
    let b = wait_writer(&cluster, &[1, 2, 3], "b", |_| true).await;
    assert_ne!(a.group, b.group);

    // A is written all over, B in its first half only: a write of A that
    // landed in B's copy would show, wherever it went.
    fill(&cluster, "a", LEN, 0xa1).await;
    fill(&cluster, "b", LEN / 2, 0xb1).await;
    let mut b_image = vec![0u8; LEN as usize];
    b_image[..(LEN / 2) as usize].fill(0xb1);
    let mut b_floors = BTreeMap::new();
    for id in [1, 2, 3] {
        b_floors.insert(id, floor(&cluster, id, "b", b.group).await);
    }

    // A's writer moves (at least once), until A's new term is above every
    // floor of B's copies: a fence of A's term that reached a copy of B
    // would raise it.
    let highest_b = b_floors.values().map(|(term, _)| *term).max().unwrap();
    let mut a_now = a.clone();
    while a_now.term == a.term || a_now.term <= highest_b {
        let to = [1, 2, 3]
            .into_iter()
            .find(|id| *id != a_now.leader)
            .unwrap();
        let (ok, out, err) = cluster
            .cli(to, &["transfer", "--volume", "a", "--to", &to.to_string()])
            .await;
        assert!(ok, "transfer --volume a --to {to}: {out} {err}");
        let before = a_now.term;
        a_now = wait_writer(&cluster, &[1, 2, 3], "a", |w| w == to).await;
        assert!(a_now.term > before, "{a_now:?}");
    }
    eprintln!(
        "a: term {} on node {}, then {} on node {}; b: term {} on node {}, floors {b_floors:?}",
        a.term, a.leader, a_now.term, a_now.leader, b.term, b.leader
    );
    // The new writer of A writes under its term.
    fill(&cluster, "a", LEN, 0xa2).await;
    // B kept its writer and term throughout.
    let b_now = wait_writer(&cluster, &[1, 2, 3], "b", |_| true).await;
    assert_eq!(
        (b_now.leader, b_now.term),
        (b.leader, b.term),
        "b's (writer, term) changed"
    );

    for id in [1, 2, 3] {
        // A's new writer fenced every copy of A with its term...
        let (a_floor, _) = floor(&cluster, id, "a", a.group).await;
        assert!(
            a_floor >= a_now.term,
            "node {id}'s copy of a: floor {a_floor}, below a's term {}",
            a_now.term
        );
        // ... and no copy of B: B's floors are as they were.
        let b_floor = floor(&cluster, id, "b", b.group).await;
        assert_eq!(
            b_floor, b_floors[&id],
            "node {id}'s copy of b: (floor, generation) {b_floor:?}, was {:?}; a's term is {}",
            b_floors[&id], a_now.term
        );
        // Each copy holds its own volume's bytes, and only those.
        let image = copy_image(&cluster, id, "b", b.group, LEN).await;
        assert!(
            image == b_image,
            "node {id}'s copy of b holds {:?}",
            runs(&image)
        );
        let image = copy_image(&cluster, id, "a", a.group, LEN).await;
        assert!(
            image.iter().all(|byte| *byte == 0xa2),
            "node {id}'s copy of a holds {:?}",
            runs(&image)
        );
    }
}

/// What node `id` sees of a move of volume `name`'s copy from node `from`
/// to node `to`, in one status reply: whether `from`'s copy has left the
/// volume's replica set (its member left the group), and whether `to`'s
/// is in the in-sync set; `None` if the node does not answer.
async fn move_seen(
    cluster: &Cluster,
    id: u64,
    name: &str,
    from: u64,
    to: u64,
) -> Option<(bool, bool)> {
    let status = cluster.status(id).await?;
    let volume = status.volumes.into_iter().find(|v| v.name == name)?;
    let from_id = from.to_string();
    let left = !volume
        .replicas
        .iter()
        .any(|r| r.id == from_id && r.state != "missing");
    let in_sync = volume.in_sync.contains(&to.to_string());
    Some((left, in_sync))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_moved_copy_is_rebuilt_before_the_old_one_leaves_even_from_the_writers_node() {
    let _serial = common::cluster::one_cluster_at_a_time().await;
    let mut cluster = Cluster::start_with(4, &["--size", "16MiB", "--balance-interval", "0"]).await;
    cluster.wait_for_leader(&[1, 2, 3, 4], WAIT).await;
    let len = 4 * CHUNK;
    create(&cluster, &["m"], "4MiB").await;
    let deadline = Instant::now() + WAIT;
    let info = loop {
        if let Some(info) = listed(&cluster, 1, "m").await {
            break info;
        }
        assert!(Instant::now() < deadline, "volume m not listed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let (placement, group) = (info.placement.clone(), info.group);
    let from = wait_writer(&cluster, &placement, "m", |_| true)
        .await
        .leader;
    let to = (1..=4).find(|id| !placement.contains(id)).unwrap();
    fill_among(&cluster, &placement, "m", len, 0x33).await;

    // The writer's own copy moves, asked of the node that gets it.
    let (ok, out, err) = cluster
        .cli(
            to,
            &[
                "volume",
                "move",
                "m",
                "--from",
                &from.to_string(),
                "--to",
                &to.to_string(),
            ],
        )
        .await;
    assert!(ok, "volume move: {out} {err}");
    let mut moved: Vec<u64> = placement.iter().copied().filter(|id| *id != from).collect();
    moved.push(to);
    moved.sort();
    assert!(
        out.contains(&format!(
            "nodes        {}",
            moved
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(",")
        )),
        "{out}"
    );

    // The old copy goes only once the new one is in sync: on every node
    // that stays, at every look, the old copy's member has not left the
    // group unless the new copy is in sync; until the old node removed
    // its copy.
    let stay: Vec<u64> = placement.iter().copied().filter(|id| *id != from).collect();
    let old = cluster
        .data_dir(from)
        .join("volumes")
        .join(format!("{group}-m"));
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut left_seen = false;
    loop {
        for id in &stay {
            if let Some((left, in_sync)) = move_seen(&cluster, *id, "m", from, to).await {
                assert!(
                    !left || in_sync,
                    "node {id} sees node {from}'s copy gone and node {to}'s not in sync"
                );
                left_seen |= left;
            }
        }
        if left_seen && !old.exists() {
            break;
        }
        if Instant::now() >= deadline {
            let said: Vec<String> = (1..=4)
                .flat_map(|id| {
                    let log = cluster.log(id);
                    log.lines()
                        .filter(|l| {
                            l.contains("placement")
                                || l.contains("not done")
                                || l.contains("volume=m")
                        })
                        .map(|l| format!("node {id}: {l}"))
                        .collect::<Vec<_>>()
                })
                .collect();
            panic!(
                "node {from}'s copy of m is still there:\n{}",
                said.join("\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let image = copy_image(&cluster, to, "m", group, len).await;
    assert!(
        image.iter().all(|b| *b == 0x33),
        "node {to}'s copy: {:?}",
        runs(&image)
    );

    // The volume writes on among its new copies, every one of them.
    fill_among(&cluster, &moved, "m", len, 0x44).await;
    for id in &moved {
        let image = copy_image(&cluster, *id, "m", group, len).await;
        assert!(
            image.iter().all(|b| *b == 0x44),
            "node {id}'s copy: {:?}",
            runs(&image)
        );
    }
    let writer = wait_writer(&cluster, &moved, "m", |_| true).await.leader;
    assert_ne!(writer, from);

    // A disk of the new placement is replaced: once the cluster names the
    // node's new incarnation, the volume's group swaps it in too, and its
    // empty copy is rebuilt in full.
    let replaced = moved.iter().copied().find(|id| *id != writer).unwrap();
    cluster.kill(replaced);
    cluster.wipe(replaced);
    cluster.spawn(replaced);
    cluster
        .wait_status(replaced, WAIT, "waiting to be re-added", |s| {
            s.not_member.contains("replaced disk")
        })
        .await;
    let others: Vec<u64> = (1..=4).filter(|id| *id != replaced).collect();
    let (cluster_writer, _) = cluster.wait_for_writer(&others, WAIT).await;
    let (ok, out, err) = cluster
        .cli(
            cluster_writer,
            &["members", "replace", "--id", &replaced.to_string()],
        )
        .await;
    assert!(ok, "members replace: {out} {err}");
    cluster
        .wait_status(replaced, WAIT, "running its copy of m", |s| {
            s.volumes
                .iter()
                .any(|v| v.name == "m" && v.here == "running")
        })
        .await;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let image = copy_image(&cluster, replaced, "m", group, len).await;
        if image.iter().all(|b| *b == 0x44) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "node {replaced}'s new copy of m was not rebuilt: {:?}",
            runs(&image)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
