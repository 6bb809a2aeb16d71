//! `replica-ha resync --full`: ask the writer to rebuild an out-of-sync
//! replica in full, every extent compared with an in-sync copy, instead of
//! only those its missed-write map names. The replica counts toward writes
//! again only once the rebuild is done (S5).

use std::process::ExitCode;
use std::time::Duration;

use clap::Args;

use super::{Admin, ClientTls, report};
use crate::proto::admin::ResyncRequest;

/// The flags of `replica-ha resync`.
#[derive(Args)]
pub struct ResyncArgs {
    /// The writer's gRPC address.
    #[arg(long, default_value = "127.0.0.1:7001")]
    addr: String,
    /// The replica's node id.
    #[arg(long)]
    id: u64,
    /// Compare every extent (the only kind of rebuild that can be asked
    /// for; without it the command refuses).
    #[arg(long)]
    full: bool,
    #[command(flatten)]
    tls: ClientTls,
}

/// Asks for the rebuild; it runs on the writer after the command returns.
pub async fn run(args: ResyncArgs) -> ExitCode {
    let ResyncArgs {
        addr,
        id,
        full,
        tls,
    } = args;
    let outcome = Admin::new(&addr, &tls)
        .ask(ResyncRequest { id, full }, Duration::from_secs(10))
        .await;
    report(outcome, "resync failed", |_| {
        format!(
            "replica {id} will be rebuilt in full (every extent compared); `replica-ha status` \
             shows its progress"
        )
    })
}
