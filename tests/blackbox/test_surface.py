"""MCP surface seen by a real client: initialize result (serverInfo, instructions, capabilities),
the tool list in default mode (exactly `terminal_execute`, exact Docker reference description, input and
output schemas, annotations, `_meta`), description assembly (override, extended, generic text for
a non-default image), the ENABLE_LIFECYCLE_TOOLS switch, empty resources/prompts, and that none
of this creates anything provider-side (docs/decisions.md, "Server identity and capabilities"; docs/decisions.md, "Acceptance checklist"
items 1-3, 23)."""

from __future__ import annotations

import re

import pytest

from harness import (
    BUSYBOX,
    BUSYBOX_ARGS,
    REPO,
)

pytestmark = pytest.mark.anyio

T_DOCKER = (
    "Execute a shell command in an isolated Debian Linux sandbox. Commands run in {shell}. Each call is "
    "independent \u2014 no state (shell variables, working directory) persists between calls (however "
    "filesystem does persist). Use the working_directory parameter or chain commands with && to control "
    "execution context. \n\n"
    "To write files or pass data without shell escaping, use the stdin parameter (e.g., "
    'command="cat > file.txt" with content in stdin). Commands time out after {timeout} seconds by default '
    "(override with the timeout parameter for long-running operations)."
)

INSTRUCTIONS = (
    "This server provides isolated Linux sandbox computers. Use terminal_execute to run commands. Omit "
    "computer_id to use this session's default computer, or pass computer_id to reuse a named computer. "
    "Temporary computers (the default) are removed when the session ends; pass temporary=false for a "
    "computer that must persist."
)

INPUT_PROPERTIES = [
    ("command", "string", "Command", "Shell command string (mutually exclusive with args)."),
    ("args", "array", "Args", "List of arguments for direct execution (mutually exclusive with command)."),
    ("stdin", "string", "Stdin", "Content to pipe to stdin."),
    ("working_directory", "string", "Working Directory", "Working directory for the command (must be absolute)."),
    ("timeout", "integer", "Timeout", "Timeout in seconds (defaults to server config)."),
    (
        "computer_id",
        "string",
        "Computer Id",
        "Stable computer slug. Omit to create and select a readable random ID for this MCP session.",
    ),
    (
        "temporary",
        "boolean",
        "Temporary",
        "Remove the computer when its MCP session shuts down. Set false to keep it provider-side and "
        "reconnect by computer_id.",
    ),
]

LIFECYCLE_TOOLS = [
    "terminal_execute",
    "computer_dashboard",
    "computer_list",
    "computer_create",
    "computer_restart",
    "computer_factory_reset",
    "computer_delete",
]


def crate_version() -> str:
    text = (REPO / "Cargo.toml").read_text()
    m = re.search(r'^version\s*=\s*"([^"]+)"', text, re.M)
    assert m, "no version in Cargo.toml"
    return m.group(1)


def _walk_keys(obj):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield k
            yield from _walk_keys(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _walk_keys(v)


async def test_default_mode_surface_debian(kbb):
    """Default configuration (Debian image, /bin/bash): exact tool list, description, schemas,
    initialize result, empty resources/prompts, and nothing created provider-side."""
    async with kbb.server() as srv:
        init = srv.init
        assert init["serverInfo"]["name"] == "Kilntainers"
        assert init["serverInfo"].get("title") == "MCP Sandbox Computer VM for AI"
        assert init["serverInfo"]["version"] == crate_version()
        assert init.get("instructions") == INSTRUCTIONS
        caps = init["capabilities"]
        assert "tools" in caps
        assert "resources" in caps and "prompts" in caps
        assert "extensions" not in caps, caps

        tools = await srv.list_tools()
        assert [t["name"] for t in tools] == ["terminal_execute"]
        tool = tools[0]
        assert tool["description"] == T_DOCKER.format(shell="bash", timeout=120)
        assert tool.get("annotations", {}).get("openWorldHint") is True
        assert tool.get("_meta") == {"ui": {"visibility": ["model", "app"]}}

        schema = tool["inputSchema"]
        assert schema["type"] == "object"
        assert not schema.get("required"), schema.get("required")
        props = schema["properties"]
        assert list(props) == [p[0] for p in INPUT_PROPERTIES]
        for name, typ, title, desc in INPUT_PROPERTIES:
            assert props[name].get("type") == typ, (name, props[name])
            assert props[name].get("title") == title, (name, props[name])
            assert props[name].get("description") == desc, (name, props[name])
        assert props["args"]["items"]["type"] == "string"
        assert props["temporary"].get("default") is True
        forbidden = {"pattern", "minimum", "maximum", "maxLength", "minLength", "exclusiveMinimum"}
        assert not forbidden & set(_walk_keys(schema)), "input schema must carry no constraints"

        out = tool["outputSchema"]
        assert out["type"] == "object"
        types = {k: v.get("type") for k, v in out["properties"].items()}
        assert types == {
            "computer_id": "string",
            "temporary": "boolean",
            "stdout": "string",
            "stderr": "string",
            "exit_code": "integer",
            "exec_duration_ms": "integer",
            "error": "string",
        }
        assert out["anyOf"] == [
            {"required": ["computer_id", "temporary", "stdout", "stderr", "exit_code", "exec_duration_ms"]},
            {"required": ["error"]},
        ]

        resources = await srv.session.list_resources()
        assert resources.resources == []
        templates = await srv.session.list_resource_templates()
        assert getattr(templates, "resource_templates", getattr(templates, "resourceTemplates", None)) == []
        prompts = await srv.session.list_prompts()
        assert prompts.prompts == []

        assert srv.containers() == [], "initialize/list calls must create nothing"
        # docs/decisions.md, "Exit codes and diagnostics": one start line on stderr
        start_line = f"kilntainers: mcp-sandbox-computer-vm-for-ai {crate_version()} serving stdio (backend: docker, lifecycle tools: off)"
        assert start_line in srv.stderr().splitlines(), srv.stderr()[:2000]
    assert srv.returncode() == 0


async def test_description_substitutes_shell_basename_and_timeout(kbb):
    async with kbb.server("--shell", "/usr/bin/bash", "--timeout", "45") as srv:
        tools = await srv.list_tools()
        assert tools[0]["description"] == T_DOCKER.format(shell="bash", timeout=45)


async def test_description_override_is_verbatim(kbb):
    text = "-A BusyBox shell; starts with a dash.\nSecond line."
    async with kbb.server("--tool-instruction-override", text) as srv:
        tools = await srv.list_tools()
        assert tools[0]["description"] == text


async def test_description_extended_is_appended(kbb):
    extra = "-- Extra notes for the model."
    async with kbb.server("--extended-tool-instruction", extra) as srv:
        tools = await srv.list_tools()
        assert tools[0]["description"] == T_DOCKER.format(shell="bash", timeout=120) + "\n\n" + extra


async def test_non_default_image_without_override_starts_and_names_image(kbb):
    """docs/decisions.md, "Tool descriptions" rule 3: never refuse a non-default image; use the generic text.
    (docs/decisions.md, "Acceptance checklist" item 23 keeps the reference's "custom image without override ->
    exit 1"; the descriptions rule wins.)"""
    async with kbb.server(*BUSYBOX_ARGS) as srv:
        tools = await srv.list_tools()
        desc = tools[0]["description"]
        assert desc.startswith("Execute a shell command in "), desc
        assert BUSYBOX in desc
        assert "Commands run in sh." in desc
        assert "Debian" not in desc
        assert "Each call is independent" in desc
        assert "Commands time out after 120 seconds by default" in desc
        res = await srv.run("echo hi")
        assert res.structured["stdout"] == "hi\n"


@pytest.mark.parametrize("value", ["1", "yes", "on", "false", ""])
async def test_lifecycle_switch_other_values_mean_off(kbb, value):
    async with kbb.server(*BUSYBOX_ARGS, env={"ENABLE_LIFECYCLE_TOOLS": value}) as srv:
        tools = await srv.list_tools()
        assert [t["name"] for t in tools] == ["terminal_execute"]
        assert "extensions" not in srv.init["capabilities"]


@pytest.mark.parametrize("how", ["env-true", "env-padded-True", "flag"])
async def test_lifecycle_switch_on(kbb, how):
    """Every spelling of the switch turns the lifecycle tools on, in order, with the dashboard's
    title."""
    env = {"ENABLE_LIFECYCLE_TOOLS": "true"} if how == "env-true" else {}
    if how == "env-padded-True":
        env = {"ENABLE_LIFECYCLE_TOOLS": " True "}
    args = ["--lifecycle-tools"] if how == "flag" else []
    async with kbb.server(*BUSYBOX_ARGS, *args, env=env) as srv:
        tools = await srv.list_tools()
        names = [t["name"] for t in tools]
        assert names == LIFECYCLE_TOOLS
        by_name = {t["name"]: t for t in tools}
        dash = by_name["computer_dashboard"]
        assert dash.get("title") == "Sandbox Computer Dashboard"
        assert dash["_meta"]["ui"]["resourceUri"] == "ui://kilntainers/computers"
        assert dash["_meta"]["ui/resourceUri"] == "ui://kilntainers/computers"
        assert by_name["computer_list"]["description"] == "List all sandbox computers managed by the selected backend."
        assert any(
            line.startswith("kilntainers: mcp-sandbox-computer-vm-for-ai ") and line.endswith("(backend: docker, lifecycle tools: on)")
            for line in srv.stderr().splitlines()
        ), srv.stderr()[:2000]
        ext = srv.init["capabilities"].get("extensions", {})
        assert ext.get("io.modelcontextprotocol/ui", {}).get("mimeTypes") == ["text/html;profile=mcp-app"]


async def test_unknown_tool_is_rejected_and_creates_nothing(kbb):
    async with kbb.server(*BUSYBOX_ARGS) as srv:
        try:
            res = await srv.call({}, name="computer_list")
        except Exception:
            pass  # rmcp's standard JSON-RPC error for an unknown tool
        else:
            assert res.is_error, res
        assert srv.containers() == []
