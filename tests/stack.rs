//! A VM's disk stack built only from real clients, across every way the
//! writer changes (design C1–C3): the cluster; `replica-ha attach` or
//! HAProxy (`cluster/haproxy.cfg`) in front of it; qemu's own NBD client
//! (`qemu-storage-daemon`, `reconnect-delay`) exporting the disk as a FUSE
//! file; ext4 on that file through a loop device; and SQLite committing one
//! row per transaction with `synchronous=FULL` (`tests/stack/commits.py`).
//!
//! The events: SIGKILL of the writer; SIGTERM of the writer (a rolling
//! restart); a transfer; SIGKILL of the writer while it rebuilds a follower.
//! After all of them: the application saw no error, the kernel logged no
//! I/O error, `fsck.ext4 -fn` is clean, `PRAGMA integrity_check` says ok,
//! and every committed row is there.
//!
//! Needs root (a loop device, a FUSE mount), `qemu-utils`, `e2fsprogs`,
//! `haproxy` and Python's `sqlite3` (`.ci/run` installs what is missing).

mod common;

use std::time::Duration;

use common::cluster::{Cluster, one_cluster_at_a_time};
use common::stack::{Stack, Via, kernel_log, longest_stall, until_rebuilding, writer};

const WAIT: Duration = Duration::from_secs(30);
const SIZE: &str = "256MiB";

/// Runs every event against a stack through `via`.
async fn every_event(via: impl FnOnce(&Cluster) -> Via) {
    let _serial = one_cluster_at_a_time().await;
    let mut cluster = Cluster::start_with(
        3,
        &[
            "--size",
            SIZE,
            "--nbd-tls",
            "optional",
            "--resync-rate",
            "32MiB",
        ],
    )
    .await;
    let all = [1, 2, 3];
    writer(&cluster, &all).await;
    // The volume under test is not the only one.
    cluster.add_volumes(&["other", "more"], WAIT).await;
    let via = via(&cluster);
    let kernel_before = kernel_log().len();
    let mut stack = Stack::build(&cluster, via).await;
    stack.filesystem();
    stack.start_app();
    stack.progress(100, "the start").await;

    // SIGKILL of the writer.
    let w = writer(&cluster, &all).await;
    cluster.kill(w);
    stack.progress(100, "SIGKILL of the writer").await;
    cluster.spawn(w);

    // SIGTERM of the writer, as a rolling restart does.
    let w = writer(&cluster, &all).await;
    assert!(cluster.terminate(w).success());
    stack.progress(100, "SIGTERM of the writer").await;
    cluster.spawn(w);

    // A transfer.
    let w = writer(&cluster, &all).await;
    let to = all.into_iter().find(|id| *id != w).unwrap();
    let mut request = tonic::Request::new(replica_ha::proto::admin::TransferRequest {
        to,
        ..Default::default()
    });
    request.set_timeout(WAIT);
    cluster
        .admin(w)
        .transfer_leader(request)
        .await
        .expect("transfer");
    stack.progress(100, "a transfer").await;

    // SIGKILL of the writer while it rebuilds a follower: the next writer
    // has one in-sync copy of the two needed, and holds writes until the
    // follower is rebuilt.
    let w = writer(&cluster, &all).await;
    let follower = all.into_iter().find(|id| *id != w).unwrap();
    cluster.kill(follower);
    stack.progress(50, "a follower's SIGKILL").await;
    cluster.spawn(follower);
    until_rebuilding(&cluster, w, follower).await;
    cluster.kill(w);
    stack
        .progress(100, "SIGKILL of the writer during a rebuild")
        .await;
    cluster.spawn(w);

    stack.stop_app();
    let commits = stack.commits();
    let kernel: Vec<String> = kernel_log().into_iter().skip(kernel_before).collect();
    let errors: Vec<&String> = kernel
        .iter()
        .filter(|line| {
            line.contains("I/O error")
                || line.contains("EXT4-fs error")
                || line.contains("EXT4-fs warning")
        })
        .collect();
    assert!(
        errors.is_empty(),
        "the kernel logged I/O errors: {errors:#?}"
    );
    stack.check();
    eprintln!(
        "{} rows committed; the longest stall was {:?}",
        commits.len(),
        longest_stall(&commits)
    );
}

/// The stack through `replica-ha attach`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ext4_database_through_attach_sees_no_error_across_writer_changes() {
    every_event(|cluster| Via::Attach(cluster.dir.path().join("attach.sock"))).await;
}

/// The stack through HAProxy (`cluster/haproxy.cfg`) and qemu's
/// `reconnect-delay`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ext4_database_through_haproxy_sees_no_error_across_writer_changes() {
    every_event(|_| Via::Haproxy(common::cluster::free_port())).await;
}
