//! The stores a node serves on its data listener, by volume name.
//!
//! A node holds copies of many volumes (#38), each in a [`ReplicaStore`]
//! of its own, and serves them all on one data listener: the replica gRPC
//! service ([`super::service`]) picks the store per request by the volume
//! its `VolumeRef` names, the block channel ([`super::blocks`]) once per
//! connection by the volume its `Hello` names. [`Stores`] is the registry
//! both read; the node adds a volume when it opens its copy and removes it
//! when the volume goes, while the listener runs.
//!
//! What this module keeps, for every invariant that rests on it:
//! - **One volume, one store.** A store is filed under the volume its own
//!   identity names, never under a name the caller passes, so a request
//!   for volume A can reach no store but A's (S2, S3: the fencing token a
//!   writer of A stamps is checked against A's floor only). A second store
//!   for a volume already served, or a store of another cluster, is
//!   refused ([`StoresError`]).
//! - **A fence notifies its own volume.** Each entry carries its volume's
//!   [`OnFenced`] (the "step down" notice to the volume's controller, S1):
//!   a fence of A's copy reaches A's controller and no other.
//! - **A volume is (cluster, name, group).** Names are reused: `volume
//!   delete db` then `volume create db` makes a new volume with a new Raft
//!   group, whose terms start low again, and terms of different groups are
//!   not comparable. So a store is found by its name *and* group
//!   ([`Stores::find`]): a request naming the name with another group (the
//!   old volume's writer, on a node that has not applied the delete yet) is
//!   refused ([`NotServed::OtherGroup`]) and never meets the new copy's
//!   floor (S2, S3). The registry holds one store per name, so a name's two
//!   groups are never served side by side.
//! - **The cluster is the node's.** The registry knows its cluster, so the
//!   servers refuse another cluster's request before any lookup (S9).
//! - **Removal.** [`Stores::remove`] takes a volume out at once: a request
//!   or a `Hello` that arrives later is refused as naming a volume this
//!   node does not hold. The block connections bound to it see it retired
//!   ([`Served::retired`]) and close as on the server's stop: they read no
//!   further frame and send the replies of what is running. What already
//!   runs finishes on the store it began on (it holds the store's `Arc`);
//!   so the store is closed only once the last of them ends, and the node
//!   removes a volume only after it stopped the volume's own use of it
//!   (controller, resync, scrub).

use std::collections::HashMap;
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use tokio::sync::watch;

use crate::ids::{GroupId, Term};
use crate::replica::disk::store::ReplicaStore;

/// Called with the new floor whenever a fence raised it: the fence a new
/// writer sends to every replica doubles as the "step down" notice to the
/// previous writer's node, for that volume's controller.
pub type OnFenced = Arc<dyn Fn(Term) + Send + Sync>;

/// Why a store could not be added.
#[derive(Debug, thiserror::Error)]
pub enum StoresError {
    /// The store belongs to a cluster other than the node's.
    #[error(
        "store of volume {volume:?} is of cluster {store:?}; this node serves cluster {node:?}"
    )]
    OtherCluster {
        volume: String,
        store: String,
        node: String,
    },
    /// A store of this volume is served already.
    #[error("volume {0:?} is served already; remove it first")]
    AlreadyServed(String),
}

/// Why a volume a request names is not served here: the servers refuse
/// it (`NOT_FOUND`, or a refused `Hello`) before any store is touched.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotServed {
    /// No store of that name.
    #[error("this node holds no copy of volume {0:?}")]
    NoCopy(String),
    /// A store of that name, of another Raft group: another volume that
    /// was given the same name (see the module docs).
    #[error(
        "this node's copy of volume {volume:?} is of group {held}, not group {asked}: a volume \
         of the same name in another group is another volume, whose terms are not this one's"
    )]
    OtherGroup {
        volume: String,
        held: GroupId,
        asked: GroupId,
    },
}

/// One volume's store as the servers use it: the store, its fence
/// callback, and whether it was removed since it was looked up.
#[derive(Clone)]
pub struct Served {
    store: Arc<ReplicaStore>,
    on_fenced: Option<OnFenced>,
    retired: watch::Receiver<bool>,
}

impl Served {
    /// The volume's store.
    pub fn store(&self) -> &Arc<ReplicaStore> {
        &self.store
    }

    /// Tells this volume's controller that its copy's floor is `floor`.
    pub fn fenced(&self, floor: Term) {
        if let Some(notify) = &self.on_fenced {
            notify(floor);
        }
    }

    /// A receiver that turns true once the volume is removed from the
    /// registry; it closes if the registry is dropped, which a server
    /// takes as the same.
    pub fn retired(&self) -> watch::Receiver<bool> {
        self.retired.clone()
    }
}

/// An entry: what the servers get, and the sender that retires it.
struct Entry {
    served: Served,
    retire: watch::Sender<bool>,
}

struct Inner {
    cluster_id: String,
    volumes: RwLock<HashMap<String, Entry>>,
}

/// The registry of the stores a node serves, by volume name; cloning it
/// shares it. See the module docs.
#[derive(Clone)]
pub struct Stores {
    inner: Arc<Inner>,
}

impl Stores {
    /// An empty registry of cluster `cluster_id`'s volumes.
    pub fn new(cluster_id: impl Into<String>) -> Self {
        Self {
            inner: Arc::new(Inner {
                cluster_id: cluster_id.into(),
                volumes: RwLock::new(HashMap::new()),
            }),
        }
    }

    /// A registry that serves `store` alone, of the cluster it names.
    pub fn one(store: Arc<ReplicaStore>, on_fenced: Option<OnFenced>) -> Self {
        let stores = Self::new(store.identity().cluster_id.clone());
        stores.write().insert(
            store.identity().volume.clone(),
            Self::entry(store, on_fenced),
        );
        stores
    }

    /// The cluster whose volumes this registry holds.
    pub fn cluster_id(&self) -> &str {
        &self.inner.cluster_id
    }

    /// Serves `store` as the volume its identity names, with that
    /// volume's fence callback.
    pub fn insert(
        &self,
        store: Arc<ReplicaStore>,
        on_fenced: Option<OnFenced>,
    ) -> Result<(), StoresError> {
        let identity = store.identity();
        if identity.cluster_id != self.inner.cluster_id {
            return Err(StoresError::OtherCluster {
                volume: identity.volume.clone(),
                store: identity.cluster_id.clone(),
                node: self.inner.cluster_id.clone(),
            });
        }
        let volume = identity.volume.clone();
        let mut volumes = self.write();
        if volumes.contains_key(&volume) {
            return Err(StoresError::AlreadyServed(volume));
        }
        volumes.insert(volume, Self::entry(store, on_fenced));
        Ok(())
    }

    /// Stops serving `volume`: later requests for it are refused, and its
    /// block connections close (see the module docs). The store it served,
    /// if any.
    pub fn remove(&self, volume: &str) -> Option<Arc<ReplicaStore>> {
        let entry = self.write().remove(volume)?;
        entry.retire.send_replace(true);
        Some(entry.served.store)
    }

    /// The store of `volume`, if this node serves it.
    pub fn get(&self, volume: &str) -> Option<Served> {
        self.read().get(volume).map(|entry| entry.served.clone())
    }

    /// The store of `volume` of Raft group `group`, if this node serves
    /// it; a store of that name but another group is not it (see the
    /// module docs).
    pub fn find(&self, volume: &str, group: GroupId) -> Result<Served, NotServed> {
        let served = self
            .get(volume)
            .ok_or_else(|| NotServed::NoCopy(volume.to_string()))?;
        let held = served.store.identity().group;
        if held != group {
            return Err(NotServed::OtherGroup {
                volume: volume.to_string(),
                held,
                asked: group,
            });
        }
        Ok(served)
    }

    /// The volumes served, by name.
    pub fn volumes(&self) -> Vec<String> {
        let mut names: Vec<String> = self.read().keys().cloned().collect();
        names.sort();
        names
    }

    fn entry(store: Arc<ReplicaStore>, on_fenced: Option<OnFenced>) -> Entry {
        let (retire, retired) = watch::channel(false);
        Entry {
            served: Served {
                store,
                on_fenced,
                retired,
            },
            retire,
        }
    }

    // A panic while the lock was held cannot leave the map half-changed
    // (every change is one insert or remove), so a poisoned lock is used
    // as it is.
    fn read(&self) -> RwLockReadGuard<'_, HashMap<String, Entry>> {
        self.inner
            .volumes
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, HashMap<String, Entry>> {
        self.inner
            .volumes
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::*;
    use crate::replica::disk::store::StoreIdentity;

    async fn store(dir: &tempfile::TempDir, cluster: &str, volume: &str) -> Arc<ReplicaStore> {
        let identity = StoreIdentity::new(cluster, volume, 1 << 20);
        Arc::new(
            ReplicaStore::open(&dir.path().join(volume), identity)
                .await
                .unwrap(),
        )
    }

    /// A store is filed under the volume its own identity names, with its
    /// own fence callback; a second store of that volume, or one of
    /// another cluster, is refused and the first stays served.
    #[tokio::test]
    async fn a_store_is_served_as_its_own_volume_and_only_once() {
        let dir = tempfile::tempdir().unwrap();
        let stores = Stores::new("c1");
        let a = store(&dir, "c1", "a").await;
        let fenced = Arc::new(AtomicU64::new(0));
        let notify: OnFenced = {
            let fenced = Arc::clone(&fenced);
            Arc::new(move |floor: Term| fenced.store(floor.0, Ordering::SeqCst))
        };
        stores.insert(Arc::clone(&a), Some(notify)).unwrap();
        let served = stores.get("a").expect("a is served");
        assert!(Arc::ptr_eq(served.store(), &a));
        served.fenced(Term(3));
        assert_eq!(fenced.load(Ordering::SeqCst), 3);
        assert!(stores.get("b").is_none());

        let again = stores.insert(Arc::clone(&a), None).unwrap_err();
        assert!(matches!(again, StoresError::AlreadyServed(ref v) if v == "a"));
        let foreign = stores
            .insert(store(&dir, "c2", "b").await, None)
            .unwrap_err();
        assert!(
            matches!(foreign, StoresError::OtherCluster { .. }),
            "{foreign}"
        );
        assert_eq!(stores.volumes(), ["a"]);
    }

    /// A store is found by its name and its group: the same name with
    /// another group (a deleted volume's writer, the name since reused) is
    /// another volume, refused naming both groups.
    #[tokio::test]
    async fn a_store_is_found_by_its_name_and_group_only() {
        let dir = tempfile::tempdir().unwrap();
        let stores = Stores::new("c1");
        let identity = StoreIdentity::new("c1", "db", 1 << 20).in_group(GroupId(2));
        let db = Arc::new(
            ReplicaStore::open(&dir.path().join("db"), identity)
                .await
                .unwrap(),
        );
        stores.insert(Arc::clone(&db), None).unwrap();
        let served = stores.find("db", GroupId(2)).expect("db of group 2");
        assert!(Arc::ptr_eq(served.store(), &db));
        for asked in [GroupId(0), GroupId(1), GroupId(3)] {
            let refused = stores.find("db", asked).err().expect("another group");
            assert_eq!(
                refused,
                NotServed::OtherGroup {
                    volume: "db".into(),
                    held: GroupId(2),
                    asked,
                }
            );
            let text = refused.to_string();
            assert!(
                text.contains("group 2") && text.contains(&format!("group {asked}")),
                "{text}"
            );
        }
        let missing = stores.find("nowhere", GroupId(2)).err().expect("no copy");
        assert_eq!(missing, NotServed::NoCopy("nowhere".into()));
    }

    /// Removing a volume retires what was looked up of it and leaves the
    /// others served.
    #[tokio::test]
    async fn removing_a_volume_retires_it_and_leaves_the_others() {
        let dir = tempfile::tempdir().unwrap();
        let stores = Stores::new("c1");
        stores.insert(store(&dir, "c1", "a").await, None).unwrap();
        stores.insert(store(&dir, "c1", "b").await, None).unwrap();
        let (a, b) = (stores.get("a").unwrap(), stores.get("b").unwrap());

        assert!(stores.remove("a").is_some());
        assert!(stores.remove("a").is_none());
        assert!(*a.retired().borrow());
        assert!(!*b.retired().borrow());
        assert!(stores.get("a").is_none());
        assert_eq!(stores.volumes(), ["b"]);
    }
}
