"""What the policy loss is told: its settings (`LossSpec`) and a micro-batch's place in the step (`BatchShare`).

Both are frozen values. `LossSpec` is built once from the config (`LossSpec.from_config`) and handed
whole to `objectives.policy_loss`, so a loss option is one field here, one term in the formula and
one test, and no layer in between knows its name. `BatchShare` is what the update knows and the
loss needs for its normalisation: the whole step's completions and tokens, over every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cohort_grpo.config.choices import CHOICES
from cohort_grpo.errors import CohortError

ScaleRewards = Literal["group", "batch", "none"]
KLEstimator = Literal["k1", "k2", "k3"]
LossType = Literal["grpo", "bnpo", "dapo", "dr_grpo"]
ImportanceLevel = Literal["token", "sequence"]
SamplerCorrection = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]

# The option values come from the one table of them (cohort_grpo/config/choices.py); the Literals above name them
# for type checkers only.
SCALE_CHOICES = CHOICES["scale_rewards"]
KL_CHOICES = ("k1", "k2", "k3")
LOSS_TYPES = CHOICES["loss_type"]
IMPORTANCE_LEVELS = CHOICES["importance_sampling_level"]
SAMPLER_CORRECTIONS = CHOICES["importance_sampling_mode"]


@dataclass(frozen=True)
class LossSpec:
    """The settings of `objectives.policy_loss`, TRL's names where TRL has the option.

    Defaults are GRPO's: symmetric clip ε = 0.2, no KL, per-completion mean, token-level ratio, no
    sampler correction."""

    loss_type: LossType = "grpo"  # the length normalisation (`objectives.aggregate_loss`)
    epsilon: float = 0.2  # lower clip: ρ ≥ 1 − ε
    epsilon_high: float | None = None  # upper clip: ρ ≤ 1 + ε_high; None is ε (DAPO's clip-higher sets it above)
    beta: float = 0.0  # weight of the k3 KL to π_ref
    delta: float | None = None  # INTELLECT-2's cap on the unclipped ratio; None is off
    use_bias_correction_kl: bool = False  # weigh each token's KL by ρ (DeepSeek-V3.2)
    importance_sampling_level: ImportanceLevel = "token"  # "sequence" is GSPO's ratio
    entropy_coef: float = 0.0  # exploration bonus: coef × entropy subtracted per token
    max_completion_length: int | None = None  # dr_grpo's constant divisor; None is the batch's width
    # The sampler correction in force (None: off), and the bounds of its importance weight.
    importance_sampling_mode: SamplerCorrection | None = None
    importance_sampling_clip_min: float | None = None
    importance_sampling_clip_max: float | None = 3.0

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise CohortError(f"loss_type={self.loss_type!r} is unknown; choose one of {list(LOSS_TYPES)}")
        if self.importance_sampling_level not in IMPORTANCE_LEVELS:
            raise CohortError(f"importance_sampling_level={self.importance_sampling_level!r} is unknown; choose "
                              f"one of {list(IMPORTANCE_LEVELS)}")
        if self.importance_sampling_mode is not None and self.importance_sampling_mode not in SAMPLER_CORRECTIONS:
            raise CohortError(f"importance_sampling_mode={self.importance_sampling_mode!r} is unknown; choose one "
                              f"of {list(SAMPLER_CORRECTIONS)} or None")

    @classmethod
    def from_config(cls, args, importance_sampling_mode: str | None = None) -> "LossSpec":
        """The spec of a `GRPOConfig`. `importance_sampling_mode` is the sampler correction actually in
        force, which depends on the model and device as well as the config
        (`update.policy_update.sampler_correction_mode`)."""
        return cls(loss_type=args.loss_type, epsilon=args.epsilon, epsilon_high=args.epsilon_high, beta=args.beta,
                   delta=args.delta, use_bias_correction_kl=args.use_bias_correction_kl,
                   importance_sampling_level=args.importance_sampling_level, entropy_coef=args.entropy_coef,
                   max_completion_length=args.max_completion_length,
                   importance_sampling_mode=importance_sampling_mode,
                   importance_sampling_clip_min=args.importance_sampling_clip_min,
                   importance_sampling_clip_max=args.importance_sampling_clip_max)

    @property
    def upper_epsilon(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def sequence_correction(self) -> bool:
        """The sampler weight is one per completion: it needs π_old's log-probs of every token first."""
        return self.importance_sampling_mode is not None and self.importance_sampling_mode.startswith("sequence")


@dataclass(frozen=True)
class BatchShare:
    """One micro-batch's place in the optimizer step that accumulates it, over every rank.

    The loss normalisers are those of the whole step, so how the step is cut into micro-batches and
    ranks never changes the gradient: `aggregate_loss` scales a micro-batch by `rows / step_rows`
    (DAPO: divides by `step_tokens`), and by `world_size`, because DDP averages the ranks' gradients
    where the normaliser already counted every rank's rows."""

    rows: int  # completions in this micro-batch
    step_rows: int  # completions in the step, over all ranks
    step_tokens: float  # loss tokens in the step, over all ranks (DAPO's divisor)
    world_size: int = 1

    def __post_init__(self):
        if self.rows < 0 or self.step_rows < 1 or self.step_tokens <= 0 or self.world_size < 1:
            raise CohortError(f"BatchShare(rows={self.rows}, step_rows={self.step_rows}, step_tokens="
                              f"{self.step_tokens}, world_size={self.world_size}): the step must hold at least one "
                              "row and one token")
