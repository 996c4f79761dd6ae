//! Generates the CRI runtime.v1 client from `proto/api.proto` (kubernetes/cri-api), without the gogoproto lines that only steer Go code generation.

use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=proto/api.proto");
    let source = std::fs::read_to_string("proto/api.proto").expect("read proto/api.proto");
    let without_gogo: String = source
        .lines()
        .filter(|line| !line.contains("gogoproto"))
        .map(|line| format!("{line}\n"))
        .collect();
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let include = out.join("proto");
    std::fs::create_dir_all(&include).expect("create the proto directory");
    std::fs::write(include.join("api.proto"), without_gogo).expect("write the proto");
    tonic_prost_build::configure()
        .build_server(false)
        .compile_protos(&[include.join("api.proto")], &[include])
        .expect("compile the CRI proto (protoc is Debian's protobuf-compiler)");
}
