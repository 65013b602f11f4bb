//! Compiles the server's Modal gRPC subset (`crates/modal/src/modal_api.proto`, the one file
//! both sides are built from) with protox, so no system `protoc` is needed, and generates the
//! server stubs the fake implements. Nothing generated is committed; it lands in `OUT_DIR`.

fn main() {
    const PROTOS: [&str; 2] = [
        "../../crates/modal/src/modal_api.proto",
        "../../crates/modal/src/task_command_router.proto",
    ];
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={proto}");
    }
    let descriptors = match protox::compile(PROTOS, ["../../crates/modal/src"]) {
        Ok(descriptors) => descriptors,
        Err(error) => panic!("cannot compile {PROTOS:?}: {error}"),
    };
    if let Err(error) = tonic_prost_build::configure()
        .build_client(false)
        .build_server(true)
        .compile_fds(descriptors)
    {
        panic!("cannot generate the Modal gRPC server stubs: {error}");
    }
}
