"""`ModelConfig`: the decoder hyper-parameters, named as in Hugging Face `config.json`.

One dataclass covers the supported families; what differs between them is derived here
(q/k/v bias, per-head q/k norm, which layers use a sliding window, which layers are mixtures of
experts) so `decoder.py` needs no `model_type` branches. Mixtral is read as a Mistral whose every MLP is a
mixture of experts of `intermediate_size` with renormalised top-k weights, the block Qwen3-MoE has. Both
`config.json` RoPE layouts are read: transformers 4.x (`rope_theta` + `rope_scaling`) and 5.x (`rope_parameters`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from cohort_grpo.errors import CohortError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral")
# Mixture-of-experts settings of other families that the Qwen3-MoE / Mixtral block does not have: refused by name.
UNSUPPORTED_MOE_KEYS = ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts",
                        "first_k_dense_replace", "n_group", "topk_group", "routed_scaling_factor")
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
# transformers' RoPE base where config.json gives none (its configs' `default_theta`; 10000 for the others)
DEFAULT_ROPE_THETA = {"mixtral": 1e6}
# Keys we derive ourselves on output; everything else unknown is kept in `extra` for the round trip.
_DERIVED_KEYS = {"rope_parameters", "rope_scaling", "rope_theta", "architectures", "torch_dtype", "dtype"}


def is_supported(hf_config: dict) -> bool:
    """True when `hf_config` (a parsed HF config.json) names a model type we implement."""
    return isinstance(hf_config, dict) and hf_config.get("model_type") in SUPPORTED_MODEL_TYPES


@dataclass
class ModelConfig:
    """Decoder-only transformer hyper-parameters; attribute names equal transformers' config names."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF rope parameters without rope_theta; None = plain RoPE
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None
    layer_types: list[str] | None = None  # "full_attention" / "sliding_attention" per layer
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    torch_dtype: str | None = None
    # mixture of experts (Qwen3-MoE, Mixtral); num_experts = 0: every layer is a dense MLP
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    # ---- what differs between families ------------------------------------------------------
    @property
    def qkv_bias(self) -> bool:
        """Qwen2 always has q/k/v biases (and none on o_proj); the others follow `attention_bias`."""
        return self.model_type == "qwen2" or self.attention_bias

    @property
    def o_bias(self) -> bool:
        return self.attention_bias and self.model_type != "qwen2"

    @property
    def qk_norm(self) -> bool:
        """Qwen3 RMS-normalises each head of q and k before RoPE (Qwen3 technical report, 2025)."""
        return self.model_type in ("qwen3", "qwen3_moe")

    def is_sparse_layer(self, layer_index: int) -> bool:
        """Whether a layer's MLP is a mixture of experts, by transformers' Qwen3-MoE rule."""
        return (self.num_experts > 0 and layer_index not in self.mlp_only_layers
                and (layer_index + 1) % self.decoder_sparse_step == 0)

    @property
    def sparse_layers(self) -> list[int]:
        """The indices of the mixture-of-experts layers, in order."""
        return [i for i in range(self.num_hidden_layers) if self.is_sparse_layer(i)]

    @property
    def rope_type(self) -> str:
        return (self.rope_scaling or {}).get("rope_type", "default")

    def layer_sliding_window(self, layer_index: int) -> int | None:
        """The sliding-window width of a layer, or None for full causal attention."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer_index] == "sliding_attention" else None

    # ---- config.json conversion ------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, hf: dict) -> "ModelConfig":
        """Build from a parsed HF config.json; CohortError for an unsupported model type or RoPE type."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise CohortError(
                f"unsupported model_type {model_type!r}: cohort implements {', '.join(SUPPORTED_MODEL_TYPES)}; "
                "pick a model of one of these families"
            )
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [key for key in required if hf.get(key) is None]
        if missing:
            raise CohortError(f"model config.json lacks {', '.join(missing)}; it is not a complete {model_type} config")
        heads = hf["num_attention_heads"]
        rope_theta, rope_scaling = _read_rope(hf, DEFAULT_ROPE_THETA.get(model_type, 10000.0))
        sliding_window, layer_types = _read_sliding_window(hf, model_type)
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        moe = _read_moe(hf, model_type) if model_type in MOE_MODEL_TYPES else {}
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            hidden_act=hf.get("hidden_act", "silu"),
            sliding_window=sliding_window,
            layer_types=layer_types,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
            torch_dtype=hf.get("torch_dtype") or hf.get("dtype"),
            **moe,
            extra={k: v for k, v in hf.items() if k not in known and k not in _DERIVED_KEYS | {"num_local_experts"}},
        )

    def to_hf_dict(self) -> dict:
        """A config.json dict that transformers 4.x (rope_theta/rope_scaling) and 5.x (rope_parameters) load."""
        out = dict(self.extra)
        moe_fields = {f.name for f in dataclasses.fields(self)} & set(_MOE_DEFAULTS)
        for f in dataclasses.fields(self):
            if f.name in moe_fields and (self.num_experts == 0 or self.model_type == "mixtral"):
                continue
            if f.name not in ("extra", "rope_scaling", "rope_theta", "layer_types"):
                out[f.name] = getattr(self, f.name)
        if self.layer_types is not None:
            out["layer_types"] = list(self.layer_types)
        if self.model_type in ("qwen2", "qwen3", "qwen3_moe"):
            out["use_sliding_window"] = self.sliding_window is not None
        if self.model_type == "mixtral":  # its own names; its expert size and renormalisation are implied
            out.update(num_local_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok)
        out["architectures"] = [ARCHITECTURES[self.model_type]]
        out["rope_theta"] = self.rope_theta
        out["rope_parameters"] = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            out["rope_scaling"] = dict(self.rope_scaling)
        if self.torch_dtype is None:
            out.pop("torch_dtype")
        return out


def _read_rope(hf: dict, default_theta: float = 10000.0) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict or None) from either config.json RoPE layout."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_theta = float(params.pop("rope_theta", None) or hf.get("rope_theta") or default_theta)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CohortError(
            f"unsupported RoPE type {rope_type!r} in config.json: cohort implements {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return rope_theta, None
    if rope_type in ("llama3", "yarn"):
        # transformers' fallbacks when the pretraining length is not given (modeling_rope_utils.py)
        original = hf.get("original_max_position_embeddings")
        params.setdefault("original_max_position_embeddings", original or hf.get("max_position_embeddings", 2048))
    return rope_theta, {"rope_type": rope_type, **params}


_MOE_DEFAULTS = dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                     decoder_sparse_step=1, mlp_only_layers=[])


def _read_moe(hf: dict, model_type: str) -> dict:
    """The expert settings of Qwen3-MoE or Mixtral (transformers' defaults where absent); a setting of
    another MoE family (shared experts, grouped routing, ...) or one the block lacks is refused by name."""
    family = "Mixtral" if model_type == "mixtral" else "Qwen3-MoE"
    unsupported = [key for key in UNSUPPORTED_MOE_KEYS if hf.get(key)]
    # Mixtral's router jitter multiplies the router's input by noise while training; cohort's router has none
    unsupported += [f"router_jitter_noise={hf['router_jitter_noise']}"] if hf.get("router_jitter_noise") else []
    if hf.get("hidden_act", "silu") != "silu":  # the experts' grouped products are SwiGLU
        unsupported.append(f"hidden_act={hf['hidden_act']}")
    if unsupported:
        raise CohortError(f"config.json sets {', '.join(unsupported)}, which cohort's {family} does not implement; "
                          "use a model without them or --model_impl hf")
    if model_type == "mixtral":  # every layer sparse, experts as wide as the dense MLP would be, top-k renormalised
        moe = dict(num_experts=hf.get("num_local_experts") or hf.get("num_experts") or 8,
                   num_experts_per_tok=hf.get("num_experts_per_tok", 2), moe_intermediate_size=hf["intermediate_size"],
                   norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    else:
        moe = {key: hf.get(key, default) for key, default in _MOE_DEFAULTS.items()}
        moe["num_experts"] = hf.get("num_experts") or hf.get("num_local_experts") or _MOE_DEFAULTS["num_experts"]
        moe["mlp_only_layers"] = list(moe["mlp_only_layers"] or [])
    if moe["num_experts_per_tok"] > moe["num_experts"]:
        raise CohortError(f"config.json has num_experts_per_tok={moe['num_experts_per_tok']} > num_experts="
                          f"{moe['num_experts']}; fix config.json")
    return moe


def _read_sliding_window(hf: dict, model_type: str) -> tuple[int | None, list[str] | None]:
    """Sliding window width and per-layer attention kinds, by each family's rules in transformers."""
    window = hf.get("sliding_window")
    if model_type == "llama" or window is None:
        return None, None
    if model_type == "qwen3_moe":  # transformers gives every layer the window when it is on
        return (int(window), None) if hf.get("use_sliding_window", False) else (None, None)
    if model_type in ("qwen2", "qwen3"):
        if not hf.get("use_sliding_window", False):
            return None, None
        layer_types = hf.get("layer_types")
        if layer_types is None:
            first_sliding = hf.get("max_window_layers", hf["num_hidden_layers"])
            layer_types = [
                "sliding_attention" if i >= first_sliding else "full_attention" for i in range(hf["num_hidden_layers"])
            ]
        return int(window), list(layer_types)
    return int(window), None  # mistral: every layer
