//! Types generated from `proto/` by `build.rs`.

/// The replica service (`proto/replica.proto`).
pub mod replica {
    tonic::include_proto!("replica_ha.replica.v1");
}

/// Raft traffic between nodes (`proto/raft.proto`).
pub mod raft {
    tonic::include_proto!("replica_ha.raft.v1");
}

/// What a node tells its peers about itself (`proto/node.proto`).
pub mod node {
    tonic::include_proto!("replica_ha.node.v1");
}

/// The operator's service (`proto/admin.proto`).
pub mod admin {
    tonic::include_proto!("replica_ha.admin.v1");
}

/// The encoded descriptors of every service, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("replica_ha_descriptor");

/// Every generated client and server takes the transport's message limits
/// the same way.
macro_rules! limited {
    ($(impl<$($g:ident),*> $ty:ty;)*) => {$(
        impl<$($g),*> crate::net::Limited for $ty {
            fn limited(self, max: usize) -> Self {
                self.max_decoding_message_size(max)
                    .max_encoding_message_size(max)
            }
        }
    )*};
}

limited! {
    impl<> replica::replica_client::ReplicaClient<tonic::transport::Channel>;
    impl<T> replica::replica_server::ReplicaServer<T>;
    impl<> raft::raft_client::RaftClient<tonic::transport::Channel>;
    impl<T> raft::raft_server::RaftServer<T>;
    impl<> node::node_client::NodeClient<tonic::transport::Channel>;
    impl<T> node::node_server::NodeServer<T>;
    impl<> admin::admin_client::AdminClient<tonic::transport::Channel>;
    impl<T> admin::admin_server::AdminServer<T>;
}
