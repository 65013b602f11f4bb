//! The MCP layer: the rmcp `ServerHandler` for one session, capabilities, tool listing and
//! dispatch (docs/decisions.md, "MCP surface"). The only module besides `transport` that knows rmcp, and the
//! only one that knows result JSON.
//!
//! **API boundary:** everything a client can observe is produced here or in [`format`].

pub mod args;
pub mod description;
mod files;
pub mod format;
#[cfg(test)]
mod golden;
mod jobs;
mod lifecycle;
pub mod ports;
mod progress;
pub mod tools;

use std::sync::Arc;

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, Implementation, JsonObject, ListPromptsResult,
    ListResourceTemplatesResult, ListResourcesResult, ListToolsResult, MetaObject,
    PaginatedRequestParams, PromptsCapability, ReadResourceRequestParams, ReadResourceResponse,
    ReadResourceResult, Resource, ResourceContents, ResourcesCapability, ServerCapabilities,
    ServerConfig, Tool, ToolsCapability,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData, RoleServer, ServerHandler};
use serde_json::json;

use crate::dashboard;
use crate::ids::Principal;
use crate::jobs::Jobs;
use crate::ports::Ports;
use crate::registry::{Registry, Session};

/// Sent to every client that initialises (docs/decisions.md, "Server identity and capabilities").
const INSTRUCTIONS: &str = "This server provides isolated Linux sandbox computers. Use terminal_execute to run commands. Omit computer_id to use this session's default computer, or pass computer_id to reuse a named computer. Temporary computers (the default) are removed when the session ends; pass temporary=false for a computer that must persist.";

/// What every session of this process shares.
pub struct Surface {
    pub registry: Arc<Registry>,
    /// The job service, when the job switch is on (docs/jobs.md, "Switch").
    pub jobs: Option<Arc<Jobs>>,
    tools: Vec<Tool>,
    /// The file tools and the `computer://` resource template (docs/files.md).
    file_tools: bool,
    /// `port_url`'s forwarders; present with the file tools.
    pub ports: Option<Arc<Ports>>,
    /// The HTTP transport's base URL, for `port_url`'s `proxy_url` (unset in stdio mode).
    proxy_base: std::sync::OnceLock<String>,
    /// Lifecycle tools, the dashboard resource and the UI extension (docs/decisions.md, "Tool list").
    lifecycle_tools: bool,
    instructions: String,
}

impl Surface {
    pub fn new(
        registry: Arc<Registry>,
        tool_description: &str,
        lifecycle_tools: bool,
        jobs: Option<Arc<Jobs>>,
        file_tools: bool,
    ) -> Arc<Self> {
        let mut tools = vec![tools::terminal_execute_tool(
            tool_description,
            jobs.is_some(),
        )];
        let mut instructions = INSTRUCTIONS.to_owned();
        if let Some(jobs) = &jobs {
            // A deleted or reset computer's jobs went with its processes (docs/jobs.md).
            let weak = Arc::downgrade(jobs);
            registry.on_removed(Box::new(move |id, _| {
                if let Some(jobs) = weak.upgrade() {
                    jobs.forget_computer(id);
                }
            }));
            tools.extend(jobs::tools(registry.backend().runs_jobs_in_server()));
            instructions.push_str(jobs::INSTRUCTIONS);
        }
        let mut ports = None;
        if file_tools {
            tools.extend(files::tools(registry.limits().output_limit));
            tools.push(ports::tool());
            instructions.push_str(files::INSTRUCTIONS);
            ports = Some(Ports::new(registry.clone()));
        }
        if lifecycle_tools {
            tools.extend(lifecycle::tools());
        }
        Arc::new(Self {
            registry,
            jobs,
            tools,
            file_tools,
            ports,
            proxy_base: std::sync::OnceLock::new(),
            lifecycle_tools,
            instructions,
        })
    }

    /// Tells `port_url` where the HTTP transport serves `/computers/<id>/ports/<port>/`.
    pub fn set_proxy_base(&self, base: String) {
        let _ = self.proxy_base.set(base);
    }

    fn dashboard_meta() -> MetaObject {
        let mut meta = MetaObject::new();
        meta.0
            .insert("ui".to_owned(), json!({"csp": {}, "prefersBorder": true}));
        meta
    }

    fn dashboard_resource() -> Resource {
        Resource::new(dashboard::RESOURCE_URI, "Sandbox Computer Dashboard")
            .with_title("Sandbox Computer Dashboard")
            .with_description("Interactive lifecycle and terminal dashboard for sandbox computers.")
            .with_mime_type(dashboard::MIME_TYPE)
            .with_meta(Self::dashboard_meta())
    }
}

/// One MCP session's handler. When its last clone is dropped (the transport ended the
/// session: EOF, client DELETE, idle expiry, shutdown) the session's computers are released.
#[derive(Clone)]
pub struct SessionHandler {
    surface: Arc<Surface>,
    session: Arc<Session>,
    _release: Arc<ReleaseOnDrop>,
}

impl SessionHandler {
    /// A handler for a new session of its own, acting for `principal`.
    pub fn new(surface: Arc<Surface>, principal: Principal) -> Self {
        let session = surface.registry.open_session(principal);
        Self::with_session(surface, session)
    }

    /// A handler for one sessionless request, holding computers by lease.
    pub fn sessionless(
        surface: Arc<Surface>,
        lease_ttl: std::time::Duration,
        principal: Principal,
    ) -> Self {
        let session = surface.registry.sessionless(lease_ttl, principal);
        Self::with_session(surface, session)
    }

    fn with_session(surface: Arc<Surface>, session: Arc<Session>) -> Self {
        let release = ReleaseOnDrop {
            registry: surface.registry.clone(),
            jobs: surface.jobs.clone(),
            session: session.clone(),
        };
        Self {
            surface,
            session,
            _release: Arc::new(release),
        }
    }
}

/// Releases a session's holds when dropped. `Drop` cannot await, so it hands the work to the
/// runtime; the shutdown sweep covers anything a dying runtime no longer runs.
struct ReleaseOnDrop {
    registry: Arc<Registry>,
    jobs: Option<Arc<Jobs>>,
    session: Arc<Session>,
}

impl Drop for ReleaseOnDrop {
    fn drop(&mut self) {
        if let Some(jobs) = &self.jobs {
            jobs.close_session(self.session.id());
        }
        let (registry, session) = (self.registry.clone(), self.session.clone());
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move { registry.close_session(&session).await });
        }
    }
}

impl ServerHandler for SessionHandler {
    fn get_info(&self) -> ServerConfig {
        let mut capabilities = ServerCapabilities::default();
        let mut tools = ToolsCapability::default();
        tools.list_changed = Some(false);
        capabilities.tools = Some(tools);
        // rmcp rejects methods of capabilities we do not advertise, and clients call
        // resources/list and prompts/list regardless, so both are advertised (and empty).
        let mut resources = ResourcesCapability::default();
        resources.subscribe = Some(false);
        resources.list_changed = Some(false);
        capabilities.resources = Some(resources);
        let mut prompts = PromptsCapability::default();
        prompts.list_changed = Some(false);
        capabilities.prompts = Some(prompts);
        if self.surface.lifecycle_tools {
            let mut ui = JsonObject::new();
            ui.insert("mimeTypes".to_owned(), json!([dashboard::MIME_TYPE]));
            capabilities.extensions = Some(
                [("io.modelcontextprotocol/ui".to_owned(), ui)]
                    .into_iter()
                    .collect(),
            );
        }
        ServerConfig::new(capabilities)
            .with_server_info(
                Implementation::new("Kilntainers", env!("CARGO_PKG_VERSION"))
                    .with_title("MCP Sandbox Computer VM for AI"),
            )
            .with_instructions(self.surface.instructions.clone())
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(self.surface.tools.clone()))
    }

    fn get_tool(&self, name: &str) -> Option<Tool> {
        self.surface.tools.iter().find(|t| t.name == name).cloned()
    }

    async fn list_resources(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListResourcesResult, ErrorData> {
        let resources = if self.surface.lifecycle_tools {
            vec![Surface::dashboard_resource()]
        } else {
            Vec::new()
        };
        Ok(ListResourcesResult::with_all_items(resources))
    }

    async fn read_resource(
        &self,
        request: ReadResourceRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<ReadResourceResponse, ErrorData> {
        if self.surface.file_tools
            && let Some(target) = files::parse_uri(&request.uri)
        {
            let (id, path) = target.map_err(|message| ErrorData::invalid_params(message, None))?;
            let registry = &self.surface.registry;
            return files::read_resource(
                registry,
                &self.session,
                &request.uri,
                id,
                path,
                &context.ct,
            )
            .await
            .map(Into::into);
        }
        if !self.surface.lifecycle_tools || request.uri != dashboard::RESOURCE_URI {
            return Err(ErrorData::resource_not_found(
                format!("Resource not found: {}", request.uri),
                None,
            ));
        }
        let contents = ResourceContents::TextResourceContents {
            uri: dashboard::RESOURCE_URI.to_owned(),
            mime_type: Some(dashboard::MIME_TYPE.to_owned()),
            text: dashboard::html(dashboard::Mode::App, self.surface.registry.backend().kind()),
            meta: Some(Surface::dashboard_meta()),
        };
        Ok(ReadResourceResult::new(vec![contents]).into())
    }

    async fn list_resource_templates(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListResourceTemplatesResult, ErrorData> {
        let templates = if self.surface.file_tools {
            vec![files::resource_template()]
        } else {
            Vec::new()
        };
        Ok(ListResourceTemplatesResult::with_all_items(templates))
    }

    async fn list_prompts(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListPromptsResult, ErrorData> {
        Ok(ListPromptsResult::with_all_items(Vec::new()))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let registry = &self.surface.registry;
        let progress = progress::McpProgress::start(&context);
        let jobs = self.surface.jobs.as_deref();
        let session = &self.session;
        let arguments = request.arguments.as_ref();
        let result = match (request.name.as_ref(), jobs) {
            (tools::TERMINAL_EXECUTE, _) => {
                tools::terminal_execute(registry, jobs, session, arguments, &progress, &context.ct)
                    .await
            }
            (jobs::OUTPUT, Some(jobs)) => {
                jobs::output(registry, jobs, session, arguments, &context.ct).await
            }
            (jobs::WRITE, Some(jobs)) => {
                jobs::write(registry, jobs, session, arguments, &context.ct).await
            }
            (jobs::KILL, Some(jobs)) => {
                jobs::kill(registry, jobs, session, arguments, &context.ct).await
            }
            (jobs::LIST, Some(jobs)) => {
                jobs::list(registry, jobs, session, arguments, &context.ct).await
            }
            (files::READ | files::WRITE | files::LIST, _) if self.surface.file_tools => {
                match request.name.as_ref() {
                    files::READ => files::read(registry, session, arguments, &context.ct).await,
                    files::WRITE => files::write(registry, session, arguments, &context.ct).await,
                    _ => files::list(registry, session, arguments, &context.ct).await,
                }
            }
            (ports::PORT_URL, _) if self.surface.ports.is_some() => {
                let forwarders = self.surface.ports.as_deref();
                let base = self.surface.proxy_base.get().map(String::as_str);
                match forwarders {
                    Some(forwarders) => {
                        ports::port_url(registry, forwarders, base, session, arguments).await
                    }
                    None => None,
                }
            }
            (name, _) if !self.surface.lifecycle_tools || self.get_tool(name).is_none() => {
                return Err(ErrorData::invalid_params("tool not found", None));
            }
            (name, _) => match name {
                lifecycle::DASHBOARD | lifecycle::LIST => {
                    Some(lifecycle::list(registry, &self.session).await)
                }
                lifecycle::CREATE => Some(
                    lifecycle::create(
                        registry,
                        &self.session,
                        request.arguments.as_ref(),
                        &progress,
                    )
                    .await,
                ),
                lifecycle::RESTART => Some(
                    lifecycle::restart(registry, &self.session, request.arguments.as_ref()).await,
                ),
                lifecycle::FACTORY_RESET => Some(
                    lifecycle::factory_reset(
                        registry,
                        &self.session,
                        request.arguments.as_ref(),
                        &progress,
                    )
                    .await,
                ),
                lifecycle::DELETE => Some(
                    lifecycle::delete(registry, &self.session, request.arguments.as_ref()).await,
                ),
                _ => return Err(ErrorData::invalid_params("tool not found", None)),
            },
        };
        progress.finish().await;
        match result {
            Some(result) => Ok(result.into()),
            // Cancelled by the client: rmcp does not send a response for a cancelled request.
            None => Err(ErrorData::internal_error("request cancelled", None)),
        }
    }
}
