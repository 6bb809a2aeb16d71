//! The exports one NBD listener serves, by name: a registry the node
//! fills with the volumes it holds a copy of, while the listener runs.
//!
//! - **Choice by name.** `NBD_OPT_GO`, `NBD_OPT_INFO`, `NBD_OPT_EXPORT_NAME`
//!   and the meta context options all name the export; the name is looked
//!   up here at that moment. `NBD_OPT_LIST` lists every export registered
//!   then, with its description.
//! - **The empty name** (a client's default) means the registry's default
//!   export, which the node sets to its configured volume, so a client of a
//!   single-volume node that names nothing keeps working. Without a default
//!   it is refused like an unknown name.
//! - **A name this node does not serve** is refused with what the node
//!   knows of it: the [`Lookup`] the node supplies answers, in words, which
//!   nodes hold the volume ("volume db is held by nodes 2, 3, 5"); without
//!   an answer the refusal says there is no such volume on this node.
//! - **Exports come and go.** [`Exports::insert`] and [`Exports::remove`]
//!   change only what the next choice finds: a connection that already
//!   chose an export holds its `Arc<Export>` until it ends. Inserting a
//!   name that is registered replaces its export for new choices only.
//! - **Admission is the listener's** ([`super::Admission`]): TLS and the
//!   grant of a client without a certificate are set once, when the
//!   registry is built, and hold for every export, because a client
//!   upgrades to TLS and is admitted before it names one.
//!
//! Clones share one table (cheap: a few `Arc`s), so the node keeps one to
//! add and remove volumes while the listener serves another. The table's
//! lock is held only to read or change the map, never across an await or
//! a callback, and a poisoned lock is used as it stands (no writer panics
//! while holding it), so no client can make the registry panic.

use std::collections::BTreeMap;
use std::sync::{Arc, PoisonError, RwLock};

use super::{Admission, Export, ExportTls, Grant};

/// What a node knows of a volume it holds no copy of: given the name a
/// client asked for, a sentence naming the nodes that hold it, or `None`
/// when the node knows of no such volume. Called during a client's
/// handshake, so it must answer at once (from memory, not the network).
pub type Lookup = dyn Fn(&str) -> Option<String> + Send + Sync;

/// The exports a listener serves; see the module docs.
#[derive(Clone)]
pub struct Exports {
    /// Shared by every clone.
    table: Arc<RwLock<Table>>,
    /// Fixed once built; see [`Exports::with_tls`].
    admission: Arc<Admission>,
    /// What the node knows of volumes it does not serve.
    elsewhere: Option<Arc<Lookup>>,
}

/// The registered exports, and which of them the empty name means.
#[derive(Default)]
struct Table {
    by_name: BTreeMap<String, Arc<Export>>,
    default: Option<String>,
}

impl Default for Exports {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Exports {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exports")
            .field("names", &self.names())
            .field("default", &self.read().default)
            .field("tls", &self.admission.has_tls())
            .field("anonymous", &self.admission.anonymous)
            .finish()
    }
}

impl Exports {
    /// No exports, no TLS, and a client without a certificate may write
    /// (as `attach`'s local socket).
    pub fn new() -> Self {
        Self {
            table: Arc::default(),
            admission: Arc::new(Admission::default()),
            elsewhere: None,
        }
    }

    /// A registry holding `export` alone, as the default: a listener of
    /// one volume.
    pub fn single(export: Arc<Export>) -> Self {
        let exports = Self::new();
        exports.set_default(export.name.clone());
        exports.insert(export);
        exports
    }

    /// The same registry, offering TLS as `tls` says, for every export.
    /// Admission is set while building: clones made before keep theirs.
    pub fn with_tls(mut self, tls: ExportTls) -> Self {
        Arc::make_mut(&mut self.admission).tls = Some(tls);
        self
    }

    /// The same registry, granting `grant` to a client without a
    /// certificate (by default [`Grant::ReadWrite`]). Set while building,
    /// as [`Exports::with_tls`].
    pub fn with_anonymous(mut self, grant: Grant) -> Self {
        Arc::make_mut(&mut self.admission).anonymous = grant;
        self
    }

    /// The same registry, answering a name it does not serve with what
    /// `lookup` says of it (see [`Lookup`]).
    pub fn with_lookup(
        mut self,
        lookup: impl Fn(&str) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.elsewhere = Some(Arc::new(lookup));
        self
    }

    /// Serves `export` under its name from the next choice on; returns the
    /// export it replaces, whose open connections go on.
    pub fn insert(&self, export: Arc<Export>) -> Option<Arc<Export>> {
        self.write().by_name.insert(export.name.clone(), export)
    }

    /// Stops offering the export named `name` to new choices; connections
    /// that chose it go on. The default name, if it is this one, stays and
    /// finds the export again once one is inserted under it.
    pub fn remove(&self, name: &str) -> Option<Arc<Export>> {
        self.write().by_name.remove(name)
    }

    /// Makes the empty name mean the export named `name`.
    pub fn set_default(&self, name: impl Into<String>) {
        self.write().default = Some(name.into());
    }

    /// The export a client naming `name` gets now: the empty name is the
    /// default export.
    pub fn get(&self, name: &str) -> Option<Arc<Export>> {
        self.choose(name.as_bytes()).ok()
    }

    /// The names of the registered exports, in order.
    pub fn names(&self) -> Vec<String> {
        self.read().by_name.keys().cloned().collect()
    }

    /// Every registered export, in name order, for `NBD_OPT_LIST`.
    pub(super) fn listed(&self) -> Vec<Arc<Export>> {
        self.read().by_name.values().cloned().collect()
    }

    /// Who may come in, and as what; the same for every export.
    pub(super) fn admission(&self) -> Arc<Admission> {
        Arc::clone(&self.admission)
    }

    /// The export a client asking for `name` (as sent, maybe not UTF-8)
    /// gets, or the refusal to send it, in words.
    pub(super) fn choose(&self, name: &[u8]) -> Result<Arc<Export>, String> {
        let Ok(name) = std::str::from_utf8(name) else {
            return Err(format!(
                "no export named {:?}: export names are UTF-8",
                String::from_utf8_lossy(name)
            ));
        };
        if !name.is_empty() {
            return self.named(name).ok_or_else(|| self.missing(name));
        }
        let default = self.read().default.clone();
        let Some(default) = default else {
            return Err("this node has no default export: name a volume \
                        (NBD_OPT_LIST lists them)"
                .to_string());
        };
        self.named(&default)
            .ok_or_else(|| format!("the default export: {}", self.missing(&default)))
    }

    fn named(&self, name: &str) -> Option<Arc<Export>> {
        self.read().by_name.get(name).cloned()
    }

    /// Why `name` is not served here: the node's lookup, or that it knows
    /// of no such volume. Called without the table's lock held.
    fn missing(&self, name: &str) -> String {
        self.elsewhere
            .as_ref()
            .and_then(|lookup| lookup(name))
            .unwrap_or_else(|| format!("there is no volume {name:?} on this node"))
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Table> {
        self.table.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Table> {
        self.table.write().unwrap_or_else(PoisonError::into_inner)
    }
}
