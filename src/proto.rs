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
