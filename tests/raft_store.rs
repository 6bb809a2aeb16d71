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

/// Reopens a Db dropped just before. sled lets go of a dropped Db's file
/// lock only once its background I/O jobs (which a flush hands work to) have
/// finished, so the reopen retries briefly, and only on that error.
async fn reopen(path: &std::path::Path) -> sled::Db {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match sled::open(path) {
            Err(err)
                if err.to_string().contains("could not acquire lock")
                    && tokio::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            outcome => return outcome.expect("reopen the Db"),
        }
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
    let db = reopen(dir.path()).await;
    let mut log = LogStore::open(&db).unwrap();
    assert_eq!(
        log.read_vote().await.unwrap(),
        Some(Vote::new_committed(7, MemberId(2)))
    );
    assert!(log.try_get_log_entries(0..10).await.unwrap().is_empty());
    let state = log.get_log_state().await.unwrap();
    assert_eq!(state.last_log_id, None::<LogId<MemberId>>);
}

/// Two groups in one Db: each has its own vote and log, and reopening the
/// Db gives each back its own.
#[tokio::test]
async fn groups_in_one_db_keep_their_votes_and_logs_apart() {
    use openraft::storage::{RaftLogStorage, RaftLogStorageExt};
    use openraft::testing::log_id;
    use openraft::{Entry, EntryPayload, Vote};
    use replica_ha::ids::GroupId;
    use replica_ha::raft::RaftDb;
    let dir = tempfile::tempdir().unwrap();
    let entry = |index| Entry::<TypeConfig> {
        log_id: log_id(1, MemberId(1), index),
        payload: EntryPayload::Blank,
    };
    {
        let db = RaftDb::new(&sled::open(dir.path()).unwrap());
        let mut first = LogStore::of_group(&db, GroupId::FIRST).unwrap();
        let mut other = LogStore::of_group(&db, GroupId(7)).unwrap();
        first
            .save_vote(&Vote::new_committed(3, MemberId(1)))
            .await
            .unwrap();
        other
            .save_vote(&Vote::new_committed(9, MemberId(2)))
            .await
            .unwrap();
        other
            .blocking_append(vec![entry(1), entry(2)])
            .await
            .unwrap();
    }
    let db = RaftDb::new(&reopen(dir.path()).await);
    let mut first = LogStore::of_group(&db, GroupId::FIRST).unwrap();
    let mut other = LogStore::of_group(&db, GroupId(7)).unwrap();
    assert_eq!(
        first.read_vote().await.unwrap(),
        Some(Vote::new_committed(3, MemberId(1)))
    );
    assert_eq!(
        other.read_vote().await.unwrap(),
        Some(Vote::new_committed(9, MemberId(2)))
    );
    assert_eq!(first.get_log_state().await.unwrap().last_log_id, None);
    assert_eq!(
        other.get_log_state().await.unwrap().last_log_id,
        Some(log_id(1, MemberId(1), 2))
    );
}

/// The upgrade path: a data dir written by a build with one group, whose
/// trees had no group in their names, is the first group's.
#[tokio::test]
async fn the_first_group_reads_the_vote_an_earlier_build_wrote() {
    use openraft::Vote;
    use openraft::storage::RaftLogStorage;
    use replica_ha::ids::GroupId;
    use replica_ha::raft::RaftDb;
    let dir = tempfile::tempdir().unwrap();
    let db = sled::open(dir.path()).unwrap();
    // What an earlier build left: the vote as JSON under `vote` in `log_meta`.
    let vote = Vote::new_committed(5, MemberId(3));
    db.open_tree("log_meta")
        .unwrap()
        .insert("vote", serde_json::to_vec(&vote).unwrap())
        .unwrap();
    let mut first = LogStore::of_group(&RaftDb::new(&db), GroupId::FIRST).unwrap();
    assert_eq!(first.read_vote().await.unwrap(), Some(vote));
    let mut other = LogStore::of_group(&RaftDb::new(&db), GroupId(1)).unwrap();
    assert_eq!(other.read_vote().await.unwrap(), None);
}
