"""The trainer's Algorithm-1 structure and real learning on the tiny model."""

import torch

from cohort import GRPOConfig, GRPOTrainer

PROMPTS = [{"prompt": f"{a}+{b}=? Reply <answer>N</answer>\n"} for a in range(10) for b in range(10)]


def _args(tmp_path, **overrides):
    base = dict(num_generations=4, per_device_train_batch_size=8, gradient_accumulation_steps=2,
                max_completion_length=4, max_steps=2, learning_rate=1e-3, output_dir=str(tmp_path), quiet=True,
                seed=0)
    base.update(overrides)
    return GRPOConfig(**base)


def first_is_digit(prompts, completions, completion_ids=None, **_):
    return [1.0 if c[:1].isdigit() else 0.0 for c in completions]


def starts_with_seven(prompts, completions, completion_ids=None, **_):
    return [1.0 if c.startswith("7") else 0.0 for c in completions]


def test_beta_zero_builds_no_reference(tiny_dir, tmp_path):
    trainer = GRPOTrainer(tiny_dir, first_is_digit, PROMPTS, args=_args(tmp_path, beta=0.0))
    assert trainer.ref_model is None
    trainer = GRPOTrainer(tiny_dir, first_is_digit, PROMPTS, args=_args(tmp_path, beta=0.1))
    assert trainer.ref_model is not None
    assert all(not p.requires_grad for p in trainer.ref_model.parameters())


def test_num_iterations_reuses_one_rollout(tiny_dir, tmp_path):
    trainer = GRPOTrainer(tiny_dir, first_is_digit, PROMPTS, args=_args(tmp_path, num_iterations=3, max_steps=2))
    calls = {"generate": 0, "optimizer": 0}
    generate, step = trainer.sampler.generate, trainer.optimizer.step

    def counting_generate(*a, **k):
        calls["generate"] += 1
        return generate(*a, **k)

    def counting_step(*a, **k):
        calls["optimizer"] += 1
        return step(*a, **k)

    trainer.sampler.generate, trainer.optimizer.step = counting_generate, counting_step
    history = trainer.train()
    assert calls == {"generate": 2, "optimizer": 6}  # one rollout per step, μ optimizer steps on it
    assert [h["num_iterations"] for h in history] == [3, 3]
    # With μ > 1 the later passes see ρ ≠ 1, so clipping statistics become possible (and KL-free loss moves).
    assert any(h["clip_ratio/region_mean"] >= 0 for h in history)


def test_reference_resets_every_M_steps(tiny_dir, tmp_path):
    trainer = GRPOTrainer(tiny_dir, first_is_digit, PROMPTS,
                          args=_args(tmp_path, beta=0.05, ref_reset_steps=2, max_steps=4, learning_rate=5e-3))
    resets = []
    original = trainer.reset_reference

    def spy():
        original()
        same = all(torch.equal(a, b) for a, b in zip(trainer.ref_model.parameters(), trainer.model.parameters()))
        resets.append((trainer.step, same))

    trainer.reset_reference = spy
    trainer.train()
    assert resets == [(3, True)]  # step 3 opens iteration 2 (M = 2); π_ref equals π_θ right after
    # ... and by the end π_θ has moved away from that reference again.
    assert not all(torch.equal(a, b) for a, b in zip(trainer.ref_model.parameters(), trainer.model.parameters()))


def test_learnable_reward_rises_to_one(tiny_dir, tmp_path):
    """Seed sanity check: with a learnable reward the mean reward climbs from ≤0.15 to ≥0.95 in ≤15 steps."""
    args = _args(tmp_path, num_generations=8, per_device_train_batch_size=64, gradient_accumulation_steps=1,
                 max_completion_length=3, max_steps=15, learning_rate=1e-2, seed=1)
    history = GRPOTrainer(tiny_dir, starts_with_seven, PROMPTS, args=args).train()
    rewards = [h["reward"] for h in history]
    assert rewards[0] <= 0.15, rewards
    assert max(rewards) >= 0.95, rewards


def test_checkpoint_is_a_transformers_folder(tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer = GRPOTrainer(tiny_dir, first_is_digit, PROMPTS, args=_args(tmp_path, max_steps=1))
    trainer.train()
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tmp_path)
    ids = torch.tensor([[5, 6, 7]])
    ours = trainer.model(ids)
    assert torch.allclose(model(ids).logits, ours, atol=1e-4)
    assert (tmp_path / "summary.json").exists() and (tmp_path / "metrics.jsonl").exists()
