"""π_ref, the KL term's reference policy: a frozen copy of the policy, or with LoRA the policy itself with its
adapters switched off, or none (β = 0).

At each outer iteration of Algorithm 1, π_ref ← π_θ: the copy takes the policy's weights (inside the memory
manager's reference pass, which may keep the copy on the host between passes), or the LoRA adapters are folded
into the base so that the adapters-off model is the current policy.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Callable

import torch
from torch import nn

from cohort_grpo.models.lora import adapters_disabled, has_lora, merge_into_base


class ReferencePolicy:
    """`model`: π_θ; `ref_model`: π_ref's own copy (None: none, or LoRA's adapters-off policy when
    `uses_reference`); `reference_pass(modified=False)`: the memory manager's block around a use of the copy;
    `logprobs(model, batch)`: the per-token log-probs of a batch under a model, no gradient."""

    def __init__(self, model: nn.Module, ref_model: nn.Module | None, uses_reference: bool,
                 reference_pass: Callable[..., AbstractContextManager], logprobs: Callable):
        self.model, self.ref_model, self.uses_reference = model, ref_model, uses_reference
        self.reference_pass, self.policy_logprobs = reference_pass, logprobs

    def reset(self, optimizer: torch.optim.Optimizer) -> None:
        """π_ref ← π_θ: copy the weights, or with LoRA fold the adapters into the base (models/lora.py)."""
        if self.ref_model is not None:
            with self.reference_pass(modified=True):
                self.ref_model.load_state_dict(self.model.state_dict())
        elif has_lora(self.model) and self.uses_reference:
            for param in merge_into_base(self.model):
                optimizer.state.pop(param, None)  # B restarts at 0: its AdamW moments start over too

    def logprobs(self, batch) -> torch.Tensor | None:
        """`[B, T]` log π_ref of the batch, None without a reference."""
        if self.ref_model is not None:
            with self.reference_pass():
                return self.policy_logprobs(self.ref_model, batch)
        if self.uses_reference:  # LoRA: the reference is this very model with its adapters switched off
            with adapters_disabled(self.model):
                return self.policy_logprobs(self.model, batch)
        return None
