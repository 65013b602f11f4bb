//! Verified TLS to a remote engine (docs/decisions.md, "Docker and Podman", "TLS"): a rustls
//! client of our own under bollard, because bollard's trusts the system's CAs besides `ca.pem`,
//! while the docker CLI, and this server, accept the engine's certificate only from the CA in
//! `ca.pem`: an engine API is root on its host, and a certificate a public CA issued for its
//! name or address must not be enough. The client certificate and key are parsed here, once, so
//! a file that cannot be used is named instead of the certificate silently not being sent.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use bollard::{BollardRequest, Docker};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::config::EngineTls;

#[derive(Debug, thiserror::Error)]
pub(super) enum TlsSetupError {
    #[error("{} holds no usable PEM certificate ({reason})", path.display())]
    Certificates { path: PathBuf, reason: String },
    #[error("{} holds no usable PEM private key ({reason})", path.display())]
    Key { path: PathBuf, reason: String },
    #[error("the CA certificate in {} cannot be used: {source}", path.display())]
    Ca {
        path: PathBuf,
        #[source]
        source: rustls::Error,
    },
    #[error("the client certificate {} and key {} cannot be used together: {source}", cert.display(), key.display())]
    ClientAuth {
        cert: PathBuf,
        key: PathBuf,
        #[source]
        source: rustls::Error,
    },
    #[error(transparent)]
    Bollard(#[from] bollard::errors::Error),
}

/// A client for the engine at `endpoint` (`tcp://host:port` or `https://host:port`) over TLS
/// with `tls`'s files; nothing is sent yet.
pub(super) fn connect(
    endpoint: &str,
    tls: &EngineTls,
    timeout_secs: u64,
) -> Result<Docker, TlsSetupError> {
    let mut roots = rustls::RootCertStore::empty();
    for certificate in certificates(&tls.ca)? {
        roots.add(certificate).map_err(|source| TlsSetupError::Ca {
            path: tls.ca.clone(),
            source,
        })?;
    }
    let (chain, key) = (certificates(&tls.cert)?, private_key(&tls.key)?);
    // The provider is named, not taken from rustls's process-wide default, which exists only
    // while exactly one provider is compiled in.
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .and_then(|builder| {
            builder
                .with_root_certificates(roots)
                .with_client_auth_cert(chain, key)
        })
        .map_err(|source| TlsSetupError::ClientAuth {
            cert: tls.cert.clone(),
            key: tls.key.clone(),
            source,
        })?;
    let mut http = HttpConnector::new();
    // The connector decides TLS by the URI's scheme, which is `https` below.
    http.enforce_http(false);
    let connector = HttpsConnector::from((http, config));
    // No idle connections kept, as bollard's own clients: each request gets its own.
    let client = Arc::new(
        Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(0)
            .build(connector),
    );
    let authority = endpoint
        .split_once("://")
        .map_or(endpoint, |(_, rest)| rest)
        .trim_end_matches('/');
    let transport = move |request: BollardRequest| {
        let client = Arc::clone(&client);
        async move {
            client
                .request(request)
                .await
                .map_err(bollard::errors::Error::from)
        }
    };
    Ok(Docker::connect_with_custom_transport(
        transport,
        Some(format!("https://{authority}")),
        timeout_secs,
        bollard::API_DEFAULT_VERSION,
    )?)
}

fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsSetupError> {
    let failed = |reason: String| TlsSetupError::Certificates {
        path: path.to_owned(),
        reason,
    };
    let all = CertificateDer::pem_file_iter(path)
        .map_err(|e| failed(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| failed(e.to_string()))?;
    if all.is_empty() {
        return Err(failed("none found".to_owned()));
    }
    Ok(all)
}

fn private_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsSetupError> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| TlsSetupError::Key {
        path: path.to_owned(),
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A self-signed P-256 certificate (its key was thrown away; nothing is sent here).
    const CERT: &str = "-----BEGIN CERTIFICATE-----
MIIBfjCCASOgAwIBAgIUaMl7ni82Y/1uKdLALhpxhuXqPhswCgYIKoZIzj0EAwIw
FDESMBAGA1UEAwwJa2lsbi10ZXN0MB4XDTI2MTIwNTA5MDg1OVoXDTI2MTIwNjA5
MDg1OVowFDESMBAGA1UEAwwJa2lsbi10ZXN0MFkwEwYHKoZIzj0CAQYIKoZIzj0D
AQcDQgAEx6NJGJ7aTPggXVI0bT+BcrVpUtuaOYu4TZcdxo6JjOUm4LY+/Z1G7abi
FS3U50JBxB2VHXwO0sZqcasJ1EK8gqNTMFEwHQYDVR0OBBYEFCDSb55+Opat7TlI
XdsHEXomFphfMB8GA1UdIwQYMBaAFCDSb55+Opat7TlIXdsHEXomFphfMA8GA1Ud
EwEB/wQFMAMBAf8wCgYIKoZIzj0EAwIDSQAwRgIhAODXbfVvf81gfg+4csoOUz1I
2am69GQiSvunLmmsGEmVAiEAiKNQt9cmNjttEAd3OTZ/N0hfZVkOFiJ8NKeR8Mfc
iE0=
-----END CERTIFICATE-----
";

    /// The error of connecting with these three files.
    fn error_with(ca: &str, cert: &str, key: &str) -> (String, EngineTls) {
        let dir = std::env::temp_dir().join(format!(
            "kilntainers-tls-test-{}",
            kilntainers_backend::ids::InstanceId::random()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let tls = EngineTls {
            ca: dir.join("ca.pem"),
            cert: dir.join("cert.pem"),
            key: dir.join("key.pem"),
            dir: dir.clone(),
        };
        std::fs::write(&tls.ca, ca).unwrap();
        std::fs::write(&tls.cert, cert).unwrap();
        std::fs::write(&tls.key, key).unwrap();
        let error = connect("tcp://127.0.0.1:9", &tls, 1).map(drop);
        std::fs::remove_dir_all(&dir).unwrap();
        (error.unwrap_err().to_string(), tls)
    }

    #[test]
    fn a_file_without_its_pem_block_is_named() {
        let (error, tls) = error_with("not pem", CERT, "");
        let ca = format!("{} holds no usable PEM certificate", tls.ca.display());
        assert!(error.starts_with(&ca), "{error}");
        let (error, tls) = error_with(CERT, "", "");
        let cert = format!("{} holds no usable PEM certificate", tls.cert.display());
        assert!(error.starts_with(&cert), "{error}");
        // The CA is taken; the key file holds a certificate instead of a key.
        let (error, tls) = error_with(CERT, CERT, CERT);
        let key = format!("{} holds no usable PEM private key", tls.key.display());
        assert!(error.starts_with(&key), "{error}");
    }
}
