//! The MCP layer: the rmcp `ServerHandler` for one session, capabilities, tool listing and
//! dispatch (docs/decisions.md, "MCP surface"). The only module besides `transport` that knows rmcp, and the
//! only one that knows result JSON. Both `tools/list` and `tools/call` read the route table
//! ([`routes`]); a call is one [`call::Call`] to its handler, answered at the edge by
//! [`format::respond`].
//!
//! **API boundary:** everything a client can observe is produced here or in [`format`].

pub mod args;
mod ask;
mod call;
mod checkpoints;
pub mod description;
mod execute;
mod files;
pub mod format;
#[cfg(test)]
mod golden;
mod jobs;
mod lifecycle;
mod network;
pub mod onboarding;
pub mod ports;
mod progress;
mod routes;
mod secrets;
mod tasks;

use std::sync::Arc;

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, CancelTaskParams, GetTaskParams,
    GetTaskResult, Implementation, InitializeRequestParams, InitializeResult, JsonObject,
    ListPromptsResult, ListResourceTemplatesResult, ListResourcesResult, ListToolsResult,
    MetaObject, PaginatedRequestParams, PromptsCapability, ReadResourceRequestParams,
    ReadResourceResponse, ReadResourceResult, Resource, ResourceContents, ResourcesCapability,
    ServerCapabilities, ServerConfig, Tool, ToolsCapability, UpdateTaskParams,
};
use rmcp::service::{NotificationContext, RequestContext};
use rmcp::{ErrorData, RoleServer, ServerHandler};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use self::call::{Call, CallError};
use self::routes::{Definitions, Switches};
pub use self::tasks::TaskSettings;
use crate::backends::Progress;
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
    /// What `tools/list` answers: the routes the switches turn on, defined once at startup.
    tools: Vec<Tool>,
    /// Which tools are on. The file switch also brings the `computer://` resource template
    /// (docs/files.md); the lifecycle switch the dashboard resource and the UI extension
    /// (docs/decisions.md, "Tool list").
    switches: Switches,
    /// `port_url`'s forwarders; present with the file tools.
    pub ports: Option<Arc<Ports>>,
    /// The server's egress policy when it is not `open` without rules: `computer_network` is
    /// listed then (docs/egress.md).
    pub egress: Option<crate::backends::egress::EgressPolicy>,
    /// Ask-to-allow: the backend's egress questions put to the sessions' people, when the
    /// backend asks any (docs/egress.md, "Ask-to-allow").
    asks: Option<Arc<ask::Asks>>,
    /// The HTTP transport's base URL, for `port_url`'s `proxy_url` (unset in stdio mode).
    proxy_base: std::sync::OnceLock<String>,
    /// The Tasks extension (docs/tasks.md), on every backend whose jobs live in the computer.
    tasks: std::sync::OnceLock<tasks::Tasks>,
    /// The secrets computers use without seeing them (docs/secrets.md); names and hosts are
    /// shown, never values.
    secrets: std::sync::OnceLock<crate::backends::brokering::SecretBook>,
    /// `secret_request`'s one-time pages, with `--secret-tools` (docs/secrets-onboarding.md);
    /// the transport serves them.
    pub onboarding: Option<Arc<onboarding::Onboarding>>,
    instructions: String,
}

impl Surface {
    pub fn new(
        registry: Arc<Registry>,
        tool_description: &str,
        lifecycle_tools: bool,
        jobs: Option<Arc<Jobs>>,
        file_tools: bool,
        egress: Option<crate::backends::egress::EgressPolicy>,
    ) -> Arc<Self> {
        Self::with_checkpoints(
            registry,
            tool_description,
            lifecycle_tools,
            jobs,
            file_tools,
            false,
            egress,
        )
    }

    /// [`Surface::new`], with the checkpoint tools' switch (docs/checkpoints.md).
    pub fn with_checkpoints(
        registry: Arc<Registry>,
        tool_description: &str,
        lifecycle_tools: bool,
        jobs: Option<Arc<Jobs>>,
        file_tools: bool,
        checkpoint_tools: bool,
        egress: Option<crate::backends::egress::EgressPolicy>,
    ) -> Arc<Self> {
        Self::with_secrets(
            registry,
            tool_description,
            lifecycle_tools,
            jobs,
            file_tools,
            checkpoint_tools,
            egress,
            None,
        )
    }

    /// [`Surface::with_checkpoints`], with the secret tools: `secret_tools` is the book the
    /// entered secrets go into, when `--secret-tools` is on (docs/secrets-onboarding.md).
    #[expect(
        clippy::too_many_arguments,
        reason = "one switch per tool group, as the callers name them"
    )]
    pub fn with_secrets(
        registry: Arc<Registry>,
        tool_description: &str,
        lifecycle_tools: bool,
        jobs: Option<Arc<Jobs>>,
        file_tools: bool,
        checkpoint_tools: bool,
        egress: Option<crate::backends::egress::EgressPolicy>,
        secret_tools: Option<crate::backends::brokering::SecretBook>,
    ) -> Arc<Self> {
        let onboarding = secret_tools.map(|book| {
            Arc::new(onboarding::Onboarding::new(
                book,
                Arc::clone(registry.backend()),
            ))
        });
        let switches = Switches {
            jobs: jobs.is_some(),
            files: file_tools,
            lifecycle: lifecycle_tools,
            checkpoints: checkpoint_tools,
            egress: egress.is_some(),
            secrets: onboarding.is_some(),
        };
        if checkpoint_tools {
            registry.enable_checkpoints();
        }
        let definitions = Definitions {
            description: tool_description,
            job_tools: jobs.is_some(),
            jobs_in_server: registry.backend().runs_jobs_in_server(),
            output_limit: registry.limits().output_limit,
            egress: egress.is_some(),
        };
        let tools = routes::tools(switches, &definitions);
        let mut instructions = INSTRUCTIONS.to_owned();
        if let Some(jobs) = &jobs {
            // A deleted or reset computer's jobs went with its processes (docs/jobs.md).
            let weak = Arc::downgrade(jobs);
            registry.on_removed(Box::new(move |id, _| {
                if let Some(jobs) = weak.upgrade() {
                    jobs.forget_computer(id);
                }
            }));
            instructions.push_str(jobs::INSTRUCTIONS);
        }
        let mut ports = None;
        if file_tools {
            instructions.push_str(files::INSTRUCTIONS);
            ports = Some(Ports::new(registry.clone()));
        }
        if checkpoint_tools {
            instructions.push_str(checkpoints::INSTRUCTIONS);
        }
        if onboarding.is_some() {
            instructions.push_str(secrets::INSTRUCTIONS);
        }
        let asks = ask::Asks::start(Arc::clone(&registry));
        Arc::new(Self {
            asks,
            registry,
            jobs,
            tools,
            switches,
            ports,
            egress,
            proxy_base: std::sync::OnceLock::new(),
            tasks: std::sync::OnceLock::new(),
            secrets: std::sync::OnceLock::new(),
            onboarding,
            instructions,
        })
    }

    /// Gives the surface the server's secret book (docs/secrets.md): `computer_network`
    /// shows each computer's secrets by name and hosts.
    pub fn enable_secrets(&self, book: crate::backends::brokering::SecretBook) {
        let _ = self.secrets.set(book);
    }

    /// The secret book; an empty one when brokering is off.
    pub(crate) fn secret_book(&self) -> crate::backends::brokering::SecretBook {
        self.secrets.get().cloned().unwrap_or_default()
    }

    /// Turns the Tasks extension on (docs/tasks.md): its tasks are jobs of `jobs`, whether or
    /// not the job tools are listed. Backends that keep jobs in the server (WASM) have no
    /// durable jobs to make tasks of, and stay without.
    pub fn enable_tasks(&self, jobs: Arc<Jobs>, settings: TaskSettings) {
        if self.registry.backend().runs_jobs_in_server() {
            return;
        }
        if self.jobs.is_none() {
            // With the job tools on, their service already forgets removed computers.
            let weak = Arc::downgrade(&jobs);
            self.registry.on_removed(Box::new(move |id, _| {
                if let Some(jobs) = weak.upgrade() {
                    jobs.forget_computer(id);
                }
            }));
        }
        let _ = self.tasks.set(tasks::Tasks::new(jobs, settings));
    }

    /// Tells `port_url` where the HTTP transport serves `/computers/<id>/ports/<port>/`.
    pub fn set_proxy_base(&self, base: String) {
        let _ = self.proxy_base.set(base);
    }

    /// The HTTP transport's base URL, once it serves (never in stdio mode).
    fn proxy_base(&self) -> Option<&str> {
        self.proxy_base.get().map(String::as_str)
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

    /// One `tools/call`: the tool's route, its handler, and the answer as the wire has it.
    async fn call(
        &self,
        name: &str,
        arguments: Option<&JsonObject>,
        progress: &dyn Progress,
        cancel: &CancellationToken,
        peer: Option<&rmcp::Peer<RoleServer>>,
    ) -> Result<CallToolResult, ErrorData> {
        let Some(route) = routes::find(self.surface.switches, name) else {
            return format::respond(Err(CallError::NotListed), format::ErrorText::Message);
        };
        let call = Call {
            tool: route.name,
            surface: &self.surface,
            session: &self.session,
            arguments,
            progress,
            cancel,
            peer,
        };
        format::respond((route.handler)(&call).await, route.errors)
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

    /// The Tasks extension; rmcp routes `tasks/*` here only while it is advertised.
    fn tasks(&self) -> Result<&tasks::Tasks, ErrorData> {
        self.surface
            .tasks
            .get()
            .ok_or_else(ErrorData::method_not_found::<rmcp::model::GetTaskMethod>)
    }

    fn with_session(surface: Arc<Surface>, session: Arc<Session>) -> Self {
        let release = ReleaseOnDrop {
            registry: surface.registry.clone(),
            asks: surface.asks.clone(),
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
    asks: Option<Arc<ask::Asks>>,
    jobs: Option<Arc<Jobs>>,
    session: Arc<Session>,
}

impl Drop for ReleaseOnDrop {
    fn drop(&mut self) {
        if let Some(asks) = &self.asks {
            asks.closed(self.session.id());
        }
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
        let mut extensions = rmcp::model::ExtensionCapabilities::new();
        if self.surface.switches.lifecycle {
            let mut ui = JsonObject::new();
            ui.insert("mimeTypes".to_owned(), json!([dashboard::MIME_TYPE]));
            extensions.insert("io.modelcontextprotocol/ui".to_owned(), ui);
        }
        if self.surface.tasks.get().is_some() {
            extensions.insert(tasks::EXTENSION.to_owned(), JsonObject::new());
        }
        if !extensions.is_empty() {
            capabilities.extensions = Some(extensions);
        }
        ServerConfig::new(capabilities)
            .with_server_info(
                Implementation::new("Kilntainers", env!("CARGO_PKG_VERSION"))
                    .with_title("MCP Sandbox Computer VM for AI"),
            )
            .with_instructions(self.surface.instructions.clone())
    }

    /// The Tasks extension is advertised where it defines its advertisement, in
    /// `server/discover`; `initialize` answers as before it existed (docs/tasks.md).
    async fn initialize(
        &self,
        request: InitializeRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<InitializeResult, ErrorData> {
        context.peer.set_peer_info(request.clone());
        let mut result = self.negotiate_initialize(&request)?;
        if let Some(extensions) = result.capabilities.extensions.as_mut() {
            extensions.remove(tasks::EXTENSION);
            if extensions.is_empty() {
                result.capabilities.extensions = None;
            }
        }
        Ok(result)
    }

    async fn get_task(
        &self,
        request: GetTaskParams,
        context: RequestContext<RoleServer>,
    ) -> Result<GetTaskResult, ErrorData> {
        let tasks = self.tasks()?;
        let registry = &self.surface.registry;
        tasks
            .get(registry, &self.session, &request.task_id, &context.ct)
            .await
    }

    async fn cancel_task(
        &self,
        request: CancelTaskParams,
        context: RequestContext<RoleServer>,
    ) -> Result<(), ErrorData> {
        let tasks = self.tasks()?;
        let registry = &self.surface.registry;
        tasks
            .cancel(registry, &self.session, &request.task_id, &context.ct)
            .await
    }

    async fn update_task(
        &self,
        request: UpdateTaskParams,
        context: RequestContext<RoleServer>,
    ) -> Result<(), ErrorData> {
        let tasks = self.tasks()?;
        let registry = &self.surface.registry;
        tasks
            .update(registry, &self.session, &request.task_id, &context.ct)
            .await
    }

    async fn on_initialized(&self, context: NotificationContext<RoleServer>) {
        tracing::info!("client initialized");
        if let Some(asks) = &self.surface.asks {
            asks.connected(self.session.id(), &context.peer, None);
        }
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
        let resources = if self.surface.switches.lifecycle {
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
        if self.surface.switches.files
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
        if !self.surface.switches.lifecycle || request.uri != dashboard::RESOURCE_URI {
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
        let templates = if self.surface.switches.files {
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
        if let Some(asks) = &self.surface.asks {
            asks.connected(
                self.session.id(),
                &context.peer,
                context.meta.client_capabilities(),
            );
            // 2026-07-28: a question while the call runs answers it with `input_required`
            // and the client's retry carries the answer (docs/egress.md, "Ask-to-allow").
            if let Some(state) = request.request_state.as_deref() {
                let principal = self.session.principal();
                let responses = request.input_responses.as_ref();
                return asks.resume(state, responses, principal, &context.ct).await;
            }
        }
        if let Some(tasks) = self.surface.tasks.get()
            && request.name == execute::TERMINAL_EXECUTE
            && tasks::declared(&context.meta)
        {
            let progress = progress::McpProgress::start(&context);
            let call = Call {
                tool: execute::TERMINAL_EXECUTE,
                surface: &self.surface,
                session: &self.session,
                arguments: request.arguments.as_ref(),
                progress: &progress,
                cancel: &context.ct,
                peer: Some(&context.peer),
            };
            let answer = execute::terminal_execute_or_task(&call, tasks).await;
            progress.finish().await;
            return tasks::respond(answer);
        }
        if let Some(asks) = &self.surface.asks {
            let session = self.session.id();
            if asks.takes_input_required(session) {
                let progress = progress::McpProgress::start(&context);
                let cancel = CancellationToken::new();
                let (handler, work_cancel) = (self.clone(), cancel.clone());
                // A 2026-07-28 call cannot send the client requests: nothing to ask with.
                let work = async move {
                    let arguments = request.arguments.as_ref();
                    let answer = handler
                        .call(
                            request.name.as_ref(),
                            arguments,
                            &progress,
                            &work_cancel,
                            None,
                        )
                        .await;
                    progress.finish().await;
                    answer
                };
                let principal = self.session.principal().clone();
                return asks
                    .run_call(session, principal, cancel, &context.ct, work)
                    .await;
            }
        }
        let progress = progress::McpProgress::start(&context);
        let arguments = request.arguments.as_ref();
        let answer = self
            .call(
                request.name.as_ref(),
                arguments,
                &progress,
                &context.ct,
                Some(&context.peer),
            )
            .await;
        // Pending progress notifications go out before the result.
        progress.finish().await;
        answer.map(Into::into)
    }
}
