"""Tools a model can call while it is trained (TRL's `GRPOTrainer(tools=[...])`, `environment_factory`).

* `sandbox`: `run_python`, a tool that runs the model's Python in a contained subprocess;
  `sandbox_report()` says what is contained on this machine, measured.
* `schema`: the JSON schema of a typed, documented function (transformers' `get_json_schema`), and the
  tools of an environment object.
* tool calls, one module a step: `call_text` reads and writes them in the model family's text format
  (Qwen/Hermes `<tool_call>`, Llama 3 JSON: parse a turn, detect a complete call while generating);
  `call_validation` checks a call against its tool's schema; `call_execution` runs it with a timeout;
  `call_messages` renders the calls and a result as the chat template's assistant and tool turns;
  `call_records` holds what they pass along (`ToolCall`, `ToolCallError`, `ToolResult`).

docs/howto/tools.md has the details, and what the sandbox does and does not contain.
"""

from cohort_grpo.tools.call_execution import execute_tool_call, run_tool_call
from cohort_grpo.tools.call_messages import assistant_message, tool_result_messages
from cohort_grpo.tools.call_records import ToolCall, ToolCallError, ToolResult, error_text
from cohort_grpo.tools.call_text import (
    FAMILIES,
    ParsedTurn,
    detect_tool_call,
    family_of_template,
    format_tool_calls,
    parse_tool_calls,
    split_turn,
)
from cohort_grpo.tools.call_validation import validate_tool_call
from cohort_grpo.tools.loading import resolve_environment, resolve_tools, tool_spec
from cohort_grpo.tools.sandbox import DEFAULT_SANDBOX, Sandbox, SandboxResult, run_python, sandbox_report
from cohort_grpo.tools.schema import Tool, environment_tools, make_tool, make_tools, tool_schema

__all__ = [
    "DEFAULT_SANDBOX", "FAMILIES", "ParsedTurn", "Sandbox", "SandboxResult", "Tool", "ToolCall", "ToolCallError",
    "ToolResult", "assistant_message", "detect_tool_call", "environment_tools", "error_text", "execute_tool_call",
    "family_of_template", "format_tool_calls", "make_tool", "make_tools", "parse_tool_calls", "resolve_environment",
    "resolve_tools", "run_python", "run_tool_call", "sandbox_report", "split_turn", "tool_result_messages",
    "tool_schema", "tool_spec", "validate_tool_call",
]
