//! Compiles `proto/*.proto` with the protoc shipped inside `protoc-bin-vendored`,
//! so a fresh machine needs nothing but cargo to build the gRPC services.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY of intent: build scripts are single-threaded; tonic-prost-build
    // reads PROTOC to find the compiler.
    unsafe { std::env::set_var("PROTOC", protoc) };

    let mut protos: Vec<PathBuf> = std::fs::read_dir("proto")?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| path.extension().is_some_and(|ext| ext == "proto"))
        .collect();
    protos.sort();
    for proto in &protos {
        println!("cargo:rerun-if-changed={}", proto.display());
    }
    println!("cargo:rerun-if-changed=proto");
    // The descriptor set serves gRPC server reflection.
    let descriptors = PathBuf::from(std::env::var("OUT_DIR")?).join("replica_ha_descriptor.bin");
    tonic_prost_build::configure()
        .bytes(".")
        .file_descriptor_set_path(descriptors)
        .compile_protos(&protos, &[PathBuf::from("proto")])?;
    Ok(())
}
