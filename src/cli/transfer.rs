//! `replica-ha transfer`: a graceful switchover. The current leader hands
//! leadership to the named node and answers once that node leads; the new
//! writer fences before its gate opens, as after any election (S1, S2).
//!
//! With `--volume NAME`, the writer of that volume of the table moves
//! (its group's leadership); any node can be asked, and one that does not
//! write the volume names the node that does, which is asked next. The
//! writer balancer (`replica-ha node --balance-interval`) moves a writer
//! that is not on its preferred node back after the interval; turn it off
//! to keep a placement made by hand.

use std::process::ExitCode;
use std::time::Duration;

use clap::Args;

use super::volume::{Answer, change};
use super::{Admin, ClientTls, report};
use crate::proto::admin::TransferRequest;

/// The flags of `replica-ha transfer`.
#[derive(Args)]
pub struct TransferArgs {
    /// The current leader's gRPC address (with --volume, any node's).
    #[arg(long)]
    addr: String,
    /// The node id to hand leadership to.
    #[arg(long)]
    to: u64,
    /// The volume whose writer moves (default: the configured volume, the
    /// one the cluster group carries).
    #[arg(long)]
    volume: Option<String>,
    #[command(flatten)]
    tls: ClientTls,
}

/// Asks for the transfer; exit 0 once node `to` leads.
pub async fn run(args: TransferArgs) -> ExitCode {
    let TransferArgs {
        addr,
        to,
        volume,
        tls,
    } = args;
    if let Some(volume) = volume {
        let what = format!("transfer of volume {volume} to node {to}");
        let request = TransferRequest {
            to,
            volume: volume.clone(),
        };
        return change(&addr, &tls, &what, request, |reply| {
            match reply.redirect.is_empty() {
                true => Answer::Done(format!("node {to} now leads volume {volume}")),
                false => Answer::AskAt(reply.redirect),
            }
        })
        .await;
    }
    let request = TransferRequest {
        to,
        volume: String::new(),
    };
    let outcome = Admin::new(&addr, &tls)
        .ask(request, Duration::from_secs(10))
        .await;
    report(outcome, format!("transfer to {to} failed"), |_| {
        format!("node {to} now leads")
    })
}
