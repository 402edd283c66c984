"""Host-side tools for agent rollouts: the tool contract, executors, a Python sandbox, a
calculator and local BM25 search; tools of MCP servers in `jaxagent.tools.mcp` (the `mcp` extra,
imported on first use of its names here: `jaxagent.tools.MCPServer`, so that importing this
package never imports the MCP SDK).

Data flow: a task (`jaxagent.envs`) builds a `ToolRegistry` of tools; the rollout driver
(`jaxagent.agent`) submits each parsed call to a `ToolExecutor` and appends the resulting
`ToolResult.to_observation()` to the trajectory. Every failure is a `ToolResult(ok=False)`.
"""

from jaxagent.tools.base import (
    FunctionTool,
    Tool,
    ToolArgumentError,
    ToolRegistry,
    ToolResult,
    UnknownToolError,
    function_tool,
    normalize_result,
    validate_arguments,
)
from jaxagent.tools.calculator import Calculator, CalculatorError, calculate, evaluate, format_number
from jaxagent.tools.executors import ToolExecutor, invoke_tool
from jaxagent.tools.sandbox import (
    PythonSession,
    PythonTool,
    SandboxConfig,
    SandboxError,
    run_python,
    sandbox_isolation,
)
from jaxagent.tools.search import BM25Index, Document, Passage, SearchTool, format_passages, load_documents

__all__ = [
    "BM25Index", "Calculator", "CalculatorError", "Document", "FunctionTool", "Passage", "PythonSession",
    "PythonTool", "SandboxConfig", "SandboxError", "SearchTool", "Tool", "ToolArgumentError", "ToolExecutor",
    "ToolRegistry", "ToolResult", "UnknownToolError", "calculate", "evaluate", "format_number",
    "format_passages", "function_tool", "invoke_tool", "load_documents", "normalize_result", "run_python",
    "sandbox_isolation", "validate_arguments",
]

_LAZY = {"MCPServer", "MCPServerConfig", "MCPServerError", "MCPTool"}  # from jaxagent.tools.mcp


def __getattr__(name: str):
    if name in _LAZY:
        from jaxagent.tools import mcp
        return getattr(mcp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
