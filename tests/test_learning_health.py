"""The step log's learning-health checks (cohort_grpo/telemetry/health.py) and what the step line's success column
counts (cohort_grpo/telemetry/step_report.py): each check fires once, at the step that completes its run of bad
steps, on made-up step records; it stays silent on a healthy run and on runs of bad steps that are broken
off; a short training on the tiny model whose reward never varies says so exactly once."""

from __future__ import annotations

import json

import math

import pytest
import torch

from cohort_grpo import GRPOConfig, GRPOTrainer
from cohort_grpo.rollout.batch import Batch
from cohort_grpo.rollout.sampler import Rollout
from cohort_grpo.telemetry.health import CLIP_LIMIT, KL_LIMIT, MOST, WINDOW, HealthOptions, LearningHealth
from cohort_grpo.telemetry.metrics import MetricsLogger, read_completions, read_metrics
from cohort_grpo.telemetry.report import build_report
from cohort_grpo.telemetry.step_report import empty_ratio, rewarded_rate, success_measure

SAMPLES = 16  # completions per rank per step in the made-up records


def healthy(step: int) -> dict:
    """A step record of a run that learns: each number well inside every check's bound."""
    return {"step": step, "reward": 0.4 + 0.001 * step, "frac_reward_zero_std": 0.25, "completions/empty_ratio": 0.0,
            "completions/clipped_ratio": 0.1, "rewards/accuracy_reward/errors": 1.0, "tools/failure_frequency": 0.2,
            "tools/call_frequency": 1.5, "kl": 0.03, "clip_ratio/region_mean": 0.05}


def feed(health: LearningHealth, records: list[dict]) -> dict[int, list[str]]:
    """The warnings of each step that gave any."""
    given = {}
    for record in records:
        lines = health.observe(record)
        if lines:
            given[record["step"]] = lines
    return given


def run_of(bad: dict, bad_steps: set[int], steps: int = 40) -> list[dict]:
    """Healthy records, with `bad`'s values at `bad_steps`."""
    return [{**healthy(s), **(bad if s in bad_steps else {})} for s in range(1, steps + 1)]


def first_full_window(bad_steps: set[int], steps: int = 40) -> int | None:
    """The step that completes the first run of WINDOW consecutive bad steps (counted here, apart from the code)."""
    count = 0
    for step in range(1, steps + 1):
        count = count + 1 if step in bad_steps else 0
        if count == WINDOW:
            return step
    return None


PROBLEMS = {  # check → (the values that show it, words its line must hold: what was seen, the option to change)
    "empty": ({"completions/empty_ratio": 1.0, "frac_reward_zero_std": 1.0}, ("every completion was empty",)),
    "clipped": ({"completions/clipped_ratio": 1.0}, ("max_completion_length=64", "--max_completion_length (now 64)")),
    "equal_rewards": ({"frac_reward_zero_std": 1.0, "reward": 0.0},
                      ("rewards were equal", "reward 0.000 at every step", "--num_generations (now 4)")),
    "reward_errors": ({"rewards/accuracy_reward/errors": 16.0}, ("'accuracy_reward' raised on 100%", "--reward_errors")),
    "unscored": ({"rewards/unscored_frac": 1.0, "frac_reward_zero_std": 1.0, "reward": 0.0},
                 ("no reward function scored any completion", "None or NaN", "--reward_timeout (now 10 s)")),
    "tool_failures": ({"tools/failure_frequency": 1.0}, ("most tool calls failed", "1.00 at every step",
                                                         "--tool_timeout (now 5 s)")),
    "kl": ({"kl": 2.5}, ("above 1 nat per token", "kl 2.500 at every step", "beta=0.04", "--beta")),
    "clip": ({"clip_ratio/region_mean": 0.8}, ("clip_ratio/region_mean 0.80", "--num_iterations (now 2)",
                                                "--epsilon (now 0.2)")),
}
OPTIONS = HealthOptions(max_completion_length=64, num_generations=4, beta=0.04, num_iterations=2, tool_timeout=5.0,
                        reward_timeout=10.0, generation_batch_size=SAMPLES)


def test_a_healthy_run_gets_no_warning():
    health = LearningHealth(OPTIONS)
    assert feed(health, [healthy(s) for s in range(1, 201)]) == {}
    assert health.lines == []


@pytest.mark.parametrize("check", sorted(PROBLEMS))
def test_each_check_fires_once_at_the_step_that_completes_its_window(check):
    bad, words = PROBLEMS[check]
    bad_steps = set(range(3, 41))  # the problem from step 3 to the end
    health = LearningHealth(OPTIONS)
    given = feed(health, run_of(bad, bad_steps))
    assert list(given) == [first_full_window(bad_steps)] == [3 + WINDOW - 1]
    [line] = given[first_full_window(bad_steps)]
    assert line.startswith("warning: ") and "\n" not in line
    assert f"{WINDOW} steps in a row (steps 3-{3 + WINDOW - 1}" in line
    for word in words:
        assert word in line, (word, line)
    assert health.lines == [line]


@pytest.mark.parametrize("check", sorted(PROBLEMS))
def test_a_run_of_bad_steps_broken_off_starts_again(check):
    bad, _ = PROBLEMS[check]
    bad_steps = set(range(1, WINDOW)) | set(range(WINDOW + 1, 2 * WINDOW)) | set(range(25, 25 + WINDOW))
    given = feed(LearningHealth(OPTIONS), run_of(bad, bad_steps))
    assert list(given) == [first_full_window(bad_steps)] == [25 + WINDOW - 1]


def test_a_step_that_does_not_log_the_metric_ends_the_run_of_steps():
    records = [{**healthy(s), "kl": 3.0} for s in range(1, 31)]
    del records[WINDOW - 2]["kl"]  # step WINDOW - 1: no KL (e.g. a record without it)
    given = feed(LearningHealth(OPTIONS), records)
    assert list(given) == [2 * WINDOW - 1]


def test_the_bounds_are_strict():
    """At the bound itself nothing fires: "most" is more than half, "above" is above."""
    at_bound = {"rewards/accuracy_reward/errors": MOST * SAMPLES, "tools/failure_frequency": MOST,
                "kl": KL_LIMIT, "clip_ratio/region_mean": CLIP_LIMIT, "completions/empty_ratio": 0.99,
                "completions/clipped_ratio": 0.99, "frac_reward_zero_std": 0.99}
    assert feed(LearningHealth(OPTIONS), run_of(at_bound, set(range(1, 41)))) == {}


def test_empty_completions_are_named_as_the_cause_not_the_equal_rewards_they_make():
    """Every completion empty makes every group's rewards equal: one warning, about the empty completions."""
    bad, _ = PROBLEMS["empty"]
    given = feed(LearningHealth(OPTIONS), run_of(bad, set(range(1, 65)), steps=64))
    assert [line.split(" for ")[0] for lines in given.values() for line in lines] == [
        "warning: every completion was empty"]


def test_rewards_no_function_scored_are_named_as_the_cause_not_as_equal_rewards():
    """Every reward None or NaN leaves every group without a spread (its advantages 0): one warning, about the
    scoring."""
    bad, _ = PROBLEMS["unscored"]
    given = feed(LearningHealth(OPTIONS), run_of(bad, set(range(1, 65)), steps=64))
    assert [line.split(" for ")[0] for lines in given.values() for line in lines] == [
        "warning: no reward function scored any completion"]


def test_a_ported_environment_run_with_reward_and_gradient_zero_for_44_steps_is_told_once():
    records = [{"step": s, "reward": 0.0, "frac_reward_zero_std": 1.0, "grad_norm": 0.0, "loss": 0.0,
                "completions/empty_ratio": 0.0, "completions/clipped_ratio": 0.0} for s in range(1, 45)]
    given = feed(LearningHealth(OPTIONS), records)
    assert list(given) == [WINDOW] and "rewards were equal" in given[WINDOW][0]


def test_a_reward_function_failing_on_most_samples_is_named_and_each_function_told_once():
    records = [{**healthy(s), "rewards/accuracy_reward/errors": 9.0, "rewards/format_reward/errors": 16.0}
               for s in range(1, 31)]  # 9 of 16 (most) and 16 of 16
    given = feed(LearningHealth(OPTIONS), records)
    assert list(given) == [WINDOW]
    assert sorted(line.split(" raised on ")[0] for line in given[WINDOW]) == [
        "warning: reward 'accuracy_reward'", "warning: reward 'format_reward'"]
    assert any(f"raised on {round(100 * 9 / 16)}% or more" in line for line in given[WINDOW])
    half = [{**healthy(s), "rewards/accuracy_reward/errors": 8.0} for s in range(1, 31)]  # half is not most
    assert feed(LearningHealth(OPTIONS), half) == {}


def test_the_tools_failing_with_no_calls_made_is_not_a_failure():
    records = [{**healthy(s), "tools/failure_frequency": 1.0, "tools/call_frequency": 0.0} for s in range(1, 31)]
    assert feed(LearningHealth(OPTIONS), records) == {}


def test_the_advice_quotes_the_run_s_settings():
    args = GRPOConfig(max_completion_length=48, num_generations=6, per_device_train_batch_size=12, temperature=0.7,
                      learning_rate=3e-6, num_iterations=3, epsilon=0.1, beta=0.02, tool_timeout=12.0)
    options = HealthOptions.from_config(args)
    assert options == HealthOptions(48, 6, 0.7, 0.02, 3e-6, 3, 0.1, 12.0, generation_batch_size=12 * 4)  # × accumulation
    health = LearningHealth.from_config(args)
    lines = [line for lines in feed(health, run_of({"clip_ratio/region_mean": 0.9, "kl": 5.0},
                                                   set(range(1, 41)))).values() for line in lines]
    assert any("beta=0.02" in line and "--learning_rate (now 3e-06)" in line for line in lines)
    assert any("--num_iterations (now 3)" in line and "--epsilon (now 0.1)" in line for line in lines)


def test_a_live_step_and_its_replay_on_resume_count_reward_errors_out_of_the_same_completions(tmp_path):
    """Steps that train on fewer rows than a reward call scored (dynamic sampling kept 8 of the 16 completions):
    6 errors are 6 of the call's 16, not most — live (`StepReport.record`) and replayed from a checkpoint's records
    (`StepReport.resumed`) alike; 9 errors are most, in both."""
    import os

    from cohort_grpo.models.tiny import build_model, build_tokenizer
    from cohort_grpo.parallel.distributed import Parallel, SilentMetrics
    from cohort_grpo.rollout.layout import Layout
    from cohort_grpo.telemetry.progress import Progress
    from cohort_grpo.telemetry.step_report import StepContext, StepReport

    args = GRPOConfig(num_generations=4, per_device_train_batch_size=16, gradient_accumulation_steps=1,
                      max_steps=2 * WINDOW, logging_steps=1, output_dir=str(tmp_path), device="cpu").validate()
    model = build_model(build_tokenizer(), seed=0)

    def report(lines: list) -> StepReport:
        with open(os.devnull, "w") as devnull:
            return StepReport(args, model=model, device=torch.device("cpu"), parallel=Parallel(),
                              metrics=SilentMetrics(), progress=Progress(0, True, devnull), log=lines.append)

    context = StepContext(success=None, learning_rate=1e-6, uses_reference=False, micro_rows=8,
                          layout=Layout.choose(False, 4), reward_names=["f"])
    for errors, warned in ((6.0, False), (9.0, True)):
        live = report([])
        for step in range(1, WINDOW + 1):
            batch = batch_of(["12"] * 8, [0.0, 1.0] * 4, [[0.0], [1.0]] * 4)  # 2 informative groups of 4
            batch.advantages, batch.reward_metrics = torch.zeros(8), {"rewards/f/errors": errors}
            live.record(step, batch, [{"loss": 0.0}], 1.0, context)
        assert bool(live.health.lines) == warned, live.health.lines
        replayed = report([])
        replayed.resumed(live.history)
        assert replayed.health.lines == live.health.lines


# ---- what the success column counts ------------------------------------------------------------------------


def batch_of(completions: list, rewards: list[float], per_function: list[list[float]]) -> Batch:
    n = len(completions)
    rollout = Rollout(completion_ids=torch.ones(n, 2, dtype=torch.long), completion_mask=torch.ones(n, 2),
                      logprobs=None, finish_reasons=["stop"] * n)
    batch = Batch(rows=[{"prompt": "p"}] * n, prompt_ids=[[1]] * n, rollout=rollout, completions=completions)
    batch.rewards, batch.per_function = torch.tensor(rewards), torch.tensor(per_function)
    return batch


def test_success_is_the_verifier_else_the_accuracy_reward_else_called_reward_above_zero():
    assert success_measure(True, ["format_reward"]).label == "Success"
    assert "verifier" in success_measure(True, ["format_reward"]).meaning
    assert success_measure(False, ["format_reward", "accuracy_reward"]).label == "Success"
    assert "accuracy_reward" in success_measure(False, ["format_reward", "accuracy_reward"]).meaning
    assert success_measure(False, ["format_reward"]).label == "Reward>0"


def test_the_accuracy_reward_counts_success_where_a_format_reward_makes_every_reward_positive():
    nan = math.nan
    per_function = [[0.1, 1.0], [0.1, 0.0], [0.1, nan], [0.1, 0.0], [0.1, 1.0]]  # format, accuracy
    batch = batch_of(["a"] * 5, [0.1 + (a if a == a else 0.0) for _, a in per_function], per_function)
    assert rewarded_rate(batch, ["format_reward", "accuracy_reward"]) == pytest.approx(2 / 4)  # of those scored
    assert rewarded_rate(batch, ["format_reward", "other"]) == 1.0  # no accuracy reward: every reward is > 0
    unscored = batch_of(["a"] * 2, [0.1, 0.1], [[0.1, nan], [0.1, nan]])
    assert rewarded_rate(unscored, ["format_reward", "accuracy_reward"]) == 0.0


def test_empty_ratio_counts_completions_with_no_text():
    batch = batch_of(["", " \n", "12", [{"role": "assistant", "content": ""}]], [0.0] * 4, [[0.0]] * 4)
    assert empty_ratio(batch) == 0.75


# ---- the metrics file and the report --------------------------------------------------------------------


def test_the_report_lists_the_warnings_of_metrics_jsonl(tmp_path):
    line = "warning: every completion was empty for 10 steps in a row (steps 1-10): <check> the prompt"
    with MetricsLogger(tmp_path) as logger:
        for step in range(1, 4):
            logger.log(step, {"reward": 0.0, **({"warnings": [line]} if step == 2 else {})})
    assert [r.get("warnings") for r in read_metrics(tmp_path)] == [None, [line], None]
    page = build_report([tmp_path]).read_text(encoding="utf-8")
    assert "<h2>Warnings</h2>" in page and "step 2: warning: every completion was empty" in page
    assert "&lt;check&gt; the prompt" in page  # escaped


# ---- end to end, on the tiny model -------------------------------------------------------------------


def zero_reward(completions, **_):
    return [0.0] * len(completions)


def format_reward(completions, **_):  # every completion gets it: reward > 0 everywhere
    return [0.1] * len(completions)


def accuracy_reward(completions, **_):
    return [1.0 if c[:1].isdigit() else 0.0 for c in completions]


def tiny_args(tmp_path, **overrides) -> GRPOConfig:
    base = dict(num_generations=2, per_device_train_batch_size=4, max_completion_length=4, max_steps=WINDOW + 2,
                learning_rate=1e-3, output_dir=str(tmp_path), quiet=True, seed=0, beta=0.0, log_completions_steps=1,
                gradient_accumulation_steps=1)
    return GRPOConfig(**{**base, **overrides})


PROMPTS = [{"prompt": f"{a}+{b}="} for a in range(1, 5) for b in range(1, 3)]


def test_a_constant_reward_on_the_tiny_model_prints_the_no_gradient_warning_once(tiny_dir, tmp_path, capsys):
    lines = []
    GRPOTrainer(tiny_dir, zero_reward, PROMPTS, args=tiny_args(tmp_path), log=lines.append).train()
    warnings = [line for line in lines if line.startswith("warning:")]
    assert len(warnings) == 1 and "every group's rewards were equal" in warnings[0]
    assert f"(steps 1-{WINDOW}, reward 0.000 at every step)" in warnings[0]
    legend = [line for line in lines if line.startswith("Legend:")]
    assert len(legend) == 1 and "Reward>0 = share of the step's completions whose total reward is above 0" in legend[0]
    steps = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Step ")]
    assert len(steps) == WINDOW + 2 and all(", Reward>0=0.00%, " in line for line in steps)
    logged = {r["step"]: r for r in read_metrics(tmp_path) if "reward" in r}
    assert [step for step, r in logged.items() if "warnings" in r] == [WINDOW]
    assert logged[WINDOW]["warnings"] == warnings
    assert all(r["frac_reward_zero_std"] == 1.0 and r["completions/empty_ratio"] < 1.0 for r in logged.values())
    assert json.loads((tmp_path / "summary.json").read_text())["warnings"] == warnings  # the run's, each once


def test_a_healthy_run_has_no_warnings_in_its_summary(tiny_dir, tmp_path):
    lines = []
    GRPOTrainer(tiny_dir, [format_reward, accuracy_reward], PROMPTS, args=tiny_args(tmp_path, max_steps=2),
                log=lines.append).train()
    assert not [line for line in lines if line.startswith("warning:")]
    assert json.loads((tmp_path / "summary.json").read_text())["warnings"] == []


def test_a_warning_given_at_a_step_not_logged_goes_on_the_next_line_written(tiny_dir, tmp_path):
    lines = []
    args = tiny_args(tmp_path, logging_steps=4)  # lines at steps 4, 8, 12: the warning of step 10 goes on 12's
    GRPOTrainer(tiny_dir, zero_reward, PROMPTS, args=args, log=lines.append).train()
    logged = [r for r in read_metrics(tmp_path) if "reward" in r]
    assert [r["step"] for r in logged] == [4, 8, 12]
    assert [r.get("warnings") for r in logged] == [None, None, [line for line in lines if line.startswith("warning:")]]


def test_success_counts_the_accuracy_reward_not_the_format_reward(tiny_dir, tmp_path, capsys):
    """A 0.1 format reward makes every total reward positive; `success` is the accuracy reward's rate."""
    args = tiny_args(tmp_path, max_steps=3, num_generations=4, per_device_train_batch_size=8)
    lines = []
    GRPOTrainer(tiny_dir, [format_reward, accuracy_reward], PROMPTS, args=args, log=lines.append).train()
    completions = read_completions(tmp_path)  # all 8 of each step (log_completions_steps=1)
    for record in (r for r in read_metrics(tmp_path) if "reward" in r):
        rows = [c for c in completions if c["step"] == record["step"]]
        assert len(rows) == 8
        assert record["success"] == pytest.approx(sum(c["rewards"]["accuracy_reward"] > 0 for c in rows) / 8)
    shown = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Step ")]
    assert len(shown) == 3 and all(", Success=" in line for line in shown)
    assert any(line.startswith("Legend:") and "accuracy_reward scores above 0" in line for line in lines)


class FailsAt:
    """A callback that raises at the start of step `step` (the run keeps the step before: run/failure.py)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_begin(self, args, state, control, **_):
        if state.global_step + 1 == self.step:
            raise KeyError("stopped")


@pytest.mark.parametrize("stopped_after", [WINDOW - 4, WINDOW + 1])
def test_a_resumed_run_warns_as_the_uninterrupted_one(tiny_dir, tmp_path, stopped_after):
    """The checks go on from where the checkpoint's steps left them: a run stopped inside the window warns at the
    same step, one stopped after the warning (given at a step metrics.jsonl did not log) does not warn again and
    still writes it on the next logged line."""
    every_third = dict(logging_steps=3, save_steps=0)
    GRPOTrainer(tiny_dir, zero_reward, PROMPTS, args=tiny_args(tmp_path / "whole", **every_third)).train()
    with pytest.raises(KeyError):
        GRPOTrainer(tiny_dir, zero_reward, PROMPTS, args=tiny_args(tmp_path / "run", **every_third),
                    callbacks=[FailsAt(stopped_after + 1)]).train()
    lines = []
    GRPOTrainer(tiny_dir, zero_reward, PROMPTS, log=lines.append,
                args=tiny_args(tmp_path / "run", **every_third, resume=True)).train()
    whole = {r["step"]: r.get("warnings") for r in read_metrics(tmp_path / "whole") if "reward" in r}
    resumed = {r["step"]: r.get("warnings") for r in read_metrics(tmp_path / "run") if "reward" in r}
    assert resumed == whole and any(whole.values())
    told = [line for line in lines if line.startswith("warning:")]
    assert len(told) == (stopped_after < WINDOW)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())["warnings"]
    assert summary == json.loads((tmp_path / "whole" / "summary.json").read_text())["warnings"]
