//! Entry point of the in-computer helper. `kilntainers-helper serve` speaks the protocol of
//! [`kilntainers_helper::wire`] on stdin/stdout until stdin closes, then kills what it started
//! that is still running and exits; `connect <port>` carries one TCP connection to the
//! computer's loopback ([`kilntainers_helper::forward`]); `egress-proxy` runs the egress proxy
//! ([`kilntainers_helper::egress`]) and `egress-relay` its in-computer end for a computer
//! without a network ([`kilntainers_helper::egress::relay`]). Diagnostics go to stderr, which the server logs.

fn main() {
    let mut args = std::env::args().skip(1);
    match args.next().as_deref() {
        Some("serve") => std::process::exit(kilntainers_helper::serve::serve()),
        Some("connect") => {
            std::process::exit(kilntainers_helper::forward::connect(args.next().as_deref()))
        }
        Some("egress-proxy") => std::process::exit(kilntainers_helper::egress::main(args)),
        Some("egress-relay") => std::process::exit(kilntainers_helper::egress::relay::main(args)),
        Some("--version") => println!(
            "kilntainers-helper {}",
            kilntainers_helper::wire::PROTOCOL_VERSION
        ),
        _ => {
            eprintln!(
                "usage: kilntainers-helper serve | connect <port> | egress-proxy [options] | egress-relay SOCKET [--resolv-conf]"
            );
            std::process::exit(2);
        }
    }
}
