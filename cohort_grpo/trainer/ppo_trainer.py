"""PPO with a learned critic and GAE: the baseline GRPO was designed to remove.

PPO (Schulman et al. 2017) as used for language models (Ziegler et al. 2019; Ouyang et al. 2022,
InstructGPT): each completion token is an action; the reward is 0 on every token except the
last, which gets the task reward, and −β·KL(π_old ‖ π_ref) per token (the k1 estimate) when β > 0;
a critic V(prompt, y_<t) turns those rewards into per-token advantages by GAE (Schulman et al.
2015). GRPO (DeepSeekMath §4.1) replaces the critic with the group mean — so this file is what
the comparison in bench/algorithms.py measures: the critic's memory and compute.

The critic is a *separate copy* of the policy with a scalar head on its final hidden states, not a
head on the policy's own trunk. That is the classic setup (InstructGPT, OpenRLHF and verl's
defaults): policy and value losses do not fight over shared weights, and its cost — a second
model, its optimizer state and its forward/backward passes — is exactly what GRPO saves.

`PPOTrainer` subclasses `GRPOTrainer` and overrides only two steps of Algorithm 1: advantage
estimation (the critic's values and GAE, with the KL to π_ref in the reward) and the update (the
policy update without a KL term, then a critic update). Sampling, rewards, logging and evaluation
are the GRPO trainer's.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import math
from dataclasses import dataclass

import torch
from torch import nn

from cohort_grpo.algorithm.advantages import gae_advantages, whiten
from cohort_grpo.algorithm.objectives import kl_penalty, value_loss
from cohort_grpo.config.grpo_config import GRPOConfig, accepting_trl_names
from cohort_grpo.config.rules import refusal
from cohort_grpo.errors import CohortError
from cohort_grpo.update.logprobs import forward_hidden, scatter_to_rows, supports_hidden
from cohort_grpo.rollout.batch import to_device
from cohort_grpo.update.packing import MicroBatch
from cohort_grpo.rollout.batch import Batch
from cohort_grpo.trainer.grpo_trainer import GRPOTrainer


@dataclass
class PPOConfig(GRPOConfig):
    # TRL's PPOConfig names where they exist; β (`beta`) is TRL's kl_coef.
    gamma: float = 1.0  # discount per token
    lam: float = 0.95  # GAE λ
    cliprange_value: float = 0.2  # clip of the value update around the rollout-time values
    critic_learning_rate: float | None = None  # None → learning_rate
    whiten_advantages: bool = True  # normalise GAE advantages over the batch's tokens
    loss_type: str = "dapo"  # PPO's usual token-mean over the batch

    def check(self) -> None:
        super().check()
        for name, ok, problem in (("gamma", lambda v: 0 <= v <= 1, "must lie in [0, 1]"),
                                  ("lam", lambda v: 0 <= v <= 1, "must lie in [0, 1]"),
                                  ("cliprange_value", lambda v: v > 0, "must be positive"),
                                  ("critic_learning_rate", lambda v: v > 0, "must be positive, or None for learning_rate")):
            value = getattr(self, name)
            if value is None and name == "critic_learning_rate":
                continue
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number or math.isnan(value) or not ok(value):
                raise CohortError(refusal(name, value, problem))


def checking_where_written(init):
    """PPOConfig's constructor as GRPOConfig's (TRL's names, each value checked where it is written), with
    PPO's own options passed through and TRL PPOConfig's `kl_coef` taken as `beta`."""
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        if "kl_coef" in kwargs:
            if "beta" in kwargs:
                raise CohortError("PPOConfig(kl_coef=..., beta=...) gives the KL coefficient twice; give one of them")
            kwargs["beta"] = kwargs.pop("kl_coef")
        own = {name: kwargs.pop(name) for name in ppo_options() if name in kwargs}
        accepting_trl_names(functools.partial(init, **own))(self, *args, **kwargs)
    return __init__


def ppo_options() -> set[str]:
    """The options PPOConfig adds to GRPOConfig's."""
    return {f.name for f in dataclasses.fields(PPOConfig)} - {f.name for f in dataclasses.fields(GRPOConfig)}


PPOConfig.__init__ = checking_where_written(PPOConfig.__init__)


class ValueModel(nn.Module):
    """A copy of the policy's decoder with a scalar head: V(prompt, y_<t) for each completion token."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.body = copy.deepcopy(policy)
        hidden_size = policy.lm_head.weight.shape[1]  # our CausalLM and HF causal LMs both have lm_head
        self.value_head = nn.Linear(hidden_size, 1)
        # Start from V ≡ 0 so the first advantages are the plain returns, not noise from a random head.
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)
        for p in self.body.parameters():
            p.requires_grad_(True)
        # Our CausalLM returns the final hidden states itself; Hugging Face models give them on request.
        self.own_model = supports_hidden(policy) or "return_hidden" in inspect.signature(policy.forward).parameters

    def forward(self, micro: MicroBatch) -> torch.Tensor:
        """`[b, T]`: the value before each completion token t (the hidden state whose logits predict
        token t), 0 off the completion mask."""
        if self.own_model:  # our CausalLM in either layout, or an HF model taking return_hidden (one row each)
            hidden = forward_hidden(self.body, micro)
        else:
            hidden = self.body(input_ids=micro.input_ids, output_hidden_states=True).hidden_states[-1]
        hidden = hidden[micro.source_rows, micro.source_cols]
        return scatter_to_rows(self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).float(), micro)


class PPOTrainer(GRPOTrainer):
    def __init__(self, model, reward_funcs=None, train_dataset=None, args: PPOConfig | None = None, **kwargs):
        args = args if args is not None else PPOConfig()
        if not isinstance(args, PPOConfig):
            raise CohortError("PPOTrainer needs a PPOConfig (it adds gamma, lam, cliprange_value, ...); "
                              "build one with PPOConfig(**your_options)")
        if args.async_rollouts:
            raise CohortError("PPOTrainer does not support async_rollouts (GAE needs the values of the policy "
                              "that sampled); use GRPOTrainer, or leave --async_rollouts off")
        if kwargs.get("tools") or kwargs.get("environment_factory") or args.tools or args.environment:
            raise CohortError("PPOTrainer does not train on tool-calling rollouts (GAE over tool turns is not "
                              "implemented); use GRPOTrainer for tools")
        super().__init__(model, reward_funcs, train_dataset, args=args, **kwargs)
        self.critic = ValueModel(self.model).to(self.device)
        self.critic_optimizer = torch.optim.AdamW(
            self.critic.parameters(), lr=args.critic_learning_rate or args.learning_rate,
            weight_decay=args.weight_decay, betas=(args.adam_beta1, args.adam_beta2))
        self.value_targets: tuple[torch.Tensor, torch.Tensor] | None = None  # (V_old, returns) of this rollout
        self.advantage_metrics: dict[str, float] = {}  # this rollout's KL, value and return means

    # ---- the two overridden steps of Algorithm 1 ------------------------------------------------
    def estimate_advantages(self, batch: Batch) -> torch.Tensor:
        """[B, T] per-token GAE advantages from the critic's values, the task reward on each
        completion's last token and −β·KL(π_old ‖ π_ref) on every token (InstructGPT)."""
        with self.report.phase("advantages"), torch.no_grad():
            args = self.args
            mask = batch.rollout.completion_mask.float()
            token_rewards = torch.zeros_like(mask)
            last = (mask.sum(dim=1).long() - 1).clamp(min=0)
            token_rewards[torch.arange(len(last)), last] = batch.rewards.float()
            metrics = {}
            if batch.ref_logp is not None:
                old = batch.old_logp if batch.old_logp is not None else self.policy_update.logprobs(self.model, batch)
                kl = kl_penalty(old, batch.ref_logp, "k1") * mask  # per-token KL in the reward (InstructGPT)
                token_rewards = token_rewards - args.beta * kl
                metrics["kl"] = float(kl.sum() / mask.sum().clamp(min=1))
            values = self.values_no_grad(batch)
            advantages, returns = gae_advantages(token_rewards, values, mask, args.gamma, args.lam)
            if args.whiten_advantages:
                advantages = whiten(advantages, mask)
            self.value_targets = (values, returns)
            metrics["ppo/value_mean"] = float((values * mask).sum() / mask.sum().clamp(min=1))
            metrics["ppo/return_mean"] = float((returns * mask).sum() / mask.sum().clamp(min=1))
            self.advantage_metrics = metrics
        return advantages

    def update_step(self, batch: Batch) -> dict:
        """The clipped policy surrogate on the GAE advantages — with no KL term: the KL is in the
        reward already — then one critic step."""
        stats = self.policy_update(dataclasses.replace(batch, ref_logp=None), self.step)
        stats.update(self.update_critic(batch))
        stats.update(self.advantage_metrics)  # the reward's KL replaces the policy loss's (zero) one
        return stats

    # ---- checkpoints: the critic is part of the run ------------------------------------------------
    def extra_checkpoint_state(self) -> dict:
        """The critic and its optimizer, in every checkpoint (trainer_extra.pt), so --resume continues
        PPO exactly rather than with a fresh value function."""
        return {"critic": {k: v.detach().to("cpu", copy=True) for k, v in self.critic.state_dict().items()},
                "critic_optimizer": self.critic_optimizer.state_dict()}

    def load_extra_checkpoint_state(self, state: dict) -> None:
        if "critic" not in state:
            raise CohortError("this checkpoint has no critic state (it was written by GRPOTrainer); resume it with "
                              "GRPOTrainer or start the PPO run afresh")
        self.critic.load_state_dict(state["critic"])
        self.critic_optimizer.load_state_dict(state["critic_optimizer"])

    # ---- critic ------------------------------------------------------------------------------
    def update_critic(self, batch: Batch) -> dict:
        """One optimizer step of the clipped value loss, token mean over the whole rollout."""
        args = self.args
        old_values, returns = self.value_targets
        self.critic.train()
        self.critic_optimizer.zero_grad(set_to_none=True)
        keep = self.policy_update.loss_rows(batch)
        token_mask = batch.rollout.completion_mask * keep.unsqueeze(1)  # on the CPU: counts need no GPU sync
        total_tokens = max(float(token_mask.sum()), 1.0)
        # as GRPO's update: the step's tensors on the device once, statistics read back once at the end
        old_values, returns, keep = (to_device(t, self.device) for t in (old_values, returns, keep))
        loss_sum = torch.zeros((), device=self.device)
        for rows in self.policy_update.plan(batch):
            tokens = float(token_mask[rows].sum())
            if tokens == 0:
                continue
            micro = self.policy_update.pack(batch, rows)
            width, index = micro.completion_ids.shape[1], micro.row_index
            loss_mask = micro.completion_mask * keep[index].unsqueeze(1)
            values = self.critic(micro)
            loss = value_loss(values, old_values[index, :width], returns[index, :width], loss_mask, args.cliprange_value)
            (loss * tokens / total_tokens).backward()  # token mean over the whole rollout
            loss_sum = loss_sum + loss.detach() * tokens / total_tokens
        grad_norm = torch.nn.utils.clip_grad_norm_(self.critic.parameters(), args.max_grad_norm)
        self.critic_optimizer.step()
        value_loss_mean, grad_norm = torch.stack([loss_sum, grad_norm.to(loss_sum.device).float()]).tolist()
        return {"value_loss": value_loss_mean, "critic_grad_norm": grad_norm}

    @torch.no_grad()
    def values_no_grad(self, batch: Batch) -> torch.Tensor:
        """[B, T] the critic's value before each completion token, on the CPU."""
        full = torch.zeros(batch.rollout.completion_ids.shape, dtype=torch.float32, device=self.device)
        self.critic.eval()
        for rows in self.policy_update.plan(batch):
            micro = self.policy_update.pack(batch, rows)
            values = self.critic(micro) * micro.completion_mask
            full[micro.row_index, : values.shape[1]] = values.float()
        return full.cpu()  # one copy back, after every micro-batch
