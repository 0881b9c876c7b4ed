"""docs/howto/tools.md says what the code does: its training script runs as written (every name it uses
defined), and its chat failure lines are the ones `cohort-grpo chat` prints."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "howto" / "tools.md"


def test_the_training_script_defines_what_it_uses(monkeypatch):
    source = next(block for block in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
                  if block.startswith("# train.py"))
    built = []

    class Trainer:  # stands in for GRPOTrainer: takes the arguments, trains nothing
        def __init__(self, model, **kwargs):
            built.append(kwargs)

        def train(self):
            built[-1]["trained"] = True

    fake = types.ModuleType("cohort_grpo")
    fake.GRPOTrainer, fake.GRPOConfig = Trainer, lambda **options: options
    monkeypatch.setitem(sys.modules, "cohort_grpo", fake)
    exec(compile(source, str(DOC), "exec"), {"__name__": "__main__"})  # a NameError here: the doc's bug
    (kwargs,) = built
    assert kwargs["trained"] and kwargs["tools"][0](6, 7) == 42
    rows, (correct,) = kwargs["train_dataset"], kwargs["reward_funcs"]
    row = rows[0]
    answered = [[{"role": "assistant", "content": f"It is {row['answer']}."}], [{"role": "assistant", "content": "?"}]]
    assert correct(answered, answer=[row["answer"]] * 2) == [1.0, 0.0]


def test_the_documented_failure_lines_are_what_chat_prints():
    from cohort_grpo.cli.chat_tools import call_line
    from cohort_grpo.tools import ToolCall, ToolResult, parse_tool_calls

    raised = call_line(ToolCall("calculator", {"expression": "1/0"}),
                       ToolResult("{'error': 'ZeroDivisionError: division by zero'}", True, 0.0))
    (unreadable,) = parse_tool_calls('<tool_call>\n{"name": "calculator", "arguments": {6*7}}\n</tool_call>', "hermes")
    text = " ".join(DOC.read_text().split())
    assert f"`{raised}`" in text
    assert call_line(unreadable, None).startswith("[calculator failed: the tool call is not valid JSON (")
    assert "`[calculator failed: the tool call is not valid JSON (...)]`" in text
