//! `attach` (design C3): what it does with requests that have no answer
//! when the writer changes, in-process against real NBD servers over
//! recording devices; and, against real nodes, that real clients through
//! it see no error across a crash, a transfer and a SIGTERM.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use common::cluster::{BIN, Cluster, one_cluster_at_a_time};
use replica_ha::attach::follow::{Following, Upstream};
use replica_ha::attach::watch::{Seen, Writer};
use replica_ha::ids::{NodeId, Term};
use replica_ha::nbd::{Export, NbdStats};
use replica_ha::volume::{Device, DeviceError};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;

const SIZE: u64 = 1 << 20;

/// What a writer's device was asked, in the order the requests arrived.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Asked {
    Write(u64, u8),
    Flush,
}

/// A writer's device that records every request as it arrives, and fails
/// writes at `failing` with EIO.
#[derive(Default)]
struct Recorder {
    log: Mutex<Vec<Asked>>,
    failing: Option<u64>,
}

impl Recorder {
    fn log(&self) -> Vec<Asked> {
        self.log.lock().unwrap().clone()
    }
}

#[async_trait]
impl Device for Recorder {
    async fn read_at(&self, _offset: u64, len: u64) -> Result<Bytes, DeviceError> {
        Ok(Bytes::from(vec![0; len as usize]))
    }

    async fn write_at(&self, offset: u64, data: Bytes, _fua: bool) -> Result<(), DeviceError> {
        self.log.lock().unwrap().push(Asked::Write(offset, data[0]));
        if self.failing == Some(offset) {
            return Err(DeviceError::Io("a bad sector".into()));
        }
        Ok(())
    }

    async fn discard(&self, _offset: u64, _len: u64) -> Result<(), DeviceError> {
        Ok(())
    }

    async fn flush(&self) -> Result<(), DeviceError> {
        self.log.lock().unwrap().push(Asked::Flush);
        Ok(())
    }

    async fn change(
        &self,
        change: replica_ha::volume::Change,
        _: &replica_ha::volume::Bond,
    ) -> Result<(), DeviceError> {
        change.run_once(self).await
    }

    fn size(&self) -> u64 {
        SIZE
    }

    fn is_writable(&self) -> bool {
        true
    }

    fn access(&self) -> replica_ha::volume::Access {
        replica_ha::volume::Access::ReadWrite { term: Term(1) }
    }
}

/// A writer: an NBD server on loopback over `device`.
async fn writer(device: Arc<Recorder>, node: u64, term: u64) -> Writer {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let export = Arc::new(Export::new("vol0", "a writer", device as Arc<dyn Device>));
    let (_stop, stopped) = watch::channel(false);
    tokio::spawn(async move {
        let _keep = _stop;
        replica_ha::nbd::serve(listener, export, Arc::new(NbdStats::default()), stopped).await
    });
    Writer {
        node: NodeId(node),
        term: Term(term),
        nbd: addr.to_string(),
    }
}

/// What a [`wire_writer`] was sent, in order.
type WireLog = Arc<Mutex<Vec<Asked>>>;

/// A writer that records requests in the order they come over the wire
/// (the real server runs them concurrently, so its device may see them in
/// another order) and answers each at once, unless frozen.
async fn wire_writer(
    log: Arc<Mutex<Vec<Asked>>>,
    frozen: Arc<AtomicBool>,
    node: u64,
    term: u64,
) -> Writer {
    use replica_ha::nbd::wire;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let (log, frozen) = (Arc::clone(&log), Arc::clone(&frozen));
            tokio::spawn(async move {
                stream.write_all(&wire::greeting()).await?;
                let _flags = stream.read_u32().await?;
                let mut header = [0u8; 16];
                stream.read_exact(&mut header).await?;
                let option = wire::parse_option_header(&header).unwrap();
                let mut data = vec![0; option.len as usize];
                stream.read_exact(&mut data).await?;
                let info = wire::info_export(SIZE, wire::TFLAG_HAS_FLAGS | wire::TFLAG_SEND_FLUSH);
                stream
                    .write_all(&wire::option_reply(option.option, wire::REP_INFO, &info))
                    .await?;
                stream
                    .write_all(&wire::option_reply(option.option, wire::REP_ACK, &[]))
                    .await?;
                loop {
                    let mut header = [0u8; wire::REQUEST_LEN];
                    stream.read_exact(&mut header).await?;
                    let request = wire::parse_request(&header).unwrap();
                    let mut payload = vec![0; request.payload_len() as usize];
                    stream.read_exact(&mut payload).await?;
                    log.lock().unwrap().push(match request.command {
                        wire::Command::Write => Asked::Write(request.offset, payload[0]),
                        _ => Asked::Flush,
                    });
                    if !frozen.load(Ordering::SeqCst) {
                        stream
                            .write_all(&wire::simple_reply(0, request.cookie))
                            .await?;
                    }
                }
                #[allow(unreachable_code)]
                Ok::<(), std::io::Error>(())
            });
        }
    });
    Writer {
        node: NodeId(node),
        term: Term(term),
        nbd: addr.to_string(),
    }
}

fn following(
    first: Option<Writer>,
    suspend: Duration,
    tasks: &mut JoinSet<()>,
) -> (Arc<Following>, watch::Sender<Seen>) {
    let (seen, watched) = watch::channel(Seen {
        writer: first,
        size: Some(SIZE),
        term: Term(1),
    });
    let device = Following::start(
        watched,
        SIZE,
        Upstream {
            export: "vol0".into(),
            tls: None,
            suspend_timeout: suspend,
        },
        tasks,
    );
    (Arc::new(device), seen)
}

async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Requests without an answer when the writer changes are sent again to
/// the next writer, all of them, in the order they were first sent, and
/// then answered; the client sees no error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unanswered_requests_are_sent_again_in_order_to_the_next_writer() {
    let mut tasks = JoinSet::new();
    let (old, new) = (WireLog::default(), WireLog::default());
    let first = wire_writer(Arc::clone(&old), Arc::new(AtomicBool::new(true)), 1, 1).await;
    let next = wire_writer(Arc::clone(&new), Arc::new(AtomicBool::new(false)), 2, 2).await;
    let (device, seen) = following(Some(first), Duration::from_secs(30), &mut tasks);

    // Overlapping writes, then a flush, one after another.
    let mut requests = Vec::new();
    let sent = [
        Asked::Write(0, b'a'),
        Asked::Write(0, b'b'),
        Asked::Write(4096, b'c'),
        Asked::Flush,
    ];
    for request in sent.clone() {
        let device = Arc::clone(&device);
        requests.push(tokio::spawn(async move {
            match request {
                Asked::Write(offset, byte) => {
                    device
                        .write_at(offset, Bytes::from(vec![byte; 4096]), false)
                        .await
                }
                Asked::Flush => device.flush().await,
            }
        }));
        let arrived = requests.len();
        until("the request reached the old writer", || {
            old.lock().unwrap().len() == arrived
        })
        .await;
    }
    assert_eq!(
        *old.lock().unwrap(),
        sent,
        "the old writer got them in order"
    );
    assert!(
        requests.iter().all(|r| !r.is_finished()),
        "nothing is answered yet"
    );

    seen.send_modify(|s| s.writer = Some(next));
    for request in requests {
        request
            .await
            .unwrap()
            .expect("answered by the next writer, no error");
    }
    assert_eq!(
        *new.lock().unwrap(),
        sent,
        "the next writer got them again, in order"
    );

    // New requests go to the new writer only.
    device
        .write_at(8192, Bytes::from(vec![b'd'; 4096]), false)
        .await
        .unwrap();
    assert_eq!(new.lock().unwrap().last(), Some(&Asked::Write(8192, b'd')));
    assert_eq!(old.lock().unwrap().len(), 4);
}

/// An error the writer answers is the answer: passed on as its NBD error,
/// not sent again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_the_writer_answers_is_passed_on_once() {
    let mut tasks = JoinSet::new();
    let failing = Arc::new(Recorder {
        failing: Some(4096),
        ..Recorder::default()
    });
    let first = writer(Arc::clone(&failing), 1, 1).await;
    let (device, _seen) = following(Some(first), Duration::from_secs(30), &mut tasks);
    let err = device
        .write_at(4096, Bytes::from(vec![1; 4096]), false)
        .await
        .unwrap_err();
    assert_eq!(err, DeviceError::Remote { errno: 5 });
    assert_eq!(failing.log(), vec![Asked::Write(4096, 1)]);
}

/// With no writer to be found, a request waits the suspend timeout, and
/// then fails, not before; one that finds a writer in time succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_writer_a_request_waits_the_suspend_timeout_then_fails() {
    let mut tasks = JoinSet::new();
    let (device, seen) = following(None, Duration::from_millis(600), &mut tasks);
    let started = Instant::now();
    let err = device.flush().await.unwrap_err();
    let waited = started.elapsed();
    assert!(matches!(err, DeviceError::Io(_)), "{err:?}");
    assert!(
        waited >= Duration::from_millis(600),
        "failed after {waited:?}"
    );
    assert!(
        waited < Duration::from_secs(5),
        "failed only after {waited:?}"
    );

    let late = Arc::new(Recorder::default());
    let writer = writer(Arc::clone(&late), 3, 5).await;
    let waiting = tokio::spawn({
        let device = Arc::clone(&device);
        async move { device.flush().await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    seen.send_modify(|s| s.writer = Some(writer));
    waiting.await.unwrap().expect("a writer came in time");
    assert_eq!(late.log(), vec![Asked::Flush]);
}

/// Starts `attach` for `cluster` on a socket in its directory, as client
/// `name`; returns the process and the socket's path.
fn start_attach(
    cluster: &Cluster,
    name: Option<&str>,
) -> (std::process::Child, std::path::PathBuf) {
    let socket = cluster.dir.path().join("attach.sock");
    let mut command = std::process::Command::new(BIN);
    command.arg("attach").arg("--socket").arg(&socket);
    for (id, addr) in &cluster.addrs {
        command.arg("--peer").arg(format!("{id}={addr}"));
    }
    if let Some(name) = name {
        command.args(cluster.cli_tls(name));
    }
    let log = std::fs::File::create(cluster.dir.path().join("attach.log")).unwrap();
    let child = command.env("RUST_LOG", "info").stderr(log).spawn().unwrap();
    (child, socket)
}

async fn wait_for_socket(socket: &std::path::Path) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !socket.exists() {
        assert!(Instant::now() < deadline, "attach never served");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// fio with crc32c verification through `socket` for `seconds`, while
/// `event` happens; fio must see no error and every block must verify.
async fn fio_through(
    socket: &std::path::Path,
    seconds: u64,
) -> tokio::task::JoinHandle<std::process::Output> {
    let uri = format!("--uri=nbd+unix:///vol0?socket={}", socket.display());
    let runtime = format!("--runtime={seconds}");
    tokio::spawn(async move {
        tokio::process::Command::new("fio")
            .args([
                "--name=through-attach",
                "--ioengine=nbd",
                &uri,
                "--rw=randwrite",
                "--bs=4k",
                "--size=16M",
                "--iodepth=16",
                "--time_based",
                &runtime,
                "--verify=crc32c",
                "--verify_fatal=1",
                // Otherwise fio leaves its verify state file in the working
                // directory (the checkout).
                "--verify_state_save=0",
            ])
            .output()
            .await
            .expect("fio runs (.ci/run installs it)")
    })
}

fn fio_ok(output: &std::process::Output) {
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success() && text.contains("err= 0"),
        "{text}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Through attach, fio writing and verifying at queue depth 16 sees no
/// error across a SIGKILL of the writer, a transfer and a SIGTERM of the
/// writer; attach says it sent requests again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_attach_a_crash_a_transfer_and_a_restart_cause_no_error() {
    let _serial = one_cluster_at_a_time().await;
    let mut cluster = Cluster::start_with(3, &["--size", "64MiB", "--nbd-tls", "optional"]).await;
    let (writer, _) = cluster
        .wait_for_writer(&[1, 2, 3], Duration::from_secs(20))
        .await;
    let (mut attach, socket) = start_attach(&cluster, Some("user"));
    wait_for_socket(&socket).await;

    // A crash.
    let fio = fio_through(&socket, 5).await;
    cluster
        .wait_for_writes(writer, 200, Duration::from_secs(20))
        .await;
    cluster.kill(writer);
    fio_ok(&fio.await.unwrap());
    cluster.spawn(writer);
    let (writer, _) = cluster
        .wait_for_writer(&[1, 2, 3], Duration::from_secs(20))
        .await;

    // A transfer.
    let target = [1, 2, 3].into_iter().find(|id| *id != writer).unwrap();
    let fio = fio_through(&socket, 4).await;
    cluster
        .wait_for_writes(writer, 200, Duration::from_secs(20))
        .await;
    let mut request = tonic::Request::new(replica_ha::proto::admin::TransferRequest { to: target });
    request.set_timeout(Duration::from_secs(10));
    cluster
        .admin(writer)
        .transfer_leader(request)
        .await
        .expect("transfer");
    fio_ok(&fio.await.unwrap());

    // A rolling restart: SIGTERM of the writer.
    let (writer, _) = cluster
        .wait_for_writer(&[1, 2, 3], Duration::from_secs(20))
        .await;
    let fio = fio_through(&socket, 4).await;
    cluster
        .wait_for_writes(writer, 200, Duration::from_secs(20))
        .await;
    assert!(cluster.terminate(writer).success());
    fio_ok(&fio.await.unwrap());

    let log = std::fs::read_to_string(cluster.dir.path().join("attach.log")).unwrap();
    assert!(
        log.contains("the writer changed") || log.contains("lost the writer"),
        "{log}"
    );
    assert!(log.contains("resending"), "{log}");
    attach.kill().unwrap();
    let _ = attach.wait();
}

/// A hostile client on attach's socket cannot bring it down: garbage and a
/// half handshake are dropped, and the next client is served. Without a
/// certificate, attach cannot reach the cluster at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attach_survives_garbage_and_needs_credentials() {
    use tokio::io::AsyncWriteExt;
    let _serial = one_cluster_at_a_time().await;
    let cluster = Cluster::start_with(3, &["--nbd-tls", "optional"]).await;
    cluster
        .wait_for_writer(&[1, 2, 3], Duration::from_secs(20))
        .await;
    let (mut attach, socket) = start_attach(&cluster, Some("user"));
    wait_for_socket(&socket).await;
    for garbage in [
        &b"GET / HTTP/1.1\r\n\r\n"[..],
        &[0xff; 4096][..],
        b"NBDMAGIC",
    ] {
        let mut stream = tokio::net::UnixStream::connect(&socket).await.unwrap();
        let _ = stream.write_all(garbage).await;
        drop(stream);
    }
    let uri = format!("nbd+unix:///vol0?socket={}", socket.display());
    let out = common::tools::run_ok_within(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-c",
            "write -P 0x77 0 64k",
            "-c",
            "read -P 0x77 0 64k",
            &uri,
        ],
        Duration::from_secs(60),
    )
    .await;
    assert!(!out.contains("failed"), "{out}");
    assert!(attach.try_wait().unwrap().is_none(), "attach died");
    attach.kill().unwrap();
    let _ = attach.wait();

    // No certificate: the nodes refuse it, and it says so and stops.
    let socket = cluster.dir.path().join("stranger.sock");
    let mut command = std::process::Command::new(BIN);
    command
        .arg("attach")
        .arg("--socket")
        .arg(&socket)
        .args(["--insecure", "--first-contact", "2"]);
    for (id, addr) in &cluster.addrs {
        command.arg("--peer").arg(format!("{id}={addr}"));
    }
    let child = command
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let out = tokio::task::spawn_blocking(move || child.wait_with_output().unwrap())
        .await
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("answered"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!socket.exists());
}
