//! S9, only members speak: mutual TLS against real nodes.
//!
//! Every test cluster runs with TLS (see `common::cluster`); these tests
//! attack it as an outsider would, with the same calls that wrote foreign
//! bytes into every replica and bricked the fence floors before TLS, and
//! check that nothing changed. They also check the roles, the sender a
//! certificate may claim, start-up refusals, certificate rotation on
//! SIGHUP, and NBD over TLS with real clients.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use common::cluster::{BIN, Cluster, client_transport, make_certs, one_cluster_at_a_time};
use replica_ha::certs::TlsFiles;
use replica_ha::ids::{NodeId, Term};
use replica_ha::nbd::client as nbd_client;
use replica_ha::nbd::wire as nbd_wire;
use replica_ha::net::{Expect, Limits, Tls, Transport, tls::Party};
use replica_ha::proto::admin::admin_client::AdminClient;
use replica_ha::proto::admin::{StatusRequest, TransferRequest, WriteRequest};
use replica_ha::proto::raft::RaftMessage;
use replica_ha::proto::raft::raft_client::RaftClient;
use replica_ha::proto::replica as pb;
use replica_ha::proto::replica::replica_client::ReplicaClient;
use replica_ha::replica::Stamp;
use tokio::time::Instant;
use tonic::Code;
use tonic::transport::Channel;

const WAIT: Duration = Duration::from_secs(20);
const CALL: Duration = Duration::from_secs(3);
const TOOL_LIMIT: Duration = Duration::from_secs(120);

fn block(byte: u8, len: usize) -> Bytes {
    Bytes::from(vec![byte; len])
}

/// The volume as node `id`'s replica expects it named (its incarnation
/// included), so that only what the test is about can refuse a request.
async fn volume(cluster: &Cluster, id: u64) -> Option<pb::VolumeRef> {
    Some(cluster.volume_ref(id).await)
}

fn timed<T>(message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.set_timeout(CALL);
    request
}

/// What a replica holds that an attacker would want to change: its fence
/// floor, its dirty marks and (a digest of) its first 64 KiB.
#[derive(Debug, PartialEq, Eq)]
struct Held {
    floor: u64,
    dirty: u64,
    head: String,
}

async fn held(cluster: &Cluster, id: u64) -> Held {
    let mut client = ReplicaClient::new(cluster.peer_channel(id));
    let status = client
        .status(timed(pb::StatusRequest {
            volume: volume(cluster, id).await,
        }))
        .await
        .expect("replica status")
        .into_inner();
    let head = cluster
        .block_client(id)
        .await
        .read(0, 64 * 1024)
        .await
        .expect("replica read");
    let head = blake3::hash(&head).to_hex().to_string();
    Held {
        floor: status.floor,
        dirty: status.dirty_extents,
        head,
    }
}

/// A write over node `id`'s block channel, through `transport`, with a
/// term far above any floor and meant for the node's incarnation as it is
/// now (S8), so that only the credentials can be what refuses it.
async fn block_write(cluster: &Cluster, id: u64, transport: &Transport) -> Result<(), String> {
    let incarnation = volume(cluster, id).await.unwrap().incarnation;
    let client = common::blocks::BlockClient::connect(
        transport,
        &cluster.data_addrs[&id].to_string(),
        Expect::AnyNode,
        &cluster.cluster_id,
        incarnation,
    )
    .await
    .map_err(|err| err.to_string())?;
    client
        .write(Stamp::from(Term(1 << 40)), 0, block(0xee, 64 * 1024), true)
        .await
        .map_err(|err| err.to_string())
}

/// Every call that did harm before TLS, from whoever holds `channel`;
/// returns the outcome of each, by name.
async fn attack(
    cluster: &Cluster,
    id: u64,
    channel: Channel,
) -> Vec<(&'static str, Result<(), tonic::Status>)> {
    let mut replica = ReplicaClient::new(channel.clone());
    let mut raft = RaftClient::new(channel.clone());
    let mut admin = AdminClient::new(channel.clone());
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    let huge = 1u64 << 40;
    // Meant for the node as it is now (S8), so that only the attacker's
    // credentials can be what refuses.
    let member = cluster.status(id).await.expect("status").member;
    let mut outcomes = Vec::new();
    outcomes.push((
        "replica fence",
        replica
            .fence(timed(pb::FenceRequest {
                volume: volume(cluster, id).await,
                term: 1 << 62,
            }))
            .await
            .map(|_| ()),
    ));
    outcomes.push((
        "replica clear dirty",
        replica
            .clear_dirty(timed(pb::ClearDirtyRequest {
                volume: volume(cluster, id).await,
                term: huge,
            }))
            .await
            .map(|_| ()),
    ));
    outcomes.push((
        "raft vote",
        raft.vote(timed(RaftMessage {
            cluster_id: cluster.cluster_id.clone(),
            from: 2,
            payload: Bytes::from_static(b"{}"),
            to: member,
            group: 0,
        }))
        .await
        .map(|_| ()),
    ));
    outcomes.push((
        "admin transfer",
        admin
            .transfer_leader(timed(TransferRequest {
                to: 2,
                ..Default::default()
            }))
            .await
            .map(|_| ()),
    ));
    outcomes.push((
        "admin status",
        admin.status(timed(StatusRequest {})).await.map(|_| ()),
    ));
    outcomes.push((
        "health",
        health
            .check(timed(tonic_health::pb::HealthCheckRequest {
                service: String::new(),
            }))
            .await
            .map(|_| ()),
    ));
    outcomes
}

/// S9 against outsiders: a plaintext client, and clients and a node whose
/// certificates come from another CA (of a cluster with the very same
/// id), are refused by every service of every node; every replica's floor,
/// marks and data are what they were, and the cluster still writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strangers_are_refused_by_every_service_and_change_nothing() {
    let _serial = one_cluster_at_a_time().await;
    let cluster = Cluster::start(3).await;
    let (writer, _) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    cluster
        .write(writer, 0, block(0x5a, 64 * 1024))
        .await
        .expect("an honest write");
    // The writer retires the write's marks during its term: wait for that,
    // so that what is held stays put unless someone changes it.
    let deadline = Instant::now() + WAIT;
    for id in &cluster.ids {
        while held(&cluster, *id).await.dirty > 0 {
            assert!(Instant::now() < deadline, "node {id} keeps its marks");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let mut before = Vec::new();
    for id in &cluster.ids {
        before.push(held(&cluster, *id).await);
    }

    let elsewhere = tempfile::tempdir().unwrap();
    let foreign = make_certs(elsewhere.path(), &cluster.cluster_id, &[1, 2, 3]);
    let foreign_node = Transport::secured(
        Limits::default(),
        Tls::load(
            replica_ha::certs::TlsFiles::for_node(&foreign, NodeId(2)),
            &cluster.cluster_id,
            Party::Node(NodeId(2)),
        )
        .unwrap(),
    );
    let attackers = [
        ("plaintext", Transport::plain(Limits::default())),
        ("another CA's admin", client_transport(&foreign, "admin")),
        ("another CA's node 2", foreign_node),
    ];
    for (who, transport) in &attackers {
        for id in &cluster.ids {
            for addr in [cluster.addrs[id], cluster.data_addrs[id]] {
                let channel = transport
                    .channel(&addr.to_string(), Expect::AnyNode)
                    .unwrap();
                for (call, outcome) in attack(&cluster, *id, channel).await {
                    assert!(
                        outcome.is_err(),
                        "{who}: {call} on node {id} at {addr} was not refused"
                    );
                }
            }
        }
    }

    // The block channel on each data listener: strangers, and this
    // cluster's own admin client (a client certificate is not a node's).
    let own_admin = client_transport(&cluster.certs, "admin");
    for (who, transport) in attackers
        .iter()
        .chain([&("this cluster's admin", own_admin)])
    {
        for id in &cluster.ids {
            let outcome = block_write(&cluster, *id, transport).await;
            assert!(
                outcome.is_err(),
                "{who}: a block-channel write on node {id} was not refused"
            );
        }
    }

    for (id, before) in cluster.ids.iter().zip(before) {
        assert_eq!(held(&cluster, *id).await, before, "node {id} changed");
    }
    let (still, _) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    cluster
        .write(still, 4096, block(0x6b, 4096))
        .await
        .expect("the cluster still writes");
    assert_eq!(
        cluster.read(still, 4096, 4096).await.unwrap(),
        block(0x6b, 4096)
    );
}

/// S9 among members: a node's certificate speaks only for that node, and a
/// client's never for a node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_speaks_only_for_whom_it_names() {
    let _serial = one_cluster_at_a_time().await;
    let cluster = Cluster::start(3).await;
    cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    let as_node_2 = Transport::secured(
        Limits::default(),
        Tls::load(
            replica_ha::certs::TlsFiles::for_node(&cluster.certs, NodeId(2)),
            &cluster.cluster_id,
            Party::Node(NodeId(2)),
        )
        .unwrap(),
    );
    let to_node_1 = as_node_2
        .channel(&cluster.addrs[&1].to_string(), Expect::Node(NodeId(1)))
        .unwrap();
    let mut raft = RaftClient::new(to_node_1.clone());
    let member_1 = cluster.status(1).await.expect("status").member;
    let claim = |from: u64| RaftMessage {
        cluster_id: cluster.cluster_id.clone(),
        from,
        payload: Bytes::from_static(b"{}"),
        to: member_1,
        group: 0,
    };
    let vote = raft.vote(timed(claim(3))).await.unwrap_err();
    assert_eq!(vote.code(), Code::PermissionDenied, "{vote:?}");
    assert!(vote.message().contains("claims node 3"), "{vote:?}");
    let append = raft.append_entries(timed(claim(3))).await.unwrap_err();
    assert_eq!(append.code(), Code::PermissionDenied, "{append:?}");
    // Speaking as itself it gets past the check to the payload, which is
    // not a Raft message.
    let honest = raft.vote(timed(claim(2))).await.unwrap_err();
    assert_eq!(honest.code(), Code::InvalidArgument, "{honest:?}");
    // A Raft group the node does not run is refused, but only once the
    // sender was admitted: a false claim learns nothing of the groups.
    let in_group = |from: u64| RaftMessage {
        group: 7,
        ..claim(from)
    };
    let elsewhere = raft.vote(timed(in_group(2))).await.unwrap_err();
    assert_eq!(elsewhere.code(), Code::NotFound, "{elsewhere:?}");
    assert!(
        elsewhere.message().contains("no Raft group 7"),
        "{elsewhere:?}"
    );
    let false_claim = raft.append_entries(timed(in_group(3))).await.unwrap_err();
    assert_eq!(
        false_claim.code(),
        Code::PermissionDenied,
        "{false_claim:?}"
    );

    // Replica requests carry no sender: a node certificate is what they
    // need, and a client's is refused, even an admin's.
    let floor = held(&cluster, 1).await.floor;
    let admin_to_data = client_transport(&cluster.certs, "admin")
        .channel(&cluster.data_addrs[&1].to_string(), Expect::Node(NodeId(1)))
        .unwrap();
    let mut replica = ReplicaClient::new(admin_to_data);
    let refused = replica
        .fence(timed(pb::FenceRequest {
            volume: volume(&cluster, 1).await,
            term: floor + 100,
        }))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    assert!(
        refused.message().contains("node certificate"),
        "{refused:?}"
    );
    assert_eq!(held(&cluster, 1).await.floor, floor);
    let mut raft_as_client = RaftClient::new(cluster.channel(1));
    let refused = raft_as_client.vote(timed(claim(2))).await.unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");

    // A node certificate of the cluster's CA, but of no member, is refused
    // by the members' services.
    replica_ha::certs::issue_node(&cluster.certs, NodeId(4), &[], 20).unwrap();
    let as_node_4 = Transport::secured(
        Limits::default(),
        Tls::load(
            replica_ha::certs::TlsFiles::for_node(&cluster.certs, NodeId(4)),
            &cluster.cluster_id,
            Party::Node(NodeId(4)),
        )
        .unwrap(),
    );
    let outsider = as_node_4
        .channel(&cluster.addrs[&1].to_string(), Expect::Node(NodeId(1)))
        .unwrap();
    let outsider_data = as_node_4
        .channel(&cluster.data_addrs[&1].to_string(), Expect::Node(NodeId(1)))
        .unwrap();
    let refused = ReplicaClient::new(outsider_data)
        .fence(timed(pb::FenceRequest {
            volume: volume(&cluster, 1).await,
            term: floor + 100,
        }))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    assert!(refused.message().contains("not a member"), "{refused:?}");
    let refused = RaftClient::new(outsider)
        .vote(timed(claim(4)))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    assert_eq!(held(&cluster, 1).await.floor, floor);

    // A client dialling node 1 but reaching another node notices: the
    // server's certificate names node 2.
    let wrong = client_transport(&cluster.certs, "admin")
        .channel(&cluster.addrs[&2].to_string(), Expect::Node(NodeId(1)))
        .unwrap();
    let status = AdminClient::new(wrong)
        .status(timed(StatusRequest {}))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
}

/// Roles: `viewer` reads status but cannot transfer leadership or write;
/// `admin` can. The CLI says why in one line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_viewer_reads_status_and_only_an_admin_changes_things() {
    let _serial = one_cluster_at_a_time().await;
    let cluster = Cluster::start(3).await;
    let (writer, _) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    let target = [1, 2, 3].into_iter().find(|id| *id != writer).unwrap();
    let viewer = client_transport(&cluster.certs, "viewer");
    let mut as_viewer = AdminClient::new(
        viewer
            .channel(&cluster.addrs[&writer].to_string(), Expect::AnyNode)
            .unwrap(),
    );
    let status = as_viewer
        .status(timed(StatusRequest {}))
        .await
        .expect("a viewer reads status")
        .into_inner();
    assert_eq!(status.security, "mutual TLS");
    let refused = as_viewer
        .transfer_leader(timed(TransferRequest {
            to: target,
            ..Default::default()
        }))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    let refused = as_viewer
        .write(timed(WriteRequest {
            offset: 0,
            data: block(1, 4096),
            fua: false,
        }))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");

    let addr = cluster.addrs[&writer].to_string();
    let to = target.to_string();
    let mut args = vec!["transfer", "--addr", &addr, "--to", &to];
    let viewer_flags = cluster.cli_tls("viewer");
    args.extend(viewer_flags.iter().map(String::as_str));
    let out = Command::new(BIN).args(&args).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("needs an admin certificate"), "{stderr}");

    let mut args = vec!["transfer", "--addr", &addr, "--to", &to];
    let admin_flags = cluster.cli_tls("admin");
    args.extend(admin_flags.iter().map(String::as_str));
    let out = Command::new(BIN).args(&args).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (now, _) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    assert_eq!(now, target);
}

fn start_error(args: &[String]) -> (Option<i32>, String) {
    let out = Command::new(BIN).args(args).output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A node without usable certificates does not start: exit code 2 and one
/// line that names the file.
#[test]
fn a_node_without_usable_certificates_stops_with_one_line() {
    let cluster = Cluster::new(1);
    let mut args = cluster.args(1);
    let at = args.iter().position(|a| a == "--tls-dir").unwrap();
    args.drain(at..at + 2);
    let with = |extra: &[&str]| {
        let mut args = args.clone();
        args.extend(extra.iter().map(|s| s.to_string()));
        args
    };
    let path = |p: &Path| p.display().to_string();

    let (code, stderr) = start_error(&args);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("--insecure"), "{stderr}");

    let empty = cluster.dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let other = cluster.dir.path().join("other");
    let other = make_certs(&other, "another-cluster", &[1]);
    let expired = cluster.dir.path().join("expired");
    let expired = make_certs(&expired, &cluster.cluster_id, &[]);
    let now = time::OffsetDateTime::now_utc();
    replica_ha::certs::issue_node_with_validity(
        &expired,
        NodeId(1),
        &[],
        now - time::Duration::days(30),
        now - time::Duration::days(1),
    )
    .unwrap();
    let cases: Vec<(Vec<String>, PathBuf, &str)> = vec![
        (
            with(&["--tls-dir", &path(&empty)]),
            empty.join("ca.crt"),
            "not found",
        ),
        (
            with(&["--tls-dir", &path(&other)]),
            other.join("ca.crt"),
            "another-cluster",
        ),
        (
            with(&[
                "--tls-dir",
                &path(&cluster.certs),
                "--tls-cert",
                &path(&cluster.certs.join("admin.crt")),
                "--tls-key",
                &path(&cluster.certs.join("admin.key")),
            ]),
            cluster.certs.join("admin.crt"),
            "not of node 1",
        ),
        (
            with(&["--tls-dir", &path(&expired)]),
            expired.join("node-1.crt"),
            "expired",
        ),
    ];
    for (args, file, expected) in cases {
        let (code, stderr) = start_error(&args);
        assert_eq!(code, Some(2), "{expected}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
        assert!(stderr.contains(&path(&file)), "{expected}: {stderr}");
        assert!(stderr.contains(expected), "{expected}: {stderr}");
    }
}

/// The certificate a server presents to a client that trusts `certs`' CA
/// and shows its `admin` certificate.
async fn presented(certs: &Path, addr: std::net::SocketAddr) -> Vec<u8> {
    use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime, pem::PemObject};

    #[derive(Debug)]
    struct Record(Mutex<Option<Vec<u8>>>, Arc<rustls::crypto::CryptoProvider>);
    impl ServerCertVerifier for Record {
        fn verify_server_cert(
            &self,
            end_entity: &CertificateDer<'_>,
            _: &[CertificateDer<'_>],
            _: &ServerName<'_>,
            _: &[u8],
            _: UnixTime,
        ) -> Result<ServerCertVerified, rustls::Error> {
            *self.0.lock().unwrap() = Some(end_entity.to_vec());
            Ok(ServerCertVerified::assertion())
        }
        fn verify_tls12_signature(
            &self,
            m: &[u8],
            c: &CertificateDer<'_>,
            d: &rustls::DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            rustls::crypto::verify_tls12_signature(
                m,
                c,
                d,
                &self.1.signature_verification_algorithms,
            )
        }
        fn verify_tls13_signature(
            &self,
            m: &[u8],
            c: &CertificateDer<'_>,
            d: &rustls::DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            rustls::crypto::verify_tls13_signature(
                m,
                c,
                d,
                &self.1.signature_verification_algorithms,
            )
        }
        fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
            self.1.signature_verification_algorithms.supported_schemes()
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let record = Arc::new(Record(Mutex::new(None), Arc::clone(&provider)));
    let chain: Vec<_> = CertificateDer::pem_file_iter(certs.join("admin.crt"))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_file(certs.join("admin.key")).unwrap();
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(record.clone())
        .with_client_auth_cert(chain, key)
        .unwrap();
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = ServerName::try_from("127.0.0.1").unwrap();
    let _ = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await;
    record
        .0
        .lock()
        .unwrap()
        .clone()
        .expect("a server certificate")
}

fn der_of(path: &Path) -> Vec<u8> {
    use rustls::pki_types::{CertificateDer, pem::PemObject};
    CertificateDer::from_pem_file(path).unwrap().to_vec()
}

/// Rotation: after SIGHUP with a newly issued node certificate, the node
/// keeps serving, connections made before go on working, and new ones are
/// shown the new certificate. A reload that fails keeps the old one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_rotates_the_node_certificate_without_downtime() {
    let _serial = one_cluster_at_a_time().await;
    let cluster = Cluster::start(3).await;
    let (writer, _) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    let node = writer;
    let addr = cluster.addrs[&node];
    let old = der_of(&cluster.certs.join(format!("node-{node}.crt")));
    assert_eq!(presented(&cluster.certs, addr).await, old);
    let mut established = cluster.admin(node);
    established
        .status(timed(StatusRequest {}))
        .await
        .expect("status before");

    replica_ha::certs::issue_node(&cluster.certs, NodeId(node), &[], 20).unwrap();
    let new = der_of(&cluster.certs.join(format!("node-{node}.crt")));
    assert_ne!(new, old);
    cluster.signal(node, "-HUP");
    let deadline = Instant::now() + Duration::from_secs(10);
    while presented(&cluster.certs, addr).await != new {
        assert!(
            Instant::now() < deadline,
            "node {node} still shows the old certificate"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    established
        .status(timed(StatusRequest {}))
        .await
        .expect("a connection made before the reload still works");
    cluster
        .write(node, 0, block(3, 4096))
        .await
        .expect("the node still writes, its peers reconnecting with the new certificate");
    assert!(cluster.log(node).contains("reloaded the certificates"));

    // A broken key: the reload fails, says so, and the node goes on with
    // the certificate it had.
    std::fs::write(cluster.certs.join(format!("node-{node}.key")), b"garbage").unwrap();
    cluster.signal(node, "-HUP");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cluster.log(node).contains("reload failed") {
        assert!(Instant::now() < deadline, "no word of the failed reload");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(presented(&cluster.certs, addr).await, new);
    cluster
        .write(node, 4096, block(4, 4096))
        .await
        .expect("still serving");
}

/// The files qemu and libnbd (GnuTLS) read from a `tls-certificates` or
/// `tls-creds-x509` directory, for client `name` (or none).
fn gnutls_dir(cluster: &Cluster, name: Option<&str>) -> PathBuf {
    let dir = cluster
        .dir
        .path()
        .join(format!("gnutls-{}", name.unwrap_or("anonymous")));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(cluster.certs.join("ca.crt"), dir.join("ca-cert.pem")).unwrap();
    if let Some(name) = name {
        std::fs::copy(
            cluster.certs.join(format!("{name}.crt")),
            dir.join("client-cert.pem"),
        )
        .unwrap();
        std::fs::copy(
            cluster.certs.join(format!("{name}.key")),
            dir.join("client-key.pem"),
        )
        .unwrap();
    }
    dir
}

async fn run(program: &str, args: &[&str]) -> std::process::Output {
    common::tools::run_within(program, args, TOOL_LIMIT).await
}

async fn run_ok(program: &str, args: &[&str]) -> String {
    common::tools::run_ok_within(program, args, TOOL_LIMIT).await
}

fn sha256(path: &Path) -> String {
    let output = Command::new("sha256sum").arg(path).output().unwrap();
    String::from_utf8_lossy(&output.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

/// NBD with `nbd_tls = "require"`: nbdinfo, nbdcopy and qemu-io work over
/// TLS unmodified, a 64 MiB image round-trips with the same checksum, and
/// a plaintext client is told TLS is required.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nbd_over_tls_serves_real_clients_and_refuses_plaintext() {
    let _serial = one_cluster_at_a_time().await;
    let cluster = Cluster::start_with(3, &["--size", "64MiB", "--nbd-tls", "require"]).await;
    let (writer, _) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    let nbd = cluster.nbd_addrs[&writer];
    let creds = gnutls_dir(&cluster, Some("user"));
    let secure = format!("nbds://{nbd}/vol0?tls-certificates={}", creds.display());

    // A plaintext client is refused (nbdinfo words it as nbdkit's
    // refusal: "operation not supported"), with NBD_REP_ERR_TLS_REQD on
    // the wire.
    let plain = run("nbdinfo", &[&format!("nbd://{nbd}/vol0")]).await;
    assert!(!plain.status.success());
    assert_eq!(plaintext_go_reply(nbd).await, 0x8000_0005);

    let info = run_ok("nbdinfo", &[&secure]).await;
    assert!(info.contains("67108864"), "{info}");

    let image = cluster.dir.path().join("in.img");
    let back = cluster.dir.path().join("out.img");
    let mut data = vec![0u8; 64 << 20];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for chunk in data.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes());
    }
    std::fs::write(&image, &data).unwrap();
    run_ok("nbdcopy", &[image.to_str().unwrap(), &secure]).await;
    run_ok("nbdcopy", &[&secure, back.to_str().unwrap()]).await;
    assert_eq!(sha256(&image), sha256(&back));

    let (ok, text) = qemu_io_tls(
        nbd,
        &creds,
        false,
        &["write -P 0x3c 1M 64k", "read -P 0x3c 1M 64k"],
    )
    .await;
    assert!(ok, "{text}");
}

/// The reply type a plaintext `NBD_OPT_GO` for `vol0` gets from `addr`.
async fn plaintext_go_reply(addr: std::net::SocketAddr) -> u32 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut greeting = [0u8; 18];
    stream.read_exact(&mut greeting).await.unwrap();
    stream.write_all(&3u32.to_be_bytes()).await.unwrap();
    let mut option = Vec::new();
    option.extend_from_slice(b"IHAVEOPT");
    option.extend_from_slice(&7u32.to_be_bytes());
    option.extend_from_slice(&10u32.to_be_bytes());
    option.extend_from_slice(&4u32.to_be_bytes());
    option.extend_from_slice(b"vol0");
    option.extend_from_slice(&0u16.to_be_bytes());
    stream.write_all(&option).await.unwrap();
    let mut reply = [0u8; 20];
    stream.read_exact(&mut reply).await.unwrap();
    u32::from_be_bytes(reply[12..16].try_into().unwrap())
}

/// `nbd_client_auth`: a client without a certificate from the cluster CA
/// is refused in the TLS handshake; one with it is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nbd_client_certificates_are_required_when_asked_for() {
    let _serial = one_cluster_at_a_time().await;
    let cluster = Cluster::start_with(
        3,
        &[
            "--size",
            "16MiB",
            "--nbd-tls",
            "require",
            "--nbd-client-auth",
        ],
    )
    .await;
    let (writer, _) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    let nbd = cluster.nbd_addrs[&writer];
    let uri = |dir: &Path| format!("nbds://{nbd}/vol0?tls-certificates={}", dir.display());
    let anonymous = run("nbdinfo", &[&uri(&gnutls_dir(&cluster, None))]).await;
    assert!(
        !anonymous.status.success(),
        "{}",
        String::from_utf8_lossy(&anonymous.stdout)
    );
    let info = run_ok("nbdinfo", &[&uri(&gnutls_dir(&cluster, Some("admin")))]).await;
    assert!(info.contains("16777216"), "{info}");
}

/// The rustls configuration an NBD client of `cluster` uses to present
/// `files`' certificate as `party`.
fn nbd_tls_of(cluster: &Cluster, files: TlsFiles, party: Party) -> Arc<rustls::ClientConfig> {
    common::nbd_tls::client_config(cluster, files, party)
}

/// Opens `vol0` at `addr` over TLS with `config`.
async fn open_nbd(
    addr: std::net::SocketAddr,
    config: Arc<rustls::ClientConfig>,
) -> Result<nbd_client::Connection, nbd_client::ClientError> {
    common::nbd_tls::open(addr, config, CALL).await
}

/// Sends one 4 KiB write of `byte` at `offset` and returns its error code.
async fn nbd_write(connection: &mut nbd_client::Connection, offset: u64, byte: u8) -> u32 {
    common::nbd_tls::write(connection, offset, block(byte, 4096), CALL)
        .await
        .expect("a reply within 3 s")
}

/// qemu-io on `vol0` at `addr` over TLS with the files in `creds`,
/// opening it read-only with `read_only`; returns whether it succeeded and
/// all it said.
async fn qemu_io_tls(
    addr: std::net::SocketAddr,
    creds: &Path,
    read_only: bool,
    commands: &[&str],
) -> (bool, String) {
    let object = format!(
        "tls-creds-x509,id=tls0,dir={},endpoint=client",
        creds.display()
    );
    let target = format!(
        "driver=nbd,host={},port={},export=vol0,tls-creds=tls0",
        addr.ip(),
        addr.port()
    );
    let mut args = vec!["--object", &object, "--image-opts", &target];
    if read_only {
        args.push("-r");
    }
    for command in commands {
        args.extend(["-c", command]);
    }
    let out = run("qemu-io", &args).await;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let ok = out.status.success() && !text.contains("failed") && !text.contains("rror");
    (ok, text)
}

/// S9 on NBD (#36): what a certificate may do with the writer's export is
/// its role's. A viewer gets a read-only export and its writes are
/// refused; a certificate that names no identity, and the certificate of
/// a node removed from the membership, are refused with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nbd_serves_each_certificate_as_its_role_allows() {
    let _serial = one_cluster_at_a_time().await;
    let cluster = Cluster::start_with(3, &["--size", "16MiB", "--nbd-tls", "require"]).await;
    let (writer, _) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    let nbd = cluster.nbd_addrs[&writer];

    // A viewer reads; its export is read-only, and a write sent anyway is
    // refused with EPERM (qemu-io will not even try).
    let viewer = nbd_tls_of(
        &cluster,
        TlsFiles::for_client(&cluster.certs, "viewer"),
        Party::Client,
    );
    let mut session = open_nbd(nbd, Arc::clone(&viewer)).await.expect("served");
    assert_ne!(
        session.export.flags & nbd_wire::TFLAG_READ_ONLY,
        0,
        "a viewer's export must be read-only"
    );
    assert_eq!(nbd_write(&mut session, 0, 0x11).await, nbd_wire::EPERM);
    let creds = gnutls_dir(&cluster, Some("viewer"));
    let (wrote, text) = qemu_io_tls(nbd, &creds, false, &["write -P 0x11 0 64k"]).await;
    assert!(!wrote, "a viewer wrote through NBD: {text}");
    let (read, text) = qemu_io_tls(nbd, &creds, true, &["read -P 0 0 64k"]).await;
    assert!(read, "{text}");

    // A client whose role writes does: `user`, and `admin`.
    for (name, byte) in [("user", 0x22), ("admin", 0x23)] {
        let creds = gnutls_dir(&cluster, Some(name));
        let write = format!("write -P {byte} 0 64k");
        let read = format!("read -P {byte} 0 64k");
        let (wrote, text) = qemu_io_tls(nbd, &creds, false, &[&write, &read]).await;
        assert!(wrote, "{name}: {text}");
    }

    // A certificate of the CA that names nobody is refused, with the reason.
    replica_ha::certs::issue_unnamed(&cluster.certs, "nobody", 10).unwrap();
    let unnamed = replica_ha::net::tls::unchecked_client(&cluster.certs, Some("nobody")).unwrap();
    let refused = open_nbd(nbd, unnamed).await.err().expect("refused");
    assert!(
        refused.to_string().contains("names no node or client"),
        "{refused}"
    );

    // A node removed from the membership is refused as the replica
    // service refuses it.
    let removed = [1u64, 2, 3].into_iter().find(|id| *id != writer).unwrap();
    let member = nbd_tls_of(
        &cluster,
        TlsFiles::for_node(&cluster.certs, NodeId(removed)),
        Party::Node(NodeId(removed)),
    );
    let mut session = open_nbd(nbd, Arc::clone(&member))
        .await
        .expect("a member is served");
    assert_eq!(nbd_write(&mut session, 8192, 0x33).await, 0);
    let (ok, out, err) = cluster
        .cli(writer, &["members", "remove", "--id", &removed.to_string()])
        .await;
    assert!(ok, "members remove {removed}: {out}{err}");
    let deadline = Instant::now() + WAIT;
    loop {
        match open_nbd(nbd, Arc::clone(&member)).await {
            Err(refused) => {
                assert!(refused.to_string().contains("not a member"), "{refused}");
                break;
            }
            Ok(_) => assert!(
                Instant::now() < deadline,
                "node {removed} was removed and is still served"
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The session it opened before is closed too.
    let mut byte = [0u8; 1];
    let ended = tokio::time::timeout(WAIT, async {
        use tokio::io::AsyncReadExt;
        session.reader.read(&mut byte).await
    })
    .await
    .expect("the removed node's open session is closed");
    assert!(matches!(ended, Ok(0) | Err(_)), "{ended:?}");
}

/// Secure by default (#36): a writer whose NBD listener is bound beyond
/// loopback requires TLS and a client certificate unless `nbd_tls =
/// "off"` says otherwise, so a plaintext client can neither write nor
/// read, and a certificate that may write does. `nbd_tls = "off"` set
/// explicitly serves plaintext there, with a warning at start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nbd_beyond_loopback_refuses_plaintext_by_default() {
    let _serial = one_cluster_at_a_time().await;
    let mut cluster = Cluster::new(3);
    cluster.nbd_bind = Some(std::net::Ipv4Addr::UNSPECIFIED.into());
    for id in cluster.ids.clone() {
        cluster.spawn(id);
    }
    let (writer, _) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    let nbd = cluster.nbd_addrs[&writer];
    let uri = common::tools::uri(nbd);
    let write = run("qemu-io", &["-f", "raw", "-c", "write -P 0x44 0 64k", &uri]).await;
    let text = String::from_utf8_lossy(&write.stdout).to_string()
        + &String::from_utf8_lossy(&write.stderr);
    assert!(
        !write.status.success() || text.contains("failed"),
        "a plaintext client wrote to a writer listening on 0.0.0.0: {text}"
    );
    let read = run("nbdinfo", &[&uri]).await;
    assert!(
        !read.status.success(),
        "a plaintext client opened the export"
    );
    assert_eq!(plaintext_go_reply(nbd).await, 0x8000_0005);

    let creds = gnutls_dir(&cluster, Some("user"));
    let (wrote, text) = qemu_io_tls(
        nbd,
        &creds,
        false,
        &["write -P 0x44 0 64k", "read -P 0x44 0 64k"],
    )
    .await;
    assert!(wrote, "{text}");

    // `nbd_tls = "off"` asked for explicitly is the operator's choice: the
    // node serves plaintext beyond loopback and says so at start.
    let follower = [1u64, 2, 3].into_iter().find(|id| *id != writer).unwrap();
    cluster.kill(follower);
    cluster
        .extra_args
        .extend(["--nbd-tls".into(), "off".into()]);
    cluster.spawn(follower);
    let deadline = Instant::now() + WAIT;
    while !cluster
        .log(follower)
        .contains("NBD is PLAINTEXT beyond loopback")
    {
        assert!(Instant::now() < deadline, "no warning at start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let follower_nbd = cluster.nbd_addrs[&follower];
    while tokio::net::TcpStream::connect(follower_nbd).await.is_err() {
        assert!(Instant::now() < deadline, "node {follower} never listened");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_ne!(plaintext_go_reply(follower_nbd).await, 0x8000_0005);
}
