//! A minimal NBD client for the campaign's workload: the fixed-newstyle
//! handshake through `NBD_OPT_EXPORT_NAME`, then one request at a time.
//! Real clients (qemu-io, nbdcopy, fio) are exercised in `nbd_clients.rs`;
//! this one exists so the workload can see every acknowledgement and error.

use std::net::SocketAddr;
use std::time::Duration;

use replica_ha::nbd::wire;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const CMD_READ: u16 = 0;
const CMD_TRIM: u16 = 4;
const CMD_WRITE: u16 = 1;

/// How a request ended.
#[derive(Debug)]
pub enum Reply {
    Ok(Vec<u8>),
    /// The server answered with this NBD error number.
    Error(u32),
}

pub struct Connection {
    stream: TcpStream,
    pub read_only: bool,
    pub size: u64,
    cookie: u64,
}

async fn within<T>(
    limit: Duration,
    what: impl std::future::Future<Output = std::io::Result<T>>,
) -> std::io::Result<T> {
    tokio::time::timeout(limit, what)
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "timed out"))?
}

impl Connection {
    /// Connects and negotiates the default export, within `limit`.
    pub async fn open(addr: SocketAddr, limit: Duration) -> std::io::Result<Connection> {
        within(limit, async {
            let mut stream = TcpStream::connect(addr).await?;
            stream.set_nodelay(true)?;
            let magic = stream.read_u64().await?;
            let ihaveopt = stream.read_u64().await?;
            let _flags = stream.read_u16().await?;
            if magic != wire::NBD_MAGIC || ihaveopt != wire::IHAVEOPT {
                return Err(std::io::Error::other("not an NBD server"));
            }
            stream
                .write_u32(wire::CLIENT_FIXED_NEWSTYLE | wire::CLIENT_NO_ZEROES)
                .await?;
            stream.write_u64(wire::IHAVEOPT).await?;
            stream.write_u32(wire::OPT_EXPORT_NAME).await?;
            stream.write_u32(0).await?;
            let size = stream.read_u64().await?;
            let flags = stream.read_u16().await?;
            Ok(Connection {
                stream,
                read_only: flags & wire::TFLAG_READ_ONLY != 0,
                size,
                cookie: 0,
            })
        })
        .await
    }

    /// One request, answered within `limit`.
    async fn request(
        &mut self,
        command: u16,
        flags: u16,
        offset: u64,
        len: u32,
        payload: &[u8],
        limit: Duration,
    ) -> std::io::Result<Reply> {
        self.cookie += 1;
        let cookie = self.cookie;
        let stream = &mut self.stream;
        within(limit, async move {
            let mut header = Vec::with_capacity(wire::REQUEST_LEN + payload.len());
            header.extend_from_slice(&wire::REQUEST_MAGIC.to_be_bytes());
            header.extend_from_slice(&flags.to_be_bytes());
            header.extend_from_slice(&command.to_be_bytes());
            header.extend_from_slice(&cookie.to_be_bytes());
            header.extend_from_slice(&offset.to_be_bytes());
            header.extend_from_slice(&len.to_be_bytes());
            header.extend_from_slice(payload);
            stream.write_all(&header).await?;
            let magic = stream.read_u32().await?;
            let error = stream.read_u32().await?;
            let answered = stream.read_u64().await?;
            if magic != wire::SIMPLE_REPLY_MAGIC || answered != cookie {
                return Err(std::io::Error::other("malformed reply"));
            }
            if error != 0 {
                return Ok(Reply::Error(error));
            }
            let mut data = vec![0u8; if command == CMD_READ { len as usize } else { 0 }];
            stream.read_exact(&mut data).await?;
            Ok(Reply::Ok(data))
        })
        .await
    }

    /// A write with FUA: acknowledged means durable on the in-sync replicas.
    pub async fn write_fua(
        &mut self,
        offset: u64,
        data: &[u8],
        limit: Duration,
    ) -> std::io::Result<Reply> {
        let len = data.len() as u32;
        self.request(CMD_WRITE, wire::CMD_FLAG_FUA, offset, len, data, limit)
            .await
    }

    /// A discard (`TRIM`) with FUA.
    pub async fn trim_fua(
        &mut self,
        offset: u64,
        len: u32,
        limit: Duration,
    ) -> std::io::Result<Reply> {
        self.request(CMD_TRIM, wire::CMD_FLAG_FUA, offset, len, &[], limit)
            .await
    }

    pub async fn read(&mut self, offset: u64, len: u32, limit: Duration) -> std::io::Result<Reply> {
        self.request(CMD_READ, 0, offset, len, &[], limit).await
    }
}
