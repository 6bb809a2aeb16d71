//! Certificates for mutual TLS: the cluster's certificate authority, one
//! certificate per node and per client tool, and reading a peer's identity
//! back out of the certificate it presented.
//!
//! A cluster has one CA. `replica-ha certs init` makes it; `certs node` and
//! `certs client` issue certificates signed by it. Every node trusts only
//! that CA (for its servers and as a client of its peers), so a certificate
//! from any other CA fails the handshake before a byte of gRPC is read.
//! This is what S9 of `docs/design.md` (only members speak; the
//! certificate decides what a client may do) rests on: the chain says a
//! peer belongs to the cluster, and the identity below says which node or
//! which client, with which [`Role`], it is.
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
//!
//! # Layout
//!
//! One file a job, each restating the invariants above that it keeps:
//! - `identity.rs`: [`Role`], [`PeerIdentity`] and the URI grammar, written
//!   for issuance and read back by [`identity_of`] on every handshake
//!   (C1–C3);
//! - `issue.rs`: the CA and the certificates it signs, with rcgen (C5, C6);
//! - `files.rs`: [`TlsFiles`], loading and checking a party's files, and
//!   writing them atomically with their modes (C4);
//! - `cli.rs`: the `certs` command ([`CertsCommand`], [`run`]);
//! - `error.rs`: [`CertError`], shared by all four.

mod cli;
mod error;
mod files;
mod identity;
mod issue;
#[cfg(test)]
mod test_support;

pub use cli::{CertsCommand, run};
pub use error::CertError;
pub use files::{TlsFiles, TlsMaterial};
pub use identity::{PeerIdentity, Role, cluster_id_of_ca, identity_of};
#[cfg(any(test, feature = "testing"))]
pub use issue::issue_unnamed;
pub use issue::{
    DEFAULT_CA_DAYS, DEFAULT_LEAF_DAYS, Issued, MAX_DAYS, init, issue_client, issue_node,
    issue_node_with_validity,
};
