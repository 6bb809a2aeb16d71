//! `replica-ha scrub`: ask the writer for a pass of its scrub, which
//! compares every extent's digest on all in-sync replicas and repairs a
//! copy that differs. With `--now` the command waits for the pass and
//! prints what differed, and its exit code says whether every extent was
//! compared and every copy agreed or was repaired.

use std::process::ExitCode;
use std::time::Duration;

use clap::Args;

use super::{Admin, ClientTls, failure};
use crate::proto::admin::{ScrubReply, ScrubRequest};

/// The flags of `replica-ha scrub`.
#[derive(Args)]
pub struct ScrubArgs {
    /// The writer's gRPC address.
    #[arg(long, default_value = "127.0.0.1:7001")]
    addr: String,
    /// End a paced pass that is running, run one at full speed, wait for
    /// it and print what differed. Exit 0 when every extent was compared
    /// and every copy agreed or was repaired, 1 otherwise.
    #[arg(long)]
    now: bool,
    #[command(flatten)]
    tls: ClientTls,
}

/// Asks for the pass; with `--now`, reports it.
pub async fn run(args: ScrubArgs) -> ExitCode {
    let ScrubArgs { addr, now, tls } = args;
    // A pass at full speed reads every replica once: allow an hour.
    let timeout = Duration::from_secs(if now { 3600 } else { 10 });
    let outcome = Admin::new(&addr, &tls)
        .ask(ScrubRequest { now }, timeout)
        .await;
    let reply = match outcome {
        Ok(reply) => reply,
        Err(err) => return failure(format!("scrub failed: {err}")),
    };
    if !now {
        println!("scrub started; `replica-ha status` shows its progress");
        return ExitCode::SUCCESS;
    }
    report(&reply)
}

/// Prints the findings of a pass and its totals; exit 0 only when nothing
/// is left differing or uncompared.
fn report(reply: &ScrubReply) -> ExitCode {
    for f in &reply.findings {
        let differing: Vec<String> = f.differing.iter().map(u64::to_string).collect();
        let outcome = if f.repaired {
            "repaired"
        } else {
            "NOT repaired"
        };
        let majority = if f.majority {
            ""
        } else {
            " (no majority: the writer's copy was kept; the replaced copies are saved on the writer, see its log)"
        };
        println!(
            "extent {}: node(s) {} differed from node {}; {outcome}{majority}",
            f.extent,
            differing.join(", "),
            f.source,
        );
    }
    let repaired = reply.findings.iter().filter(|f| f.repaired).count();
    println!(
        "scrub: {} extents compared, {} differed, {repaired} repaired",
        reply.checked,
        reply.findings.len()
    );
    if reply.unchecked > 0 {
        println!(
            "scrub: {} extents could not be compared (a replica did not answer; see the writer's log)",
            reply.unchecked
        );
    }
    if repaired == reply.findings.len() && reply.unchecked == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
