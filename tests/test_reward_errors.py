"""A reward function that raises (cohort_grpo/rewards/runner.py, `--reward_errors`): by default the run stops at
the first exception with one line naming the function and the exception's last line; with `warn` the
samples it failed on score None and `rewards/<name>/errors` counts them. A timeout is not an error."""

import json
import math
import re
import time

import pytest
import torch

from cohort_grpo import GRPOConfig, GRPOTrainer
from cohort_grpo.config.command_line import parse_config
from cohort_grpo.errors import CohortError
from cohort_grpo.rewards import sample_workers
from cohort_grpo.rewards.runner import RewardRunner
from cohort_grpo.rewards.user_calls import exception_line

torch.set_num_threads(1)

PROMPTS = ["p0", "p1", "p2", "p3"]
COMPLETIONS = ["a", "bb", "ccc", "dddd"]


def raising_reward(prompts, completions, **_):
    raise ValueError("boom")


def multiline_reward(prompts, completions, **_):
    raise RuntimeError("while parsing the answer\n  at column 3\nunbalanced brace")


def length_reward(prompts, completions, **_):
    return [float(len(c)) for c in completions]


def hanging_reward(prompts, completions, **_):
    time.sleep(30)
    return [0.0] * len(completions)


SCORING_MODULE = """
import time

def score_marker(completion, solution):
    if "HANG" in completion:
        time.sleep(60)
    if "RAISE" in completion:
        raise RuntimeError("bad sample\\nsecond line: the last one")
    return 1.0 if completion.strip() == str(solution) else 0.0

def marker_reward(prompts, completions, solution, **_):
    return [score_marker(c, s) for c, s in zip(completions, solution)]

marker_reward.score_sample = score_marker

def raiser(prompts, completions, **_):
    raise KeyError("solution")
"""


@pytest.fixture
def scoring_module(tmp_path, monkeypatch):
    import importlib

    (tmp_path / "cohort_test_reward_errors_mod.py").write_text(SCORING_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module("cohort_test_reward_errors_mod")


def quiet_call(runner, *args):
    return runner(*args)  # its notices go to stderr, which pytest captures


def notices(capsys) -> list[str]:
    """The runner's notices printed since the last call: one `cohort: ` line on stderr each."""
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("cohort: ")]


# ---- the runner ------------------------------------------------------------------------------------

def test_raise_is_the_default_and_names_the_function_and_the_exception_in_one_line():
    runner = RewardRunner([length_reward, raising_reward])
    assert runner.errors == "raise"
    with pytest.raises(CohortError) as caught:
        runner(PROMPTS, COMPLETIONS, None, {})
    message = str(caught.value)
    assert "\n" not in message
    assert "reward 'raising_reward' raised ValueError: boom" in message
    assert "on a batch of 4 completions" in message and "reward_errors='warn'" in message


def test_the_exception_is_cut_to_its_last_line():
    with pytest.raises(CohortError, match=r"raised RuntimeError: unbalanced brace on a batch") as caught:
        RewardRunner([multiline_reward])(PROMPTS, COMPLETIONS, None, {})
    assert "\n" not in str(caught.value) and "column 3" not in str(caught.value)
    assert exception_line("ValueError: first\nlast") == "ValueError: last"  # a worker's report
    assert exception_line(KeyError()) == "KeyError"


def test_warn_scores_none_and_counts_the_errors_of_every_call(capsys):
    runner = RewardRunner([raising_reward, length_reward], errors="warn")
    out = runner(PROMPTS, COMPLETIONS, None, {})
    [notice] = notices(capsys)
    assert re.search(r"raising_reward' raised ValueError: boom.*rewards/raising_reward/errors", notice), notice
    assert torch.isnan(out.per_function[:, 0]).all()
    assert torch.equal(out.rewards, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert out.metrics["rewards/raising_reward/errors"] == 4.0  # every sample of the batch
    assert out.metrics["rewards/length_reward/errors"] == 0.0
    again = runner(PROMPTS, COMPLETIONS, None, {})
    assert not notices(capsys)  # warned once; counted again
    assert again.metrics["rewards/raising_reward/errors"] == 4.0


def test_no_errors_metric_under_raise():
    out = RewardRunner([length_reward])(PROMPTS, COMPLETIONS, None, {})
    assert not [key for key in out.metrics if key.endswith("/errors")]


def test_a_timeout_is_not_an_error(capsys):
    runner = RewardRunner([hanging_reward, length_reward], timeout_s=0.5)  # errors="raise"
    out = runner(PROMPTS, COMPLETIONS, None, {})
    [notice] = notices(capsys)
    assert "hanging_reward" in notice and "longer than 0.5s" in notice
    assert torch.isnan(out.per_function[:, 0]).all()
    warn = RewardRunner([hanging_reward, length_reward], timeout_s=0.5, errors="warn")
    assert quiet_call(warn, PROMPTS, COMPLETIONS, None, {}).metrics["rewards/hanging_reward/errors"] == 0.0


def test_an_unknown_policy_is_refused():
    with pytest.raises(CohortError, match=r"reward_errors='ignore': choose raise .* or warn .*\(reward_errors\)"):
        RewardRunner([length_reward], errors="ignore")


@pytest.mark.slow
def test_per_sample_workers_follow_the_same_rule(scoring_module):
    completions, solution = ["5", "HANG", "6", "RAISE", "7"], {"solution": ["5", "5", "5", "5", "7"]}
    raising = RewardRunner([scoring_module.marker_reward], timeout_s=2.0, sample_workers=2)
    try:
        with pytest.raises(CohortError) as caught:
            quiet_call(raising, None, completions, None, solution)
        message = str(caught.value)
        assert "\n" not in message
        assert "reward 'marker_reward' raised RuntimeError: second line: the last one on sample 3 ('RAISE')" in message
        assert raising._pool.workers == []  # none left busy with the abandoned batch
        again = raising(None, ["7", "8"], None, {"solution": ["7", "7"]})  # fresh workers score the next one
        assert again.per_function[:, 0].tolist() == [1.0, 0.0]
    finally:
        raising.close()
    warn = RewardRunner([scoring_module.marker_reward], timeout_s=2.0, sample_workers=2, errors="warn")
    try:
        out = quiet_call(warn, None, completions, None, solution)
        column = out.per_function[:, 0]
        assert column[0] == 1.0 and column[2] == 0.0 and column[4] == 1.0
        assert torch.isnan(column[1]) and torch.isnan(column[3])
        assert out.metrics["rewards/marker_reward/errors"] == 1.0  # RAISE; HANG timed out, not an error
    finally:
        warn.close()


def test_in_process_fallback_follows_the_same_rule(scoring_module, monkeypatch):
    def no_workers(*_):
        raise OSError("cannot start python")

    monkeypatch.setattr(sample_workers, "WorkerProcess", no_workers)
    with pytest.raises(CohortError, match=r"'marker_reward' raised RuntimeError: second line: the last one on "
                                          r"sample 1"):
        quiet_call(RewardRunner([scoring_module.marker_reward]), None, ["5", "RAISE"], None, {"solution": ["5", "5"]})
    out = quiet_call(RewardRunner([scoring_module.marker_reward], errors="warn"), None, ["5", "RAISE"], None,
                     {"solution": ["5", "5"]})
    assert out.per_function[0, 0] == 1.0 and torch.isnan(out.per_function[1, 0])
    assert out.metrics["rewards/marker_reward/errors"] == 1.0


# ---- the option and a training run ---------------------------------------------------------------

def test_option_parses_and_defaults_to_raise():
    assert GRPOConfig().reward_errors == "raise"
    assert parse_config(["--reward_errors", "warn"]).reward_errors == "warn"


def small_args(tmp_path, **overrides) -> GRPOConfig:
    return GRPOConfig(num_generations=2, per_device_train_batch_size=4, gradient_accumulation_steps=1,
                      max_completion_length=3, max_steps=2, learning_rate=1e-4, output_dir=str(tmp_path / "run"),
                      quiet=True, device="cpu", **overrides)


def test_training_stops_at_the_first_step_by_default(tiny_dir, tmp_path):
    trainer = GRPOTrainer(tiny_dir, [raising_reward, length_reward], [{"prompt": f"{i}+1=?"} for i in range(4)],
                          args=small_args(tmp_path), log=lambda *_: None)
    with pytest.raises(CohortError, match="reward 'raising_reward' raised ValueError: boom"):
        trainer.train()
    assert trainer.history == []  # not one step recorded


def test_training_with_warn_goes_on_and_logs_the_error_counts(tiny_dir, tmp_path):
    trainer = GRPOTrainer(tiny_dir, [raising_reward, length_reward], [{"prompt": f"{i}+1=?"} for i in range(4)],
                          args=small_args(tmp_path, reward_errors="warn"), log=lambda *_: None)
    trainer.train()
    history = trainer.history
    assert [r["step"] for r in history] == [1, 2]
    for record in history:
        assert record["rewards/raising_reward/errors"] == 4.0 and record["rewards/length_reward/errors"] == 0.0
        assert math.isnan(record["rewards/raising_reward/mean"]) and math.isfinite(record["loss"])
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["rewards/raising_reward/errors"] for r in logged if "rewards/raising_reward/errors" in r] == [4.0, 4.0]


def cli_run(tiny_dir, tmp_path, *extra):
    return ["train", "--model", tiny_dir, "--reward_funcs", "cohort_test_reward_errors_mod:raiser",
            "--num_generations", "2", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
            "--max_completion_length", "3", "--max_steps", "2", "--levels", "2", "--eval_limit", "0",
            "--logging_steps", "1", "--quiet", "--device", "cpu", *extra]


def test_cli_stops_with_one_line_or_goes_on_with_warn(tiny_dir, tmp_path, scoring_module, capsys):
    from cohort_grpo.cli import main

    assert main(cli_run(tiny_dir, tmp_path, "--output_dir", str(tmp_path / "stopped"))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("cohort: error: reward 'raiser' raised KeyError: 'solution'"), err[0]
    assert main(cli_run(tiny_dir, tmp_path, "--reward_errors", "warn", "--output_dir", str(tmp_path / "warned"))) == 0
    logged = [json.loads(line) for line in (tmp_path / "warned" / "metrics.jsonl").read_text().splitlines()]
    assert [r["rewards/raiser/errors"] for r in logged if "rewards/raiser/errors" in r] == [4.0, 4.0]
