"""`chat_template_kwargs` reach every rendering of a chat: the tool turns of a rollout (and of an evaluation),
SFT's prompts and tool trajectories, and `cohort-grpo eval` / `cohort-grpo sft`'s own option."""

import types

import pytest

from cohort_grpo import GRPOConfig
from cohort_grpo.sft.sft_trainer import SFTConfig, encode_sft_row
from cohort_grpo.sft.sft_tools import encode_trajectory
from cohort_grpo.cli.eval import EVAL_OPTIONS, run_eval
from cohort_grpo.cli.flags import parse_options
from cohort_grpo.cli.sft import SFT_OPTIONS
from cohort_grpo.errors import CohortError
from cohort_grpo.models.tiny import build_tokenizer
from cohort_grpo.tools import assistant_message, make_tools, run_tool_call, split_turn, tool_result_messages
from cohort_grpo.tools.toolbox import make_toolbox
from helpers import QWEN_STYLE_TEMPLATE

# The Qwen-style template, with a reasoning block opened after the generation prompt when asked.
THINKING_TEMPLATE = QWEN_STYLE_TEMPLATE + "{%- if add_generation_prompt and thinking %}{{- '<think>' }}{%- endif %}"


def multiply(a: int, b: int) -> int:
    """Multiply two numbers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def tokenizer_with_template():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = THINKING_TEMPLATE
    return tokenizer


def tool_turn(chat_template_kwargs) -> str:
    """The text a rollout appends after a turn that called multiply, for a run with these kwargs."""
    args = GRPOConfig(tools=[f"{__name__}:multiply"], chat_template_kwargs=chat_template_kwargs)
    toolbox = make_toolbox(None, None, args, None)
    turns = toolbox.turns(tokenizer_with_template(), num_rows=1)
    table = make_tools([multiply])
    calls = split_turn('<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call>',
                       "hermes", table).calls
    messages = [m for call in calls for m in tool_result_messages(call, run_tool_call(call, table))]
    return turns.tool_turn_text(calls, messages, table)


def test_a_template_kwarg_changes_the_tool_turn_of_a_rollout():
    plain, thinking = tool_turn(None), tool_turn({"thinking": True})
    assert plain.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert thinking == plain + "<think>"
    assert tool_turn({"thinking": False}) == plain


def test_sft_renders_prompts_and_trajectories_with_the_kwargs():
    tokenizer = tokenizer_with_template()
    row = {"prompt": [{"role": "user", "content": "6*7"}], "completion": "42"}
    plain, _ = encode_sft_row(row, tokenizer)
    thinking, _ = encode_sft_row(row, tokenizer, template_kwargs={"thinking": True})
    assert tokenizer.decode(thinking) == tokenizer.decode(plain) + "<think>"

    table = make_tools([multiply])
    calls = split_turn('<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call>',
                       "hermes", table).calls
    messages = [{"role": "user", "content": "6*7"}, assistant_message(calls),
                *tool_result_messages(calls[0], run_tool_call(calls[0], table)),
                {"role": "assistant", "content": "42"}]
    # A trajectory needs a template that keeps earlier turns as they were: the kwarg opens the chat instead.
    tokenizer.chat_template = "{%- if thinking %}{{- '<think>' }}{%- endif %}" + QWEN_STYLE_TEMPLATE
    plain = encode_trajectory(tokenizer, messages)
    thinking = encode_trajectory(tokenizer, messages, {"thinking": True})
    assert tokenizer.decode(thinking[0]) == "<think>" + tokenizer.decode(plain[0])
    assert thinking[1:] == plain[1:]


def test_sft_train_encodes_rows_with_its_configs_kwargs(monkeypatch):
    import torch

    import cohort_grpo.sft.sft_trainer as sft

    seen = []
    monkeypatch.setattr(sft, "encode_sft_row", lambda row, tokenizer, length, kwargs: seen.append(kwargs) or ([1], [2]))
    sft.sft_train(torch.nn.Linear(1, 1), build_tokenizer(), [{"prompt": "p", "completion": "c"}],
                  SFTConfig(max_steps=0, chat_template_kwargs={"thinking": True}), log=lambda _: None)
    assert seen == [{"thinking": True}]


@pytest.mark.parametrize("options", [EVAL_OPTIONS, SFT_OPTIONS])
def test_the_commands_take_a_json_object(options):
    command = "eval" if options is EVAL_OPTIONS else "sft"
    parsed = parse_options(["--chat_template_kwargs", '{"thinking": true}'], options, command)
    assert parsed["chat_template_kwargs"] == {"thinking": True}
    with pytest.raises(CohortError, match="chat_template_kwargs expects mapping, got"):
        parse_options(["--chat_template_kwargs", "[1, 2]"], options, command)


def test_cohort_eval_encodes_prompts_with_the_kwargs(monkeypatch, tmp_path):
    import cohort_grpo.eval.evaluate
    import cohort_grpo.run.policy
    import cohort_grpo.rollout

    seen = []

    class Stop(Exception):
        pass

    def fake_evaluate(sampler, tokenizer, task, rows, encode, **_):
        seen.append(tokenizer.decode(encode([{"role": "user", "content": "1+1"}])))
        raise Stop

    monkeypatch.setattr(cohort_grpo.run.policy, "load_policy",
                        lambda *a, **k: (types.SimpleNamespace(eval=lambda: None), tokenizer_with_template()))
    monkeypatch.setattr(cohort_grpo.rollout, "make_sampler", lambda model, tokenizer: None)
    monkeypatch.setattr(cohort_grpo.eval.evaluate, "evaluate", fake_evaluate)
    for extra in ([], ["--chat_template_kwargs", '{"thinking": true}']):
        with pytest.raises(Stop):
            run_eval(["--task", "arithmetic", "--limit", "1", "--device", "cpu", "--output_dir", str(tmp_path),
                      *extra])
    assert seen[1] == seen[0] + "<think>"
