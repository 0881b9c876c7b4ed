"""Asynchronous rollouts (cohort_grpo/rollout/async_rollouts.py): the rollout of step t is sampled on a producer
thread from the weights after update t − 1 − max_staleness, while earlier steps update.

Checked against independent computations: the sampling log-probs a step trains on are those the saved
checkpoint of exactly that policy version assigns (and not the next version's); the step records say
how stale their samples were and carry the sampler-correction metrics; two runs with one seed are equal,
and a run resumed from a checkpoint ends where the uninterrupted one did, bit for bit."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from cohort_grpo import GRPOConfig, GRPOTrainer
from cohort_grpo.errors import CohortError
from cohort_grpo.models import from_pretrained
from cohort_grpo.update.logprobs import rollout_logprobs
from helpers import UPDATE_PROMPTS

torch.set_num_threads(1)


def odd_length(completions, **kwargs):
    """A reward that varies within groups, so every step moves the weights."""
    return [float(len(c) % 2) for c in completions]


class Recording(GRPOTrainer):
    """Keeps the batch each step trained on (the rollout its source handed over, as it is scored)."""

    def score(self, batch):
        self.batches = {**getattr(self, "batches", {}), self.step: batch}
        super().score(batch)


def config(out, **overrides):
    base = dict(num_generations=4, per_device_train_batch_size=8, max_completion_length=6, max_steps=4,
                learning_rate=3e-3, output_dir=str(out), quiet=True, seed=0, async_rollouts=True,
                max_staleness=1, save_steps=1, save_total_limit=0, logging_steps=1, eval_limit=0)
    base.update(overrides)
    return GRPOConfig(**base)


def records(out):
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def sampling_logprobs_under(folder, batch):
    model = from_pretrained(folder)
    return rollout_logprobs(model, batch.prompt_ids, batch.rollout.completion_ids, batch.rollout.completion_mask,
                            pad_id=0, max_rows=64)


@pytest.mark.cpu("log-probs compared to 1e-4: float32 on the CPU (a bf16 sampler and trainer are ~1e-2 apart)")
@pytest.mark.parametrize("staleness", [1, 2])
def test_each_step_samples_from_the_policy_max_staleness_updates_ago(tiny_dir, tmp_path, staleness):
    trainer = Recording(tiny_dir, odd_length, UPDATE_PROMPTS, args=config(tmp_path, max_staleness=staleness))
    trainer.train()
    got = records(tmp_path)
    assert [r["async/staleness"] for r in got] == [min(step - 1, staleness) for step in range(1, 5)]
    for r in got:  # the sampler correction runs, and its metrics are in every step's record
        assert "sampling/importance_sampling_ratio/mean" in r and "sampling/sampling_logp_difference/max" in r
    step = 4
    version = step - 1 - staleness
    batch = trainer.batches[step]
    mask = batch.rollout.completion_mask.bool()
    sampled = batch.rollout.logprobs[mask]
    that_version = sampling_logprobs_under(tmp_path / f"checkpoint-{version}", batch)[mask]
    next_version = sampling_logprobs_under(tmp_path / f"checkpoint-{version + 1}", batch)[mask]
    assert (sampled - that_version).abs().max() < 1e-4
    assert (sampled - next_version).abs().max() > 1e-3, "the versions must differ for the check to mean anything"


@pytest.mark.cpu("bitwise-equal runs: the CPU sums in a fixed order, a GPU's atomics do not")
@pytest.mark.slow
def test_same_seed_same_run_and_an_exact_resume(tiny_dir, tmp_path):
    GRPOTrainer(tiny_dir, odd_length, UPDATE_PROMPTS, args=config(tmp_path / "a")).train()
    GRPOTrainer(tiny_dir, odd_length, UPDATE_PROMPTS, args=config(tmp_path / "b")).train()
    assert [r["loss"] for r in records(tmp_path / "a")] == [r["loss"] for r in records(tmp_path / "b")]
    final = load_file(tmp_path / "a" / "model.safetensors")
    assert all(torch.equal(final[k], v) for k, v in load_file(tmp_path / "b" / "model.safetensors").items())
    # resume from the uninterrupted run's checkpoint-2: the rollouts it had sampled ahead come back
    (tmp_path / "c").mkdir()
    shutil.copytree(tmp_path / "a" / "checkpoint-2", tmp_path / "c" / "checkpoint-2")
    GRPOTrainer(tiny_dir, odd_length, UPDATE_PROMPTS, args=config(tmp_path / "c", resume=True)).train()
    resumed = load_file(tmp_path / "c" / "model.safetensors")
    assert all(torch.equal(final[k], v) for k, v in resumed.items())
    assert [r["loss"] for r in records(tmp_path / "c")][-2:] == [r["loss"] for r in records(tmp_path / "a")][-2:]


def test_settings_that_cannot_work_are_refused(tiny_dir, tmp_path):
    with pytest.raises(CohortError, match="max_staleness=0"):
        config(tmp_path, max_staleness=0).validate()
    with pytest.raises(CohortError, match="leave importance_sampling_correction on"):
        config(tmp_path, importance_sampling_correction=False).validate()


@pytest.mark.cpu("bitwise-equal runs: the CPU sums in a fixed order, a GPU's atomics do not")
def test_a_finished_run_resumed_with_more_steps_continues_as_the_longer_run(tiny_dir, tmp_path):
    """The rollouts of the steps after max_steps are sampled ahead as in a longer run (from the policy
    max_staleness updates before), so the last checkpoint holds them and a resume with a larger max_steps trains
    what the longer run trains."""
    longer = config(tmp_path / "longer", max_steps=5, max_staleness=2, save_steps=0)
    GRPOTrainer(tiny_dir, odd_length, UPDATE_PROMPTS, args=longer).train()
    shorter = config(tmp_path / "run", max_steps=3, max_staleness=2, save_steps=0)
    GRPOTrainer(tiny_dir, odd_length, UPDATE_PROMPTS, args=shorter).train()
    GRPOTrainer(tiny_dir, odd_length, UPDATE_PROMPTS, args=config(tmp_path / "run", max_steps=5, max_staleness=2,
                                                                  save_steps=0, resume=True)).train()
    assert [r["loss"] for r in records(tmp_path / "run")] == [r["loss"] for r in records(tmp_path / "longer")]
    final = load_file(tmp_path / "longer" / "model.safetensors")
    assert all(torch.equal(final[k], v) for k, v in load_file(tmp_path / "run" / "model.safetensors").items())


class WithoutRolloutsSampledAhead(GRPOTrainer):
    """Resumes as from a checkpoint that holds no rollouts sampled ahead (one of an older version)."""

    def load_extra_checkpoint_state(self, state):
        pass


def test_a_resume_without_rollouts_sampled_ahead_says_in_one_line_that_its_steps_differ(tiny_dir, tmp_path):
    GRPOTrainer(tiny_dir, odd_length, UPDATE_PROMPTS, args=config(tmp_path, max_steps=2, save_steps=0)).train()
    lines = []
    WithoutRolloutsSampledAhead(tiny_dir, odd_length, UPDATE_PROMPTS, log=lines.append,
                                args=config(tmp_path, max_steps=4, save_steps=0, resume=True)).train()
    said = [line for line in lines if "sampled ahead" in line]
    assert said == ["asynchronous rollouts: the checkpoint of step 2 holds no rollouts sampled ahead, so step 3's "
                    "rollout is sampled from its weights, not from those max_staleness=1 updates before: the resumed "
                    "run differs from an uninterrupted one from step 3 on"], lines
