//! The `replica-ha` command line, one command a file; the binary
//! (`src/bin/replica-ha.rs`) only defines the commands and dispatches to
//! the `run` of each.
//!
//! What the commands share lives here: how a client authenticates to a
//! node ([`ClientTls`], S9: a client certificate of the cluster CA, unless
//! the node runs insecure), the admin client and one call of it with a
//! deadline ([`Admin`], [`Rpc`]), one line for why a call failed
//! ([`describe`]), and the exit codes ([`report`], [`failure`],
//! [`usage_error`]).
//!
//! Exit codes: 0 success, 1 a runtime failure (a node unreachable, a failed
//! transfer), 2 a usage or configuration error. Every error goes to stderr
//! as one line that starts with `replica-ha: `.

pub mod attach;
pub mod certs;
pub mod inspect;
pub mod members;
pub mod node;
pub mod resize;
pub mod resync;
pub mod scrub;
pub mod status;
pub mod transfer;
pub mod volume;

use std::fmt::Display;
use std::future::Future;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;

use crate::certs::TlsFiles;
use crate::net::tls::Party;
use crate::net::{Expect, Limits, Tls, Transport};
use crate::proto::admin::admin_client::AdminClient;
use crate::proto::admin::{
    MembersChange, MembersChangeReply, MembersReply, MembersRequest, ResizeReply, ResizeRequest,
    ResyncReply, ResyncRequest, ScrubReply, ScrubRequest, StatusReply, StatusRequest,
    TransferReply, TransferRequest, VolumeCreateReply, VolumeCreateRequest, VolumeDeleteReply,
    VolumeDeleteRequest, VolumeListReply, VolumeListRequest, VolumeMoveReply, VolumeMoveRequest,
};
use tonic::transport::Channel;

/// How the CLI authenticates to a node: a client certificate of the
/// cluster CA (role `viewer` to read, `admin` to change; `attach` needs
/// `user` or `admin` to write the volume). `cluster/up`
/// prints the exact flags (or the environment) to use.
#[derive(Args)]
pub struct ClientTls {
    /// The certificate directory: DIR/ca.crt and, with --as NAME,
    /// DIR/NAME.crt and DIR/NAME.key.
    #[arg(long, global = true, value_name = "DIR", env = "REPLICA_HA_TLS_DIR")]
    tls_dir: Option<PathBuf>,
    /// The client certificate's name in --tls-dir.
    #[arg(long = "as", global = true, value_name = "NAME", env = "REPLICA_HA_AS")]
    name: Option<String>,
    /// The cluster CA certificate (instead of --tls-dir's).
    #[arg(long, global = true, value_name = "FILE")]
    ca: Option<PathBuf>,
    /// The client certificate (instead of --tls-dir's).
    #[arg(long, global = true, value_name = "FILE")]
    cert: Option<PathBuf>,
    /// The client certificate's key (instead of --tls-dir's).
    #[arg(long, global = true, value_name = "FILE")]
    key: Option<PathBuf>,
    /// Connect without TLS, to a node that runs with `insecure = true`.
    #[arg(long, global = true, env = "REPLICA_HA_INSECURE")]
    insecure: bool,
}

impl ClientTls {
    /// The transport these flags describe; an error says what is missing.
    pub fn transport(&self) -> Result<Transport, String> {
        if self.insecure {
            return Ok(Transport::plain(Limits::default()));
        }
        let default = match (&self.tls_dir, &self.name) {
            (Some(dir), Some(name)) => Some(TlsFiles::for_client(dir, name)),
            (Some(dir), None) if self.cert.is_some() && self.key.is_some() => {
                Some(TlsFiles::for_client(dir, "unnamed"))
            }
            (Some(_), None) => {
                return Err("--tls-dir needs --as NAME (the client certificate's name)".into());
            }
            (None, _) => None,
        };
        let files = TlsFiles::with_overrides(
            default,
            self.ca.clone(),
            self.cert.clone(),
            self.key.clone(),
        )
        .ok_or(
            "no client certificate: pass --tls-dir DIR --as NAME (or --ca, --cert and --key), \
             or --insecure for a node without TLS",
        )?;
        let ca_pem = std::fs::read(files.ca())
            .map_err(|e| format!("reading {}: {e}", files.ca().display()))?;
        let cluster = crate::certs::cluster_id_of_ca(&ca_pem)
            .map_err(|e| format!("{}: {e}", files.ca().display()))?;
        let tls = Tls::load(files, &cluster, Party::Client).map_err(|e| e.to_string())?;
        Ok(Transport::secured(Limits::default(), tls))
    }
}

/// The admin client of one node, as the commands use it.
pub struct Admin {
    /// The client, or why there is none (the flags name no usable
    /// certificate, or the address is wrong): each call says so.
    client: Result<AdminClient<Channel>, String>,
}

impl Admin {
    /// A client of the node at `addr` (any node: the server's certificate
    /// must name a node of the cluster, whichever). It connects on its
    /// first call, and its calls share the connection.
    pub fn new(addr: &str, tls: &ClientTls) -> Self {
        let client = tls.transport().and_then(|transport| {
            transport
                .client(addr, Expect::AnyNode, AdminClient::new)
                .map_err(|e| e.to_string())
        });
        Self { client }
    }

    /// One call: `message`, sent by its method ([`Rpc`]) with a deadline of
    /// `timeout`; the reply, or why it failed in one line.
    pub async fn ask<M: Rpc>(&self, message: M, timeout: Duration) -> Result<M::Reply, String> {
        let client = self.client.clone()?;
        let mut request = tonic::Request::new(message);
        request.set_timeout(timeout);
        M::send(client, request)
            .await
            .map(tonic::Response::into_inner)
            .map_err(|s| describe(&s))
    }
}

/// A request of the admin API, and the method that carries it.
pub trait Rpc: Sized {
    /// What the method answers.
    type Reply;
    /// Sends `request` through `client`.
    fn send(
        client: AdminClient<Channel>,
        request: tonic::Request<Self>,
    ) -> impl Future<Output = Result<tonic::Response<Self::Reply>, tonic::Status>> + Send;
}

/// Implements [`Rpc`] for each `Request => method -> Reply`.
macro_rules! rpcs {
    ($($request:ident => $method:ident -> $reply:ident,)*) => {$(
        impl Rpc for $request {
            type Reply = $reply;
            async fn send(
                mut client: AdminClient<Channel>,
                request: tonic::Request<Self>,
            ) -> Result<tonic::Response<$reply>, tonic::Status> {
                client.$method(request).await
            }
        }
    )*};
}

rpcs! {
    StatusRequest => status -> StatusReply,
    MembersRequest => members -> MembersReply,
    MembersChange => change_members -> MembersChangeReply,
    TransferRequest => transfer_leader -> TransferReply,
    ScrubRequest => scrub -> ScrubReply,
    ResyncRequest => resync -> ResyncReply,
    ResizeRequest => resize -> ResizeReply,
    VolumeListRequest => list_volumes -> VolumeListReply,
    VolumeCreateRequest => create_volume -> VolumeCreateReply,
    VolumeDeleteRequest => delete_volume -> VolumeDeleteReply,
    VolumeMoveRequest => move_volume -> VolumeMoveReply,
}

/// One line saying why a call failed: the server's reason, or the
/// transport's (a refused certificate shows up there).
pub fn describe(status: &tonic::Status) -> String {
    let mut line = status.message().to_string();
    let mut source = std::error::Error::source(status);
    while let Some(cause) = source {
        let text = cause.to_string();
        if !line.contains(&text) {
            line = format!("{line}: {text}");
        }
        source = cause.source();
    }
    line
}

/// The end of a command that makes one call: on success the line `done`
/// makes of the reply (exit 0), on failure "`failed`: why" (exit 1).
pub fn report<R>(
    outcome: Result<R, String>,
    failed: impl Display,
    done: impl FnOnce(R) -> String,
) -> ExitCode {
    match outcome {
        Ok(reply) => {
            println!("{}", done(reply));
            ExitCode::SUCCESS
        }
        Err(err) => failure(format!("{failed}: {err}")),
    }
}

/// Says `what` went wrong at run time; exit 1.
pub fn failure(what: impl Display) -> ExitCode {
    eprintln!("replica-ha: {what}");
    ExitCode::FAILURE
}

/// Says what is wrong with the command or the configuration; exit 2.
pub fn usage_error(what: impl Display) -> ExitCode {
    eprintln!("replica-ha: {what}");
    ExitCode::from(2)
}

/// Logs to stderr, at `RUST_LOG`'s levels (by default info, and warnings
/// only from openraft): for the long-running commands, `node` and
/// `attach`.
pub fn init_logging() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,openraft=warn".into()),
        )
        .with_writer(std::io::stderr)
        .try_init();
}
