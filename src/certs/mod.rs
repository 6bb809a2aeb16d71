//! Certificates for mutual TLS: the cluster's certificate authority, one
//! certificate per node and per client tool, and reading a peer's identity
//! back out of the certificate it presented.
//!
//! A cluster has one CA. `replica-ha certs init` makes it; `certs node` and
//! `certs client` issue certificates signed by it. Every node trusts only
//! that CA (for its servers and as a client of its peers), so a certificate
//! from any other CA fails the handshake before a byte of gRPC is read.
//!
//! # Files
//!
//! All live in one directory (`--dir`, created mode 0700 by `init`):
//! - `ca.crt`, `ca.key`: the CA. `ca.crt` goes to every node and client;
//!   `ca.key` is needed only to issue certificates.
//! - `node-<id>.crt`, `node-<id>.key`: node `<id>`'s certificate and key.
//! - `<name>.crt`, `<name>.key`: client `<name>`'s (an operator or a
//!   tool); the names `ca` and `node-…` are kept for the files above.
//!
//! [`TlsFiles`] names these paths and loads them.
//!
//! # Identity
//!
//! Each certificate carries exactly one URI subject alternative name in the
//! `replica-ha` scheme, and that URI is its identity:
//! - CA: `replica-ha://<cluster_id>/ca` (the cluster id is read back from
//!   here when a certificate is issued; it is also the CA's subject O, for
//!   people reading the certificate with `openssl x509 -text`, and the CA's
//!   CN carries a fingerprint of its key, so two CAs never share a name);
//! - node: `replica-ha://<cluster_id>/node/<id>`;
//! - client: `replica-ha://<cluster_id>/client/<name>/<role>`, role `admin`,
//!   `user` or `viewer` ([`Role`]).
//!
//! Cluster ids and client names are 1 to 64 ASCII letters, digits, `-` and
//! `_`, so they are safe in a file name and a URI as they stand; node ids
//! are positive decimal numbers without leading zeros.
//!
//! # Invariants
//!
//! - C1: a peer's identity is its URI SAN and nothing else: not its CN, not
//!   its DNS or IP SANs (those exist for host-name verification only), not
//!   anything it says in a message. A message that claims to be from node
//!   N is only accepted on a connection whose certificate says node N of
//!   this cluster ([`PeerIdentity::node_in`]).
//! - C2: [`identity_of`] does not verify signatures or dates. It must only
//!   be given a leaf that rustls has verified against this cluster's
//!   `ca.crt`.
//! - C3: a certificate with no `replica-ha` URI SAN, with two, or with one
//!   that does not parse exactly (unknown kind, bad id, bad name, unknown
//!   role) has no identity: [`identity_of`] refuses it with a typed error.
//!   The scheme is matched case-insensitively when counting, so a second,
//!   differently spelt URI cannot slip past the count.
//! - C4: a private key file never exists on disk with a mode wider than
//!   0600: it is created with that mode, not narrowed afterwards. Every
//!   file is written to a temporary file in the same directory, synced and
//!   renamed into place, so a crash leaves the old file or the new one,
//!   never a part of one (a stray `.*.tmp.*` file may be left; delete it).
//! - C5: `init` never replaces an existing CA unless forced: a new CA
//!   orphans every certificate the old one signed. Node and client
//!   certificates are replaced when re-issued (that is how they are
//!   renewed).
//! - C6: the CA has path length 0 (it signs leaves, never another CA), and
//!   no leaf outlives the CA that signed it. Leaves are not CAs; a node's
//!   is for both server and client authentication (nodes call each other),
//!   a client's for client authentication only.
//!
//! Every certificate's validity starts an hour before it is made, so a
//! node whose clock is a little behind the issuing machine's accepts it.
//!
//! Not done here: revocation (there is no CRL; replace the CA to revoke
//! everything), and enforcing roles, which is the server's job.

use std::fmt;
use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io::{self, Write};
use std::net::IpAddr;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, PublicKeyData, SanType,
};
use time::{Duration, OffsetDateTime};

use crate::ids::NodeId;

mod identity;
#[cfg(test)]
mod test_support;

pub use identity::{PeerIdentity, Role, cluster_id_of_ca, identity_of};

use identity::{MAX_NAME_LEN, ca_uri, is_name, parse_der, pem_certificate};

/// How long a CA is valid by default, in days.
pub const DEFAULT_CA_DAYS: u32 = 3650;
/// How long a node or client certificate is valid by default, in days.
pub const DEFAULT_LEAF_DAYS: u32 = 365;
/// The longest validity accepted, in days (a hundred years).
pub const MAX_DAYS: u32 = 36_500;

/// How far back a certificate's validity starts (clock skew).
const BACKDATE: Duration = Duration::hours(1);
/// The default hosts of a node certificate.
const DEFAULT_HOSTS: [&str; 2] = ["127.0.0.1", "localhost"];

const CA_CERT: &str = "ca.crt";
const CA_KEY: &str = "ca.key";
const CERT_MODE: u32 = 0o644;
const KEY_MODE: u32 = 0o600;
const DIR_MODE: u32 = 0o700;

/// What can go wrong making, reading or checking certificates.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("{action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path} not found; {remedy}")]
    Missing { path: PathBuf, remedy: String },
    #[error(
        "{path} already exists: {dir} already holds a CA. Replacing it makes every certificate \
         it signed stop verifying; pass --force if that is what you want",
        dir = .path.parent().unwrap_or(Path::new(".")).display()
    )]
    CaExists { path: PathBuf },
    #[error("{path} is not usable: {reason}; {remedy}")]
    BadFile {
        path: PathBuf,
        reason: String,
        remedy: String,
    },
    #[error("{key} is not the key of {cert}; {remedy}")]
    KeyMismatch {
        cert: PathBuf,
        key: PathBuf,
        remedy: String,
    },
    #[error("{path} expired on {date}; {remedy}")]
    Expired {
        path: PathBuf,
        date: String,
        remedy: String,
    },
    #[error("invalid cluster id {0:?}: use 1 to {MAX_NAME_LEN} ASCII letters, digits, - or _")]
    InvalidClusterId(String),
    #[error(
        "invalid client name {0:?}: use 1 to {MAX_NAME_LEN} ASCII letters, digits, - or _ \
         (not `ca`, and not starting with `node-`: those files are the CA's and the nodes')"
    )]
    InvalidName(String),
    #[error("invalid node id {0}: node ids are positive integers")]
    InvalidNodeId(NodeId),
    #[error("invalid host {0:?}: give an IP address or a DNS name (letters, digits, `-`, `.`)")]
    InvalidHost(String),
    #[error("invalid validity of {0} days: use 1 to {MAX_DAYS}")]
    InvalidDays(u32),
    #[error(
        "the certificate would be valid until {not_after}, after its CA expires on {ca_not_after}; \
         ask for fewer days, or make a new CA"
    )]
    OutlivesCa {
        not_after: String,
        ca_not_after: String,
    },
    #[error("making a certificate: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("not a readable X.509 certificate: {0}")]
    BadCertificate(String),
    #[error("the certificate has no `replica-ha://` URI SAN, so it names no node or client")]
    NoIdentity,
    #[error("the certificate has {count} `replica-ha` URI SANs; exactly one is allowed")]
    SeveralIdentities { count: usize },
    #[error("malformed identity {uri:?}: {reason}")]
    MalformedIdentity { uri: String, reason: &'static str },
    #[error("identity {uri:?} is of unknown kind {kind:?} (expected `node` or `client`)")]
    UnknownKind { uri: String, kind: String },
    #[error("identity {uri:?} has a bad node id (a positive decimal number, no leading zeros)")]
    BadNodeId { uri: String },
    #[error("identity {uri:?} is a CA's; a peer must present a node or client certificate")]
    NotALeaf { uri: String },
}

/// The files a certificate was written to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Issued {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// The cluster id in the certificate.
    pub cluster_id: String,
    /// The end of the certificate's validity.
    pub not_after: OffsetDateTime,
}

/// Creates the cluster's CA in `dir` (created mode 0700 if missing):
/// `ca.crt` and `ca.key`, valid for `days`. Refuses if either exists,
/// unless `force` (C5).
pub fn init(dir: &Path, cluster_id: &str, days: u32, force: bool) -> Result<Issued, CertError> {
    check_cluster_id(cluster_id)?;
    let (not_before, not_after) = validity(days)?;
    let cert_path = dir.join(CA_CERT);
    let key_path = dir.join(CA_KEY);
    DirBuilder::new()
        .recursive(true)
        .mode(DIR_MODE)
        .create(dir)
        .map_err(|source| io_error("creating", dir, source))?;
    if !force {
        for path in [&key_path, &cert_path] {
            if fs::symlink_metadata(path).is_ok() {
                return Err(CertError::CaExists { path: path.clone() });
            }
        }
    }

    let key = KeyPair::generate()?;
    let mut params = CertificateParams::default();
    // The key's fingerprint in the name makes every CA's subject unique, so
    // a certificate from another CA of the same cluster id fails as of an
    // unknown issuer, not as a bad signature of a look-alike.
    let tag = blake3::hash(key.der_bytes()).to_hex();
    let common_name = format!("replica-ha CA {cluster_id} {}", &tag[..16]);
    params.distinguished_name = name(&common_name, cluster_id);
    params.subject_alt_names = vec![uri_san(ca_uri(cluster_id))?];
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.not_before = not_before;
    params.not_after = not_after;
    let cert = params.self_signed(&key)?;

    // The key first: a crash in between leaves `ca.key` without `ca.crt`,
    // so issuing says `ca.crt` is missing and `init` wants `--force`.
    let replace = force;
    write_atomic(&key_path, key.serialize_pem().as_bytes(), KEY_MODE, replace)?;
    write_atomic(&cert_path, cert.pem().as_bytes(), CERT_MODE, replace)?;
    Ok(Issued {
        cert: cert_path,
        key: key_path,
        cluster_id: cluster_id.to_owned(),
        not_after,
    })
}

/// Issues node `node_id`'s certificate, signed by the CA in `dir`, valid
/// for `days`: `node-<id>.crt` and `node-<id>.key`. Its DNS and IP SANs are
/// `hosts` plus `127.0.0.1` and `localhost`; it serves and calls.
pub fn issue_node(
    dir: &Path,
    node_id: NodeId,
    hosts: &[String],
    days: u32,
) -> Result<Issued, CertError> {
    let (not_before, not_after) = validity(days)?;
    issue_node_with_validity(dir, node_id, hosts, not_before, not_after)
}

/// [`issue_node`] with an explicit validity, for certificates that are not
/// valid yet or any more (how a test makes an expired one).
pub fn issue_node_with_validity(
    dir: &Path,
    node_id: NodeId,
    hosts: &[String],
    not_before: OffsetDateTime,
    not_after: OffsetDateTime,
) -> Result<Issued, CertError> {
    if node_id == NodeId(0) {
        return Err(CertError::InvalidNodeId(node_id));
    }
    let mut sans = host_sans(hosts)?;
    let ca = Ca::load(dir)?;
    let identity = PeerIdentity::Node {
        cluster_id: ca.cluster_id.clone(),
        id: node_id,
    };
    sans.push(uri_san(identity.uri())?);
    let files = TlsFiles::for_node(dir, node_id);
    let leaf = Leaf {
        common_name: format!("replica-ha node {node_id}"),
        sans,
        usages: vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ],
        not_before,
        not_after,
    };
    ca.issue(leaf, &files)
}

/// Issues client `name`'s certificate with `role`, signed by the CA in
/// `dir`, valid for `days`: `<name>.crt` and `<name>.key`. It
/// authenticates a client only; it cannot serve.
pub fn issue_client(dir: &Path, name: &str, role: Role, days: u32) -> Result<Issued, CertError> {
    check_name(name)?;
    let (not_before, not_after) = validity(days)?;
    let ca = Ca::load(dir)?;
    let identity = PeerIdentity::Client {
        cluster_id: ca.cluster_id.clone(),
        name: name.to_owned(),
        role,
    };
    let sans = vec![uri_san(identity.uri())?];
    let files = TlsFiles::for_client(dir, name);
    let leaf = Leaf {
        common_name: format!("replica-ha client {name} ({role})"),
        sans,
        usages: vec![ExtendedKeyUsagePurpose::ClientAuth],
        not_before,
        not_after,
    };
    ca.issue(leaf, &files)
}

/// Test support: a client certificate signed by the CA in `dir`, valid for
/// `days`, that names no identity (no `replica-ha://` URI SAN, only the DNS
/// name `localhost`): `<name>.crt` and `<name>.key`. Its chain verifies,
/// and a node must still give it nothing (C3).
#[cfg(any(test, feature = "testing"))]
pub fn issue_unnamed(dir: &Path, name: &str, days: u32) -> Result<Issued, CertError> {
    check_name(name)?;
    let (not_before, not_after) = validity(days)?;
    let ca = Ca::load(dir)?;
    let leaf = Leaf {
        common_name: format!("unnamed {name}"),
        sans: vec![SanType::DnsName("localhost".try_into()?)],
        usages: vec![ExtendedKeyUsagePurpose::ClientAuth],
        not_before,
        not_after,
    };
    ca.issue(leaf, &TlsFiles::for_client(dir, name))
}

/// The conventional paths of one party's TLS files in a certificate
/// directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
    /// The command that makes `cert` and `key`, for error messages.
    issue: String,
    /// The command that makes `ca`.
    init: String,
}

impl TlsFiles {
    /// Node `id`'s files in `dir`: `ca.crt`, `node-<id>.crt`, `node-<id>.key`.
    pub fn for_node(dir: &Path, id: NodeId) -> Self {
        Self::new(
            dir,
            &format!("node-{id}"),
            format!("replica-ha certs node --dir {} --id {id}", dir.display()),
        )
    }

    /// Client `name`'s files in `dir`: `ca.crt`, `<name>.crt`,
    /// `<name>.key`.
    pub fn for_client(dir: &Path, name: &str) -> Self {
        Self::new(
            dir,
            name,
            format!(
                "replica-ha certs client --dir {} --name {name} --role ROLE",
                dir.display()
            ),
        )
    }

    /// Files named one by one (the config's `[tls]` `ca`, `cert` and
    /// `key`); `dir` or `default` fills in any not given.
    pub fn with_overrides(
        default: Option<TlsFiles>,
        ca: Option<PathBuf>,
        cert: Option<PathBuf>,
        key: Option<PathBuf>,
    ) -> Option<Self> {
        let issue = "replica-ha certs node|client --dir DIR ...".to_string();
        let init = "replica-ha certs init --dir DIR --cluster CLUSTER_ID".to_string();
        match default {
            Some(mut files) => {
                files.ca = ca.unwrap_or(files.ca);
                files.cert = cert.unwrap_or(files.cert);
                files.key = key.unwrap_or(files.key);
                Some(files)
            }
            None => Some(TlsFiles {
                ca: ca?,
                cert: cert?,
                key: key?,
                issue,
                init,
            }),
        }
    }

    fn new(dir: &Path, stem: &str, issue: String) -> Self {
        TlsFiles {
            ca: dir.join(CA_CERT),
            cert: dir.join(format!("{stem}.crt")),
            key: dir.join(format!("{stem}.key")),
            issue,
            init: format!(
                "replica-ha certs init --dir {} --cluster CLUSTER_ID",
                dir.display()
            ),
        }
    }

    /// The CA certificate every peer is checked against.
    pub fn ca(&self) -> &Path {
        &self.ca
    }

    /// This party's certificate.
    pub fn cert(&self) -> &Path {
        &self.cert
    }

    /// This party's private key.
    pub fn key(&self) -> &Path {
        &self.key
    }

    /// Reads the three files and checks them: the CA is a replica-ha CA,
    /// the certificate names a node or client of the CA's cluster and has
    /// not expired, and the key is the certificate's. (Whether the CA
    /// signed the certificate is left to the TLS handshake.)
    pub fn load(&self) -> Result<TlsMaterial, CertError> {
        let init = format!(
            "run `{}` (once per cluster), or copy ca.crt here",
            self.init
        );
        let issue = format!("run `{}`", self.issue);
        let ca_pem = read(&self.ca, &init)?;
        let cert_pem = read(&self.cert, &issue)?;
        let key_pem = read(&self.key, &issue)?;

        let bad = |path: &Path, reason: String, remedy: &str| CertError::BadFile {
            path: path.to_owned(),
            reason,
            remedy: remedy.to_owned(),
        };
        let cluster_id =
            cluster_id_of_ca(&ca_pem).map_err(|e| bad(&self.ca, e.to_string(), &init))?;

        let cert_der = pem_certificate(&cert_pem).map_err(|e| bad(&self.cert, e, &issue))?;
        let cert = parse_der(&cert_der).map_err(|e| bad(&self.cert, e.to_string(), &issue))?;
        let identity =
            identity_of(&cert_der).map_err(|e| bad(&self.cert, e.to_string(), &issue))?;
        if identity.cluster_id() != cluster_id {
            return Err(bad(
                &self.cert,
                format!(
                    "it is for cluster {:?} but {} is the CA of cluster {cluster_id:?}",
                    identity.cluster_id(),
                    self.ca.display()
                ),
                &issue,
            ));
        }
        let not_after = cert.validity().not_after.to_datetime();
        if not_after <= OffsetDateTime::now_utc() {
            return Err(CertError::Expired {
                path: self.cert.clone(),
                date: not_after.date().to_string(),
                remedy: issue,
            });
        }

        let key = std::str::from_utf8(&key_pem)
            .ok()
            .and_then(|text| KeyPair::from_pem(text).ok())
            .ok_or_else(|| bad(&self.key, "not a PEM private key".into(), &issue))?;
        if key.subject_public_key_info() != cert.public_key().raw {
            return Err(CertError::KeyMismatch {
                cert: self.cert.clone(),
                key: self.key.clone(),
                remedy: issue,
            });
        }
        Ok(TlsMaterial {
            ca_pem,
            cert_pem,
            key_pem,
        })
    }
}

/// The contents of one party's TLS files, as PEM.
#[derive(Clone, PartialEq, Eq)]
pub struct TlsMaterial {
    pub ca_pem: Vec<u8>,
    pub cert_pem: Vec<u8>,
    pub key_pem: Vec<u8>,
}

/// Never prints the key.
impl fmt::Debug for TlsMaterial {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsMaterial")
            .field("ca_pem", &format_args!("{} bytes", self.ca_pem.len()))
            .field("cert_pem", &format_args!("{} bytes", self.cert_pem.len()))
            .field("key_pem", &format_args!("<redacted>"))
            .finish()
    }
}

/// `replica-ha certs`: make the cluster's CA and issue node and client
/// certificates for mutual TLS.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum CertsCommand {
    /// Create the cluster's certificate authority: DIR/ca.crt and
    /// DIR/ca.key. Run once per cluster; copy ca.crt to every node and
    /// client, and keep ca.key where certificates are issued. Refuses to
    /// replace an existing CA unless --force.
    Init {
        /// The certificate directory (created with mode 0700).
        #[arg(long, value_name = "DIR")]
        dir: PathBuf,
        /// The cluster id, the same as the nodes' `cluster_id` (1 to 64
        /// ASCII letters, digits, `-` or `_`).
        #[arg(
            long = "cluster",
            visible_alias = "cluster-id",
            value_name = "ID",
            default_value = "replica-ha"
        )]
        cluster_id: String,
        /// How many days the CA is valid.
        #[arg(long, default_value_t = DEFAULT_CA_DAYS)]
        days: u32,
        /// Replace an existing CA. Every certificate the old one signed
        /// stops verifying.
        #[arg(long)]
        force: bool,
    },
    /// Issue a node's certificate, signed by the CA in DIR:
    /// DIR/node-ID.crt and DIR/node-ID.key. The node uses it both to serve
    /// and to call its peers; it is accepted as node ID only. Replaces an
    /// earlier one (renewal).
    Node {
        /// The certificate directory holding ca.crt and ca.key.
        #[arg(long, value_name = "DIR")]
        dir: PathBuf,
        /// The node's id (a positive integer), as in its config.
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
        id: u64,
        /// A host name or IP address peers and clients reach the node by;
        /// repeat for each. 127.0.0.1 and localhost are always included.
        #[arg(long = "host", value_name = "HOST")]
        hosts: Vec<String>,
        /// How many days the certificate is valid.
        #[arg(long, default_value_t = DEFAULT_LEAF_DAYS)]
        days: u32,
    },
    /// Issue a client certificate (for the admin tools, `attach` and NBD
    /// clients), signed by the CA in DIR: DIR/NAME.crt and DIR/NAME.key.
    /// It can only authenticate a client, with the given role (admin: the
    /// cluster and the data; user: the data; viewer: reads only).
    /// Replaces an earlier one.
    Client {
        /// The certificate directory holding ca.crt and ca.key.
        #[arg(long, value_name = "DIR")]
        dir: PathBuf,
        /// The client's name (1 to 64 ASCII letters, digits, `-` or `_`).
        #[arg(long)]
        name: String,
        /// What the client may do.
        #[arg(long, value_enum)]
        role: Role,
        /// How many days the certificate is valid.
        #[arg(long, default_value_t = DEFAULT_LEAF_DAYS)]
        days: u32,
    },
}

/// Runs a `certs` command; returns what to tell the operator.
pub fn run(cmd: CertsCommand) -> Result<String, CertError> {
    match cmd {
        CertsCommand::Init {
            dir,
            cluster_id,
            days,
            force,
        } => {
            let done = init(&dir, &cluster_id, days, force)?;
            Ok(format!(
                "Created the CA of cluster {cluster_id}, valid until {}:\n  {}  (copy to every \
                 node and client)\n  {}  (private key, mode 0600; needed only to issue \
                 certificates)\nNext, for each node: replica-ha certs node --dir {} --id ID \
                 --host HOST",
                done.not_after.date(),
                done.cert.display(),
                done.key.display(),
                dir.display()
            ))
        }
        CertsCommand::Node {
            dir,
            id,
            hosts,
            days,
        } => {
            let done = issue_node(&dir, NodeId(id), &hosts, days)?;
            let mut named: Vec<&str> = DEFAULT_HOSTS.to_vec();
            named.extend(
                hosts
                    .iter()
                    .map(String::as_str)
                    .filter(|h| !DEFAULT_HOSTS.contains(h)),
            );
            let hosts = named.join(", ");
            Ok(format!(
                "Issued the certificate of node {id} of cluster {}, for {hosts}, valid until \
                 {}:\n  {}\n  {}  (private key, mode 0600)",
                done.cluster_id,
                done.not_after.date(),
                done.cert.display(),
                done.key.display()
            ))
        }
        CertsCommand::Client {
            dir,
            name,
            role,
            days,
        } => {
            let done = issue_client(&dir, &name, role, days)?;
            Ok(format!(
                "Issued the certificate of client {name} ({role}) of cluster {}, valid until \
                 {}:\n  {}\n  {}  (private key, mode 0600)",
                done.cluster_id,
                done.not_after.date(),
                done.cert.display(),
                done.key.display()
            ))
        }
    }
}

/// The CA of a certificate directory, ready to sign.
struct Ca {
    cert_pem: String,
    key: KeyPair,
    cluster_id: String,
    not_after: OffsetDateTime,
}

/// What goes into a leaf certificate.
struct Leaf {
    common_name: String,
    sans: Vec<SanType>,
    usages: Vec<ExtendedKeyUsagePurpose>,
    not_before: OffsetDateTime,
    not_after: OffsetDateTime,
}

impl Ca {
    fn load(dir: &Path) -> Result<Ca, CertError> {
        let cert_path = dir.join(CA_CERT);
        let key_path = dir.join(CA_KEY);
        let init = format!(
            "run `replica-ha certs init --dir {} --cluster CLUSTER_ID` first",
            dir.display()
        );
        let bad = |path: &Path, reason: String| CertError::BadFile {
            path: path.to_owned(),
            reason,
            remedy: "restore it from a backup, or make a new CA with `replica-ha certs init \
                     --force` and re-issue every certificate"
                .into(),
        };
        let cert_bytes = read(&cert_path, &init)?;
        let key_bytes = read(&key_path, &init)?;
        let cert_pem = String::from_utf8(cert_bytes)
            .map_err(|_| bad(&cert_path, "not a PEM certificate".into()))?;
        let cluster_id =
            cluster_id_of_ca(cert_pem.as_bytes()).map_err(|e| bad(&cert_path, e.to_string()))?;
        let der = pem_certificate(cert_pem.as_bytes()).map_err(|e| bad(&cert_path, e))?;
        let cert = parse_der(&der).map_err(|e| bad(&cert_path, e.to_string()))?;
        let key = std::str::from_utf8(&key_bytes)
            .ok()
            .and_then(|text| KeyPair::from_pem(text).ok())
            .ok_or_else(|| bad(&key_path, "not a PEM private key".into()))?;
        if key.subject_public_key_info() != cert.public_key().raw {
            return Err(CertError::KeyMismatch {
                cert: cert_path,
                key: key_path,
                remedy: "put the CA's own key beside it".into(),
            });
        }
        let not_after = cert.validity().not_after.to_datetime();
        Ok(Ca {
            cert_pem,
            key,
            cluster_id,
            not_after,
        })
    }

    /// Signs `leaf` and writes it to `files` (C4, C6).
    fn issue(&self, leaf: Leaf, files: &TlsFiles) -> Result<Issued, CertError> {
        if leaf.not_after > self.not_after {
            return Err(CertError::OutlivesCa {
                not_after: leaf.not_after.date().to_string(),
                ca_not_after: self.not_after.date().to_string(),
            });
        }
        let issuer = Issuer::from_ca_cert_pem(&self.cert_pem, &self.key)?;
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::default();
        params.distinguished_name = name(&leaf.common_name, &self.cluster_id);
        params.subject_alt_names = leaf.sans;
        params.is_ca = IsCa::ExplicitNoCa;
        // Key encipherment means nothing to an ECDSA key, but qemu's TLS
        // credentials refuse a certificate whose (critical) key usage
        // lacks it.
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = leaf.usages;
        params.use_authority_key_identifier_extension = true;
        params.not_before = leaf.not_before;
        params.not_after = leaf.not_after;
        let cert = params.signed_by(&key, &issuer)?;

        write_atomic(&files.key, key.serialize_pem().as_bytes(), KEY_MODE, true)?;
        write_atomic(&files.cert, cert.pem().as_bytes(), CERT_MODE, true)?;
        Ok(Issued {
            cert: files.cert.clone(),
            key: files.key.clone(),
            cluster_id: self.cluster_id.clone(),
            not_after: leaf.not_after,
        })
    }
}

fn check_cluster_id(cluster_id: &str) -> Result<(), CertError> {
    if is_name(cluster_id) {
        Ok(())
    } else {
        Err(CertError::InvalidClusterId(cluster_id.to_owned()))
    }
}

fn check_name(name: &str) -> Result<(), CertError> {
    // A client's files are `<name>.crt`: the CA's and the nodes' names are
    // taken.
    if is_name(name) && name != "ca" && !name.starts_with("node-") {
        Ok(())
    } else {
        Err(CertError::InvalidName(name.to_owned()))
    }
}

/// The IP and DNS SANs for `hosts` and the defaults (`127.0.0.1`,
/// `localhost`, always included), deduplicated.
fn host_sans(hosts: &[String]) -> Result<Vec<SanType>, CertError> {
    let hosts: Vec<&str> = DEFAULT_HOSTS
        .iter()
        .copied()
        .chain(hosts.iter().map(String::as_str))
        .collect();
    let mut sans = Vec::new();
    for host in hosts {
        let san = if let Ok(ip) = host.parse::<IpAddr>() {
            SanType::IpAddress(ip)
        } else if is_dns_name(host) {
            SanType::DnsName(
                host.try_into()
                    .map_err(|_| CertError::InvalidHost(host.to_owned()))?,
            )
        } else {
            return Err(CertError::InvalidHost(host.to_owned()));
        };
        if !sans.contains(&san) {
            sans.push(san);
        }
    }
    Ok(sans)
}

/// Letters, digits and `-` in dot-separated labels of at most 63, no label
/// starting or ending with `-`; at most 253 in all. No wildcards.
fn is_dns_name(host: &str) -> bool {
    host.len() <= 253
        && host.split('.').all(|label| {
            (1..=63).contains(&label.len())
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-')
        })
}

fn uri_san(uri: String) -> Result<SanType, CertError> {
    Ok(SanType::URI(uri.try_into()?))
}

fn name(common_name: &str, cluster_id: &str) -> DistinguishedName {
    let mut name = DistinguishedName::new();
    name.push(DnType::OrganizationName, cluster_id);
    name.push(DnType::CommonName, common_name);
    name
}

/// From an hour ago (clock skew) to `days` from now.
fn validity(days: u32) -> Result<(OffsetDateTime, OffsetDateTime), CertError> {
    if !(1..=MAX_DAYS).contains(&days) {
        return Err(CertError::InvalidDays(days));
    }
    let now = OffsetDateTime::now_utc();
    let not_after = now
        .checked_add(Duration::days(i64::from(days)))
        .ok_or(CertError::InvalidDays(days))?;
    Ok((now - BACKDATE, not_after))
}

fn read(path: &Path, remedy: &str) -> Result<Vec<u8>, CertError> {
    fs::read(path).map_err(|source| match source.kind() {
        io::ErrorKind::NotFound => CertError::Missing {
            path: path.to_owned(),
            remedy: remedy.to_owned(),
        },
        _ => io_error("reading", path, source),
    })
}

fn io_error(action: &'static str, path: &Path, source: io::Error) -> CertError {
    CertError::Io {
        action,
        path: path.to_owned(),
        source,
    }
}

/// Writes `bytes` to `path` atomically (C4): a new temporary file created
/// with `mode`, synced, then renamed over `path` (`replace`) or linked to
/// it, failing if it exists (not `replace`); then the directory is synced.
fn write_atomic(path: &Path, bytes: &[u8], mode: u32, replace: bool) -> Result<(), CertError> {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    let file_name = path
        .file_name()
        .map(|name| name.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(
        ".{file_name}.tmp.{}.{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));

    let written = (|| {
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&tmp)
            .map_err(|source| io_error("creating", &tmp, source))?;
        file.write_all(bytes)
            .and_then(|()| file.sync_all())
            .map_err(|source| io_error("writing", &tmp, source))?;
        drop(file);
        if replace {
            fs::rename(&tmp, path).map_err(|source| io_error("renaming into", path, source))
        } else {
            fs::hard_link(&tmp, path).map_err(|source| {
                if source.kind() == io::ErrorKind::AlreadyExists {
                    CertError::CaExists {
                        path: path.to_owned(),
                    }
                } else {
                    io_error("linking into", path, source)
                }
            })?;
            fs::remove_file(&tmp).map_err(|source| io_error("removing", &tmp, source))
        }
    })();
    if written.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    written?;
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|source| io_error("syncing", dir, source))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use rustls::client::danger::ServerCertVerifier;
    use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
    use rustls::{CertificateError, RootCertStore};

    use super::test_support::{CLUSTER, ca_dir, der_of, mode_of};
    use super::*;

    fn provider() -> Arc<rustls::crypto::CryptoProvider> {
        Arc::new(rustls::crypto::ring::default_provider())
    }

    fn roots(dir: &Path) -> Arc<RootCertStore> {
        let mut roots = RootCertStore::empty();
        roots
            .add(CertificateDer::from(der_of(&dir.join(CA_CERT))))
            .unwrap();
        Arc::new(roots)
    }

    /// Checks `leaf` as a server's certificate for `host` against the CA in
    /// `ca_dir`, as a client of that server would.
    fn verify_as_server(ca_dir: &Path, leaf: &Path, host: &str) -> Result<(), rustls::Error> {
        let verifier =
            rustls::client::WebPkiServerVerifier::builder_with_provider(roots(ca_dir), provider())
                .build()
                .unwrap();
        let name = ServerName::try_from(host.to_owned()).unwrap();
        verifier
            .verify_server_cert(
                &CertificateDer::from(der_of(leaf)),
                &[],
                &name,
                &[],
                UnixTime::now(),
            )
            .map(|_| ())
    }

    /// Checks `leaf` as a client's certificate against the CA in `ca_dir`,
    /// as a server would.
    fn verify_as_client(ca_dir: &Path, leaf: &Path) -> Result<(), rustls::Error> {
        let verifier =
            rustls::server::WebPkiClientVerifier::builder_with_provider(roots(ca_dir), provider())
                .build()
                .unwrap();
        verifier
            .verify_client_cert(&CertificateDer::from(der_of(leaf)), &[], UnixTime::now())
            .map(|_| ())
    }

    #[test]
    fn init_node_and_client_write_the_conventional_files_with_private_keys_0600() {
        let parent = tempfile::tempdir().unwrap();
        let dir = parent.path().join("certs");
        let ca = init(&dir, CLUSTER, DEFAULT_CA_DAYS, false).unwrap();
        assert_eq!(ca.cert, dir.join("ca.crt"));
        assert_eq!(ca.key, dir.join("ca.key"));
        assert_eq!(mode_of(&dir), 0o700);
        assert_eq!(
            cluster_id_of_ca(&fs::read(&ca.cert).unwrap()).unwrap(),
            CLUSTER
        );

        let node = issue_node(&dir, NodeId(3), &[], DEFAULT_LEAF_DAYS).unwrap();
        assert_eq!(node.cert, dir.join("node-3.crt"));
        assert_eq!(node.key, dir.join("node-3.key"));
        assert_eq!(node.cluster_id, CLUSTER);
        let client = issue_client(&dir, "ops_1", Role::Admin, DEFAULT_LEAF_DAYS).unwrap();
        assert_eq!(client.cert, dir.join("ops_1.crt"));
        assert_eq!(client.key, dir.join("ops_1.key"));

        for key in [&ca.key, &node.key, &client.key] {
            assert_eq!(mode_of(key), 0o600, "{}", key.display());
        }
        for cert in [&ca.cert, &node.cert, &client.cert] {
            assert_eq!(mode_of(cert), 0o644, "{}", cert.display());
        }
        // No temporary file is left behind.
        let names: Vec<String> = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(names.iter().all(|n| !n.starts_with('.')), "{names:?}");

        let material = TlsFiles::for_node(&dir, NodeId(3)).load().unwrap();
        assert_eq!(material.cert_pem, fs::read(&node.cert).unwrap());
        assert!(!format!("{material:?}").contains("PRIVATE"));
        TlsFiles::for_client(&dir, "ops_1").load().unwrap();
    }

    #[test]
    fn init_refuses_to_replace_a_ca_unless_forced() {
        let dir = ca_dir();
        let before = fs::read(dir.path().join(CA_CERT)).unwrap();
        let err = init(dir.path(), CLUSTER, DEFAULT_CA_DAYS, false).unwrap_err();
        assert!(matches!(err, CertError::CaExists { .. }), "{err}");
        assert!(err.to_string().contains("--force"), "{err}");
        assert_eq!(fs::read(dir.path().join(CA_CERT)).unwrap(), before);

        init(dir.path(), CLUSTER, DEFAULT_CA_DAYS, true).unwrap();
        assert_ne!(fs::read(dir.path().join(CA_CERT)).unwrap(), before);
        assert_eq!(mode_of(&dir.path().join(CA_KEY)), 0o600);
    }

    #[test]
    fn a_node_certificate_verifies_against_its_own_ca_only() {
        let ours = ca_dir();
        let theirs = tempfile::tempdir().unwrap();
        // Same cluster id, different CA: only the chain tells them apart.
        init(theirs.path(), CLUSTER, DEFAULT_CA_DAYS, false).unwrap();
        let good = issue_node(ours.path(), NodeId(1), &[], 30).unwrap();
        let foreign = issue_node(theirs.path(), NodeId(1), &[], 30).unwrap();

        verify_as_server(ours.path(), &good.cert, "localhost").unwrap();
        verify_as_server(ours.path(), &good.cert, "127.0.0.1").unwrap();
        verify_as_client(ours.path(), &good.cert).unwrap();

        for result in [
            verify_as_server(ours.path(), &foreign.cert, "localhost"),
            verify_as_client(ours.path(), &foreign.cert),
        ] {
            assert!(
                matches!(
                    result,
                    Err(rustls::Error::InvalidCertificate(
                        CertificateError::UnknownIssuer
                    ))
                ),
                "{result:?}"
            );
        }
        // A host not in its SANs is refused too.
        assert!(verify_as_server(ours.path(), &good.cert, "elsewhere.example").is_err());
    }

    #[test]
    fn a_client_certificate_authenticates_a_client_but_cannot_serve() {
        let dir = ca_dir();
        let client = issue_client(dir.path(), "alice", Role::Admin, 30).unwrap();
        verify_as_client(dir.path(), &client.cert).unwrap();
        assert!(verify_as_server(dir.path(), &client.cert, "localhost").is_err());
    }

    #[test]
    fn an_expired_certificate_is_refused() {
        let dir = ca_dir();
        let now = OffsetDateTime::now_utc();
        let old = issue_node_with_validity(
            dir.path(),
            NodeId(2),
            &[],
            now - Duration::days(10),
            now - Duration::days(1),
        )
        .unwrap();
        for result in [
            verify_as_client(dir.path(), &old.cert),
            verify_as_server(dir.path(), &old.cert, "localhost"),
        ] {
            assert!(
                matches!(
                    result,
                    Err(rustls::Error::InvalidCertificate(
                        CertificateError::Expired | CertificateError::ExpiredContext { .. }
                    ))
                ),
                "{result:?}"
            );
        }
        let err = TlsFiles::for_node(dir.path(), NodeId(2))
            .load()
            .unwrap_err();
        assert!(matches!(err, CertError::Expired { .. }), "{err}");
    }

    #[test]
    fn a_leaf_may_not_outlive_its_ca() {
        let dir = tempfile::tempdir().unwrap();
        init(dir.path(), CLUSTER, 10, false).unwrap();
        let err = issue_node(dir.path(), NodeId(1), &[], 11).unwrap_err();
        assert!(matches!(err, CertError::OutlivesCa { .. }), "{err}");
    }

    #[test]
    fn bad_inputs_are_refused_before_anything_is_written() {
        let dir = ca_dir();
        let p = dir.path();
        for bad in ["", "a/b", "a b", "..", "ü", &"x".repeat(65)] {
            assert!(matches!(
                init(&p.join("x"), bad, 10, false),
                Err(CertError::InvalidClusterId(_))
            ));
            assert!(matches!(
                issue_client(p, bad, Role::Viewer, 10),
                Err(CertError::InvalidName(_))
            ));
        }
        assert!(matches!(
            issue_node(p, NodeId(0), &[], 10),
            Err(CertError::InvalidNodeId(NodeId(0)))
        ));
        for host in ["*.example", "-a.example", "a..b", "[::1]", "a_b"] {
            assert!(
                matches!(
                    issue_node(p, NodeId(1), &[host.to_owned()], 10),
                    Err(CertError::InvalidHost(_))
                ),
                "{host}"
            );
        }
        assert!(matches!(
            issue_node(p, NodeId(1), &[], 0),
            Err(CertError::InvalidDays(0))
        ));
        assert!(!p.join("x").exists());
        assert!(!p.join("node-1.crt").exists());
    }

    #[test]
    fn issuing_without_a_ca_says_to_run_init() {
        let dir = tempfile::tempdir().unwrap();
        let err = issue_node(dir.path(), NodeId(1), &[], 10).unwrap_err();
        assert!(matches!(err, CertError::Missing { .. }), "{err}");
        assert!(err.to_string().contains("replica-ha certs init"), "{err}");
    }

    #[test]
    fn load_names_the_missing_file_and_what_to_run() {
        let dir = ca_dir();
        let err = TlsFiles::for_node(dir.path(), NodeId(4))
            .load()
            .unwrap_err();
        let text = err.to_string();
        assert!(text.contains("node-4.crt"), "{text}");
        assert!(text.contains("replica-ha certs node"), "{text}");
    }

    #[test]
    fn load_refuses_a_key_that_is_not_the_certificates() {
        let dir = ca_dir();
        issue_node(dir.path(), NodeId(1), &[], 10).unwrap();
        issue_node(dir.path(), NodeId(2), &[], 10).unwrap();
        fs::copy(dir.path().join("node-2.key"), dir.path().join("node-1.key")).unwrap();
        let err = TlsFiles::for_node(dir.path(), NodeId(1))
            .load()
            .unwrap_err();
        assert!(matches!(err, CertError::KeyMismatch { .. }), "{err}");
    }

    #[test]
    fn run_reports_the_files_it_wrote() {
        use clap::Parser;

        #[derive(clap::Parser)]
        struct Cli {
            #[command(subcommand)]
            cmd: CertsCommand,
        }
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_str().unwrap();
        let parse = |args: &[&str]| {
            Cli::try_parse_from(std::iter::once("certs").chain(args.iter().copied()))
                .map(|cli| cli.cmd)
        };

        let init = parse(&["init", "--dir", d, "--cluster", CLUSTER]).unwrap();
        let text = run(init).unwrap();
        assert!(text.contains("ca.crt") && text.contains("ca.key"), "{text}");

        let node = parse(&[
            "node", "--dir", d, "--id", "2", "--host", "10.1.1.2", "--host", "n2",
        ])
        .unwrap();
        let text = run(node).unwrap();
        assert!(
            text.contains("node-2.crt") && text.contains("node-2.key"),
            "{text}"
        );
        assert!(text.contains("10.1.1.2, n2"), "{text}");

        let client = parse(&["client", "--dir", d, "--name", "ci", "--role", "viewer"]).unwrap();
        let text = run(client).unwrap();
        assert!(text.contains("ci.crt"), "{text}");
        let client = parse(&["client", "--dir", d, "--name", "vm", "--role", "user"]).unwrap();
        let text = run(client).unwrap();
        assert!(text.contains("vm.crt") && text.contains("(user)"), "{text}");
        assert_eq!(
            identity_of(&der_of(&dir.path().join("vm.crt"))).unwrap(),
            PeerIdentity::Client {
                cluster_id: CLUSTER.into(),
                name: "vm".into(),
                role: Role::User
            }
        );

        assert!(parse(&["node", "--dir", d, "--id", "0"]).is_err());
        assert!(parse(&["client", "--dir", d, "--name", "x", "--role", "root"]).is_err());
        assert!(parse(&["node", "--id", "1"]).is_err(), "--dir is required");
    }
}
