//! Issuance: the cluster's CA (`init`) and the node and client
//! certificates it signs, made with rcgen from the checked inputs and
//! written through [`super::files`].
//!
//! Every certificate gets its one identity URI from
//! [`super::identity`], so what is issued here is what a handshake will
//! read back; a certificate of this CA is what S9 (`docs/design.md`) calls
//! a member's or a client's, and its URI is what it may claim to be.
//!
//! Invariants (numbered as in [`super`]):
//! - Inputs are checked before anything is written: cluster id and client
//!   name (the grammar of [`super::identity`]; a client may not take the
//!   CA's or a node's file name), node id, hosts, days.
//! - C5: [`init`] replaces an existing CA only when forced; it writes the
//!   key first, so a crash leaves a key without a certificate, which
//!   issuing reports and `init` will not overwrite unforced. Node and
//!   client certificates are replaced when issued again (renewal).
//! - C6: the CA has path length 0 and signs only leaves; a leaf is never a
//!   CA, never outlives the CA that signs it, and is for server and client
//!   authentication (a node) or client authentication only (a client).
//! - Validity starts an hour back, for clocks a little behind this one.

use std::fs;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, PublicKeyData, SanType,
};
use time::{Duration, OffsetDateTime};

use super::CertError;
use super::files::{CA_CERT, CA_KEY, TlsFiles, create_dir, read, write_cert, write_key};
use super::identity::{
    PeerIdentity, Role, ca_uri, cluster_id_of_ca, is_name, parse_der, pem_certificate,
};
use crate::ids::NodeId;

/// How long a CA is valid by default, in days.
pub const DEFAULT_CA_DAYS: u32 = 3650;
/// How long a node or client certificate is valid by default, in days.
pub const DEFAULT_LEAF_DAYS: u32 = 365;
/// The longest validity accepted, in days (a hundred years).
pub const MAX_DAYS: u32 = 36_500;

/// How far back a certificate's validity starts (clock skew).
const BACKDATE: Duration = Duration::hours(1);
/// The default hosts of a node certificate.
pub(super) const DEFAULT_HOSTS: [&str; 2] = ["127.0.0.1", "localhost"];

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
    create_dir(dir)?;
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
    write_key(&key_path, &key.serialize_pem(), replace)?;
    write_cert(&cert_path, &cert.pem(), replace)?;
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

        write_key(files.key(), &key.serialize_pem(), true)?;
        write_cert(files.cert(), &cert.pem(), true)?;
        Ok(Issued {
            cert: files.cert().to_owned(),
            key: files.key().to_owned(),
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use rustls::client::danger::ServerCertVerifier;
    use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
    use rustls::{CertificateError, RootCertStore};

    use super::*;
    use crate::certs::test_support::{CLUSTER, ca_dir, der_of, mode_of};

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
}
