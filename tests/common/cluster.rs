//! A cluster of real `replica-ha node` processes on loopback, for
//! integration tests. Every node logs to `<dir>/nodeN.log`; on drop every
//! process is killed.
//!
//! Every cluster runs with mutual TLS, as a deployment does by default:
//! `<dir>/certs` holds its CA, a certificate per node, and the client
//! certificates `admin` (role admin), `user` (role user: the volume's
//! data) and `viewer` (role viewer). The test's own calls
//! ([`Cluster::channel`]) present `admin`; clients that write the volume
//! through NBD or `attach` present `user`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use replica_ha::proto::admin::admin_client::AdminClient;
use replica_ha::proto::admin::{ReadRequest, StatusReply, StatusRequest, WriteRequest};
use tokio::time::Instant;

use super::proxy::Proxy;

pub const BIN: &str = env!("CARGO_BIN_EXE_replica-ha");

static ONE_CLUSTER_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Held by every test that runs node processes: cargo runs a binary's tests
/// in parallel, and several three-node clusters on two cores starve
/// heartbeats past the election timeout, causing real (unwanted) elections.
pub async fn one_cluster_at_a_time() -> tokio::sync::MutexGuard<'static, ()> {
    ONE_CLUSTER_AT_A_TIME.lock().await
}

/// A free loopback port for a node to listen on, from below Linux's
/// ephemeral range (32768-60999). A port from that range (`bind` to port 0)
/// can be handed out again, between our release and the node's bind, to a
/// proxy listener or to the source port of any outgoing connection — the
/// fault campaign saw a node fail to start that way. Below the range only
/// another explicit bind can take it, and ports are tried in turn from a
/// per-process start.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const LOW: u32 = 20_000;
    const SPAN: u32 = 12_000;
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let _ = NEXT.compare_exchange(
        u32::MAX,
        std::process::id() % SPAN,
        Ordering::SeqCst,
        Ordering::SeqCst,
    );
    for _ in 0..SPAN {
        let port = (LOW + NEXT.fetch_add(1, Ordering::SeqCst) % SPAN) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port in {LOW}..{}", LOW + SPAN);
}

pub struct Cluster {
    pub dir: tempfile::TempDir,
    pub ids: Vec<u64>,
    pub addrs: BTreeMap<u64, SocketAddr>,
    /// Each node's NBD and HTTP addresses.
    pub nbd_addrs: BTreeMap<u64, SocketAddr>,
    pub http_addrs: BTreeMap<u64, SocketAddr>,
    /// Each node's replica (data) listener, a fixed port so that proxies
    /// can front it.
    pub data_addrs: BTreeMap<u64, SocketAddr>,
    /// `proxies[(from, to)]`, when the cluster routes through proxies:
    /// the gRPC link (Raft, hello).
    pub proxies: BTreeMap<(u64, u64), Proxy>,
    /// The same for the data link (the replica service).
    pub data_proxies: BTreeMap<(u64, u64), Proxy>,
    children: BTreeMap<u64, Child>,
    pub cluster_id: String,
    pub extra_args: Vec<String>,
    /// Extra environment for every node process (the fault campaign's
    /// fsync shim); `{dir}` in a value becomes the node's data dir.
    pub env: Vec<(String, String)>,
    /// The certificate directory (see the module docs).
    pub certs: PathBuf,
    /// The test's own client: the `admin` certificate.
    admin: replica_ha::net::Transport,
    /// Let each node's data listener take a port the OS picks (the default
    /// outside tests) instead of `data_addrs`; no data proxies then.
    pub os_chosen_data_ports: bool,
    /// The node binary ([`BIN`] unless a benchmark compares another build).
    pub bin: PathBuf,
    /// The nodes that form the cluster, when not all of `ids` do: these
    /// list only each other as peers; the others (nodes to add later) list
    /// every node, so they can reach the members and wait to be added.
    pub founders: Option<Vec<u64>>,
    /// The address every node's NBD listener binds, with its port from
    /// `nbd_addrs` (which clients still dial); `None`: `nbd_addrs` as they
    /// are (loopback).
    pub nbd_bind: Option<std::net::IpAddr>,
    /// Start each node with `--config <dir>/node<id>.toml` as well; the
    /// flags still give its addresses, data dir and certificates.
    pub configs: bool,
}

impl Cluster {
    /// `n` nodes that dial each other directly.
    pub async fn start(n: u64) -> Cluster {
        let mut cluster = Cluster::new(n);
        for id in cluster.ids.clone() {
            cluster.spawn(id);
        }
        cluster
    }

    /// `n` nodes started with `extra_args` (replacing the default size).
    pub async fn start_with(n: u64, extra_args: &[&str]) -> Cluster {
        let mut cluster = Cluster::new(n);
        cluster.extra_args = extra_args.iter().map(|a| a.to_string()).collect();
        for id in cluster.ids.clone() {
            cluster.spawn(id);
        }
        cluster
    }

    /// `n` nodes where every node dials every peer through its own proxy.
    pub async fn start_with_proxies(n: u64) -> Cluster {
        let mut cluster = Cluster::new(n);
        cluster.add_proxies().await;
        for id in cluster.ids.clone() {
            cluster.spawn(id);
        }
        cluster
    }

    /// Routes every node-to-node link through its own proxy (call before
    /// the nodes start).
    pub async fn add_proxies(&mut self) {
        for from in self.ids.clone() {
            for to in self.ids.clone() {
                if from != to {
                    let proxy = Proxy::start(self.addrs[&to]).await;
                    self.proxies.insert((from, to), proxy);
                    let proxy = Proxy::start(self.data_addrs[&to]).await;
                    self.data_proxies.insert((from, to), proxy);
                }
            }
        }
    }

    pub fn new(n: u64) -> Cluster {
        let ids: Vec<u64> = (1..=n).collect();
        let dir = tempfile::tempdir().unwrap();
        let cluster_id = "test-cluster".to_string();
        make_certs(dir.path(), &cluster_id, &ids);
        Cluster::adopt(dir, &cluster_id, &ids)
    }

    /// Nodes `ids` of cluster `cluster_id` on what `dir` already holds:
    /// the certificates in `<dir>/certs` (see the module docs; at least
    /// `admin`), and whatever each node's data dir `<dir>/node<id>` holds
    /// (nothing, or a cluster's state, as an upgrade finds it), on fresh
    /// ports. Nothing is started.
    pub fn adopt(dir: tempfile::TempDir, cluster_id: &str, ids: &[u64]) -> Cluster {
        let ids = ids.to_vec();
        let ports = || {
            ids.iter()
                .map(|id| (*id, SocketAddr::from(([127, 0, 0, 1], free_port()))))
                .collect::<BTreeMap<_, _>>()
        };
        let (addrs, nbd_addrs, http_addrs, data_addrs) = (ports(), ports(), ports(), ports());
        let cluster_id = cluster_id.to_string();
        let certs = dir.path().join("certs");
        let admin = client_transport(&certs, "admin");
        Cluster {
            dir,
            ids,
            addrs,
            nbd_addrs,
            http_addrs,
            data_addrs,
            proxies: BTreeMap::new(),
            data_proxies: BTreeMap::new(),
            children: BTreeMap::new(),
            cluster_id,
            extra_args: vec!["--size".into(), "16MiB".into()],
            env: Vec::new(),
            certs,
            admin,
            os_chosen_data_ports: false,
            bin: PathBuf::from(BIN),
            founders: None,
            nbd_bind: None,
            configs: false,
        }
    }

    /// A channel to node `id` that presents the `admin` certificate and
    /// checks that the server is node `id`.
    pub fn channel(&self, id: u64) -> tonic::transport::Channel {
        self.admin
            .channel(
                &self.addrs[&id].to_string(),
                replica_ha::net::Expect::Node(replica_ha::ids::NodeId(id)),
            )
            .expect("a loopback address")
    }

    /// The CLI's flags to authenticate as client `name` (`admin`, `user`
    /// or `viewer`).
    pub fn cli_tls(&self, name: &str) -> Vec<String> {
        vec![
            "--tls-dir".into(),
            self.certs.display().to_string(),
            "--as".into(),
            name.into(),
        ]
    }

    /// A channel to node `id`'s replica service (its data listener) that
    /// presents `id`'s own node certificate: the replica service refuses a
    /// client's.
    pub fn peer_channel(&self, id: u64) -> tonic::transport::Channel {
        self.node_transport(id)
            .channel(
                &self.data_addrs[&id].to_string(),
                replica_ha::net::Expect::Node(replica_ha::ids::NodeId(id)),
            )
            .expect("a loopback address")
    }

    /// A raw client of node `id`'s block channel, with node `id`'s own
    /// credentials, naming the node's incarnation as it is now (S8).
    pub async fn block_client(&self, id: u64) -> super::blocks::BlockClient {
        self.copy_client(id, "vol0", 0).await
    }

    /// [`Cluster::block_client`] for node `id`'s copy of volume `name` of
    /// Raft group `group` (a table volume's; `"vol0"`, 0: the configured
    /// one).
    pub async fn copy_client(&self, id: u64, name: &str, group: u64) -> super::blocks::BlockClient {
        let incarnation = self.volume_ref(id).await.incarnation;
        super::blocks::BlockClient::connect_to(
            &self.node_transport(id),
            &self.data_addrs[&id].to_string(),
            replica_ha::net::Expect::Node(replica_ha::ids::NodeId(id)),
            &self.cluster_id,
            (name, replica_ha::ids::GroupId(group)),
            incarnation,
        )
        .await
        .expect("a block-channel link")
    }

    /// A transport with node `id`'s credentials.
    pub fn node_transport(&self, id: u64) -> replica_ha::net::Transport {
        let node = replica_ha::ids::NodeId(id);
        let files = replica_ha::certs::TlsFiles::for_node(&self.certs, node);
        let tls = replica_ha::net::Tls::load(
            files,
            &self.cluster_id,
            replica_ha::net::tls::Party::Node(node),
        )
        .expect("node credentials");
        replica_ha::net::Transport::secured(replica_ha::net::Limits::default(), tls)
    }

    /// An admin client of node `id` (see [`Cluster::channel`]).
    pub fn admin(&self, id: u64) -> AdminClient<tonic::transport::Channel> {
        AdminClient::new(self.channel(id))
    }

    pub fn data_dir(&self, id: u64) -> PathBuf {
        self.dir.path().join(format!("node{id}"))
    }

    pub fn log_path(&self, id: u64) -> PathBuf {
        self.dir.path().join(format!("node{id}.log"))
    }

    pub fn log(&self, id: u64) -> String {
        std::fs::read_to_string(self.log_path(id)).unwrap_or_default()
    }

    /// Node `id`'s gate journal (every test node keeps one).
    pub fn journal_path(&self, id: u64) -> PathBuf {
        self.dir.path().join(format!("node{id}.journal"))
    }

    /// Node `id`'s process id, while it runs.
    pub fn pid(&self, id: u64) -> Option<u32> {
        self.children.get(&id).map(Child::id)
    }

    /// Whether node `id` is running (started and not killed or stopped).
    pub fn is_running(&self, id: u64) -> bool {
        self.children.contains_key(&id)
    }

    /// The nodes that exited by themselves (not killed or terminated by the
    /// test) since the last call, with their exit status; they are reaped.
    pub fn exited(&mut self) -> Vec<(u64, ExitStatus)> {
        let mut exited = Vec::new();
        for (id, child) in &mut self.children {
            if let Ok(Some(status)) = child.try_wait() {
                exited.push((*id, status));
            }
        }
        for (id, _) in &exited {
            self.children.remove(id);
        }
        exited
    }

    /// The arguments node `id` starts with.
    pub fn args(&self, id: u64) -> Vec<String> {
        let mut args = vec!["node".to_string()];
        if self.configs {
            args.push("--config".into());
            let config = self.dir.path().join(format!("node{id}.toml"));
            args.push(config.display().to_string());
        }
        args.extend([
            "--id".into(),
            id.to_string(),
            "--cluster-id".into(),
            self.cluster_id.clone(),
            "--listen".into(),
            self.addrs[&id].to_string(),
            "--data-dir".into(),
            self.data_dir(id).display().to_string(),
            "--nbd".into(),
            match self.nbd_bind {
                Some(ip) => SocketAddr::new(ip, self.nbd_addrs[&id].port()).to_string(),
                None => self.nbd_addrs[&id].to_string(),
            },
            "--http".into(),
            self.http_addrs[&id].to_string(),
            "--gate-journal".into(),
            self.journal_path(id).display().to_string(),
            "--tls-dir".into(),
            self.certs.display().to_string(),
        ]);
        if !self.os_chosen_data_ports {
            args.push("--data-listen".into());
            args.push(self.data_addrs[&id].to_string());
        }
        let listed = match &self.founders {
            Some(founders) if founders.contains(&id) => founders.clone(),
            _ => self.ids.clone(),
        };
        for peer in &listed {
            let addr = match self.proxies.get(&(id, *peer)) {
                Some(proxy) => proxy.addr,
                None => self.addrs[peer],
            };
            args.push("--peer".into());
            args.push(format!("{peer}={addr}"));
            if let Some(proxy) = self.data_proxies.get(&(id, *peer)) {
                args.push("--peer-data".into());
                args.push(format!("{peer}={}", proxy.addr));
            }
        }
        args.extend(self.extra_args.iter().cloned());
        args
    }

    /// Deletes everything in node `id`'s data dir (the node must be
    /// stopped): a replaced disk. A directory that cannot go (a mount
    /// point, the fault campaign's small disks) is emptied instead. The
    /// log stays.
    pub fn wipe(&self, id: u64) {
        fn empty(dir: &std::path::Path) {
            let Ok(entries) = std::fs::read_dir(dir) else {
                return;
            };
            for entry in entries.flatten() {
                let path = entry.path();
                if path.is_dir() {
                    if std::fs::remove_dir_all(&path).is_err() {
                        empty(&path);
                    }
                } else {
                    std::fs::remove_file(&path).unwrap();
                }
            }
        }
        empty(&self.data_dir(id));
    }

    /// Runs the CLI command `args[0]` with the rest of `args` against node
    /// `id` (admin certificate; the address and certificate flags go right
    /// after the command, before any subcommand) and returns whether it
    /// succeeded, its stdout and its stderr.
    pub async fn cli(&self, id: u64, args: &[&str]) -> (bool, String, String) {
        let mut command = tokio::process::Command::new(&self.bin);
        command.arg(args[0]);
        command.args(["--addr", &self.addrs[&id].to_string()]);
        command.args(self.cli_tls("admin"));
        command.args(&args[1..]);
        let output = command.output().await.expect("run the CLI");
        (
            output.status.success(),
            String::from_utf8_lossy(&output.stdout).into_owned(),
            String::from_utf8_lossy(&output.stderr).into_owned(),
        )
    }

    /// The members node `id`'s membership names.
    pub async fn member_ids(&self, id: u64) -> Vec<u64> {
        let mut request = tonic::Request::new(replica_ha::proto::admin::MembersRequest {});
        request.set_timeout(Duration::from_secs(2));
        match self.admin(id).members(request).await {
            Ok(reply) => reply.into_inner().members.iter().map(|m| m.id).collect(),
            Err(_) => Vec::new(),
        }
    }

    /// Waits until node `id`'s status passes `check`; panics with the last
    /// status after `within`.
    pub async fn wait_status(
        &self,
        id: u64,
        within: Duration,
        what: &str,
        check: impl Fn(&StatusReply) -> bool,
    ) -> StatusReply {
        let deadline = Instant::now() + within;
        loop {
            let status = self.status(id).await;
            if let Some(status) = status.as_ref().filter(|s| check(s)) {
                return status.clone();
            }
            assert!(
                Instant::now() < deadline,
                "node {id}: {what} not within {within:?}; last status {status:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Starts (or restarts) node `id`, appending to its log.
    pub fn spawn(&mut self, id: u64) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path(id))
            .unwrap();
        let child = Command::new(&self.bin)
            .args(self.args(id))
            .env("RUST_LOG", "info,openraft=warn")
            .envs(self.env.iter().map(|(k, v)| {
                let dir = self.data_dir(id).display().to_string();
                (k.clone(), v.replace("{dir}", &dir))
            }))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("spawn node");
        self.children.insert(id, child);
    }

    pub fn signal(&self, id: u64, signal: &str) {
        if let Some(child) = self.children.get(&id) {
            let status = Command::new("kill")
                .args([signal, &child.id().to_string()])
                .status()
                .unwrap();
            assert!(status.success(), "kill {signal} {id}");
        }
    }

    /// SIGKILL and reap.
    pub fn kill(&mut self, id: u64) {
        if let Some(mut child) = self.children.remove(&id) {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM; waits (bounded) for the exit and returns its status.
    pub fn terminate(&mut self, id: u64) -> ExitStatus {
        self.signal(id, "-TERM");
        let mut child = self.children.remove(&id).expect("running");
        let deadline = std::time::Instant::now() + Duration::from_secs(15);
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status;
            }
            if std::time::Instant::now() > deadline {
                let _ = child.kill();
                panic!("node {id} did not exit after SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn pause(&self, id: u64) {
        self.signal(id, "-STOP");
    }

    pub fn resume(&self, id: u64) {
        self.signal(id, "-CONT");
    }

    /// Every proxied link, gRPC and data, by `(from, to)`.
    fn links(&self) -> impl Iterator<Item = (&(u64, u64), &Proxy)> {
        self.proxies.iter().chain(self.data_proxies.iter())
    }

    /// Cuts node `id` off from every peer, both ways (proxied clusters).
    pub fn isolate(&self, id: u64, cut: bool) {
        for ((from, to), proxy) in self.links() {
            if *from == id || *to == id {
                proxy.set_blocked(cut);
            }
        }
    }

    /// Cuts (or restores) only the data link (replica service) from `from`
    /// to `to`: Raft between them goes on.
    pub fn block_data(&self, from: u64, to: u64, cut: bool) {
        if let Some(proxy) = self.data_proxies.get(&(from, to)) {
            proxy.set_blocked(cut);
        }
    }

    /// Cuts (or restores) what `from` sends to `to`, gRPC and data alike.
    pub fn block(&self, from: u64, to: u64, cut: bool) {
        for (link, proxy) in self.links() {
            if *link == (from, to) {
                proxy.set_blocked(cut);
            }
        }
    }

    /// Cuts (or restores) the link between `a` and `b`, both ways.
    pub fn cut_link(&self, a: u64, b: u64, cut: bool) {
        for ((from, to), proxy) in self.links() {
            if (*from, *to) == (a, b) || (*from, *to) == (b, a) {
                proxy.set_blocked(cut);
            }
        }
    }

    /// Node `id`'s status, if it answers within 500 ms.
    /// The volume as node `id`'s replica service expects it named: this
    /// cluster's volume, in the incarnation of node `id`'s data dir (S8).
    /// Waits (up to 10 s) for the node to answer.
    pub async fn volume_ref(&self, id: u64) -> replica_ha::proto::replica::VolumeRef {
        // The configured volume: the cluster group's.
        self.volume_ref_of(id, "vol0", 0).await
    }

    /// [`Cluster::volume_ref`] for volume `name` of Raft group `group`.
    pub async fn volume_ref_of(
        &self,
        id: u64,
        name: &str,
        group: u64,
    ) -> replica_ha::proto::replica::VolumeRef {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = self.status(id).await {
                return replica_ha::proto::replica::VolumeRef {
                    cluster_id: self.cluster_id.clone(),
                    volume: name.into(),
                    incarnation: status.incarnation,
                    group,
                };
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "node {id} did not answer status"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub async fn status(&self, id: u64) -> Option<StatusReply> {
        let mut client = self.admin(id);
        let mut request = tonic::Request::new(StatusRequest {});
        request.set_timeout(Duration::from_millis(500));
        let call = client.status(request);
        match tokio::time::timeout(Duration::from_millis(700), call).await {
            Ok(Ok(reply)) => Some(reply.into_inner()),
            _ => None,
        }
    }

    /// Writes through node `id`'s gate (as an NBD client would).
    pub async fn write(
        &self,
        id: u64,
        offset: u64,
        data: bytes::Bytes,
    ) -> Result<(), tonic::Status> {
        let mut client = self.admin(id);
        let mut request = tonic::Request::new(WriteRequest {
            offset,
            data,
            fua: true,
        });
        request.set_timeout(Duration::from_secs(5));
        client.write(request).await.map(|_| ())
    }

    /// Reads through node `id`.
    pub async fn read(
        &self,
        id: u64,
        offset: u64,
        length: u32,
    ) -> Result<bytes::Bytes, tonic::Status> {
        let mut client = self.admin(id);
        let mut request = tonic::Request::new(ReadRequest { offset, length });
        request.set_timeout(Duration::from_secs(5));
        client.read(request).await.map(|r| r.into_inner().data)
    }

    /// Waits until exactly one of `among` is the active writer (role leader,
    /// gate open) and returns it with its term.
    /// The BLAKE3 digests of node `id`'s replica, one per extent, over
    /// `[offset, offset + length)`, asked of its replica service.
    pub async fn digests(&self, id: u64, offset: u64, length: u64) -> Vec<bytes::Bytes> {
        use replica_ha::proto::replica as pb;
        let volume = self.volume_ref(id).await;
        let mut client = pb::replica_client::ReplicaClient::new(self.peer_channel(id));
        let reply = client
            .digest(pb::DigestRequest {
                volume: Some(volume),
                offset,
                length,
            })
            .await
            .unwrap()
            .into_inner();
        reply.digests
    }

    /// The members whose missed-write maps node `id`'s replica keeps open,
    /// asked of its replica service.
    pub async fn missed_maps(&self, id: u64) -> Vec<u64> {
        use replica_ha::proto::replica as pb;
        let volume = self.volume_ref(id).await;
        let mut client = pb::replica_client::ReplicaClient::new(self.peer_channel(id));
        let reply = client
            .missed_maps(pb::MissedMapsRequest {
                volume: Some(volume),
            })
            .await
            .unwrap()
            .into_inner();
        reply.maps.iter().map(|m| m.node).collect()
    }

    /// Waits until node `id` has taken `more` writes beyond those it had
    /// taken when called (a client is writing through it by then).
    pub async fn wait_for_writes(&self, id: u64, more: u64, within: Duration) {
        let taken = || async { self.status(id).await.map_or(0, |s| s.writes_total) };
        let start = taken().await;
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let now = taken().await;
            if now >= start + more {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "node {id} took {} writes in {within:?}, not {more}",
                now - start
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The in-sync set as `writer` reports it (empty if it does not answer).
    pub async fn in_sync(&self, writer: u64) -> Vec<u64> {
        match self.status(writer).await {
            Some(status) => status
                .in_sync
                .iter()
                .map(|id| id.parse().unwrap())
                .collect(),
            None => Vec::new(),
        }
    }

    /// Waits until `writer` reports `id` in sync (or out of sync, `want`).
    pub async fn wait_in_sync(&self, writer: u64, id: u64, want: bool, within: Duration) {
        let deadline = tokio::time::Instant::now() + within;
        while self.in_sync(writer).await.contains(&id) != want {
            assert!(
                tokio::time::Instant::now() < deadline,
                "node {id} in sync = {} after {within:?}: {:?}",
                !want,
                self.status(writer).await
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub async fn wait_for_writer(&self, among: &[u64], within: Duration) -> (u64, u64) {
        let deadline = Instant::now() + within;
        loop {
            let mut writers = Vec::new();
            let mut seen = Vec::new();
            for id in among {
                if let Some(status) = self.status(*id).await {
                    if status.role == "leader" && status.gate_open {
                        writers.push((status.node_id, status.term));
                    }
                    seen.push(status);
                }
            }
            if let [writer] = writers.as_slice() {
                return *writer;
            }
            assert!(
                Instant::now() < deadline,
                "no single writer among {among:?} within {within:?}: {seen:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Creates each volume of `names` (4 MiB, 3 copies) through the
    /// volume table and waits until each has a writer: the configured
    /// volume is then not the only one on the cluster.
    pub async fn add_volumes(&self, names: &[&str], within: Duration) {
        let ids: Vec<u64> = self.addrs.keys().copied().collect();
        for name in names {
            let (ok, out, err) = self
                .cli(ids[0], &["volume", "create", name, "--size", "4MiB"])
                .await;
            assert!(ok, "volume create {name}: {out} {err}");
        }
        for name in names {
            self.wait_volume_writer(&ids, name, within).await;
        }
    }

    /// The writer of table volume `name` once every node of `among` names
    /// the same one and it says it writes it now; polls until then.
    pub async fn wait_volume_writer(&self, among: &[u64], name: &str, within: Duration) -> u64 {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let mut seen = Vec::new();
            for id in among {
                let (ok, out, _) = self.cli(*id, &["volume", "list"]).await;
                let writer = out
                    .lines()
                    .map(|line| line.split_whitespace().collect::<Vec<_>>())
                    .find(|words| ok && words.first() == Some(&name))
                    .and_then(|words| words.get(6).and_then(|w| w.parse::<u64>().ok()));
                seen.push(writer);
            }
            if let Some(Some(writer)) = seen.first().copied() {
                let (_, shown, _) = self.cli(writer, &["volume", "show", name]).await;
                if seen.iter().all(|w| *w == Some(writer))
                    && shown.contains("this node writes it now")
                {
                    return writer;
                }
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no agreed writer of {name}: {seen:?}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Waits until exactly one of `among` holds a lease and every other
    /// answering node in `among` names it leader in the same term.
    pub async fn wait_for_leader(&self, among: &[u64], within: Duration) -> (u64, u64) {
        let deadline = Instant::now() + within;
        loop {
            let mut replies = Vec::new();
            for id in among {
                if let Some(reply) = self.status(*id).await {
                    replies.push(reply);
                }
            }
            let leaders: Vec<_> = replies.iter().filter(|r| r.is_self).collect();
            if let [leader] = leaders.as_slice() {
                let agreed = replies
                    .iter()
                    .all(|r| r.leader == leader.node_id && r.term == leader.term);
                if agreed && replies.len() == among.len() {
                    return (leader.node_id, leader.term);
                }
            }
            assert!(
                Instant::now() < deadline,
                "no agreed leader among {among:?} within {within:?}: {replies:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // The nodes go first: whatever happens below, none outlives us.
        for (_, mut child) in std::mem::take(&mut self.children) {
            let _ = Command::new("kill")
                .args(["-CONT", &child.id().to_string()])
                .status();
            let _ = child.kill();
            let _ = child.wait();
        }
        if std::thread::panicking() {
            // The failing test's evidence: every node's log, on stderr. A
            // stderr that is gone (a closed pipe) must not panic here: a
            // panic while unwinding aborts, and the data dir would stay.
            use std::io::Write;
            let mut stderr = std::io::stderr();
            for id in &self.ids {
                let _ = writeln!(stderr, "===== node {id} log =====\n{}", self.log(*id));
            }
        }
    }
}

/// Makes a cluster's certificates in `<dir>/certs`: the CA, one per node of
/// `ids`, and the clients `admin`, `user` and `viewer`.
pub fn make_certs(dir: &std::path::Path, cluster_id: &str, ids: &[u64]) -> PathBuf {
    use replica_ha::certs::{self, Role};
    let certs = dir.join("certs");
    certs::init(&certs, cluster_id, 60, false).expect("a CA");
    for id in ids {
        certs::issue_node(&certs, replica_ha::ids::NodeId(*id), &[], 30)
            .expect("a node certificate");
    }
    certs::issue_client(&certs, "admin", Role::Admin, 30).expect("the admin certificate");
    certs::issue_client(&certs, "user", Role::User, 30).expect("the user certificate");
    certs::issue_client(&certs, "viewer", Role::Viewer, 30).expect("the viewer certificate");
    certs
}

/// A client transport that presents client `name`'s certificate from
/// `certs`.
pub fn client_transport(certs: &std::path::Path, name: &str) -> replica_ha::net::Transport {
    let files = replica_ha::certs::TlsFiles::for_client(certs, name);
    let ca = std::fs::read(files.ca()).expect("ca.crt");
    let cluster = replica_ha::certs::cluster_id_of_ca(&ca).expect("a CA certificate");
    let tls = replica_ha::net::Tls::load(files, &cluster, replica_ha::net::tls::Party::Client)
        .expect("client credentials");
    replica_ha::net::Transport::secured(replica_ha::net::Limits::default(), tls)
}
