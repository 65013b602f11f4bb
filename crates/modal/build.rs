//! Compiles the Modal gRPC subset (`src/modal_api.proto`) with protox, so no system `protoc`
//! is needed. Client stubs only: the local fake of the tests is its own crate (`fakes/modal/`),
//! whose build script generates the server half from the same file. The output lands in
//! `OUT_DIR`; nothing generated is committed.

fn main() {
    modal();
}

fn modal() {
    const PROTO: &str = "src/modal_api.proto";
    println!("cargo:rerun-if-changed={PROTO}");
    let descriptors = match protox::compile([PROTO], ["src"]) {
        Ok(descriptors) => descriptors,
        Err(error) => panic!("cannot compile {PROTO}: {error}"),
    };
    if let Err(error) = tonic_prost_build::configure()
        .build_client(true)
        .build_server(false)
        .compile_fds(descriptors)
    {
        panic!("cannot generate the Modal gRPC client stubs: {error}");
    }
}
