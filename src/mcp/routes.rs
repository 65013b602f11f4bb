//! The route table: every tool in the order `tools/list` lists it (docs/decisions.md, "Tool
//! list"; the spec's order: `terminal_execute`, the job tools, the file tools and `port_url`,
//! the checkpoint tools, then the lifecycle tools), with the switch that turns it on, its definition, its handler
//! and how its errors read. `tools/list` and `tools/call` both read this one table, so a tool
//! is listed exactly when it can be called.

use futures_util::future::BoxFuture;
use rmcp::model::Tool;

use super::call::{Call, CallError, Payload};
use super::format::ErrorText;
use super::{checkpoints, execute, files, jobs, lifecycle, network, ports, secrets};

/// Which startup switch turns a tool on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Switch {
    Always,
    /// `--job-tools` (docs/jobs.md, "Switch").
    Jobs,
    /// `--file-tools` (docs/files.md); `port_url` comes with it.
    Files,
    /// `--lifecycle-tools` (docs/decisions.md, "Tool list").
    Lifecycle,
    /// `--checkpoint-tools` (docs/checkpoints.md).
    Checkpoints,
    /// An egress policy other than `open` without rules (docs/egress.md).
    Egress,
    /// The dashboard (the lifecycle switch) and an egress policy both: the person's egress
    /// tools, for the app alone (docs/egress.md, "Dashboard").
    EgressDashboard,
    /// `--secret-tools` (docs/secrets-onboarding.md).
    Secrets,
}

/// The switches one process runs with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Switches {
    pub jobs: bool,
    pub files: bool,
    pub lifecycle: bool,
    pub checkpoints: bool,
    pub egress: bool,
    pub secrets: bool,
}

impl Switches {
    pub fn on(self, switch: Switch) -> bool {
        match switch {
            Switch::Always => true,
            Switch::Jobs => self.jobs,
            Switch::Files => self.files,
            Switch::Lifecycle => self.lifecycle,
            Switch::Checkpoints => self.checkpoints,
            Switch::Egress => self.egress,
            Switch::EgressDashboard => self.egress && self.lifecycle,
            Switch::Secrets => self.secrets,
        }
    }
}

/// What the tool definitions are made from, fixed at startup.
pub(super) struct Definitions<'a> {
    /// `terminal_execute`'s description, assembled for the backend (`description.rs`).
    pub description: &'a str,
    /// The job switch: `terminal_execute` gains `yield_after` and `keep_stdin_open`.
    pub job_tools: bool,
    /// Jobs run in the server process on this backend, which `job_list` says.
    pub jobs_in_server: bool,
    /// `--output-limit`, `file_read`'s largest page.
    pub output_limit: u64,
    /// An egress policy is enforced: `computer_create` takes `egress` (docs/egress.md).
    pub egress: bool,
}

/// A tool's handler: `async fn(&Call) -> Result<Payload, CallError>`, boxed so that one table
/// holds them all.
pub(super) type Handler = for<'c> fn(&'c Call<'c>) -> BoxFuture<'c, Result<Payload, CallError>>;

/// One tool.
pub(super) struct Route {
    pub name: &'static str,
    pub switch: Switch,
    pub tool: fn(&Definitions<'_>) -> Tool,
    pub handler: Handler,
    pub errors: ErrorText,
}

/// `handler!(f)`: the async fn `f` as a [`Handler`].
macro_rules! handler {
    ($f:path) => {
        |call| Box::pin($f(call))
    };
}

/// Every tool, in listing order.
pub(super) static ROUTES: &[Route] = &[
    Route {
        name: execute::TERMINAL_EXECUTE,
        switch: Switch::Always,
        tool: execute::tool,
        handler: handler!(execute::terminal_execute),
        errors: ErrorText::Message,
    },
    Route {
        name: jobs::OUTPUT,
        switch: Switch::Jobs,
        tool: jobs::output_tool,
        handler: handler!(jobs::output),
        errors: ErrorText::Message,
    },
    Route {
        name: jobs::WRITE,
        switch: Switch::Jobs,
        tool: jobs::write_tool,
        handler: handler!(jobs::write),
        errors: ErrorText::Message,
    },
    Route {
        name: jobs::KILL,
        switch: Switch::Jobs,
        tool: jobs::kill_tool,
        handler: handler!(jobs::kill),
        errors: ErrorText::Message,
    },
    Route {
        name: jobs::LIST,
        switch: Switch::Jobs,
        tool: jobs::list_tool,
        handler: handler!(jobs::list),
        errors: ErrorText::Message,
    },
    Route {
        name: files::READ,
        switch: Switch::Files,
        tool: files::read_tool,
        handler: handler!(files::read),
        errors: ErrorText::Message,
    },
    Route {
        name: files::WRITE,
        switch: Switch::Files,
        tool: files::write_tool,
        handler: handler!(files::write),
        errors: ErrorText::Message,
    },
    Route {
        name: files::LIST,
        switch: Switch::Files,
        tool: files::list_tool,
        handler: handler!(files::list),
        errors: ErrorText::Message,
    },
    Route {
        name: ports::PORT_URL,
        switch: Switch::Files,
        tool: ports::tool,
        handler: handler!(ports::port_url),
        errors: ErrorText::Message,
    },
    Route {
        name: checkpoints::CHECKPOINT,
        switch: Switch::Checkpoints,
        tool: checkpoints::checkpoint_tool,
        handler: handler!(checkpoints::checkpoint),
        errors: ErrorText::Message,
    },
    Route {
        name: checkpoints::ROLLBACK,
        switch: Switch::Checkpoints,
        tool: checkpoints::rollback_tool,
        handler: handler!(checkpoints::rollback),
        errors: ErrorText::Message,
    },
    Route {
        name: checkpoints::FORK,
        switch: Switch::Checkpoints,
        tool: checkpoints::fork_tool,
        handler: handler!(checkpoints::fork),
        errors: ErrorText::Message,
    },
    Route {
        name: checkpoints::LIST,
        switch: Switch::Checkpoints,
        tool: checkpoints::list_tool,
        handler: handler!(checkpoints::list),
        errors: ErrorText::Message,
    },
    Route {
        name: checkpoints::DELETE,
        switch: Switch::Checkpoints,
        tool: checkpoints::delete_tool,
        handler: handler!(checkpoints::delete),
        errors: ErrorText::Message,
    },
    Route {
        name: lifecycle::DASHBOARD,
        switch: Switch::Lifecycle,
        tool: lifecycle::dashboard_tool,
        handler: handler!(lifecycle::list),
        errors: ErrorText::Json,
    },
    Route {
        name: lifecycle::LIST,
        switch: Switch::Lifecycle,
        tool: lifecycle::list_tool,
        handler: handler!(lifecycle::list),
        errors: ErrorText::Json,
    },
    Route {
        name: lifecycle::CREATE,
        switch: Switch::Lifecycle,
        tool: lifecycle::create_tool,
        handler: handler!(lifecycle::create),
        errors: ErrorText::Json,
    },
    Route {
        name: lifecycle::RESTART,
        switch: Switch::Lifecycle,
        tool: lifecycle::restart_tool,
        handler: handler!(lifecycle::restart),
        errors: ErrorText::Json,
    },
    Route {
        name: lifecycle::FACTORY_RESET,
        switch: Switch::Lifecycle,
        tool: lifecycle::factory_reset_tool,
        handler: handler!(lifecycle::factory_reset),
        errors: ErrorText::Json,
    },
    Route {
        name: lifecycle::DELETE,
        switch: Switch::Lifecycle,
        tool: lifecycle::delete_tool,
        handler: handler!(lifecycle::delete),
        errors: ErrorText::Json,
    },
    Route {
        name: network::COMPUTER_NETWORK,
        switch: Switch::Egress,
        tool: network::tool,
        handler: handler!(network::computer_network),
        errors: ErrorText::Message,
    },
    Route {
        name: network::ALLOW,
        switch: Switch::EgressDashboard,
        tool: network::allow_tool,
        handler: handler!(network::allow),
        errors: ErrorText::Message,
    },
    Route {
        name: network::REMOVE,
        switch: Switch::EgressDashboard,
        tool: network::remove_tool,
        handler: handler!(network::remove),
        errors: ErrorText::Message,
    },
    Route {
        name: network::QUESTIONS,
        switch: Switch::EgressDashboard,
        tool: network::questions_tool,
        handler: handler!(network::questions),
        errors: ErrorText::Message,
    },
    Route {
        name: network::ANSWER,
        switch: Switch::EgressDashboard,
        tool: network::answer_tool,
        handler: handler!(network::answer),
        errors: ErrorText::Message,
    },
    Route {
        name: secrets::SECRET_REQUEST,
        switch: Switch::Secrets,
        tool: secrets::tool,
        handler: handler!(secrets::secret_request),
        errors: ErrorText::Message,
    },
];

/// The routes `switches` turn on, in listing order.
pub(super) fn enabled(switches: Switches) -> impl Iterator<Item = &'static Route> {
    ROUTES.iter().filter(move |route| switches.on(route.switch))
}

/// The tool definitions `tools/list` answers with.
pub(super) fn tools(switches: Switches, definitions: &Definitions<'_>) -> Vec<Tool> {
    enabled(switches)
        .map(|route| (route.tool)(definitions))
        .collect()
}

/// The route `tools/call` takes for `name`, when the switches list that tool.
pub(super) fn find(switches: Switches, name: &str) -> Option<&'static Route> {
    enabled(switches).find(|route| route.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL_ON: Switches = Switches {
        jobs: true,
        files: true,
        lifecycle: true,
        checkpoints: true,
        egress: true,
        secrets: true,
    };

    #[test]
    fn each_route_defines_the_tool_it_is_named_for_once() {
        let definitions = Definitions {
            description: "",
            job_tools: true,
            jobs_in_server: false,
            output_limit: 1,
            egress: true,
        };
        let names: Vec<String> = tools(ALL_ON, &definitions)
            .into_iter()
            .map(|tool| tool.name.into_owned())
            .collect();
        let routed: Vec<&str> = ROUTES.iter().map(|route| route.name).collect();
        assert_eq!(names, routed);
        let mut unique = routed.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), routed.len(), "a tool is routed twice");
    }

    #[test]
    fn a_switched_off_tool_is_neither_listed_nor_found() {
        let off = Switches {
            jobs: false,
            files: true,
            lifecycle: false,
            checkpoints: false,
            egress: false,
            secrets: false,
        };
        assert!(find(off, secrets::SECRET_REQUEST).is_none());
        assert!(find(ALL_ON, secrets::SECRET_REQUEST).is_some());
        assert!(find(off, jobs::OUTPUT).is_none());
        assert!(find(off, lifecycle::LIST).is_none());
        assert!(find(off, checkpoints::CHECKPOINT).is_none());
        assert!(find(off, "no_such_tool").is_none());
        assert_eq!(
            find(off, ports::PORT_URL).map(|route| route.name),
            Some(ports::PORT_URL)
        );
        assert!(find(ALL_ON, jobs::OUTPUT).is_some());
    }

    #[test]
    fn the_persons_egress_tools_need_the_dashboard_and_a_policy() {
        let only = |lifecycle, egress| Switches {
            jobs: false,
            files: false,
            lifecycle,
            checkpoints: false,
            egress,
            secrets: false,
        };
        for name in [
            network::ALLOW,
            network::REMOVE,
            network::QUESTIONS,
            network::ANSWER,
        ] {
            assert!(find(only(true, true), name).is_some(), "{name}");
            assert!(find(only(false, true), name).is_none(), "{name}");
            assert!(find(only(true, false), name).is_none(), "{name}");
        }
        assert!(find(only(false, true), network::COMPUTER_NETWORK).is_some());
    }
}
