//! A party's certificate files: where they are, reading and checking them
//! as a set ([`TlsFiles::load`]), and writing them so that no reader ever
//! sees a part of one and no key is ever readable by others.
//!
//! The layout of a certificate directory is fixed here (see [`super`],
//! *Files*): `ca.crt` and `ca.key`, `node-<id>.crt`/`.key`,
//! `<name>.crt`/`.key`. [`TlsFiles::load`] is what a node, `attach` and
//! the admin tools run at start-up and on reload, before [`crate::net::tls`]
//! builds the mutual TLS of S9 (`docs/design.md`) from what it returns.
//!
//! Invariants (numbered as in [`super`]):
//! - C4: a private key is created with mode 0600 ([`write_key`]), never
//!   narrowed afterwards; certificates are 0644 and the directory 0700.
//!   Every file is written to a temporary file beside it, synced, and
//!   renamed (or, where it must not replace anything, linked) into place,
//!   and the directory is synced: a crash leaves the old file or the new
//!   one, never a part.
//! - [`TlsFiles::load`] hands out nothing it has not checked: the CA is a
//!   replica-ha CA, the certificate names a node or client of that CA's
//!   cluster and has not expired, and the key is the certificate's. Whether
//!   the CA signed the certificate is left to the handshake; the key is
//!   never printed ([`TlsMaterial`]'s `Debug`).

use std::fmt;
use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use rcgen::{KeyPair, PublicKeyData};
use time::OffsetDateTime;

use super::CertError;
use super::identity::{cluster_id_of_ca, identity_of, parse_der, pem_certificate};
use crate::ids::NodeId;

/// The CA's certificate in a certificate directory.
pub(super) const CA_CERT: &str = "ca.crt";
/// The CA's private key in a certificate directory.
pub(super) const CA_KEY: &str = "ca.key";
const CERT_MODE: u32 = 0o644;
const KEY_MODE: u32 = 0o600;
const DIR_MODE: u32 = 0o700;

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

/// Creates `dir` and any missing parents, mode 0700 (those that exist are
/// left as they are).
pub(super) fn create_dir(dir: &Path) -> Result<(), CertError> {
    DirBuilder::new()
        .recursive(true)
        .mode(DIR_MODE)
        .create(dir)
        .map_err(|source| io_error("creating", dir, source))
}

/// Writes a private key (PEM) to `path`, created mode 0600 (C4); see
/// [`write_atomic`] for `replace`.
pub(super) fn write_key(path: &Path, pem: &str, replace: bool) -> Result<(), CertError> {
    write_atomic(path, pem.as_bytes(), KEY_MODE, replace)
}

/// Writes a certificate (PEM) to `path`, mode 0644; see [`write_atomic`]
/// for `replace`.
pub(super) fn write_cert(path: &Path, pem: &str, replace: bool) -> Result<(), CertError> {
    write_atomic(path, pem.as_bytes(), CERT_MODE, replace)
}

/// The bytes of `path`; a missing file is [`CertError::Missing`], with
/// `remedy` saying what makes it.
pub(super) fn read(path: &Path, remedy: &str) -> Result<Vec<u8>, CertError> {
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
/// Only a new CA is written without `replace`, so a file in the way is
/// reported as [`CertError::CaExists`].
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
    use super::*;
    use crate::certs::test_support::{CLUSTER, ca_dir, mode_of};
    use crate::certs::{DEFAULT_CA_DAYS, DEFAULT_LEAF_DAYS, Role, init, issue_client, issue_node};

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
}
