//! Types generated from `proto/` by `build.rs`.

/// The replica service (`proto/replica.proto`).
pub mod replica {
    tonic::include_proto!("replica_ha.replica.v1");
}

/// Raft traffic between nodes (`proto/raft.proto`).
pub mod raft {
    tonic::include_proto!("replica_ha.raft.v1");
}

/// The operator's service (`proto/admin.proto`).
pub mod admin {
    tonic::include_proto!("replica_ha.admin.v1");
}

/// The encoded descriptors of every service, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("replica_ha_descriptor");
