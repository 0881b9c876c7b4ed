"""The settings of supervised fine-tuning (`cohort_grpo.sft.sft_trainer.sft_train`), importable without torch so that
`cohort-grpo sft --help` shows their defaults at once."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SFTConfig:
    learning_rate: float = 1e-3
    max_steps: int = 300
    batch_size: int = 32
    warmup_steps: int = 20
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    seed: int = 0
    logging_steps: int = 50
    max_completion_length: int | None = None  # truncate longer targets (their EOS is then dropped)
    chat_template_kwargs: dict | None = None  # as GRPOConfig's: the prompts SFT trains on are the ones GRPO samples
