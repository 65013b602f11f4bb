//! Where the Docker backend finds its engine and how it talks to it (docs/decisions.md, "Docker
//! and Podman", "Connection"): the address from `--docker-host`, `DOCKER_HOST` or the engine's
//! usual sockets, and TLS from `--docker-tls-verify` / `DOCKER_TLS_VERIFY` with the certificates
//! in `--docker-cert-path` / `DOCKER_CERT_PATH`, read the way the docker CLI reads them. The
//! environment is read here, through the caller's lookup, so the backend reads none; the
//! types are the Docker crate's.

use std::path::{Path, PathBuf};

pub use kilntainers_docker::config::{
    DOCKER_DEFAULT_SOCKET, EngineAddress, EngineConnection, EngineTls, scheme,
};

use super::{ConfigError, Engine, fail};
use crate::cli::DockerArgs;

/// The connection of `--backend docker` from its flags and the environment (`env` looks a
/// variable up; `uid` names rootless Podman's socket). Fails when TLS is asked for and a
/// certificate file cannot be read, or when `http://` and TLS verification are both given.
pub fn connection(
    engine: Engine,
    args: &DockerArgs,
    env: impl Fn(&str) -> Option<String>,
    uid: Option<u32>,
) -> Result<EngineConnection, ConfigError> {
    let env = |name: &str| env(name).filter(|v| !v.is_empty());
    let address = match (
        args.docker_host.as_deref().filter(|h| !h.is_empty()),
        engine,
    ) {
        (Some(host), _) => EngineAddress::Fixed(host.to_owned()),
        (None, Engine::Docker) => EngineAddress::Fixed(
            env("DOCKER_HOST").unwrap_or_else(|| DOCKER_DEFAULT_SOCKET.to_owned()),
        ),
        (None, Engine::Podman) => {
            // DOCKER_HOST usually names a Docker engine; Podman takes it only as a socket.
            let mut candidates: Vec<String> = env("DOCKER_HOST")
                .into_iter()
                .filter(|h| h.starts_with("unix://"))
                .collect();
            if let Some(dir) = env("XDG_RUNTIME_DIR") {
                candidates.push(format!("unix://{dir}/podman/podman.sock"));
            }
            if let Some(uid) = uid {
                candidates.push(format!("unix:///run/user/{uid}/podman/podman.sock"));
            }
            candidates.push("unix:///run/podman/podman.sock".to_owned());
            EngineAddress::FirstExisting(candidates)
        }
    };
    // As the docker CLI: any non-empty value turns verification on, "0" included.
    let verify = args.docker_tls_verify || env("DOCKER_TLS_VERIFY").is_some();
    let tls = match &address {
        EngineAddress::Fixed(host) => match scheme(host).as_str() {
            "https" => Some(tls_files(host, args, &env)?),
            "tcp" if verify => Some(tls_files(host, args, &env)?),
            "http" if verify => {
                return fail(format!(
                    "The engine address {host} is plain HTTP, but DOCKER_TLS_VERIFY (or --docker-tls-verify) asks for TLS. Use tcp://… or https://… to reach the engine over TLS, or unset DOCKER_TLS_VERIFY."
                ));
            }
            _ => None,
        },
        EngineAddress::FirstExisting(_) => None,
    };
    Ok(EngineConnection { address, tls })
}

/// The directory of the certificates, as the docker CLI finds it: `--docker-cert-path`, else
/// `DOCKER_CERT_PATH`, else `DOCKER_CONFIG`, else `~/.docker`; then each file checked.
fn tls_files(
    host: &str,
    args: &DockerArgs,
    env: &impl Fn(&str) -> Option<String>,
) -> Result<EngineTls, ConfigError> {
    let from_env = env("DOCKER_CERT_PATH").or_else(|| env("DOCKER_CONFIG"));
    let dir = match (&args.docker_cert_path, from_env, env("HOME")) {
        (Some(dir), _, _) => dir.clone(),
        (None, Some(dir), _) => PathBuf::from(dir),
        (None, None, Some(home)) => Path::new(&home).join(".docker"),
        (None, None, None) => {
            return fail(format!(
                "TLS to the engine at {host} needs ca.pem, cert.pem and key.pem, but no directory holds them: set DOCKER_CERT_PATH or --docker-cert-path (HOME is not set, so ~/.docker cannot be used)."
            ));
        }
    };
    let check = |name: &str, what: &str, marker: &str| -> Result<PathBuf, ConfigError> {
        let path = dir.join(name);
        let problem = match read_pem(&path) {
            Ok(text) if text.contains(marker) => return Ok(path),
            Ok(_) => format!("holds no PEM block of that kind ({marker})"),
            Err(error) => format!("cannot be read: {error}"),
        };
        fail(format!(
            "TLS to the engine at {host} needs {what} {}, which {problem}. Put ca.pem (the CA that signed the engine's certificate), cert.pem and key.pem (this client's certificate and key) in the directory DOCKER_CERT_PATH or --docker-cert-path names (now {}).",
            path.display(),
            dir.display()
        ))
    };
    Ok(EngineTls {
        ca: check(
            "ca.pem",
            "the CA certificate",
            "-----BEGIN CERTIFICATE-----",
        )?,
        cert: check(
            "cert.pem",
            "the client certificate",
            "-----BEGIN CERTIFICATE-----",
        )?,
        key: check("key.pem", "the client key", "PRIVATE KEY-----")?,
        dir,
    })
}

/// Largest certificate file read: a CA bundle is a few hundred KiB; anything larger is not one.
const MAX_PEM_BYTES: u64 = 1 << 20;

/// The text of a PEM file: a regular file of at most [`MAX_PEM_BYTES`]. Only its kind is checked
/// here; the TLS client parses it when it connects.
fn read_pem(path: &Path) -> std::io::Result<String> {
    use std::io::Read;
    let file = std::fs::File::open(path)?;
    let metadata = file.metadata()?;
    if !metadata.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    if metadata.len() > MAX_PEM_BYTES {
        return Err(std::io::Error::other("larger than 1 MiB"));
    }
    let mut bytes = Vec::new();
    file.take(MAX_PEM_BYTES).read_to_end(&mut bytes)?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// Our uid, from the owner of `/proc/self` (no libc call).
pub fn current_uid() -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").ok().map(|m| m.uid())
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::config::test_cli;

    fn connect(
        engine: Engine,
        args: &[&str],
        vars: &[(&str, &str)],
    ) -> Result<EngineConnection, String> {
        let cli = test_cli(args);
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        connection(
            engine,
            &cli.docker,
            |name| vars.get(name).cloned(),
            Some(1000),
        )
        .map_err(|e| e.0)
    }

    /// A directory removed when dropped.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new() -> Self {
            let dir = std::env::temp_dir().join(format!(
                "kilntainers-engine-test-{}",
                crate::ids::InstanceId::random()
            ));
            std::fs::create_dir_all(&dir).unwrap();
            Self(dir)
        }

        fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// Only the PEM headers matter here; the TLS client parses the contents.
    fn pem_of(file: &str) -> &'static str {
        match file {
            "key.pem" => "-----BEGIN PRIVATE KEY-----\n-----END PRIVATE KEY-----\n",
            _ => "-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n",
        }
    }

    fn cert_dir(files: &[&str]) -> Scratch {
        let dir = Scratch::new();
        for file in files {
            std::fs::write(dir.path().join(file), pem_of(file)).unwrap();
        }
        dir
    }

    fn fixed(host: &str) -> EngineAddress {
        EngineAddress::Fixed(host.to_owned())
    }

    #[test]
    fn docker_takes_the_flag_then_docker_host_then_the_default_socket() {
        let flag = connect(
            Engine::Docker,
            &["--docker-host", "ssh://u@h"],
            &[("DOCKER_HOST", "tcp://x:1")],
        );
        assert_eq!(flag.unwrap().address, fixed("ssh://u@h"));
        let env = connect(Engine::Docker, &[], &[("DOCKER_HOST", "tcp://x:1")]).unwrap();
        assert_eq!((env.address, env.tls), (fixed("tcp://x:1"), None));
        let empty = connect(Engine::Docker, &[], &[("DOCKER_HOST", "")]).unwrap();
        assert_eq!(empty.address, fixed(DOCKER_DEFAULT_SOCKET));
    }

    #[test]
    fn podman_looks_for_its_sockets_and_takes_docker_host_only_as_a_socket() {
        let vars = [
            ("DOCKER_HOST", "unix:///d.sock"),
            ("XDG_RUNTIME_DIR", "/run/user/7"),
        ];
        let candidates =
            |vars: &[(&str, &str)]| connect(Engine::Podman, &[], vars).unwrap().address;
        assert_eq!(
            candidates(&vars),
            EngineAddress::FirstExisting(vec![
                "unix:///d.sock".to_owned(),
                "unix:///run/user/7/podman/podman.sock".to_owned(),
                "unix:///run/user/1000/podman/podman.sock".to_owned(),
                "unix:///run/podman/podman.sock".to_owned(),
            ])
        );
        let EngineAddress::FirstExisting(list) = candidates(&[("DOCKER_HOST", "tcp://x:1")]) else {
            panic!("podman without --docker-host searches");
        };
        assert!(!list.iter().any(|c| c.starts_with("tcp://")), "{list:?}");
    }

    #[test]
    fn tls_applies_to_https_and_to_tcp_with_verification_only() {
        let dir = cert_dir(&["ca.pem", "cert.pem", "key.pem"]);
        let path = dir.path().to_str().unwrap();
        let https = connect(
            Engine::Docker,
            &["--docker-host", "https://e:2376"],
            &[("DOCKER_CERT_PATH", path)],
        );
        let tls = https.unwrap().tls.unwrap();
        assert_eq!(tls.ca, dir.path().join("ca.pem"));
        assert_eq!(tls.key, dir.path().join("key.pem"));
        // tcp:// is plain unless verification is asked for; any non-empty value asks, as for
        // the docker CLI, even "0".
        let plain = connect(
            Engine::Docker,
            &["--docker-host", "tcp://e:2375"],
            &[("DOCKER_CERT_PATH", path)],
        );
        assert_eq!(plain.unwrap().tls, None);
        for value in ["1", "0", "yes"] {
            let vars = [
                ("DOCKER_CERT_PATH", path),
                ("DOCKER_TLS_VERIFY", value),
                ("DOCKER_HOST", "tcp://e:2376"),
            ];
            assert!(
                connect(Engine::Docker, &[], &vars).unwrap().tls.is_some(),
                "{value}"
            );
        }
        let vars = [
            ("DOCKER_CERT_PATH", path),
            ("DOCKER_TLS_VERIFY", ""),
            ("DOCKER_HOST", "tcp://e:2376"),
        ];
        assert_eq!(connect(Engine::Docker, &[], &vars).unwrap().tls, None);
        let flags = [
            "--docker-host",
            "tcp://e:2376",
            "--docker-tls-verify",
            "--docker-cert-path",
            path,
        ];
        assert!(connect(Engine::Podman, &flags, &[]).unwrap().tls.is_some());
        // Sockets and ssh:// have no TLS of their own, whatever the environment says.
        for host in ["unix:///var/run/docker.sock", "ssh://u@h"] {
            let vars = [("DOCKER_TLS_VERIFY", "1"), ("DOCKER_HOST", host)];
            assert_eq!(
                connect(Engine::Docker, &[], &vars).unwrap().tls,
                None,
                "{host}"
            );
        }
    }

    #[test]
    fn the_certificate_directory_is_found_as_the_docker_cli_finds_it() {
        let dir = cert_dir(&["ca.pem", "cert.pem", "key.pem"]);
        let home = Scratch::new();
        std::fs::create_dir(home.path().join(".docker")).unwrap();
        for file in ["ca.pem", "cert.pem", "key.pem"] {
            std::fs::write(home.path().join(".docker").join(file), pem_of(file)).unwrap();
        }
        let https = ["--docker-host", "https://e:2376"];
        let from = |vars: &[(&str, &str)]| {
            connect(Engine::Docker, &https, vars)
                .unwrap()
                .tls
                .unwrap()
                .dir
        };
        let path = dir.path().to_str().unwrap();
        let home_path = home.path().to_str().unwrap();
        assert_eq!(
            from(&[("DOCKER_CONFIG", path), ("HOME", home_path)]),
            dir.path()
        );
        let config = [("DOCKER_CERT_PATH", path), ("DOCKER_CONFIG", home_path)];
        assert_eq!(from(&config), dir.path());
        assert_eq!(from(&[("HOME", home_path)]), home.path().join(".docker"));
        let none = connect(Engine::Docker, &https, &[]).unwrap_err();
        assert!(
            none.contains("set DOCKER_CERT_PATH or --docker-cert-path"),
            "{none}"
        );
    }

    #[test]
    fn a_missing_certificate_file_is_named() {
        for (missing, what) in [
            ("ca.pem", "the CA certificate"),
            ("cert.pem", "the client certificate"),
            ("key.pem", "the client key"),
        ] {
            let present: Vec<&str> = ["ca.pem", "cert.pem", "key.pem"]
                .into_iter()
                .filter(|f| *f != missing)
                .collect();
            let dir = cert_dir(&present);
            let path = dir.path().to_str().unwrap();
            let error = connect(
                Engine::Docker,
                &[
                    "--docker-host",
                    "tcp://e:2376",
                    "--docker-tls-verify",
                    "--docker-cert-path",
                    path,
                ],
                &[],
            )
            .unwrap_err();
            let file = dir.path().join(missing);
            assert!(
                error.starts_with(&format!(
                    "TLS to the engine at tcp://e:2376 needs {what} {}, which cannot be read: ",
                    file.display()
                )),
                "{error}"
            );
            assert!(error.contains(&format!("(now {path})")), "{error}");
        }
    }

    #[test]
    fn swapped_or_empty_certificate_files_are_named() {
        let dir = cert_dir(&["ca.pem", "cert.pem", "key.pem"]);
        let path = dir.path().to_str().unwrap();
        let flags = [
            "--docker-host",
            "https://e:2376",
            "--docker-cert-path",
            path,
        ];
        // The key where the client certificate belongs.
        std::fs::write(dir.path().join("cert.pem"), pem_of("key.pem")).unwrap();
        let error = connect(Engine::Docker, &flags, &[]).unwrap_err();
        assert!(
            error.contains("the client certificate")
                && error.contains("holds no PEM block of that kind (-----BEGIN CERTIFICATE-----)"),
            "{error}"
        );
        std::fs::write(dir.path().join("cert.pem"), pem_of("cert.pem")).unwrap();
        std::fs::write(dir.path().join("key.pem"), "").unwrap();
        let error = connect(Engine::Docker, &flags, &[]).unwrap_err();
        assert!(error.contains("the client key"), "{error}");
        std::fs::remove_file(dir.path().join("key.pem")).unwrap();
        std::fs::create_dir(dir.path().join("key.pem")).unwrap();
        let error = connect(Engine::Docker, &flags, &[]).unwrap_err();
        assert!(
            error.contains("cannot be read: not a regular file"),
            "{error}"
        );
    }

    #[test]
    fn plain_http_with_verification_is_a_contradiction() {
        let error = connect(
            Engine::Docker,
            &["--docker-host", "http://e:2375"],
            &[("DOCKER_TLS_VERIFY", "1")],
        )
        .unwrap_err();
        assert!(
            error.starts_with(
                "The engine address http://e:2375 is plain HTTP, but DOCKER_TLS_VERIFY"
            ),
            "{error}"
        );
        // Without verification, plain HTTP is what was asked for.
        let plain = connect(Engine::Docker, &["--docker-host", "http://e:2375"], &[]).unwrap();
        assert_eq!(plain.tls, None);
    }
}
