"""The policy's dropout: on in the update (train mode), off in the no-grad passes of π_old, π_ref and the sampler
(eval mode). With dropout on, log π_θ in the update is a noisy draw while the others are not, so the ratio
π_θ/π_old and the KL to π_ref carry that noise; TRL's `disable_dropout` turns it off. cohort's own models have
none; transformers models keep their config's (GPT-2's 0.1, for one)."""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn


def acting_dropouts(model: nn.Module) -> Iterator[tuple[str, nn.Module, str]]:
    """(name, module, the attribute holding its rate) of each of `model`'s dropouts that acts in train mode:
    `nn.Dropout` modules with p > 0 (LoRA's adapters' included) and attention modules whose `attention_dropout`
    (transformers' float) is above 0."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Dropout) and module.p > 0:
            yield name, module, "p"
        elif isinstance(getattr(module, "attention_dropout", None), float) and module.attention_dropout > 0:
            yield f"{name} (attention)", module, "attention_dropout"


def active_dropouts(model: nn.Module) -> list[str]:
    """The names of `model`'s dropouts that act in train mode (`acting_dropouts`)."""
    return [name for name, _, _ in acting_dropouts(model)]


def disable_dropout(model: nn.Module) -> int:
    """Every dropout `acting_dropouts` finds set to 0, in place; how many there were."""
    found = list(acting_dropouts(model))
    for _, module, rate in found:
        setattr(module, rate, 0.0)
    return len(found)
