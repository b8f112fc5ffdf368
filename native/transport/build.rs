//! The messages and services of `proto/embedding.proto`, the wire format the Python services speak too.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "../../proto/embedding.proto";
    println!("cargo:rerun-if-changed={proto}");
    // SAFETY (of the environment): a build script is single-threaded; tonic-prost-build reads PROTOC.
    unsafe { std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?) };
    tonic_prost_build::configure()
        .build_client(true)
        .bytes(".")
        .codec_path("crate::codec::LenientCodec")
        .compile_protos(&[proto], &["../../proto"])?;
    Ok(())
}
