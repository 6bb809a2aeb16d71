//! `replica-ha resize`: grow the volume online. The writer grows every
//! in-sync replica, commits the new size through Raft, and offers it to new
//! NBD connections; shrinking is refused.

use std::process::ExitCode;
use std::time::Duration;

use clap::Args;

use super::{Admin, ClientTls, report};
use crate::proto::admin::ResizeRequest;

/// The flags of `replica-ha resize`.
#[derive(Args)]
pub struct ResizeArgs {
    /// The writer's gRPC address.
    #[arg(long, default_value = "127.0.0.1:7001")]
    addr: String,
    /// The new size: bytes, or with a unit (KiB, MiB, GiB, TiB), a
    /// multiple of 512 and at least the current size.
    #[arg(long, value_parser = parse_volume_size)]
    size: u64,
    #[command(flatten)]
    tls: ClientTls,
}

/// A size as the node's config reads one (`32MiB`, `1GiB`, bytes).
fn parse_volume_size(text: &str) -> Result<u64, String> {
    crate::node::config::parse_size(text).map_err(|e| e.to_string())
}

/// Asks the writer to grow the volume and says from what to what.
pub async fn run(args: ResizeArgs) -> ExitCode {
    let ResizeArgs { addr, size, tls } = args;
    let outcome = Admin::new(&addr, &tls)
        .ask(ResizeRequest { size }, Duration::from_secs(30))
        .await;
    report(outcome, "resize failed", |reply| {
        if reply.previous == reply.size {
            format!("the volume is {} bytes already", reply.size)
        } else {
            format!(
                "the volume grew from {} to {} bytes; new connections see the new size",
                reply.previous, reply.size
            )
        }
    })
}
