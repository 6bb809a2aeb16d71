//! The `replica-ha certs` command: clap's types for `init`, `node` and
//! `client`, and [`run`], which calls [`super::issue`] and tells the
//! operator what was written and what to do next.
//!
//! Nothing here decides what a certificate holds; it only maps arguments
//! onto issuance. Two things the command line itself enforces before
//! issuance sees them: a node id is at least 1, and a role is one of the
//! three [`Role`]s (S9's roles, `docs/design.md`). Replacing a CA takes
//! `--force` (C5, in [`super`]); node and client certificates are replaced
//! when issued again, which is how they are renewed.

use std::path::PathBuf;

use super::issue::{DEFAULT_HOSTS, init, issue_client, issue_node};
use super::{CertError, DEFAULT_CA_DAYS, DEFAULT_LEAF_DAYS, Role};
use crate::ids::NodeId;

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::certs::PeerIdentity;
    use crate::certs::identity_of;
    use crate::certs::test_support::{CLUSTER, der_of};

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
