"""The variants' pure functions against independent float64 loops: overlong penalty, GSPO ratio and
gradient, GAE, whitening, clipped value loss, entropy bonus, and DAPO dynamic sampling's drop/refill."""

import dataclasses
import math

import pytest
import torch

from cohort_grpo.algorithm.advantages import gae_advantages, overlong_penalty, whiten
from cohort_grpo.algorithm.objectives import LossSpec, policy_loss, sequence_log_ratio, value_loss
from cohort_grpo.errors import CohortError
from cohort_grpo.trainer.dynamic_sampling import fill_informative, informative_groups
from cohort_grpo.update.logprobs import selected_logprobs
from cohort_grpo.rollout.sampler import Rollout
from cohort_grpo.trainer.grpo_trainer import Batch


# ---- overlong penalty (DAPO eq. 13) -------------------------------------------------------------

@pytest.mark.parametrize("max_len,buffer,factor", [(8, 2, 1.0), (10, 4, 0.5), (5, 5, 2.0)])
def test_overlong_penalty_piecewise(max_len, buffer, factor):
    lengths = torch.arange(0, max_len + 3)
    got = overlong_penalty(lengths, max_len, buffer, factor).tolist()
    for n, value in zip(lengths.tolist(), got):
        if n <= max_len - buffer:
            want = 0.0
        elif n <= max_len:
            want = ((max_len - buffer) - n) / buffer
        else:
            want = -1.0
        assert value == pytest.approx(want * factor, abs=1e-12), n


def test_overlong_penalty_docstring_example_and_bad_buffer():
    assert overlong_penalty(torch.tensor([6, 7, 8, 9]), 8, 2).tolist() == [0.0, -0.5, -1.0, -1.0]
    with pytest.raises(ValueError):
        overlong_penalty(torch.tensor([1]), 8, 0)


# ---- GSPO ---------------------------------------------------------------------------------------

def _random_case(seed, B=4, T=6):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    old = logp.detach() + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5) * 0.6
    mask = torch.tensor([[1] * 6, [1] * 2 + [0] * 4, [1] * 4 + [0] * 2, [1] + [0] * 5])
    adv = torch.tensor([1.0, -0.5, 0.25, -2.0], dtype=torch.float64)
    return logp, old, mask, adv


def test_sequence_log_ratio_value_is_mean_token_log_ratio():
    logp, old, mask, _ = _random_case(0)
    got = sequence_log_ratio(logp, old, mask)
    for b in range(4):
        n = int(mask[b].sum())
        want = sum(float(logp.detach()[b, t] - old[b, t]) for t in range(n)) / n
        for t in range(6):
            assert got[b, t].item() == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_gspo_loss_and_gradient_match_explicit_calculation(loss_type):
    logp, old, mask, adv = _random_case(1)
    # Per-row shifts of log π_old so that rows 0 (A > 0, s ≈ e^0.2) and 3 (A < 0, s ≈ e^−0.3) clip.
    old = old + torch.tensor([[-0.2], [0.0], [0.0], [0.3]], dtype=torch.float64)
    eps, eps_high = 0.05, 0.08
    spec = LossSpec(epsilon=eps, epsilon_high=eps_high, loss_type=loss_type, importance_sampling_level="sequence")
    loss, stats = policy_loss(logp, old, adv, mask, spec)
    loss.backward()
    lengths = [int(m) for m in mask.sum(1)]
    total_tokens = sum(lengths)
    want_loss, want_grad, clipped = 0.0, [[0.0] * 6 for _ in range(4)], 0
    for b in range(4):
        n, a = lengths[b], float(adv[b])
        s = math.exp(sum(float(logp.detach()[b, t] - old[b, t]) for t in range(n)) / n)
        seq_loss = -min(s * a, min(max(s, 1 - eps), 1 + eps_high) * a)
        weight = 1 / 4 if loss_type == "grpo" else n / total_tokens  # how the completion enters the mean
        want_loss += weight * seq_loss
        is_clipped = (a > 0 and s > 1 + eps_high) or (a < 0 and s < 1 - eps)
        clipped += is_clipped
        for t in range(n):
            # d(−s·A)/d logp_t = −A · s / n   (s = exp(mean of n log-ratios)); zero where the clip is active
            want_grad[b][t] = 0.0 if is_clipped else weight * (-a * s / n)
    assert loss.item() == pytest.approx(want_loss, abs=1e-12)
    assert torch.allclose(logp.grad, torch.tensor(want_grad, dtype=torch.float64), atol=1e-12)
    assert 0 < clipped < 4  # both branches exercised
    region = sum(lengths[b] for b in range(4) if want_grad[b][0] == 0.0) / total_tokens
    assert stats["clip_ratio/region_mean"] == pytest.approx(region)


def test_gspo_equals_grpo_gradient_on_policy():
    """At ρ ≡ 1 (old = logp) with per-completion means, GSPO's gradient is GRPO's: s = 1, mean_t ∇logp."""
    logp, _, mask, adv = _random_case(2)
    grads = []
    for level in ("token", "sequence"):
        x = logp.detach().clone().requires_grad_(True)
        loss, _ = policy_loss(x, x.detach(), adv, mask, LossSpec(importance_sampling_level=level))
        loss.backward()
        grads.append(x.grad)
    assert torch.allclose(grads[0], grads[1], atol=1e-14)


def test_unknown_importance_level_rejected():
    logp, old, mask, adv = _random_case(3)
    with pytest.raises(CohortError, match="importance_sampling_level='word'"):
        policy_loss(logp, old, adv, mask, LossSpec(importance_sampling_level="word"))


# ---- per-token advantages and the entropy bonus --------------------------------------------------

def test_policy_loss_accepts_per_token_advantages_and_entropy_bonus():
    logp, old, mask, _ = _random_case(4)
    g = torch.Generator().manual_seed(4)
    adv = torch.randn(4, 6, generator=g, dtype=torch.float64)
    entropy = torch.rand(4, 6, generator=g, dtype=torch.float64) * 2
    coef = 0.3
    loss, _ = policy_loss(logp, old, adv, mask, LossSpec(epsilon=0.2, loss_type="grpo", entropy_coef=coef),
                          entropy=entropy)
    want = 0.0
    for b in range(4):
        n = int(mask[b].sum())
        row = 0.0
        for t in range(n):
            rho = math.exp(float(logp.detach()[b, t] - old[b, t]))
            a = float(adv[b, t])
            row += -min(rho * a, min(max(rho, 0.8), 1.2) * a) - coef * float(entropy[b, t])
        want += row / n / 4
    assert loss.item() == pytest.approx(want, abs=1e-12)
    with pytest.raises(ValueError):
        policy_loss(logp, old, adv, mask, LossSpec(entropy_coef=0.1))  # a bonus needs the entropy


def test_entropy_has_gradient_matching_explicit_formula():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 3, 7, generator=g, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 7, (2, 3), generator=g)
    _, entropy = selected_logprobs(logits, tokens, temperature=0.7, with_entropy=True)
    assert entropy.requires_grad
    entropy.sum().backward()
    # Independent: H = −Σ p log p with p = softmax(z / τ); its gradient by autograd on that formula.
    z = logits.detach().clone().requires_grad_(True)
    p = torch.softmax(z / 0.7, -1)
    explicit = -(p * p.log()).sum(-1)
    explicit.sum().backward()
    assert torch.allclose(entropy.detach(), explicit.detach().float(), atol=1e-6)
    assert torch.allclose(logits.grad, z.grad, atol=1e-6)


# ---- GAE, whitening, value loss ------------------------------------------------------------------

def _gae_loop(rewards, values, lengths, gamma, lam):
    adv_rows, ret_rows = [], []
    for r, v, n in zip(rewards, values, lengths):
        adv = [0.0] * len(r)
        running = 0.0
        for t in range(n - 1, -1, -1):
            next_v = v[t + 1] if t + 1 < n else 0.0
            running = r[t] + gamma * next_v - v[t] + gamma * lam * running
            adv[t] = running
        adv_rows.append(adv)
        ret_rows.append([adv[t] + v[t] if t < n else 0.0 for t in range(len(r))])
    return adv_rows, ret_rows


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0), (0.99, 0.0)])
def test_gae_matches_reversed_loop(gamma, lam):
    g = torch.Generator().manual_seed(6)
    B, T = 5, 7
    lengths = [7, 1, 4, 6, 3]
    mask = torch.tensor([[1] * n + [0] * (T - n) for n in lengths])
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    adv, ret = gae_advantages(rewards, values, mask, gamma, lam)
    want_adv, want_ret = _gae_loop(rewards.tolist(), values.tolist(), lengths, gamma, lam)
    assert torch.allclose(adv, torch.tensor(want_adv, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(ret, torch.tensor(want_ret, dtype=torch.float64), atol=1e-12)


def test_gae_with_zero_values_and_lambda_one_is_reward_to_go():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 9.0]], dtype=torch.float64)  # the 9 is padding
    mask = torch.tensor([[1, 1, 1, 0]])
    adv, ret = gae_advantages(rewards, torch.zeros(1, 4, dtype=torch.float64), mask, gamma=0.5, lam=1.0)
    assert adv.tolist() == [[0.25, 0.5, 1.0, 0.0]]
    assert ret.tolist() == adv.tolist()


def test_whiten_matches_loop():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 4, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    kept = [float(x[b, t]) for b in range(3) for t in range(4) if mask[b, t]]
    mean = sum(kept) / len(kept)
    std = math.sqrt(sum((v - mean) ** 2 for v in kept) / (len(kept) - 1))
    got = whiten(x, mask)
    for b in range(3):
        for t in range(4):
            want = (float(x[b, t]) - mean) / (std + 1e-8) if mask[b, t] else 0.0
            assert got[b, t].item() == pytest.approx(want, abs=1e-10)


def test_value_loss_matches_loop():
    g = torch.Generator().manual_seed(8)
    v, v_old, ret = (torch.randn(3, 5, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.tensor([[1] * 5, [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    clip = 0.3
    total, n = 0.0, 0
    for b in range(3):
        for t in range(5):
            if mask[b, t]:
                vc = float(v_old[b, t]) + max(-clip, min(clip, float(v[b, t] - v_old[b, t])))
                total += 0.5 * max((float(v[b, t]) - float(ret[b, t])) ** 2, (vc - float(ret[b, t])) ** 2)
                n += 1
    assert value_loss(v, v_old, ret, mask, clip).item() == pytest.approx(total / n, abs=1e-12)
    assert value_loss(torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.tensor([[1.0]]),
                      torch.tensor([[1]]), 0.2).item() == pytest.approx(0.32)


# ---- dynamic sampling with a deterministic fake sampler ------------------------------------------

G = 2


def _fake_batch(group_rewards, tag, width):
    """A scored batch: one group per entry of group_rewards (G rewards each), rows named by tag."""
    B = len(group_rewards) * G
    rewards = torch.tensor([r for group in group_rewards for r in group], dtype=torch.float32)
    ids = torch.arange(B * width).view(B, width) + 100
    return Batch(rows=[{"prompt": f"{tag}{i // G}", "id": f"{tag}{i}"} for i in range(B)],
                 prompt_ids=[[i] for i in range(B)],
                 rollout=Rollout(ids, torch.ones(B, width, dtype=torch.long), None, ["stop"] * B),
                 completions=[f"{tag}-c{i}" for i in range(B)], rewards=rewards,
                 per_function=rewards.unsqueeze(1).clone(), reward_metrics={"rewards/x": float(rewards.mean())})


def _expected_kept(rounds, needed):
    """Independently: walk the rounds' groups in order, keep those with unequal rewards."""
    kept = []
    for tag, groups in rounds:
        for i, group in enumerate(groups):
            if len(set(group)) > 1 and len(kept) < needed:
                kept.append(f"{tag}{i}")
        if len(kept) >= needed:
            break
    return kept


def test_fill_informative_drops_and_refills():
    rounds = [("a", [[1, 0], [1, 1], [0, 0], [0.5, 1]]),
              ("b", [[0, 0], [1, 0], [1, 1], [0, 1]]),  # one more than needed: the surplus is cut
              ("c", [[1, 0]] * 4)]  # never reached
    batches = [_fake_batch(groups, tag, width=3 + i) for i, (tag, groups) in enumerate(rounds)]
    calls = []

    def sample_more():
        calls.append(1)
        return batches[len(calls)]

    out, stats = fill_informative(batches[0], sample_more, prompts_needed=3, group_size=G, max_resample_tries=5, pad_id=0)
    assert len(calls) == 1
    assert [r["prompt"] for r in out.rows[::G]] == _expected_kept(rounds, 3) == ["a0", "a3", "b1"]
    assert stats == {"dynamic_sampling/tries": 2.0, "dynamic_sampling/dropped_groups": 4.0,
                     "dynamic_sampling/informative_groups": 3.0}
    assert bool(informative_groups(out.rewards, G).all())
    # Rows travel together: rewards, completions and padded ids of b1 are b's rows 2-3.
    assert out.completions[4:6] == ["b-c2", "b-c3"]
    assert out.rewards[4:6].tolist() == [1.0, 0.0]
    assert out.rollout.completion_ids.shape == (6, 4)  # widths 3 and 4 → padded to 4
    assert out.rollout.completion_mask[:4, 3].tolist() == [0, 0, 0, 0]  # padding column of round a
    assert torch.equal(out.rollout.completion_ids[4:6], batches[1].rollout.completion_ids[2:4])


def test_fill_informative_stops_after_max_tries_and_keeps_what_it_has():
    flat = [[1, 1], [0, 0], [1, 1], [0, 0]]
    rounds = [("a", [[1, 0]] + flat[1:]), ("b", flat), ("c", [[0, 1]] * 4)]
    batches = [_fake_batch(g, t, 3) for t, g in rounds]
    calls = []

    def sample_more():
        calls.append(1)
        return batches[len(calls)]

    out, stats = fill_informative(batches[0], sample_more, prompts_needed=4, group_size=G, max_resample_tries=1, pad_id=0)
    assert len(calls) == 1  # the third round is beyond the bound
    assert [r["prompt"] for r in out.rows[::G]] == ["a0"]
    assert stats["dynamic_sampling/tries"] == 2.0
    assert stats["dynamic_sampling/dropped_groups"] == 7.0
    assert stats["dynamic_sampling/informative_groups"] == 1.0


def test_fill_informative_with_nothing_informative_returns_first_batch():
    batches = [_fake_batch([[1, 1], [0, 0]], t, 3) for t in "ab"]
    out, stats = fill_informative(batches[0], lambda: batches[1], prompts_needed=2, group_size=G,
                                  max_resample_tries=1, pad_id=0)
    assert out is batches[0]
    assert stats["dynamic_sampling/informative_groups"] == 0.0
    assert stats["dynamic_sampling/dropped_groups"] == 4.0


def test_fill_informative_needs_no_refill_when_full():
    batch = _fake_batch([[1, 0], [0, 1]], "a", 3)
    out, stats = fill_informative(batch, lambda: pytest.fail("sampled again"), prompts_needed=2, group_size=G,
                                  max_resample_tries=3, pad_id=0)
    assert stats["dynamic_sampling/tries"] == 1.0
    assert [r["id"] for r in out.rows] == [r["id"] for r in batch.rows]


# ---- wiring into the trainer (tiny random model) -------------------------------------------------

from cohort_grpo import GRPOConfig, GRPOTrainer# noqa: E402
from cohort_grpo.trainer.dynamic_sampling import select_groups# noqa: E402
from update_gradients import update_gradient  # noqa: E402

PROMPTS = [{"prompt": f"{a}+{b}=? Reply <answer>N</answer>\n", "a": a} for a in range(10) for b in range(10)]


def digit_first(prompts, completions, completion_ids=None, **_):
    return [1.0 if c[:1].isdigit() else 0.0 for c in completions]


def digit_first_odd_only(prompts, completions, completion_ids=None, *, a, **_):
    """Prompts with an even first operand always score 0: their groups are never informative."""
    return [1.0 if x % 2 and c[:1].isdigit() else 0.0 for c, x in zip(completions, a)]


def _trainer(tiny_dir, tmp_path, reward=digit_first, **overrides):
    base = dict(num_generations=4, per_device_train_batch_size=8, gradient_accumulation_steps=2,
                max_completion_length=4, max_steps=2, learning_rate=1e-3, output_dir=str(tmp_path), quiet=True,
                seed=0, max_grad_norm=1e9)
    base.update(overrides)
    return GRPOTrainer(tiny_dir, reward, PROMPTS, args=GRPOConfig(**base))


def retarget(trainer, **changes):
    """The same trainer's update under other options: the run's config is frozen, so the update is handed a
    copy with `changes` (the weights, optimizer and batch stay the same)."""
    trainer.policy_update.args = dataclasses.replace(trainer.policy_update.args, **changes)


def _scored_batch(trainer, seed=0):
    batch = trainer.sample(trainer.next_prompts())
    trainer.score(batch)
    batch.advantages = torch.randn(len(batch.rows), generator=torch.Generator().manual_seed(seed))
    return batch


@pytest.mark.cpu("two updates compared to 1e-6: float32 CPU arithmetic (bf16 on a GPU is ~1e-3 apart)")
def test_mask_truncated_completions_equals_training_without_those_rows(tiny_dir, tmp_path):
    trainer = _trainer(tiny_dir, tmp_path, loss_type="dapo", mask_truncated_completions=True)
    batch = _scored_batch(trainer)
    batch.rollout.finish_reasons = ["length" if i % 3 == 0 else "stop" for i in range(len(batch.rows))]
    masked = update_gradient(trainer, batch)[0]
    kept = [i for i, r in enumerate(batch.rollout.finish_reasons) if r == "stop"]
    retarget(trainer, mask_truncated_completions=False)
    restricted = update_gradient(trainer, select_groups(batch, kept, 1))[0]
    everything = update_gradient(trainer, batch)[0]
    assert torch.allclose(masked, restricted, atol=1e-6)
    assert not torch.allclose(masked, everything, atol=1e-4)
    # Every completion truncated: nothing left to learn from, the gradient is exactly zero.
    retarget(trainer, mask_truncated_completions=True)
    batch.rollout.finish_reasons = ["length"] * len(batch.rows)
    assert torch.count_nonzero(update_gradient(trainer, batch)[0]) == 0


@pytest.mark.slow
def test_overlong_penalty_is_added_to_the_reward(tiny_dir, tmp_path):
    trainer = _trainer(tiny_dir, tmp_path, overlong_buffer_length=2, overlong_penalty_factor=0.5)
    batch = trainer.sample(trainer.next_prompts())
    trainer.score(batch)
    raw = digit_first(None, batch.completions)
    lengths = batch.rollout.completion_mask.sum(1).tolist()
    want = [r + 0.5 * (0.0 if n <= 2 else (2 - n) / 2) for r, n in zip(raw, lengths)]
    assert batch.rewards.tolist() == pytest.approx(want)
    assert any(n > 2 for n in lengths)  # the case actually exercises the penalty
    assert "rewards/overlong_penalty" in batch.reward_metrics


@pytest.mark.cpu("two gradients compared to 1e-6: float32 CPU arithmetic (bf16 on a GPU is ~1e-3 apart)")
def test_gspo_update_equals_grpo_update_on_policy(tiny_dir, tmp_path):
    trainer = _trainer(tiny_dir, tmp_path, importance_sampling_level="sequence")
    batch = _scored_batch(trainer)
    sequence = update_gradient(trainer, batch)[0]
    trainer.policy_update.loss = dataclasses.replace(trainer.policy_update.loss, importance_sampling_level="token")
    token = update_gradient(trainer, batch)[0]
    assert torch.allclose(sequence, token, atol=1e-6) and sequence.abs().sum() > 0


@pytest.mark.slow
def test_entropy_bonus_raises_entropy(tiny_dir, tmp_path):
    def mean_entropy(trainer, batch):
        from cohort_grpo.update.logprobs import micro_batch_logprobs

        micro = trainer.policy_update.pack(batch, list(range(len(batch.rows))))
        mask = micro.completion_mask
        out = micro_batch_logprobs(trainer.model, micro, with_entropy=True)
        assert out.entropy.requires_grad  # the bonus can only work if the entropy carries a gradient
        return float((out.entropy.detach() * mask).sum() / mask.sum())

    for coef in (0.0, 1.0):
        trainer = _trainer(tiny_dir, tmp_path, entropy_coef=coef, learning_rate=1e-3)
        with torch.no_grad():  # sharpen the random model's logits: near-uniform leaves no room to rise
            trainer.model.model.norm.weight.mul_(20.0)
        batch = _scored_batch(trainer)
        batch.advantages = torch.zeros(len(batch.rows))  # no policy signal: only the bonus acts
        before = mean_entropy(trainer, batch)
        for _ in range(3):
            trainer.update(batch)
        after = mean_entropy(trainer, batch)
        if coef == 0.0:
            assert after == pytest.approx(before, abs=1e-7)
        else:
            assert after > before + 1e-3


def test_dynamic_sampling_trains_only_informative_groups(tiny_dir, tmp_path):
    trainer = _trainer(tiny_dir, tmp_path, reward=digit_first_odd_only, dynamic_sampling=True, max_resample_tries=3)
    seen = []
    update = trainer.update

    def spy(batch):
        seen.append(batch)
        return update(batch)

    trainer.update = spy
    trainer.train()
    history = trainer.history
    for batch in seen:
        assert bool(informative_groups(batch.rewards, 4).all())
        assert all(row["a"] % 2 == 1 for row in batch.rows)
        assert len(batch.rows) <= trainer.args.generation_batch_size
    assert all(h["dynamic_sampling/tries"] >= 1 for h in history)
    # Half the prompts have an even operand, so over two steps some groups must have been dropped.
    assert sum(h["dynamic_sampling/dropped_groups"] for h in history) > 0
