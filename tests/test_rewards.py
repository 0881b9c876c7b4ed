"""Rule-based rewards (cohort_grpo/rewards/rules.py) against hand-worked expectations."""

import json
from fractions import Fraction
from pathlib import Path

import pytest

from cohort_grpo.errors import CohortError
from cohort_grpo.rewards.rules import (
    REWARD_FUNCS,
    accuracy_reward,
    canonical_answer,
    extract_answer,
    format_reward,
    lenient_format_reward,
    reasoning_steps_reward,
    resolve_reward,
    tag_count_reward,
)

# the main checkout's ../shared copy, found from this checkout or a git worktree beside it (any folder above)
GSM8K_TEST = next((folder / "shared" / "data" / "gsm8k" / "test.jsonl" for folder in Path(__file__).resolve().parents
                   if (folder / "shared" / "data" / "gsm8k" / "test.jsonl").is_file()), None)

STRICT = "<think>\nadd 2 and 3\n</think>\n<answer>\n5\n</answer>"


def chat(text):
    return [{"role": "assistant", "content": text}]


# ------------------------------------------------------------------------------------------ format

@pytest.mark.parametrize("completion, strict, lenient", [
    (STRICT, 1.0, 1.0),
    (STRICT + "\n", 1.0, 1.0),  # trailing whitespace is ignored
    (STRICT + "<|im_end|>", 1.0, 1.0),  # so is an end-of-sequence marker left by decoding
    (STRICT + "</s>\n", 1.0, 1.0),
    ("<think>add</think><answer>5</answer>", 0.0, 1.0),  # no newlines: only lenient
    ("  <think> add </think>\n\n <answer> 5 </answer>  ", 0.0, 1.0),
    ("Sure! " + STRICT, 0.0, 0.0),  # text before <think>
    (STRICT + " and more", 0.0, 0.0),  # text after </answer>
    ("<think>\na\n</think>\n<answer>\n5\n</answer>\n<answer>\n6\n</answer>", 0.0, 0.0),  # two answers
    ("<think>\na\n</think>\n<think>\nb\n</think>\n<answer>\n5\n</answer>", 0.0, 0.0),  # two thinks
    ("<answer>\n5\n</answer>", 0.0, 0.0),
    ("<think>\na\n</think>\n<answer>\n5", 0.0, 0.0),  # truncated
    ("", 0.0, 0.0),
])
def test_format_rewards(completion, strict, lenient):
    assert format_reward(None, [completion]) == [strict]
    assert lenient_format_reward(None, [completion]) == [lenient]
    # conversational completions score the same as their text
    assert format_reward(None, [chat(completion)]) == [strict]
    assert lenient_format_reward(None, [chat(completion)]) == [lenient]


def test_format_multiline_think_content():
    text = "<think>\nline one\n\nline two\n</think>\n<answer>\n42\n</answer>"
    assert format_reward(None, [text]) == [1.0]


@pytest.mark.parametrize("completion, pieces_once", [
    (STRICT, 4),
    ("<think>\nx</think><answer>5</answer>", 1),  # only "<think>\n"
    ("<think>\nx\n</think>\n<answer>5</answer>", 2),
    ("<think>\nx\n</think>\n<answer>\n5\n</answer>", 4),
    ("<think>\n<think>\nx\n</think>\n<answer>\n5\n</answer>", 3),  # "<think>\n" twice earns nothing
    ("no tags", 0),
])
def test_tag_count_reward(completion, pieces_once):
    assert tag_count_reward(None, [completion]) == [0.25 * pieces_once]
    assert tag_count_reward(None, [chat(completion)]) == [0.25 * pieces_once]


@pytest.mark.parametrize("completion, markers", [
    ("Step 1: add. Step 2: multiply. Step 3: done.", 3),
    ("First, add. Next, multiply. Finally, report.", 3),
    ("1. add\n2. multiply", 2),
    ("- add\n* multiply\n- report\n- check", 4),
    ("The price is 1.5 dollars and 5 - 3 = 2.", 0),  # decimals and minus signs are not steps
    ("Second, we know x.", 1),
    ("", 0),
])
def test_reasoning_steps_reward(completion, markers):
    assert reasoning_steps_reward(None, [completion]) == [min(1.0, markers / 3)]


# ---------------------------------------------------------------------------------------- accuracy

@pytest.mark.parametrize("text, expected", [
    ("<think>\n1+1\n</think>\n<answer>\n 2 \n</answer>", "2"),
    ("<answer>1</answer> then <answer>3</answer>", "3"),  # the last answer block
    ("so the result is \\boxed{\\frac{1}{2}} and \\boxed{7}", "7"),  # the last boxed
    ("\\boxed{\\frac{3}{4}} is it", "\\frac{3}{4}"),  # nested braces kept
    ("she has 3 apples and 1,000 pears", "1,000"),  # last number, thousands separator kept
    ("the temperature fell to -4.5 degrees", "-4.5"),
    ("no digits here", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected
    assert extract_answer(chat(text)) == expected


@pytest.mark.parametrize("answer, gold, expected", [
    ("1,000", "1000", 1.0),
    ("1000", "1,000", 1.0),
    ("\\frac{1}{2}", "0.5", 1.0),
    ("0.5", "\\frac{1}{2}", 1.0),
    ("$18", "18", 1.0),
    ("18.00", "18", 1.0),
    ("$18.00", "18", 1.0),
    ("18 dollars", "18", 1.0),
    ("-7", "-7", 1.0),
    ("17", "18", 0.0),
    ("1,001", "1000", 0.0),
    ("0.49", "\\frac{1}{2}", 0.0),
    ("-18", "18", 0.0),
    ("eighteen", "18", 0.0),  # nothing parsable in the answer: wrong, not unscored
    ("", "18", 0.0),
])
def test_accuracy_answer_forms(answer, gold, expected):
    completion = f"<think>\nworking\n</think>\n<answer>\n{answer}\n</answer>"
    assert accuracy_reward(None, [completion], solution=[gold]) == [expected]
    assert accuracy_reward(None, [chat(completion)], solution=[gold]) == [expected]


def test_accuracy_fallbacks_without_answer_tags():
    completions = [
        "We compute 9 * 2 and get \\boxed{18}.",  # boxed
        "We compute 9 * 2 = 18",  # last number
        "9 * 2 = 18, minus 1 is 17",  # last number is wrong
        "I do not know",  # nothing to read
    ]
    assert accuracy_reward(None, completions, solution=["18"] * 4) == [1.0, 1.0, 0.0, 0.0]


def test_accuracy_unparseable_gold_is_none_and_batch_keeps_order():
    rewards = accuracy_reward(["p"] * 3, ["<answer>4</answer>", "<answer>4</answer>", "<answer>5</answer>"],
                              solution=["4", "no number at all", 4])
    assert rewards == [1.0, None, 0.0]


def test_accuracy_is_thread_safe():
    """math-verify's own signal-based timeout fails off the main thread; ours is disabled there."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        result = pool.submit(accuracy_reward, None, ["<answer>\\frac{1}{2}</answer>"], solution=["0.5"]).result()
    assert result == [1.0]


@pytest.mark.parametrize("text, expected", [
    ("<answer>18.00</answer>", "18"),
    ("<answer>$1,000</answer>", "1000"),
    ("<answer>\\frac{1}{2}</answer>", "0.5"),
    ("<answer>none</answer>", None),
])
def test_canonical_answer(text, expected):
    assert canonical_answer(text) == expected


@pytest.mark.parametrize("a, b", [
    ("3.14159", "3.14"), ("0.12345", "0.123"), ("1234.5", "1230"), ("1234.5", "1235"), ("2.71828", "2.72"),
    ("-0.06255", "-0.0626"), ("123456.789", "123457"), ("0.000123456", "0.000123"), ("99.99", "100"),
])
def test_canonical_answer_keeps_every_digit_of_a_decimal(a, b):
    """Majority voting must not merge answers that differ past the third significant digit."""
    assert canonical_answer(f"<answer>{a}</answer>") == a  # a plain decimal is its own normal form
    assert canonical_answer(f"<answer>{b}</answer>") == b
    assert canonical_answer(f"<answer>{a}</answer>") != canonical_answer(f"<answer>{b}</answer>")


@pytest.mark.parametrize("forms, normal", [
    (["3.14159", "3.141590", "$3.14159$", "The answer is 3.14159"], "3.14159"),
    (["1234.5", "1,234.5", "1234.50", "\\frac{2469}{2}"], "1234.5"),
    (["0.125", "\\frac{1}{8}", ".125", "0.1250"], "0.125"),
    (["-2.5", "-\\frac{5}{2}", "-2.50"], "-2.5"),
])
def test_canonical_answer_gives_equal_forms_one_normal_form(forms, normal):
    assert [canonical_answer(f"<answer>{form}</answer>") for form in forms] == [normal] * len(forms)


# ---------------------------------------------------------------------------------------- registry

def test_resolve_reward_by_name_path_and_callable():
    assert set(REWARD_FUNCS) == {"format", "lenient_format", "tag_count", "reasoning_steps", "accuracy",
                                 "think_format_reward"}
    for name, func in REWARD_FUNCS.items():
        assert resolve_reward(name) is func
    assert resolve_reward("cohort_grpo.rewards.rules:format_reward") is format_reward
    assert resolve_reward("json:dumps") is json.dumps  # any importable function, named by the user
    assert resolve_reward(len) is len


@pytest.mark.parametrize("spec, fragment", [
    ("acuracy", "accuracy"),  # the message lists the known names
    ("no_such_module_xyz:f", "cannot import"),
    ("json:no_such_function", "no_such_function"),
    ("json:__doc__", "not a function"),
])
def test_resolve_reward_errors(spec, fragment):
    with pytest.raises(CohortError, match=fragment):
        resolve_reward(spec)


# ------------------------------------------------------------------------------------ GSM8K golds

def _gold(answer: str) -> str:
    return answer.split("####")[-1].strip().replace(",", "")


@pytest.mark.skipif(GSM8K_TEST is None, reason="no shared/data/gsm8k/test.jsonl (the main checkout's ../shared copy "
                                                 "of GSM8K) in any folder above this checkout")
def test_every_gsm8k_test_gold_parses_to_its_number():
    from math_verify import parse

    rows = [json.loads(line) for line in GSM8K_TEST.read_text().splitlines() if line.strip()]
    assert len(rows) == 1319
    golds = [_gold(r["answer"]) for r in rows]
    for gold in golds:
        parsed = parse(gold, parsing_timeout=None)
        assert parsed, gold
        assert Fraction(str(parsed[0])) == Fraction(gold), gold  # the number itself, exactly
        assert canonical_answer(f"<answer>{gold}</answer>") == str(Fraction(gold)), gold
    # scored through the reward: the gold answer is right, the gold answer plus one is wrong
    right = [f"<think>\nx\n</think>\n<answer>\n{g}\n</answer>" for g in golds]
    wrong = [f"<answer>{Fraction(g) + 1}</answer>" for g in golds]
    assert accuracy_reward(None, right, solution=golds) == [1.0] * len(golds)
    assert accuracy_reward(None, wrong, solution=golds) == [0.0] * len(golds)
