//! A full disk is an error for the writes it stops, never a lasting state:
//! once the disk has room again, the replica store takes writes, fences
//! and mark changes as before, with its floor and marks intact (see
//! `replica::disk::meta`). Needs root, for a small tmpfs; without it the test
//! says so and does nothing.

mod common;

use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use replica_ha::ids::Term;
use replica_ha::replica::disk::store::{ReplicaStore, StoreIdentity};
use tokio::time::Instant;

struct Tmpfs(tempfile::TempDir);

impl Tmpfs {
    fn mount(mib: u64) -> Option<Self> {
        let dir = tempfile::tempdir().ok()?;
        let status = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={mib}m"), "tmpfs"])
            .arg(dir.path())
            .stderr(std::process::Stdio::null())
            .status()
            .ok()?;
        status.success().then_some(Self(dir))
    }

    fn path(&self) -> &Path {
        self.0.path()
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(self.0.path())
            .status();
    }
}

fn block(byte: u8) -> Bytes {
    Bytes::from(vec![byte; 4096])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_whose_disk_filled_up_works_again_once_there_is_room() {
    common::init_tracing();
    let Some(fs) = Tmpfs::mount(48) else {
        eprintln!("skipped: mounting a tmpfs needs root");
        return;
    };
    // Sparse on tmpfs: only what is written takes room.
    let size = 4 << 30;
    let store = ReplicaStore::open(
        fs.path().join("replica"),
        StoreIdentity::new("c", "v", size),
    )
    .await
    .expect("open the store");
    store.fence(Term(3)).await.unwrap();
    store.write(Term(3), 0, block(1), false).await.unwrap();
    let filler = fs.path().join("filler");
    common::fill_file_system(&filler);

    // Writes into new extents need new marks: with no room, some fail.
    let mut refused = 0;
    for extent in 1..2048u64 {
        if store
            .write(Term(3), extent << 20, block(2), false)
            .await
            .is_err()
        {
            refused += 1;
        }
    }
    assert!(refused > 0, "a full disk refused no write");

    std::fs::remove_file(filler).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let retried = store.write(Term(3), 4000 << 20, block(4), false).await;
        if retried.is_ok() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the store still refuses writes with room on the disk: {retried:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    store.flush(Term(3)).await.unwrap();
    assert_eq!(store.floor().await, Term(3), "the floor survived");
    let marks = store.dirty_extents().unwrap();
    assert!(
        marks.iter().any(|m| m.term == Term(3) && m.extent == 0),
        "the mark made before the disk filled survived: {marks:?}"
    );
    assert!(marks.iter().any(|m| m.extent == 4000));
    store
        .fence(Term(4))
        .await
        .expect("a fence after the disk had room");
    assert_eq!(store.read(0, 4096).await.unwrap(), block(1));
}
