//! Types generated from `proto/` by `build.rs`.

/// The replica service (`proto/replica.proto`).
pub mod replica {
    tonic::include_proto!("replica_ha.replica.v1");
}
