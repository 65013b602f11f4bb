//! `port_url` (docs/files.md, "Ports"): a URL for a port in a computer. It comes with the
//! file tools' switch. The routes themselves are [`crate::ports`]'s: over stdio a loopback
//! forwarder; in HTTP mode the port's own origin on the server's listener, and in `proxy_url`
//! the same port under the server's `/computers/<id>/ports/<port>/`, for HTTP clients that send
//! the token.

use rmcp::model::Tool;
use serde_json::{Map, Value, json};

use super::call::{Call, CallError, Payload};
use super::files::{annotations, computer_id_property, decode_computer, mode_of};
use super::format;
use super::routes::Definitions;
use crate::ports::{PortError, PortUrl};
use crate::registry::{Registry, Unnamed};

pub const PORT_URL: &str = "port_url";

/// The HTTP transport's path for a port, below its base URL.
pub fn proxy_path(computer_id: &str, port: u16) -> String {
    format!("/computers/{computer_id}/ports/{port}/")
}

pub(super) fn tool(_: &Definitions<'_>) -> Tool {
    Tool::new(
        PORT_URL,
        "Get a URL for a TCP port in a computer, e.g. a dev server started as a job, so a browser can open it. The server must already listen on that port (any address in the computer, 127.0.0.1 included).",
        format::object(json!({
            "type": "object",
            "properties": {
                "port": {"type": "integer", "minimum": 1, "maximum": 65535, "title": "Port", "description": "The TCP port in the computer."},
                "computer_id": computer_id_property()
            },
            "required": ["port"]
        })),
    )
    .with_raw_output_schema(format::output_schema(
        json!({
            "computer_id": {"type": "string"},
            "port": {"type": "integer"},
            "url": {"type": "string"},
            "proxy_url": {"type": "string"},
            "warning": {"type": "string"}
        }),
        &["computer_id", "port", "url"],
        None,
    ))
    .with_annotations(annotations(true))
}

/// `port_url`.
pub(super) async fn port_url(call: &Call<'_>) -> Result<Payload, CallError> {
    let ports = call.ports()?;
    let (registry, session) = (call.registry(), call.session);
    let args = call.args();
    let port = match args.integer("port")? {
        Some(port) if (1..=65535).contains(&port) => port as u16,
        Some(port) => {
            return Err(CallError::invalid(format!(
                "port must be between 1 and 65535, got: {port}"
            )));
        }
        None => return Err(CallError::invalid("port is required.")),
    };
    let computer = decode_computer(&args, session)?;
    if !registry.backend().has_ports() {
        return Err(registry.backend().no_ports().into());
    }
    let temporary = mode_of(registry, session, computer.as_ref()).await?;
    let sandbox = registry
        .acquire(
            session,
            computer,
            temporary,
            Unnamed::SessionDefault,
            Registry::no_progress(),
        )
        .await?;
    let id = sandbox.computer_id.slug().to_owned();
    let url = ports.url(&sandbox, port).await?;
    let mut payload = Map::new();
    payload.insert("computer_id".into(), Value::String(id.clone()));
    payload.insert("port".into(), json!(port));
    match url {
        PortUrl::Forwarded(address) => {
            payload.insert("url".into(), Value::String(format!("http://{address}/")));
        }
        PortUrl::Origin(url) => {
            payload.insert("url".into(), Value::String(url));
            if let Some(base) = call.surface.proxy_base() {
                payload.insert(
                    "proxy_url".into(),
                    Value::String(format!("{base}{}", proxy_path(&id, port))),
                );
            }
        }
        PortUrl::Provider { url, public } => {
            payload.insert("url".into(), Value::String(url));
            if public {
                payload.insert(
                    "warning".into(),
                    Value::String(
                        "This URL is public: anyone who has it reaches the port.".to_owned(),
                    ),
                );
            }
        }
    }
    Ok(payload.into())
}

/// The user-facing text of a port failure.
pub fn message(error: &PortError) -> String {
    match error {
        PortError::Registry(error) => format::user_message(error),
        other => other.to_string(),
    }
}
