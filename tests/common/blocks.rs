//! A raw client of a replica's block channel, for tests that send what a
//! writer never would (a stale or zero term, another incarnation, a range
//! past the end, an oversized write) and look at what the replica answers.
//! Block I/O has one server, the block channel; this speaks its frames
//! directly, without the `RemoteReplica` that would check them first.

use std::time::Duration;

use bytes::Bytes;
use replica_ha::ids::GroupId;
use replica_ha::net::frame::{FUA, Header, Kind};
use replica_ha::net::link::{Link, LinkError};
use replica_ha::net::{Expect, Transport};
use replica_ha::replica::wire::from_refusal;
use replica_ha::replica::{ReplicaError, Stamp};

/// How long one call may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// A block-channel link and the incarnation its requests name (S8).
pub struct BlockClient {
    link: Link,
    incarnation: u64,
}

impl BlockClient {
    /// Opens a link to the block channel at `addr` (a node's data
    /// listener), for `cluster_id`'s volume `vol0` (group 0, the configured
    /// volume's), naming `incarnation`.
    pub async fn connect(
        transport: &Transport,
        addr: &str,
        expect: Expect,
        cluster_id: &str,
        incarnation: u64,
    ) -> Result<Self, LinkError> {
        let vol0 = ("vol0", GroupId::FIRST);
        Self::connect_to(transport, addr, expect, cluster_id, vol0, incarnation).await
    }

    /// Opens a link to the block channel at `addr` for `cluster_id`'s
    /// `volume`, named as (name, Raft group) in its `Hello`, naming
    /// `incarnation`.
    pub async fn connect_to(
        transport: &Transport,
        addr: &str,
        expect: Expect,
        cluster_id: &str,
        (volume, group): (&str, GroupId),
        incarnation: u64,
    ) -> Result<Self, LinkError> {
        let link = transport
            .link(addr, expect, cluster_id, volume, group, CALL_TIMEOUT)
            .await?;
        Ok(Self { link, incarnation })
    }

    /// The same link, naming `incarnation` from now on.
    pub fn naming(self, incarnation: u64) -> Self {
        Self {
            incarnation,
            ..self
        }
    }

    /// Writes `data` at `offset` under `stamp` (durable first when `fua`).
    pub async fn write(
        &self,
        stamp: Stamp,
        offset: u64,
        data: Bytes,
        fua: bool,
    ) -> Result<(), ReplicaError> {
        let mut header = self.header(Kind::Write, stamp);
        header.offset = offset;
        header.flags = if fua { FUA } else { 0 };
        self.call(header, data, stamp).await.map(|_| ())
    }

    /// Reads `len` bytes at `offset`.
    pub async fn read(&self, offset: u64, len: u64) -> Result<Bytes, ReplicaError> {
        let stamp = Stamp::from(replica_ha::ids::Term::ZERO);
        let mut header = self.header(Kind::Read, stamp);
        header.offset = offset;
        header.length = len;
        self.call(header, Bytes::new(), stamp).await
    }

    fn header(&self, kind: Kind, stamp: Stamp) -> Header {
        let mut header = Header::new(kind, 0);
        header.stamp = stamp;
        header.incarnation = self.incarnation;
        header
    }

    /// Sends one request; a refusal comes back as the error it carries, a
    /// lost link as `Unavailable`.
    async fn call(&self, header: Header, data: Bytes, stamp: Stamp) -> Result<Bytes, ReplicaError> {
        match self.link.call(header, data, CALL_TIMEOUT).await {
            Ok(reply) if reply.header.kind == Kind::Ok => Ok(reply.payload),
            Ok(refusal) => Err(from_refusal(&refusal, stamp)),
            Err(err) => Err(ReplicaError::Unavailable(err.to_string())),
        }
    }
}
