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

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::cluster::{BIN, Cluster, one_cluster_at_a_time};
use tokio::time::Instant;

const WAIT: Duration = Duration::from_secs(30);
const SIZE: &str = "256MiB";

/// How the disk reaches the cluster.
enum Via {
    /// `replica-ha attach` on this unix socket.
    Attach(PathBuf),
    /// HAProxy on this local port.
    Haproxy(u16),
}

/// Everything of the stack above the cluster, torn down in order on drop:
/// the application, the mount, the loop device, qemu, attach or HAProxy.
struct Stack {
    dir: PathBuf,
    front: Child,
    qemu: Option<Child>,
    app: Option<Child>,
    churn: Option<Child>,
    loop_dev: Option<String>,
}

impl Drop for Stack {
    fn drop(&mut self) {
        for app in [&mut self.app, &mut self.churn].into_iter().flatten() {
            let _ = app.kill();
            let _ = app.wait();
        }
        let _ = Command::new("umount")
            .arg("-l")
            .arg(self.dir.join("mnt"))
            .status();
        if let Some(dev) = &self.loop_dev {
            let _ = Command::new("losetup").args(["-d", dev]).status();
        }
        if let Some(qemu) = &mut self.qemu {
            let _ = qemu.kill();
            let _ = qemu.wait();
        }
        let _ = Command::new("umount")
            .arg("-l")
            .arg(self.dir.join("disk"))
            .status();
        let _ = self.front.kill();
        let _ = self.front.wait();
    }
}

fn run(program: &str, args: &[&str]) -> String {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {program} ({e}); .ci/run installs it"));
    assert!(
        out.status.success(),
        "{program} {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn is_root() -> bool {
    run("id", &["-u"]).trim() == "0"
}

/// The kernel log's lines so far.
fn kernel_log() -> Vec<String> {
    run("dmesg", &[]).lines().map(str::to_owned).collect()
}

/// `cluster/haproxy.cfg` with the cluster's ports in place of
/// `cluster/up`'s.
fn haproxy_config(cluster: &Cluster, port: u16) -> String {
    let recipe =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/cluster/haproxy.cfg"))
            .expect("cluster/haproxy.cfg");
    let mut config = recipe.replace("127.0.0.1:10800", &format!("127.0.0.1:{port}"));
    for id in [1u64, 2, 3] {
        config = config
            .replace(
                &format!("127.0.0.1:{}", 10808 + id),
                &cluster.nbd_addrs[&id].to_string(),
            )
            .replace(
                &format!("check port {}", 9000 + id),
                &format!("check port {}", cluster.http_addrs[&id].port()),
            );
    }
    config
}

impl Stack {
    /// Builds the stack on `cluster` through `via`, up to a mounted ext4.
    async fn build(cluster: &Cluster, via: Via) -> Stack {
        assert!(
            is_root(),
            "this test needs root for a loop device and a FUSE mount"
        );
        let dir = cluster.dir.path().join("stack");
        std::fs::create_dir_all(dir.join("mnt")).unwrap();
        let (front, server) = match &via {
            Via::Attach(socket) => {
                let mut command = Command::new(BIN);
                command.arg("attach").arg("--socket").arg(socket);
                for (id, addr) in &cluster.addrs {
                    command.arg("--peer").arg(format!("{id}={addr}"));
                }
                command.args(cluster.cli_tls("viewer"));
                let log = std::fs::File::create(dir.join("attach.log")).unwrap();
                let child = command.stderr(log).spawn().unwrap();
                let deadline = Instant::now() + WAIT;
                while !socket.exists() {
                    assert!(Instant::now() < deadline, "attach never served");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                (
                    child,
                    format!("server.type=unix,server.path={}", socket.display()),
                )
            }
            Via::Haproxy(port) => {
                let config = dir.join("haproxy.cfg");
                std::fs::write(&config, haproxy_config(cluster, *port)).unwrap();
                let log = std::fs::File::create(dir.join("haproxy.log")).unwrap();
                let child = Command::new("haproxy")
                    .arg("-db")
                    .arg("-f")
                    .arg(&config)
                    .stdout(log.try_clone().unwrap())
                    .stderr(log)
                    .spawn()
                    .expect("haproxy (.ci/run installs it)");
                wait_for_writable_route(*port).await;
                (
                    child,
                    format!("server.type=inet,server.host=127.0.0.1,server.port={port}"),
                )
            }
        };
        let mut stack = Stack {
            dir: dir.clone(),
            front,
            qemu: None,
            app: None,
            churn: None,
            loop_dev: None,
        };
        let disk = dir.join("disk");
        std::fs::write(&disk, b"").unwrap();
        let blockdev = format!("driver=nbd,node-name=nbd0,{server},export=vol0,reconnect-delay=20");
        let export = format!(
            "type=fuse,id=exp0,node-name=nbd0,mountpoint={},writable=on",
            disk.display()
        );
        let log = std::fs::File::create(dir.join("qemu.log")).unwrap();
        stack.qemu = Some(
            Command::new("qemu-storage-daemon")
                .args(["--blockdev", &blockdev, "--export", &export])
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .spawn()
                .expect("qemu-storage-daemon (qemu-utils)"),
        );
        let deadline = Instant::now() + WAIT;
        while std::fs::metadata(&disk).map_or(0, |m| m.len()) == 0 {
            let log = std::fs::read_to_string(dir.join("qemu.log")).unwrap_or_default();
            assert!(
                Instant::now() < deadline,
                "qemu never exported the disk: {log}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let dev = run("losetup", &["-f", "--show", &disk.display().to_string()]);
        stack.loop_dev = Some(dev.trim().to_owned());
        run(
            "mkfs.ext4",
            &[
                "-q",
                "-E",
                "nodiscard,lazy_itable_init=0,lazy_journal_init=0",
                dev.trim(),
            ],
        );
        stack.mount();
        stack
    }

    fn device(&self) -> &str {
        self.loop_dev.as_deref().unwrap_or_default()
    }

    fn mount(&self) {
        run(
            "mount",
            &[self.device(), &self.dir.join("mnt").display().to_string()],
        );
    }

    fn start_app(&mut self) {
        let churn = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/stack/churn.py");
        self.churn = Some(
            Command::new("python3")
                .arg(churn)
                .arg(self.dir.join("mnt/churn.bin"))
                .arg(self.dir.join("stop"))
                .stderr(Stdio::piped())
                .spawn()
                .expect("python3"),
        );
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/stack/commits.py");
        let child = Command::new("python3")
            .arg(script)
            .arg(self.dir.join("mnt/app.db"))
            .arg(self.dir.join("commits.log"))
            .arg(self.dir.join("stop"))
            .stderr(Stdio::piped())
            .spawn()
            .expect("python3 with sqlite3");
        self.app = Some(child);
    }

    /// Committed rows (id, time) so far.
    fn commits(&self) -> Vec<(u64, f64)> {
        std::fs::read_to_string(self.dir.join("commits.log"))
            .unwrap_or_default()
            .lines()
            .filter_map(|line| {
                let (id, at) = line.split_once(' ')?;
                Some((id.parse().ok()?, at.parse().ok()?))
            })
            .collect()
    }

    /// Waits until `more` further rows are committed (the application
    /// goes on), or fails if it stopped.
    async fn progress(&mut self, more: usize, what: &str) {
        let target = self.commits().len() + more;
        let deadline = Instant::now() + Duration::from_secs(90);
        while self.commits().len() < target {
            for app in [&mut self.app, &mut self.churn].into_iter().flatten() {
                if let Ok(Some(status)) = app.try_wait() {
                    let mut err = String::new();
                    if let Some(mut stderr) = app.stderr.take() {
                        use std::io::Read;
                        let _ = stderr.read_to_string(&mut err);
                    }
                    panic!("the application stopped after {what} ({status}): {err}");
                }
            }
            assert!(Instant::now() < deadline, "no progress after {what}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Stops the application cleanly; it must have seen no error.
    fn stop_app(&mut self) {
        std::fs::write(self.dir.join("stop"), b"").unwrap();
        for app in [self.app.take(), self.churn.take()].into_iter().flatten() {
            let out = app.wait_with_output().unwrap();
            assert!(
                out.status.success(),
                "an application saw an error: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }

    /// Unmounts, checks the filesystem, mounts again and checks the
    /// database and every committed row.
    fn check(&self) {
        run("umount", &[&self.dir.join("mnt").display().to_string()]);
        run("fsck.ext4", &["-fn", self.device()]);
        self.mount();
        let db = self.dir.join("mnt/app.db");
        let committed = self.commits();
        let script = "import sqlite3, sys\n\
            con = sqlite3.connect(sys.argv[1])\n\
            print(con.execute('PRAGMA integrity_check').fetchone()[0])\n\
            print(' '.join(str(r[0]) for r in con.execute('SELECT id FROM t ORDER BY id')))\n";
        let out = run("python3", &["-c", script, &db.display().to_string()]);
        let mut lines = out.lines();
        assert_eq!(lines.next(), Some("ok"), "integrity_check");
        let rows: std::collections::BTreeSet<u64> = lines
            .next()
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|id| id.parse().ok())
            .collect();
        let lost: Vec<u64> = committed
            .iter()
            .map(|(id, _)| *id)
            .filter(|id| !rows.contains(id))
            .collect();
        assert!(lost.is_empty(), "committed rows lost: {lost:?}");
    }
}

/// Waits until HAProxy on `port` sends every connection to the writer:
/// five in a row open a writable export (it starts with every node up,
/// until its first checks mark the passive ones down).
async fn wait_for_writable_route(port: u16) {
    use replica_ha::nbd::{client, wire};
    let addr = format!("127.0.0.1:{port}");
    let deadline = Instant::now() + WAIT;
    let mut in_a_row = 0;
    while in_a_row < 5 {
        let writable = match client::connect(&addr, "vol0", None).await {
            Ok(conn) => conn.export.flags & wire::TFLAG_READ_ONLY == 0,
            Err(_) => false,
        };
        in_a_row = if writable { in_a_row + 1 } else { 0 };
        assert!(
            Instant::now() < deadline,
            "HAProxy never routed to the writer alone"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The longest pause between two commits.
fn longest_stall(commits: &[(u64, f64)]) -> Duration {
    commits
        .windows(2)
        .map(|w| Duration::from_secs_f64((w[1].1 - w[0].1).max(0.0)))
        .max()
        .unwrap_or_default()
}

/// The writer, once every replica is back in sync (a restarted node has
/// been rebuilt): each event starts from a whole cluster, as an operator's
/// rolling restart would.
async fn writer(cluster: &Cluster, among: &[u64]) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let (writer, _) = cluster.wait_for_writer(among, WAIT).await;
        let whole = cluster.status(writer).await.is_some_and(|s| {
            s.replicas.len() == among.len() && s.replicas.iter().all(|r| r.state == "in_sync")
        });
        if whole {
            return writer;
        }
        assert!(
            Instant::now() < deadline,
            "the replicas never came back in sync"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until node `follower` is reported rebuilding by `writer`.
async fn until_rebuilding(cluster: &Cluster, writer: u64, follower: u64) {
    let deadline = Instant::now() + WAIT;
    loop {
        let status = cluster.status(writer).await;
        if status.as_ref().is_some_and(|s| {
            s.replicas
                .iter()
                .any(|r| r.id == follower.to_string() && r.resync_running)
        }) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "node {follower} never rebuilt: {status:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

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
    let via = via(&cluster);
    let kernel_before = kernel_log().len();
    let mut stack = Stack::build(&cluster, via).await;
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
    let mut request = tonic::Request::new(replica_ha::proto::admin::TransferRequest { to });
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
