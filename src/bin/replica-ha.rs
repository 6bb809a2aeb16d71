//! The `replica-ha` command line.
//!
//! Today it offers `inspect`, an offline look at a replica's data directory
//! (identity, fence floor, dirty extents). The node process, `status` and
//! `transfer` arrive with the Raft and admin work (see README, Status).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use replica_ha::replica::{ReplicaStore, StoreIdentity};

#[derive(Parser)]
#[command(
    name = "replica-ha",
    version,
    about = "A replicated block volume with one fenced writer, chosen by embedded Raft."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Show a replica data directory offline: identity, fence floor and the
    /// extents each writer's term may have left dirty. The node that owns
    /// the directory must be stopped (the metadata is locked while it runs).
    Inspect {
        /// The replica's data directory (holds volume.img and meta/).
        #[arg(long)]
        data_dir: PathBuf,
        /// The cluster id the directory must belong to.
        #[arg(long)]
        cluster_id: String,
        /// The volume name.
        #[arg(long, default_value = "vol0")]
        volume: String,
        /// The volume size in bytes.
        #[arg(long)]
        size: u64,
    },
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Inspect {
            data_dir,
            cluster_id,
            volume,
            size,
        } => inspect(data_dir, StoreIdentity::new(cluster_id, volume, size)).await,
    }
}

async fn inspect(dir: PathBuf, identity: StoreIdentity) -> ExitCode {
    if !dir.join("meta").exists() {
        eprintln!("replica-ha: {} holds no replica", dir.display());
        return ExitCode::from(2);
    }
    let store = match ReplicaStore::open(&dir, identity).await {
        Ok(store) => store,
        Err(err) => {
            eprintln!("replica-ha: {}: {err}", dir.display());
            return ExitCode::from(2);
        }
    };
    let id = store.identity();
    println!("cluster_id   {}", id.cluster_id);
    println!("volume       {}", id.volume);
    println!("size         {}", id.size);
    println!("extent_size  {}", id.extent_size);
    println!("fence_floor  {}", store.floor().await);
    match store.dirty_extents() {
        Ok(dirty) => {
            println!("dirty        {}", dirty.len());
            for mark in dirty {
                println!("  term {:>6}  extent {}", mark.term, mark.extent);
            }
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("replica-ha: {err}");
            ExitCode::FAILURE
        }
    }
}
