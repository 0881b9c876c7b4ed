"""TRL's reward functions, re-expressed as tests of cohort's functions of the same names.

The cases restate the documented behaviour of TRL 1.16's `think_format_reward`, `accuracy_reward` and
`get_soft_overlong_punishment` (their docstring examples and their contracts: arguments, return
values, None for an unparseable gold answer). Where cohort deliberately grades differently from TRL's
`accuracy_reward` (a wrong answer TRL pays, a right one it does not), the test asserts cohort's verdict
and says what TRL returns.
"""

import pickle

import pytest

from cohort_grpo.errors import CohortError
from cohort_grpo.rewards import (
    REWARD_FUNCS,
    accuracy_reward,
    get_soft_overlong_punishment,
    resolve_reward,
    think_format_reward,
)


def msg(content):
    """A conversational completion: a list of one assistant message."""
    return [{"role": "assistant", "content": content}]


# ------------------------------------------------------------------------------ think_format_reward

def test_think_format_reward_docstring_example():
    completions = [
        [{"content": "<think>\nThis is my reasoning.\n</think>\nThis is my answer."}],
        [{"content": "<think>\nThis is my reasoning.\nThis is my answer."}],
    ]
    assert think_format_reward(completions) == [1.0, 0.0]


@pytest.mark.parametrize("content, reward", [
    ("<think>\nI add 2 and 3.\n</think>\n5", 1.0),
    ("<think>\nfirst line\nsecond line\n\nthird line\n</think>\nThe answer is 5.", 1.0),  # multi-line reasoning
    ("<think>short</think>5", 1.0),  # no newlines needed
    ("<think>\nreasoning\n</think>\n", 1.0),  # nothing after the reasoning is still the format
    ("<think></think>5", 1.0),  # empty reasoning
    ("<think>\nreasoning\n</think>\n<answer>\n5\n</answer>", 1.0),  # an <answer> tag is allowed, not needed
    ("<think>\na\n</think>\nb\n</think>\nc", 1.0),  # a stray later </think> does not matter
    ("<think>\nreasoning, never closed", 0.0),
    ("reasoning\n</think>\n5", 0.0),  # no opening tag
    ("The answer is 5.", 0.0),
    ("Sure! <think>\nreasoning\n</think>\n5", 0.0),  # text before <think>
    (" <think>\nreasoning\n</think>\n5", 0.0),  # even a space
    ("\n<think>\nreasoning\n</think>\n5", 0.0),
    ("<think>\na\n<think>\nb\n</think>\n5", 0.0),  # a second <think> inside
    ("<think>\na\n</think>\n<think>\nb\n</think>\n5", 0.0),  # a second think block
    ("<think>\na\n</think>\n5 <think>", 0.0),  # any later <think>
    ("<THINK>\na\n</THINK>\n5", 0.0),  # tags are case-sensitive
    ("", 0.0),
])
def test_think_format_reward_cases(content, reward):
    assert think_format_reward([msg(content)]) == [reward]
    assert think_format_reward(completions=[[{"content": content}]]) == [reward]
    assert think_format_reward([content]) == [reward]  # cohort also takes plain-text completions


def test_think_format_reward_reads_the_first_message_like_trl():
    """TRL judges `completion[0]["content"]`; later messages of a conversational completion do not count."""
    good, bad = "<think>\nr\n</think>\nanswer", "no tags here"
    assert think_format_reward([[{"role": "assistant", "content": good}, {"role": "assistant", "content": bad}],
                                [{"role": "assistant", "content": bad}, {"role": "assistant", "content": good}]]) \
        == [1.0, 0.0]


def test_think_format_reward_keyword_call_and_registry():
    """The trainer calls reward functions by keyword with prompts and columns; `--reward_funcs
    think_format_reward` resolves to it."""
    rewards = think_format_reward(prompts=[msg("q")] * 2, completions=[msg("<think>a</think>b"), msg("b")],
                                  completion_ids=[[1], [2]], solution=["x", "y"])
    assert rewards == [1.0, 0.0]
    assert REWARD_FUNCS["think_format_reward"] is think_format_reward
    assert resolve_reward("think_format_reward") is think_format_reward


def test_think_format_reward_through_the_runner():
    from cohort_grpo.rewards import RewardRunner

    runner = RewardRunner(["think_format_reward"], timeout_s=10.0, sample_workers=1)
    try:
        out = runner([msg("q")] * 2, [msg("<think>a</think>b"), msg("b")], [[1], [2]], {})
    finally:
        runner.close()
    assert out.per_function[:, 0].tolist() == [1.0, 0.0]
    assert "rewards/think_format_reward/mean" in out.metrics


# ---------------------------------------------------------------------------------- accuracy_reward

def test_accuracy_reward_docstring_example():
    solutions = [r"\frac{1}{3}", r"\frac{1}{3}"]
    completions = [msg(r"My answer is \boxed{\frac{1}{3}}"), msg(r"My answer is \boxed{\frac{1}{2}}")]
    assert accuracy_reward(completions=completions, solution=solutions) == [1.0, 0.0]


@pytest.mark.parametrize("content, solution, reward", [
    (r"\boxed{\frac{63}{400}}", r"\frac{63}{400}", 1.0),
    (r"\boxed{\frac{64}{400}}", r"\frac{63}{400}", 0.0),
    (r"\boxed{-\frac{2}{3}}", r"-\frac{2}{3}", 1.0),
    (r"\boxed{\frac{2}{3}}", r"-\frac{2}{3}", 0.0),
    (r"The answer is $\frac{1}{2}$.", "0.5", 1.0),  # inline maths, as TRL's LaTeX extraction reads it
    (r"$\boxed{6}$", "6", 1.0),
    (r"\boxed{12", "12", 0.0),  # a box cut off: no answer
    (r"\boxed{2 \text{ or } 3}", "3", 0.0),
    ("I cannot tell.", "7", 0.0),  # no answer: 0.0, not None
])
def test_accuracy_reward_cases_that_agree_with_trl(content, solution, reward):
    assert accuracy_reward(completions=[msg(content)], solution=[solution]) == [reward]


def test_accuracy_reward_unparseable_gold_is_none():
    """A gold answer with nothing to read in it skips the sample (None), whatever the completion says."""
    completions = [msg("Answer is forty two."), msg("Some other content."), msg(r"\boxed{42}")]
    solutions = ["Answer is forty two.", "Answer is forty three.", "forty-two"]
    assert accuracy_reward(completions=completions, solution=solutions) == [None, None, None]


def test_accuracy_reward_contract():
    """`solution` is the dataset column the trainer passes by keyword; other columns and TRL's
    `log_extra` are accepted and ignored; the runner sees `solution` as a required column."""
    from cohort_grpo.rewards import RewardRunner

    rewards = accuracy_reward(prompts=[msg("q")], completions=[msg(r"\boxed{4}")], completion_ids=[[1, 2]],
                              solution=["4"], log_extra=None, difficulty=["easy"])
    assert rewards == [1.0]
    with pytest.raises(TypeError):
        accuracy_reward(completions=[msg(r"\boxed{4}")])  # no solution column
    with pytest.raises(ValueError):
        accuracy_reward(completions=[msg("4"), msg("5")], solution=["4"])  # TRL zips strictly too
    runner = RewardRunner([accuracy_reward], timeout_s=10.0, sample_workers=1)
    try:
        assert runner.required_columns(accuracy_reward) == ["solution"]
        with pytest.raises(CohortError, match="solution"):
            runner.check_columns({"prompt", "answer"})
    finally:
        runner.close()


def test_accuracy_reward_works_off_the_main_thread():
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        result = pool.submit(accuracy_reward, completions=[msg(r"\boxed{\frac{1}{3}}")], solution=[r"\frac{1}{3}"])
        assert result.result() == [1.0]


# Where cohort deliberately differs from TRL 1.16's accuracy_reward. Each row: completion, gold, cohort's
# reward, TRL's reward, and why cohort's is the careful grader's verdict.
DIFFERENCES = [
    # TRL pays these wrong answers (false positives):
    (r"\boxed{0.0000001}", "0.0000003", 0.0, 1.0, "math-verify rounds both to 6 decimals: 0 = 0"),
    (r"\boxed{2 3}", "5", 0.0, 1.0, "math-verify reads '2 3' as 5"),
    (r"\boxed{18 \text{ thousand}}", "18", 0.0, 1.0, "'thousand' changes the value"),
    (r"\boxed{1800\%}", "18", 0.0, 1.0, "a percentage is not a count"),
    (r"\boxed{18 = 19}", "19", 0.0, 1.0, "a false equation is no answer"),
    (r"\boxed{5m}", "5", 0.0, 1.0, "5·m is not 5 (a unit must be a word or in \\text{})"),
    # TRL does not pay these right answers:
    ("18", "18", 1.0, 0.0, "a plain-text answer: TRL needs LaTeX ($…$ or a box)"),
    (r"First \boxed{5}. Wait, that is wrong: \boxed{6}.", "6", 1.0, 0.0, "the last box is the final answer"),
    (r"\boxed{\frac{1}{2}} is wrong, it is \boxed{\frac{1}{3}}", r"\frac{1}{3}", 1.0, 0.0, "the last box"),
    (r"\boxed{\sqrt{8}}", r"2\sqrt{2}", 1.0, 0.0, "TRL parses the gold bare and reads 2"),
    # TRL cannot read these gold answers (None); cohort reads them as LaTeX:
    (r"\boxed{\left(1,2\right)}", "(1,2)", 1.0, None, "TRL's gold parse finds no LaTeX anchor"),
]


@pytest.mark.parametrize("content, solution, cohort, trl, why", DIFFERENCES)
def test_accuracy_reward_where_cohort_differs_from_trl(content, solution, cohort, trl, why):
    assert accuracy_reward(completions=[msg(content)], solution=[solution]) == [cohort], why


# ----------------------------------------------------------------------- get_soft_overlong_punishment

def test_soft_overlong_punishment_docstring_example():
    soft_overlong_punishment = get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=20)
    completion_ids = [[1] * 90]  # 90 tokens lie between 80 and 100
    assert soft_overlong_punishment(completion_ids) == [-0.5]


@pytest.mark.parametrize("length, reward", [
    (0, 0.0), (50, 0.0), (80, 0.0),  # up to L_max - L_cache: no punishment
    (81, -0.05), (85, -0.25), (90, -0.5), (99, -0.95), (100, -1.0),  # linear inside the cache
    (101, -1.0), (500, -1.0),  # beyond L_max
])
def test_soft_overlong_punishment_values(length, reward):
    f = get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=20)
    assert f(completion_ids=[[7] * length]) == pytest.approx([reward])


def test_soft_overlong_punishment_batch_and_keyword_call():
    f = get_soft_overlong_punishment(max_completion_len=8, soft_punish_cache=2)
    ids = [[1] * n for n in (6, 7, 8, 9)]
    assert f(ids) == [0.0, -0.5, -1.0, -1.0]
    # the trainer passes everything by keyword
    by_keyword = f(prompts=["p"] * 4, completions=["c"] * 4, completion_ids=ids, solution=["s"] * 4)
    assert by_keyword == [0.0, -0.5, -1.0, -1.0]
    assert f(completion_ids=[]) == []


def test_soft_overlong_punishment_without_cache_is_a_hard_limit():
    f = get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=0)
    assert f([[1] * 9, [1] * 10, [1] * 11]) == [0.0, 0.0, -1.0]


def test_soft_overlong_punishment_matches_the_trainers_overlong_penalty():
    """One formula: the reward function gives what `--overlong_buffer_length` adds in the trainer."""
    import torch

    from cohort_grpo.algorithm.advantages import overlong_penalty

    lengths = list(range(0, 140, 3))
    f = get_soft_overlong_punishment(max_completion_len=128, soft_punish_cache=32)
    expected = overlong_penalty(torch.tensor(lengths), 128, 32).tolist()
    assert f([[0] * n for n in lengths]) == pytest.approx(expected)


def test_soft_overlong_punishment_is_picklable_and_named_like_trl():
    f = get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=20)
    assert f.__name__ == "soft_overlong_punishment_reward"  # the metric key TRL logs
    g = pickle.loads(pickle.dumps(f))
    assert g([[1] * 90]) == [-0.5]


def test_soft_overlong_punishment_through_the_runner():
    from cohort_grpo.rewards import RewardRunner

    runner = RewardRunner([get_soft_overlong_punishment(100, 20)], timeout_s=10.0, sample_workers=1)
    try:
        out = runner(["p"] * 2, ["a", "b"], [[1] * 50, [1] * 90], {})
    finally:
        runner.close()
    assert out.per_function[:, 0].tolist() == [0.0, -0.5]
    assert "rewards/soft_overlong_punishment_reward/mean" in out.metrics


@pytest.mark.parametrize("max_len, cache", [(10, 20), (10, -1)])
def test_soft_overlong_punishment_rejects_a_cache_outside_the_limit(max_len, cache):
    """cohort differs from TRL here: TRL computes a punishment for any cache; a cache longer than the
    limit punishes every completion, which cohort reports as a configuration error instead."""
    with pytest.raises(CohortError, match="soft_punish_cache"):
        get_soft_overlong_punishment(max_completion_len=max_len, soft_punish_cache=cache)
