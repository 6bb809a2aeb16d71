//! An NBD client over TLS with a chosen certificate, for the tests that
//! check what each role may do through NBD (S9): `tls.rs`, and the fault
//! campaign's role-abuse client.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use replica_ha::certs::TlsFiles;
use replica_ha::nbd::client as nbd_client;
use replica_ha::nbd::wire as nbd_wire;
use replica_ha::net::{Expect, Tls, tls::Party};

use super::cluster::Cluster;

/// The rustls configuration an NBD client of `cluster` uses to present
/// `files`' certificate as `party`.
pub fn client_config(
    cluster: &Cluster,
    files: TlsFiles,
    party: Party,
) -> Arc<rustls::ClientConfig> {
    Tls::load(files, &cluster.cluster_id, party)
        .expect("the client's credentials")
        .client(Expect::AnyNode)
        .expect("a client configuration")
}

/// Opens `vol0` at `addr` over TLS with `config`, within `limit`.
pub async fn open(
    addr: std::net::SocketAddr,
    config: Arc<rustls::ClientConfig>,
    limit: Duration,
) -> Result<nbd_client::Connection, nbd_client::ClientError> {
    let addr = addr.to_string();
    let name = replica_ha::net::tls::server_name(&addr);
    match tokio::time::timeout(
        limit,
        nbd_client::connect(&addr, "vol0", Some((config, name))),
    )
    .await
    {
        Ok(outcome) => outcome,
        Err(_) => Err(nbd_client::ClientError::TimedOut {
            what: "NBD handshake",
            limit,
        }),
    }
}

/// Sends one write of `data` at `offset` and returns its error code, or
/// `None` if no reply came within `limit` (the server closed, or holds it).
pub async fn write(
    connection: &mut nbd_client::Connection,
    offset: u64,
    data: Bytes,
    limit: Duration,
) -> Option<u32> {
    use tokio::io::AsyncWriteExt;
    let request = nbd_wire::Request {
        flags: 0,
        command: nbd_wire::Command::Write,
        cookie: 7,
        offset,
        len: data.len() as u32,
    };
    nbd_client::send(&mut connection.writer, &request, Some(&data))
        .await
        .ok()?;
    connection.writer.flush().await.ok()?;
    let (error, cookie) = tokio::time::timeout(limit, nbd_client::receive(&mut connection.reader))
        .await
        .ok()?
        .ok()?;
    assert_eq!(cookie, 7, "a reply to a request never sent");
    Some(error)
}
