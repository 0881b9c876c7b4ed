"""A round of tool calls as chat messages, for `apply_chat_template` (the transformers chat format, TRL's
form): the assistant turn that made the calls (`assistant_message`) and the tool turn holding a call's
result (`tool_result_messages`). The template renders them in the model family's own format (e.g. Qwen's
<tool_response> block).
"""

from __future__ import annotations

from cohort_grpo.tools.call_records import ToolCall, ToolCallError, ToolResult, result_text


def tool_result_messages(call, result) -> list[dict]:
    """The tool turn for a call's result, for `apply_chat_template`: [{"role": "tool", "name", "content"}]
    (TRL's form; the template renders it, e.g. as Qwen's <tool_response> block). `result` is the text,
    or what `execute_tool_call` returned; a ToolCallError may stand for both call and result."""
    if isinstance(result, ToolResult):
        result = result.text
    if result is None and isinstance(call, ToolCallError):
        result = call.result_text
    name = call.name if getattr(call, "name", None) else "unknown"
    message = {"role": "tool", "name": name, "content": result_text(result)}
    if getattr(call, "id", None):
        message["tool_call_id"] = call.id
    return [message]


def assistant_message(calls, content: str = "") -> dict:
    """The assistant turn that made `calls`, in the transformers chat format (arguments as dicts), so that
    `apply_chat_template` renders it in the model's own format. ToolCallErrors are left out."""
    tool_calls = []
    for call in calls:
        if isinstance(call, ToolCall):
            entry = {"type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            if call.id:
                entry["id"] = call.id
            tool_calls.append(entry)
    message: dict = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message
