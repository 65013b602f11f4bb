//! Compiles the Modal gRPC subset (`src/backends/modal/modal_api.proto`) with protox, so no
//! system `protoc` is needed. Client and server stubs are both generated: the server half is
//! what the local fake of the tests implements. Nothing generated is committed; it lands in
//! `OUT_DIR`.

fn main() {
    #[cfg(feature = "modal")]
    modal();
}

#[cfg(feature = "modal")]
fn modal() {
    const PROTO: &str = "src/backends/modal/modal_api.proto";
    println!("cargo:rerun-if-changed={PROTO}");
    let descriptors = match protox::compile([PROTO], ["src/backends/modal"]) {
        Ok(descriptors) => descriptors,
        Err(error) => panic!("cannot compile {PROTO}: {error}"),
    };
    if let Err(error) = tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(descriptors)
    {
        panic!("cannot generate the Modal gRPC stubs: {error}");
    }
}
