"""TRL's config values with TRL's meanings: a list `report_to`, `save_strategy` and `eval_strategy`, `warmup_ratio`
and fractions of the run for the step counts, settled into whole step counts once the run's length is known
(cohort_grpo/config/step_counts.py); every value cohort has no counterpart for refused by `GRPOConfig()` itself, in one
line; a re-run into a finished run's output_dir runs, as under TRL; bf16 on a CPU says what it costs.

The expected step counts are transformers' rules written out by hand: a fraction f of a run of N steps is
ceil(f × N) steps (`TrainerState.compute_steps`, `TrainingArguments.get_warmup_steps`), `eval_strategy="steps"`
without `eval_steps` evaluates every `logging_steps`, and an epoch is a pass over the training rows."""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from cohort_grpo import GRPOConfig, GRPOTrainer
from cohort_grpo.config.command_line import resolve_config
from cohort_grpo.config.step_counts import epoch_options, with_step_counts
from cohort_grpo.errors import CohortError
from cohort_grpo.optim.precision import cpu_precision_line
from cohort_grpo.run.lifecycle import RunLifecycle, TrainingInterrupted
from cohort_grpo.tasks import get_task

ACCEPTANCE = dict(report_to=["tensorboard"], save_strategy="no", eval_strategy="steps", eval_steps=5, warmup_ratio=0.1,
                  logging_steps=0.1)
SETTLED = ("logging_steps", "log_completions_steps", "save_strategy", "save_steps", "eval_strategy", "eval_steps",
           "warmup_steps", "warmup_ratio")


def settled(rows: int = 100, world_size: int = 1, **options) -> dict:
    config = with_step_counts(GRPOConfig(**options), rows, world_size)
    return {name: getattr(config, name) for name in ("max_steps", *SETTLED)}


# ---- the settled step counts --------------------------------------------------------------------

def test_the_acceptance_config_settles_to_trls_step_counts():
    assert settled(max_steps=20, **ACCEPTANCE) == dict(
        max_steps=20, logging_steps=2, log_completions_steps=10, save_strategy="no", save_steps=0,
        eval_strategy="steps", eval_steps=5, warmup_steps=2, warmup_ratio=0.0)


@pytest.mark.parametrize("options, expected", [
    # a fraction of the run rounds up: ceil(0.1 × 15) = 2, ceil(0.25 × 15) = 4, ceil(0.5 × 15) = 8
    (dict(max_steps=15, logging_steps=0.1, save_steps=0.25, eval_steps=0.5, eval_strategy="steps"),
     dict(logging_steps=2, save_steps=4, eval_steps=8, eval_strategy="steps")),
    # transformers: eval_strategy steps without eval_steps evaluates every logging_steps
    (dict(max_steps=30, logging_steps=3, eval_strategy="steps"), dict(eval_steps=3, eval_strategy="steps")),
    # cohort's default strategy: steps where eval_steps is set, else no evaluation during training
    (dict(max_steps=30, eval_steps=7), dict(eval_steps=7, eval_strategy="steps")),
    (dict(max_steps=30), dict(eval_steps=0, eval_strategy="no")),
    # transformers ignores the step counts of a strategy other than steps
    (dict(max_steps=30, eval_steps=7, eval_strategy="no", save_steps=5, save_strategy="no"),
     dict(eval_steps=0, eval_strategy="no", save_steps=0, save_strategy="no")),
    # warm-up: a fraction in warmup_steps (transformers 5), warmup_ratio where warmup_steps is 0 (transformers 4),
    # and warmup_steps winning over warmup_ratio where both are set, as in transformers 4
    (dict(max_steps=30, warmup_steps=0.2), dict(warmup_steps=6)),
    (dict(max_steps=30, warmup_ratio=0.05), dict(warmup_steps=2)),
    (dict(max_steps=30, warmup_ratio=1.0), dict(warmup_steps=30)),
    (dict(max_steps=30, warmup_ratio=0.5, warmup_steps=3), dict(warmup_steps=3, warmup_ratio=0.0)),
    # whole numbers written as floats (YAML's 10.0) are those steps
    (dict(max_steps=30, logging_steps=10.0, save_steps=1.0), dict(logging_steps=10, save_steps=1)),
    (dict(max_steps=30, log_completions=True, logging_steps=0.1), dict(log_completions_steps=3)),
])
def test_fractions_and_strategies_settle_as_transformers_counts_them(options, expected):
    result = settled(**options)
    assert {name: result[name] for name in expected} == expected
    assert all(isinstance(result[name], int) for name in ("logging_steps", "save_steps", "eval_steps", "warmup_steps"))


def test_an_epoch_is_a_pass_over_the_training_rows():
    # 25 rows, 2 prompts a step (4 completions of G = 2) on each of 2 ranks: ceil(25 / 4) = 7 steps an epoch
    shape = dict(num_generations=2, per_device_train_batch_size=4, gradient_accumulation_steps=1)
    result = settled(rows=25, world_size=2, save_strategy="epoch", eval_strategy="epoch", num_train_epochs=3, **shape)
    assert result["max_steps"] == 19  # ceil(3 × 25 / 4)
    assert (result["save_strategy"], result["save_steps"], result["eval_strategy"], result["eval_steps"]) == (
        "steps", 7, "steps", 7)
    assert settled(rows=25, max_steps=50, save_strategy="epoch", **shape)["save_steps"] == 13  # ceil(25 / 2)


def test_settling_twice_changes_nothing():
    once = with_step_counts(GRPOConfig(max_steps=20, **ACCEPTANCE), rows=40)
    assert with_step_counts(once, rows=40) == once


def test_the_environment_without_rows_refuses_what_counts_epochs():
    assert epoch_options(GRPOConfig()) == []
    assert epoch_options(GRPOConfig(save_strategy="epoch", num_train_epochs=2)) == [
        ("num_train_epochs=2", "set max_steps instead"), ("save_strategy='epoch'", "give save_steps instead")]


# ---- the command line and YAML take the same values ---------------------------------------------------

def test_the_command_line_and_yaml_take_fractions_strategies_and_lists(tmp_path):
    args, _ = resolve_config(["--logging_steps", "0.1", "--save_steps", "10", "--save_strategy", "no",
                              "--eval_strategy", "steps", "--warmup_ratio", "0.1", "--report_to", "tensorboard,wandb"])
    assert (args.logging_steps, args.save_steps, args.save_strategy, args.eval_strategy, args.warmup_ratio) == (
        0.1, 10, "no", "steps", 0.1)
    assert isinstance(args.save_steps, int) and args.report_to == "tensorboard,wandb"
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("report_to: [tensorboard]\nlogging_steps: 0.25\neval_steps: 5.0\nsave_strategy: no\n")
    args, _ = resolve_config(["--config", str(yaml_file)])
    assert (args.report_to, args.logging_steps, args.eval_steps, args.save_strategy) == (["tensorboard"], 0.25, 5, "no")


# ---- refused by GRPOConfig() itself, in one line ------------------------------------------------------

@pytest.mark.parametrize("options, message", [
    (dict(loss_type="cispo"), "loss_type='cispo' is TRL's cispo loss, which cohort does not have; pass grpo, bnpo, "
                              "dapo or dr_grpo (loss_type)"),
    (dict(loss_type="sapo"), "loss_type='sapo' is TRL's sapo loss, which cohort does not have; pass grpo, bnpo, "
                             "dapo or dr_grpo (loss_type)"),
    (dict(report_to="trackio"), "report_to='trackio' is not one of its values; pass none, tensorboard, wandb or "
                                "all, or several of them as a list or comma-separated (report_to)"),
    (dict(report_to=["wandb", "trackio"]), "report_to=['wandb', 'trackio']: 'trackio' is not one of its values; "
                                           "pass none, tensorboard, wandb or all, or several of them as a list or "
                                           "comma-separated (report_to)"),
    (dict(save_strategy="best"), "save_strategy='best' keeps the checkpoint of the best metric_for_best_model, "
                                 "which cohort does not track; pass steps, epoch or no (save_strategy)"),
    (dict(eval_strategy="always"), "eval_strategy='always' is not one of its values; pass steps, epoch or no "
                                   "(eval_strategy)"),
    (dict(logging_steps=2.5), "logging_steps=2.5 is neither a whole number of steps nor a fraction of max_steps in "
                              "(0, 1); pass a whole number or a fraction such as 0.1"),
    (dict(logging_steps=0), "logging_steps=0 is neither a whole number of steps nor a fraction of max_steps in "
                            "(0, 1); pass a whole number or a fraction such as 0.1"),
    (dict(save_steps=-0.5), "save_steps=-0.5 is neither a whole number of steps nor a fraction of max_steps in "
                            "(0, 1); pass a whole number (0: off) or a fraction such as 0.1"),
    (dict(warmup_ratio=1.5), "warmup_ratio=1.5 must lie in [0, 1]"),
    (dict(save_strategy="epoch", curriculum=[{"task": "arithmetic", "steps": 5}]),
     "save_strategy='epoch' with a curriculum: each stage counts its own steps and rows; give save_steps instead"),
])
def test_a_value_cohort_cannot_honour_is_refused_where_it_is_written(options, message):
    with pytest.raises(CohortError) as caught:
        GRPOConfig(**options)
    assert str(caught.value) == message


def test_every_loss_type_and_reporter_is_checked_at_construction():
    for loss_type in ("grpo", "bnpo", "dapo", "dr_grpo"):
        assert GRPOConfig(loss_type=loss_type).loss_type == loss_type
    for report_to in ("none", "all", "tensorboard", "wandb", "tensorboard,wandb", ["wandb"], ["tensorboard", "wandb"],
                      []):
        assert GRPOConfig(report_to=report_to).report_to == report_to
    for loss_type in ("cispo", "luspo", "vespo", "ppo"):
        with pytest.raises(CohortError, match=f"^loss_type='{loss_type}'"):
            GRPOConfig(loss_type=loss_type)
    config = GRPOConfig()
    config.loss_type = "cispo"  # set after construction: validate(), which every trainer calls, says it
    with pytest.raises(CohortError, match="^loss_type='cispo' is TRL's cispo loss"):
        config.validate()


# ---- a tiny run obeys them ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def arithmetic():
    task = get_task("arithmetic")
    return task, task.load("train", levels=[2], size=16), task.load("test", levels=[2], size=2)


def tiny_run(tiny_dir, arithmetic, out: Path, log=None, **options) -> GRPOTrainer:
    task, rows, held_out = arithmetic
    args = GRPOConfig(output_dir=str(out), num_generations=2, per_device_train_batch_size=4,
                      gradient_accumulation_steps=1, max_completion_length=4, learning_rate=1e-3, quiet=True, seed=0,
                      device="cpu", **options)
    return GRPOTrainer(tiny_dir, None, rows, args=args, eval_dataset=held_out, task=task,
                       log=log if log is not None else (lambda *_: None))


def test_a_tiny_run_obeys_trls_meanings(tiny_dir, arithmetic, tmp_path):
    torch.set_num_threads(1)
    trainer = tiny_run(tiny_dir, arithmetic, tmp_path / "run", max_steps=20, **ACCEPTANCE)
    assert {name: getattr(trainer.args, name) for name in SETTLED} == dict(
        logging_steps=2, log_completions_steps=10, save_strategy="no", save_steps=0, eval_strategy="steps",
        eval_steps=5, warmup_steps=2, warmup_ratio=0.0)
    base = 1e-3  # transformers' linear warm-up over 2 steps: from 0 at step 1's update, half the rate at step 2's
    assert trainer.scheduler.get_last_lr() == pytest.approx([0.0])
    trainer.train()
    history = trainer.history
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "loss" in r] == list(range(2, 21, 2))  # every ceil(0.1 × 20) steps
    assert [r["step"] for r in lines if "eval/accuracy" in r] == [0, 5, 10, 15, 20]  # before, every 5, after
    assert not list((tmp_path / "run").glob("checkpoint-*"))  # save_strategy no: not even after the last step
    assert (tmp_path / "run" / "model.safetensors").is_file()  # the trained policy, as trainer.save_model() writes
    assert list((tmp_path / "run" / "tensorboard").iterdir())  # report_to, a list
    assert [r["learning_rate"] for r in history] == pytest.approx([base / 2] + [base] * 19)  # the next update's


def test_a_stop_still_saves_with_save_strategy_no(tmp_path):
    saved = []
    args = SimpleNamespace(save_strategy="no", save_steps=0, max_steps=3, max_consecutive_nonfinite=5,
                           output_dir=str(tmp_path))
    parallel = SimpleNamespace(world_size=1)

    def save():
        saved.append(True)
        return tmp_path / f"checkpoint-{len(saved)}"

    run = RunLifecycle(args, parallel, log=lambda *_: None, save=save, close_logs=lambda: None)
    run.end_of_step(3, nonfinite_in_a_row=0)  # the last step: no checkpoint
    assert saved == []
    run.stop.signum = 2  # Ctrl-C during the step: the run is saved before it stops
    with pytest.raises(TrainingInterrupted):
        run.end_of_step(2, nonfinite_in_a_row=0)
    assert saved == [True]
    steps_args = copy.copy(args)
    steps_args.save_strategy = "steps"
    RunLifecycle(steps_args, parallel, log=lambda *_: None, save=save, close_logs=lambda: None).end_of_step(3, 0)
    assert len(saved) == 2  # save_strategy steps: after the last step


# ---- a re-run into the same output_dir -------------------------------------------------------------------

def test_a_script_run_twice_runs_twice_and_an_unfinished_run_is_kept(tiny_dir, arithmetic, tmp_path):
    torch.set_num_threads(1)
    out = tmp_path / "run"
    tiny_run(tiny_dir, arithmetic, out, max_steps=2, save_steps=1, eval_limit=0).train()
    first = (out / "metrics.jsonl").read_text()
    logged = []
    tiny_run(tiny_dir, arithmetic, out, max_steps=2, save_steps=1, eval_limit=0, log=logged.append).train()
    assert any(re.search(r"holds a finished run \(newest: checkpoint-2\): a new run replaces it", str(line))
               for line in logged), logged
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "loss" in r] == [1, 2]
    assert (out / "metrics.jsonl").read_text().count("\n") == first.count("\n")  # one run's lines, not two
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]

    shutil.rmtree(out / "checkpoint-2")  # as a run stopped after step 1 leaves its folder
    with pytest.raises(CohortError) as caught:
        tiny_run(tiny_dir, arithmetic, out, max_steps=2, save_steps=1, eval_limit=0).train()
    assert str(caught.value) == (f"output_dir {str(out)!r} holds an unfinished run (newest: checkpoint-1); pass "
                                 "resume=True to continue it, overwrite_output_dir=True to start over (deleting its "
                                 "checkpoints), or choose another output_dir")
    resumed = tiny_run(tiny_dir, arithmetic, out, max_steps=2, save_steps=1, eval_limit=0, resume=True)
    resumed.train()
    assert [r["step"] for r in resumed.history] == [1, 2]


# ---- bf16 on a CPU -----------------------------------------------------------------------------------------

def test_bf16_on_a_cpu_says_what_it_costs(tiny_dir, arithmetic, tmp_path):
    line = cpu_precision_line("bfloat16", torch.device("cpu"))
    assert line == ("dtype: bfloat16 on a CPU, where PyTorch's bfloat16 kernels are mostly slower than its float32 "
                    "ones; pass dtype='float32' (TRL's keywords: bf16=False) for speed")
    assert cpu_precision_line("float32", torch.device("cpu")) is None
    assert cpu_precision_line("bfloat16", torch.device("cuda")) is None
    logged = []
    trainer = tiny_run(tiny_dir, arithmetic, tmp_path / "bf16", log=logged.append, bf16=True, max_steps=1)
    assert trainer.args.dtype == "bfloat16"  # asked for: kept
    assert line in [str(entry) for entry in logged]
    logged.clear()
    tiny_run(tiny_dir, arithmetic, tmp_path / "auto", log=logged.append, max_steps=1)
    assert not any("on a CPU" in str(entry) for entry in logged)
