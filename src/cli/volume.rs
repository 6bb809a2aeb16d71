//! `replica-ha volume`: the cluster's volumes. `list` and `show` read the
//! volume table as the node asked has applied it; `create` and `delete`
//! change it on the node that leads the cluster group, and `resize` grows
//! a volume on its writer (the node asked says where that is, and the
//! command asks there).
//!
//! The volume the nodes' config names is the cluster group's own: it is
//! listed with group 0, cannot be created again or deleted, and grows with
//! `replica-ha resize`, or `volume resize` with its name.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Subcommand};

use super::{Admin, ClientTls, failure, usage_error};
use crate::proto::admin::{
    ResizeRequest, VolumeCreateRequest, VolumeDeleteRequest, VolumeInfo, VolumeListRequest,
    VolumeMoveRequest,
};

/// The flags of `replica-ha volume`.
#[derive(Args)]
pub struct VolumeArgs {
    /// The gRPC address of a node of the cluster (any: a change is
    /// forwarded to the cluster group's leader).
    #[arg(long, default_value = "127.0.0.1:7001")]
    addr: String,
    #[command(subcommand)]
    command: VolumeCommand,
    #[command(flatten)]
    tls: ClientTls,
}

/// What to do with the volumes.
#[derive(Subcommand)]
pub enum VolumeCommand {
    /// Create a volume. Asking again for the same volume (same size,
    /// copies and min-in-sync) succeeds and changes nothing; a different
    /// volume of that name is refused. Names are 1-63 characters of
    /// lower-case letters, digits, '-', '_' and '.', beginning with a
    /// letter or digit. The copies go to the nodes holding the fewest
    /// copies, then the most free space.
    Create {
        /// The volume's name (also its NBD export name).
        #[arg(value_name = "NAME")]
        volume: String,
        /// Its size: bytes, or with a unit (KiB, MiB, GiB, TiB); a multiple
        /// of 512.
        #[arg(long, value_parser = parse_volume_size)]
        size: u64,
        /// How many copies (default 3, or every node when there are fewer).
        #[arg(long)]
        replicas: Option<u32>,
        /// How many copies must hold a write before it is acknowledged
        /// (default 2, or 1 for a single copy).
        #[arg(long)]
        min_in_sync: Option<u32>,
    },
    /// List the volumes, one line each.
    List,
    // (The positional is `volume`, not `name`: `--as NAME` of the TLS flags
    // is `name`, and global, so the two would share one argument.)
    /// Show one volume.
    Show {
        /// The volume's name.
        #[arg(value_name = "NAME")]
        volume: String,
    },
    /// Move a volume's copy from one node to another: the new copy is
    /// added and rebuilt before the old one leaves, so the volume never
    /// has fewer copies than it should (a writer on the old node hands over
    /// first). Answers once the move is decided; `volume show` names the
    /// nodes, and `status` the new copy's rebuild.
    Move {
        /// The volume's name.
        #[arg(value_name = "NAME")]
        volume: String,
        /// The node whose copy leaves.
        #[arg(long)]
        from: u64,
        /// The node that gets a copy.
        #[arg(long)]
        to: u64,
    },
    /// Grow a volume online: its writer grows every in-sync copy, commits
    /// the new size, and offers it to new NBD connections (connected ones
    /// keep theirs). A volume never shrinks.
    Resize {
        /// The volume's name.
        #[arg(value_name = "NAME")]
        volume: String,
        /// The new size: bytes, or with a unit (KiB, MiB, GiB, TiB); a
        /// multiple of 512, at least the current size.
        #[arg(long, value_parser = parse_volume_size)]
        size: u64,
    },
    /// Delete a volume: it leaves the table, and every node that held a
    /// copy stops serving it and removes its data.
    Delete {
        /// The volume's name.
        #[arg(value_name = "NAME")]
        volume: String,
        /// Delete even while a client is connected.
        #[arg(long)]
        force: bool,
    },
}

/// A size as the node's config reads one (`32MiB`, `1GiB`, bytes).
pub(super) fn parse_volume_size(text: &str) -> Result<u64, String> {
    crate::node::config::parse_size(text).map_err(|e| e.to_string())
}

/// How long a change may take: creation asks every node for its room.
const CHANGE_DEADLINE: Duration = Duration::from_secs(30);

/// Runs the subcommand.
pub async fn run(args: VolumeArgs) -> ExitCode {
    let VolumeArgs { addr, command, tls } = args;
    match command {
        VolumeCommand::List => list(&addr, &tls, None).await,
        VolumeCommand::Show { volume } => list(&addr, &tls, Some(volume)).await,
        VolumeCommand::Create {
            volume: name,
            size,
            replicas,
            min_in_sync,
        } => {
            let request = VolumeCreateRequest {
                name,
                size,
                copies: replicas.unwrap_or(0),
                min_in_sync: min_in_sync.unwrap_or(0),
            };
            if request.copies == 0 && replicas.is_some() {
                return usage_error("--replicas must be at least 1");
            }
            create(&addr, &tls, request).await
        }
        VolumeCommand::Delete {
            volume: name,
            force,
        } => delete(&addr, &tls, VolumeDeleteRequest { name, force }).await,
        VolumeCommand::Move { volume, from, to } => {
            let request = VolumeMoveRequest {
                name: volume,
                from,
                to,
            };
            move_copy(&addr, &tls, request).await
        }
        VolumeCommand::Resize { volume, size } => {
            resize(&addr, &tls, ResizeRequest { size, volume }).await
        }
    }
}

/// `volume list` (every volume) and `volume show NAME` (one).
async fn list(addr: &str, tls: &ClientTls, only: Option<String>) -> ExitCode {
    let volumes = match Admin::new(addr, tls)
        .ask(VolumeListRequest {}, Duration::from_secs(5))
        .await
    {
        Ok(reply) => reply.volumes,
        Err(err) => return failure(format!("volume list: {err}")),
    };
    match only {
        None => {
            println!("{}", header());
            for volume in &volumes {
                println!("{}", line(volume));
            }
        }
        Some(name) => match volumes.iter().find(|v| v.name == name) {
            Some(volume) => println!("{}", details(volume)),
            None => return failure(format!("no volume {name}")),
        },
    }
    ExitCode::SUCCESS
}

/// The column heads of `volume list`.
pub fn header() -> String {
    format!(
        "{:<24} {:>16} {:>6} {:>11} {:>6}  {:<12} {:>6} {:>6}",
        "name", "size", "copies", "min-in-sync", "group", "nodes", "writer", "term"
    )
}

/// One volume's line of `volume list`.
pub fn line(volume: &VolumeInfo) -> String {
    format!(
        "{:<24} {:>16} {:>6} {:>11} {:>6}  {:<12} {:>6} {:>6}",
        volume.name,
        volume.size,
        volume.copies,
        volume.min_in_sync,
        volume.group,
        nodes(&volume.placement),
        known(volume.leader),
        known(volume.term)
    )
}

/// One volume, a fact a line.
pub fn details(volume: &VolumeInfo) -> String {
    format!(
        "volume {}\n  size         {} bytes\n  copies       {}\n  min-in-sync  {}\n  nodes        {}\n  raft group   {}{}\n  writer       {} (term {}, as the node asked sees it){}{}",
        volume.name,
        volume.size,
        volume.copies,
        volume.min_in_sync,
        nodes(&volume.placement),
        volume.group,
        if volume.group == 0 {
            " (the cluster group: the volume the nodes' config names)"
        } else {
            ""
        },
        known(volume.leader),
        known(volume.term),
        if volume.writing {
            "\n  this node writes it now"
        } else {
            ""
        },
        match volume.preferred {
            0 => String::new(),
            node => format!("\n  preferred    {node} (where the balancer moves its writer)"),
        }
    )
}

/// A number the node may not know: `-` for 0.
fn known(value: u64) -> String {
    match value {
        0 => "-".into(),
        value => value.to_string(),
    }
}

fn nodes(placement: &[u64]) -> String {
    let ids: Vec<String> = placement.iter().map(u64::to_string).collect();
    ids.join(",")
}

/// How long a change keeps asking while the node to ask (the cluster
/// group's leader, a volume's writer) moves or one named went away (an
/// election takes about a second).
const FOLLOW_LEADER_FOR: Duration = Duration::from_secs(10);

/// How long to wait before asking again after a redirect failed (the
/// leader the node named is gone; a new one is elected within a second).
const RETRY_AFTER: Duration = Duration::from_millis(500);

/// What a change's reply says: done (with the line to print), or ask the
/// leader at this address.
pub(super) enum Answer {
    Done(String),
    AskAt(String),
    Failed(String),
}

/// Asks `addr`, then wherever it says the leader is (the cluster group's
/// for a table change, the volume's writer for `transfer --volume`); when
/// a leader it named cannot be reached, asks `addr` again after
/// [`RETRY_AFTER`].
pub(super) async fn change<R>(
    addr: &str,
    tls: &ClientTls,
    what: &str,
    request: R,
    answer: impl Fn(R::Reply) -> Answer,
) -> ExitCode
where
    R: super::Rpc + Clone,
{
    let mut at = addr.to_string();
    let deadline = tokio::time::Instant::now() + FOLLOW_LEADER_FOR;
    while tokio::time::Instant::now() < deadline {
        match Admin::new(&at, tls)
            .ask(request.clone(), CHANGE_DEADLINE)
            .await
        {
            Ok(reply) => match answer(reply) {
                Answer::Done(line) => {
                    println!("{line}");
                    return ExitCode::SUCCESS;
                }
                Answer::AskAt(leader) => {
                    if at != addr {
                        // Redirected again: let the leadership settle.
                        tokio::time::sleep(RETRY_AFTER).await;
                    }
                    at = leader;
                }
                Answer::Failed(why) => return failure(format!("{what}: {why}")),
            },
            Err(err) if at != addr => {
                tracing::debug!(%err, leader = %at, "the leader named did not answer");
                tokio::time::sleep(RETRY_AFTER).await;
                at = addr.to_string();
            }
            Err(err) => return failure(format!("{what}: {err}")),
        }
    }
    failure(format!(
        "{what}: the node to ask kept moving (an election?); try again"
    ))
}

/// `volume create`.
async fn create(addr: &str, tls: &ClientTls, request: VolumeCreateRequest) -> ExitCode {
    let what = format!("volume create {}", request.name);
    change(addr, tls, &what, request, |reply| {
        if !reply.redirect.is_empty() {
            return Answer::AskAt(reply.redirect);
        }
        match reply.volume {
            Some(volume) => {
                let how = if reply.created {
                    "created"
                } else {
                    "exists as asked"
                };
                Answer::Done(format!(
                    "volume {} {how}\n{}",
                    volume.name,
                    details(&volume)
                ))
            }
            None => Answer::Failed("the node answered without the volume".into()),
        }
    })
    .await
}

/// `volume delete`.
async fn delete(addr: &str, tls: &ClientTls, request: VolumeDeleteRequest) -> ExitCode {
    let what = format!("volume delete {}", request.name);
    let name = request.name.clone();
    change(addr, tls, &what, request, |reply| {
        match reply.redirect.is_empty() {
            true => Answer::Done(format!("volume {name} deleted")),
            false => Answer::AskAt(reply.redirect),
        }
    })
    .await
}

/// `volume move`.
async fn move_copy(addr: &str, tls: &ClientTls, request: VolumeMoveRequest) -> ExitCode {
    let what = format!(
        "volume move {} from node {} to node {}",
        request.name, request.from, request.to
    );
    let (from, to) = (request.from, request.to);
    change(addr, tls, &what, request, |reply| {
        if !reply.redirect.is_empty() {
            return Answer::AskAt(reply.redirect);
        }
        match reply.volume {
            Some(volume) => Answer::Done(format!(
                "volume {}: node {to}'s copy is added and rebuilt, then node {from}'s leaves\n{}",
                volume.name,
                details(&volume)
            )),
            None => Answer::Failed("the node answered without the volume".into()),
        }
    })
    .await
}

/// `volume resize`: asks the node, then the writer it names.
async fn resize(addr: &str, tls: &ClientTls, request: ResizeRequest) -> ExitCode {
    let what = format!("volume resize {}", request.volume);
    let volume = format!("volume {}", request.volume);
    change(addr, tls, &what, request, |reply| {
        match reply.redirect.is_empty() {
            true => Answer::Done(super::resize::grown(&volume, &reply)),
            false => Answer::AskAt(reply.redirect),
        }
    })
    .await
}
