"""Completions that no reward function scores (every function returned None, failed or timed out):
TRL 1.16's semantics. Such a completion is left out of its group's mean and std (and of the batch's std)
and gets advantage 0; a group without two scored completions contributes nothing; the fraction is
logged as `rewards/unscored_frac`. Checked through the reward runner and the trainer's own methods, and
against an independent float64 computation of TRL's NaN-aware formulas. Also: `scale_rewards` takes
TRL's booleans."""

import math
import types

import pytest
import torch

from cohort_grpo import GRPOConfig, GRPOTrainer
from cohort_grpo.trainer.dynamic_sampling import select_groups
from cohort_grpo.algorithm.advantages import group_advantages
from cohort_grpo.config.command_line import parse_config
from cohort_grpo.errors import CohortError
from cohort_grpo.rewards.runner import RewardOutput, RewardRunner
from cohort_grpo.rollout.batch import Batch
from cohort_grpo.rollout.sampler import Rollout

torch.set_num_threads(1)


def last_of_four_unscored(prompts, completions, **_):
    """1, 1, 0, None within each group of 4 (the completions' text says which)."""
    return [None if c == "?" else float(c) for c in completions]


def never_scores(prompts, completions, **_):
    return [None] * len(completions)


def make_batch(completions: list[str]) -> Batch:
    B = len(completions)
    rollout = Rollout(torch.ones(B, 2, dtype=torch.long), torch.ones(B, 2, dtype=torch.long), None, ["stop"] * B)
    return Batch(rows=[{"prompt": f"p{i // 4}"} for i in range(B)], prompt_ids=[[1]] * B, rollout=rollout,
                 completions=completions)


def trainer_stub(reward_funcs, **config) -> types.SimpleNamespace:
    """What `GRPOTrainer.add_rewards` and `estimate_advantages` read of the trainer, nothing more: the
    trainer's own methods run on it exactly as `train()` calls them."""
    args = GRPOConfig(num_generations=4, **config).validate()
    return types.SimpleNamespace(args=args, state=None, rewards=RewardRunner(reward_funcs, timeout_s=30, errors=args.reward_errors))


def score_and_estimate(stub, completions: list[str]) -> tuple[Batch, torch.Tensor]:
    batch = make_batch(completions)
    GRPOTrainer.add_rewards(stub, batch)  # its notices go to stderr
    return batch, GRPOTrainer.estimate_advantages(stub, batch)


def trl_advantages(rewards: list[float | None], G: int, scale: str) -> list[float]:
    """TRL 1.16's sum_then_normalize advantages written out in float64 over Python floats: None rows are
    NaN, means and Bessel-corrected stds are NaN-aware (a std of one value is NaN), advantages
    (r − group mean) / (std + 1e-4) unless scale is none, and every NaN advantage becomes 0."""

    def nanmean(xs):
        kept = [x for x in xs if x is not None]
        return sum(kept) / len(kept) if kept else math.nan

    def nanstd(xs):
        kept = [x for x in xs if x is not None]
        if len(kept) < 2:
            return math.nan
        m = sum(kept) / len(kept)
        return math.sqrt(sum((x - m) ** 2 for x in kept) / (len(kept) - 1))

    batch_std = nanstd(rewards)
    out = []
    for start in range(0, len(rewards), G):
        group = rewards[start:start + G]
        mean, std = nanmean(group), nanstd(group)
        for r in group:
            if r is None:
                out.append(0.0)
                continue
            a = r - mean
            if scale == "group":
                a = a / (std + 1e-4)
            elif scale == "batch":
                a = a / (batch_std + 1e-4)
            out.append(0.0 if math.isnan(a) else a)
    return out


# ---- through the reward runner and the trainer's estimate path -----------------------------------

def test_one_unscored_completion_is_left_out_of_its_group():
    stub = trainer_stub([last_of_four_unscored], scale_rewards="group")
    batch, advantages = score_and_estimate(stub, ["1", "1", "0", "?"])
    assert advantages.tolist() == pytest.approx([0.5773, 0.5773, -1.1545, 0.0], abs=1e-3)
    # Exactly: mean 2/3 and Bessel std 1/√3 over the three scored; eps as group_advantages' default.
    std = 1 / math.sqrt(3)
    assert advantages.tolist() == pytest.approx([(1 / 3) / (std + 1e-4)] * 2 + [(-2 / 3) / (std + 1e-4), 0.0],
                                                abs=1e-6)
    assert batch.rewards.tolist() == [1.0, 1.0, 0.0, 0.0]  # the combined reward stays TRL's nansum
    assert torch.isnan(batch.per_function[3]).all()
    assert batch.reward_metrics["rewards/unscored_frac"] == 0.25


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_trainer_path_matches_trl_formulas(scale):
    texts = ["1", "1", "0", "?",  # one unscored
             "?", "?", "?", "?",  # no scored completion: contributes nothing
             "3", "?", "?", "?",  # one scored: nothing to compare it with
             "0.5", "2", "?", "-1",
             "4", "2", "0", "1"]  # all scored
    stub = trainer_stub([last_of_four_unscored], scale_rewards=scale)
    _, advantages = score_and_estimate(stub, texts)
    want = trl_advantages([None if t == "?" else float(t) for t in texts], 4, scale)
    assert advantages.tolist() == pytest.approx(want, abs=1e-5)
    assert advantages[4:12].eq(0).all()
    assert torch.isfinite(advantages).all()


def test_a_completion_scored_by_any_function_is_scored():
    """Two functions: a completion one of them scores is scored (its reward is the nansum); only one that
    neither scores is left out."""

    def scores_odd(prompts, completions, **_):
        return [float(i % 2) if i % 2 else None for i in range(len(completions))]

    stub = trainer_stub([last_of_four_unscored, scores_odd])
    batch, advantages = score_and_estimate(stub, ["1", "?", "0", "?"])
    assert batch.rewards.tolist() == [1.0, 1.0, 0.0, 1.0]  # row 1: 0 (None) + 1; row 3 likewise
    assert not torch.isnan(batch.per_function).all(dim=1).any()
    assert batch.reward_metrics["rewards/unscored_frac"] == 0.0
    mean, std = 0.75, 0.5
    assert advantages.tolist() == pytest.approx([(r - mean) / (std + 1e-4) for r in (1, 1, 0, 1)], abs=1e-6)


def test_failing_function_makes_its_samples_unscored():
    def raises(prompts, completions, **_):
        raise RuntimeError("verifier crashed")

    stub = trainer_stub([raises], reward_errors="warn")
    batch, advantages = score_and_estimate(stub, ["1", "0", "1", "0"])
    assert advantages.eq(0).all()
    assert batch.reward_metrics["rewards/unscored_frac"] == 1.0
    assert math.isnan(batch.reward_metrics["reward"])  # nothing scored: no reward to report, as TRL's nanmean


def test_unscored_rows_survive_dynamic_sampling_selection():
    """DAPO's group selection keeps `per_function`, where the trainer reads which rows are unscored."""
    stub = trainer_stub([last_of_four_unscored])
    batch = make_batch(["5", "5", "5", "5", "1", "1", "0", "?"])
    GRPOTrainer.add_rewards(stub, batch)
    kept = select_groups(batch, [1], 4)
    assert GRPOTrainer.estimate_advantages(stub, kept).tolist() == pytest.approx([0.5773, 0.5773, -1.1545, 0.0],
                                                                                 abs=1e-3)


def test_batch_without_per_function_is_all_scored():
    stub = trainer_stub([last_of_four_unscored])
    batch = make_batch(["1", "1", "0", "0"])
    batch.rewards = torch.tensor([1.0, 1.0, 0.0, 0.0])
    assert GRPOTrainer.estimate_advantages(stub, batch).tolist() == pytest.approx(
        group_advantages(batch.rewards, 4).tolist())


# ---- the reward runner ---------------------------------------------------------------------------

def test_runner_marks_unscored_and_reports_it(capsys):
    runner = RewardRunner([last_of_four_unscored, never_scores], reward_weights=[2.0, 1.0])
    out = runner(["p"] * 4, ["1", "?", "0", "?"], None, {})
    assert "advantage 0" in capsys.readouterr().err
    assert isinstance(out, RewardOutput)
    assert out.unscored.tolist() == [False, True, False, True]
    assert out.unscored.dtype == torch.bool
    assert out.rewards.tolist() == [2.0, 0.0, 0.0, 0.0]  # finite; the unscored ones are 0 (nansum)
    assert out.metrics["rewards/unscored_frac"] == 0.5
    # TRL logs the combined reward's statistics over the scored samples only.
    assert out.metrics["reward"] == pytest.approx(1.0)
    assert out.metrics["reward_std"] == pytest.approx(math.sqrt(2.0))
    assert out.metrics["rewards/last_of_four_unscored/mean"] == pytest.approx(0.5)
    assert math.isnan(out.metrics["rewards/never_scores/mean"])


def test_runner_all_scored_reports_zero_unscored():
    runner = RewardRunner([last_of_four_unscored])
    out = runner(["p"] * 2, ["1", "0"], None, {})
    assert out.unscored.tolist() == [False, False]
    assert out.metrics["rewards/unscored_frac"] == 0.0
    assert out.metrics["reward"] == 0.5


# ---- group_advantages with a scored mask ---------------------------------------------------------

@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_scored_mask_matches_trl_in_float64(scale):
    g = torch.Generator().manual_seed(3)
    G, prompts = 5, 7
    rewards = torch.randn(prompts * G, generator=g, dtype=torch.float64)
    scored = torch.rand(prompts * G, generator=g) > 0.3
    scored[0:G] = False  # a group with nothing scored
    scored[G:2 * G] = torch.tensor([True, False, False, False, False])  # one scored
    scored[2 * G:3 * G] = True  # all scored
    rewards[~scored] = 123.0  # whatever an unscored row holds never enters the statistics
    got = group_advantages(rewards, G, scale, scored=scored)
    want = trl_advantages([r if s else None for r, s in zip(rewards.tolist(), scored.tolist())], G, scale)
    assert got.dtype == torch.float64
    assert got.tolist() == pytest.approx(want, abs=1e-12, rel=1e-12)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_all_scored_mask_is_the_unmasked_computation(scale):
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25, 1.0, 1.0, 0.0, 0.0])
    plain = group_advantages(rewards, 4, scale)
    assert torch.equal(group_advantages(rewards, 4, scale, scored=torch.ones(8, dtype=torch.bool)), plain)


def test_unscored_nan_rewards_do_not_leak():
    rewards = torch.tensor([1.0, 1.0, 0.0, math.nan])
    scored = torch.tensor([True, True, True, False])
    for scale in ("group", "batch", "none"):
        adv = group_advantages(rewards, 4, scale, scored=scored)
        assert torch.isfinite(adv).all() and adv[3] == 0


def test_scored_mask_shape_is_checked():
    with pytest.raises(ValueError, match="scored"):
        group_advantages(torch.ones(4), 2, scored=torch.ones(2, dtype=torch.bool))


# ---- scale_rewards takes TRL's booleans ------------------------------------------------------------

@pytest.mark.parametrize("value, want", [(True, "group"), (False, "none"), ("group", "group"), ("batch", "batch"),
                                         ("none", "none")])
def test_scale_rewards_from_python(value, want):
    assert GRPOConfig(scale_rewards=value).validate().scale_rewards == want


@pytest.mark.parametrize("text, want", [("true", "group"), ("false", "none"), ("True", "group"), ("FALSE", "none"),
                                        ("batch", "batch")])
def test_scale_rewards_from_the_command_line(text, want):
    assert parse_config(["--scale_rewards", text]).scale_rewards == want
    assert parse_config([f"--scale-rewards={text}"]).scale_rewards == want


@pytest.mark.parametrize("text, want", [("true", "group"), ("false", "none"), ("group", "group"), ("none", "none")])
def test_scale_rewards_from_yaml(tmp_path, text, want):
    path = tmp_path / "run.yaml"
    path.write_text(f"scale_rewards: {text}\n")
    assert parse_config(["--config", str(path)]).scale_rewards == want


def test_scale_rewards_rejects_other_values():
    with pytest.raises(CohortError, match="scale_rewards"):
        GRPOConfig(scale_rewards="std").validate()
    with pytest.raises(CohortError, match="scale_rewards"):
        parse_config(["--scale_rewards", "yes"])


# ---- one real run --------------------------------------------------------------------------------

PROMPTS = [{"prompt": f"{a}+{b}=? Reply <answer>N</answer>\n"} for a in range(10) for b in range(10)]


def digit_or_unscored(prompts, completions, **_):
    """1 for a leading digit, 0 for a leading letter, None (unscored) otherwise."""
    return [1.0 if c[:1].isdigit() else 0.0 if c[:1].isalpha() else None for c in completions]


def test_training_with_unscored_completions(tiny_dir, tmp_path):
    args = GRPOConfig(num_generations=4, per_device_train_batch_size=8, gradient_accumulation_steps=2,
                      max_completion_length=4, max_steps=2, learning_rate=1e-3, output_dir=str(tmp_path),
                      quiet=True, seed=0)
    trainer = GRPOTrainer(tiny_dir, digit_or_unscored, PROMPTS, args=args)
    seen = []
    estimate = trainer.estimate_advantages

    def spy(batch):
        advantages = estimate(batch)
        seen.append((torch.isnan(batch.per_function).all(dim=1), advantages))
        return advantages

    trainer.estimate_advantages = spy
    trainer.train()
    history = trainer.history
    assert len(history) == 2
    for record, (unscored, advantages) in zip(history, seen):
        assert record["rewards/unscored_frac"] == pytest.approx(float(unscored.float().mean()))
        assert advantages[unscored].eq(0).all() and torch.isfinite(advantages).all()
        assert math.isfinite(record["loss"]) and math.isfinite(record["reward"])
    assert any(unscored.any() for unscored, _ in seen), "the tiny model should leave some completions unscored"
