"""The trainer's Algorithm-1 structure and real learning on the tiny model; what it logs (advantages,
KL) against independent recomputations from the logged rewards and the models themselves."""

import copy
import json
import math

import numpy as np
import pytest
import torch

from cohort_grpo import GRPOConfig, GRPOTrainer

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
    trainer.train()
    history = trainer.history
    assert calls == {"generate": 2, "optimizer": 6}  # one rollout per step, μ optimizer steps on it
    assert [h["num_iterations"] for h in history] == [3, 3]
    # With μ > 1 the later passes see ρ ≠ 1 and some tokens leave the clip range; the first pass of each
    # rollout has ρ = 1 (π_old = π_θ), so at most 2 of the 3 passes can clip a token. A token is clipped
    # low (A < 0) or high (A > 0), never both: the region is their sum.
    for h in history:
        assert 0 < h["clip_ratio/region_mean"] <= 2 / 3
        assert h["clip_ratio/region_mean"] == pytest.approx(h["clip_ratio/low_mean"] + h["clip_ratio/high_mean"])


def test_reference_resets_every_M_steps(tiny_dir, tmp_path):
    trainer = GRPOTrainer(tiny_dir, first_is_digit, PROMPTS,
                          args=_args(tmp_path, beta=0.05, ref_reset_steps=2, max_steps=4, learning_rate=5e-3))
    resets = []
    original = trainer.reset_reference

    def spy():
        original()
        # On a GPU π_ref's weights live in host memory between its passes (offload_ref_model): their device
        # tensors are empty then, so they are read inside a reference pass.
        with trainer.memory.reference_pass():
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
    trainer = GRPOTrainer(tiny_dir, starts_with_seven, PROMPTS, args=args)
    trainer.train()
    history = trainer.history
    rewards = [h["reward"] for h in history]
    assert rewards[0] <= 0.15, rewards
    assert max(rewards) >= 0.95, rewards


@pytest.mark.cpu("the saved model's logits compared to 1e-4 with the trained one: float32 CPU weights (a GPU run trains in bf16)")
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


def reward_of_the_text(prompts, completions, completion_ids=None, **_):
    """A reward that differs between most completions (0 … 10), so groups have spread."""
    return [float(sum(map(ord, c)) % 11) for c in completions]


def _logged_completions(output_dir) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "completions.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_logged_advantages_follow_scale_rewards(tiny_dir, tmp_path, scale):
    """Every completion of each step is logged with its reward and advantage; the advantage must be
    the group-relative one that `scale_rewards` names, recomputed here from the logged rewards."""
    args = _args(tmp_path, scale_rewards=scale, per_device_train_batch_size=8, gradient_accumulation_steps=1,
                 max_completion_length=6, max_steps=2, log_completions_steps=1)
    GRPOTrainer(tiny_dir, reward_of_the_text, PROMPTS, args=args).train()
    samples = _logged_completions(tmp_path)
    assert [s["step"] for s in samples] == [1] * 8 + [2] * 8  # the whole batch, in group order
    spread = []
    for step in (1, 2):
        rows = [s for s in samples if s["step"] == step]
        rewards = np.array([s["reward"] for s in rows], dtype=np.float64)
        assert list(rewards) == [reward_of_the_text(None, [s["completion"]])[0] for s in rows]
        groups = rewards.reshape(2, 4)  # G = 4
        centred = groups - groups.mean(axis=1, keepdims=True)
        if scale == "group":  # (r − mean) / (std + 1e-4), std with Bessel's correction (DeepSeekMath §4.1.2)
            want = centred / (groups.std(axis=1, ddof=1, keepdims=True) + 1e-4)
        elif scale == "batch":
            want = centred / (rewards.std(ddof=1) + 1e-4)
        else:  # Dr. GRPO: no division
            want = centred
        assert [s["advantage"] for s in rows] == pytest.approx(want.ravel().tolist(), abs=1e-5)
        spread += list(groups.std(axis=1, ddof=1)) + [rewards.std(ddof=1)]
    # the three scalings give different advantages here: no divisor is 0 or close to 1
    assert all(s > 0 and abs(s - 1) > 0.1 for s in spread), spread


def _k3_and_k1(policy, reference, tokenizer, prompts, completion_ids) -> tuple[float, float]:
    """Token means of k3 = exp(r) − r − 1 and k1 = −r, r = log π_ref − log π_θ, over every completion
    token, from each model's full forward of prompt + completion (float64 log-softmax)."""
    k3 = k1 = 0.0
    n = 0
    for prompt, completion in zip(prompts, completion_ids):
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([prompt_ids + list(completion)])
        logps = []
        for model in (policy, reference):
            with torch.no_grad():
                out = model(ids)
            logits = (out.logits if hasattr(out, "logits") else out)[0].double()
            logps.append(torch.log_softmax(logits, dim=-1))
        for t, token in enumerate(completion):
            position = len(prompt_ids) - 1 + t  # the logits that predict completion token t
            r = float(logps[1][position, token] - logps[0][position, token])
            k3, k1, n = k3 + math.exp(r) - r - 1, k1 - r, n + 1
    return k3 / n, k1 / n


@pytest.mark.cpu("the logged KL against a float64 recomputation to 1e-3 relative: float32 numbers (bf16 is ~1e-2)")
@pytest.mark.parametrize("fused_head_loss", [True, False])
def test_logged_kl_is_the_k3_estimate_between_policy_and_reference(tiny_dir, tmp_path, fused_head_loss):
    """β > 0: the logged `kl` of a step is the mean k3 KL of the step's completion tokens between π_θ as
    the update found it and π_ref, recomputed here from the two models' forwards. Step 1: π_ref is a
    copy of π_θ (0); step 2: π_θ has taken one step, and k3 and k1 differ."""
    seen = []
    holder = {}

    def reward(prompts, completions, completion_ids=None, **_):
        # called after sampling, before the update: the weights the update's statistics will see
        weights = {k: v.detach().clone() for k, v in holder["trainer"].model.state_dict().items()}
        seen.append((list(prompts), [list(ids) for ids in completion_ids], weights))
        return reward_of_the_text(prompts, completions)

    args = _args(tmp_path, beta=0.1, per_device_train_batch_size=8, gradient_accumulation_steps=1,
                 max_completion_length=6, max_steps=2, learning_rate=3e-2, fused_head_loss=fused_head_loss)
    trainer = holder["trainer"] = GRPOTrainer(tiny_dir, reward, PROMPTS, args=args)
    trainer.train()
    history = trainer.history
    assert len(seen) == 2 and [h["micro_batches"] for h in history] == [1, 1]  # one micro-batch: a plain token mean
    policy = copy.deepcopy(trainer.model)
    for record, (prompts, completion_ids, weights) in zip(history, seen):
        policy.load_state_dict(weights)
        k3, k1 = _k3_and_k1(policy, trainer.ref_model, trainer.tokenizer, prompts, completion_ids)
        assert record["kl"] == pytest.approx(k3, rel=1e-3, abs=1e-7)
    assert history[0]["kl"] == pytest.approx(0.0, abs=1e-6)
    # the policy moved; k1 = −r, whose mean over π_θ's samples estimates the same KL, differs from k3 on
    # these tokens by more than the tolerance, so a k1 statistic would fail the comparison above
    assert history[1]["kl"] > 1e-3 and abs(k1 - k3) > 5e-3 * k3, (k1, k3)
