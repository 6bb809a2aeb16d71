//! What the tests of more than one file here share: a fresh CA to issue
//! from, and reading back what was written.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use super::identity::pem_certificate;
use super::{DEFAULT_CA_DAYS, init};

/// The cluster id of [`ca_dir`]'s CA.
pub(super) const CLUSTER: &str = "test-cluster";

/// A temporary directory holding a new CA of [`CLUSTER`].
pub(super) fn ca_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    init(dir.path(), CLUSTER, DEFAULT_CA_DAYS, false).unwrap();
    dir
}

/// The DER of the PEM certificate in `path`.
pub(super) fn der_of(path: &Path) -> Vec<u8> {
    pem_certificate(&fs::read(path).unwrap()).unwrap()
}

/// `path`'s permission bits.
pub(super) fn mode_of(path: &Path) -> u32 {
    fs::metadata(path).unwrap().permissions().mode() & 0o777
}
