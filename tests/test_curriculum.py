"""Curriculum: parsing (CLI and YAML), stage boundaries, and a real trainer run that switches prompts
and reward functions at the boundary and logs `curriculum/stage` and `informative`."""

import json

import pytest
import torch

from cohort_grpo import GRPOConfig, GRPOTrainer
from cohort_grpo.config.command_line import parse_config
from cohort_grpo.config.curriculum import parse_curriculum
from cohort_grpo.tasks.curriculum import Curriculum
from cohort_grpo.errors import CohortError
from cohort_grpo.tasks import get_task
from cohort_grpo.models.tiny import TINY_SPEC, build_model, build_tokenizer

torch.set_num_threads(1)


def test_compact_cli_form_and_yaml_agree(tmp_path):
    from_cli = parse_config(["--curriculum", "arithmetic:50,gsm8k:200"]).curriculum
    assert from_cli == [{"task": "arithmetic", "steps": 50}, {"task": "gsm8k", "steps": 200}]
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("curriculum:\n  - {task: arithmetic, steps: 50, levels: '1,2'}\n  - task: gsm8k\n    steps: 200\n")
    from_yaml = parse_config(["--config", str(yaml_file)]).curriculum
    assert from_yaml == [{"task": "arithmetic", "steps": 50, "levels": "1,2"}, {"task": "gsm8k", "steps": 200}]
    assert GRPOConfig().validate().curriculum is None


@pytest.mark.parametrize("raw, fragment", [
    ("arithmetic", "is not TASK:STEPS"),
    ("arithmetic:ten", "steps must be a positive whole number"),
    ("arithmetic:0", "steps must be a positive whole number"),
    ("arithmetic:2.5", "steps must be a positive whole number"),
    ("algebra:5", "unknown task 'algebra'"),
    ([{"task": "arithmetic"}], "needs 'task' and 'steps'"),
    ([{"task": "arithmetic", "steps": 3, "level": 2}], "unknown option(s) ['level']"),
    ({"task": "arithmetic"}, "must be a list of stages"),
])
def test_bad_curricula_are_one_line_errors(raw, fragment):
    with pytest.raises(CohortError) as error:
        parse_curriculum(raw)
    assert fragment in str(error.value) and "\n" not in str(error.value)


def test_stage_boundaries():
    curriculum = Curriculum([{"task": "arithmetic", "steps": 2}, {"task": "gsm8k", "steps": 3}], GRPOConfig())
    # steps 1-2 → stage 0, 3-5 → stage 1, and the last stage continues past its steps
    assert [curriculum.stage_at(s) for s in range(1, 9)] == [0, 0, 1, 1, 1, 1, 1, 1]


def test_the_held_out_rows_of_a_curriculum_run_are_its_last_stage_s_task():
    """`cohort-grpo train --curriculum arithmetic:2,calculator:3` (--task left at arithmetic): the held-out rows
    are the calculator's test problems, the task the curriculum leads to, said in one line."""
    from cohort_grpo.cli.train import task_rows

    args = parse_config(["--curriculum", "arithmetic:2,calculator:3", "--eval_limit", "7"])
    lines = []
    train, held_out = task_rows(get_task(args.task), args, log=lines.append)
    assert held_out == get_task("calculator").load("test", size=7, seed=args.seed)
    assert train == get_task("arithmetic").load("train", seed=args.seed, levels=args.levels)  # the run's rows as before
    assert lines == ["held-out evaluation on calculator, the curriculum's last stage (not --task arithmetic)"]


def test_a_last_stage_s_levels_are_those_of_the_held_out_rows(tmp_path):
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("curriculum:\n  - {task: calculator, steps: 2}\n  - {task: arithmetic, steps: 3, levels: '1'}\n")
    from cohort_grpo.cli.train import task_rows

    args = parse_config(["--config", str(yaml_file), "--eval_limit", "9"])
    lines = []
    _, held_out = task_rows(get_task(args.task), args, log=lines.append)
    assert held_out == get_task("arithmetic").load("test", levels="1", size=9, seed=args.seed)
    assert {row["level"] for row in held_out} == {1} and lines == []  # --task is the last stage's: no line


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_curriculum")
    tokenizer = build_tokenizer()
    build_model(tokenizer, seed=0, spec=dict(TINY_SPEC, max_position_embeddings=1024)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


class RecordingTrainer(GRPOTrainer):
    """Remembers each step's prompts and rewards, to check the logged metrics independently."""

    def next_prompts(self):
        rows = super().next_prompts()
        self.seen = getattr(self, "seen", []) + [(self.step, rows)]
        return rows

    def score(self, batch):
        super().score(batch)
        self.scored = getattr(self, "scored", []) + [(self.step, batch.rewards.clone())]


def _args(tmp_path, **overrides):
    base = dict(num_generations=4, per_device_train_batch_size=8, gradient_accumulation_steps=1,
                max_completion_length=6, max_prompt_length=1024, max_steps=4, learning_rate=1e-4,
                output_dir=str(tmp_path), quiet=True, seed=0, device="cpu")
    base.update(overrides)
    return GRPOConfig(**base)


@pytest.mark.slow
def test_trainer_switches_prompts_and_rewards_at_the_boundary(tiny_dir, tmp_path):
    data = tmp_path / "gsm.jsonl"
    data.write_text("".join(json.dumps({"question": f"Add {a} and {a}.", "answer": f"x\n#### {2 * a}"}) + "\n"
                            for a in range(6)))
    stages = [{"task": "arithmetic", "steps": 2, "levels": "2"}, {"task": "gsm8k", "steps": 2, "data_files": str(data)}]
    task = get_task("arithmetic")
    trainer = RecordingTrainer(tiny_dir, None, task.load("train", levels=[3], size=20), task=task,
                               args=_args(tmp_path / "run", curriculum=stages), log=lambda *_: None)
    trainer.train()
    for step, rows in trainer.seen:
        if step <= 2:
            assert all(r["level"] == 2 for r in rows)  # the stage's own levels, not the run's level 3
        else:
            assert all(r["question"].startswith("Add ") for r in rows)
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in metrics if "loss" in r}
    assert [steps[s]["curriculum/stage"] for s in (1, 2, 3, 4)] == [0, 0, 1, 1]
    for s in (1, 2):  # arithmetic's reward function only
        assert "rewards/answer_reward/mean" in steps[s] and "rewards/format_reward/mean" not in steps[s]
    for s in (3, 4):  # GSM8K's default mix
        assert {"rewards/format_reward/mean", "rewards/tag_count_reward/mean", "rewards/accuracy_reward/mean"} <= set(steps[s])
        assert "rewards/answer_reward/mean" not in steps[s]
    _check_informative(trainer, steps)


def _check_informative(trainer, steps) -> list[float]:
    """`informative` = fraction of groups whose rewards are not all equal, recomputed from the scored rewards."""
    values = []
    for step, rewards in trainer.scored:
        groups = rewards.view(-1, 4)
        expected = float((groups.max(dim=1).values != groups.min(dim=1).values).float().mean())
        assert steps[step]["informative"] == pytest.approx(expected)
        assert steps[step]["frac_reward_zero_std"] == pytest.approx(1 - expected)
        values.append(expected)
    return values


def test_the_trainer_scores_the_held_out_rows_with_the_last_stage_s_verifier(tiny_dir, tmp_path):
    """A curriculum ending on GSM8K, the run's task arithmetic: eval_dataset is scored by GSM8K's verifier."""
    stages = [{"task": "arithmetic", "steps": 1}, {"task": "gsm8k", "steps": 1}]
    task = get_task("arithmetic")
    rows = get_task("arithmetic").load("train", size=8)
    held_out = [{"prompt": "Add 2 and 2.", "question": "Add 2 and 2.", "solution": "4"}]
    trainer = GRPOTrainer(tiny_dir, None, rows, task=task, eval_dataset=held_out,
                          args=_args(tmp_path, curriculum=stages, max_steps=2), log=lambda *_: None)
    verifier = trainer.evaluation.task
    assert verifier.name == "gsm8k" and verifier.is_correct("<answer>\n4\n</answer>", held_out[0])
    trainer.close_logs()
    trainer.discard_unused_output_dir()
    trainer.parallel.close()


def first_char_is_digit(prompts, completions, **_):
    return [1.0 if c[:1].isdigit() else 0.0 for c in completions]


def test_explicit_reward_funcs_are_kept_for_every_stage(tiny_dir, tmp_path):
    stages = [{"task": "arithmetic", "steps": 1, "levels": "2"}, {"task": "arithmetic", "steps": 1, "levels": "4"}]
    trainer = RecordingTrainer(tiny_dir, first_char_is_digit, [{"prompt": "1+1=?"}],
                               args=_args(tmp_path, curriculum=stages, max_steps=3, max_completion_length=3), log=lambda *_: None)
    runner = trainer.rewards
    trainer.train()
    assert trainer.rewards is runner and trainer.rewards.names == ["first_char_is_digit"]
    assert [{r["level"] for r in rows} for _, rows in trainer.seen] == [{2}, {4}, {4}]
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    informative = _check_informative(trainer, {r["step"]: r for r in metrics if "loss" in r})
    assert any(0 < v for v in informative)  # a random policy's digit-or-not reward splits some groups


@pytest.mark.parametrize("max_steps, refused", [(4, True), (5, True), (6, False), (9, False)])
def test_a_stage_that_max_steps_never_reaches_is_refused(max_steps, refused):
    # stages 1-2 cover steps 1-5: the last stage starts at step 6, so max_steps below 6 would never train it
    stages = parse_curriculum("arithmetic:2,calculator:3,gsm8k:4")
    if not refused:
        assert GRPOConfig(curriculum=stages, max_steps=max_steps).curriculum == stages
        return
    with pytest.raises(CohortError) as error:
        GRPOConfig(curriculum=stages, max_steps=max_steps)
    message = str(error.value)
    assert "\n" not in message and f"max_steps={max_steps}" in message and "stage 3 (gsm8k)" in message
    assert "step 6" in message
