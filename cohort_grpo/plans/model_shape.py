"""`ModelShape`: what the memory plans read of a model that cohort does not implement itself.

The plans (sampling_plan.py, training_plan.py, training_slots.py) price a model from its shape: the layers, heads,
head width, hidden and MLP widths and vocabulary of a native `ModelConfig`, every layer's KV cache alike. A
transformers model on the generic path (`cohort_grpo.models.generic.TransformersCausalLM`) has a config of its own
family's spelling, and its engine cache is what the wrap-time probe found: each layer's own (kv heads, head dim)
(wider global heads, a layer that reuses another's keys or keeps only a recurrent state holds (0, 0)), and each
sequence's recurrent states beside. `ModelShape` carries the fields the plans read under `ModelConfig`'s names,
the probed cache shapes, and the weights as the model holds them, so a plan prices such a model as its engine
allocates it. A native `ModelConfig` goes to the plans as it is: its numbers do not move.

Every cache layer is as long as a slot (the engine keeps a sliding-window layer's whole length too), so the
probed shapes are the whole of a slot's keys and values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cohort_grpo.models.config import ModelConfig
from cohort_grpo.models.recurrent_state import row_bytes


@dataclass
class ModelShape(ModelConfig):
    """A generic-path model as the plans see it: a `ModelConfig` of the widths the activation and LoRA estimates read
    (a dense MLP in every layer), with `kv_cache_layer_shapes` each layer's (kv heads, head dim) in the engine's
    cache and `parameters` the weights the model holds (tied ones once)."""

    kv_cache_layer_shapes: tuple[tuple[int, int], ...] = field(default=(), kw_only=True)
    parameters: int = field(default=0, kw_only=True)

    @property
    def kv_elements_per_token(self) -> int:
        """Keys of one token over every layer (as many values again)."""
        return sum(heads * width for heads, width in self.kv_cache_layer_shapes)

    @classmethod
    def of(cls, model) -> "ModelShape":
        """The shape of a wrapped transformers model (`TransformersCausalLM`, probed): widths from its (text) config,
        the KV heads and head width of its widest cache layer (a config may give them per layer only), the cache its
        probe's."""
        config = model.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        shapes = tuple(model.kv_cache_layer_shapes)
        hidden = text.hidden_size
        kv_heads, head_dim = max(shapes, key=lambda shape: shape[0] * shape[1])
        # a model of state-space layers only (Mamba) has no heads: one of the hidden width stands for its mixer
        heads = config_value(text, "num_attention_heads") or kv_heads or 1
        return cls(model_type=model.model_type, vocab_size=text.vocab_size, hidden_size=hidden,
                   intermediate_size=config_value(text, "intermediate_size") or 4 * hidden,
                   num_hidden_layers=len(shapes), num_attention_heads=heads, num_key_value_heads=kv_heads,
                   head_dim=head_dim or hidden // heads,
                   tie_word_embeddings=bool(config_value(text, "tie_word_embeddings")),
                   kv_cache_layer_shapes=shapes, parameters=sum(p.numel() for p in model.parameters()))


def config_value(config, name: str):
    """`config.name`, or None where the config has none or gives it per layer only (reading it then raises)."""
    try:
        return getattr(config, name, None)
    except Exception:  # transformers' per-layer attributes refuse a global read
        return None


def planned_shape(model):
    """What the plans price `model` (its base model, outside LoRA) by: a native `ModelConfig`, a generic-path model's
    `ModelShape`; None for a model cohort's engine does not sample (transformers' generate serves it)."""
    config = getattr(model, "config", None)
    if isinstance(config, ModelConfig):  # a native model's (a `ModelShape` is made here, never a model's config)
        return config
    if getattr(model, "kv_cache_layer_shapes", None) is not None:
        return ModelShape.of(model)
    return None


def slot_state_bytes(model, dtype: torch.dtype) -> int:
    """Each engine sequence's recurrent states of `model` (its base model) in a cache of `dtype`: the probed state
    shapes of a generic-path model's recurrent layers (models/recurrent_state.py `row_bytes`); 0 without."""
    shapes = getattr(model, "recurrent_state_shapes", None)
    return row_bytes(shapes, dtype) if shapes else 0
