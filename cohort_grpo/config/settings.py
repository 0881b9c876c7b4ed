"""Typed settings a stage takes from the config: one value built once (`GRPOConfig.reward_model()`), in
place of a stage's keyword list remapped name by name from the config's flat options.

A setting is checked where it is built, by the same rows of cohort_grpo/config/rules.py that check the config,
so a stage built from Python refuses what `cohort-grpo train` refuses, in the same words.
"""

from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass

from cohort_grpo.config.choices import CHOICES, choose
from cohort_grpo.config.rules import REWARD_MODEL_RULES, first_refusal
from cohort_grpo.errors import CohortError


@dataclass(frozen=True)
class RewardModelSettings:
    """How a learned reward model r_φ trains (cohort_grpo/rewards/model.py): `GRPOConfig`'s rm_* options, named
    without the prefix. The defaults are the config's; `updates_per_step=0` keeps r_φ frozen (TRL's
    behaviour), `train_steps=K` freezes it after K steps, `head_learning_rate=None` is `learning_rate`."""
    updates_per_step: int = 0
    buffer_size: int = 4096
    buffer_policy: str = "fifo"
    replay_ratio: float = 0.5
    batch_size: int = 32
    learning_rate: float = 1e-4
    loss: str = "pointwise"
    label_fraction: float = 1.0
    train_steps: int = 0
    max_length: int = 512
    scorer: str = "head"
    head_learning_rate: float | None = None
    warmup_batches: int = 0
    warmup_updates: int = 200

    def __post_init__(self):
        options = self.as_options()
        for name, value in vars(options).items():
            if name in CHOICES:
                choose(name, value)
        message = first_refusal(REWARD_MODEL_RULES, options)
        if message is not None:
            raise CohortError(message)

    def as_options(self) -> types.SimpleNamespace:
        """These settings under the config's names (rm_replay_ratio, ...), as the rules and messages read them."""
        return types.SimpleNamespace(**{f"rm_{f.name}": getattr(self, f.name) for f in dataclasses.fields(self)})

    @classmethod
    def of(cls, config) -> "RewardModelSettings":
        """The settings of `config`'s rm_* options."""
        return cls(**{f.name: getattr(config, f"rm_{f.name}") for f in dataclasses.fields(cls)})
