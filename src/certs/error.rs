//! [`CertError`], the one error type of issuing, reading and checking
//! certificates. Its messages are read by operators: each says which file
//! or input is wrong and, where there is one, what command puts it right.

use std::io;
use std::path::{Path, PathBuf};

use super::MAX_DAYS;
use super::identity::MAX_NAME_LEN;
use crate::ids::NodeId;

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
