//! Raft never waits behind the data plane (issue 19, point 1): the writer
//! keeps its lease — no demotion, the same term throughout — while real NBD
//! clients push data as hard as they go by default, in the unoptimized test
//! build, on a fresh volume of a few GiB:
//!
//! - nbdcopy with its default parallelism copies 1 GiB in, and the copy
//!   reads back with the same sha256;
//! - fio writes sequentially in 1 MiB blocks at queue depth 8, then 32.
//!
//! Nothing here asserts a speed; the clients only have to finish, and the
//! writer must not have lost its lease on the way, nor closed a session or
//! dropped a copy. `cluster/flood` runs this test in a loop, each run on a
//! fresh cluster, and keeps the output of any run that fails.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use common::cluster::{Cluster, one_cluster_at_a_time};

const WRITER_WAIT: Duration = Duration::from_secs(30);
const COPY_MIB: u64 = 1024;

const TOOL_LIMIT: Duration = Duration::from_secs(240);

async fn run_ok(program: &str, args: &[&str]) -> String {
    common::tools::run_ok_within(program, args, TOOL_LIMIT).await
}

use common::tools::uri;

async fn sha256(path: &Path) -> String {
    let out = run_ok("sha256sum", &[path.to_str().unwrap()]).await;
    out.split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string()
}

/// Lines of `log` that show a node losing or giving up leadership at
/// `term` or later: a demotion, a lease that ran out, a spent term. Election
/// churn before the writer of `term` was chosen (a candidate of an earlier
/// term stepping down) is not a lost lease.
fn lease_losses(log: &str, term: u64) -> Vec<&str> {
    log.lines()
        .filter(|line| {
            ["demoted", "lease ran out", "term already used"]
                .iter()
                .any(|sign| line.contains(sign))
        })
        .filter(|line| logged_term(line).is_none_or(|t| t >= term))
        .collect()
}

/// The `term=N` field of a log line, if it has one.
fn logged_term(line: &str) -> Option<u64> {
    let plain: String = common::tools::strip_ansi(line);
    let at = plain.find(" term=")? + " term=".len();
    let digits: String = plain[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

/// Lines of `log` that show a client or a copy paying for the load: a
/// writable session closed under its client (a lease that lapsed for a
/// moment) or a copy dropped from the in-sync set (#36: a mark that could
/// not be placed cost the writer its own copy).
fn client_or_copy_losses(log: &str) -> Vec<&str> {
    log.lines()
        .filter(|line| {
            [
                "the session's gate closed",
                "dropping replicas from the in-sync set",
            ]
            .iter()
            .any(|sign| line.contains(sign))
        })
        .collect()
}

/// Fails if any node lost or changed leadership since the writer was
/// promoted: a demotion at `term` or later in any log, any node in another
/// term, or the writer no longer the active writer of `term`; or if a
/// client lost its session or a copy left the in-sync set.
async fn assert_still_leading(cluster: &Cluster, writer: u64, term: u64, after: &str) {
    for id in &cluster.ids {
        let log = cluster.log(*id);
        let losses = lease_losses(&log, term);
        assert!(
            losses.is_empty(),
            "node {id} saw the writer of term {term} lose its lease during {after}:\n{}",
            losses.join("\n")
        );
        let losses = client_or_copy_losses(&log);
        assert!(
            losses.is_empty(),
            "node {id} closed a session or dropped a copy during {after}:\n{}",
            losses.join("\n")
        );
        let status = cluster.status(*id).await.expect("every node answers");
        assert_eq!(
            status.term, term,
            "after {after} node {id} is in term {}, not the writer's term {term}",
            status.term
        );
    }
    let status = cluster.status(writer).await.expect("the writer answers");
    assert!(
        status.role == "leader" && status.gate_open,
        "after {after} node {writer} is {} (gate open {}), not the writer of term {term}",
        status.role,
        status.gate_open,
    );
}

#[test]
fn a_demotion_before_the_writers_term_is_not_a_lost_lease() {
    let log = "\u{1b}[2mT\u{1b}[0m INFO demoted: gate closed node=\"3\" \u{1b}[3mterm\u{1b}[0m\u{1b}[2m=\u{1b}[0m2 role=\"follower\"\n\
               INFO demoted: gate closed node=\"1\" term=5 why=\"the lease ran out\"";
    assert_eq!(lease_losses(log, 5).len(), 1);
    assert_eq!(lease_losses(log, 6).len(), 0);
    assert_eq!(lease_losses(log, 2).len(), 2);
}

fn fio_seq_write(nbd: SocketAddr, depth: u32, offset_mib: u64) -> Vec<String> {
    vec![
        format!("--name=seq-qd{depth}"),
        "--ioengine=nbd".into(),
        format!("--uri={}", uri(nbd)),
        "--rw=write".into(),
        "--bs=1M".into(),
        format!("--iodepth={depth}"),
        format!("--offset={offset_mib}M"),
        "--size=256M".into(),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_writer_keeps_its_lease_under_nbdcopy_and_fio_at_their_default_flood() {
    let _serial = one_cluster_at_a_time().await;
    let cluster = Cluster::start_with(3, &["--size", "2GiB"]).await;
    let (writer, term) = cluster.wait_for_writer(&[1, 2, 3], WRITER_WAIT).await;
    let nbd = cluster.nbd_addrs[&writer];

    let dir = tempfile::tempdir().unwrap();
    let (input, output) = (dir.path().join("in.img"), dir.path().join("out.img"));
    run_ok(
        "dd",
        &[
            "if=/dev/urandom",
            &format!("of={}", input.display()),
            "bs=1M",
            &format!("count={COPY_MIB}"),
            "status=none",
        ],
    )
    .await;

    // nbdcopy with its default parallelism (connections and requests).
    run_ok("nbdcopy", &[input.to_str().unwrap(), &uri(nbd)]).await;
    assert_still_leading(&cluster, writer, term, "nbdcopy in").await;
    run_ok(
        "sh",
        &[
            "-c",
            &format!(
                "nbdcopy {} - | head -c {} > {}",
                uri(nbd),
                COPY_MIB << 20,
                output.display()
            ),
        ],
    )
    .await;
    assert_eq!(
        sha256(&input).await,
        sha256(&output).await,
        "nbdcopy round trip differs"
    );
    std::fs::remove_file(&output).ok();

    // fio sequential 1 MiB writes at queue depth 8 and 32, past the copy.
    for (depth, offset) in [(8, COPY_MIB), (32, COPY_MIB + 256)] {
        let args = fio_seq_write(nbd, depth, offset);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        run_ok("fio", &args).await;
        assert_still_leading(&cluster, writer, term, &format!("fio at QD{depth}")).await;
    }
}
