//! `replica-ha members`: the cluster's members as a node's committed
//! membership names them, and changes to it (replace, add, remove), which
//! the writer makes through Raft's joint consensus. A replaced or added
//! node's replica counts toward writes only once it is rebuilt (S5, S8).
//!
//! Removing the writer's own node moves leadership first; the writer
//! answers with where it went, and the command asks again there.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Subcommand};

use super::{Admin, ClientTls, failure};
use crate::api::status::member_line;
use crate::proto::admin::{Member, MembersChange, MembersRequest, StatusReply, StatusRequest};

/// The flags of `replica-ha members`, and the change if one is asked for.
#[derive(Args)]
pub struct MembersArgs {
    /// The gRPC address of the node to ask (the writer, for a change).
    /// Give it before the subcommand: `add` has an `--addr` of its own,
    /// the new node's.
    #[arg(long, default_value = "127.0.0.1:7001")]
    addr: String,
    #[command(subcommand)]
    change: Option<MembersCommand>,
    #[command(flatten)]
    tls: ClientTls,
}

/// A change to the membership, made through Raft's joint consensus.
#[derive(Subcommand)]
pub enum MembersCommand {
    /// Bring back a node whose data dir was lost: swap its old incarnation
    /// for the new one that is running and waiting (its `status` says
    /// "replaced disk: waiting to be re-added"). Its replica leaves the
    /// in-sync set first, joins as a learner, is rebuilt in full, and only
    /// then counts toward writes (S5, S8).
    Replace {
        /// The node's id.
        #[arg(long)]
        id: u64,
    },
    /// Add a new node, running with this cluster's peer list and waiting:
    /// it joins as a learner, catches up on Raft, its replica is rebuilt by
    /// resync, and then it becomes a voter. Returns once it votes.
    Add {
        /// The new node's id.
        #[arg(long)]
        id: u64,
        /// Its gRPC address, HOST:PORT.
        #[arg(long)]
        addr: String,
    },
    /// Remove a node. Its replica leaves the in-sync set through a
    /// committed change first; removing the writer's own node hands
    /// leadership over first. Refused if fewer members than min_in_sync
    /// would remain.
    Remove {
        /// The node's id.
        #[arg(long)]
        id: u64,
    },
}

/// Lists the members, or makes the change asked for.
pub async fn run(args: MembersArgs) -> ExitCode {
    match args.change {
        None => list(&args.addr, &args.tls).await,
        Some(change) => change_members(&args.addr, change, &args.tls).await,
    }
}

/// `replica-ha members`: one line per member.
async fn list(addr: &str, tls: &ClientTls) -> ExitCode {
    let (members, status) = match fetch_members(addr, tls).await {
        Ok(answer) => answer,
        Err(err) => return failure(err),
    };
    if members.is_empty() {
        println!(
            "node {} holds no membership: {}",
            status.node_id,
            member_line(&status)
        );
        return ExitCode::SUCCESS;
    }
    println!(
        "{:<6} {:<22} {:<12} {:<8} {:<5} in-sync",
        "id", "address", "incarnation", "role", "live"
    );
    for m in &members {
        let role = match (m.voter, m.leader) {
            (true, true) => "leader",
            (true, false) => "voter",
            (false, _) => "learner",
        };
        println!(
            "{:<6} {:<22} {:<12} {:<8} {:<5} {}",
            m.id,
            m.address,
            format!("{:010x}", m.incarnation),
            role,
            if m.live { "yes" } else { "no" },
            if m.in_sync { "yes" } else { "no" },
        );
    }
    ExitCode::SUCCESS
}

/// The node's members, and its status (which says why it holds no
/// membership, when it holds none), through one client.
async fn fetch_members(addr: &str, tls: &ClientTls) -> Result<(Vec<Member>, StatusReply), String> {
    let admin = Admin::new(addr, tls);
    let members = admin
        .ask(MembersRequest {}, Duration::from_secs(5))
        .await?
        .members;
    let status = admin.ask(StatusRequest {}, Duration::from_secs(5)).await?;
    Ok((members, status))
}

/// `replica-ha members replace|add|remove`: asks the node at `addr`, and
/// when the writer's own node is removed, asks again where leadership moved.
async fn change_members(addr: &str, change: MembersCommand, tls: &ClientTls) -> ExitCode {
    let (op, id, new_addr) = match change {
        MembersCommand::Replace { id } => ("replace", id, String::new()),
        MembersCommand::Add { id, addr } => ("add", id, addr),
        MembersCommand::Remove { id } => ("remove", id, String::new()),
    };
    let mut at = addr.to_string();
    for _ in 0..2 {
        let request = MembersChange {
            op: op.into(),
            id,
            addr: new_addr.clone(),
        };
        // Adding waits for the new replica's rebuild.
        let outcome = Admin::new(&at, tls)
            .ask(request, Duration::from_secs(3600))
            .await;
        match outcome {
            Ok(reply) if reply.moved_to != 0 => {
                println!("{}; asking it at {}", reply.summary, reply.moved_to_addr);
                at = reply.moved_to_addr;
            }
            Ok(reply) => {
                println!("{}", reply.summary);
                return ExitCode::SUCCESS;
            }
            Err(err) => return failure(format!("members {op} --id {id}: {err}")),
        }
    }
    failure(format!(
        "members {op} --id {id}: leadership kept moving; try again"
    ))
}
