"""PPO with a separate critic and GAE, on a tiny random model: advantages against an independent
loop, the critic learns its returns, and the trainer reuses GRPO's loop."""

import pytest
import torch

from cohort_grpo.errors import CohortError
from cohort_grpo.config.grpo_config import GRPOConfig
from cohort_grpo.trainer.ppo_trainer import PPOConfig, PPOTrainer

PROMPTS = [{"prompt": f"{a}+{b}=? Reply <answer>N</answer>\n"} for a in range(10) for b in range(10)]


def digit_first(prompts, completions, completion_ids=None, **_):
    return [1.0 if c[:1].isdigit() else 0.0 for c in completions]


def _trainer(tiny_dir, tmp_path, **overrides):
    base = dict(num_generations=4, per_device_train_batch_size=8, gradient_accumulation_steps=2,
                max_completion_length=4, max_steps=2, learning_rate=1e-3, output_dir=str(tmp_path), quiet=True,
                seed=0, beta=0.1, gamma=0.9, lam=0.8, whiten_advantages=False)
    base.update(overrides)
    return PPOTrainer(tiny_dir, digit_first, PROMPTS, args=PPOConfig(**base))


def _rollout(trainer):
    batch = trainer.sample(trainer.next_prompts())
    trainer.score(batch)
    return batch


def _estimate(trainer, batch):
    """The loop's log-prob and advantage steps: GAE advantages, and the critic's targets kept for its update."""
    batch.old_logp, batch.ref_logp = trainer.reference_logprobs(batch)
    batch.advantages = trainer.estimate_advantages(batch)


@pytest.mark.slow
def test_ppo_advantages_are_gae_of_terminal_reward_minus_kl(tiny_dir, tmp_path):
    trainer = _trainer(tiny_dir, tmp_path)
    with torch.no_grad():  # a non-zero critic and a reference unlike the policy, so every term matters
        trainer.critic.value_head.weight.normal_(0, 0.5)
        trainer.critic.value_head.bias.fill_(0.3)
        for p in trainer.ref_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch = _rollout(trainer)
    with torch.no_grad():
        old = trainer.policy_update.logprobs(trainer.model, batch)
        ref = trainer.policy_update.logprobs(trainer.ref_model, batch)
        values = trainer.values_no_grad(batch)
    _estimate(trainer, batch)
    gamma, lam, beta = 0.9, 0.8, 0.1
    mask = batch.rollout.completion_mask
    for b in range(len(batch.rows)):
        n = int(mask[b].sum())
        rewards = [-beta * float(old[b, t] - ref[b, t]) for t in range(n)]
        rewards[n - 1] += float(batch.rewards[b])
        running, want = 0.0, [0.0] * n
        for t in reversed(range(n)):
            next_value = float(values[b, t + 1]) if t + 1 < n else 0.0
            running = rewards[t] + gamma * next_value - float(values[b, t]) + gamma * lam * running
            want[t] = running
        assert batch.advantages[b, :n].tolist() == pytest.approx(want, abs=1e-5)
        assert batch.advantages[b, n:].abs().sum() == 0
        assert trainer.value_targets[1][b, :n].tolist() == pytest.approx(
            [a + float(values[b, t]) for t, a in enumerate(want)], abs=1e-5)
    assert trainer.advantage_metrics["kl"] > 0


def test_critic_learns_the_returns(tiny_dir, tmp_path):
    trainer = _trainer(tiny_dir, tmp_path, critic_learning_rate=3e-3, cliprange_value=10.0, beta=0.0)
    batch = _rollout(trainer)
    _estimate(trainer, batch)
    losses = [trainer.update_critic(batch)["value_loss"] for _ in range(15)]
    assert losses[-1] < 0.5 * losses[0], losses


def test_value_clip_stops_the_gradient_only_when_the_clipped_error_is_larger(tiny_dir, tmp_path):
    """V sits 1 below V_old, clip c = 0.1, so V_clip = V + 0.9. Return 5 below V: the clipped error (5.9)
    beats the unclipped one (5) and is constant in V, so no gradient. Return 5 above V: the unclipped
    error (5) beats the clipped one (4.1), and the gradient flows."""
    trainer = _trainer(tiny_dir, tmp_path, cliprange_value=0.1, beta=0.0)
    batch = _rollout(trainer)
    _estimate(trainer, batch)
    values, _ = trainer.value_targets
    for offset, want_gradient in ((-5.0, False), (5.0, True)):
        trainer.value_targets = (values + 1.0, values + offset)
        stats = trainer.update_critic(batch)
        assert stats["value_loss"] == pytest.approx(0.5 * 5.0**2 if want_gradient else 0.5 * 5.9**2, rel=1e-4)
        assert (stats["critic_grad_norm"] > 0) == want_gradient


def test_ppo_training_moves_policy_and_separate_critic(tiny_dir, tmp_path):
    trainer = _trainer(tiny_dir, tmp_path, whiten_advantages=True, num_iterations=2)
    policy_before = [p.detach().clone() for p in trainer.model.parameters()]
    critic_before = [p.detach().clone() for p in trainer.critic.parameters()]
    # The critic is a copy, not a view of the policy's weights.
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(trainer.critic.body.parameters(), trainer.model.parameters()))
    trainer.train()
    history = trainer.history
    assert len(history) == 2 and all("value_loss" in h and "ppo/value_mean" in h for h in history)
    assert any(not torch.equal(a, p) for a, p in zip(policy_before, trainer.model.parameters()))
    assert any(not torch.equal(a, p) for a, p in zip(critic_before, trainer.critic.parameters()))


def test_ppo_config_validation(tiny_dir, tmp_path):
    with pytest.raises(CohortError):
        PPOConfig(lam=1.5).validate()
    with pytest.raises(CohortError):
        PPOConfig(cliprange_value=0).validate()
    with pytest.raises(CohortError, match="PPOConfig"):
        PPOTrainer(tiny_dir, digit_first, PROMPTS, args=GRPOConfig(output_dir=str(tmp_path)))


@pytest.mark.parametrize("options, fragment", [
    (dict(lam=1.5), "lam=1.5"),  # PPO's own options, refused where written as GRPOConfig's are
    (dict(gamma=float("nan")), "gamma=nan"),
    (dict(cliprange_value=float("nan")), "cliprange_value=nan"),
    (dict(critic_learning_rate=float("nan")), "critic_learning_rate=nan"),
    (dict(critic_learning_rate=-1e-5), "critic_learning_rate=-1e-05"),
    (dict(beta=-1.0), "beta=-1.0"),  # GRPOConfig's options and rules, inherited
    (dict(max_completion_length=0), "max_completion_length=0"),
    (dict(kl_coef=0.1, beta=0.2), "kl_coef"),
])
def test_ppo_config_refuses_a_bad_value_where_it_is_written(options, fragment):
    with pytest.raises(CohortError) as error:
        PPOConfig(**options)
    assert fragment in str(error.value) and "\n" not in str(error.value)


def test_ppo_config_takes_trl_names():
    assert PPOConfig(kl_coef=0.25).beta == 0.25  # TRL's PPOConfig name of the KL coefficient
    assert PPOConfig(bf16=True, lam=0.9).lam == 0.9
    assert PPOConfig().validate().loss_type == "dapo"


@pytest.mark.cpu("bitwise-equal resume: the CPU sums in a fixed order, a GPU's atomics do not")
@pytest.mark.slow
def test_ppo_resume_restores_the_critic_exactly(tiny_dir, tmp_path):
    """2 steps, a checkpoint, then --resume to step 3 equals 3 steps straight: policy and critic."""
    full = _trainer(tiny_dir, tmp_path / "full", max_steps=3)
    full.train()
    first = _trainer(tiny_dir, tmp_path / "part", max_steps=2, save_steps=1, save_total_limit=0)
    first.train()
    resumed = _trainer(tiny_dir, tmp_path / "part", max_steps=3, resume=True)
    fresh_critic = [p.detach().clone() for p in resumed.critic.parameters()]
    resumed.train()
    for a, b in zip(full.critic.parameters(), resumed.critic.parameters()):
        assert torch.allclose(a, b, atol=1e-6)
    for a, b in zip(full.model.parameters(), resumed.model.parameters()):
        assert torch.allclose(a, b, atol=1e-6)
    # the critic really came from the checkpoint: a fresh one (zero head) differs from the trained one
    assert any(not torch.equal(a, b) for a, b in zip(fresh_critic, full.critic.parameters()))


def test_ppo_policy_update_gets_no_reference_the_kl_is_in_the_reward(tiny_dir, tmp_path):
    trainer = _trainer(tiny_dir, tmp_path)
    with torch.no_grad():  # a reference unlike the policy: a KL to report
        for p in trainer.ref_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch = _rollout(trainer)
    _estimate(trainer, batch)
    seen = []

    class Spy:
        def __init__(self, real):
            self.real = real

        def __call__(self, batch, step):
            seen.append(batch.ref_logp)
            return self.real(batch, step)

        def __getattr__(self, name):
            return getattr(self.real, name)

    trainer.policy_update = Spy(trainer.policy_update)
    stats = trainer.update(batch)
    assert batch.ref_logp is not None and seen == [None]  # the loop's batch keeps π_ref; the loss gets none
    assert stats["kl"] == trainer.advantage_metrics["kl"] > 0  # the logged KL is the reward's
