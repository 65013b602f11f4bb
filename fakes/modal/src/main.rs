//! `fake-modal`: the local fake of Modal's gRPC API as a process, for the black-box tests
//! (`tests/blackbox/test_modal_fake.py`); never shipped. All logic lives in the library.

fn main() -> std::process::ExitCode {
    fake_modal::main()
}
