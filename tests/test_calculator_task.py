"""The built-in tool-use task (`--task calculator`): its calculator tool, problems, reward, the tiny
tools model's chat template and tokenizer, and the warm start's trajectories (tool tokens out of the loss).

Everything runs on tiny objects in seconds; the full warm start is measured outside the suite."""

import json

import pytest
import torch

from cohort_grpo.sft.sft_trainer import SFTConfig, sft_train
from cohort_grpo.sft.sft_tools import (
    encode_trajectory,
    reproduced_fraction,
    tool_trajectories,
)
from cohort_grpo.errors import CohortError
from cohort_grpo.models import tiny
from cohort_grpo.sft import builtin
from cohort_grpo.models.tiny import (
    TINY_TOOLS_MODEL,
    TINY_TOOLS_SPEC,
    build_model,
    build_tools_tokenizer,
)
from cohort_grpo.tasks import get_task, prompt_text
from cohort_grpo.tasks.calculator import (
    CalculatorTask,
    answer_reward,
    calculator,
    extract_answer,
)
from cohort_grpo.tools import (
    assistant_message,
    family_of_template,
    make_tools,
    parse_tool_calls,
    run_tool_call,
    split_turn,
    tool_result_messages,
    tool_schema,
)

torch.set_num_threads(1)

SMALL = dict(TINY_TOOLS_SPEC, hidden_size=32, intermediate_size=64, num_hidden_layers=1)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tools_tokenizer()


def conversation(question="347*2891", answer=None):
    row = {"prompt": [{"role": "user", "content": f"{question}=?"}], "question": question,
           "solution": calculator(question)}
    messages = CalculatorTask.solved_messages(row)
    if answer is not None:
        messages[-1] = {"role": "assistant", "content": f"<answer>{answer}</answer>"}
    return messages


# ---- the tool ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("expression, value", [
    ("347*2891", "1003177"), ("(12+30)/7", "6"), ("7/2", "3.5"), ("-3*(2+1)", "-9"), (" 10 - 4 - 3 ", "3"),
    ("+5", "5"), ("123456789*987654321", str(123456789 * 987654321)), ("1/3*3", "1"),
])
def test_calculator_values(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("expression, message", [
    ("__import__('os').system('true')", "is not allowed"),
    ("x+1", "name 'x' is not allowed"),
    ("2**10", "operator Pow is not supported"),
    ("7//2", "operator FloorDiv is not supported"),
    ("1.5*2", "only integers are allowed"),
    ("1/0", "division by zero"),
    ("3*", "cannot read"),
    ("1+" * 150 + "1", "at most 200"),
    ("[1, 2]", "is not allowed"),
])
def test_calculator_rejects_anything_else_with_a_clear_error(expression, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("*", r"\*")):
        calculator(expression)


def test_calculator_schema_and_errors_as_the_model_sees_them():
    schema = tool_schema(calculator)
    function = schema["function"]
    assert function["name"] == "calculator"
    assert function["parameters"]["required"] == ["expression"]
    assert function["parameters"]["properties"]["expression"]["type"] == "string"
    assert "347*2891" in function["parameters"]["properties"]["expression"]["description"]
    tools = make_tools(CalculatorTask.tools)
    ok = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
    assert run_tool_call(parse_tool_calls(ok, "hermes", tools)[0], tools).text == "42"
    bad = run_tool_call(parse_tool_calls(ok.replace("6*7", "open(1)"), "hermes", tools)[0], tools)
    assert bad.failed and "ValueError" in bad.text and "is not allowed" in bad.text


# ---- the task -----------------------------------------------------------------------------------------------

def test_rows_are_chat_prompts_with_exact_products_and_disjoint_splits():
    task = get_task("calculator")
    assert isinstance(task, CalculatorTask) and task.tools == [calculator] and not task.reads_data
    train, test = task.load("train", size=500, seed=3), task.load("test", size=200)
    for row in train[:20] + test[:20]:
        a, b = row["question"].split("*")
        assert (len(a), len(b), len(row["solution"])) == (3, 4, 7)
        assert row["solution"] == str(int(a) * int(b))
        assert row["prompt"] == [{"role": "user", "content": f"{row['question']}=?"}]
    assert not {r["question"] for r in train} & {r["question"] for r in task.load("test", size=1000)}
    assert task.load("test", size=50, seed=7) == test[:50]  # the held-out split ignores the seed
    assert task.load("train", size=50, seed=3) == train[:50] != task.load("train", size=50, seed=4)
    with pytest.raises(CohortError, match="splits train/test/validation"):
        task.load("dev")


def test_default_config_names_the_tools_model_and_fits_a_rollout(tokenizer):
    config = CalculatorTask.default_config
    assert config["model"] == TINY_TOOLS_MODEL and tiny.is_builtin_model(config["model"])
    assert config["max_tool_calling_iterations"] == 1 and config["num_generations"] == 8
    prompt, completion, _ = encode_trajectory(tokenizer, conversation("999*9999"))
    assert len(completion) <= config["max_completion_length"]
    assert len(prompt) + len(completion) <= TINY_TOOLS_SPEC["max_position_embeddings"]
    with pytest.raises(CohortError, match="unknown built-in model"):
        builtin.builtin_model_dir("cohort:nope")


def test_reward_reads_the_last_assistant_message_only():
    row = CalculatorTask().load("test", size=1)[0]
    gold = row["solution"]
    called = conversation(row["question"])
    direct = [{"role": "assistant", "content": f"<answer>{gold}</answer>"}]
    wrong = conversation(row["question"], answer="12")
    no_answer = called[1:-1] + [{"role": "assistant", "content": "I do not know"}]
    cut_after_the_call = called[1:3]  # the budget ran out after the tool's result
    completions = [called[1:], direct, wrong[1:], no_answer, cut_after_the_call]
    assert answer_reward(None, completions, solution=[gold] * 5) == [1.0, 1.0, 0.0, 0.0, 0.0]
    # A whole trajectory as text: only what follows the last tool response counts.
    text = f"<tool_call>{{}}</tool_call><tool_response><answer>{gold}</answer></tool_response>\n<answer>1</answer>"
    assert extract_answer(text) == "1" and extract_answer(f"<answer> {gold} </answer>") == gold
    assert CalculatorTask().is_correct(called[1:], row) and not CalculatorTask().is_correct("<answer>", row)


# ---- the tiny tools model's tokenizer and template ---------------------------------------------------------

def test_template_renders_a_tool_conversation_in_the_hermes_format(tokenizer):
    messages = conversation()
    assert family_of_template(tokenizer.chat_template) == "hermes"
    assert prompt_text(tokenizer, messages[:1]) == "347*2891=?\n"  # the generation prompt adds nothing
    assert tokenizer.apply_chat_template(messages, tokenize=False) == (
        '347*2891=?\n<tool_call>{"name": "calculator", "arguments": {"expression": "347*2891"}}</tool_call><eos>'
        "<tool_response>1003177</tool_response>\n<answer>1003177</answer><eos>")
    schemas = [tool_schema(calculator)]  # tools are not shown: the warm start teaches the one tool
    assert tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False) == \
        tokenizer.apply_chat_template(messages, tokenize=False)


def test_a_tool_conversation_round_trips(tokenizer):
    messages = conversation()
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.unk_token_id not in ids and tokenizer.decode(ids) == text
    for tag in tiny.TOOL_TAGS + tiny.ANSWER_TAGS:  # one token each, as Qwen has them
        assert len(tokenizer(tag, add_special_tokens=False)["input_ids"]) == 1
    json_text = json.dumps({"a": [1, "b_c"], "d": {"e": "'"}})
    assert tokenizer.decode(tokenizer(json_text, add_special_tokens=False)["input_ids"]) == json_text
    # The model's call turn parses back into the call that was rendered, and re-renders identically.
    call_turn = text[len("347*2891=?\n"): text.index("<eos>")]
    turn = split_turn(call_turn, "hermes", make_tools(CalculatorTask.tools))
    assert [(c.name, c.arguments) for c in turn.calls] == [("calculator", {"expression": "347*2891"})]
    result = run_tool_call(turn.calls[0], make_tools(CalculatorTask.tools))
    rebuilt = [messages[0], assistant_message(turn.calls, turn.content),
               *tool_result_messages(turn.calls[0], result), messages[-1]]
    assert tokenizer.apply_chat_template(rebuilt, tokenize=False) == text


# ---- the warm start ---------------------------------------------------------------------------------------

def test_warm_start_trajectory_masks_exactly_the_tool_response(tokenizer):
    prompt, completion, mask = encode_trajectory(tokenizer, conversation())
    tokens = tokenizer.convert_ids_to_tokens(completion)
    assert tokenizer.decode(prompt) == "347*2891=?\n"
    start, end = tokens.index("<tool_response>"), tokens.index("</tool_response>") + 1
    assert tokens[start - 2: start] == ["</tool_call>", "<eos>"] and tokens[end] == "\n"
    assert tokens[end + 1] == "<answer>" and tokens[-1] == "<eos>"
    # Out of the loss: the tool turn from <tool_response> to its newline; every other token is the model's.
    assert mask == [1] * start + [0] * (end + 1 - start) + [1] * (len(tokens) - end - 1)
    direct = encode_trajectory(tokenizer, conversation()[:1] + conversation()[-1:])
    assert tokenizer.convert_ids_to_tokens(direct[1]) == ["<answer>", *"1003177", "</answer>", "<eos>"]
    assert direct[2] == [1] * 10
    with pytest.raises(CohortError, match="first assistant turn"):
        encode_trajectory(tokenizer, conversation()[1:])


def test_warm_start_mixes_calls_and_direct_answers():
    rows = CalculatorTask().load("train", size=100)
    mixed = tool_trajectories(rows, 0.3, seed=0)
    assert sum(len(m) == 4 for m in mixed) == 30 and sum(len(m) == 2 for m in mixed) == 70
    assert all(len(m) == 4 for m in tool_trajectories(rows, 1.0, seed=0))


def test_masked_sft_leaves_tool_tokens_out_of_the_loss(tokenizer):
    """The tool's tokens carry no loss: training on a trajectory whose tool result is replaced by other
    digits gives the same step as on the original."""
    messages = conversation()
    changed = [dict(m) for m in messages]
    changed[2]["content"] = "5555555"
    losses = []
    for trajectory in (messages, changed):
        model = build_model(tokenizer, seed=0, spec=SMALL)
        encoded = encode_trajectory(tokenizer, trajectory)
        # Mask the answer too: it is the only model token that reads the tool's result.
        encoded = (encoded[0], encoded[1], encoded[2][:-10] + [0] * 10)
        losses.append(sft_train(model, tokenizer, [{}], SFTConfig(max_steps=2, batch_size=2, logging_steps=0),
                                log=lambda *_: None, encode=lambda _, encoded=encoded: encoded))
    assert losses[0] == losses[1]
    exact, call_probability = reproduced_fraction(model, tokenizer, [encode_trajectory(tokenizer, messages)] * 2)
    assert exact == 0.0 and 0.0 < call_probability < 1.0  # an untrained model reproduces nothing


def test_sft_log_lines_start_with_the_pass_they_count(tokenizer):
    lines = []
    encoded = encode_trajectory(tokenizer, conversation())
    sft_train(build_model(tokenizer, seed=0, spec=SMALL), tokenizer, [{}],
              SFTConfig(max_steps=2, batch_size=1, logging_steps=1), log=lines.append, encode=lambda _: encoded,
              label="SFT pass 2 of 2 (the mixture)")
    assert [line.split(":")[0] for line in lines] == ["SFT pass 2 of 2 (the mixture) step 1/2",
                                                       "SFT pass 2 of 2 (the mixture) step 2/2"]


def test_the_builtin_name_loads_a_cached_hugging_face_folder(tmp_path, monkeypatch):
    """`--model cohort:tiny-tools` builds the warm start once (here a 2-step one of a tiny spec) into an
    ordinary Hugging Face folder, tokenizer and chat template included, and loads it as the policy."""
    from transformers import AutoTokenizer

    from cohort_grpo.run.policy import load_policy

    monkeypatch.setenv("COHORT_CACHE", str(tmp_path))
    spec = dict(SMALL, hidden_size=16, intermediate_size=32, sft_steps=1, sft_mix_steps=1, sft_batch_size=2)
    monkeypatch.setitem(builtin.BUILDERS, TINY_TOOLS_MODEL,
                        lambda log=print: builtin.tiny_tools_model_dir(log=log, spec=spec))
    lines = []
    model, tokenizer = load_policy(TINY_TOOLS_MODEL, log=lines.append)
    folder = builtin.builtin_model_dir(TINY_TOOLS_MODEL, log=lines.append)
    assert folder.parent == tmp_path and folder.name.startswith("tiny-tools-")
    assert sum("Building the built-in tiny tools model" in line for line in lines) == 1  # cached after
    # each pass counts its steps from 1: its lines say which pass they are of
    assert any(line.startswith("SFT pass 2 of 2 (the mixture) done (2 steps in both passes): ") for line in lines)
    assert AutoTokenizer.from_pretrained(folder).chat_template == tiny.TINY_TOOLS_TEMPLATE
    assert family_of_template(tokenizer.chat_template) == "hermes"
    assert model.config.max_position_embeddings == 256
