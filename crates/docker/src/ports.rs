//! Reaching a TCP port in a container (docs/files.md, "Ports"): straight to the container's
//! network address when this machine can route to it (a local Docker engine) and the answer
//! comes from the computer's own interface, else — and whenever nothing answers there, as for
//! a server bound to `127.0.0.1` inside — through one Docker exec of the helper's `connect`
//! mode, which dials the computer's own loopback.

use std::io;
use std::net::Ipv4Addr;
use std::time::Duration;

use bollard::container::LogOutput;
use bollard::exec::{CreateExecOptions, StartExecOptions, StartExecResults};
use bollard::models::ContainerInspectResponse;
use futures_util::StreamExt;
use tokio::net::TcpStream;
use tokio_util::io::StreamReader;
use tracing::warn;

use super::helper::{DockerTransport, PORT_CONNECTED};
use super::{DockerBackend, describe};
use crate::config::Engine;
use kilntainers_backend::{BackendError, PortStream, SandboxRef};

/// A local bridge answers a connect in well under a millisecond; past this the address is
/// not routable from here (a rootless engine's private namespace) and the helper is tried.
const ADDRESS_CONNECT_TIMEOUT: Duration = Duration::from_millis(500);
/// The helper's answer to `connect` (its first byte, or its error line) must arrive by then.
const HELPER_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How much of the helper's error line is kept for the message.
const HELPER_ERROR_KEPT: usize = 512;

pub(super) async fn connect(
    backend: &DockerBackend,
    sandbox: &SandboxRef,
    port: u16,
) -> Result<Box<dyn PortStream>, BackendError> {
    let Some(inspected) = backend.inspect(sandbox.sandbox_id.as_str()).await? else {
        return Err(BackendError::Vanished(sandbox.computer_id.clone()));
    };
    let running = inspected
        .state
        .as_ref()
        .and_then(|s| s.running)
        .unwrap_or(false);
    if !running {
        return Err(BackendError::NotRunning(sandbox.sandbox_id.clone()));
    }
    if routes_to_containers(backend) {
        for (address, hardware) in addresses(&inspected) {
            if let Ok(Ok(stream)) =
                tokio::time::timeout(ADDRESS_CONNECT_TIMEOUT, TcpStream::connect((address, port)))
                    .await
            {
                if answered_from(address).await.as_deref() == Some(hardware.as_str()) {
                    let _ = stream.set_nodelay(true);
                    return Ok(Box::new(stream));
                }
                // Another machine on the network answers for the computer's address (it
                // announced the address as its own): never talk to it; the helper reaches the
                // computer through the engine instead.
                warn!(
                    computer_id = %sandbox.computer_id,
                    %address,
                    "a port connection was answered from another machine than the computer; going through the engine instead"
                );
            }
        }
    }
    through_helper(backend, sandbox, port).await
}

/// The hardware address this host sends `address`'s packets to, from its neighbour table
/// (complete entries only), in lower case.
async fn answered_from(address: Ipv4Addr) -> Option<String> {
    let table = tokio::fs::read_to_string("/proc/net/arp").await.ok()?;
    neighbour(&table, address)
}

/// Reads `/proc/net/arp`: `IP address  HW type  Flags  HW address  Mask  Device`, flag 0x2
/// marking a complete entry.
fn neighbour(table: &str, address: Ipv4Addr) -> Option<String> {
    table.lines().skip(1).find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let [ip, _, flags, hardware, ..] = fields.as_slice() else {
            return None;
        };
        let complete = u32::from_str_radix(flags.trim_start_matches("0x"), 16).ok()? & 0x2 != 0;
        (complete && ip.parse() == Ok(address)).then(|| hardware.to_ascii_lowercase())
    })
}

/// Whether this machine routes to container addresses: a local Docker engine's bridge does;
/// a remote engine's or a rootless Podman's network is not ours to reach.
fn routes_to_containers(backend: &DockerBackend) -> bool {
    backend.config.engine == Engine::Docker
        && backend
            .endpoint()
            .is_some_and(|endpoint| endpoint.starts_with("unix://"))
}

/// The container's IPv4 addresses with the hardware address of each interface. Only IPv4:
/// the answer's origin is checked in the host's ARP table.
fn addresses(inspected: &ContainerInspectResponse) -> Vec<(Ipv4Addr, String)> {
    let Some(networks) = inspected
        .network_settings
        .as_ref()
        .and_then(|n| n.networks.as_ref())
    else {
        return Vec::new();
    };
    networks
        .values()
        .filter_map(|n| {
            let address = n.ip_address.as_deref()?.parse().ok()?;
            let hardware = n.mac_address.as_deref().filter(|m| !m.is_empty())?;
            Some((address, hardware.to_ascii_lowercase()))
        })
        .collect()
}

fn unreachable(sandbox: &SandboxRef, port: u16, why: &str) -> BackendError {
    BackendError::Provider(format!(
        "Nothing accepts connections on port {port} in computer '{}' ({why}). Start a server listening on that port first.",
        sandbox.computer_id
    ))
}

async fn through_helper(
    backend: &DockerBackend,
    sandbox: &SandboxRef,
    port: u16,
) -> Result<Box<dyn PortStream>, BackendError> {
    let docker = backend.client().await?;
    let path = backend
        .helpers
        .runnable_path(&DockerTransport(docker), sandbox)
        .await
        .map_err(|reason| unreachable(sandbox, port, &reason))?;
    let options = CreateExecOptions {
        cmd: Some(vec![
            path.to_owned(),
            "connect".to_owned(),
            port.to_string(),
        ]),
        attach_stdin: Some(true),
        attach_stdout: Some(true),
        attach_stderr: Some(true),
        tty: Some(false),
        ..Default::default()
    };
    let engine_error = |error: bollard::errors::Error| {
        BackendError::Provider(format!(
            "Docker exec in container {} failed: {}",
            sandbox.sandbox_id,
            describe(&error)
        ))
    };
    let created = docker
        .create_exec(sandbox.sandbox_id.as_str(), options)
        .await
        .map_err(engine_error)?;
    let start = StartExecOptions {
        detach: false,
        tty: false,
        output_capacity: Some(32 * 1024),
    };
    let StartExecResults::Attached { mut output, input } = docker
        .start_exec(&created.id, Some(start))
        .await
        .map_err(engine_error)?
    else {
        return Err(unreachable(sandbox, port, "the engine did not attach"));
    };
    // The first stdout byte says the helper is connected; anything else, or an end, is a
    // failure whose stderr (capped: the helper may be an impostor) says why.
    let answer = tokio::time::timeout(HELPER_CONNECT_TIMEOUT, async {
        let mut error = Vec::new();
        while let Some(frame) = output.next().await {
            match frame {
                Ok(LogOutput::StdOut { message }) if !message.is_empty() => {
                    return if message[0] == PORT_CONNECTED {
                        Ok(message.slice(1..))
                    } else {
                        Err("the helper answered with something else".to_owned())
                    };
                }
                Ok(LogOutput::StdErr { message }) => {
                    let room = HELPER_ERROR_KEPT.saturating_sub(error.len());
                    error.extend_from_slice(&message[..message.len().min(room)]);
                }
                Ok(_) => {}
                Err(e) => return Err(describe(&e)),
            }
        }
        let line = String::from_utf8_lossy(&error).trim().to_owned();
        Err(if line.is_empty() {
            "the helper ended without connecting".to_owned()
        } else {
            line
        })
    })
    .await
    .unwrap_or_else(|_| Err("the helper did not answer in time".to_owned()));
    let first = answer.map_err(|why| unreachable(sandbox, port, &why))?;
    let rest = output.filter_map(|frame| async move {
        match frame {
            Ok(LogOutput::StdOut { message }) => Some(Ok(message)),
            Ok(_) => None,
            Err(e) => Some(Err(io::Error::other(e))),
        }
    });
    let reader = StreamReader::new(Box::pin(
        futures_util::stream::iter([Ok(first)]).chain(rest),
    ));
    Ok(Box::new(tokio::io::join(reader, input)))
}

#[cfg(test)]
mod tests {
    use super::*;

    const TABLE: &str =
        "IP address       HW type     Flags       HW address            Mask     Device
172.17.0.2       0x1         0x2         02:42:AC:11:00:03     *        docker0
172.17.0.4       0x1         0x0         00:00:00:00:00:00     *        docker0
";

    #[test]
    fn the_neighbour_table_says_where_an_address_goes() {
        assert_eq!(
            neighbour(TABLE, Ipv4Addr::new(172, 17, 0, 2)).as_deref(),
            Some("02:42:ac:11:00:03")
        );
        // Incomplete (still resolving, or failed): no answer to trust.
        assert_eq!(neighbour(TABLE, Ipv4Addr::new(172, 17, 0, 4)), None);
        assert_eq!(neighbour(TABLE, Ipv4Addr::new(172, 17, 0, 9)), None);
        assert_eq!(neighbour("", Ipv4Addr::new(172, 17, 0, 2)), None);
    }
}
