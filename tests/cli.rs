//! The `replica-ha` binary, run as an operator would.

use std::process::Command;

use bytes::Bytes;
use replica_ha::ids::Term;
use replica_ha::replica::disk::store::{ReplicaStore, StoreIdentity};

const SIZE: u64 = 4 * 1024 * 1024;

fn replica_ha(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_replica-ha"))
        .args(args)
        .output()
        .expect("run replica-ha")
}

#[tokio::test]
async fn inspect_shows_identity_floor_and_dirty_extents() {
    let dir = tempfile::tempdir().unwrap();
    {
        let store = ReplicaStore::open(dir.path(), StoreIdentity::new("c1", "vol0", SIZE))
            .await
            .unwrap();
        store
            .write(Term(3), 1 << 20, Bytes::from_static(b"x"), false)
            .await
            .unwrap();
        store.fence(Term(4)).await.unwrap();
    }
    let path = dir.path().to_str().unwrap();
    let size = SIZE.to_string();
    let out = replica_ha(&[
        "inspect",
        "--data-dir",
        path,
        "--cluster-id",
        "c1",
        "--size",
        &size,
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("cluster_id   c1"), "{text}");
    assert!(text.contains("fence_floor  4"), "{text}");
    assert!(text.contains("term      3  extent 1"), "{text}");
    assert!(text.contains("group        0"), "{text}");

    // The same name of another Raft group is another volume.
    let out = replica_ha(&[
        "inspect",
        "--data-dir",
        path,
        "--cluster-id",
        "c1",
        "--group",
        "2",
    ]);
    assert_eq!(out.status.code(), Some(2));
    let refused = String::from_utf8_lossy(&out.stderr);
    assert!(
        refused.contains("group 0") && refused.contains("group 2"),
        "{refused}"
    );

    let out = replica_ha(&[
        "inspect",
        "--data-dir",
        path,
        "--cluster-id",
        "other",
        "--size",
        &size,
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cluster id"));
}

#[test]
fn inspect_refuses_a_directory_without_a_replica() {
    let dir = tempfile::tempdir().unwrap();
    let out = replica_ha(&[
        "inspect",
        "--data-dir",
        dir.path().to_str().unwrap(),
        "--cluster-id",
        "c1",
        "--size",
        "4096",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("holds no replica"));
    assert!(
        !dir.path().join("meta").exists(),
        "inspect must not create a replica"
    );
}

#[test]
fn help_explains_the_commands() {
    let out = replica_ha(&["--help"]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("inspect"));
}
