//! A VM's disk stack built from real clients, for `tests/stack.rs` and
//! `benches/stall.rs`: `replica-ha attach` or HAProxy (`cluster/haproxy.cfg`)
//! in front of a cluster, qemu's own NBD client (`qemu-storage-daemon` with
//! `reconnect-delay`) exporting the disk as a FUSE file, and optionally ext4
//! on that file through a loop device. Needs root.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tokio::time::Instant;

use super::cluster::{BIN, Cluster};

const WAIT: Duration = Duration::from_secs(30);

/// How the disk reaches the cluster.
pub enum Via {
    /// `replica-ha attach` on this unix socket.
    Attach(PathBuf),
    /// HAProxy on this local port.
    Haproxy(u16),
}

/// Everything of the stack above the cluster, torn down in order on drop:
/// the application, the mount, the loop device, qemu, attach or HAProxy.
pub struct Stack {
    pub dir: PathBuf,
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

pub fn run(program: &str, args: &[&str]) -> String {
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
pub fn kernel_log() -> Vec<String> {
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
    /// Builds the stack on `cluster` through `via`, up to qemu's export of
    /// the disk.
    pub async fn build(cluster: &Cluster, via: Via) -> Stack {
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
                command.args(cluster.cli_tls("user"));
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
        stack
    }

    /// The disk as qemu exports it: a file whose writes are the volume's.
    pub fn disk(&self) -> PathBuf {
        self.dir.join("disk")
    }

    /// Puts ext4 on the disk through a loop device and mounts it at
    /// `mnt`.
    pub fn filesystem(&mut self) {
        let dev = run(
            "losetup",
            &["-f", "--show", &self.disk().display().to_string()],
        );
        self.loop_dev = Some(dev.trim().to_owned());
        run(
            "mkfs.ext4",
            &[
                "-q",
                "-E",
                "nodiscard,lazy_itable_init=0,lazy_journal_init=0",
                dev.trim(),
            ],
        );
        self.mount();
    }

    pub fn device(&self) -> &str {
        self.loop_dev.as_deref().unwrap_or_default()
    }

    pub fn mount(&self) {
        run(
            "mount",
            &[self.device(), &self.dir.join("mnt").display().to_string()],
        );
    }

    pub fn start_app(&mut self) {
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
    pub fn commits(&self) -> Vec<(u64, f64)> {
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
    pub async fn progress(&mut self, more: usize, what: &str) {
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
    pub fn stop_app(&mut self) {
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
    pub fn check(&self) {
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
pub async fn wait_for_writable_route(port: u16) {
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
pub fn longest_stall(commits: &[(u64, f64)]) -> Duration {
    commits
        .windows(2)
        .map(|w| Duration::from_secs_f64((w[1].1 - w[0].1).max(0.0)))
        .max()
        .unwrap_or_default()
}

/// The writer, once every replica is back in sync (a restarted node has
/// been rebuilt): each event starts from a whole cluster, as an operator's
/// rolling restart would.
pub async fn writer(cluster: &Cluster, among: &[u64]) -> u64 {
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
pub async fn until_rebuilding(cluster: &Cluster, writer: u64, follower: u64) {
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
