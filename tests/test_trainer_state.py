"""transformers' TrainerState and TrainerCallback on GRPOTrainer, `evaluate()`, `save_model()`, a
failed run's folder, and summary.json's time across resumes."""

import json

import pytest
import torch
from transformers import TrainerCallback

from cohort_grpo import GRPOConfig, GRPOTrainer
from cohort_grpo.errors import CohortError
from cohort_grpo.tasks.arithmetic import ArithmeticTask
from helpers import UPDATE_PROMPTS

TASK = ArithmeticTask()


def _args(tmp_path, **overrides):
    base = dict(num_generations=4, per_device_train_batch_size=8, max_completion_length=4, max_steps=3,
                output_dir=str(tmp_path), quiet=True, save_steps=0, learning_rate=1e-3)
    base.update(overrides)
    return GRPOConfig(**base)


def _length(completions, **_):
    return [float(len(c)) for c in completions]


class Recorder(TrainerCallback):
    def __init__(self):
        self.events = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.events.append(("train_begin", state.global_step, sorted(kwargs)))

    def on_step_begin(self, args, state, control, **kwargs):
        self.events.append(("step_begin", state.global_step))

    def on_step_end(self, args, state, control, **kwargs):
        self.events.append(("step_end", state.global_step))

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.events.append(("log", logs["step"], "loss" in logs))

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.events.append(("evaluate", state.global_step, round(metrics["eval/accuracy"], 6)))

    def on_save(self, args, state, control, **kwargs):
        self.events.append(("save", state.global_step))

    def on_train_end(self, args, state, control, **kwargs):
        self.events.append(("train_end", state.global_step))


def test_callbacks_see_every_event_in_order_and_state_tracks_the_run(tiny_dir, tmp_path):
    recorder = Recorder()
    eval_rows = TASK.load("test", size=4)
    trainer = GRPOTrainer(tiny_dir, _length, TASK.load("train", size=32, seed=0), args=_args(tmp_path, eval_steps=2),
                          task=TASK, eval_dataset=eval_rows, callbacks=[recorder])
    trainer.train()
    history = trainer.history
    names = [e[0] for e in recorder.events]
    assert names[0] == "train_begin" and names[-1] == "train_end"
    assert recorder.events[0][2] == ["lr_scheduler", "model", "optimizer", "processing_class"]
    assert [e for e in recorder.events if e[0] == "step_end"] == [("step_end", 1), ("step_end", 2), ("step_end", 3)]
    assert [e[1] for e in recorder.events if e[0] == "step_begin"] == [0, 1, 2]  # global_step counts finished steps
    assert [e[1] for e in recorder.events if e[0] == "log"] == [1, 2, 3]
    evaluations = [e for e in recorder.events if e[0] == "evaluate"]
    assert [e[1] for e in evaluations] == [0, 2, 3]  # before training, every eval_steps, after
    assert [e[1] for e in recorder.events if e[0] == "save"] == [3]  # save_steps=0: the last step only
    state = trainer.state
    assert state.global_step == 3 and state.max_steps == 3
    steps = [r for r in state.log_history if "loss" in r]
    assert steps == history and len(steps) == 3
    evals = [r for r in state.log_history if "eval/accuracy" in r]
    assert [round(r["eval/accuracy"], 6) for r in evals] == [e[2] for e in evaluations]
    metrics = trainer.evaluate()
    assert metrics["eval/accuracy"] == pytest.approx(evals[-1]["eval/accuracy"])  # the same model, greedy


def test_a_callback_can_stop_training(tiny_dir, tmp_path):
    class StopAfterTwo(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                control.should_training_stop = True
            return control

    trainer = GRPOTrainer(tiny_dir, _length, UPDATE_PROMPTS, args=_args(tmp_path, max_steps=6), callbacks=[StopAfterTwo])
    trainer.train()
    history = trainer.history
    assert [r["step"] for r in history] == [1, 2]
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 2
    assert (tmp_path / "model.safetensors").is_file()  # the final policy is written as at a last step


def test_save_model_writes_a_folder_transformers_loads(tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    trainer = GRPOTrainer(tiny_dir, _length, UPDATE_PROMPTS, args=_args(tmp_path / "run", max_steps=1))
    out = trainer.save_model(str(tmp_path / "saved"))
    loaded = AutoModelForCausalLM.from_pretrained(out)
    for (name, a), b in zip(trainer.model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a.cpu(), b), name  # transformers loads onto the CPU, the trainer's copy may be on a GPU


def test_a_run_that_fails_before_its_first_step_leaves_no_folder(tiny_dir, tmp_path):
    def broken(completions, **_):
        raise ValueError("a typo in the reward")

    out = tmp_path / "new-run"
    trainer = GRPOTrainer(tiny_dir, broken, UPDATE_PROMPTS, args=_args(out, reward_timeout=5))
    assert out.is_dir()
    with pytest.raises(CohortError, match="broken"):  # a reward function that raises stops the run
        trainer.train()
    assert not out.exists()


def test_a_run_that_fails_while_building_leaves_no_folder(tmp_path):
    out = tmp_path / "new-run"
    with pytest.raises(CohortError):
        GRPOTrainer(str(tmp_path / "no-such-model"), _length, UPDATE_PROMPTS, args=_args(out))
    assert not out.exists()
    existing = tmp_path / "mine"
    existing.mkdir()
    (existing / "notes.txt").write_text("keep me")
    with pytest.raises(CohortError):
        GRPOTrainer(str(tmp_path / "no-such-model"), _length, UPDATE_PROMPTS, args=_args(existing))
    assert (existing / "notes.txt").read_text() == "keep me"  # a folder the user made is never removed


def test_summary_seconds_add_up_over_resumed_attempts(tiny_dir, tmp_path):
    first = GRPOTrainer(tiny_dir, _length, UPDATE_PROMPTS, args=_args(tmp_path, max_steps=2, save_steps=2))
    first.train()
    seconds_first = json.loads((tmp_path / "summary.json").read_text())["seconds"]
    state = json.loads((tmp_path / "checkpoint-2" / "trainer_state.json").read_text())
    assert 0 < state["seconds"] <= seconds_first + 0.01
    second = GRPOTrainer(tiny_dir, _length, UPDATE_PROMPTS, args=_args(tmp_path, max_steps=4, save_steps=2,
                                                                       resume=True))
    second.train()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 4
    assert summary["seconds"] >= state["seconds"] + 0.01  # this attempt's time on top of the first's
    assert second.state.global_step == 4 and len([r for r in second.state.log_history if "loss" in r]) == 4
