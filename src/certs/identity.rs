//! Who a certificate says its holder is: the one `replica-ha://` URI SAN,
//! written into every certificate by [`super::issue`] and read back here.
//!
//! [`identity_of`] runs on every handshake ([`crate::net::tls`] calls it
//! for the leaf of each verified peer, server or client) and each time a
//! party loads its own files; [`cluster_id_of_ca`] names the cluster a CA
//! was made for. What S9 (`docs/design.md`) asks of a message, that the
//! sender and role it claims match the peer's certificate, is answered
//! with the [`PeerIdentity`] found here and nothing else.
//!
//! The URI grammar lives in this file alone, both ways: [`PeerIdentity::uri`]
//! and [`ca_uri`] write it, [`parse_uri`] reads it.
//!
//! Invariants (numbered as in [`super`]):
//! - C1: an identity comes from the URI SAN only: never the CN, the DNS or
//!   IP SANs, or anything a message says. [`PeerIdentity::node_in`] is the
//!   one test of "is this node N of our cluster".
//! - C2: nothing here checks a signature or a date; a certificate must have
//!   been verified against the cluster CA before it is asked who it is.
//! - C3: no `replica-ha` URI SAN, two of them (the scheme compared without
//!   regard to case, so a differently spelt second one still counts), or
//!   one that does not parse exactly is a typed [`CertError`], never a
//!   guess. A CA's URI is no peer's: [`identity_of`] refuses it.
//! - Roles: a client's [`Role`] is one of three exact lower-case words;
//!   anything else is no identity at all, not a lesser role.

use std::fmt;

use x509_parser::certificate::X509Certificate;
use x509_parser::extensions::GeneralName;
use x509_parser::pem::Pem;
use x509_parser::prelude::FromDer;

use super::CertError;
use crate::ids::NodeId;

/// The URI scheme of every identity.
const SCHEME: &str = "replica-ha";
/// An identity URI starts with exactly this.
const URI_PREFIX: &str = "replica-ha://";
/// The longest cluster id or client name.
pub(super) const MAX_NAME_LEN: usize = 64;

/// What a client certificate allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum Role {
    /// Reads and changes: status, transfer and every other admin call,
    /// and the volume's data (it can write it through the admin API
    /// anyway, so NBD grants it a writable export too).
    Admin,
    /// Uses the volume: reads and writes its data through NBD (and
    /// `attach`), reads status; changes nothing in the cluster.
    User,
    /// Reads only: status and the like, and the volume's data through a
    /// read-only NBD export.
    Viewer,
}

impl Role {
    /// The role as it appears in the URI SAN and on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Admin => "admin",
            Role::User => "user",
            Role::Viewer => "viewer",
        }
    }

    /// Whether a holder may change the volume's data (an NBD export
    /// opened writable): `admin` and `user`, not `viewer`.
    pub fn writes_data(self) -> bool {
        match self {
            Role::Admin | Role::User => true,
            Role::Viewer => false,
        }
    }

    fn parse(text: &str) -> Option<Role> {
        match text {
            "admin" => Some(Role::Admin),
            "user" => Some(Role::User),
            "viewer" => Some(Role::Viewer),
            _ => None,
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Who a verified peer certificate says its holder is (C1).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum PeerIdentity {
    /// Node `id` of cluster `cluster_id`.
    Node { cluster_id: String, id: NodeId },
    /// Client tool `name` of cluster `cluster_id`, allowed `role`.
    Client {
        cluster_id: String,
        name: String,
        role: Role,
    },
}

impl PeerIdentity {
    /// The cluster the certificate was issued for.
    pub fn cluster_id(&self) -> &str {
        match self {
            PeerIdentity::Node { cluster_id, .. } | PeerIdentity::Client { cluster_id, .. } => {
                cluster_id
            }
        }
    }

    /// The node id, if this is a node of `cluster_id`; `None` for a client
    /// or a node of another cluster. A message that claims to be from node
    /// N is accepted only if this returns `Some(N)`.
    pub fn node_in(&self, cluster_id: &str) -> Option<NodeId> {
        match self {
            PeerIdentity::Node { cluster_id: c, id } if c == cluster_id => Some(*id),
            _ => None,
        }
    }

    /// The URI SAN that names this identity in a certificate; [`parse_uri`]
    /// reads it back. The caller has checked the cluster id and name.
    pub(super) fn uri(&self) -> String {
        match self {
            PeerIdentity::Node { cluster_id, id } => format!("{URI_PREFIX}{cluster_id}/node/{id}"),
            PeerIdentity::Client {
                cluster_id,
                name,
                role,
            } => format!("{URI_PREFIX}{cluster_id}/client/{name}/{role}"),
        }
    }
}

impl fmt::Display for PeerIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PeerIdentity::Node { cluster_id, id } => {
                write!(f, "node {id} of cluster {cluster_id}")
            }
            PeerIdentity::Client {
                cluster_id,
                name,
                role,
            } => write!(f, "client {name} ({role}) of cluster {cluster_id}"),
        }
    }
}

/// The URI SAN of cluster `cluster_id`'s CA.
pub(super) fn ca_uri(cluster_id: &str) -> String {
    format!("{URI_PREFIX}{cluster_id}/ca")
}

/// The identity in a peer's leaf certificate (DER), from its one
/// `replica-ha` URI SAN (C1, C3). The chain must already be verified (C2).
pub fn identity_of(cert_der: &[u8]) -> Result<PeerIdentity, CertError> {
    let cert = parse_der(cert_der)?;
    match identity_in(&cert)? {
        Parsed::Leaf(identity) => Ok(identity),
        Parsed::Ca { uri, .. } => Err(CertError::NotALeaf { uri }),
    }
}

/// The cluster id a CA certificate (PEM, as in `ca.crt`) was made for; a
/// node checks it against its configured cluster id.
pub fn cluster_id_of_ca(ca_pem: &[u8]) -> Result<String, CertError> {
    let der = pem_certificate(ca_pem).map_err(CertError::BadCertificate)?;
    let cert = parse_der(&der)?;
    match identity_in(&cert)? {
        Parsed::Ca { cluster_id, .. } if cert.is_ca() => Ok(cluster_id),
        _ => Err(CertError::BadCertificate(
            "it is not a replica-ha CA certificate".into(),
        )),
    }
}

/// An identity URI, parsed.
enum Parsed {
    Ca { uri: String, cluster_id: String },
    Leaf(PeerIdentity),
}

/// The identity in `cert`'s one `replica-ha` URI SAN (C3).
fn identity_in(cert: &X509Certificate<'_>) -> Result<Parsed, CertError> {
    let san = cert
        .subject_alternative_name()
        .map_err(|e| CertError::BadCertificate(e.to_string()))?;
    let ours: Vec<&str> = san
        .iter()
        .flat_map(|ext| ext.value.general_names.iter())
        .filter_map(|name| match name {
            GeneralName::URI(uri) => Some(*uri),
            _ => None,
        })
        .filter(|uri| {
            uri.split_once(':')
                .is_some_and(|(scheme, _)| scheme.eq_ignore_ascii_case(SCHEME))
        })
        .collect();
    match ours.as_slice() {
        [] => Err(CertError::NoIdentity),
        [uri] => parse_uri(uri),
        several => Err(CertError::SeveralIdentities {
            count: several.len(),
        }),
    }
}

fn parse_uri(uri: &str) -> Result<Parsed, CertError> {
    let malformed = |reason| CertError::MalformedIdentity {
        uri: uri.to_owned(),
        reason,
    };
    let rest = uri
        .strip_prefix(URI_PREFIX)
        .ok_or_else(|| malformed("it must start with exactly `replica-ha://`"))?;
    let parts: Vec<&str> = rest.split('/').collect();
    let (cluster_id, path) = parts
        .split_first()
        .ok_or_else(|| malformed("no cluster id"))?;
    if !is_name(cluster_id) {
        return Err(malformed("bad cluster id"));
    }
    let cluster_id = (*cluster_id).to_owned();
    match path {
        ["ca"] => Ok(Parsed::Ca {
            uri: uri.to_owned(),
            cluster_id,
        }),
        ["node", id] => match parse_node_id(id) {
            Some(id) => Ok(Parsed::Leaf(PeerIdentity::Node { cluster_id, id })),
            None => Err(CertError::BadNodeId {
                uri: uri.to_owned(),
            }),
        },
        ["client", name, role] => {
            if !is_name(name) {
                return Err(malformed("bad client name"));
            }
            let role = Role::parse(role).ok_or_else(|| malformed("unknown role"))?;
            Ok(Parsed::Leaf(PeerIdentity::Client {
                cluster_id,
                name: (*name).to_owned(),
                role,
            }))
        }
        ["ca" | "node" | "client", ..] => Err(malformed("wrong number of path segments")),
        [kind, ..] => Err(CertError::UnknownKind {
            uri: uri.to_owned(),
            kind: (*kind).to_owned(),
        }),
        [] => Err(malformed("no kind after the cluster id")),
    }
}

/// A positive decimal without sign or leading zeros.
fn parse_node_id(text: &str) -> Option<NodeId> {
    if text.is_empty() || text.starts_with('0') || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

/// Whether `text` may be a cluster id or a client name: 1 to
/// [`MAX_NAME_LEN`] ASCII letters, digits, `-` and `_`, safe in a URI and
/// a file name as it stands.
pub(super) fn is_name(text: &str) -> bool {
    (1..=MAX_NAME_LEN).contains(&text.len())
        && text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// The DER of the first PEM block of `pem`, which must be a certificate.
pub(super) fn pem_certificate(pem: &[u8]) -> Result<Vec<u8>, String> {
    match Pem::iter_from_buffer(pem).next() {
        Some(Ok(block)) if block.label == "CERTIFICATE" => Ok(block.contents),
        Some(Ok(block)) => Err(format!(
            "its PEM block is {:?}, not CERTIFICATE",
            block.label
        )),
        Some(Err(e)) => Err(format!("not PEM: {e}")),
        None => Err("no PEM certificate in it".into()),
    }
}

/// One whole DER certificate, with nothing after it.
pub(super) fn parse_der(der: &[u8]) -> Result<X509Certificate<'_>, CertError> {
    let (rest, cert) =
        X509Certificate::from_der(der).map_err(|e| CertError::BadCertificate(e.to_string()))?;
    if !rest.is_empty() {
        return Err(CertError::BadCertificate(
            "trailing bytes after the certificate".into(),
        ));
    }
    Ok(cert)
}

#[cfg(test)]
mod tests {
    use rcgen::{CertificateParams, KeyPair, SanType};

    use super::*;
    use crate::certs::files::CA_CERT;
    use crate::certs::test_support::{CLUSTER, ca_dir, der_of};
    use crate::certs::{issue_client, issue_node};

    #[test]
    fn identity_round_trips_for_a_node_and_a_client() {
        let dir = ca_dir();
        let hosts = vec!["10.0.0.5".to_owned(), "node5.example".to_owned()];
        let node = issue_node(dir.path(), NodeId(5), &hosts, 30).unwrap();
        let identity = identity_of(&der_of(&node.cert)).unwrap();
        assert_eq!(
            identity,
            PeerIdentity::Node {
                cluster_id: CLUSTER.into(),
                id: NodeId(5)
            }
        );
        assert_eq!(identity.node_in(CLUSTER), Some(NodeId(5)));
        assert_eq!(identity.node_in("other"), None);

        let client = issue_client(dir.path(), "viewer-bot", Role::Viewer, 30).unwrap();
        let identity = identity_of(&der_of(&client.cert)).unwrap();
        assert_eq!(
            identity,
            PeerIdentity::Client {
                cluster_id: CLUSTER.into(),
                name: "viewer-bot".into(),
                role: Role::Viewer
            }
        );
        assert_eq!(identity.node_in(CLUSTER), None);

        // The CA itself is no peer.
        assert!(matches!(
            identity_of(&der_of(&dir.path().join(CA_CERT))),
            Err(CertError::NotALeaf { .. })
        ));
    }

    /// A certificate with `uris` as its URI SANs, self-signed (the parser
    /// does not look at the signature).
    fn with_uris(uris: &[&str]) -> Vec<u8> {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::default();
        params.subject_alt_names = uris
            .iter()
            .map(|u| SanType::URI((*u).try_into().unwrap()))
            .collect();
        params
            .subject_alt_names
            .push(SanType::DnsName("localhost".try_into().unwrap()));
        params.self_signed(&key).unwrap().der().to_vec()
    }

    #[test]
    fn anything_but_exactly_one_well_formed_identity_is_refused() {
        let ok = with_uris(&["https://example.com/x", "replica-ha://c/node/7"]);
        assert_eq!(
            identity_of(&ok).unwrap(),
            PeerIdentity::Node {
                cluster_id: "c".into(),
                id: NodeId(7)
            }
        );

        type Check = fn(&CertError) -> bool;
        let cases: &[(&[&str], Check)] = &[
            (&[], |e| matches!(e, CertError::NoIdentity)),
            (&["https://c/node/1"], |e| {
                matches!(e, CertError::NoIdentity)
            }),
            (&["replica-ha://c/node/1", "replica-ha://c/node/2"], |e| {
                matches!(e, CertError::SeveralIdentities { count: 2 })
            }),
            (&["replica-ha://c/node/1", "REPLICA-HA://c/node/2"], |e| {
                matches!(e, CertError::SeveralIdentities { count: 2 })
            }),
            (&["Replica-HA://c/node/1"], |e| {
                matches!(e, CertError::MalformedIdentity { .. })
            }),
            (&["replica-ha:c/node/1"], |e| {
                matches!(e, CertError::MalformedIdentity { .. })
            }),
            (&["replica-ha://c/peer/1"], |e| {
                matches!(e, CertError::UnknownKind { .. })
            }),
            (&["replica-ha://c/node/0"], |e| {
                matches!(e, CertError::BadNodeId { .. })
            }),
            (&["replica-ha://c/node/01"], |e| {
                matches!(e, CertError::BadNodeId { .. })
            }),
            (&["replica-ha://c/node/+1"], |e| {
                matches!(e, CertError::BadNodeId { .. })
            }),
            (&["replica-ha://c/node/18446744073709551616"], |e| {
                matches!(e, CertError::BadNodeId { .. })
            }),
            (&["replica-ha://c/node/"], |e| {
                matches!(e, CertError::BadNodeId { .. })
            }),
            (&["replica-ha://c/node/1/x"], |e| {
                matches!(e, CertError::MalformedIdentity { .. })
            }),
            (&["replica-ha://c/node"], |e| {
                matches!(e, CertError::MalformedIdentity { .. })
            }),
            (&["replica-ha:///node/1"], |e| {
                matches!(e, CertError::MalformedIdentity { .. })
            }),
            (&["replica-ha://c?x/node/1"], |e| {
                matches!(e, CertError::MalformedIdentity { .. })
            }),
            (&["replica-ha://c/client/bob/root"], |e| {
                matches!(e, CertError::MalformedIdentity { .. })
            }),
            (&["replica-ha://c/client/bob/Admin"], |e| {
                matches!(e, CertError::MalformedIdentity { .. })
            }),
            (&["replica-ha://c/client/b.b/admin"], |e| {
                matches!(e, CertError::MalformedIdentity { .. })
            }),
            (&["replica-ha://c/client/bob"], |e| {
                matches!(e, CertError::MalformedIdentity { .. })
            }),
            (&["replica-ha://c/ca"], |e| {
                matches!(e, CertError::NotALeaf { .. })
            }),
        ];
        for (uris, expected) in cases {
            let err = identity_of(&with_uris(uris)).unwrap_err();
            assert!(expected(&err), "{uris:?}: {err}");
        }

        assert!(matches!(
            identity_of(b"not a certificate"),
            Err(CertError::BadCertificate(_))
        ));
        let mut trailing = ok.clone();
        trailing.push(0);
        assert!(matches!(
            identity_of(&trailing),
            Err(CertError::BadCertificate(_))
        ));
    }
}
