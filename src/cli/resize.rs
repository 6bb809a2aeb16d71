//! `replica-ha resize`: grow the configured volume online. The writer
//! grows every in-sync replica, commits the new size through Raft, and
//! offers it to new NBD connections; shrinking is refused. (`replica-ha
//! volume resize NAME` grows any volume, asked of any node.)

use std::process::ExitCode;
use std::time::Duration;

use clap::Args;

use super::{Admin, ClientTls, report};
use crate::proto::admin::{ResizeReply, ResizeRequest};

/// The flags of `replica-ha resize`.
#[derive(Args)]
pub struct ResizeArgs {
    /// The writer's gRPC address.
    #[arg(long, default_value = "127.0.0.1:7001")]
    addr: String,
    /// The new size: bytes, or with a unit (KiB, MiB, GiB, TiB), a
    /// multiple of 512 and at least the current size.
    #[arg(long, value_parser = super::volume::parse_volume_size)]
    size: u64,
    #[command(flatten)]
    tls: ClientTls,
}

/// Asks the writer to grow the volume and says from what to what.
pub async fn run(args: ResizeArgs) -> ExitCode {
    let ResizeArgs { addr, size, tls } = args;
    let outcome = Admin::new(&addr, &tls)
        .ask(
            ResizeRequest {
                size,
                volume: String::new(),
            },
            Duration::from_secs(30),
        )
        .await;
    report(outcome, "resize failed", |reply| {
        grown("the volume", &reply)
    })
}

/// What a resize did to `what` (`the volume`, `volume db`), in words.
pub fn grown(what: &str, reply: &ResizeReply) -> String {
    if reply.previous == reply.size {
        format!("{what} is {} bytes already", reply.size)
    } else {
        format!(
            "{what} grew from {} to {} bytes; new connections see the new size",
            reply.previous, reply.size
        )
    }
}
