//! Compiles the Modal gRPC subset (`src/modal_api.proto`, and `src/task_command_router.proto`
//! for exec through the per-task command router) with protox, so no system `protoc`
//! is needed. Client stubs only: the local fake of the tests is its own crate (`fakes/modal/`),
//! whose build script generates the server half from the same file. The output lands in
//! `OUT_DIR`; nothing generated is committed.

fn main() {
    modal();
}

fn modal() {
    const PROTOS: [&str; 2] = ["src/modal_api.proto", "src/task_command_router.proto"];
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={proto}");
    }
    let descriptors = match protox::compile(PROTOS, ["src"]) {
        Ok(descriptors) => descriptors,
        Err(error) => panic!("cannot compile {PROTOS:?}: {error}"),
    };
    if let Err(error) = tonic_prost_build::configure()
        .build_client(true)
        .build_server(false)
        .compile_fds(descriptors)
    {
        panic!("cannot generate the Modal gRPC client stubs: {error}");
    }
}
