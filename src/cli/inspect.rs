//! `replica-ha inspect`: a replica data directory, offline — its identity,
//! fence floor (S2) and the extents each writer's term may have left dirty.
//!
//! It never changes the directory: the store is opened with the smallest
//! valid size, and opening never grows a store past what it recorded. The
//! node that owns the directory must be stopped (its metadata is locked
//! while it runs).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;

use super::{failure, usage_error};
use crate::ids::GroupId;
use crate::replica::disk::store::{ReplicaStore, StoreIdentity};

/// The flags of `replica-ha inspect`.
#[derive(Args)]
pub struct InspectArgs {
    /// The replica's data directory (holds volume.img and meta/).
    #[arg(long)]
    data_dir: PathBuf,
    /// The cluster id the directory must belong to.
    #[arg(long)]
    cluster_id: String,
    /// The volume name.
    #[arg(long, default_value = "vol0")]
    volume: String,
    /// The volume's Raft group (0: the configured volume's). A volume's
    /// name may be reused by a volume of another group, so the directory
    /// must hold this group's copy.
    #[arg(long, default_value_t = 0)]
    group: u64,
    /// Accepted for older scripts and otherwise ignored: inspect shows
    /// the size recorded in the directory (the volume may have grown
    /// since its config was written) and never changes the directory.
    #[arg(long, hide = true)]
    size: Option<u64>,
}

/// Prints what the directory holds; exit 2 if it holds no replica of this
/// cluster and volume.
pub async fn run(args: InspectArgs) -> ExitCode {
    let InspectArgs {
        data_dir: dir,
        cluster_id,
        volume,
        group,
        size: _,
    } = args;
    // The smallest valid size: opening never grows a store past what it
    // recorded, so inspect changes nothing.
    let identity = StoreIdentity::new(cluster_id, volume, 512).in_group(GroupId(group));
    if !dir.join("meta").exists() {
        return usage_error(format!("{} holds no replica", dir.display()));
    }
    let store = match ReplicaStore::open(&dir, identity).await {
        Ok(store) => store,
        Err(err) => return usage_error(format!("{}: {err}", dir.display())),
    };
    let id = store.identity();
    println!("cluster_id   {}", id.cluster_id);
    println!("volume       {}", id.volume);
    println!("group        {}", id.group);
    println!("size         {}", store.size());
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
        Err(err) => failure(err),
    }
}
