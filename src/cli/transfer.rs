//! `replica-ha transfer`: a graceful switchover. The current leader hands
//! leadership to the named node and answers once that node leads; the new
//! writer fences before its gate opens, as after any election (S1, S2).

use std::process::ExitCode;
use std::time::Duration;

use clap::Args;

use super::{Admin, ClientTls, report};
use crate::proto::admin::TransferRequest;

/// The flags of `replica-ha transfer`.
#[derive(Args)]
pub struct TransferArgs {
    /// The current leader's gRPC address.
    #[arg(long)]
    addr: String,
    /// The node id to hand leadership to.
    #[arg(long)]
    to: u64,
    #[command(flatten)]
    tls: ClientTls,
}

/// Asks for the transfer; exit 0 once node `to` leads.
pub async fn run(args: TransferArgs) -> ExitCode {
    let TransferArgs { addr, to, tls } = args;
    let outcome = Admin::new(&addr, &tls)
        .ask(TransferRequest { to }, Duration::from_secs(10))
        .await;
    report(outcome, format!("transfer to {to} failed"), |_| {
        format!("node {to} now leads")
    })
}
