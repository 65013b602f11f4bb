//! The MCP layer: the rmcp `ServerHandler` for one session, capabilities, tool listing and
//! dispatch (`mcp-surface.md`). The only module besides `transport` that knows rmcp, and the
//! only one that knows result JSON.
//!
//! **API boundary:** everything a client can observe is produced here or in [`format`].

pub mod args;
pub mod description;
pub mod format;
mod progress;
pub mod tools;

use std::sync::Arc;

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, Implementation, ListPromptsResult,
    ListResourceTemplatesResult, ListResourcesResult, ListToolsResult, PaginatedRequestParams,
    PromptsCapability, ResourcesCapability, ServerCapabilities, ServerConfig, Tool,
    ToolsCapability,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData, RoleServer, ServerHandler};

use crate::registry::{Registry, Session};

/// Sent to every client that initialises (`mcp-surface.md` §1).
const INSTRUCTIONS: &str = "This server provides isolated Linux sandbox computers. Use terminal_execute to run commands. Omit computer_id to use this session's default computer, or pass computer_id to reuse a named computer. Temporary computers (the default) are removed when the session ends; pass temporary=false for a computer that must persist.";

/// What every session of this process shares.
pub struct Surface {
    pub registry: Arc<Registry>,
    tools: Vec<Tool>,
}

impl Surface {
    pub fn new(registry: Arc<Registry>, tool_description: &str) -> Arc<Self> {
        Arc::new(Self {
            registry,
            tools: vec![tools::terminal_execute_tool(tool_description)],
        })
    }
}

/// One MCP session's handler. Dropping it does not end the session; the transport calls
/// [`Registry::close_session`] when the session ends.
#[derive(Clone)]
pub struct SessionHandler {
    surface: Arc<Surface>,
    session: Arc<Session>,
}

impl SessionHandler {
    pub fn new(surface: Arc<Surface>, session: Arc<Session>) -> Self {
        Self { surface, session }
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
        ServerConfig::new(capabilities)
            .with_server_info(
                Implementation::new("Kilntainers", env!("CARGO_PKG_VERSION"))
                    .with_title("MCP Sandbox Computer VM for AI"),
            )
            .with_instructions(INSTRUCTIONS)
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
        Ok(ListResourcesResult::with_all_items(Vec::new()))
    }

    async fn list_resource_templates(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListResourceTemplatesResult, ErrorData> {
        Ok(ListResourceTemplatesResult::with_all_items(Vec::new()))
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
        let result = match request.name.as_ref() {
            tools::TERMINAL_EXECUTE => {
                tools::terminal_execute(
                    registry,
                    &self.session,
                    request.arguments.as_ref(),
                    &progress,
                    &context.ct,
                )
                .await
            }
            _ => return Err(ErrorData::invalid_params("tool not found", None)),
        };
        progress.finish().await;
        match result {
            Some(result) => Ok(result.into()),
            // Cancelled by the client: rmcp does not send a response for a cancelled request.
            None => Err(ErrorData::internal_error("request cancelled", None)),
        }
    }
}
