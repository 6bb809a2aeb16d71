//! `replica-ha certs`: the cluster CA and its node and client certificates
//! (S9). The work is [`crate::certs::run`]'s; this prints its report, or
//! its error as a usage error (exit 2: a wrong directory, name or role).

use std::process::ExitCode;

use crate::certs::CertsCommand;

/// Runs one `certs` subcommand.
pub fn run(command: CertsCommand) -> ExitCode {
    match crate::certs::run(command) {
        Ok(report) => {
            println!("{report}");
            ExitCode::SUCCESS
        }
        Err(err) => super::usage_error(err),
    }
}
