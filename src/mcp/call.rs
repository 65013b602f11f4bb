//! The one shape of a tool call: a handler takes the decoded request ([`Call`]) and answers
//! with what a success shows ([`Payload`]) or why it failed ([`CallError`]). The route table
//! (`routes.rs`) names the handler of each tool; `format::respond` turns the answer into the
//! wire result at the edge, so no handler builds a result or an error text itself.
//!
//! Errors stay typed until that edge: the layers' own errors convert through `From`, and
//! [`CallError`]'s `Display` is the message the model reads (registry and backend words through
//! `format::user_message`).

use rmcp::model::JsonObject;
use rmcp::{Peer, RoleServer};
use serde_json::{Map, Value};
use tokio_util::sync::CancellationToken;

use super::Surface;
use super::args::{ArgError, Args};
use super::format;
use crate::backends::files::{FileError, FileOpError};
use crate::backends::{BackendError, Progress};
use crate::ids::{InvalidComputerId, Principal};
use crate::jobs::{JobError, Jobs};
use crate::ports::{PortError, Ports};
use crate::registry::{Registry, RegistryError, Session};

/// One `tools/call` as its handler sees it: the tool's name and raw arguments, the session it
/// acts for, and the client's progress token and cancellation.
pub(super) struct Call<'a> {
    /// The tool's name (the route's), which argument errors quote.
    pub tool: &'static str,
    pub surface: &'a Surface,
    pub session: &'a Session,
    pub arguments: Option<&'a JsonObject>,
    pub progress: &'a dyn Progress,
    pub cancel: &'a CancellationToken,
    /// The client, for a tool that asks the person (`secret_request`); `None` where a call
    /// runs without one to ask.
    pub peer: Option<&'a Peer<RoleServer>>,
}

impl Call<'_> {
    pub fn registry(&self) -> &Registry {
        &self.surface.registry
    }

    pub fn principal(&self) -> &Principal {
        self.session.principal()
    }

    /// The arguments, read for this tool.
    pub fn args(&self) -> Args<'_> {
        Args::new(self.tool, self.arguments)
    }

    /// The job service; a job tool is only routed with the switch on, so `NotListed` is what a
    /// call would get if it were not.
    pub fn jobs(&self) -> Result<&Jobs, CallError> {
        self.surface.jobs.as_deref().ok_or(CallError::NotListed)
    }

    /// `port_url`'s forwarders, present with the file tools' switch.
    pub fn ports(&self) -> Result<&Ports, CallError> {
        self.surface.ports.as_deref().ok_or(CallError::NotListed)
    }
}

/// What a successful call shows: the payload object (the result's text, as Python's
/// `json.dumps` writes it, and its `structuredContent`), and an image a model can see.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Payload {
    pub fields: Map<String, Value>,
    pub image: Option<Image>,
}

/// An image content block after the text: `file_read` of a whole PNG, JPEG, GIF or WebP.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Image {
    pub base64: String,
    pub mime: &'static str,
}

impl Payload {
    pub fn with_image(mut self, image: Option<Image>) -> Self {
        self.image = image;
        self
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.fields.get(key)
    }
}

impl From<Map<String, Value>> for Payload {
    fn from(fields: Map<String, Value>) -> Self {
        Self {
            fields,
            image: None,
        }
    }
}

/// Why a call did not succeed. `Display` is the text of the error result; `Cancelled` and
/// `NotListed` answer as JSON-RPC instead (`format::respond`).
#[derive(Debug, thiserror::Error)]
pub(super) enum CallError {
    /// An argument of the wrong type, or a required one missing.
    #[error(transparent)]
    Args(#[from] ArgError),
    /// An argument's value, refused in the reference's (or the spec's) words.
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    ComputerId(#[from] InvalidComputerId),
    /// The computer could not be found, created, started or changed.
    #[error("{}", format::user_message(.0))]
    Registry(RegistryError),
    #[error(transparent)]
    Job(JobError),
    #[error(transparent)]
    File(#[from] FileError),
    /// A file operation that did not reach the file (unavailable, timed out, overflowed).
    #[error(transparent)]
    FileOp(FileOpError),
    #[error(transparent)]
    Port(PortError),
    /// The client cancelled the call: no result is sent.
    #[error("cancelled")]
    Cancelled,
    /// No tool of that name is listed (unknown, or its switch is off).
    #[error("tool not found")]
    NotListed,
}

impl CallError {
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::Invalid(message.into())
    }
}

impl From<RegistryError> for CallError {
    fn from(error: RegistryError) -> Self {
        match error {
            RegistryError::Cancelled => Self::Cancelled,
            other => Self::Registry(other),
        }
    }
}

impl From<BackendError> for CallError {
    fn from(error: BackendError) -> Self {
        Self::Registry(RegistryError::Backend(error))
    }
}

impl From<JobError> for CallError {
    fn from(error: JobError) -> Self {
        match error {
            JobError::Cancelled => Self::Cancelled,
            JobError::Backend(error) => error.into(),
            other => Self::Job(other),
        }
    }
}

impl From<FileOpError> for CallError {
    fn from(error: FileOpError) -> Self {
        match error {
            FileOpError::File(error) => Self::File(error),
            FileOpError::Backend(error) => error.into(),
            FileOpError::Cancelled => Self::Cancelled,
            other => Self::FileOp(other),
        }
    }
}

impl From<PortError> for CallError {
    fn from(error: PortError) -> Self {
        match error {
            PortError::Backend(error) => error.into(),
            PortError::Registry(error) => Self::Registry(error),
            other => Self::Port(other),
        }
    }
}
