//! `replica-ha status`: one node's view of its configured volume and of
//! every volume, as a table, as JSON (`--json`) or as a live view
//! (`--watch`). The renderings are
//! [`crate::api::status`]'s; this fetches the reply and prints it. Any
//! node answers, and a node that cannot be reached is exit 1 (the watch
//! keeps trying instead).

use std::io::Write;
use std::process::ExitCode;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::Args;

use super::{Admin, ClientTls, failure};
use crate::api::status::{StatusJson, Table, Watch};
use crate::proto::admin::{StatusReply, StatusRequest};

/// The flags of `replica-ha status`.
#[derive(Args)]
pub struct StatusArgs {
    /// The node's gRPC address.
    #[arg(long, default_value = "127.0.0.1:7001")]
    addr: String,
    /// Print one JSON object instead of a table (for scripts; the keys
    /// are those of the table, plus `replicas` and `volumes` as lists).
    #[arg(long, conflicts_with = "watch")]
    json: bool,
    /// Keep a live view on the terminal, refreshed once a second: role,
    /// term, gate, lease, I/O, write rate, scrub, and every replica with
    /// its state and resync progress, then every volume with its writer,
    /// term and copies. It keeps trying while the node
    /// cannot be reached (during its restart, say). Ctrl-C ends it.
    #[arg(long)]
    watch: bool,
    #[command(flatten)]
    tls: ClientTls,
}

/// Prints the node's status once, or watches it.
pub async fn run(args: StatusArgs) -> ExitCode {
    let StatusArgs {
        addr,
        json,
        watch,
        tls,
    } = args;
    if watch {
        return watch_status(&addr, &tls).await;
    }
    match fetch_status(&addr, &tls).await {
        Ok(reply) if json => {
            println!("{}", StatusJson::new(&reply));
            ExitCode::SUCCESS
        }
        Ok(reply) => {
            print!("{}", Table(&reply));
            ExitCode::SUCCESS
        }
        Err(err) => failure(format!("cannot reach {addr}: {err}")),
    }
}

/// One `Status` call to `addr`.
async fn fetch_status(addr: &str, tls: &ClientTls) -> Result<StatusReply, String> {
    Admin::new(addr, tls)
        .ask(StatusRequest {}, Duration::from_secs(3))
        .await
}

/// `status --watch`: the live view, redrawn once a second until Ctrl-C.
async fn watch_status(addr: &str, tls: &ClientTls) -> ExitCode {
    let mut watch = Watch::new();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = tokio::signal::ctrl_c() => return ExitCode::SUCCESS,
        }
        let now = Instant::now();
        let view = match fetch_status(addr, tls).await {
            Ok(reply) => watch.frame(&reply, now, unix_now()),
            Err(err) => watch.unreachable(addr, &err),
        };
        // Clear the screen and draw from the top.
        print!("\x1b[2J\x1b[H{view}");
        let _ = std::io::stdout().flush();
    }
}

/// Seconds since the Unix epoch, now.
fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
