//! Real, unmodified NBD clients (qemu-io, nbdinfo, nbdcopy, fio) and
//! generic HTTP/gRPC checks against a three-node cluster of real processes.
//!
//! The tools come from Debian's `qemu-utils`, `libnbd-bin` and `fio`
//! (`.ci/run` installs them). A missing tool fails the test with that hint;
//! nothing is skipped.

mod common;

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::process::Output;
use std::time::Duration;

use common::cluster::{Cluster, one_cluster_at_a_time};
use tokio::time::Instant;

const WRITER_WAIT: Duration = Duration::from_secs(20);

const TOOL_LIMIT: Duration = Duration::from_secs(120);

async fn run(program: &str, args: &[&str]) -> Output {
    common::tools::run_within(program, args, TOOL_LIMIT).await
}

async fn run_ok(program: &str, args: &[&str]) -> String {
    common::tools::run_ok_within(program, args, TOOL_LIMIT).await
}

use common::tools::{http_get, uri};

/// A qemu-io command list against `addr`'s export (read-only with `-r`).
async fn qemu_io(addr: SocketAddr, read_only: bool, commands: &[String]) -> Output {
    let uri = uri(addr);
    let mut args = vec!["-f", "raw"];
    if read_only {
        args.push("-r");
    }
    for command in commands {
        args.push("-c");
        args.push(command);
    }
    args.push(&uri);
    run("qemu-io", &args).await
}

/// qemu-io reports a failed command on stdout/stderr and, in the versions
/// we use, with a non-zero exit; both are checked.
fn qemu_io_ok(output: &Output) -> bool {
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output.status.success() && !text.contains("failed") && !text.contains("error")
}

async fn started(size: &str) -> (Cluster, u64) {
    let cluster = Cluster::start_with(3, &["--size", size]).await;
    let (writer, _) = cluster.wait_for_writer(&[1, 2, 3], WRITER_WAIT).await;
    (cluster, writer)
}

fn sha256(path: &std::path::Path) -> String {
    let output = std::process::Command::new("sha256sum")
        .arg(path)
        .output()
        .unwrap();
    String::from_utf8_lossy(&output.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_clients_use_the_writer_and_a_follower_is_read_only() {
    let _one = one_cluster_at_a_time().await;
    let (cluster, writer) = started("128MiB").await;
    let nbd = cluster.nbd_addrs[&writer];

    // nbdinfo sees the configured size and a writable export.
    let info = run_ok("nbdinfo", &["--json", &uri(nbd)]).await;
    let info: serde_json::Value = serde_json::from_str(&info).unwrap();
    let export = &info["exports"][0];
    assert_eq!(export["export-size"], 128 * 1024 * 1024, "{info}");
    assert_eq!(export["is_read_only"], false, "{info}");
    for flag in [
        "can_trim",
        "can_zero",
        "can_fast_zero",
        "can_cache",
        "can_multi_conn",
    ] {
        assert_eq!(export[flag], true, "{flag} in {info}");
    }

    // nbdinfo --list sees the one listener's exports by name, with their
    // descriptions; a name the node does not hold is refused (nbdinfo
    // shows the refusal, not its text: the unit tests check that).
    let listed = run_ok("nbdinfo", &["--list", "--json", &format!("nbd://{nbd}")]).await;
    let listed: serde_json::Value = serde_json::from_str(&listed).unwrap();
    let exports = listed["exports"].as_array().expect("a list of exports");
    assert_eq!(exports.len(), 1, "{listed}");
    assert_eq!(exports[0]["export-name"], "vol0", "{listed}");
    let description = exports[0]["description"].as_str().unwrap_or_default();
    assert!(description.contains("replica-ha volume vol0"), "{listed}");
    let unknown = run("nbdinfo", &[&format!("nbd://{nbd}/nope")]).await;
    let said = String::from_utf8_lossy(&unknown.stderr);
    assert!(!unknown.status.success(), "{unknown:?}");
    assert!(
        said.contains("No such file or directory for export: nope"),
        "{said}"
    );

    // qemu-io writes a pattern and reads it back.
    let written = qemu_io(
        nbd,
        false,
        &["write -P 0xab 0 1M".into(), "read -P 0xab 0 1M".into()],
    )
    .await;
    assert!(qemu_io_ok(&written), "{written:?}");

    // nbdcopy: a 64 MiB random image in and back out, checksums equal.
    let dir = tempfile::tempdir().unwrap();
    let (input, output) = (dir.path().join("in.img"), dir.path().join("out.img"));
    run_ok(
        "dd",
        &[
            "if=/dev/urandom",
            &format!("of={}", input.display()),
            "bs=1M",
            "count=64",
            "status=none",
        ],
    )
    .await;
    // (This overwrites the qemu-io pattern at offset 0.)
    // nbdcopy's defaults (several connections, many requests in flight),
    // in the debug build: Raft runs on threads of its own, so the flood does
    // not starve the writer's lease (see `raft::runtime` and
    // tests/raft_under_load.rs).
    run_ok("nbdcopy", &[input.to_str().unwrap(), &uri(nbd)]).await;
    run_ok(
        "sh",
        &[
            "-c",
            &format!(
                "nbdcopy {} - | head -c 67108864 > {}",
                uri(nbd),
                output.display()
            ),
        ],
    )
    .await;
    assert_eq!(
        sha256(&input),
        sha256(&output),
        "nbdcopy round trip differs"
    );

    // fio with verification, through libnbd, at queue depth 16.
    run_ok(
        "fio",
        &[
            "--name=verify",
            "--ioengine=nbd",
            &format!("--uri={}", uri(nbd)),
            "--rw=randwrite",
            "--bs=4k",
            "--offset=64M",
            "--size=16M",
            "--iodepth=16",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
            // Otherwise fio leaves its verify state file in the working
            // directory (the checkout).
            "--verify_state_save=0",
        ],
    )
    .await;

    // A follower's export is read-only: qemu-io cannot open it for writing,
    // and it serves the writer's data (every follower is in sync).
    let follower = *cluster.ids.iter().find(|id| **id != writer).unwrap();
    let follower_nbd = cluster.nbd_addrs[&follower];
    let refused = qemu_io(follower_nbd, false, &["write -P 0xcd 0 4k".into()]).await;
    assert!(!refused.status.success(), "{refused:?}");
    let text = String::from_utf8_lossy(&refused.stderr);
    assert!(
        text.contains("Permission denied") || text.contains("read-only"),
        "{text}"
    );
    let head = std::fs::read(&input).unwrap();
    let first = head[0];
    let read = qemu_io(
        follower_nbd,
        true,
        &[format!("read -P {first:#x} 0 1"), "read 0 1M".into()],
    )
    .await;
    assert!(qemu_io_ok(&read), "{read:?}");
    let info = run_ok("nbdinfo", &["--json", &uri(follower_nbd)]).await;
    assert!(info.contains("\"is_read_only\": true"), "{info}");
    // The writer's copy did not change through the follower.
    let check = qemu_io(nbd, true, &[format!("read -P {first:#x} 0 1")]).await;
    assert!(qemu_io_ok(&check), "{check:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_on_the_new_writer_reads_every_block_the_old_one_acknowledged() {
    let _one = one_cluster_at_a_time().await;
    let (mut cluster, writer) = started("64MiB").await;
    // Eight 64 KiB blocks, each with its own pattern, each acknowledged.
    let commands: Vec<String> = (0..8u64)
        .map(|i| format!("write -P {:#x} {} 64k", 0x10 + i, i * 1024 * 1024))
        .collect();
    let written = qemu_io(cluster.nbd_addrs[&writer], false, &commands).await;
    assert!(qemu_io_ok(&written), "{written:?}");

    cluster.kill(writer);
    let survivors: Vec<u64> = cluster
        .ids
        .iter()
        .copied()
        .filter(|id| *id != writer)
        .collect();
    let (new_writer, _) = cluster.wait_for_writer(&survivors, WRITER_WAIT).await;
    let reads: Vec<String> = (0..8u64)
        .map(|i| format!("read -P {:#x} {} 64k", 0x10 + i, i * 1024 * 1024))
        .collect();
    let read = qemu_io(cluster.nbd_addrs[&new_writer], false, &reads).await;
    assert!(qemu_io_ok(&read), "{read:?}");
    // And the new writer takes writes.
    let more = qemu_io(
        cluster.nbd_addrs[&new_writer],
        false,
        &["write -P 0x99 0 4k".into()],
    )
    .await;
    assert!(qemu_io_ok(&more), "{more:?}");
}

/// A plain HTTP/1.0 GET; returns the status code and body.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_health_metrics_and_grpc_health_agree_on_one_writer() {
    let _one = one_cluster_at_a_time().await;
    let (cluster, writer) = started("16MiB").await;
    let deadline = Instant::now() + WRITER_WAIT;
    loop {
        // `replica-ha status --json` on every node parses; exactly one is
        // the active writer, and every node names the same leader.
        let mut active = Vec::new();
        let mut leaders = Vec::new();
        for id in &cluster.ids {
            let addr = cluster.addrs[id].to_string();
            let tls = cluster.cli_tls("viewer");
            let mut args = vec!["status", "--addr", &addr, "--json"];
            args.extend(tls.iter().map(String::as_str));
            let out = run_ok(common::cluster::BIN, &args).await;
            let status: serde_json::Value = serde_json::from_str(&out).unwrap();
            assert_eq!(status["replicas"].as_array().unwrap().len(), 3, "{status}");
            if status["active"] == true {
                active.push(status["node_id"].as_u64().unwrap());
            }
            leaders.push(status["leader"].as_u64());
        }
        let health: Vec<u64> = cluster
            .ids
            .iter()
            .copied()
            .filter(|id| http_get(cluster.http_addrs[id], "/health/leader").0 == 200)
            .collect();
        let agreed = leaders.iter().all(|l| *l == Some(writer));
        if active == [writer] && health == [writer] && agreed {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "active {active:?}, health {health:?}, leaders {leaders:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for id in &cluster.ids {
        assert_eq!(http_get(cluster.http_addrs[id], "/health/live").0, 200);
        assert_eq!(http_get(cluster.http_addrs[id], "/nope").0, 404);
    }

    // Metrics: the writer counts a write made through it.
    cluster
        .write(writer, 0, bytes::Bytes::from_static(b"metrics!"))
        .await
        .unwrap();
    let (code, metrics) = http_get(cluster.http_addrs[&writer], "/metrics");
    assert_eq!(code, 200);
    for line in [
        "replica_ha_gate_open{volume=\"vol0\"} 1",
        "replica_ha_writes_total{volume=\"vol0\"} 1",
        "replica_ha_write_bytes_total{volume=\"vol0\"} 8",
        "replica_ha_role{volume=\"vol0\",node=\"",
        "replica_ha_write_latency_seconds_count{volume=\"vol0\"} 1",
        "replica_ha_replica_state{volume=\"vol0\",replica=\"1\",state=\"in_sync\"} 1",
        "replica_ha_raft_replication_lag{peer=\"",
        "replica_ha_replica_fence_floor{volume=\"vol0\",replica=\"",
        "replica_ha_replica_stale_accepts{volume=\"vol0\",replica=\"1\"} 0",
    ] {
        assert!(metrics.contains(line), "missing {line:?} in\n{metrics}");
    }
    // The write was its extent's first in the term: every replica marked it.
    for id in &cluster.ids {
        let name = format!(
            "replica_ha_replica_first_touch_marks_total{{volume=\"vol0\",replica=\"{id}\"}} "
        );
        let marks: f64 = metrics
            .lines()
            .find_map(|l| l.strip_prefix(name.as_str()))
            .unwrap_or_else(|| panic!("missing {name:?} in\n{metrics}"))
            .parse()
            .unwrap();
        assert!(marks >= 1.0, "{name}{marks}");
    }
    let follower = *cluster.ids.iter().find(|id| **id != writer).unwrap();
    let (_, metrics) = http_get(cluster.http_addrs[&follower], "/metrics");
    assert!(
        metrics.contains("replica_ha_gate_open{volume=\"vol0\"} 0"),
        "{metrics}"
    );

    // The standard gRPC health service: the writer service is SERVING on
    // the writer only; the node itself everywhere.
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    for id in &cluster.ids {
        let mut health = HealthClient::new(cluster.channel(*id));
        let check = |service: &str| HealthCheckRequest {
            service: service.into(),
        };
        let node = health.check(check("")).await.unwrap().into_inner();
        assert_eq!(node.status(), ServingStatus::Serving);
        let writes = health
            .check(check(replica_ha::node::WRITER_HEALTH_SERVICE))
            .await
            .unwrap()
            .into_inner();
        let expected = if *id == writer {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        assert_eq!(writes.status(), expected, "node {id}");
    }

    // Server reflection lists the admin service, so generic clients work.
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    let mut reflection = ServerReflectionClient::new(cluster.channel(writer));
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut replies = reflection
        .server_reflection_info(futures::stream::iter([request]))
        .await
        .unwrap()
        .into_inner();
    let reply = replies.message().await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = reply.message_response else {
        panic!("unexpected reflection reply {reply:?}");
    };
    let names: Vec<_> = list.service.iter().map(|s| s.name.as_str()).collect();
    assert!(names.contains(&"replica_ha.admin.v1.Admin"), "{names:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_on_the_nbd_port_never_panics_a_node() {
    let _one = one_cluster_at_a_time().await;
    let (cluster, writer) = started("16MiB").await;
    let nbd = cluster.nbd_addrs[&writer];
    let written = qemu_io(nbd, false, &["write -P 0x42 0 64k".into()]).await;
    assert!(qemu_io_ok(&written), "{written:?}");

    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut random = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let handshake = {
        let mut h = Vec::new();
        h.extend_from_slice(&1u32.to_be_bytes()); // fixed newstyle
        h.extend_from_slice(&replica_ha::nbd::wire::IHAVEOPT.to_be_bytes());
        h.extend_from_slice(&replica_ha::nbd::wire::OPT_EXPORT_NAME.to_be_bytes());
        h.extend_from_slice(&4u32.to_be_bytes());
        h.extend_from_slice(b"vol0");
        h
    };
    for round in 0..40 {
        let mut stream = std::net::TcpStream::connect(nbd).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        let mut greeting = [0u8; 18];
        stream.read_exact(&mut greeting).unwrap();
        let mut garbage: Vec<u8> = Vec::new();
        if round % 2 == 1 {
            garbage.extend_from_slice(&handshake);
        }
        let len = 1 + random() % 600;
        garbage.extend((0..len).map(|_| random() as u8));
        let _ = stream.write_all(&garbage);
        let mut sink = Vec::new();
        let _ = stream.read_to_end(&mut sink);
    }
    // The node still serves: its data is intact and it still writes.
    let read = qemu_io(
        nbd,
        false,
        &["read -P 0x42 0 64k".into(), "write -P 0x43 64k 4k".into()],
    )
    .await;
    assert!(qemu_io_ok(&read), "{read:?}");
    assert!(cluster.status(writer).await.is_some());
    let log = cluster.log(writer);
    assert!(!log.contains("panicked"), "{log}");
}

/// `replica-ha status --json` of node `id`, if it answers.
async fn status_json(cluster: &Cluster, id: u64) -> Option<serde_json::Value> {
    let addr = cluster.addrs[&id].to_string();
    let tls = cluster.cli_tls("viewer");
    let mut args = vec!["status", "--addr", &addr, "--json"];
    args.extend(tls.iter().map(String::as_str));
    let output = run(common::cluster::BIN, &args).await;
    if !output.status.success() {
        return None;
    }
    serde_json::from_slice(&output.stdout).ok()
}

/// Polls node `id`'s `status --json` until `want` holds for it; returns it.
async fn wait_status(
    cluster: &Cluster,
    id: u64,
    what: &str,
    within: Duration,
    want: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = Instant::now() + within;
    loop {
        let status = status_json(cluster, id).await;
        if let Some(status) = status.as_ref().filter(|s| want(s)) {
            return status.clone();
        }
        assert!(Instant::now() < deadline, "{what}: {status:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Issue 19, point 8: a follower whose replica left the committed in-sync
/// set serves no reads until its rebuild has brought it back, and `status`
/// says so. The rebuild is slowed (`--resync-rate`) so the window is seconds
/// long.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_out_of_the_in_sync_set_refuses_reads_until_it_is_rebuilt() {
    let _one = one_cluster_at_a_time().await;
    let mut cluster = Cluster::start_with(3, &["--size", "128MiB", "--resync-rate", "4MiB"]).await;
    let (writer, _) = cluster.wait_for_writer(&[1, 2, 3], WRITER_WAIT).await;
    let follower = *cluster.ids.iter().find(|id| **id != writer).unwrap();
    let follower_nbd = cluster.nbd_addrs[&follower];
    let status = wait_status(&cluster, follower, "served", WRITER_WAIT, |s| {
        s["reads"] == "served"
    })
    .await;
    assert_eq!(status["reads_refused"], serde_json::Value::Null, "{status}");

    // The follower misses 24 MiB of writes and is dropped from the set.
    cluster.kill(follower);
    let written = qemu_io(
        cluster.nbd_addrs[&writer],
        false,
        &["write -P 0x5c 0 24M".into()],
    )
    .await;
    assert!(qemu_io_ok(&written), "{written:?}");
    wait_status(&cluster, writer, "the follower dropped", WRITER_WAIT, |s| {
        !s["in_sync"]
            .as_array()
            .is_some_and(|set| set.contains(&follower.to_string().into()))
    })
    .await;

    // Back, and being rebuilt (24 MiB at 4 MiB/s): its reads are refused.
    cluster.spawn(follower);
    let status = wait_status(&cluster, follower, "reads refused", WRITER_WAIT, |s| {
        s["reads"] == "refused"
    })
    .await;
    assert_eq!(status["reads_refused"], "replica not in sync", "{status}");
    let addr = cluster.addrs[&follower].to_string();
    let tls = cluster.cli_tls("viewer");
    let mut args = vec!["status", "--addr", &addr];
    args.extend(tls.iter().map(String::as_str));
    let table = run_ok(common::cluster::BIN, &args).await;
    assert!(
        table.contains("reads          refused (replica not in sync)"),
        "{table}"
    );
    let refused = qemu_io(follower_nbd, true, &["read -P 0x5c 0 4k".into()]).await;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&refused.stdout),
        String::from_utf8_lossy(&refused.stderr)
    );
    assert!(!qemu_io_ok(&refused), "a stale read was served: {text}");
    assert!(text.contains("not in the committed in-sync set"), "{text}");
    let writer_status = status_json(&cluster, writer).await.unwrap();
    let still_out = !writer_status["in_sync"]
        .as_array()
        .is_some_and(|set| set.contains(&follower.to_string().into()));
    assert!(still_out, "the rebuild finished too soon: {writer_status}");

    // Once it is back in sync it serves the writer's data again.
    wait_status(
        &cluster,
        follower,
        "reads served again",
        Duration::from_secs(40),
        |s| s["reads"] == "served",
    )
    .await;
    let read = qemu_io(follower_nbd, true, &["read -P 0x5c 0 24M".into()]).await;
    assert!(qemu_io_ok(&read), "{read:?}");
}

/// `status --watch` redraws the view once a second, with the write rate
/// measured between two samples, and keeps going until it is stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_watch_redraws_a_live_view_with_the_write_rate() {
    use tokio::io::AsyncReadExt;
    let _one = one_cluster_at_a_time().await;
    let (cluster, writer) = started("16MiB").await;
    let mut args = vec![
        "status".to_string(),
        "--watch".into(),
        "--addr".into(),
        cluster.addrs[&writer].to_string(),
    ];
    args.extend(cluster.cli_tls("viewer"));
    let mut child = tokio::process::Command::new(common::cluster::BIN)
        .args(&args)
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut seen = String::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut buf = [0u8; 4096];
    // Three redraws, writes flowing between them.
    while seen.matches("\x1b[2J").count() < 3 {
        assert!(Instant::now() < deadline, "no live view in time:\n{seen}");
        cluster
            .write(writer, 0, bytes::Bytes::from(vec![7u8; 65536]))
            .await
            .unwrap();
        if let Ok(Ok(n)) =
            tokio::time::timeout(Duration::from_millis(200), stdout.read(&mut buf)).await
        {
            seen.push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    }
    child.kill().await.unwrap();
    let last = seen.rsplit("\x1b[2J").next().unwrap();
    assert!(
        last.contains(&format!("replica-ha node {writer}")),
        "{last}"
    );
    assert!(last.contains("role leader"), "{last}");
    assert!(last.contains("gate open"), "{last}");
    assert!(
        last.contains("writes/s,") && last.contains("MiB/s"),
        "{last}"
    );
    for id in &cluster.ids {
        assert!(
            last.lines()
                .any(|l| l.starts_with(&id.to_string()) && l.contains("in_sync")),
            "replica {id} in the view:\n{last}"
        );
    }
}

/// qemu-io's discard over NBD (`TRIM`) frees the space on every replica:
/// each node's `volume.img` shrinks on disk, the range reads back as
/// zeroes, and the replicas' digests stay identical.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_discard_frees_space_on_every_replica() {
    use std::os::unix::fs::MetadataExt;
    let _one = one_cluster_at_a_time().await;
    let (cluster, writer) = started("64MiB").await;
    let nbd = cluster.nbd_addrs[&writer];
    let allocated = |id: u64| {
        let path = cluster.data_dir(id).join("replica").join("volume.img");
        std::fs::metadata(path).unwrap().blocks() * 512
    };
    let written = qemu_io(nbd, false, &["write -P 0x5a 8M 16M".into(), "flush".into()]).await;
    assert!(qemu_io_ok(&written), "{written:?}");
    let before: Vec<u64> = cluster.ids.iter().map(|id| allocated(*id)).collect();
    let discarded = qemu_io(nbd, false, &["discard 8M 16M".into(), "flush".into()]).await;
    assert!(qemu_io_ok(&discarded), "{discarded:?}");
    for (id, before) in cluster.ids.iter().zip(&before) {
        let after = allocated(*id);
        assert!(
            after + (15 << 20) <= *before,
            "node {id}'s volume.img still holds {after} bytes (was {before})"
        );
    }
    let zeroes = qemu_io(nbd, true, &["read -P 0 8M 16M".into()]).await;
    assert!(qemu_io_ok(&zeroes), "{zeroes:?}");
    let reference = cluster.digests(writer, 0, 64 << 20).await;
    for id in &cluster.ids {
        assert!(
            cluster.digests(*id, 0, 64 << 20).await == reference,
            "node {id}'s digests differ from the writer's"
        );
    }
}

/// `base:allocation` through real clients: `nbdinfo --map` and `qemu-img
/// map` show data where it was written and holes where nothing was and
/// where it was trimmed, on the writer and on an in-sync follower; `nbdcopy`
/// of the mostly empty volume reads only what is allocated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_status_shows_data_and_holes_to_nbdinfo_qemu_img_and_nbdcopy() {
    let _one = one_cluster_at_a_time().await;
    let (cluster, writer) = started("64MiB").await;
    let nbd = cluster.nbd_addrs[&writer];
    let written = qemu_io(
        nbd,
        false,
        &[
            "write -P 0x5a 4M 8M".into(),
            "write -P 0x6b 32M 1M".into(),
            "discard 6M 2M".into(),
            "flush".into(),
        ],
    )
    .await;
    assert!(qemu_io_ok(&written), "{written:?}");
    const M: u64 = 1 << 20;
    // (start, length, data?) as both tools must show them.
    let want = vec![
        (0, 4 * M, false),
        (4 * M, 2 * M, true),
        (6 * M, 2 * M, false),
        (8 * M, 4 * M, true),
        (12 * M, 20 * M, false),
        (32 * M, M, true),
        (33 * M, 31 * M, false),
    ];
    let follower = *cluster.ids.iter().find(|id| **id != writer).unwrap();
    for id in [writer, follower] {
        let map = run_ok("nbdinfo", &["--map", &uri(cluster.nbd_addrs[&id])]).await;
        let got: Vec<(u64, u64, bool)> = map
            .lines()
            .map(|line| {
                let fields: Vec<&str> = line.split_whitespace().collect();
                let data = fields[3] == "data";
                (fields[0].parse().unwrap(), fields[1].parse().unwrap(), data)
            })
            .collect();
        assert_eq!(got, want, "nbdinfo --map on node {id}:\n{map}");
    }
    let json = run_ok(
        "qemu-img",
        &["map", "--output=json", "-f", "raw", &uri(nbd)],
    )
    .await;
    let entries: Vec<serde_json::Value> = serde_json::from_str(&json).unwrap();
    let got: Vec<(u64, u64, bool)> = entries
        .iter()
        .map(|e| {
            (
                e["start"].as_u64().unwrap(),
                e["length"].as_u64().unwrap(),
                e["data"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(got, want, "qemu-img map:\n{json}");
    // nbdcopy skips the holes: what crossed the writer's data path is the
    // allocated 7 MiB, not the 64 MiB volume.
    let read_bytes = || {
        let (_, metrics) = http_get(cluster.http_addrs[&writer], "/metrics");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix("replica_ha_read_bytes_total{volume=\"vol0\"} "))
            .map_or(0.0, |v| v.parse::<f64>().unwrap()) as u64
    };
    let before = read_bytes();
    run_ok("nbdcopy", &[&uri(nbd), "null:"]).await;
    let moved = read_bytes() - before;
    assert!(
        (7 * M..=8 * M).contains(&moved),
        "nbdcopy read {moved} bytes of the 64 MiB volume"
    );
    // Reads across data and holes (block status off, so every read is
    // sent): the holes come back as hole chunks, and what nbdcopy puts
    // together is the volume, byte for byte.
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join("copy.img");
    let copy_arg = copy.to_str().unwrap();
    run_ok("nbdcopy", &["--no-extents", &uri(nbd), copy_arg]).await;
    let mut expected = vec![0u8; 64 * M as usize];
    expected[4 * M as usize..6 * M as usize].fill(0x5a);
    expected[8 * M as usize..12 * M as usize].fill(0x5a);
    expected[32 * M as usize..33 * M as usize].fill(0x6b);
    assert!(
        std::fs::read(&copy).unwrap() == expected,
        "nbdcopy --no-extents copied something else than the volume"
    );
    let moved = read_bytes() - before;
    assert!(
        moved < 16 * M,
        "reads around holes moved {moved} bytes: the holes were sent as data"
    );
}
