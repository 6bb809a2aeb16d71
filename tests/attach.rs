//! `attach` (design C3): what it does with requests that have no answer
//! when the writer changes, in-process against real NBD servers over
//! recording devices; and, against real nodes, that real clients through
//! it see no error across a crash, a transfer and a SIGTERM.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use common::cluster::{BIN, Cluster, one_cluster_at_a_time};
use replica_ha::attach::follow::{Following, Upstream};
use replica_ha::attach::watch::{Seen, Writer};
use replica_ha::ids::{NodeId, Term};
use replica_ha::nbd::{Export, Exports, NbdStats};
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
    let exports = Exports::single(export);
    let (_stop, stopped) = watch::channel(false);
    tokio::spawn(async move {
        let _keep = _stop;
        replica_ha::nbd::serve(listener, exports, Arc::new(NbdStats::default()), stopped).await
    });
    Writer {
        node: NodeId(node),
        term: Term(term),
        nbd: addr.to_string(),
    }
}

/// What a [`wire_writer`] was sent, in order.
type WireLog = Arc<Mutex<Vec<Asked>>>;

/// The server's side of the handshake, just enough for `attach`: the
/// greeting, then one `NBD_OPT_GO`, answered with the export's info.
async fn fake_handshake(stream: &mut tokio::net::TcpStream) -> std::io::Result<()> {
    use replica_ha::nbd::wire;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
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
        .await
}

/// How a [`stalled_writer`] stalls.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Stall {
    /// It accepts the connection and never sends the greeting.
    BeforeGreeting,
    /// It completes the handshake and never reads again.
    AfterHandshake,
}

/// A writer that stalls as a frozen process does: its kernel accepts the
/// connection, nothing else answers. Returns it and how many connections
/// reached the point where it stalls.
async fn stalled_writer(stall: Stall, node: u64, term: u64) -> (Writer, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stalled = Arc::new(AtomicUsize::new(0));
    let count = Arc::clone(&stalled);
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let count = Arc::clone(&count);
            tokio::spawn(async move {
                if stall == Stall::BeforeGreeting || fake_handshake(&mut stream).await.is_ok() {
                    count.fetch_add(1, Ordering::SeqCst);
                    // Holds the connection open, reading nothing.
                    std::future::pending::<()>().await;
                }
                drop(stream);
            });
        }
    });
    let writer = Writer {
        node: NodeId(node),
        term: Term(term),
        nbd: addr.to_string(),
    };
    (writer, stalled)
}

/// The bytes queued on loopback toward `port` (the receiver's queue and
/// the sender's), from `/proc/net/tcp`.
fn queued_toward(port: u16) -> u64 {
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
    let port = format!(":{port:04X}");
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (local, remote, queues) = (fields.get(1)?, fields.get(2)?, fields.get(4)?);
            let (tx, rx) = queues.split_once(':')?;
            let (tx, rx) = (
                u64::from_str_radix(tx, 16).ok()?,
                u64::from_str_radix(rx, 16).ok()?,
            );
            if local.ends_with(&port) {
                Some(rx)
            } else if remote.ends_with(&port) {
                Some(tx)
            } else {
                None
            }
        })
        .sum()
}

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
                fake_handshake(&mut stream).await?;
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

/// The port of a writer's NBD address.
fn port_of(writer: &Writer) -> u16 {
    writer.nbd.rsplit(':').next().unwrap().parse().unwrap()
}

/// A writer that completes the handshake and then stops reading (a frozen
/// process: its kernel keeps the connection) holds nothing up once the
/// watchers report another writer: 32 writes of 1 MiB, sent while the
/// buffers toward it filled, all complete at the next writer within 2 s of
/// the switch, without an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_that_stops_reading_holds_nothing_up_after_a_switch() {
    let mut tasks = JoinSet::new();
    let (frozen, opened) = stalled_writer(Stall::AfterHandshake, 1, 1).await;
    let port = port_of(&frozen);
    let log = WireLog::default();
    let next = wire_writer(Arc::clone(&log), Arc::new(AtomicBool::new(false)), 2, 2).await;
    let (device, seen) = following(Some(frozen), Duration::from_secs(30), &mut tasks);
    until("attach opened the frozen writer's export", || {
        opened.load(Ordering::SeqCst) == 1
    })
    .await;

    let writes: Vec<_> = (0..32u8)
        .map(|i| {
            let device = Arc::clone(&device);
            tokio::spawn(async move {
                device
                    .write_at(0, Bytes::from(vec![i; SIZE as usize]), false)
                    .await
            })
        })
        .collect();
    // The buffers toward the frozen writer are full once what is queued
    // toward it stops growing (32 MiB is far more than they hold).
    let deadline = Instant::now() + Duration::from_secs(10);
    let (mut last, mut steady) = (0, 0);
    while steady < 5 {
        assert!(Instant::now() < deadline, "the buffers never filled");
        tokio::time::sleep(Duration::from_millis(50)).await;
        let queued = queued_toward(port);
        steady = if queued > 0 && queued == last {
            steady + 1
        } else {
            0
        };
        last = queued;
    }
    assert!(writes.iter().all(|w| !w.is_finished()));

    seen.send_modify(|s| s.writer = Some(next));
    let deadline = Instant::now() + Duration::from_secs(2);
    for write in writes {
        tokio::time::timeout_at(deadline, write)
            .await
            .expect("every write completes within 2 s of the switch")
            .unwrap()
            .expect("no error for a writer change");
    }
    let mut written: Vec<u8> = log
        .lock()
        .unwrap()
        .iter()
        .filter_map(|asked| match asked {
            Asked::Write(_, byte) => Some(*byte),
            Asked::Flush => None,
        })
        .collect();
    written.sort_unstable();
    written.dedup();
    assert_eq!(
        written,
        (0..32).collect::<Vec<u8>>(),
        "all went to the next writer"
    );
}

/// A writer that accepts the connection and never sends the greeting is
/// given up: a switch to a working writer while `attach` is connecting
/// serves the waiting request at once, and a connect on its own fails
/// within its deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_that_never_greets_is_given_up() {
    let mut tasks = JoinSet::new();
    let (silent, accepted) = stalled_writer(Stall::BeforeGreeting, 1, 1).await;
    let log = WireLog::default();
    let good = wire_writer(Arc::clone(&log), Arc::new(AtomicBool::new(false)), 2, 2).await;
    let (device, seen) = following(Some(silent.clone()), Duration::from_secs(30), &mut tasks);
    until("attach connected to the silent writer", || {
        accepted.load(Ordering::SeqCst) >= 1
    })
    .await;
    let flush = tokio::spawn({
        let device = Arc::clone(&device);
        async move { device.flush().await }
    });
    seen.send_modify(|s| s.writer = Some(good));
    tokio::time::timeout(Duration::from_secs(2), flush)
        .await
        .expect("the flush completes within 2 s of the switch")
        .unwrap()
        .expect("no error for a writer change");
    assert_eq!(*log.lock().unwrap(), vec![Asked::Flush]);

    let started = Instant::now();
    let limit = replica_ha::nbd::client::CONNECT_TIMEOUT
        + replica_ha::nbd::client::HANDSHAKE_TIMEOUT
        + Duration::from_secs(1);
    let outcome = tokio::time::timeout(
        limit,
        replica_ha::nbd::client::connect(&silent.nbd, "vol0", None),
    )
    .await
    .expect("the connect gives up within its deadlines");
    let err = outcome.err().expect("no connection without a greeting");
    eprintln!("gave up after {:?}: {err}", started.elapsed());
}

/// Starts `attach` for `cluster` on a socket in its directory, as client
/// `name`, with `extra` arguments; returns the process and the socket's
/// path.
fn start_attach(
    cluster: &Cluster,
    name: Option<&str>,
    extra: &[&str],
) -> (std::process::Child, std::path::PathBuf) {
    let socket = cluster.dir.path().join("attach.sock");
    let mut command = std::process::Command::new(BIN);
    command
        .arg("attach")
        .arg("--socket")
        .arg(&socket)
        .args(extra);
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
    let (mut attach, socket) = start_attach(&cluster, Some("user"), &[]);
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
    let mut request = tonic::Request::new(replica_ha::proto::admin::TransferRequest {
        to: target,
        ..Default::default()
    });
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
    let (mut attach, socket) = start_attach(&cluster, Some("user"), &[]);
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

/// A three-node cluster of `size` (NBD over TLS optional) with its
/// writer elected, and `attach` on it as the viewer, with `extra`
/// arguments, serving: the cluster, the writer, attach and its socket.
async fn under_attach(
    size: &str,
    extra: &[&str],
) -> (Cluster, u64, std::process::Child, std::path::PathBuf) {
    let cluster = Cluster::start_with(3, &["--size", size, "--nbd-tls", "optional"]).await;
    let (writer, _) = cluster
        .wait_for_writer(&[1, 2, 3], Duration::from_secs(20))
        .await;
    let (attach, socket) = start_attach(&cluster, Some("user"), extra);
    wait_for_socket(&socket).await;
    (cluster, writer, attach, socket)
}

/// What [`write_through`] saw.
struct Written {
    /// Each slot's byte in its last acknowledged write.
    acked: std::collections::BTreeMap<u64, u8>,
    /// The longest wait for an answer, and the longest time without one.
    slowest: Duration,
    longest_gap: Duration,
    /// Writes answered, all told.
    count: u64,
}

/// One MiB: the block [`write_through`] writes.
const MIB: u64 = 1 << 20;

/// Writes 1 MiB blocks over `conn`, `depth` at a time, round the MiB
/// `slots` (never two at once to one slot), until `stop` or `limit`
/// writes; counts answers in `progress`. Panics on any error answer.
async fn write_through(
    conn: replica_ha::nbd::client::Connection,
    slots: std::ops::Range<u64>,
    depth: usize,
    limit: u64,
    stop: watch::Receiver<bool>,
    progress: Arc<AtomicUsize>,
) -> (Written, replica_ha::nbd::client::Connection) {
    use replica_ha::nbd::client;
    use replica_ha::nbd::wire::{Command, Request};
    use std::collections::HashMap;
    let replica_ha::nbd::client::Connection {
        mut reader,
        mut writer,
        export,
    } = conn;
    let mut in_flight: HashMap<u64, (u64, u8, Instant)> = HashMap::new();
    let mut written = Written {
        acked: Default::default(),
        slowest: Duration::ZERO,
        longest_gap: Duration::ZERO,
        count: 0,
    };
    let mut last_answer = Instant::now();
    let mut cookie = 0u64;
    loop {
        let slot = slots.start + cookie % (slots.end - slots.start);
        let busy = in_flight.values().any(|(s, _, _)| *s == slot);
        let stopping = *stop.borrow() || cookie == limit;
        if !stopping && !busy && in_flight.len() < depth {
            cookie += 1;
            let byte = (cookie % 255 + 1) as u8;
            let request = Request {
                flags: 0,
                command: Command::Write,
                cookie,
                offset: slot * MIB,
                len: MIB as u32,
            };
            let payload = Bytes::from(vec![byte; MIB as usize]);
            client::send(&mut writer, &request, Some(&payload))
                .await
                .unwrap();
            tokio::io::AsyncWriteExt::flush(&mut writer).await.unwrap();
            in_flight.insert(cookie, (slot, byte, Instant::now()));
            continue;
        }
        if in_flight.is_empty() {
            break;
        }
        let (error, answered) = client::receive(&mut reader).await.unwrap();
        assert_eq!(error, 0, "write {answered} failed through attach");
        let (slot, byte, sent) = in_flight.remove(&answered).unwrap();
        let now = Instant::now();
        written.slowest = written.slowest.max(now - sent);
        written.longest_gap = written.longest_gap.max(now - last_answer);
        last_answer = now;
        written.acked.insert(slot, byte);
        written.count += 1;
        progress.fetch_add(1, Ordering::SeqCst);
    }
    let conn = replica_ha::nbd::client::Connection {
        reader,
        writer,
        export,
    };
    (written, conn)
}

/// Reads every slot back over `conn` and checks it holds its last
/// acknowledged write.
async fn read_back(
    conn: &mut replica_ha::nbd::client::Connection,
    acked: &std::collections::BTreeMap<u64, u8>,
) {
    use replica_ha::nbd::client;
    use replica_ha::nbd::wire::{Command, Request};
    use tokio::io::AsyncReadExt;
    for (slot, byte) in acked {
        let request = Request {
            flags: 0,
            command: Command::Read,
            cookie: *slot,
            offset: slot * MIB,
            len: MIB as u32,
        };
        client::send(&mut conn.writer, &request, None)
            .await
            .unwrap();
        tokio::io::AsyncWriteExt::flush(&mut conn.writer)
            .await
            .unwrap();
        let (error, cookie) = client::receive(&mut conn.reader).await.unwrap();
        assert_eq!((error, cookie), (0, *slot));
        let mut data = vec![0; MIB as usize];
        conn.reader.read_exact(&mut data).await.unwrap();
        assert!(
            data.iter().all(|b| b == byte),
            "MiB {slot} does not hold its last acknowledged write"
        );
    }
}

/// Waits until `progress` counts `more` answers beyond `from`, or panics
/// naming `what` after `within`.
async fn progress_past(
    progress: &AtomicUsize,
    from: usize,
    more: usize,
    within: Duration,
    what: &str,
) {
    let deadline = Instant::now() + within;
    while progress.load(Ordering::SeqCst) < from + more {
        assert!(Instant::now() < deadline, "no writes answered {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Through attach, a client writing 1 MiB blocks eight at a time sees no
/// error and loses nothing while the writer is SIGSTOPped for 10 s (its
/// kernel keeps the connections); nor does a second client that sends 32
/// writes of 1 MiB at once just after the stop, which fill the buffers
/// toward the frozen writer: attach follows the next writer instead of
/// waiting for the frozen one. With `--suspend-timeout 5`, no write may
/// wait longer than that bound plus the 3 s the next writer may need to
/// take over: an attach that waited for the frozen writer would hold
/// writes for the whole 10 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_attach_a_frozen_writer_holds_nothing_up() {
    let _serial = one_cluster_at_a_time().await;
    let listen = format!("127.0.0.1:{}", common::cluster::free_port());
    let (cluster, writer, mut attach, _) =
        under_attach("64MiB", &["--listen", &listen, "--suspend-timeout", "5"]).await;
    let conn = replica_ha::nbd::client::connect(&listen, "vol0", None)
        .await
        .unwrap();
    let (stop, stopped) = watch::channel(false);
    let progress = Arc::new(AtomicUsize::new(0));
    let load = tokio::spawn(write_through(
        conn,
        0..32,
        8,
        u64::MAX,
        stopped.clone(),
        Arc::clone(&progress),
    ));
    progress_past(&progress, 0, 20, Duration::from_secs(20), "before the stop").await;

    cluster.pause(writer);
    let paused = Instant::now();
    let at_pause = progress.load(Ordering::SeqCst);
    let conn = replica_ha::nbd::client::connect(&listen, "vol0", None)
        .await
        .unwrap();
    let burst = tokio::spawn(write_through(
        conn,
        32..64,
        32,
        32,
        stopped,
        Arc::clone(&progress),
    ));
    while paused.elapsed() < Duration::from_secs(10) {
        assert!(!load.is_finished(), "the client failed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let while_stopped = progress.load(Ordering::SeqCst) - at_pause;
    cluster.resume(writer);
    let now = progress.load(Ordering::SeqCst);
    progress_past(
        &progress,
        now,
        20,
        Duration::from_secs(20),
        "after the stop",
    )
    .await;
    stop.send(true).unwrap();
    let (written, mut conn) = load.await.expect("no error through attach");
    read_back(&mut conn, &written.acked).await;
    let (burst, mut conn) = burst.await.expect("no error through attach");
    assert_eq!(burst.count, 32);
    read_back(&mut conn, &burst.acked).await;
    eprintln!(
        "{} writes; {while_stopped} while the writer was stopped; the longest pause was {:?}, the slowest write {:?}; the burst's slowest {:?}",
        written.count, written.longest_gap, written.slowest, burst.slowest
    );
    assert!(
        while_stopped > 0,
        "no write was answered while the writer was stopped"
    );
    assert!(
        written.slowest.max(burst.slowest) < Duration::from_secs(8),
        "a write waited {:?}",
        written.slowest.max(burst.slowest)
    );
    attach.kill().unwrap();
    let _ = attach.wait();
}

/// Through attach, a connection opened after a resize is offered the new
/// size, and writes past the old end land and read back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_attach_a_new_connection_sees_the_grown_size() {
    let _serial = one_cluster_at_a_time().await;
    let (cluster, writer, mut attach, socket) = under_attach("16MiB", &[]).await;
    let uri = format!("nbd+unix:///vol0?socket={}", socket.display());
    let limit = Duration::from_secs(60);
    let size = || async {
        let out = common::tools::run_ok_within("nbdinfo", &["--size", &uri], limit).await;
        out.trim().parse::<u64>().unwrap()
    };
    assert_eq!(size().await, common::load::SIZE);

    let (ok, out, err) = cluster.cli(writer, &["resize", "--size", "32MiB"]).await;
    assert!(ok, "resize failed: {out} {err}");
    let grown = 2 * common::load::SIZE;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let now = size().await;
        if now == grown {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "a new connection through attach is still offered {now} bytes"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    common::tools::write_and_read_back(&uri, common::load::SIZE + (1 << 20), limit).await;
    attach.kill().unwrap();
    let _ = attach.wait();
}
