//! `fake-modal`: the local fake of Modal's gRPC API used by the black-box tests (cargo feature
//! `modal-fake`; never shipped). All logic lives in `backends::modal::fake`.

fn main() -> std::process::ExitCode {
    mcp_sandbox_computer_vm_for_ai::backends::modal::fake::main()
}
