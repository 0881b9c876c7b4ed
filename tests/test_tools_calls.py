"""Tool calls as text: parsing (complete, cut off, several, malformed), detection while the text grows,
checking against the schema, execution (sync, async, timeouts, exceptions) and the chat messages."""

from __future__ import annotations

import asyncio
import json
import time

from pathlib import Path

import pytest

from cohort_grpo.models.tiny import build_tokenizer
from cohort_grpo.tools import (
    ToolCall,
    ToolCallError,
    ToolResult,
    assistant_message,
    detect_tool_call,
    execute_tool_call,
    family_of_template,
    format_tool_calls,
    make_tools,
    parse_tool_calls,
    run_tool_call,
    split_turn,
    tool_result_messages,
)
from helpers import QWEN_STYLE_TEMPLATE


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def add(a: float, b: float) -> float:
    """Add two numbers.

    Args:
        a: The first term.
        b: The second term.
    """
    return a + b


def divide(a: int, b: int) -> float:
    """Divide a by b.

    Args:
        a: The dividend.
        b: The divisor.
    """
    return a / b


async def slow_add(a: int, b: int, delay: float = 0.0) -> int:
    """Add two integers, after a while.

    Args:
        a: The first term.
        b: The second term.
        delay: Seconds to wait first.
    """
    await asyncio.sleep(delay)
    return a + b


def nap(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "awake"


def tag(labels: list[str], weights: dict[str, float] | None = None, mode: str = "all") -> str:
    """Tag something.

    Args:
        labels: The labels.
        weights: A weight per label.
        mode: How to combine them (choices: ["all", "any"])
    """
    return ",".join(labels)


TOOLS = make_tools([multiply, add, divide, slow_add, nap, tag])


def hermes(name, arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# -- parsing ------------------------------------------------------------------------------------------------


def test_parse_one_hermes_call():
    text = "I will multiply.\n" + hermes("multiply", {"a": 6, "b": 7})
    [call] = parse_tool_calls(text, "hermes", TOOLS)
    assert isinstance(call, ToolCall)
    assert (call.name, call.arguments) == ("multiply", {"a": 6, "b": 7})
    assert text[call.start:call.end] == call.raw and call.raw.startswith("<tool_call>") and call.end == len(text)
    assert parse_tool_calls("No tools needed: 42.", "qwen") == []


def test_parse_several_calls_in_one_turn_and_the_content_around_them():
    text = "First both.\n" + hermes("multiply", {"a": 2, "b": 3}) + "\n" + hermes("add", {"a": 1.5, "b": 2})
    calls = parse_tool_calls(text, "qwen2.5", TOOLS)
    assert [(c.name, c.arguments) for c in calls] == [("multiply", {"a": 2, "b": 3}), ("add", {"a": 1.5, "b": 2})]
    turn = split_turn(text, "hermes")
    assert turn.content == "First both." and len(turn.calls) == 2


def test_a_cut_off_call_is_an_error_in_a_finished_turn():
    text = hermes("multiply", {"a": 2, "b": 3}) + '\n<tool_call>\n{"name": "add", "argu'
    first, second = parse_tool_calls(text, "hermes")
    assert isinstance(first, ToolCall)
    assert isinstance(second, ToolCallError)
    assert str(second) == "the tool call was cut off: <tool_call> has no closing </tool_call>"
    assert second.result_text == "{'error': 'the tool call was cut off: <tool_call> has no closing </tool_call>'}"


@pytest.mark.parametrize("body, message", [
    ('{"name": "multiply", "arguments": {"a": 6, "b": }}', "the tool call is not valid JSON (Expecting value at character"),
    ('["multiply", 6, 7]', 'a tool call must be a JSON object with "name" and "arguments"'),
    ('{"arguments": {"a": 6}}', 'the tool call has no "name" string'),
    ('{"name": "multiply", "arguments": [6, 7]}', "the arguments of 'multiply' must be a JSON object"),
    ('{"name": "multiply", "arguments": "{\\"a\\": 6,"}', "the arguments of 'multiply' are not valid JSON"),
])
def test_malformed_calls_are_errors_the_model_sees(body, message):
    [error] = parse_tool_calls(f"<tool_call>\n{body}\n</tool_call>", "hermes", TOOLS)
    assert isinstance(error, ToolCallError)
    assert str(error).startswith(message)
    assert "\n" not in str(error)


def test_arguments_written_as_a_json_string_are_accepted():
    [call] = parse_tool_calls('<tool_call>{"name": "multiply", "arguments": "{\\"a\\": 6, \\"b\\": 7}"}</tool_call>',
                              "hermes", TOOLS)
    assert call.arguments == {"a": 6, "b": 7}


@pytest.mark.parametrize("name, arguments, message", [
    ("power", {"a": 2}, "unknown tool 'power'; the tools are: add, divide, multiply, nap, slow_add, tag"),
    ("multiply", {"a": 6}, "tool 'multiply' is missing required argument 'b'"),
    ("multiply", {}, "tool 'multiply' is missing required arguments 'a', 'b'"),
    ("multiply", {"a": 6, "b": 7, "c": 8}, "tool 'multiply' has no argument 'c' (its arguments: a, b)"),
    ("multiply", {"a": "6", "b": 7}, "tool 'multiply': argument 'a' must be integer, got string \"6\""),
    ("multiply", {"a": True, "b": 7}, "tool 'multiply': argument 'a' must be integer, got boolean true"),
    ("multiply", {"a": 6.5, "b": 7}, "tool 'multiply': argument 'a' must be integer, got number 6.5"),
    ("tag", {"labels": ["x", 3]}, "tool 'tag': argument 'labels'[1] must be string, got integer 3"),
    ("tag", {"labels": ["x"], "weights": {"x": "heavy"}}, "tool 'tag': argument 'weights'['x'] must be number"),
    ("tag", {"labels": ["x"], "mode": "some"}, "tool 'tag': argument 'mode' must be one of [\"all\", \"any\"]"),
])
def test_calls_that_do_not_fit_the_schema_are_errors(name, arguments, message):
    [error] = parse_tool_calls(hermes(name, arguments), "hermes", TOOLS)
    assert isinstance(error, ToolCallError), error
    assert str(error).startswith(message)
    assert error.name == name


def test_values_the_schema_allows():
    for name, arguments in [("add", {"a": 1, "b": 2.5}), ("tag", {"labels": [], "weights": None}),
                            ("tag", {"labels": ["a"], "weights": {"a": 1}, "mode": "any"})]:
        [call] = parse_tool_calls(hermes(name, arguments), "hermes", TOOLS)
        assert isinstance(call, ToolCall), call


def test_parse_llama3_json_calls():
    [call] = parse_tool_calls('{"name": "multiply", "parameters": {"a": 6, "b": 7}}', "llama3", TOOLS)
    assert (call.name, call.arguments) == ("multiply", {"a": 6, "b": 7})
    text = '<|python_tag|>{"name": "add", "arguments": {"a": 1, "b": 2}}<|eom_id|>'
    [call] = parse_tool_calls(text, "llama3.1", TOOLS)
    assert (call.name, call.arguments, call.start) == ("add", {"a": 1, "b": 2}, 0)
    assert parse_tool_calls("The answer is 42.", "llama3") == []
    assert parse_tool_calls('{"answer": 42}', "llama3") == []  # JSON, but not a call
    [error] = parse_tool_calls('{"name": "multiply", "parameters": {"a": 6', "llama3")
    assert str(error) == "the tool call was cut off: its JSON object is not closed"
    [error] = parse_tool_calls('{"name": "multiply", "parameters": {"a": 6, "b": "7"}}', "llama3", TOOLS)
    assert str(error) == "tool 'multiply': argument 'b' must be integer, got string \"7\""


def test_unknown_family():
    with pytest.raises(ValueError, match="unknown tool-call family 'mistral'"):
        parse_tool_calls("", "mistral")


# -- detecting a call while the text grows --------------------------------------------------------------------


def test_detect_returns_none_until_the_closing_tag_then_the_call():
    text = "Let me see. " + hermes("multiply", {"a": 12, "b": 34}) + "\n" + hermes("add", {"a": 1, "b": 2}) + "<|im_end|>"
    first_end = text.index("</tool_call>") + len("</tool_call>")
    for n in range(first_end):
        assert detect_tool_call(text[:n], "hermes") is None, text[:n]
    call = detect_tool_call(text[:first_end], "hermes", tools=TOOLS)
    assert (call.name, call.arguments, call.end) == ("multiply", {"a": 12, "b": 34}, first_end)
    # the next call of the same turn: look from where the first ended
    second_end = text.index("</tool_call>", first_end) + len("</tool_call>")
    assert detect_tool_call(text[:second_end - 1], "hermes", start=call.end) is None
    second = detect_tool_call(text[:second_end], "hermes", start=call.end)
    assert (second.name, second.arguments) == ("add", {"a": 1, "b": 2})
    assert detect_tool_call(text, "hermes", start=second.end) is None


def test_detect_llama3_a_complete_json_object():
    text = '<|python_tag|>{"name": "tag", "parameters": {"labels": ["}", "{\\"x"], "mode": "any"}}'
    for n in range(len(text)):
        assert detect_tool_call(text[:n], "llama3") is None, text[:n]
    call = detect_tool_call(text, "llama3", tools=TOOLS)
    assert call.arguments == {"labels": ["}", '{"x'], "mode": "any"}
    assert detect_tool_call("The answer is {42}", "llama3") is None  # not a call: never one


def test_detect_returns_the_error_for_a_malformed_complete_call():
    error = detect_tool_call('<tool_call>{"name": "multiply", "arguments": {"a": 1,}}</tool_call>', "hermes")
    assert isinstance(error, ToolCallError) and "not valid JSON" in str(error)
    error = detect_tool_call(hermes("power", {"a": 1}), "hermes", tools=TOOLS)
    assert isinstance(error, ToolCallError) and str(error).startswith("unknown tool 'power'")


# -- execution ------------------------------------------------------------------------------------------------


def run(call, timeout_s=5.0) -> ToolResult:
    return asyncio.run(execute_tool_call(call, TOOLS, timeout_s))


def test_execute_a_sync_and_an_async_tool():
    text, failed, seconds = run(ToolCall("multiply", {"a": 6, "b": 7}))
    assert (text, failed) == ("42", False) and seconds < 1
    assert run(ToolCall("slow_add", {"a": 1, "b": 2, "delay": 0.05})) [:2] == ("3", False)
    assert run_tool_call(ToolCall("add", {"a": 0.5, "b": 2}), TOOLS).text == "2.5"


def test_sync_tools_run_in_threads_concurrently():
    async def both():
        return await asyncio.gather(execute_tool_call(ToolCall("nap", {"seconds": 0.5}), TOOLS),
                                    execute_tool_call(ToolCall("nap", {"seconds": 0.5}), TOOLS))

    start = time.monotonic()
    results = asyncio.run(both())
    assert [r.text for r in results] == ["awake", "awake"]
    assert time.monotonic() - start < 0.9


def test_a_tool_that_times_out_fails_at_its_timeout():
    start = time.monotonic()
    text, failed, seconds = run(ToolCall("nap", {"seconds": 3}), timeout_s=0.2)
    assert failed and text == "{'error': \"tool 'nap' timed out after 0.2 s\"}"
    assert 0.2 <= seconds < 1 and time.monotonic() - start < 1
    text, failed, _ = run(ToolCall("slow_add", {"a": 1, "b": 2, "delay": 3}), timeout_s=0.2)
    assert failed and "timed out after 0.2 s" in text


HANGS_FOREVER = """
import threading
from cohort_grpo.tools import ToolCall, run_tool_call

def wait_forever() -> str:
    \"\"\"Never returns.\"\"\"
    threading.Event().wait()

print(run_tool_call(ToolCall("wait_forever", {}), [wait_forever], timeout_s=0.2).text, flush=True)
"""


def test_a_tool_that_never_returns_does_not_keep_the_process_from_exiting(tmp_path):
    """Its thread cannot be stopped; it must not be one the interpreter waits for at exit (a run that ended would
    hang there forever)."""
    import os
    import subprocess
    import sys

    script = tmp_path / "hangs.py"
    script.write_text(HANGS_FOREVER)
    started = time.monotonic()
    repo = Path(__file__).resolve().parents[1]  # this checkout's cohort_grpo, installed or not
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=20, env=env)
    assert done.returncode == 0, done.stderr
    assert "timed out after 0.2 s" in done.stdout and time.monotonic() - started < 20


def test_a_tool_that_raises_fails_with_its_message():
    text, failed, _ = run(ToolCall("divide", {"a": 1, "b": 0}))
    assert failed and text == "{'error': 'ZeroDivisionError: division by zero'}"


def test_an_unusable_call_fails_without_running_anything():
    text, failed, seconds = run(ToolCallError("the tool call has no \"name\" string"))
    assert failed and seconds == 0.0 and text == "{'error': 'the tool call has no \"name\" string'}"
    text, failed, _ = run(ToolCall("multiply", {"a": "6", "b": 7}))
    assert failed and "must be integer" in text


# -- messages and the chat template ------------------------------------------------------------------------------



def test_result_messages_render_through_the_chat_template_and_calls_round_trip():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = QWEN_STYLE_TEMPLATE
    assert family_of_template(QWEN_STYLE_TEMPLATE) == "hermes"
    generated = "Two products.\n" + hermes("multiply", {"a": 6, "b": 7}) + "\n" + hermes("divide", {"a": 1, "b": 0})
    turn = split_turn(generated, "hermes", TOOLS)
    messages = [{"role": "user", "content": "6*7 and 1/0?"}, assistant_message(turn.calls, turn.content)]
    for call in turn.calls:
        result = run(call)
        messages += tool_result_messages(call, result)
    assert messages[2] == {"role": "tool", "name": "multiply", "content": "42"}
    assert messages[3] == {"role": "tool", "name": "divide", "content": "{'error': 'ZeroDivisionError: division by zero'}"}
    rendered = tokenizer.apply_chat_template(messages, tools=[t.schema for t in TOOLS.values()], tokenize=False,
                                             add_generation_prompt=True)
    assert '"name": "multiply"' in rendered.split("<tools>")[1].split("</tools>")[0]
    assert ("<|im_start|>user\n<tool_response>\n42\n</tool_response>\n<tool_response>\n{'error': "
            "'ZeroDivisionError: division by zero'}\n</tool_response><|im_end|>\n<|im_start|>assistant\n") in rendered
    # the assistant turn as the template renders it parses back to the same calls
    assistant = rendered.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert [(c.name, c.arguments) for c in parse_tool_calls(assistant, "hermes")] == \
        [(c.name, c.arguments) for c in turn.calls]
    assert format_tool_calls(turn.calls, "hermes") == generated.split("\n", 1)[1]


def test_format_llama3_and_error_messages():
    call = ToolCall("multiply", {"a": 6, "b": 7})
    assert format_tool_calls([call], "llama3") == '{"name": "multiply", "parameters": {"a": 6, "b": 7}}'
    with pytest.raises(ValueError, match="one call per message"):
        format_tool_calls([call, call], "llama3")
    error = ToolCallError("unknown tool 'power'; the tools are: multiply", name="power")
    assert tool_result_messages(error, None) == [
        {"role": "tool", "name": "power", "content": "{'error': \"unknown tool 'power'; the tools are: multiply\"}"}]
    assert tool_result_messages(ToolCallError("bad JSON"), None)[0]["name"] == "unknown"
    assert assistant_message([error], "text") == {"role": "assistant", "content": "text"}
