//! The read gate: what a node may read, and from where.
//!
//! **Invariant.** A read is served only from data that holds every
//! acknowledged write:
//! - on the active writer (its write gate grants a term), reads go through
//!   the engine, which reads only members of the in-sync set (S5, S6);
//! - on a passive node, reads go to this node's own replica, and only while
//!   that replica is a member of the **committed** in-sync set, as this node
//!   has applied it. A replica outside it (dropped by a writer, or being
//!   rebuilt) may lack acknowledged writes, so its reads are refused with
//!   [`DeviceError::NotInSync`], and [`Device::access`] reports
//!   [`Access::Refused`] so that new clients are turned away at the
//!   handshake and `status` can say why.
//!
//! The membership check is made before each read. A read that passed it
//! overlaps any write acknowledged after it, so returning the older data is
//! what a disk may do for a concurrent read.
//!
//! Known limit: "committed" means as applied here. A passive node cut off
//! from the Raft group learns of its removal only once it hears from the
//! group again; until then it still serves its copy. Closing that window
//! needs the writer to wait out a read lease of the dropped replica before
//! it acknowledges a write without it (not done yet).
//!
//! [`ReadGate`] is a [`Device`] in front of the write gate; writes and
//! flushes pass through to the write gate unchanged. This module stays pure:
//! the committed set and the local replica come through [`LocalCopy`].

use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;

use crate::volume::{Access, Bond, Change, Device, DeviceError, check_request};

/// This node's own replica, as the read gate sees it.
#[async_trait]
pub trait LocalCopy: Send + Sync {
    /// Whether this node's replica is in the committed in-sync set now.
    fn in_sync(&self) -> bool;
    /// Reads `len` bytes at `offset` of this node's replica.
    async fn read(&self, offset: u64, len: u64) -> Result<Bytes, DeviceError>;
    /// Where this node's replica holds data in `[offset, offset + len)`
    /// (see [`Device::allocation`]); the default knows of no holes.
    async fn allocation(
        &self,
        offset: u64,
        len: u64,
    ) -> Result<Vec<crate::volume::Extent>, DeviceError> {
        let _ = offset;
        Ok(vec![crate::volume::Extent { len, hole: false }])
    }
}

/// The read gate. See the module docs.
pub struct ReadGate {
    writer: Arc<dyn Device>,
    local: Arc<dyn LocalCopy>,
}

impl ReadGate {
    /// Reads through `writer` (the write gate) while it grants writes, else
    /// from `local` while it is in sync.
    pub fn new(writer: Arc<dyn Device>, local: Arc<dyn LocalCopy>) -> Self {
        Self { writer, local }
    }

    /// Whether a read would be served now.
    pub fn serves_reads(&self) -> bool {
        !matches!(self.access(), Access::Refused(_))
    }
}

#[async_trait]
impl Device for ReadGate {
    async fn read_at(&self, offset: u64, len: u64) -> Result<Bytes, DeviceError> {
        if self.writer.is_writable() {
            return self.writer.read_at(offset, len).await;
        }
        check_request(offset, len, self.size())?;
        if !self.local.in_sync() {
            return Err(DeviceError::NotInSync);
        }
        self.local.read(offset, len).await
    }

    async fn allocation(
        &self,
        offset: u64,
        len: u64,
    ) -> Result<Vec<crate::volume::Extent>, DeviceError> {
        if self.writer.is_writable() {
            return self.writer.allocation(offset, len).await;
        }
        crate::volume::check_span(offset, len, self.size())?;
        if !self.local.in_sync() {
            return Err(DeviceError::NotInSync);
        }
        self.local.allocation(offset, len).await
    }

    async fn write_at(&self, offset: u64, data: Bytes, fua: bool) -> Result<(), DeviceError> {
        self.writer.write_at(offset, data, fua).await
    }

    async fn discard(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        self.writer.discard(offset, len).await
    }

    async fn flush(&self) -> Result<(), DeviceError> {
        self.writer.flush().await
    }

    /// Writes go to the write gate with their bond.
    async fn change(&self, change: Change, bond: &Bond) -> Result<(), DeviceError> {
        self.writer.change(change, bond).await
    }

    fn size(&self) -> u64 {
        self.writer.size()
    }

    fn is_writable(&self) -> bool {
        self.writer.is_writable()
    }

    fn access(&self) -> Access {
        match self.writer.access() {
            Access::ReadOnly if !self.local.in_sync() => Access::Refused(DeviceError::NotInSync),
            access => access,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ha::WriterEngine;
    use crate::ha::fake::{MemoryCopy, MemoryEngine};
    use crate::ids::Term;

    /// A passive gate: the engine holds "mirror", the local copy "local".
    fn gate() -> (Arc<MemoryEngine>, Arc<MemoryCopy>, ReadGate) {
        let writer = MemoryEngine::new(8192);
        let mut data = vec![0; 8192];
        data[..5].copy_from_slice(b"local");
        let local = MemoryCopy::new(data);
        futures::executor::block_on(async {
            writer.activate(Term(2)).await.unwrap();
            let mirror = Bytes::from_static(b"mirror");
            writer.write_at(0, mirror, false).await.unwrap();
            writer.deactivate();
        });
        let gate = ReadGate::new(writer.clone(), local.clone());
        (writer, local, gate)
    }

    #[tokio::test]
    async fn a_passive_node_reads_its_own_copy_only_while_it_is_in_sync() {
        let (_, local, gate) = gate();
        assert_eq!(gate.access(), Access::ReadOnly);
        assert_eq!(&gate.read_at(0, 5).await.unwrap()[..], b"local");
        local.set_in_sync(false);
        assert_eq!(gate.access(), Access::Refused(DeviceError::NotInSync));
        assert!(!gate.serves_reads());
        assert_eq!(gate.read_at(0, 5).await, Err(DeviceError::NotInSync));
        // Range errors stay range errors.
        assert!(matches!(
            gate.read_at(8190, 5).await,
            Err(DeviceError::Range(_))
        ));
        local.set_in_sync(true);
        assert!(gate.serves_reads());
        assert_eq!(&gate.read_at(0, 5).await.unwrap()[..], b"local");
    }

    #[tokio::test]
    async fn the_writer_reads_through_its_engine_whatever_its_own_copy() {
        let (writer, local, gate) = gate();
        local.set_in_sync(false);
        writer.activate(Term(3)).await.unwrap();
        assert_eq!(gate.access(), Access::ReadWrite { term: Term(3) });
        assert_eq!(&gate.read_at(0, 6).await.unwrap()[..], b"mirror");
        let data = Bytes::from_static(b"WRITER");
        gate.write_at(0, data, true).await.unwrap();
        assert_eq!(writer.writes().last(), Some(&(Term(3), 0)));
        writer.deactivate();
        assert_eq!(gate.read_at(0, 6).await, Err(DeviceError::NotInSync));
        let refused = gate.write_at(0, Bytes::new(), false).await;
        assert_eq!(refused, Err(DeviceError::Inactive));
    }
}
