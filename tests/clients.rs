//! Clients of many volumes (issue #38, item 5), with real node processes:
//! `attach` following each volume's own writer, `/health/leader/NAME`, and
//! `WatchLeader` naming a volume.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use common::cluster::{BIN, Cluster, one_cluster_at_a_time};
use replica_ha::proto::admin::{LeaderUpdate, WatchLeaderRequest};
use tokio::time::Instant;

const WAIT: Duration = Duration::from_secs(30);

/// Volume `name`'s row of `volume list` on node `id`, split into words
/// (name size copies min-in-sync group nodes writer term).
async fn row(cluster: &Cluster, id: u64, name: &str) -> Option<Vec<String>> {
    let (ok, out, _) = cluster.cli(id, &["volume", "list"]).await;
    out.lines()
        .map(|line| {
            line.split_whitespace()
                .map(String::from)
                .collect::<Vec<_>>()
        })
        .find(|words| ok && words.first().map(String::as_str) == Some(name))
}

/// The nodes `volume list` on node `id` places volume `name` on.
async fn placement(cluster: &Cluster, id: u64, name: &str) -> Vec<u64> {
    let words = row(cluster, id, name).await.expect("the volume is listed");
    words[5]
        .split(',')
        .map(|node| node.parse().expect("a node id"))
        .collect()
}

/// Volume `name`'s writer, once every node of `among` agrees on it.
async fn wait_writer(cluster: &Cluster, among: &[u64], name: &str) -> u64 {
    cluster.wait_volume_writer(among, name, WAIT).await
}

/// Creates volume `name` of `size` through node 1, with `extra` arguments.
async fn create(cluster: &Cluster, name: &str, size: &str, extra: &[&str]) {
    let mut args = vec!["volume", "create", name, "--size", size];
    args.extend_from_slice(extra);
    let (ok, out, err) = cluster.cli(1, &args).await;
    assert!(ok, "create {name}: {out} {err}");
}

/// The unix-socket NBD URI of export `name` on `socket`.
fn socket_uri(name: &str, socket: &Path) -> String {
    format!("nbd+unix:///{name}?socket={}", socket.display())
}

/// Runs qemu-io's `commands` on `uri`; panics on any failure it reports.
async fn qemu_io(uri: &str, commands: &[String]) {
    let mut args = vec!["-f", "raw"];
    for command in commands {
        args.extend(["-c", command.as_str()]);
    }
    args.push(uri);
    let out = common::tools::run_ok_within("qemu-io", &args, WAIT).await;
    assert!(
        !out.contains("failed") && !out.contains("mismatch"),
        "{uri}: {out}"
    );
}

/// Writes `pattern` over the first 4 MiB through `uri` and reads it back.
async fn write_back(uri: &str, pattern: u8) {
    qemu_io(
        uri,
        &[
            format!("write -P {pattern} 0 4M"),
            format!("read -P {pattern} 0 4M"),
        ],
    )
    .await;
}

/// Writes through `uri` again and again until `stop`, counting each
/// write that was answered (and read back) in `done`; any error panics.
fn keep_writing(
    uri: String,
    pattern: u8,
    stop: Arc<AtomicBool>,
    done: Arc<AtomicU64>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while !stop.load(Ordering::SeqCst) {
            write_back(&uri, pattern).await;
            done.fetch_add(1, Ordering::SeqCst);
        }
    })
}

/// Polls until `done` reaches `count`.
async fn wait_count(what: &str, done: &AtomicU64, count: u64) {
    let deadline = Instant::now() + WAIT;
    while done.load(Ordering::SeqCst) < count {
        assert!(Instant::now() < deadline, "{what}: only {done:?} writes");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A child process that is killed when the test ends, failed or not.
struct Attach(std::process::Child);

impl Drop for Attach {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `attach` as client `user` serving each `(volume, socket)`.
fn start_attach(cluster: &Cluster, serves: &[(&str, &Path)]) -> Attach {
    let mut command = std::process::Command::new(BIN);
    command.arg("attach");
    for (volume, socket) in serves {
        command
            .arg("--serve")
            .arg(format!("{volume}={}", socket.display()));
    }
    for (id, addr) in &cluster.addrs {
        command.arg("--peer").arg(format!("{id}={addr}"));
    }
    command.args(cluster.cli_tls("user"));
    let log = std::fs::File::create(cluster.dir.path().join("attach.log")).unwrap();
    let child = command
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    Attach(child)
}

/// Polls until every socket of `sockets` exists.
async fn wait_for_sockets(sockets: &[&PathBuf]) {
    let deadline = Instant::now() + WAIT;
    while !sockets.iter().all(|socket| socket.exists()) {
        assert!(Instant::now() < deadline, "attach never served");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One `attach` serves two table volumes on two sockets, each following
/// its own writer: killing one volume's writer costs neither volume an
/// error, both keep taking writes, and each reads back its own bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attach_serves_two_volumes_through_a_crash_of_one_writer_without_an_error() {
    let _serial = one_cluster_at_a_time().await;
    let mut cluster = Cluster::start_with(3, &["--size", "16MiB", "--nbd-tls", "optional"]).await;
    cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    create(&cluster, "a", "16MiB", &[]).await;
    create(&cluster, "b", "16MiB", &[]).await;
    let writer_a = wait_writer(&cluster, &[1, 2, 3], "a").await;
    wait_writer(&cluster, &[1, 2, 3], "b").await;

    let (socket_a, socket_b) = (
        cluster.dir.path().join("a.sock"),
        cluster.dir.path().join("b.sock"),
    );
    let mut attach = start_attach(&cluster, &[("a", &socket_a), ("b", &socket_b)]);
    wait_for_sockets(&[&socket_a, &socket_b]).await;
    let (uri_a, uri_b) = (socket_uri("a", &socket_a), socket_uri("b", &socket_b));

    let stop = Arc::new(AtomicBool::new(false));
    let (done_a, done_b) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let writing_a = keep_writing(uri_a.clone(), 0xa1, Arc::clone(&stop), Arc::clone(&done_a));
    let writing_b = keep_writing(uri_b.clone(), 0xb1, Arc::clone(&stop), Arc::clone(&done_b));
    wait_count("a before the crash", &done_a, 2).await;
    wait_count("b before the crash", &done_b, 2).await;

    let killed_at = (done_a.load(Ordering::SeqCst), done_b.load(Ordering::SeqCst));
    cluster.kill(writer_a);
    let others: Vec<u64> = [1, 2, 3].into_iter().filter(|id| *id != writer_a).collect();
    let new_a = wait_writer(&cluster, &others, "a").await;
    assert_ne!(new_a, writer_a);
    // Both volumes go on taking writes through attach after the crash.
    wait_count("a after the crash", &done_a, killed_at.0 + 3).await;
    wait_count("b after the crash", &done_b, killed_at.1 + 3).await;
    stop.store(true, Ordering::SeqCst);
    writing_a.await.expect("no error writing a");
    writing_b.await.expect("no error writing b");

    // Each volume holds its own bytes only, through attach and on its
    // writer's export.
    qemu_io(&uri_a, &["read -P 0xa1 0 4M".into()]).await;
    qemu_io(&uri_b, &["read -P 0xb1 0 4M".into()]).await;
    // Volume a's driver moved to the new writer; b's had no cause to.
    let log = common::tools::strip_ansi(
        &std::fs::read_to_string(cluster.dir.path().join("attach.log")).unwrap(),
    );
    let moved = |name: &str, to: u64| {
        log.lines().any(|line| {
            line.contains(&format!("volume{{name={name}}}"))
                && line.contains("following the writer")
                && line.contains(&format!("writer={to}"))
        })
    };
    assert!(moved("a", new_a), "{log}");
    eprintln!(
        "writes through attach: a {} ({} before the crash), b {} ({})",
        done_a.load(Ordering::SeqCst),
        killed_at.0,
        done_b.load(Ordering::SeqCst),
        killed_at.1
    );
    assert!(attach.0.try_wait().unwrap().is_none(), "attach died: {log}");
}

/// Node `id`'s first `WatchLeader` update for `volume`, or its refusal.
async fn first_update(
    cluster: &Cluster,
    id: u64,
    volume: &str,
) -> Result<LeaderUpdate, tonic::Status> {
    let mut request = tonic::Request::new(WatchLeaderRequest {
        volume: volume.into(),
    });
    request.set_timeout(Duration::from_secs(5));
    let mut stream = cluster.admin(id).watch_leader(request).await?.into_inner();
    let update = stream.message().await?;
    Ok(update.expect("a first update"))
}

/// Polls node `id`'s `/health/leader/{name}` until it answers `code`.
async fn wait_health(cluster: &Cluster, id: u64, name: &str, code: u16) -> String {
    let addr = cluster.http_addrs[&id];
    let path = format!("/health/leader/{name}");
    let deadline = Instant::now() + WAIT;
    loop {
        let (got, body) = tokio::task::spawn_blocking({
            let path = path.clone();
            move || common::tools::http_get(addr, &path)
        })
        .await
        .unwrap();
        if got == code {
            return body;
        }
        assert!(
            Instant::now() < deadline,
            "node {id} {path}: {got} {body}, not {code}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `/health/leader/NAME` is 200 exactly on the volume's writer, 503 on
/// its other copy and 404 on the node without one; `WatchLeader` names
/// the volume and reports its own group, and a node without a copy, or a
/// name nobody holds, is NOT_FOUND naming the holders.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_is_reported_as_written_only_by_its_writer_and_elsewhere_its_holders_are_named() {
    let _serial = one_cluster_at_a_time().await;
    let cluster = Cluster::start(3).await;
    let (writer0, _) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    create(&cluster, "pair", "8MiB", &["--replicas", "2"]).await;
    let holders = placement(&cluster, 1, "pair").await;
    assert_eq!(holders.len(), 2, "{holders:?}");
    let writer = wait_writer(&cluster, &holders, "pair").await;
    let copy = holders.iter().copied().find(|id| *id != writer).unwrap();
    let outside = [1, 2, 3]
        .into_iter()
        .find(|id| !holders.contains(id))
        .unwrap();

    // HTTP: 200 on the writer, 503 on its copy, 404 where none is.
    wait_health(&cluster, writer, "pair", 200).await;
    wait_health(&cluster, copy, "pair", 503).await;
    let body = wait_health(&cluster, outside, "pair", 404).await;
    assert!(body.contains("held by nodes"), "{body}");
    for id in [1, 2, 3] {
        wait_health(&cluster, id, "nope", 404).await;
        // The configured volume by name is /health/leader's.
        let code = if id == writer0 { 200 } else { 503 };
        wait_health(&cluster, id, "vol0", code).await;
        let (plain, _) = tokio::task::spawn_blocking({
            let addr = cluster.http_addrs[&id];
            move || common::tools::http_get(addr, "/health/leader")
        })
        .await
        .unwrap();
        assert_eq!(plain, code, "node {id} /health/leader");
    }

    // WatchLeader of the volume: its own name, group and writer.
    let on_writer = first_update(&cluster, writer, "pair")
        .await
        .expect("a stream");
    assert_eq!(on_writer.volume, "pair");
    assert!(
        on_writer.writer && on_writer.writer_term > 0,
        "{on_writer:?}"
    );
    assert_eq!(on_writer.leader, writer, "{on_writer:?}");
    assert_eq!(on_writer.size, 8 << 20, "{on_writer:?}");
    let on_copy = first_update(&cluster, copy, "pair")
        .await
        .expect("a stream");
    assert!(!on_copy.writer && on_copy.leader == writer, "{on_copy:?}");
    // Empty: the configured volume, as earlier builds of attach ask.
    let configured = first_update(&cluster, writer0, "").await.expect("a stream");
    assert_eq!(configured.volume, "vol0");
    assert!(configured.writer, "{configured:?}");

    // Not held here: NOT_FOUND naming the holders, for a program too.
    let refused = first_update(&cluster, outside, "pair")
        .await
        .expect_err("no copy on that node");
    assert_eq!(refused.code(), tonic::Code::NotFound, "{refused:?}");
    for id in &holders {
        let named = format!("{id} ({})", cluster.addrs[id]);
        assert!(refused.message().contains(&named), "{refused:?}");
    }
    let listed = refused
        .metadata()
        .get(replica_ha::api::admin::HOLDERS_METADATA)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    for id in &holders {
        assert!(
            listed.contains(&format!("{id}={}", cluster.addrs[id])),
            "{listed}"
        );
    }
    let unknown = first_update(&cluster, writer, "nope")
        .await
        .expect_err("no such volume");
    assert_eq!(unknown.code(), tonic::Code::NotFound, "{unknown:?}");
    assert!(unknown.message().contains("no volume nope"), "{unknown:?}");
}
