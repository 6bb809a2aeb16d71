//! Mutual TLS: the credentials one party holds, and the rustls
//! configurations every connection between nodes, to the admin API and to
//! NBD is made with.
//!
//! A [`Tls`] is loaded once at start-up from the party's files (see
//! [`crate::certs::TlsFiles`]): the cluster CA, its own certificate and key.
//! Loading checks them all before anything listens, so a node with a
//! missing, unreadable, expired or foreign certificate stops with one line
//! naming the file: the CA must be this cluster's, the certificate must be
//! signed by it, name this party (node N of this cluster, or a client of
//! it) and not have expired, and the key must be the certificate's.
//!
//! Invariants:
//! - T1: both sides of every connection present a certificate that chains
//!   to the cluster CA; a server refuses a client without one in the
//!   handshake, before a byte of gRPC is read.
//! - T2: a client checks that the server is the node it meant to reach
//!   ([`Expect::Node`]) or at least a node of this cluster
//!   ([`Expect::AnyNode`], for operator tools that dial an address). A
//!   server's identity is its `replica-ha://` URI SAN; host names are not
//!   checked, because the identity is stronger and a node is often dialled
//!   through an address its certificate does not list (a proxy, NAT).
//! - T3: what a server learns of its client is that client's identity,
//!   read from the verified certificate after the handshake; a
//!   connection whose certificate names no identity of this cluster is
//!   closed (gRPC, the block channel) or refused with the reason (NBD).
//!   The handshake checks only the chain: what the identity may do is
//!   decided after it, by the [`crate::net::PeerGuard`] of the service.
//! - T4: [`Tls::reload`] swaps in new credentials only after they passed
//!   the same checks as at start-up; a reload that fails keeps the old
//!   ones. Connections already established keep the credentials they were
//!   made with.
//!
//! Only TLS 1.3 is spoken between nodes and tools (all ours); the NBD
//! server also accepts TLS 1.2, which some NBD clients still use.

use std::path::Path;
use std::sync::{Arc, RwLock};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::danger::ClientCertVerifier;
use rustls::server::{ParsedCertificate, WebPkiClientVerifier};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, Error as TlsError, RootCertStore,
    ServerConfig, SignatureScheme,
};

use crate::certs::{self, CertError, PeerIdentity, TlsFiles};
use crate::ids::NodeId;

/// Whom a TLS party must be: what its own certificate must name when it is
/// loaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Party {
    /// Node `id` of the cluster (serves and calls).
    Node(NodeId),
    /// Any client of the cluster (calls only): an operator's tool.
    Client,
}

/// Whom a client expects to reach (T2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    /// Exactly this node of the cluster.
    Node(NodeId),
    /// Any node of the cluster (a tool dialling an address).
    AnyNode,
}

/// Whether the NBD server asks its clients for certificates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NbdClientAuth {
    /// A client may present one; it must then chain to the CA.
    Optional,
    /// A client must present one that chains to the CA.
    Required,
}

/// One party's TLS credentials, reloadable. See the module docs.
pub struct Tls {
    cluster_id: String,
    files: TlsFiles,
    party: Party,
    provider: Arc<CryptoProvider>,
    current: RwLock<Arc<Credentials>>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls")
            .field("cluster_id", &self.cluster_id)
            .field("party", &self.party)
            .field("cert", &self.files.cert())
            .finish_non_exhaustive()
    }
}

/// What one load of the files produced.
struct Credentials {
    roots: Arc<RootCertStore>,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    /// For the gRPC servers (client certificates required, HTTP/2).
    grpc_server: Arc<ServerConfig>,
    /// The certificate's identity, for the log.
    identity: PeerIdentity,
}

/// The ALPN protocol of gRPC.
const H2: &[u8] = b"h2";

impl Tls {
    /// Loads and checks `files` for `party` of `cluster_id` (see the module
    /// docs).
    pub fn load(files: TlsFiles, cluster_id: &str, party: Party) -> Result<Arc<Self>, CertError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let credentials = Credentials::load(&files, cluster_id, &party, &provider)?;
        Ok(Arc::new(Self {
            cluster_id: cluster_id.to_owned(),
            files,
            party,
            provider,
            current: RwLock::new(Arc::new(credentials)),
        }))
    }

    /// Reads the files again and, if they pass the checks, uses them for
    /// every connection made or accepted from now on (T4). Returns the
    /// loaded certificate's identity.
    pub fn reload(&self) -> Result<PeerIdentity, CertError> {
        let credentials =
            Credentials::load(&self.files, &self.cluster_id, &self.party, &self.provider)?;
        let identity = credentials.identity.clone();
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(credentials);
        Ok(identity)
    }

    /// The cluster every peer must belong to.
    pub fn cluster_id(&self) -> &str {
        &self.cluster_id
    }

    /// The certificate file, for messages.
    pub fn cert_path(&self) -> &Path {
        self.files.cert()
    }

    fn current(&self) -> Arc<Credentials> {
        Arc::clone(&self.current.read().unwrap_or_else(|p| p.into_inner()))
    }

    /// The configuration of a gRPC server: client certificates required
    /// (T1), HTTP/2.
    pub fn grpc_server(&self) -> Arc<ServerConfig> {
        Arc::clone(&self.current().grpc_server)
    }

    /// The configuration of a client that expects to reach `expect`: it
    /// presents this party's certificate and checks the server's (T1, T2).
    pub fn client(&self, expect: Expect) -> Result<Arc<ClientConfig>, TlsError> {
        let current = self.current();
        let verifier = PeerVerifier {
            roots: Arc::clone(&current.roots),
            provider: Arc::clone(&self.provider),
            cluster_id: self.cluster_id.clone(),
            expect,
        };
        let mut config = ClientConfig::builder_with_provider(Arc::clone(&self.provider))
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(verifier))
            .with_client_auth_cert(current.chain.clone(), current.key.clone_key())?;
        config.alpn_protocols = vec![H2.to_vec()];
        Ok(Arc::new(config))
    }

    /// The configuration of the NBD server: this node's certificate, TLS
    /// 1.2 or 1.3, and client certificates from the CA as `auth` says.
    pub fn nbd_server(&self, auth: NbdClientAuth) -> Result<Arc<ServerConfig>, TlsError> {
        let current = self.current();
        let verifier = client_verifier(&current.roots, &self.provider, auth)?;
        let config = ServerConfig::builder_with_provider(Arc::clone(&self.provider))
            .with_safe_default_protocol_versions()?
            .with_client_cert_verifier(verifier)
            .with_single_cert(current.chain.clone(), current.key.clone_key())?;
        Ok(Arc::new(config))
    }

    /// The identity of the client of a finished server handshake (T3):
    /// `None` when it presented no certificate, an error when its
    /// certificate names no identity of this cluster.
    pub fn client_identity(
        &self,
        certs: Option<&[CertificateDer<'_>]>,
    ) -> Result<Option<PeerIdentity>, CertError> {
        let Some(leaf) = certs.and_then(|certs| certs.first()) else {
            return Ok(None);
        };
        let identity = certs::identity_of(leaf)?;
        if identity.cluster_id() != self.cluster_id {
            return Err(CertError::BadCertificate(format!(
                "it is for cluster {:?}, not {:?}",
                identity.cluster_id(),
                self.cluster_id
            )));
        }
        Ok(Some(identity))
    }
}

/// Verifies a client's chain against the CA, and nothing else: its
/// identity and role are read and judged after the handshake (T3).
fn client_verifier(
    roots: &Arc<RootCertStore>,
    provider: &Arc<CryptoProvider>,
    auth: NbdClientAuth,
) -> Result<Arc<dyn ClientCertVerifier>, TlsError> {
    let builder =
        WebPkiClientVerifier::builder_with_provider(Arc::clone(roots), Arc::clone(provider));
    let builder = match auth {
        NbdClientAuth::Required => builder,
        NbdClientAuth::Optional => builder.allow_unauthenticated(),
    };
    builder
        .build()
        .map_err(|err| TlsError::General(format!("client verifier: {err}")))
}

impl Credentials {
    fn load(
        files: &TlsFiles,
        cluster_id: &str,
        party: &Party,
        provider: &Arc<CryptoProvider>,
    ) -> Result<Self, CertError> {
        let material = files.load()?;
        let bad = |path: &Path, reason: String| CertError::BadFile {
            path: path.to_owned(),
            reason,
            remedy: "issue it again with `replica-ha certs` from this cluster's CA".into(),
        };
        let ca_cluster = certs::cluster_id_of_ca(&material.ca_pem)
            .map_err(|e| bad(files.ca(), e.to_string()))?;
        if ca_cluster != cluster_id {
            return Err(bad(
                files.ca(),
                format!("it is the CA of cluster {ca_cluster:?}, this is cluster {cluster_id:?}"),
            ));
        }
        let chain: Vec<CertificateDer<'static>> =
            CertificateDer::pem_slice_iter(&material.cert_pem)
                .collect::<Result<_, _>>()
                .map_err(|e| bad(files.cert(), format!("not a PEM certificate: {e}")))?;
        let leaf = chain
            .first()
            .ok_or_else(|| bad(files.cert(), "no certificate in it".into()))?;
        let identity = certs::identity_of(leaf).map_err(|e| bad(files.cert(), e.to_string()))?;
        let expected = match (party, &identity) {
            (Party::Node(id), PeerIdentity::Node { id: named, .. }) if named == id => Ok(()),
            (Party::Node(id), other) => Err(format!(
                "it is the certificate of {other}, not of node {id}"
            )),
            (Party::Client, PeerIdentity::Client { .. }) => Ok(()),
            (Party::Client, other) => {
                Err(format!("it is the certificate of {other}, not of a client"))
            }
        };
        expected.map_err(|reason| bad(files.cert(), reason))?;

        let mut roots = RootCertStore::empty();
        for ca in CertificateDer::pem_slice_iter(&material.ca_pem) {
            let ca = ca.map_err(|e| bad(files.ca(), format!("not a PEM certificate: {e}")))?;
            roots
                .add(ca)
                .map_err(|e| bad(files.ca(), format!("not a usable CA certificate: {e}")))?;
        }
        let roots = Arc::new(roots);
        // Signed by this CA, and usable as what the party is (serverAuth
        // for a node, clientAuth for a client).
        let signed = match party {
            Party::Node(_) => ParsedCertificate::try_from(leaf).and_then(|parsed| {
                rustls::client::verify_server_cert_signed_by_trust_anchor(
                    &parsed,
                    &roots,
                    &chain[1..],
                    UnixTime::now(),
                    provider.signature_verification_algorithms.all,
                )
            }),
            Party::Client => {
                client_verifier(&roots, provider, NbdClientAuth::Required).and_then(|verifier| {
                    verifier
                        .verify_client_cert(leaf, &chain[1..], UnixTime::now())
                        .map(|_| ())
                })
            }
        };
        signed.map_err(|e| {
            bad(
                files.cert(),
                format!("it does not verify against {}: {e}", files.ca().display()),
            )
        })?;

        let key = PrivateKeyDer::from_pem_slice(&material.key_pem)
            .map_err(|e| bad(files.key(), format!("not a PEM private key: {e}")))?;
        let verifier = client_verifier(&roots, provider, NbdClientAuth::Required)
            .map_err(|e| bad(files.ca(), e.to_string()))?;
        let mut grpc_server = ServerConfig::builder_with_provider(Arc::clone(provider))
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| bad(files.cert(), e.to_string()))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain.clone(), key.clone_key())
            .map_err(|e| bad(files.key(), e.to_string()))?;
        grpc_server.alpn_protocols = vec![H2.to_vec()];
        Ok(Self {
            roots,
            chain,
            key,
            grpc_server: Arc::new(grpc_server),
            identity,
        })
    }
}

/// Checks a server's certificate: signed by the cluster CA, for server
/// authentication, not expired, and naming the node expected (T2).
#[derive(Debug)]
struct PeerVerifier {
    roots: Arc<RootCertStore>,
    provider: Arc<CryptoProvider>,
    cluster_id: String,
    expect: Expect,
}

impl ServerCertVerifier for PeerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, TlsError> {
        let parsed = ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &parsed,
            &self.roots,
            intermediates,
            now,
            self.provider.signature_verification_algorithms.all,
        )?;
        let refused =
            || TlsError::InvalidCertificate(CertificateError::ApplicationVerificationFailure);
        let identity = certs::identity_of(end_entity).map_err(|_| refused())?;
        match (identity.node_in(&self.cluster_id), self.expect) {
            (Some(id), Expect::Node(expected)) if id == expected => {}
            (Some(_), Expect::AnyNode) => {}
            _ => {
                tracing::warn!(%identity, expected = ?self.expect, "refused a server's certificate");
                return Err(refused());
            }
        }
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, TlsError> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, TlsError> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// Test support: a client configuration that trusts `dir`'s `ca.crt` and
/// presents `<name>.crt` and `<name>.key` from it (or no certificate),
/// made without [`Tls::load`]'s checks, so that a test can present what a
/// server must refuse: a certificate of the CA that names nobody.
#[cfg(any(test, feature = "testing"))]
pub fn unchecked_client(dir: &Path, name: Option<&str>) -> Result<Arc<ClientConfig>, String> {
    let read = |file: String| std::fs::read(dir.join(&file)).map_err(|e| format!("{file}: {e}"));
    let mut roots = RootCertStore::empty();
    for ca in CertificateDer::pem_slice_iter(&read("ca.crt".into())?) {
        roots
            .add(ca.map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots);
    let config = match name {
        None => builder.with_no_client_auth(),
        Some(name) => {
            let chain = CertificateDer::pem_slice_iter(&read(format!("{name}.crt"))?)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| e.to_string())?;
            let key = PrivateKeyDer::from_pem_slice(&read(format!("{name}.key"))?)
                .map_err(|e| e.to_string())?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| e.to_string())?
        }
    };
    Ok(Arc::new(config))
}

/// The name a client sends in its handshake for `addr` (`HOST:PORT`). The
/// server's identity is checked by its URI SAN, not by this name (T2).
pub fn server_name(addr: &str) -> ServerName<'static> {
    let host = addr
        .rsplit_once(':')
        .map_or(addr, |(host, _)| host)
        .trim_start_matches('[')
        .trim_end_matches(']');
    ServerName::try_from(host.to_owned()).unwrap_or(ServerName::IpAddress(
        std::net::IpAddr::from(std::net::Ipv4Addr::UNSPECIFIED).into(),
    ))
}
