"""Attention for `TransformersCausalLM` (generic.py): cohort's KV cache behind transformers' attention interface.

A wrapped model's config names `ATTENTION`, so each of its attention modules calls `cache_attention` with its
queries, keys and values (after its own rotary, QK-norm, ...). During one of the wrapper's cached or shared-prompt
forwards `ACTIVE_STEP` holds that forward's `AttentionStep`: the keys and values go into cohort's `KVCache` (layer
`module.layer_idx`, the engine's rows and positions) and the queries attend over the row's cached prefix, or over
shared-prompt attention rows (shared_prefix.py); transformers builds no mask for it (`cache_mask`). Any other forward
(training, transformers' own `generate`) attends as transformers' SDPA would, with transformers' mask: a context
variable rather than a keyword, so models whose modules do not pass keywords through are served too, and a
forward in another thread is untouched.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from cohort_grpo.errors import CohortError
from cohort_grpo.kernels.decode_attention import SUPPORTED_HEAD_DIMS as DECODE_KERNEL_HEAD_DIMS
from cohort_grpo.kernels.decode_attention import decode_attention
from cohort_grpo.kernels.elementwise import cache_keys_visible, triton_allowed
from cohort_grpo.models import shared_prefix
from cohort_grpo.models.cache import KVCache

ATTENTION = "cohort_kv_cache"  # the attention implementation's name in transformers' interfaces
ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention"}
SLIDING_LAYER_TYPES = {"sliding_attention", "hybrid_sliding"}
# Layers whose recurrent state (a convolution's last inputs and a state matrix, through transformers' cache
# interface) the engine keeps per row beside the KV cache (recurrent_state.py): Gated DeltaNet and other linear
# attention, Mamba 1 and 2 mixers (transformers names them linear_attention too), LFM2's short convolution.
RECURRENT_LAYER_TYPES = {"linear_attention", "conv"}
# Layers that attend and keep a recurrent state beside (Falcon-H1's parallel attention and Mamba, ZAYA's CCA).
HYBRID_LAYER_TYPES = {"hybrid", "hybrid_sliding"}
# Layers with neither keys nor a state (Nemotron-H's MLP and mixture-of-experts blocks): no cache entry.
STATELESS_LAYER_TYPES = {"mlp", "moe"}
# Models whose layers keep a recurrent state outside transformers' cache interface: the engine cannot keep it.
OWN_STATE_MODEL_TYPES = {
    "minimax": "its lightning-attention layers keep their state through MiniMaxCache's own linear cache",
    "recurrent_gemma": "its recurrent blocks keep their state in their own modules, not in transformers' cache",
    "rwkv": "its layers pass their state as an argument, not through transformers' cache",
    "xlstm": "its layers keep their state in xLSTMCache, not through transformers' cache interface",
}

# Attention blocks shared by several layers, each call given its layer's index as an argument (Zamba's shared
# transformer block): cohort's attention function reads a module's own `layer_idx`, one cache layer per module.
SHARED_ATTENTION_MODEL_TYPES = {"zamba", "zamba2"}

# Attention that adds a learned relative-position bias to its scores (Inkling's), which cohort's attention does not
# apply; a model that passes one anyway (`position_bias`) is refused at its probe.
POSITION_BIAS_MODEL_TYPES = {"inkling_text", "inkling2_text", "inkling2_loop_text"}
POSITION_BIAS_REASON = "'s attention adds a learned relative-position bias to its scores, which cohort's attention " \
                       "does not apply"

# Attention whose mask carries learned values (Doge's dynamic mask): cohort's cached attention applies only the
# causal and window structure, so its logits would differ from the model's own.
MASK_VALUED_MODEL_TYPES = {"doge"}
# Recurrent layers read and write their state through transformers' cache methods (get_conv_state, ...), which
# transformers has had since 5.21; before, each model kept it in its own fields, which the engine's rows cannot.
STATE_INTERFACE_SINCE = "5.21"


def has_state_interface() -> bool:
    from transformers.cache_utils import Cache

    return hasattr(Cache, "get_conv_state")


class GenericPathRefused(CohortError):
    """A model the generic path cannot serve (the message says why); it takes transformers' generate instead."""


def refusal(config) -> str | None:
    """Why the generic path cannot serve a model of `config` (a transformers config), from the config alone;
    None when it may (the wrap-time check still runs)."""
    model_type = getattr(config, "model_type", "")
    if getattr(config, "is_encoder_decoder", False):
        return f"{model_type} is an encoder-decoder"
    if model_type in OWN_STATE_MODEL_TYPES:
        return f"{model_type} has recurrent layers the engine cannot keep: {OWN_STATE_MODEL_TYPES[model_type]}"
    if model_type in SHARED_ATTENTION_MODEL_TYPES:
        return (f"{model_type}'s attention block is shared by several layers that pass their layer index as an "
                "argument, which cohort's attention function does not get")
    if model_type in POSITION_BIAS_MODEL_TYPES:
        return model_type + POSITION_BIAS_REASON
    if model_type in MASK_VALUED_MODEL_TYPES:
        return f"{model_type}'s attention mask carries learned values, which cohort's cached attention does not apply"
    if keeps_recurrent_state(config) and not has_state_interface():
        import transformers

        return (f"{model_type}'s recurrent layers keep their state through transformers' cache interface of "
                f"{STATE_INTERFACE_SINCE} and later (installed: {transformers.__version__}): upgrade transformers")
    other = sorted(set(getattr(config, "layer_types", None) or []) - ATTENTION_LAYER_TYPES - RECURRENT_LAYER_TYPES
                   - HYBRID_LAYER_TYPES - STATELESS_LAYER_TYPES)
    if other:
        return f"{model_type} has layers of type {', '.join(other)}, which cohort's KV cache does not hold"
    return None


def keeps_recurrent_state(config) -> bool:
    """Whether a model of `config` has layers whose recurrent state the engine keeps (`RECURRENT_LAYER_TYPES`,
    `HYBRID_LAYER_TYPES`)."""
    return bool(set(getattr(config, "layer_types", None) or []) & (RECURRENT_LAYER_TYPES | HYBRID_LAYER_TYPES))


@dataclass
class AttentionStep:
    """What the attention modules of one forward need besides their queries, keys and values: the engine's cache
    (`cache`, rows, positions, pad tokens that must not write, the attended length), or shared-prompt attention
    rows (`packed`), or neither for the wrap-time probe, which records what each layer gives (`served`); for a model
    with recurrent layers, their rows' recurrent states (`states`, passed to the decoder as its cache); for a
    cached forward of prompts whose image tokens see their whole image (Gemma 3), each token's image block
    (`image_blocks` [B, T], -1 for a text token: vision_families.py), or with `packed`, each attention row's
    ([b, L])."""

    positions: torch.Tensor
    cache: KVCache | None = None
    cache_rows: torch.Tensor | None = None
    write_mask: torch.Tensor | None = None
    cache_len: int = 0
    packed: shared_prefix.PackedRows | None = None
    served: list = field(default_factory=list)
    states: object | None = None  # recurrent layers' states (recurrent_state.StateCache)
    image_blocks: torch.Tensor | None = None
    image_masks: dict = field(default_factory=dict)  # with `packed` and `image_blocks`: each window's mask


ACTIVE_STEP: ContextVar[AttentionStep | None] = ContextVar("cohort_attention_step", default=None)


@contextlib.contextmanager
def active_step(step: AttentionStep):
    """`step` is what every `cache_attention` call inside the block serves."""
    token = ACTIVE_STEP.set(step)
    try:
        yield
    finally:
        ACTIVE_STEP.reset(token)


def recompute_in_the_same_step():
    """torch checkpoint's `context_fn`: a checkpointed layer's recomputation in the backward runs under the
    `AttentionStep` its forward ran under (the shared-prompt attention rows of the update's forward), not under
    none, as the backward would otherwise (the context variable is unset there)."""
    return contextlib.nullcontext(), active_step(ACTIVE_STEP.get())


def layer_window(module, config, given: dict) -> int | None:
    """The sliding window of `module`'s layer: what the module passed, else its own attribute, else the config's
    layer type, else the config's one window (transformers' windows: a query at p sees keys at positions
    > p - window)."""
    if "sliding_window" in given:
        return given["sliding_window"]
    if getattr(module, "sliding_window", None) is not None:
        return module.sliding_window
    types = getattr(config, "layer_types", None)
    if types:
        return getattr(config, "sliding_window", None) if types[module.layer_idx] in SLIDING_LAYER_TYPES else None
    if getattr(config, "use_sliding_window", True):  # one window for every layer, in the model's mask (PhiMoE)
        return getattr(config, "sliding_window", None)
    return None


def attend(query, key, value, mask, scaling, softcap=None, sinks=None, dropout: float = 0.0) -> torch.Tensor:
    """Attention of q [B, H, T, D] over k/v [B, H_kv, S, D] (query head h on kv head h // (H / H_kv)) with a bool
    mask [B or 1, 1, T, S] (None: causal by index), optional tanh soft-capping of the scores, per-head sink
    logits (a column every query attends to, whose value is zero) and dropout. Returns [B, H, T, D]."""
    group = query.shape[1] // key.shape[1]
    if group > 1:
        key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=mask is None,
                                              dropout_p=dropout, scale=scaling)
    scores = (query @ key.transpose(-1, -2)).float() * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        length, keys = scores.shape[-2:]
        mask = torch.ones(length, keys, dtype=torch.bool, device=scores.device).tril(keys - length)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.float().reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        weights = torch.softmax(scores, dim=-1)
    return F.dropout(weights, dropout, training=dropout > 0).to(value.dtype) @ value


def window_mask(length: int, window: int | None, device) -> torch.Tensor | None:
    """Bool [1, 1, L, L] causal mask within `window` (None when plain causal attention is the same)."""
    if window is None or length <= window:
        return None
    index = torch.arange(length, device=device)
    allowed = (index[None, :] <= index[:, None]) & (index[None, :] > index[:, None] - window)
    return allowed[None, None]


def cache_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function signature (registered as `ATTENTION`): this layer's keys and values into
    the step's cache, then attention over the row's visible cached keys; or over the step's shared-prompt rows;
    or, probing, over this call's own keys. Returns ([B, T, H, D], None) as transformers' functions do."""
    step = ACTIVE_STEP.get()
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    extras = dict(softcap=kwargs.get("softcap"), sinks=kwargs.get("s_aux"))
    if step is None:  # transformers' own forward: its mask (SDPA's form: bool, or None for causal)
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            attention_mask = attention_mask == 0  # an additive mask: 0 where a key is seen
        out = attend(query, key, value, attention_mask, scaling, **extras, dropout=dropout)
        return out.transpose(1, 2).contiguous(), None
    width = value.shape[-1]
    if width < key.shape[-1]:  # values narrower than keys (MLA): padded with zeros, so a cache row holds one shape
        value = F.pad(value, (0, key.shape[-1] - width))
    if kwargs.get("position_bias") is not None:  # a learned bias on the scores (Inkling's relative positions)
        raise GenericPathRefused(module.config.model_type + POSITION_BIAS_REASON)
    layer = module.layer_idx
    window = layer_window(module, module.config, kwargs)
    if step.packed is not None:
        if step.image_blocks is None:
            mask = window_mask(step.packed.rows.shape[1], window, query.device)
        else:  # Gemma 3's image tokens see their whole image: a mask per attention row, made once per window
            mask = step.image_masks.get(window)
            if mask is None:
                mask = step.image_masks[window] = same_image_or_causal(step.image_blocks, window)
        packed = step.packed._replace(mask=mask)
        out = shared_prefix.packed_attention(query, key, value, packed,
                                             lambda q, k, v, m: attend(q, k, v, m, scaling, **extras))
    elif step.cache is None:  # the probe: causal over this call's tokens
        step.served.append((layer, tuple(key.shape[1:2] + key.shape[3:]), tuple(value.shape[1:2] + value.shape[3:])))
        out = attend(query, key, value, window_mask(query.shape[2], window, query.device), scaling, **extras)
    else:
        batch, cache = query.shape[0], step.cache
        cache.write(layer, step.cache_rows, step.positions, key, value, step.write_mask)
        if decode_kernel_serves(step, query, extras, dropout):
            # one query per row, straight from the cache: each cached key read once per kv head, no mask built
            out = decode_attention(query, cache.k_layers[layer], cache.v_layers[layer], step.positions,
                                   step.cache_len, window, scaling, prefix_rows=cache.prefix_rows[:batch],
                                   prefix_lens=cache.prefix_lens[:batch])
        else:
            keys, values = cache.keys_values(layer, step.cache_rows, batch, step.cache_len)
            mask = cache_keys_visible(step.positions, step.cache_len, window)
            if step.image_blocks is not None:
                mask = mask | same_image_visible(step, window)
            out = attend(query, keys, values, mask[:, None], scaling, **extras)
    return out[..., :width].transpose(1, 2).contiguous(), None


def same_image_visible(step: AttentionStep, window: int | None) -> torch.Tensor:
    """Bool [B, T, cache_len]: whether the query sees the key at each cache position as a token of its own image
    (this forward writes the whole image's keys), within a sliding layer's window below its position (transformers'
    mask: the window AND (causal OR same image))."""
    blocks, positions = step.image_blocks, step.positions
    key_blocks = torch.full((blocks.shape[0], step.cache_len), -1, dtype=blocks.dtype, device=blocks.device)
    key_blocks.scatter_(1, positions, blocks)
    same = (blocks[:, :, None] == key_blocks[:, None, :]) & (blocks[:, :, None] >= 0)
    if window is not None:
        key_positions = torch.arange(step.cache_len, device=blocks.device)
        same = same & (key_positions > positions[:, :, None] - window)
    return same


def same_image_or_causal(blocks: torch.Tensor, window: int | None) -> torch.Tensor:
    """Bool [b, 1, L, L] over attention rows whose tokens have image `blocks` [b, L] (-1: text): a query sees the
    keys at or before it and the keys of its own image, all within a sliding layer's window below it (as
    `same_image_visible` over the cache)."""
    index = torch.arange(blocks.shape[1], device=blocks.device)
    visible = (index[None, :] <= index[:, None])[None] | ((blocks[:, :, None] == blocks[:, None, :])
                                                         & (blocks[:, :, None] >= 0))
    if window is not None:
        visible = visible & (index[None, :] > index[:, None] - window)[None]
    return visible[:, None]


def decode_kernel_serves(step: AttentionStep, query: torch.Tensor, extras: dict, dropout: float) -> bool:
    """Whether a cached step's attention takes the flash-decoding kernel (kernels/decode_attention.py): one query
    per engine row (a decode step: rows 0..B-1, no pad tokens), on CUDA with triton, without autograd, soft-capping,
    sinks or dropout, at a head width the kernel takes, in the cache's dtype."""
    return (query.shape[2] == 1 and step.cache_rows is None and step.write_mask is None
            and not torch.is_grad_enabled() and not dropout and extras["softcap"] is None and extras["sinks"] is None
            and query.shape[-1] in DECODE_KERNEL_HEAD_DIMS and query.dtype == step.cache.dtype
            and triton_allowed(query))


def cache_mask(*args, **kwargs):
    """transformers' mask function for `ATTENTION`: none during a cohort step (the cache's positions or the
    attention rows are the mask), else SDPA's."""
    if ACTIVE_STEP.get() is not None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


def register_attention() -> None:
    """Register `cache_attention` and `cache_mask` in transformers' interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, cache_attention)
    AttentionMaskInterface.register(ATTENTION, cache_mask)


@contextlib.contextmanager
def attention_implementation(config, name: str):
    """`config`'s attention implementation is `name` inside the block (each attention module reads it per call)."""
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before


class LogitHead:
    """The model's head as its own forward applies it: the output embedding, then (as the config says) a logit
    scale (Cohere multiplies, Granite divides) and final soft-capping (Gemma). `weight` is the embedding's."""

    def __init__(self, linear: nn.Module, config):
        self.linear = linear
        self.multiply = getattr(config, "logit_scale", None)
        self.divide = getattr(config, "logits_scaling", None)
        self.softcap = getattr(config, "final_logit_softcapping", None)

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight

    @property
    def scale(self) -> float:
        """The logits' factor: `scale` × hidden @ weightᵀ is this head's output where it is `plain`."""
        return (1.0 if self.multiply in (None, 1) else float(self.multiply)) / (
            1.0 if self.divide in (None, 1) else float(self.divide))

    @property
    def plain(self) -> bool:
        """Whether the logits are hidden @ weightᵀ under `scale` and `softcap` alone, no bias: the update's chunked
        LM-head path then computes them (`update.logprobs.head_temperature`, `head_softcap`)."""
        return getattr(self.linear, "bias", None) is None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.linear(hidden)
        if self.multiply not in (None, 1):
            logits = logits * self.multiply
        if self.divide not in (None, 1):
            logits = logits / self.divide
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
