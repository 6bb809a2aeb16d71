//! Upgrade in place (#38, item 6): what a three-node cluster of an earlier
//! build left on disk opens under this build as a cluster with that one
//! volume, its data, its nodes' identities and its certificates intact.
//!
//! The fixture `tests/fixtures/upgrade-8957a70.tar.gz` was made by the
//! build at commit 8957a70 (`tests/fixtures/make-upgrade-fixture` makes it
//! again): three nodes with TLS on, one 4 MiB volume named `legacy` in
//! their configs, known patterns written through the writer's NBD export
//! in three terms (leadership was transferred twice), every replica in
//! sync, then every node stopped with SIGTERM. It holds the data dirs, the
//! certificates, the configs and `fixture.toml`, the record of what was
//! written, of each node's incarnation and of the last writer's term.
//!
//! The nodes of this build start on those data dirs, certificates and
//! configs, on fresh ports given as flags (the configs' addresses are the
//! fixture's; a node dials its peers where its peer list says, whatever
//! the membership recorded), and a second volume can then be created.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::cluster::Cluster;
use common::tools::run_ok_within;

const FIXTURE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/upgrade-8957a70.tar.gz"
);
const WAIT: Duration = Duration::from_secs(30);
const TOOL_LIMIT: Duration = Duration::from_secs(60);

/// `fixture.toml`: what the old cluster was left holding.
#[derive(serde::Deserialize)]
struct Record {
    commit: String,
    cluster_id: String,
    cluster_uuid: String,
    volume: String,
    size: u64,
    /// The last writer's term when the nodes were stopped.
    term: u64,
    /// Each node's data dir incarnation, in hex.
    incarnations: BTreeMap<String, String>,
    /// Every write, in order.
    writes: Vec<Write>,
}

#[derive(serde::Deserialize)]
struct Write {
    offset: u64,
    length: u64,
    byte: u8,
}

impl Record {
    /// The volume's bytes as the writes left them (zeros elsewhere).
    fn image(&self) -> Vec<u8> {
        let mut image = vec![0; self.size as usize];
        for write in &self.writes {
            let range = write.offset as usize..(write.offset + write.length) as usize;
            image[range].fill(write.byte);
        }
        image
    }

    fn incarnation(&self, id: u64) -> u64 {
        let hex = &self.incarnations[&id.to_string()];
        u64::from_str_radix(hex, 16).unwrap_or_else(|_| panic!("incarnation {hex:?} is not hex"))
    }
}

/// Unpacks the fixture into a fresh directory and reads its record.
fn unpack() -> (tempfile::TempDir, Record) {
    let dir = tempfile::tempdir().unwrap();
    let status = std::process::Command::new("tar")
        .args(["-xzf", FIXTURE, "-C"])
        .arg(dir.path())
        .status()
        .expect("run tar");
    assert!(status.success(), "tar could not unpack {FIXTURE}");
    let text = std::fs::read_to_string(dir.path().join("fixture.toml")).unwrap();
    let record: Record = toml::from_str(&text).expect("the fixture's record");
    (dir, record)
}

/// The files qemu and libnbd (GnuTLS) read from a `tls-certificates` or
/// `tls-creds-x509` directory, for the fixture's client `name`.
fn gnutls_dir(cluster: &Cluster, name: &str) -> PathBuf {
    let dir = cluster.dir.path().join(format!("gnutls-{name}"));
    std::fs::create_dir_all(&dir).unwrap();
    let copy = |from: &str, to: &str| {
        std::fs::copy(cluster.certs.join(from), dir.join(to))
            .unwrap_or_else(|err| panic!("the fixture's {from}: {err}"));
    };
    copy("ca.crt", "ca-cert.pem");
    copy(&format!("{name}.crt"), "client-cert.pem");
    copy(&format!("{name}.key"), "client-key.pem");
    dir
}

/// Reads the whole volume through node `id`'s NBD export over TLS, with
/// nbdcopy presenting the certificate in `creds`.
async fn read_over_nbd(cluster: &Cluster, record: &Record, id: u64, creds: &Path) -> Vec<u8> {
    let uri = format!(
        "nbds://{}/{}?tls-certificates={}",
        cluster.nbd_addrs[&id],
        record.volume,
        creds.display()
    );
    let copy = cluster.dir.path().join(format!("volume-from-{id}.img"));
    let out = copy.display().to_string();
    run_ok_within("nbdcopy", &[&uri, &out], TOOL_LIMIT).await;
    std::fs::read(&copy).unwrap()
}

/// Reads the whole volume through node `id` (the admin API: the writer's
/// engine, or a follower's own copy), 1 MiB at a time.
async fn read_over_admin(cluster: &Cluster, id: u64, size: u64) -> Vec<u8> {
    let mut volume = Vec::with_capacity(size as usize);
    for offset in (0..size).step_by(1 << 20) {
        let length = (size - offset).min(1 << 20) as u32;
        let data = cluster
            .read(id, offset, length)
            .await
            .unwrap_or_else(|err| panic!("node {id}: read at {offset}: {err}"));
        volume.extend_from_slice(&data);
    }
    volume
}

/// Where two images first differ, for the assertion message.
fn first_difference(got: &[u8], want: &[u8]) -> String {
    if got.len() != want.len() {
        return format!("{} bytes, not {}", got.len(), want.len());
    }
    match got.iter().zip(want).position(|(a, b)| a != b) {
        Some(at) => format!("byte {at} is {:#04x}, not {:#04x}", got[at], want[at]),
        None => "identical".into(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_made_by_the_8957a70_build_opens_with_its_volume_data_identities_and_certificates()
 {
    let _serial = common::cluster::one_cluster_at_a_time().await;
    let (dir, record) = unpack();
    assert!(record.commit.starts_with("8957a70"), "{}", record.commit);
    let mut cluster = Cluster::adopt(dir, &record.cluster_id, &[1, 2, 3]);
    cluster.configs = true;
    cluster.extra_args.clear(); // the configs give the size
    for id in [1, 2, 3] {
        cluster.spawn(id);
    }

    // A writer is elected without any step by hand, at a term past the
    // recorded one: the last writer's term cannot open a gate again (S1),
    // and no term is ever lower.
    let (writer, term) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    assert!(
        term > record.term,
        "node {writer} writes at term {term}, not past the fixture's last term {}",
        record.term
    );

    // Every node is the same node as before: the same incarnation (S8:
    // a new one would be a replaced disk, waiting to be re-added), the
    // same cluster, the volume its config names, at its size, and its
    // replica back in the in-sync set.
    for id in [1, 2, 3] {
        cluster.wait_in_sync(writer, id, true, WAIT).await;
        let status = cluster
            .wait_status(id, WAIT, "a member serving reads", |s| {
                s.reads_served && s.not_member.is_empty()
            })
            .await;
        assert_eq!(
            status.incarnation,
            record.incarnation(id),
            "node {id} has incarnation {:x}, not the fixture's {}",
            status.incarnation,
            record.incarnations[&id.to_string()]
        );
        assert_eq!(
            status.cluster_uuid, record.cluster_uuid,
            "node {id} belongs to another cluster"
        );
        assert_eq!(
            status.volume, record.volume,
            "node {id} serves another volume"
        );
        assert_eq!(
            status.volume_size, record.size,
            "node {id} has the volume at another size"
        );
        assert!(
            status.term >= record.term,
            "node {id} is at term {}, below the fixture's {}",
            status.term,
            record.term
        );
        assert_eq!(
            status.security, "mutual TLS",
            "node {id} does not run with its certificates"
        );
    }

    // The data is intact: through the writer's NBD export over TLS (the
    // fixture's viewer certificate; that build had no user role), and in
    // every node's own copy.
    let mut want = record.image();
    let viewer = gnutls_dir(&cluster, "viewer");
    let got = read_over_nbd(&cluster, &record, writer, &viewer).await;
    assert!(
        got == want,
        "the volume through node {writer}'s NBD export: {}",
        first_difference(&got, &want)
    );
    for id in [1, 2, 3] {
        let got = read_over_admin(&cluster, id, record.size).await;
        assert!(
            got == want,
            "the volume through node {id}: {}",
            first_difference(&got, &want)
        );
    }

    // The configured volume is the cluster group's own, on every node.
    let follower = [1, 2, 3].into_iter().find(|id| *id != writer).unwrap();
    let (ok, out, err) = cluster.cli(follower, &["volume", "list"]).await;
    assert!(ok, "volume list failed: {err}");
    let volumes: Vec<Vec<&str>> = out
        .lines()
        .skip(1)
        .map(|line| line.split_whitespace().take(6).collect())
        .collect();
    let size = record.size.to_string();
    assert_eq!(
        volumes,
        vec![vec![record.volume.as_str(), &size, "3", "2", "0", "1,2,3"]],
        "volume list shows:\n{out}"
    );

    // The upgraded members all know volume groups: a second volume can be
    // created, asked of a follower (which names the leader), though every
    // node now listens elsewhere than the membership recorded.
    let (ok, out, err) = cluster
        .cli(follower, &["volume", "create", "more", "--size", "8MiB"])
        .await;
    assert!(
        ok && out.contains("volume more created"),
        "volume create after the upgrade: {out}{err}"
    );
    let (ok, out, err) = cluster.cli(writer, &["volume", "list"]).await;
    assert!(ok, "volume list failed: {err}");
    let listed: Vec<(&str, &str)> = out
        .lines()
        .skip(1)
        .filter_map(|line| {
            let words: Vec<&str> = line.split_whitespace().collect();
            Some((*words.first()?, *words.get(4)?))
        })
        .collect();
    assert_eq!(
        listed,
        vec![(record.volume.as_str(), "0"), ("more", "1")],
        "volume list shows:\n{out}"
    );

    // A write after the upgrade lands on every copy and reads back: over
    // the extent boundary at 2 MiB, through qemu-io over TLS with the
    // fixture's admin certificate.
    let (offset, length, byte) = ((2u64 << 20) - (32 << 10), 64u64 << 10, 0x3cu8);
    let admin = gnutls_dir(&cluster, "admin");
    let tls = format!(
        "tls-creds-x509,id=tls0,dir={},endpoint=client",
        admin.display()
    );
    let image = format!(
        "driver=nbd,host=127.0.0.1,port={},export={},tls-creds=tls0",
        cluster.nbd_addrs[&writer].port(),
        record.volume
    );
    let out = run_ok_within(
        "qemu-io",
        &[
            "--object",
            &tls,
            "--image-opts",
            &image,
            "-c",
            &format!("write -P {byte} {offset} {length}"),
            "-c",
            &format!("read -P {byte} {offset} {length}"),
        ],
        TOOL_LIMIT,
    )
    .await;
    assert!(!out.contains("failed"), "qemu-io after the upgrade: {out}");
    want[offset as usize..(offset + length) as usize].fill(byte);
    for id in [1, 2, 3] {
        cluster.wait_in_sync(writer, id, true, WAIT).await;
        let got = read_over_admin(&cluster, id, record.size).await;
        assert!(
            got == want,
            "after the write, the volume through node {id}: {}",
            first_difference(&got, &want)
        );
    }
    assert!(
        cluster.exited().is_empty(),
        "a node exited by itself (its log is above)"
    );
}
