"""RewardRunner (cohort_grpo/rewards/runner.py): weighting, None/NaN handling, fault isolation, time limits.
A function that raises is isolated only with errors="warn" (the default stops the run: test_reward_errors.py)."""

import math
import re
import time

import pytest
import torch

from cohort_grpo.errors import CohortError
from cohort_grpo.rewards.rules import accuracy_reward, format_reward
from cohort_grpo.rewards.runner import RewardRunner

torch.set_num_threads(1)

PROMPTS = ["p0", "p1", "p2", "p3"]
COMPLETIONS = ["a", "bb", "ccc", "dddd"]
IDS = [[1], [2, 2], [3, 3, 3], [4, 4, 4, 4]]


def notices(capsys) -> list[str]:
    """The runner's notices printed since the last call: one `cohort: ` line on stderr each."""
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("cohort: ")]


def one_notice(capsys, pattern: str) -> str:
    lines = notices(capsys)
    assert len(lines) == 1 and re.search(pattern, lines[0]), lines
    return lines[0]


def length_reward(prompts, completions, completion_ids=None, **_):
    return [float(len(c)) for c in completions]


def id_count_reward(prompts, completions, completion_ids, **_):
    return [float(len(ids)) for ids in completion_ids]


def odd_only_reward(prompts, completions, **_):
    return [1.0 if i % 2 else None for i in range(len(completions))]


def label_reward(prompts, completions, label, **_):
    return [float(x) for x in label]


def raising_reward(prompts, completions, **_):
    raise ValueError("boom")


def nan_reward(prompts, completions, **_):
    return [math.nan, 1.0, 2.0, 3.0][: len(completions)]


def hanging_reward(prompts, completions, **_):
    time.sleep(60)
    return [0.0] * len(completions)


def short_reward(prompts, completions, **_):
    return [1.0] * (len(completions) - 1)


def text_reward(prompts, completions, **_):
    return ["good"] * len(completions)


# A user's per-sample scoring module, written at test time so the worker processes import only it
# (not torch, which this test file imports), as they would import a user's own reward module.
MARKER_MODULE = """
import time

def score_marker(completion, solution):
    if "HANG" in completion:
        time.sleep(60)
    if "RAISE" in completion:
        raise RuntimeError("bad sample")
    return 1.0 if completion.strip() == str(solution) else 0.0

def marker_reward(prompts, completions, solution, **_):
    return [score_marker(c, s) for c, s in zip(completions, solution)]

marker_reward.score_sample = score_marker
"""


@pytest.fixture
def marker_reward(tmp_path, monkeypatch):
    import importlib

    (tmp_path / "cohort_test_marker_scoring.py").write_text(MARKER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module("cohort_test_marker_scoring").marker_reward


def test_weights_combine_and_metrics():
    runner = RewardRunner([length_reward, id_count_reward], reward_weights=[0.5, -2.0])
    out = runner(PROMPTS, COMPLETIONS, IDS, {})
    lengths = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert out.per_function.shape == (4, 2) and out.per_function.dtype == torch.float32
    assert torch.equal(out.per_function[:, 0], lengths)
    assert torch.equal(out.per_function[:, 1], lengths)
    assert torch.allclose(out.rewards, 0.5 * lengths - 2.0 * lengths)
    assert runner.names == ["length_reward", "id_count_reward"]
    assert out.metrics["rewards/length_reward/mean"] == pytest.approx(2.5)
    assert out.metrics["rewards/length_reward/std"] == pytest.approx(torch.tensor([1.0, 2, 3, 4]).std().item())
    assert out.metrics["reward"] == pytest.approx(out.rewards.mean().item())
    assert out.metrics["reward_std"] == pytest.approx(out.rewards.std().item())


def test_default_weights_are_one_and_names_unique():
    runner = RewardRunner([length_reward, length_reward, "format"])
    assert runner.names == ["length_reward", "length_reward_2", "format_reward"]
    out = runner(PROMPTS, COMPLETIONS, IDS, {})
    assert torch.equal(out.rewards, 2 * torch.tensor([1.0, 2.0, 3.0, 4.0]))


def test_none_is_nan_in_table_and_zero_in_sum():
    runner = RewardRunner([odd_only_reward, length_reward], reward_weights=[10.0, 1.0])
    out = runner(PROMPTS, COMPLETIONS, IDS, {})
    column = out.per_function[:, 0]
    assert torch.isnan(column[0]) and torch.isnan(column[2])
    assert column[1] == 1.0 and column[3] == 1.0
    assert torch.equal(out.rewards, torch.tensor([1.0, 12.0, 3.0, 14.0]))
    assert out.metrics["rewards/odd_only_reward/mean"] == 1.0  # over scored samples only
    assert out.metrics["rewards/odd_only_reward/std"] == 0.0


def test_columns_arrive_as_keywords():
    runner = RewardRunner([label_reward])
    out = runner(PROMPTS, COMPLETIONS, IDS, {"label": [3, 1, 4, 1], "unused": ["x"] * 4})
    assert torch.equal(out.rewards, torch.tensor([3.0, 1.0, 4.0, 1.0]))


def test_raising_function_gives_nan_warns_once_and_training_continues(capsys):
    runner = RewardRunner([raising_reward, length_reward], errors="warn")
    out = runner(PROMPTS, COMPLETIONS, IDS, {})
    one_notice(capsys, "raising_reward.*ValueError: boom")
    assert torch.isnan(out.per_function[:, 0]).all()
    assert torch.equal(out.rewards, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    runner(PROMPTS, COMPLETIONS, IDS, {})
    assert not notices(capsys)  # the same fault again: no second notice


def test_nan_return_is_treated_as_none_with_warning(capsys):
    runner = RewardRunner([nan_reward])
    out = runner(PROMPTS, COMPLETIONS, IDS, {})
    one_notice(capsys, "nan_reward.*nan.*sample 0")
    assert torch.isnan(out.per_function[0, 0])
    assert torch.equal(out.rewards, torch.tensor([0.0, 1.0, 2.0, 3.0]))


def test_hanging_function_is_abandoned_after_timeout(capsys):
    runner = RewardRunner([hanging_reward, length_reward], timeout_s=0.5)
    start = time.monotonic()
    out = runner(PROMPTS, COMPLETIONS, IDS, {})
    one_notice(capsys, "hanging_reward.*longer than 0.5s")
    assert time.monotonic() - start < 5
    assert torch.isnan(out.per_function[:, 0]).all()
    assert torch.equal(out.rewards, torch.tensor([1.0, 2.0, 3.0, 4.0]))


def test_per_sample_function_loses_only_the_pathological_samples(marker_reward, capsys):
    runner = RewardRunner([marker_reward], timeout_s=2.0, sample_workers=2, errors="warn")
    try:
        completions = ["5", "HANG", "6", "RAISE", "7"]
        runner(PROMPTS[:1], ["5"], None, {"solution": ["5"]})  # warm the workers up (imports)
        start = time.monotonic()
        notices(capsys)
        out = runner(None, completions, None, {"solution": ["5", "5", "5", "5", "7"]})
        elapsed = time.monotonic() - start
        messages = " | ".join(notices(capsys))
        column = out.per_function[:, 0]
        assert column[0] == 1.0 and column[2] == 0.0 and column[4] == 1.0
        assert torch.isnan(column[1]) and torch.isnan(column[3])
        assert "longer than 2s on one sample" in messages and "RuntimeError: bad sample" in messages
        assert elapsed < 15  # one timeout (2 s) plus a worker restart, not 60 s
        # the killed worker was replaced: the next batch is scored normally
        again = runner(None, ["7", "8"], None, {"solution": ["7", "7"]})
        assert again.per_function[:, 0].tolist() == [1.0, 0.0]
    finally:
        runner.close()


def test_accuracy_through_workers_matches_in_process():
    completions = ["<answer>1,000</answer>", "\\boxed{\\frac{1}{2}}", "it is 17", "<answer>$18.00</answer>"]
    solution = ["1000", "0.5", "18", "no gold"]
    runner = RewardRunner([accuracy_reward], timeout_s=10.0, sample_workers=1)
    try:
        out = runner(PROMPTS, completions, IDS, {"solution": solution})
    finally:
        runner.close()
    expected = [math.nan if v is None else v for v in accuracy_reward(None, completions, solution=solution)]
    assert expected[:3] == [1.0, 1.0, 0.0] and math.isnan(expected[3])
    got = out.per_function[:, 0].tolist()
    assert got[:3] == expected[:3] and math.isnan(got[3])


def test_wrong_length_is_an_error_naming_the_function():
    runner = RewardRunner([short_reward])
    with pytest.raises(CohortError, match=r"'short_reward' returned 3 values for 4 completions"):
        runner(PROMPTS, COMPLETIONS, IDS, {})


@pytest.mark.parametrize("returned, kind", [({"score": 1.0}, "dict"), ("1.00", "str"), ({1.0, 0.0}, "set")])
def test_a_mapping_a_string_or_a_set_is_not_read_as_a_list(returned, kind):
    """Each has a length (a string of 4 characters would pass for 4 scores) but no score per completion in order."""
    def returns_whole(prompts, completions, **_):
        return returned

    with pytest.raises(CohortError, match=rf"^reward 'returns_whole' returned a {kind}, not a list of floats; "):
        RewardRunner([returns_whole])(PROMPTS, COMPLETIONS, IDS, {})


def test_non_numeric_value_is_an_error():
    runner = RewardRunner([text_reward])
    with pytest.raises(CohortError, match=r"'text_reward' returned 'good'"):
        runner(PROMPTS, COMPLETIONS, IDS, {})


def test_missing_column_is_an_error_before_calling():
    calls = []

    def needs_solution(prompts, completions, solution, **_):
        calls.append(1)
        return [1.0] * len(completions)

    runner = RewardRunner([format_reward, needs_solution])
    with pytest.raises(CohortError, match=r"reward 'needs_solution' needs dataset column 'solution'; "
                                          r"the dataset has columns \['answer', 'question'\]"):
        runner(PROMPTS, COMPLETIONS, IDS, {"question": [""] * 4, "answer": [""] * 4})
    assert not calls
    with pytest.raises(CohortError, match="'accuracy_reward' needs dataset column 'solution'"):
        RewardRunner(["accuracy"]).check_columns(["prompt"])


def test_weight_count_mismatch_is_an_error():
    with pytest.raises(CohortError, match="2 reward weights for 1 reward functions"):
        RewardRunner([length_reward], reward_weights=[1.0, 2.0])
    with pytest.raises(CohortError, match="unknown reward 'nope'"):
        RewardRunner(["nope"])


# ------------------------------------------------------- end to end: faulty rewards in a training run

def nan_first_reward(prompts, completions, **_):
    return [math.nan] + [1.0] * (len(completions) - 1)


def short_hang_reward(prompts, completions, **_):
    time.sleep(30)
    return [0.0] * len(completions)


def test_training_goes_on_past_raising_nan_and_hanging_rewards(tiny_dir, tmp_path, capsys):
    from cohort_grpo import GRPOConfig, GRPOTrainer

    args = GRPOConfig(num_generations=2, per_device_train_batch_size=4, gradient_accumulation_steps=1,
                      max_completion_length=3, max_steps=2, learning_rate=1e-4, reward_timeout=0.5,
                      reward_errors="warn", output_dir=str(tmp_path), quiet=True, device="cpu")
    trainer = GRPOTrainer(tiny_dir, [raising_reward, nan_first_reward, short_hang_reward, length_reward],
                          [{"prompt": f"{i}+1=?"} for i in range(4)], args=args, log=lambda *_: None)
    trainer.train()
    history = trainer.history
    assert [r["step"] for r in history] == [1, 2]  # both steps ran
    messages = notices(capsys)
    for name, fault in (("raising_reward", "ValueError: boom"), ("nan_first_reward", "returned nan"),
                        ("short_hang_reward", "took longer than 0.5s")):
        hits = [m for m in messages if name in m and fault in m]
        assert len(hits) == 1, (name, messages)  # once per function and fault, over both steps
        if fault != "took longer than 0.5s":  # a batch that timed out has no one completion to blame
            assert re.search(r"sample \d+.* \('.*'\)", hits[0])  # names and quotes the offending completion
    for record in history:
        assert math.isnan(record["rewards/raising_reward/mean"]) and math.isnan(record["rewards/short_hang_reward/mean"])
        assert record["rewards/nan_first_reward/mean"] == 1.0  # the NaN sample left out, the rest scored
        assert math.isfinite(record["loss"]) and math.isfinite(record["reward"])


def test_wrong_length_stops_the_cli_run_with_one_line_naming_the_function(tiny_dir, tmp_path, monkeypatch, capsys):
    from cohort_grpo.cli import main

    (tmp_path / "cohort_test_short_reward.py").write_text(
        "def one_short(prompts, completions, **_):\n    return [1.0] * (len(completions) - 1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["train", "--model", tiny_dir, "--reward_funcs", "cohort_test_short_reward:one_short",
                 "--num_generations", "2", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
                 "--max_completion_length", "3", "--max_steps", "2", "--levels", "2", "--eval_limit", "0",
                 "--output_dir", str(tmp_path / "run"), "--quiet", "--device", "cpu"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "one_short" in err[0] and "returned 3 values for 4 completions" in err[0]
