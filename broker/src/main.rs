//! `kilntainers-broker`: the egress proxy of `kilntainers-helper` with TLS termination for the
//! hosts a computer's secrets are bound to (docs/egress.md, "Secrets brokering in the proxy").
//! The helper is std only, so the TLS half ([`terminator::RustlsTerminator`]: rustls, rcgen, webpki-roots)
//! lives in this separate binary, which the egress proxy's image carries instead of the helper
//! when the build has it (crates/docker/build.rs). `egress-proxy` is the helper's own mode with
//! the terminator installed; the helper's other modes are passed through, so this binary stands
//! in for the helper wherever it is used.

mod terminator;

fn main() {
    let mut args = std::env::args().skip(1);
    let code = match args.next().as_deref() {
        Some("egress-proxy") => match terminator::RustlsTerminator::new() {
            Ok(terminator) => {
                kilntainers_helper::egress::main_with(args, Some(Box::new(terminator)))
            }
            Err(e) => {
                eprintln!("kilntainers-broker: cannot start the TLS terminator: {e}");
                1
            }
        },
        Some("egress-relay") => kilntainers_helper::egress::relay::main(args),
        Some("serve") => kilntainers_helper::serve::serve(),
        Some("connect") => kilntainers_helper::forward::connect(args.next().as_deref()),
        Some("--version") => {
            println!(
                "kilntainers-broker {}",
                kilntainers_helper::wire::PROTOCOL_VERSION
            );
            0
        }
        _ => {
            eprintln!(
                "usage: kilntainers-broker egress-proxy [options] | egress-relay SOCKET [--resolv-conf] | serve | connect <port>"
            );
            2
        }
    };
    std::process::exit(code);
}

#[cfg(test)]
mod tests;
