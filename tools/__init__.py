"""Agent tools: the Tool interface, a registry that never raises, and the builtin tools.

    from tools import ToolRegistry
    registry = ToolRegistry.from_names(["calculator", "python"])
    schemas = registry.schemas()          # OpenAI function schemas for the chat template
    result = await registry.execute("python", '{"code": "print(1)"}', timeout_s=10)

See docs/tools.md for the limits and the isolation of the python sandbox.
"""

from tools.base import Tool, ToolResult, validate_arguments
from tools.registry import ToolRegistry

__all__ = ["Tool", "ToolResult", "ToolRegistry", "validate_arguments"]
