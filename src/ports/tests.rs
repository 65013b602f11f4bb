//! The forwarders over the fake backend: real loopback sockets, the fake's echo port.

use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::{PortError, PortUrl, Ports};
use crate::backends::fake::{ECHO_PORT, FakeBackend, within};
use crate::config::ExecLimits;
use crate::ids::{ComputerId, InstanceId};
use crate::registry::Registry;

fn setup() -> (Arc<FakeBackend>, Arc<Registry>, Arc<Ports>) {
    let backend = FakeBackend::new();
    let registry = Registry::new(
        backend.clone(),
        InstanceId::random(),
        "/bin/sh".to_owned(),
        ExecLimits {
            default_timeout_secs: 60,
            output_limit: 1000,
        },
        crate::config::Quotas::default(),
    );
    let ports = Ports::new(registry.clone());
    (backend, registry, ports)
}

fn forwarded(url: PortUrl) -> std::net::SocketAddr {
    match url {
        PortUrl::Forwarded(address) => address,
        other => panic!("expected a forwarder, got {other:?}"),
    }
}

/// Sends `bytes` through a new connection and returns what came back before it closed.
async fn round_trip(address: std::net::SocketAddr, bytes: &[u8]) -> Vec<u8> {
    let Ok(mut stream) = TcpStream::connect(address).await else {
        return Vec::new();
    };
    let mut back = Vec::new();
    if stream.write_all(bytes).await.is_ok() {
        let _ = stream.shutdown().await;
        let _ = stream.read_to_end(&mut back).await;
    }
    back
}

#[tokio::test]
async fn a_forwarder_carries_bytes_to_the_port_and_back() {
    let (backend, _registry, ports) = setup();
    let sandbox = backend.insert(&ComputerId::parse("web").unwrap(), false, true);
    let address = forwarded(within(ports.url(&sandbox, ECHO_PORT)).await.unwrap());
    assert!(address.ip().is_loopback(), "{address}");
    assert_eq!(
        within(round_trip(address, b"hello port")).await,
        b"hello port"
    );
    // A second call for the same port reuses the forwarder.
    let again = forwarded(within(ports.url(&sandbox, ECHO_PORT)).await.unwrap());
    assert_eq!(again, address);
}

#[tokio::test]
async fn a_closed_port_is_refused_and_a_stopped_computer_closes_the_connection() {
    let (backend, _registry, ports) = setup();
    let id = ComputerId::parse("web").unwrap();
    let sandbox = backend.insert(&id, false, true);
    let refused = within(ports.url(&sandbox, 8080)).await;
    assert!(matches!(refused, Err(PortError::Backend(_))), "{refused:?}");
    let echo = forwarded(within(ports.url(&sandbox, ECHO_PORT)).await.unwrap());
    backend.stop(&id);
    assert_eq!(within(round_trip(echo, b"anyone?")).await, b"");
    assert!(matches!(
        within(ports.connect(&id, ECHO_PORT)).await,
        Err(PortError::Backend(_))
    ));
}

#[tokio::test]
async fn deleting_the_computer_ends_its_forwarders_and_connect_never_creates() {
    let (backend, registry, ports) = setup();
    let id = ComputerId::parse("web").unwrap();
    let sandbox = backend.insert(&id, false, true);
    let address = forwarded(within(ports.url(&sandbox, ECHO_PORT)).await.unwrap());
    within(registry.delete(&id)).await.unwrap();
    assert_eq!(within(round_trip(address, b"still there?")).await, b"");
    assert!(matches!(
        within(ports.connect(&id, ECHO_PORT)).await,
        Err(PortError::NotFound(_))
    ));
    assert!(!backend.exists(&id), "connect created the computer");
}

fn origin(url: PortUrl) -> String {
    match url {
        PortUrl::Origin(url) => url,
        other => panic!("expected a port origin, got {other:?}"),
    }
}

/// The host name of a port origin URL.
fn host_of(url: &str) -> &str {
    let authority = url.strip_prefix("http://").unwrap().trim_end_matches('/');
    authority.rsplit_once(':').unwrap().0
}

// See: issue 30
#[tokio::test]
async fn over_http_ports_get_keyed_origins_and_no_listener() {
    let (backend, registry, ports) = setup();
    ports.route_over_http(super::OriginNames {
        domain: "localhost".to_owned(),
        listener_port: 8435,
    });
    let id = ComputerId::parse("web").unwrap();
    let sandbox = backend.insert(&id, false, true);
    let url = origin(within(ports.url(&sandbox, ECHO_PORT)).await.unwrap());
    let host = host_of(&url);
    let (label, domain) = host.split_once('.').unwrap();
    assert_eq!(domain, "localhost");
    let key = label.strip_prefix(&format!("p{ECHO_PORT}-")).unwrap();
    assert!(
        key.len() == 32
            && key
                .bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()),
        "{key}"
    );
    assert!(url.ends_with(":8435/"), "{url}");
    assert!(
        ports.forwarders().is_empty(),
        "a loopback forwarder was started over HTTP"
    );
    // The same key for the same port; the key names the computer and port, nothing else.
    assert_eq!(
        origin(within(ports.url(&sandbox, ECHO_PORT)).await.unwrap()),
        url
    );
    assert_eq!(ports.origin_of_host(host), Some((id.clone(), ECHO_PORT)));
    assert_eq!(
        ports.origin_of_host(&host.replace(&format!("p{ECHO_PORT}-"), "p1-")),
        None
    );
    let guessed = format!("p{ECHO_PORT}-{}.localhost", "0".repeat(32));
    assert_eq!(ports.origin_of_host(&guessed), None);
    assert_eq!(ports.origin_of_host("localhost"), None);
    // Gone with the computer.
    within(registry.delete(&id)).await.unwrap();
    assert_eq!(ports.origin_of_host(host), None);
}
