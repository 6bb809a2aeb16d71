//! openraft's own storage test suite against the sled log store and state
//! machine (fresh sled Db in a temporary directory for every case).

use openraft::StorageError;
use openraft::testing::{StoreBuilder, Suite};
use replica_ha::raft::{LogStore, MemberId, StateMachine, TypeConfig};

struct SledBuilder;

impl StoreBuilder<TypeConfig, LogStore, StateMachine, tempfile::TempDir> for SledBuilder {
    async fn build(
        &self,
    ) -> Result<(tempfile::TempDir, LogStore, StateMachine), StorageError<MemberId>> {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = sled::open(dir.path()).expect("sled");
        let log = LogStore::open(&db).expect("log store");
        let sm = StateMachine::open(&db).expect("state machine");
        Ok((dir, log, sm))
    }
}

#[test]
fn sled_storage_passes_the_openraft_suite() {
    if let Err(err) = Suite::test_all(SledBuilder) {
        panic!("openraft storage suite: {err}");
    }
}

/// S7 across a restart: the vote and the log survive reopening the Db.
#[tokio::test]
async fn vote_and_log_survive_reopening() {
    use openraft::storage::{RaftLogReader, RaftLogStorage};
    use openraft::{LogId, Vote};
    let dir = tempfile::tempdir().unwrap();
    {
        let db = sled::open(dir.path()).unwrap();
        let mut log = LogStore::open(&db).unwrap();
        log.save_vote(&Vote::new_committed(7, MemberId(2)))
            .await
            .unwrap();
    }
    let db = sled::open(dir.path()).unwrap();
    let mut log = LogStore::open(&db).unwrap();
    assert_eq!(
        log.read_vote().await.unwrap(),
        Some(Vote::new_committed(7, MemberId(2)))
    );
    assert!(log.try_get_log_entries(0..10).await.unwrap().is_empty());
    let state = log.get_log_state().await.unwrap();
    assert_eq!(state.last_log_id, None::<LogId<MemberId>>);
}
