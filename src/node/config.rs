//! A node's configuration: a TOML file, with command-line flags on top.
//!
//! ```toml
//! id = 1
//! cluster_id = "local"
//! listen = "127.0.0.1:7001"
//! data_dir = "cluster/data/node1"
//! peers = ["1=127.0.0.1:7001", "2=127.0.0.1:7002", "3=127.0.0.1:7003"]
//! size = "1GiB"
//! min_in_sync = 2
//!
//! [tls]
//! dir = "cluster/data/certs"   # ca.crt, node-1.crt, node-1.key
//! ```
//!
//! Every node of a cluster starts with the same peer list (its own entry
//! included). Validation refuses, with one line naming the problem: a
//! duplicate id, an id missing from the peers, `min_in_sync` of 0 or larger
//! than the cluster, an address that does not parse, a size that is not a
//! positive multiple of 512, no certificates without `insecure = true`.
//! The data dir of another cluster is refused when the node opens it, and
//! a certificate that is missing, unreadable, expired or not this node's
//! of this cluster when the node loads it (all exit code 2).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::certs::TlsFiles;
use crate::raft::{NodeId, RaftTiming};

/// A configuration error: the node refuses to start (exit code 2).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

fn fail<T>(message: impl Into<String>) -> Result<T, ConfigError> {
    Err(ConfigError(message.into()))
}

/// The configuration file, as written.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    /// This node's id (a positive integer).
    pub id: Option<NodeId>,
    /// The cluster's id; every node of a cluster uses the same.
    pub cluster_id: Option<String>,
    /// The volume's name.
    pub volume: Option<String>,
    /// gRPC listen address (Raft and admin services).
    pub listen: Option<String>,
    /// The replica (block data) service's listen address; by default the
    /// gRPC host with a port the OS picks.
    pub data_listen: Option<String>,
    /// Peers' data addresses, `ID=HOST:PORT`, where they cannot be asked
    /// (a proxy, NAT); by default each peer is asked.
    pub peer_data: Option<Vec<String>>,
    /// Where this node keeps its replica and its Raft state.
    pub data_dir: Option<PathBuf>,
    /// NBD listen address.
    pub nbd: Option<String>,
    /// HTTP (metrics, health) listen address.
    pub http: Option<String>,
    /// Every node, `ID=HOST:PORT`.
    pub peers: Option<Vec<String>>,
    /// The volume size: bytes, or with a KiB/MiB/GiB/TiB suffix.
    pub size: Option<toml::Value>,
    /// The fewest in-sync replicas a write is acknowledged on.
    pub min_in_sync: Option<usize>,
    /// The most bytes per second a resync copies ("0" for no limit).
    pub resync_rate: Option<toml::Value>,
    /// Bytes per second the writer's background scrub compares ("0": off).
    pub scrub_rate: Option<toml::Value>,
    /// Append the gate's history to this file (see `node::journal`).
    pub gate_journal: Option<PathBuf>,
    /// Raft timing, in milliseconds.
    pub raft: Option<RaftFile>,
    /// Seconds a write is held while too few replicas are in sync, before
    /// it fails (0: fail at once).
    pub suspend_timeout: Option<u64>,
    /// The writer replaces a waiting new incarnation of a node by itself.
    pub auto_replace: Option<bool>,
    /// Seconds the old incarnation must have been silent first.
    pub auto_replace_after: Option<u64>,
    /// Seconds a writer keeps a volume before the balancer may move it
    /// towards its preferred node; 0 turns the balancer off.
    pub balance_interval: Option<u64>,
    /// Run without TLS: no authentication on any connection.
    pub insecure: Option<bool>,
    /// The node's certificate files.
    pub tls: Option<TlsFile>,
    /// TLS on the NBD export: "off", "optional" or "require"; not set,
    /// "off" on loopback and "require" beyond it (see [`NbdTls`]).
    pub nbd_tls: Option<String>,
    /// Whether NBD clients must present a certificate from the cluster CA;
    /// not set, `true` where `nbd_tls` defaulted to "require".
    pub nbd_client_auth: Option<bool>,
}

/// The `[tls]` table as written: `dir` (holding `ca.crt` and
/// `node-<id>.crt/.key`) and/or the three paths one by one.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsFile {
    pub dir: Option<PathBuf>,
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
}

/// Raft timing as written.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RaftFile {
    /// Heartbeat interval.
    pub heartbeat_ms: Option<u64>,
    /// Shortest election timeout.
    pub election_min_ms: Option<u64>,
    /// Longest election timeout.
    pub election_max_ms: Option<u64>,
    /// Lease safety margin.
    pub lease_margin_ms: Option<u64>,
}

/// Flags that override the file.
#[derive(Debug, Default, Clone)]
pub struct Overrides {
    pub id: Option<NodeId>,
    pub cluster_id: Option<String>,
    pub listen: Option<String>,
    pub data_listen: Option<String>,
    /// `ID=HOST:PORT`; replaces the file's entry for that id, or adds one.
    pub peer_data: Vec<String>,
    pub data_dir: Option<PathBuf>,
    pub nbd: Option<String>,
    pub http: Option<String>,
    /// `ID=HOST:PORT`; replaces the file's entry for that id, or adds one.
    pub peers: Vec<String>,
    pub size: Option<String>,
    pub min_in_sync: Option<usize>,
    /// Bytes per second, with an optional KiB/MiB/GiB suffix; "0" for none.
    pub resync_rate: Option<String>,
    /// Bytes per second, with an optional KiB/MiB/GiB suffix; "0" for off.
    pub scrub_rate: Option<String>,
    pub gate_journal: Option<PathBuf>,
    /// `--suspend-timeout SECONDS`.
    pub suspend_timeout: Option<u64>,
    /// `--auto-replace`.
    pub auto_replace: bool,
    /// `--auto-replace-after SECONDS`.
    pub auto_replace_after: Option<u64>,
    /// `--balance-interval SECONDS`.
    pub balance_interval: Option<u64>,
    /// `--insecure`: no TLS.
    pub insecure: bool,
    /// `--tls-dir`, `--tls-ca`, `--tls-cert`, `--tls-key`.
    pub tls: TlsFile,
    /// `--nbd-tls off|optional|require`.
    pub nbd_tls: Option<String>,
    /// `--nbd-client-auth`.
    pub nbd_client_auth: bool,
}

/// Whether the NBD export speaks TLS (`NBD_OPT_STARTTLS`).
///
/// Not set, it follows the listen address (secure by default): `off` on
/// loopback, where only this machine reaches the port; `require` beyond it,
/// with `nbd_client_auth` then `true` unless set, so nobody without a
/// certificate of the cluster CA reaches the volume. `off` beyond loopback
/// must be asked for, and the node warns at start
/// ([`NodeConfig::nbd_plaintext_exposed`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NbdTls {
    /// Plaintext only, as qemu-nbd and nbdkit by default.
    #[default]
    Off,
    /// A client may upgrade to TLS.
    Optional,
    /// A client must upgrade before anything else (`NBD_REP_ERR_TLS_REQD`).
    Require,
}

/// A validated node configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeConfig {
    pub id: NodeId,
    pub cluster_id: String,
    pub volume: String,
    pub listen: SocketAddr,
    /// The replica service's listener (port 0: the OS picks).
    pub data_listen: SocketAddr,
    /// Peers' data addresses fixed by the configuration.
    pub peer_data: BTreeMap<NodeId, String>,
    pub data_dir: PathBuf,
    pub nbd: Option<SocketAddr>,
    pub http: Option<SocketAddr>,
    /// Every node, this one included.
    pub peers: BTreeMap<NodeId, SocketAddr>,
    pub size: u64,
    pub min_in_sync: usize,
    /// Bytes per second a resync may copy (0: no limit).
    pub resync_rate: u64,
    /// Bytes per second the writer's scrub compares (0: only on request).
    pub scrub_rate: u64,
    /// Where the gate journal goes, if anywhere.
    pub gate_journal: Option<PathBuf>,
    pub timing: RaftTiming,
    /// How long a write is held below `min_in_sync` before it fails.
    pub suspend_timeout: Duration,
    /// With `auto_replace`, how long a member's old incarnation must have
    /// been silent before the writer replaces it by the new one that waits
    /// (see `node::membership`); `None`: only `members replace` does.
    pub auto_replace: Option<Duration>,
    /// How long a writer keeps a table volume before the balancer may
    /// hand it to the volume's preferred writer (`node::balance`); `None`:
    /// the balancer is off.
    pub balance_interval: Option<Duration>,
    /// The node's certificate files, when configured.
    pub tls: Option<TlsFiles>,
    /// No TLS between nodes and on the admin API (`insecure = true`).
    pub insecure: bool,
    pub nbd_tls: NbdTls,
    /// NBD clients must present a certificate from the cluster CA.
    pub nbd_client_auth: bool,
}

/// How long a write is held, by default, while too few replicas are in
/// sync (design C2): long enough to ride out a node's restart and the
/// rebuild of what it missed, as DRBD's `suspend-io` and multipath's
/// `queue_if_no_path` ride out a lost path; short enough that an
/// application whose cluster lost a replica for good hears of it within
/// two minutes instead of hanging. Linux's own SCSI command timeout is 30
/// s; a held write is not a stuck one, so this allows four times that.
pub const DEFAULT_SUSPEND_TIMEOUT: Duration = Duration::from_secs(120);

/// How long a member's old incarnation must have been silent before
/// `auto_replace` swaps it for a waiting new one: long past any restart or
/// network blip of the old one (a replacement costs a full rebuild), short
/// against the hours a replaced disk would otherwise wait for an operator.
pub const DEFAULT_AUTO_REPLACE_AFTER: Duration = Duration::from_secs(60);

/// How long, by default, a writer keeps a volume before the balancer may
/// move it: each move pauses the volume's clients for a drained hand-over
/// (tens of milliseconds), so a writer that just moved, or just took over
/// from a failed node, stays put for half a minute; a node that returns
/// gets its share back about that long after it is in sync.
pub const DEFAULT_BALANCE_INTERVAL: Duration = Duration::from_secs(30);

/// The default resync copy limit: 128 MiB/s, well under a disk's speed so
/// client I/O keeps its share.
pub const DEFAULT_RESYNC_RATE: u64 = 128 * 1024 * 1024;

/// The default scrub rate: 4 MiB of every in-sync replica compared per
/// second. Gentle: a fraction of a percent of a disk's bandwidth, and a
/// pass over 1 TiB takes about three days, about as often as Ceph
/// deep-scrubs (weekly by default) and more often than a typical monthly
/// RAID scrub.
pub const DEFAULT_SCRUB_RATE: u64 = 4 * 1024 * 1024;

impl NodeConfig {
    /// Reads `path` (if given), applies `overrides` and validates.
    pub fn load(path: Option<&Path>, overrides: Overrides) -> Result<Self, ConfigError> {
        let file = match path {
            None => ConfigFile::default(),
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| ConfigError(format!("cannot read {}: {e}", path.display())))?;
                toml::from_str(&text).map_err(|e| {
                    ConfigError(format!("{}: {}", path.display(), e.message().trim()))
                })?
            }
        };
        Self::build(file, overrides)
    }

    /// Merges and validates.
    pub fn build(file: ConfigFile, flags: Overrides) -> Result<Self, ConfigError> {
        let Some(id) = flags.id.or(file.id) else {
            return fail("no node id: set `id` in the config or pass --id");
        };
        check_node_id("node", id)?;
        let cluster_id = flags
            .cluster_id
            .or(file.cluster_id)
            .unwrap_or_else(|| "replica-ha".into());
        if cluster_id.is_empty() {
            return fail("cluster_id is empty");
        }
        let listen = parse_addr(
            "listen",
            &flags.listen.or(file.listen).ok_or_else(|| {
                ConfigError("no listen address: set `listen` or pass --listen".into())
            })?,
        )?;
        let data_listen = match flags.data_listen.or(file.data_listen) {
            Some(text) => parse_addr("data_listen", &text)?,
            None => SocketAddr::new(listen.ip(), 0),
        };
        let mut peer_data = BTreeMap::new();
        for entry in file
            .peer_data
            .unwrap_or_default()
            .into_iter()
            .chain(flags.peer_data)
        {
            let (peer, addr) = parse_peer(&entry)?;
            peer_data.insert(peer, addr.to_string());
        }
        let data_dir = flags
            .data_dir
            .or(file.data_dir)
            .ok_or_else(|| ConfigError("no data dir: set `data_dir` or pass --data-dir".into()))?;
        let nbd = flags
            .nbd
            .or(file.nbd)
            .map(|a| parse_addr("nbd", &a))
            .transpose()?;
        let http = flags
            .http
            .or(file.http)
            .map(|a| parse_addr("http", &a))
            .transpose()?;

        let mut peers = BTreeMap::new();
        for entry in file.peers.unwrap_or_default() {
            let (peer, addr) = parse_peer(&entry)?;
            if peers.insert(peer, addr).is_some() {
                return fail(format!(
                    "duplicate peer id {peer} in the config's peer list"
                ));
            }
        }
        let mut overridden = BTreeMap::new();
        for entry in flags.peers {
            let (peer, addr) = parse_peer(&entry)?;
            if overridden.insert(peer, addr).is_some() {
                return fail(format!("duplicate peer id {peer} in --peer flags"));
            }
        }
        peers.extend(overridden);
        if !peers.contains_key(&id) {
            return fail(format!(
                "this node's id {id} is not in the peer list ({})",
                peers
                    .keys()
                    .map(|p| p.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }

        let size = match (flags.size, file.size) {
            (Some(text), _) => parse_size(&text)?,
            (None, Some(toml::Value::Integer(n))) if n > 0 => n as u64,
            (None, Some(toml::Value::String(text))) => parse_size(&text)?,
            (None, Some(other)) => return fail(format!("size {other} is not a size")),
            (None, None) => 1024 * 1024 * 1024,
        };
        if size == 0 || size % 512 != 0 {
            return fail(format!(
                "size {size} is not a positive multiple of 512 bytes"
            ));
        }
        let min_in_sync = flags
            .min_in_sync
            .or(file.min_in_sync)
            .unwrap_or(peers.len() / 2 + 1);
        if min_in_sync == 0 || min_in_sync > peers.len() {
            return fail(format!(
                "min_in_sync {min_in_sync} must be between 1 and the number of nodes ({})",
                peers.len()
            ));
        }

        let resync_rate = parse_rate(
            "resync_rate",
            flags.resync_rate,
            file.resync_rate,
            DEFAULT_RESYNC_RATE,
        )?;
        let scrub_rate = parse_rate(
            "scrub_rate",
            flags.scrub_rate,
            file.scrub_rate,
            DEFAULT_SCRUB_RATE,
        )?;

        let raft = file.raft.unwrap_or_default();
        let defaults = RaftTiming::default();
        let ms = |value: Option<u64>, default: Duration| {
            value.map(Duration::from_millis).unwrap_or(default)
        };
        let timing = RaftTiming {
            heartbeat: ms(raft.heartbeat_ms, defaults.heartbeat),
            election_min: ms(raft.election_min_ms, defaults.election_min),
            election_max: ms(raft.election_max_ms, defaults.election_max),
            lease_margin: ms(raft.lease_margin_ms, defaults.lease_margin),
        };
        if timing.lease_margin >= timing.election_min {
            return fail("raft.lease_margin_ms must be below raft.election_min_ms");
        }
        timing
            .raft_config(&cluster_id)
            .map_err(|e| ConfigError(format!("raft timing: {e}")))?;

        let tls = tls_files(id, file.tls.unwrap_or_default(), flags.tls)?;
        let insecure = flags.insecure || file.insecure.unwrap_or(false);
        if !insecure && tls.is_none() {
            return fail(
                "TLS is on by default and no certificates are configured: set [tls] dir (or ca, \
                 cert and key) or pass --tls-dir DIR (make them with `replica-ha certs`), or \
                 pass --insecure to run without authentication",
            );
        }
        // Secure by default: an NBD listener beyond loopback requires TLS
        // and client certificates unless the configuration says otherwise.
        let exposed = nbd.filter(beyond_loopback);
        let given_tls = flags.nbd_tls.or(file.nbd_tls);
        let nbd_tls = match (given_tls.as_deref(), exposed) {
            (Some("off"), _) | (None, None) => NbdTls::Off,
            (Some("optional"), _) => NbdTls::Optional,
            (Some("require"), _) | (None, Some(_)) => NbdTls::Require,
            (Some(other), _) => {
                return fail(format!(
                    "nbd_tls {other:?} is not one of off, optional, require"
                ));
            }
        };
        if nbd_tls != NbdTls::Off && tls.is_none() {
            return fail(match (given_tls, exposed) {
                (None, Some(addr)) => format!(
                    "NBD listens on {addr}, beyond loopback, where it requires TLS and client \
                     certificates by default, which need the node's certificates: set [tls] or \
                     pass --tls-dir, or set nbd_tls = \"off\" to let anyone who reaches the \
                     port read and write the volume"
                ),
                _ => "nbd_tls needs the node's certificates: set [tls] or pass --tls-dir".into(),
            });
        }
        let nbd_client_auth = match (flags.nbd_client_auth, file.nbd_client_auth) {
            (true, _) => true,
            (false, Some(given)) => given,
            (false, None) => exposed.is_some() && nbd_tls == NbdTls::Require,
        };
        if nbd_client_auth && nbd_tls == NbdTls::Off {
            return fail("nbd_client_auth needs nbd_tls = \"optional\" or \"require\"");
        }

        if let Some(unknown) = peer_data.keys().find(|id| !peers.contains_key(id)) {
            return fail(format!(
                "peer_data names node {unknown}, which is not a peer"
            ));
        }

        Ok(NodeConfig {
            id,
            cluster_id,
            volume: file.volume.unwrap_or_else(|| "vol0".into()),
            listen,
            data_listen,
            peer_data,
            data_dir,
            nbd,
            http,
            peers,
            size,
            min_in_sync,
            resync_rate,
            scrub_rate,
            gate_journal: flags.gate_journal.or(file.gate_journal),
            timing,
            suspend_timeout: flags
                .suspend_timeout
                .or(file.suspend_timeout)
                .map_or(DEFAULT_SUSPEND_TIMEOUT, Duration::from_secs),
            auto_replace: (flags.auto_replace || file.auto_replace.unwrap_or(false)).then(|| {
                flags
                    .auto_replace_after
                    .or(file.auto_replace_after)
                    .map_or(DEFAULT_AUTO_REPLACE_AFTER, Duration::from_secs)
            }),
            balance_interval: match flags.balance_interval.or(file.balance_interval) {
                None => Some(DEFAULT_BALANCE_INTERVAL),
                Some(0) => None,
                Some(secs) => Some(Duration::from_secs(secs)),
            },
            tls,
            insecure,
            nbd_tls,
            nbd_client_auth,
        })
    }

    /// Whether the NBD listener is bound beyond loopback: to any address
    /// but 127.0.0.0/8 and ::1 (0.0.0.0 and :: included).
    pub fn nbd_exposed(&self) -> bool {
        self.nbd.as_ref().is_some_and(beyond_loopback)
    }

    /// Whether the NBD export is plaintext beyond loopback (`nbd_tls =
    /// "off"` asked for explicitly): anyone who reaches the port may read
    /// and write the volume.
    pub fn nbd_plaintext_exposed(&self) -> bool {
        self.nbd_exposed() && self.nbd_tls == NbdTls::Off
    }

    /// Whether a client without a certificate (plaintext, or TLS without
    /// one, where `nbd_client_auth` is off) may write through NBD: on
    /// loopback, and with `nbd_tls = "off"`; beyond loopback with TLS on,
    /// it only reads.
    pub fn nbd_anonymous_writes(&self) -> bool {
        !self.nbd_exposed() || self.nbd_tls == NbdTls::Off
    }
}

/// Whether a listener bound to `addr` can be reached from beyond this
/// machine: any address but 127.0.0.0/8 and ::1.
fn beyond_loopback(addr: &SocketAddr) -> bool {
    !addr.ip().is_loopback()
}

/// A rate in bytes per second from the flag (which wins) or the file:
/// bytes, or with a KiB/MiB/GiB suffix and an optional "/s"; "0" is 0.
fn parse_rate(
    name: &str,
    flag: Option<String>,
    file: Option<toml::Value>,
    default: u64,
) -> Result<u64, ConfigError> {
    match flag.map(toml::Value::String).or(file) {
        None => Ok(default),
        Some(toml::Value::Integer(n)) if n >= 0 => Ok(n as u64),
        Some(toml::Value::String(text)) if text.trim() == "0" => Ok(0),
        Some(toml::Value::String(text)) => parse_size(text.trim_end_matches("/s")),
        Some(other) => fail(format!("{name} {other} is not a rate")),
    }
}

/// The node's certificate files from the file's `[tls]` and the flags
/// (which win): `dir` gives `ca.crt` and `node-<id>.crt/.key`, and `ca`,
/// `cert`, `key` replace any of them; without a `dir`, all three are
/// needed.
fn tls_files(id: NodeId, file: TlsFile, flags: TlsFile) -> Result<Option<TlsFiles>, ConfigError> {
    let dir = flags.dir.or(file.dir);
    let (ca, cert, key) = (
        flags.ca.or(file.ca),
        flags.cert.or(file.cert),
        flags.key.or(file.key),
    );
    let named = [ca.is_some(), cert.is_some(), key.is_some()];
    if dir.is_none() && named.contains(&true) && named.contains(&false) {
        return fail("[tls] needs all of ca, cert and key (or a dir)");
    }
    let default = dir.map(|dir| TlsFiles::for_node(&dir, id));
    Ok(TlsFiles::with_overrides(default, ca, cert, key))
}

fn parse_addr(what: &str, text: &str) -> Result<SocketAddr, ConfigError> {
    text.parse().map_err(|_| {
        ConfigError(format!(
            "{what} address {text:?} is not HOST:PORT (an IP address and a port)"
        ))
    })
}

/// Node ids are positive and fit a Raft member id (see [`crate::ids`]).
pub fn check_node_id(what: &str, id: NodeId) -> Result<(), ConfigError> {
    if id == NodeId(0) {
        return fail(format!(
            "{what} id 0 is not allowed; ids are positive integers"
        ));
    }
    if id.0 > crate::ids::MAX_NODE_ID {
        return fail(format!(
            "{what} id {id} is too large; ids go up to {}",
            crate::ids::MAX_NODE_ID
        ));
    }
    Ok(())
}

fn parse_peer(entry: &str) -> Result<(NodeId, SocketAddr), ConfigError> {
    let Some((id, addr)) = entry.split_once('=') else {
        return fail(format!("peer {entry:?} is not ID=HOST:PORT"));
    };
    let id: NodeId = id
        .trim()
        .parse()
        .map_err(|_| ConfigError(format!("peer id {id:?} is not a positive integer")))?;
    check_node_id("peer", id)?;
    Ok((id, parse_addr(&format!("peer {id}"), addr.trim())?))
}

/// Parses `1073741824`, `1GiB`, `512MiB`, `64KiB`, `1TiB` (also `G`, `M`,
/// `K`, `T`).
pub fn parse_size(text: &str) -> Result<u64, ConfigError> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    let number: u64 = digits
        .parse()
        .map_err(|_| ConfigError(format!("size {text:?} does not start with a number")))?;
    let shift = match unit.trim() {
        "" | "B" => 0,
        "K" | "KiB" => 10,
        "M" | "MiB" => 20,
        "G" | "GiB" => 30,
        "T" | "TiB" => 40,
        other => {
            return fail(format!(
                "size unit {other:?} is not one of B, KiB, MiB, GiB, TiB"
            ));
        }
    };
    number
        .checked_mul(1u64 << shift)
        .ok_or_else(|| ConfigError(format!("size {text:?} is too large")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn three() -> Vec<String> {
        vec![
            "1=127.0.0.1:7001".into(),
            "2=127.0.0.1:7002".into(),
            "3=127.0.0.1:7003".into(),
        ]
    }

    fn flags(id: u64) -> Overrides {
        Overrides {
            id: Some(NodeId(id)),
            listen: Some("127.0.0.1:7001".into()),
            data_dir: Some("/tmp/x".into()),
            peers: three(),
            tls: TlsFile {
                dir: Some("/tmp/certs".into()),
                ..TlsFile::default()
            },
            ..Default::default()
        }
    }

    fn error(file: &str, overrides: Overrides) -> String {
        let file: ConfigFile = toml::from_str(file).unwrap();
        NodeConfig::build(file, overrides).unwrap_err().0
    }

    #[test]
    fn a_full_file_parses_with_defaults() {
        let file: ConfigFile = toml::from_str(
            r#"
            id = 2
            cluster_id = "c"
            listen = "127.0.0.1:7002"
            data_dir = "d"
            peers = ["1=127.0.0.1:7001", "2=127.0.0.1:7002", "3=127.0.0.1:7003"]
            size = "64MiB"
            [raft]
            heartbeat_ms = 20
            [tls]
            dir = "certs"
            "#,
        )
        .unwrap();
        let config = NodeConfig::build(file, Overrides::default()).unwrap();
        assert_eq!(config.id, NodeId(2));
        assert_eq!(config.size, 64 << 20);
        assert_eq!(config.min_in_sync, 2);
        assert_eq!(config.peers.len(), 3);
        assert_eq!(config.timing.heartbeat, Duration::from_millis(20));
        assert_eq!(config.volume, "vol0");
        assert_eq!(config.data_listen, "127.0.0.1:0".parse().unwrap());
        assert_eq!(config.suspend_timeout, DEFAULT_SUSPEND_TIMEOUT);
        assert_eq!(config.balance_interval, Some(DEFAULT_BALANCE_INTERVAL));
        assert!(config.peer_data.is_empty());
        let tls = config.tls.expect("tls files");
        assert_eq!(tls.cert(), Path::new("certs/node-2.crt"));
        assert_eq!(tls.ca(), Path::new("certs/ca.crt"));
        assert!(!config.insecure);
        assert_eq!(config.nbd_tls, NbdTls::Off);
    }

    #[test]
    fn tls_is_required_unless_insecure_and_files_can_be_named_one_by_one() {
        let no_tls = Overrides {
            tls: TlsFile::default(),
            ..flags(1)
        };
        assert!(error("", no_tls.clone()).contains("--insecure"));
        let insecure = Overrides {
            insecure: true,
            ..no_tls.clone()
        };
        let file = || toml::from_str::<ConfigFile>("").unwrap();
        let config = NodeConfig::build(file(), insecure.clone()).unwrap();
        assert!(config.insecure && config.tls.is_none());
        let in_file: ConfigFile = toml::from_str("insecure = true").unwrap();
        assert!(NodeConfig::build(in_file, no_tls.clone()).unwrap().insecure);

        let named = Overrides {
            tls: TlsFile {
                ca: Some("a/ca.pem".into()),
                cert: Some("b/n1.pem".into()),
                key: Some("c/n1.key".into()),
                dir: None,
            },
            ..no_tls.clone()
        };
        let tls = NodeConfig::build(file(), named).unwrap().tls.unwrap();
        assert_eq!(
            (tls.ca(), tls.cert(), tls.key()),
            (
                Path::new("a/ca.pem"),
                Path::new("b/n1.pem"),
                Path::new("c/n1.key")
            )
        );
        let partial = Overrides {
            tls: TlsFile {
                ca: Some("a/ca.pem".into()),
                ..TlsFile::default()
            },
            ..no_tls.clone()
        };
        assert!(error("", partial).contains("all of ca, cert and key"));
        let key_elsewhere = Overrides {
            tls: TlsFile {
                dir: Some("d".into()),
                key: Some("vault/n1.key".into()),
                ..TlsFile::default()
            },
            ..no_tls.clone()
        };
        let tls = NodeConfig::build(file(), key_elsewhere)
            .unwrap()
            .tls
            .unwrap();
        assert_eq!(tls.cert(), Path::new("d/node-1.crt"));
        assert_eq!(tls.key(), Path::new("vault/n1.key"));

        assert!(error("nbd_tls = \"maybe\"", flags(1)).contains("nbd_tls"));
        assert!(error("nbd_tls = \"require\"", insecure).contains("certificates"));
        assert!(error("nbd_client_auth = true", flags(1)).contains("nbd_tls"));
        let nbd: ConfigFile =
            toml::from_str("nbd_tls = \"require\"\nnbd_client_auth = true").unwrap();
        let config = NodeConfig::build(nbd, flags(1)).unwrap();
        assert_eq!(
            (config.nbd_tls, config.nbd_client_auth),
            (NbdTls::Require, true)
        );
    }

    /// Secure by default (#36): NBD beyond loopback requires TLS and client
    /// certificates unless `nbd_tls = "off"` is asked for; on loopback it
    /// stays open to the machine.
    #[test]
    fn nbd_beyond_loopback_requires_certificates_unless_off_is_asked_for() {
        let at = |addr: &str| Overrides {
            nbd: Some(addr.into()),
            ..flags(1)
        };
        let build = |file: &str, flags: Overrides| {
            NodeConfig::build(toml::from_str(file).unwrap(), flags).unwrap()
        };
        let local = build("", at("127.0.0.1:10809"));
        assert_eq!((local.nbd_tls, local.nbd_client_auth), (NbdTls::Off, false));
        assert!(local.nbd_anonymous_writes() && !local.nbd_plaintext_exposed());
        for addr in ["0.0.0.0:10809", "10.0.0.5:10809", "[::]:10809"] {
            let exposed = build("", at(addr));
            assert_eq!(
                (exposed.nbd_tls, exposed.nbd_client_auth),
                (NbdTls::Require, true),
                "{addr}"
            );
            assert!(!exposed.nbd_anonymous_writes(), "{addr}");
        }
        // Explicitly off: the operator's choice, warned about at start.
        let off = build("nbd_tls = \"off\"", at("0.0.0.0:10809"));
        assert_eq!((off.nbd_tls, off.nbd_client_auth), (NbdTls::Off, false));
        assert!(off.nbd_plaintext_exposed() && off.nbd_anonymous_writes());
        // TLS without client authentication: a client without a
        // certificate only reads.
        let optional = build("nbd_tls = \"optional\"", at("0.0.0.0:10809"));
        assert_eq!(
            (optional.nbd_tls, optional.nbd_client_auth),
            (NbdTls::Optional, false)
        );
        assert!(!optional.nbd_anonymous_writes());
        let no_auth = build("nbd_client_auth = false", at("0.0.0.0:10809"));
        assert_eq!(
            (no_auth.nbd_tls, no_auth.nbd_client_auth),
            (NbdTls::Require, false)
        );
        // No certificates: beyond loopback only with NBD explicitly off.
        let insecure = Overrides {
            insecure: true,
            tls: TlsFile::default(),
            ..at("0.0.0.0:10809")
        };
        let refused = error("", insecure.clone());
        assert!(refused.contains("nbd_tls = \"off\""), "{refused}");
        assert!(build("nbd_tls = \"off\"", insecure).nbd_plaintext_exposed());
    }

    #[test]
    fn flags_override_the_file() {
        let file: ConfigFile = toml::from_str(
            r#"
            id = 1
            listen = "127.0.0.1:7001"
            data_dir = "d"
            peers = ["1=127.0.0.1:7001", "2=127.0.0.1:7002"]
            size = 4096
            insecure = true
            balance_interval = 5
            "#,
        )
        .unwrap();
        let overrides = Overrides {
            peers: vec!["2=127.0.0.1:9999".into(), "3=127.0.0.1:7003".into()],
            size: Some("1M".into()),
            min_in_sync: Some(3),
            ..Default::default()
        };
        let from_file = NodeConfig::build(file.clone(), overrides.clone()).unwrap();
        assert_eq!(from_file.balance_interval, Some(Duration::from_secs(5)));
        let config = NodeConfig::build(
            file,
            Overrides {
                balance_interval: Some(0),
                ..overrides
            },
        )
        .unwrap();
        assert_eq!(config.peers[&NodeId(2)].port(), 9999);
        assert_eq!(config.peers.len(), 3);
        assert_eq!(config.size, 1 << 20);
        assert_eq!(config.min_in_sync, 3);
        // 0 turns the balancer off.
        assert_eq!(config.balance_interval, None);
    }

    #[test]
    fn each_mistake_gets_a_clear_message() {
        let dup = Overrides {
            peers: vec!["1=127.0.0.1:1".into(), "1=127.0.0.1:2".into()],
            ..flags(1)
        };
        assert!(error("", dup).contains("duplicate peer id 1"));
        assert!(error("", flags(4)).contains("id 4 is not in the peer list"));
        let big = Overrides {
            min_in_sync: Some(4),
            ..flags(1)
        };
        assert!(error("", big).contains("min_in_sync 4"));
        let bad = Overrides {
            peers: vec!["1=localhost".into()],
            ..flags(1)
        };
        assert!(error("", bad).contains("not HOST:PORT"));
        let bad_listen = Overrides {
            listen: Some("nowhere".into()),
            ..flags(1)
        };
        assert!(error("", bad_listen).contains("listen address"));
        assert!(error("", Overrides::default()).contains("no node id"));
        assert!(error("", flags(0)).contains("id 0"));
        let odd = Overrides {
            size: Some("1000".into()),
            ..flags(1)
        };
        assert!(error("", odd).contains("multiple of 512"));
        assert!(error("size = true", flags(1)).contains("not a size"));
        assert!(error("peers = [\"x\"]", flags(1)).contains("not ID=HOST:PORT"));
        assert!(error("[raft]\nlease_margin_ms = 900", flags(1)).contains("lease_margin"));
        assert!(error("peer_data = [\"7=127.0.0.1:1\"]", flags(1)).contains("node 7"));
        assert!(error("data_listen = \"x\"", flags(1)).contains("data_listen"));
        let data = Overrides {
            data_listen: Some("0.0.0.0:7101".into()),
            peer_data: vec!["2=10.0.0.2:7102".into()],
            ..flags(1)
        };
        let config = NodeConfig::build(ConfigFile::default(), data).unwrap();
        assert_eq!(config.data_listen.port(), 7101);
        assert_eq!(config.peer_data[&NodeId(2)], "10.0.0.2:7102");
        assert!(parse_size("12XB").is_err());
        assert!(parse_size("99999999999T").is_err());
        assert!(parse_size("GiB").is_err());
    }

    #[test]
    fn unknown_keys_are_refused() {
        assert!(toml::from_str::<ConfigFile>("bogus = 1").is_err());
    }
}
