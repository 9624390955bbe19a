//! Compiles proto/specd/v1/*.proto once, for every crate, with a vendored protoc (no system
//! install needed), and writes the descriptor set that gRPC reflection serves.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY: build scripts are single-threaded.
    unsafe { std::env::set_var("PROTOC", protoc) };
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    let files = ["common", "drafter", "verifier", "orchestrator"].map(|f| format!("specd/v1/{f}.proto"));
    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("specd_v1_descriptor.bin"))
        .compile_protos(&files, &[".".to_string()])?;
    for f in &files {
        println!("cargo:rerun-if-changed={f}");
    }
    Ok(())
}
