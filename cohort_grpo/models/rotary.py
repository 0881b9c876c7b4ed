"""Rotary position embeddings (Su et al. 2021, "RoFormer") and their scaling variants: the cos/sin
tables each decoder layer rotates q and k by."""

from __future__ import annotations

import math

import torch
from torch import nn

from cohort_grpo.models import exact_layers
from cohort_grpo.models.config import ModelConfig


def rope_inverse_frequencies(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim/2] float32, attention_factor) for the config's RoPE variant, by the
    formulas of transformers' modeling_rope_utils: linear = position interpolation (Chen et al.
    2023); llama3 = Llama 3.1's wavelength-banded scaling; yarn = YaRN (Peng et al. 2023).
    "dynamic" NTK only changes frequencies beyond max_position_embeddings; within it, it is the
    default, which is what we compute (longer contexts are not supported for it)."""
    dim = config.head_dim
    base = config.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    params = config.rope_scaling or {}
    rope_type = config.rope_type
    if rope_type == "linear":
        return inv_freq / params["factor"], 1.0
    if rope_type == "llama3":
        factor, old_len = params["factor"], params["original_max_position_embeddings"]
        low, high = params["low_freq_factor"], params["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(is_medium, smoothed, scaled), 1.0
    if rope_type == "yarn":
        return _yarn_inverse_frequencies(config, inv_freq)
    return inv_freq, 1.0


def _yarn_inverse_frequencies(config: ModelConfig, inv_freq: torch.Tensor) -> tuple[torch.Tensor, float]:
    params, dim, base = config.rope_scaling, config.head_dim, config.rope_theta
    old_len = params["original_max_position_embeddings"]
    factor = params.get("factor") or config.max_position_embeddings / old_len

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        if params.get("mscale") and params.get("mscale_all_dim"):
            attention_factor = mscale(factor, params["mscale"]) / mscale(factor, params["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(params.get("beta_fast") or 32), correction_dim(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = (inv_freq / factor) * (1 - extrapolation_weight) + inv_freq * extrapolation_weight
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for given positions; inv_freq stays float32 whatever dtype the model is cast to."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self._inv_freq_fp32, self.attention_factor = rope_inverse_frequencies(config)
        self.register_buffer("inv_freq", self._inv_freq_fp32.clone(), persistent=False)
        self.max_positions = config.max_position_embeddings
        self.numerics = "fast"
        self.exact_tables: dict = {}  # (device, dtype) -> (cos, sin) of every position, exact numerics

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.inv_freq = self._inv_freq_fp32.to(self.inv_freq.device)  # undo any dtype cast
        self.exact_tables = {}
        return self

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.numerics == "exact":
            return exact_layers.rotary_table(self, position_ids, dtype, self.max_positions)
        return self.compute(position_ids, dtype)

    def compute(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq  # [B, T, head_dim/2]
        angles = torch.cat((freqs, freqs), dim=-1)
        return (angles.cos() * self.attention_factor).to(dtype), (angles.sin() * self.attention_factor).to(dtype)
