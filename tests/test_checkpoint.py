"""Checkpoints (cohort_grpo/run/checkpoint.py): contents, atomic writes, exact in-process resume, local faults, safe loading.

Tiny random-init Llama (no warm start), arithmetic prompts, and a dense reward (share of digits in
the completion) so every step really moves the weights."""

import dataclasses
import hashlib
import json
import random
import re
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from cohort_grpo import GRPOConfig, GRPOTrainer
from cohort_grpo.run import checkpoint as ckpt
from cohort_grpo.run import lifecycle as run_guard
from cohort_grpo.errors import CohortError
from cohort_grpo.tasks.arithmetic import ArithmeticTask
from cohort_grpo.models.tiny import build_model, build_tokenizer

SPEC = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            max_position_embeddings=64)
TASK = ArithmeticTask()
TRAIN = TASK.load("train", size=64, seed=0)
HELD_OUT = TASK.load("test", size=4)


def digit_share(prompts, completions, completion_ids=None, **_):
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


def noisy_digit_share(prompts, completions, completion_ids=None, **_):
    """digit_share plus noise from the python, numpy and torch global generators: a resumed run only
    matches when all three are restored."""
    noise = [random.random() + float(np.random.rand()) + float(torch.rand(())) for _ in completions]
    return [s + 1e-2 * n for s, n in zip(digit_share(prompts, completions), noise)]


def is_wall_clock(key: str) -> bool:
    return key in ("time", "step_time") or key.startswith(("time/", "tokens_per_second", "peak_memory"))


def without_wall_clock(records):
    return [{k: v for k, v in r.items() if not is_wall_clock(k)} for r in records]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("tiny-random")
    tokenizer = build_tokenizer()
    build_model(tokenizer, seed=0, spec=SPEC).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def make_args(out, **overrides):
    base = dict(num_generations=4, per_device_train_batch_size=8, gradient_accumulation_steps=1,
                max_completion_length=5, max_prompt_length=64, max_steps=6, save_steps=2, learning_rate=3e-3,
                beta=0.05, output_dir=str(out), quiet=True, seed=0, device="cpu", log_completions_steps=1)
    base.update(overrides)
    return GRPOConfig(**base)


def trainer_for(model_dir, out, reward=digit_share, log=None, **overrides):
    kwargs = dict(args=make_args(out, **overrides), eval_dataset=HELD_OUT, task=TASK)
    if log is not None:
        kwargs["log"] = log
    return GRPOTrainer(model_dir, reward, TRAIN, **kwargs)


def state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


class Crash(BaseException):
    """Stands for a process dying mid-way: not an Exception, so no cleanup code catches it."""


def crash_in_step(trainer, step: int) -> None:
    """Make `trainer` die (as a killed process would) inside its update of step `step`."""
    update = trainer.update

    def dies(batch):
        if trainer.step == step:
            raise Crash()
        return update(batch)

    trainer.update = dies


def test_checkpoint_holds_everything_and_its_manifest_is_true(model_dir, tmp_path):
    trainer = trainer_for(model_dir, tmp_path, max_steps=4, save_total_limit=0)
    trainer.train()
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-4"]
    folder = tmp_path / "checkpoint-4"
    manifest = json.loads((folder / "complete.json").read_text())
    assert manifest["step"] == 4
    on_disk = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()} - {"complete.json"}
    assert set(manifest["files"]) == on_disk
    assert {"config.json", "model.safetensors", "reference.safetensors", "optimizer.pt", "trainer_state.json"} <= on_disk
    for name, entry in manifest["files"].items():
        data = (folder / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    # The policy is an ordinary transformers folder equal to the final weights (tied lm_head stored once).
    saved = load_file(folder / "model.safetensors")
    for name, tensor in trainer.model.state_dict().items():
        if name in saved:
            assert torch.equal(saved[name], tensor), name
    reference = load_file(folder / "reference.safetensors")
    assert all(torch.equal(reference[k], v) for k, v in trainer.ref_model.state_dict().items() if k in reference)
    optimizer = torch.load(folder / "optimizer.pt", weights_only=True)  # no pickled code needed
    assert optimizer["scheduler"]["last_epoch"] == 4
    assert all(int(s["step"]) == 4 for s in optimizer["optimizer"]["state"].values())
    trainer_state = json.loads((folder / "trainer_state.json").read_text())
    assert trainer_state["step"] == 4 and [h["step"] for h in trainer_state["history"]] == [1, 2, 3, 4]
    assert trainer_state["data_order"] == trainer.prompts.order
    assert ckpt.check_checkpoint(folder) is None


def test_only_the_newest_save_total_limit_are_kept(model_dir, tmp_path):
    trainer_for(model_dir, tmp_path, max_steps=5, save_steps=1, save_total_limit=2, beta=0.0).train()
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["checkpoint-4", "checkpoint-5"]
    assert not list(tmp_path.glob(".tmp-*")) and not list(tmp_path.glob(".trash-*"))


@pytest.mark.slow
def test_same_seed_same_run_and_crash_resume_is_exact(model_dir, tmp_path):
    """Cosine LR, μ = 2, β > 0 with π_ref resets and periodic evaluation: everything the next step depends on."""
    options = dict(max_steps=7, save_steps=3, num_iterations=2, ref_reset_steps=2, eval_steps=2,
                   lr_scheduler_type="cosine", warmup_steps=1)
    options["reward"] = noisy_digit_share
    first = trainer_for(model_dir, tmp_path / "a", **options)
    first.train()
    again = trainer_for(model_dir, tmp_path / "b", **options)
    again.train()
    assert without_wall_clock(jsonl(tmp_path / "a/metrics.jsonl")) == without_wall_clock(jsonl(tmp_path / "b/metrics.jsonl"))

    crashed = trainer_for(model_dir, tmp_path / "c", **options)
    crash_in_step(crashed, 5)
    with pytest.raises(Crash):
        crashed.train()
    assert max(r["step"] for r in jsonl(tmp_path / "c/metrics.jsonl")) == 4  # steps past the checkpoint were logged
    lines = []
    resumed = trainer_for(model_dir, tmp_path / "c", resume=True, log=lines.append, **options)
    resumed.train()
    assert any(re.search(r"resumed from .*checkpoint-3 at step 3", line) for line in lines), lines
    for name in ("metrics.jsonl", "completions.jsonl"):
        expected, got = jsonl(tmp_path / "a" / name), jsonl(tmp_path / "c" / name)
        assert without_wall_clock(got) == without_wall_clock(expected), name
    assert without_wall_clock(resumed.history) == without_wall_clock(first.history)
    for (name, a), b in zip(first.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    for a, b in zip(first.ref_model.state_dict().values(), resumed.ref_model.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_resume_inside_a_curriculum_stage_is_exact(model_dir, tmp_path):
    """A checkpoint in the middle of stage 2 restores that stage's rows and the position in them."""
    options = dict(max_steps=7, save_steps=2, beta=0.0, curriculum=[
        {"task": "arithmetic", "steps": 3, "levels": "3", "size": 40},
        {"task": "arithmetic", "steps": 4, "levels": "2", "size": 40}])
    reference = trainer_for(model_dir, tmp_path / "ref", **options)
    reference.train()
    crashed = trainer_for(model_dir, tmp_path / "run", **options)
    crash_in_step(crashed, 6)
    with pytest.raises(Crash):
        crashed.train()
    resumed = trainer_for(model_dir, tmp_path / "run", resume=True, **options)
    resumed.train()
    assert [h["curriculum/stage"] for h in resumed.history] == [0, 0, 0, 1, 1, 1, 1]
    assert without_wall_clock(jsonl(tmp_path / "run/completions.jsonl")) == without_wall_clock(
        jsonl(tmp_path / "ref/completions.jsonl"))
    assert without_wall_clock(resumed.history) == without_wall_clock(reference.history)
    assert all(torch.equal(a, b) for a, b in zip(reference.model.state_dict().values(),
                                                 resumed.model.state_dict().values()))


@pytest.mark.slow
def test_crash_while_writing_a_checkpoint_resumes_from_the_previous_one(model_dir, tmp_path, monkeypatch):
    reference = trainer_for(model_dir, tmp_path / "ref", max_steps=6)
    reference.train()
    save_optimizer = ckpt._save_optimizer

    def dies_after_the_model_file(parts, path, *gathered):
        if path.parent.name.startswith(".tmp-checkpoint-4-"):  # the write of checkpoint-4
            assert (path.parent / "model.safetensors").is_file()  # the write is really half done
            raise Crash()
        save_optimizer(parts, path, *gathered)

    monkeypatch.setattr(ckpt, "_save_optimizer", dies_after_the_model_file)
    with pytest.raises(Crash):
        trainer_for(model_dir, tmp_path / "run", max_steps=6).train()
    monkeypatch.setattr(ckpt, "_save_optimizer", save_optimizer)
    half_written = list((tmp_path / "run").glob(".tmp-checkpoint-4-*"))
    assert half_written and not (half_written[0] / "complete.json").exists()
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "run")] == ["checkpoint-2"]
    lines = []
    resumed = trainer_for(model_dir, tmp_path / "run", max_steps=6, resume=True, log=lines.append)
    resumed.train()
    assert any("resumed from" in line and "checkpoint-2 at step 2" in line for line in lines), lines
    assert not list((tmp_path / "run").glob(".tmp-*"))  # the leftover was cleaned up
    for a, b in zip(reference.model.state_dict().values(), resumed.model.state_dict().values()):
        assert torch.equal(a, b)
    assert without_wall_clock(jsonl(tmp_path / "run/metrics.jsonl")) == without_wall_clock(jsonl(tmp_path / "ref/metrics.jsonl"))


def test_incomplete_and_corrupt_checkpoints_are_skipped_with_a_reason(model_dir, tmp_path):
    trainer_for(model_dir, tmp_path, max_steps=6, save_total_limit=0, beta=0.0).train()
    (tmp_path / "checkpoint-6" / "complete.json").unlink()  # as if the write stopped before the marker
    model_file = tmp_path / "checkpoint-4" / "model.safetensors"
    data = bytearray(model_file.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit of weights, same size
    model_file.write_bytes(bytes(data))
    lines = []
    resumed = trainer_for(model_dir, tmp_path, max_steps=6, beta=0.0, resume=True, log=lines.append)
    resumed.resume()
    assert resumed.step == 2
    assert "skipping checkpoint-6: incomplete (no complete.json: its write was interrupted)" in lines
    assert "skipping checkpoint-4: corrupt (model.safetensors differs from its manifest's sha256)" in lines
    (tmp_path / "checkpoint-2" / "optimizer.pt").write_bytes(b"short")
    assert "optimizer.pt has 5 bytes" in ckpt.check_checkpoint(tmp_path / "checkpoint-2")


def test_non_finite_updates_are_skipped_counted_and_stop_the_run(model_dir, tmp_path, monkeypatch):
    import cohort_grpo.update.policy_update as update_module

    real_loss = update_module.micro_batch_policy_loss
    bad_steps = {2}

    def loss_nan_on_bad_steps(*args, **kwargs):
        out = real_loss(*args, **kwargs)
        return dataclasses.replace(out, loss=out.loss * float("nan")) if trainer.step in bad_steps else out

    monkeypatch.setattr(update_module, "micro_batch_policy_loss", loss_nan_on_bad_steps)
    trainer = trainer_for(model_dir, tmp_path / "one", max_steps=3, beta=0.0)
    before_step_2 = {}
    record = trainer.log_step

    def snapshot(batch, losses, seconds):
        record(batch, losses, seconds)
        before_step_2.setdefault(trainer.step, state(trainer.model))

    trainer.log_step = snapshot
    trainer.train()
    history = trainer.history
    assert [h["skipped_steps"] for h in history] == [0, 1, 1]
    assert all(torch.equal(before_step_2[1][k], v) for k, v in before_step_2[2].items())  # step 2 left θ alone
    assert not all(torch.equal(before_step_2[2][k], v) for k, v in before_step_2[3].items())  # step 3 trained

    bad_steps.update(range(1, 10))
    trainer = trainer_for(model_dir, tmp_path / "all", max_steps=8, beta=0.0, max_consecutive_nonfinite=3)
    initial = state(trainer.model)
    with pytest.raises(CohortError, match=r"3 updates in a row had a non-finite loss, gradient or log-prob \(up to step 3\)"):
        trainer.train()
    folder = tmp_path / "all" / "checkpoint-3"
    assert ckpt.check_checkpoint(folder) is None
    saved = load_file(folder / "model.safetensors")
    assert all(torch.equal(saved[k], initial[k]) for k in saved)  # the last finite weights


def test_sigterm_saves_a_checkpoint_then_stops(model_dir, tmp_path):
    import os

    previous = signal.getsignal(signal.SIGTERM)

    def sends_sigterm_in_step_3(prompts, completions, completion_ids=None, **_):
        if trainer.step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return digit_share(prompts, completions)

    trainer = trainer_for(model_dir, tmp_path, reward=sends_sigterm_in_step_3, max_steps=8, save_steps=5)
    with pytest.raises(run_guard.TrainingInterrupted) as stop:
        trainer.train()
    assert stop.value.exit_code == 143 and "stopped by SIGTERM after step 3" in str(stop.value)
    assert ckpt.check_checkpoint(tmp_path / "checkpoint-3") is None
    assert signal.getsignal(signal.SIGTERM) is previous  # the handler was given back


def test_a_repeat_of_the_signal_at_once_is_the_same_stop_and_a_later_one_stops_at_once():
    """torchrun sends its workers SIGTERM twice in a row: that is one stop (finish the step, save). A second
    signal after `REPEAT_WINDOW_S` is the user insisting: the previous handler takes over."""
    import os

    from cohort_grpo.run.lifecycle import StopRequest

    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    stop = StopRequest()
    stop.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signum == signal.SIGTERM and received == []  # noted once, the repeat ignored
        stop.noted_at -= StopRequest.REPEAT_WINDOW_S + 1  # as if the first came a while ago
        os.kill(os.getpid(), signal.SIGTERM)
        assert received == [signal.SIGTERM]  # the previous handler ran: a stop at once
    finally:
        stop.uninstall()
        signal.signal(signal.SIGTERM, previous)


class CountingReward:
    """A reward object with state (as a learned reward model with a replay buffer has)."""

    __name__ = "counting"

    def __init__(self):
        self.calls = torch.zeros(1, dtype=torch.long)
        self.buffer: list[float] = []

    def __call__(self, prompts, completions, completion_ids=None, **_):
        self.calls += 1
        scores = digit_share(prompts, completions)
        self.buffer.extend(scores[:2])
        return scores

    def state_dict(self):
        return {"calls": self.calls.clone(), "buffer": list(self.buffer)}

    def load_state_dict(self, state):
        self.calls, self.buffer = state["calls"].clone(), list(state["buffer"])


def test_reward_function_state_is_saved_and_restored(model_dir, tmp_path):
    first = CountingReward()
    trainer_for(model_dir, tmp_path, reward=first, max_steps=4, beta=0.0).train()
    saved = torch.load(tmp_path / "checkpoint-4" / "reward_funcs" / "0" / "state.pt", weights_only=True)
    assert int(saved["calls"]) == 4 and len(saved["buffer"]) == 8
    second = CountingReward()
    trainer = trainer_for(model_dir, tmp_path, reward=second, max_steps=4, beta=0.0, resume_from_checkpoint=str(
        tmp_path / "checkpoint-2"))
    trainer.resume()
    assert int(second.calls) == 2 and second.buffer == first.buffer[:4]


# ---- safe loading -------------------------------------------------------------------------------

def _calls(text: str, name: str) -> list[str]:
    """The full text of each `name(...)` call in `text` (balanced parentheses)."""
    calls = []
    for match in re.finditer(re.escape(name) + r"\(", text):
        depth, end = 0, match.end() - 1
        for end in range(match.end() - 1, len(text)):
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            if depth == 0:
                break
        calls.append(text[match.start(): end + 1])
    return calls


def test_weights_load_only_from_safetensors_or_weights_only_torch_load():
    import cohort_grpo

    sources = {p: p.read_text() for p in Path(cohort_grpo.__file__).parent.rglob("*.py")}
    torch_loads = [(p.name, call) for p, text in sources.items() for call in _calls(text, "torch.load")]
    assert torch_loads, "the checkpoint code loads optimizer.pt with torch.load"
    for name, call in torch_loads:
        assert "weights_only=True" in call, (name, call)
    for path, text in sources.items():
        assert not re.search(r"\bpickle\.loads?\(|\bdill\.|\bjoblib\.load", text), path.name
        assert "trust_remote_code=True" not in text, path.name  # only the user's --trust_remote_code turns it on


def test_a_reward_module_is_imported_only_when_named(model_dir, tmp_path, monkeypatch):
    import sys

    (tmp_path / "spy_reward_module.py").write_text(
        "def score(prompts, completions, completion_ids=None, **_):\n    return [0.5] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "spy_reward_module", raising=False)
    GRPOTrainer(model_dir, None, TRAIN, args=make_args(tmp_path / "a"), task=TASK)
    assert "spy_reward_module" not in sys.modules
    trainer = GRPOTrainer(model_dir, None, TRAIN, args=make_args(tmp_path / "b", reward_funcs=["spy_reward_module:score"]),
                          task=TASK)
    assert "spy_reward_module" in sys.modules and trainer.rewards.names == ["score"]


class TrainerWithOwnState(GRPOTrainer):
    """A subclass with state of its own (as PPO's critic) plugs in through two methods."""

    def log_step(self, batch, losses, seconds):
        self.own_steps = getattr(self, "own_steps", torch.zeros(1)) + 1
        super().log_step(batch, losses, seconds)

    def extra_checkpoint_state(self):
        return {"own_steps": self.own_steps.clone()}

    def load_extra_checkpoint_state(self, state):
        self.own_steps = state["own_steps"].clone()


def test_a_subclass_saves_and_restores_its_own_state(model_dir, tmp_path):
    TrainerWithOwnState(model_dir, digit_share, TRAIN, args=make_args(tmp_path, max_steps=4, beta=0.0)).train()
    resumed = TrainerWithOwnState(model_dir, digit_share, TRAIN, args=make_args(
        tmp_path, max_steps=4, beta=0.0, resume_from_checkpoint=str(tmp_path / "checkpoint-2")))
    resumed.resume()
    assert resumed.step == 2 and int(resumed.own_steps) == 2


class NanSamplerLogprob:
    """`trainer`'s group sampler (its rollout source's), reporting NaN for one sampled token (inside the loss
    mask) on `bad_steps`."""

    def __init__(self, trainer, bad_steps):
        self.trainer, self.bad_steps, self.inner = trainer, bad_steps, trainer.rollouts.group_sampler
        trainer.rollouts.group_sampler = self

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, *args, **kwargs):
        batch = self.inner(*args, **kwargs)
        if self.trainer.step in self.bad_steps:
            logprobs = batch.rollout.logprobs.clone()
            row, col = batch.rollout.loss_mask.nonzero()[0].tolist()
            logprobs[row, col] = float("nan")
            batch.rollout.logprobs = logprobs
        return batch


def nan_sampler_logprob_on(trainer, bad_steps):
    NanSamplerLogprob(trainer, bad_steps)
    return trainer


@pytest.mark.slow
def test_a_nan_sampler_logprob_skips_the_update_and_a_resumed_run_still_matches(model_dir, tmp_path):
    """With the sampler correction on, a NaN sampler log-prob would be read as ratio 1 (TRL's nan_to_num)
    and the step would train on a finite loss: the update is skipped and counted instead, the run goes
    on, and a run resumed across the skipped step is the uninterrupted one."""
    options = dict(max_steps=5, save_steps=2, beta=0.0, eval_steps=0, importance_sampling_correction=True)
    trainer = nan_sampler_logprob_on(trainer_for(model_dir, tmp_path / "one", **options), {3})
    weights = {}
    record = trainer.log_step

    def snapshot(batch, losses, seconds):
        record(batch, losses, seconds)
        weights[trainer.step] = state(trainer.model)

    trainer.log_step = snapshot
    trainer.train()
    history = trainer.history
    assert [h["skipped_steps"] for h in history] == [0, 0, 1, 1, 1]
    assert [h["nonfinite_logprobs"] > 0 for h in history] == [False, False, True, False, False]
    assert all(np.isfinite(h["loss"]) for h in history)  # the loss alone would not have caught it
    assert all(torch.equal(weights[2][k], v) for k, v in weights[3].items())  # step 3 left θ alone
    assert not all(torch.equal(weights[3][k], v) for k, v in weights[4].items())  # step 4 trained

    crashed = nan_sampler_logprob_on(trainer_for(model_dir, tmp_path / "two", **options), {3})
    crash_in_step(crashed, 4)
    with pytest.raises(Crash):
        crashed.train()
    resumed = nan_sampler_logprob_on(trainer_for(model_dir, tmp_path / "two", resume=True, **options), {3})
    resumed.train()
    assert without_wall_clock(resumed.history) == without_wall_clock(history)
    assert all(torch.equal(a, b) for a, b in zip(trainer.model.state_dict().values(),
                                                 resumed.model.state_dict().values()))
