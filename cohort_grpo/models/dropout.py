"""The policy's dropout: on in the update (train mode), off in the no-grad passes of π_old, π_ref and the sampler
(eval mode). With dropout on, log π_θ in the update is a noisy draw while the others are not, so the ratio
π_θ/π_old and the KL to π_ref carry that noise; TRL's `disable_dropout` turns it off. cohort's own models have
none; transformers models keep their config's (GPT-2's 0.1, for one)."""

from __future__ import annotations

from torch import nn


def active_dropouts(model: nn.Module) -> list[str]:
    """The names of `model`'s dropouts that act in train mode: `nn.Dropout` modules with p > 0 (LoRA's adapters'
    included) and attention modules whose `attention_dropout` (transformers' float) is above 0."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Dropout) and module.p > 0:
            names.append(name)
        elif isinstance(getattr(module, "attention_dropout", None), float) and module.attention_dropout > 0:
            names.append(f"{name} (attention)")
    return names


def disable_dropout(model: nn.Module) -> int:
    """Every dropout `active_dropouts` finds set to 0, in place; how many there were."""
    count = 0
    for module in model.modules():
        if isinstance(module, nn.Dropout) and module.p > 0:
            module.p, count = 0.0, count + 1
        elif isinstance(getattr(module, "attention_dropout", None), float) and module.attention_dropout > 0:
            module.attention_dropout, count = 0.0, count + 1
    return count
