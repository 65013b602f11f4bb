//! Unit tests of `port_proxy`.

use super::*;

#[test]
fn paths_name_a_computer_a_port_and_the_rest() {
    let target = parse(&Uri::from_static("/computers/dev-box/ports/8080/a/b?x=1")).unwrap();
    assert_eq!(target.computer.as_str(), "dev-box");
    assert_eq!(target.port, 8080);
    assert_eq!(target.rest.as_deref(), Some("a/b"));
    let bare = parse(&Uri::from_static("/computers/dev-box/ports/8080")).unwrap();
    assert_eq!(bare.rest, None);
    for bad in [
        "/computers/dev-box/ports/0/",
        "/computers/dev-box/ports/65536/",
        "/computers/Not_An_Id!/ports/80/",
        "/computers/dev-box/files/80/",
    ] {
        assert!(parse(&Uri::from_static(bad)).is_err(), "{bad}");
    }
}

#[test]
fn hop_by_hop_headers_are_dropped_and_upgrades_kept_only_when_asked() {
    let mut headers = HeaderMap::new();
    headers.insert(CONNECTION, HeaderValue::from_static("Upgrade, x-private"));
    headers.insert(UPGRADE, HeaderValue::from_static("websocket"));
    headers.insert("x-private", HeaderValue::from_static("1"));
    headers.insert(TRANSFER_ENCODING, HeaderValue::from_static("chunked"));
    headers.insert("x-kept", HeaderValue::from_static("1"));
    assert!(wants_upgrade(&headers));
    let mut upgraded = headers.clone();
    strip_hop_by_hop(&mut upgraded, true);
    assert!(upgraded.contains_key(UPGRADE) && upgraded.contains_key(CONNECTION));
    assert!(!upgraded.contains_key("x-private") && !upgraded.contains_key(TRANSFER_ENCODING));
    strip_hop_by_hop(&mut headers, false);
    assert!(!headers.contains_key(UPGRADE) && !headers.contains_key(CONNECTION));
    assert!(headers.contains_key("x-kept"));
}

#[test]
fn credentials_and_origin_wide_headers_are_dropped() {
    let mut headers = HeaderMap::new();
    for name in [
        "cookie",
        "authorization",
        "x-forwarded-for",
        "x-forwarded-user",
        "x-auth-request-email",
        "cf-access-jwt-assertion",
        "x-ms-client-principal-name",
        "x-kept",
    ] {
        headers.insert(HeaderName::from_static(name), HeaderValue::from_static("v"));
    }
    strip_named(
        &mut headers,
        &CREDENTIAL_HEADERS,
        &CREDENTIAL_HEADER_PREFIXES,
    );
    assert_eq!(
        headers.keys().map(HeaderName::as_str).collect::<Vec<_>>(),
        ["x-kept"]
    );
    let mut headers = HeaderMap::new();
    for name in [
        "set-cookie",
        "service-worker-allowed",
        "access-control-allow-origin",
        "content-type",
    ] {
        headers.insert(HeaderName::from_static(name), HeaderValue::from_static("v"));
    }
    strip_named(&mut headers, &ORIGIN_WIDE_HEADERS, &[CORS_PREFIX]);
    assert_eq!(
        headers.keys().map(HeaderName::as_str).collect::<Vec<_>>(),
        ["content-type"]
    );
}

fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
    let mut map = HeaderMap::new();
    for (name, value) in pairs {
        map.append(
            HeaderName::from_static(name),
            HeaderValue::from_static(value),
        );
    }
    map
}

#[test]
fn only_a_routes_own_pages_and_direct_requests_get_through() {
    let get = Method::GET;
    let host = ("host", "p80-k.localhost:8435");
    for (pairs, server, own) in [
        // An HTTP client, a typed address, the page's own requests.
        (vec![host], true, true),
        (vec![host, ("sec-fetch-site", "none")], true, true),
        (
            vec![
                host,
                ("sec-fetch-site", "same-origin"),
                ("origin", "http://p80-k.localhost:8435"),
            ],
            true,
            true,
        ),
        (
            vec![host, ("origin", "https://P80-K.localhost:8435")],
            true,
            true,
        ),
        // Another page: by Origin, opaque (a sandboxed page), by Fetch Metadata.
        (
            vec![host, ("origin", "http://127.0.0.1:8435")],
            false,
            false,
        ),
        (vec![host, ("origin", "null")], false, false),
        (
            vec![
                host,
                ("sec-fetch-site", "same-site"),
                ("sec-fetch-mode", "no-cors"),
            ],
            false,
            false,
        ),
        // A link followed from elsewhere: only a port's own origin takes it.
        (
            vec![
                host,
                ("sec-fetch-site", "cross-site"),
                ("sec-fetch-mode", "navigate"),
                ("sec-fetch-dest", "document"),
            ],
            false,
            true,
        ),
        (
            vec![
                host,
                ("sec-fetch-site", "cross-site"),
                ("sec-fetch-mode", "navigate"),
                ("sec-fetch-dest", "iframe"),
            ],
            false,
            false,
        ),
    ] {
        let map = headers(&pairs);
        assert_eq!(
            foreign_initiator(&map, &get, Exposure::ServerOrigin).is_none(),
            server,
            "{pairs:?}"
        );
        assert_eq!(
            foreign_initiator(&map, &get, Exposure::OwnOrigin).is_none(),
            own,
            "{pairs:?}"
        );
    }
    let navigate = headers(&[
        host,
        ("sec-fetch-site", "cross-site"),
        ("sec-fetch-mode", "navigate"),
        ("sec-fetch-dest", "document"),
    ]);
    assert!(foreign_initiator(&navigate, &Method::POST, Exposure::OwnOrigin).is_some());
}

#[tokio::test(start_paused = true)]
async fn a_quiet_tunnel_is_closed_and_a_busy_one_is_not() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (client, mut client_far) = tokio::io::duplex(64);
    let (upstream, mut upstream_far) = tokio::io::duplex(64);
    let idle = Duration::from_secs(60);
    let tunnel = tokio::spawn(carry(client, upstream, idle));
    // Traffic every 40 s keeps it open past the idle time.
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_secs(40)).await;
        client_far.write_all(b"x").await.unwrap();
        let mut byte = [0u8; 1];
        upstream_far.read_exact(&mut byte).await.unwrap();
    }
    assert!(!tunnel.is_finished());
    tokio::time::sleep(idle + Duration::from_secs(1)).await;
    tokio::task::yield_now().await;
    assert!(tunnel.is_finished(), "a quiet tunnel stayed open");
}

#[test]
fn tunnels_are_counted_per_owner() {
    let tunnels = Tunnels::default();
    let alice = ComputerId::parse("web")
        .unwrap()
        .owned_by(&crate::ids::Principal::parse("alice").unwrap());
    let mine: Vec<Tunnel> = (0..TUNNELS_PER_PRINCIPAL)
        .map(|_| tunnels.admit(&alice).unwrap())
        .collect();
    assert!(tunnels.admit(&alice).is_none());
    let default = ComputerId::parse("web").unwrap();
    assert!(
        tunnels.admit(&default).is_some(),
        "another owner was refused"
    );
    drop(mine);
    assert!(
        tunnels.admit(&alice).is_some(),
        "closed tunnels were not given back"
    );
}
