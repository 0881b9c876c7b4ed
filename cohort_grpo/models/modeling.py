"""Our decoder: Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE and Mixtral in one small module.

All four are the Llama block (Touvron et al. 2023): pre-RMSNorm (Zhang & Sennrich 2019), rotary
position embeddings (Su et al. 2021, "RoFormer"), grouped-query attention (Ainslie et al. 2023)
and a SwiGLU MLP (Shazeer 2020). The family differences are config flags (see `config.py`): Qwen2
has q/k/v biases, Qwen3 RMS-normalises each q/k head, Mistral/Qwen2 may use a sliding window.
Qwen3-MoE is Qwen3 whose MLPs are (in the layers its config names) mixtures of experts (`moe.py`);
Mixtral is Mistral whose every MLP is one.

Parameter names equal transformers' (`model.layers.0.self_attn.q_proj.weight`, ...) so a state
dict moves between the two unchanged. Attention goes through `F.scaled_dot_product_attention`.
With a `KVCache` the forward has static shapes and no host sync, so a decode step is CUDA-graph
capturable: keys are written in place (`index_put_`) and the mask is built from `position_ids`.
Decode (default cache rows 0..B-1) reads the cache as a view and folds grouped-query heads instead
of expanding k/v, so a step reads each cached key once. With fused kernels on and autograd off
(sampling), the same math is regrouped into fewer kernels (`cohort_grpo/kernels/elementwise.py`: residual
add + RMSNorm, norm + rotary + cache write, the attention mask built once per step).

`save_pretrained` writes the model as a Hugging Face folder; `loading.from_pretrained` reads one.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from cohort_grpo.errors import CohortError
from cohort_grpo.kernels import elementwise as kernels
from cohort_grpo.models.cache import KVCache
from cohort_grpo.kernels.decode_attention import SUPPORTED_HEAD_DIMS as DECODE_KERNEL_HEAD_DIMS
from cohort_grpo.kernels.decode_attention import decode_attention
from cohort_grpo.models.files import save_safetensors
from cohort_grpo.models.fusion import fused_weight
from cohort_grpo.models.moe import LayerRouting, Routing, SparseMoeBlock, split_expert_weights
from cohort_grpo.models import exact_layers, shared_prefix
from cohort_grpo.models.training_compile import run_layer
from cohort_grpo.models.config import ModelConfig
from cohort_grpo.models.rotary import RotaryEmbedding

ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), computed in float32 like transformers' LlamaRMSNorm."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.numerics = "fast"  # "exact": batch-invariant (exact_layers.py); set by CausalLM.set_numerics

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.numerics == "exact":
            return exact_layers.rms_norm(self, x)
        return kernels.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, qkv_bias = config.hidden_size, config.qkv_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.fused_qkv = None  # (weight, bias) view of q/k/v as one matrix, see fusion.py
        self.sliding_window = config.layer_sliding_window(layer_index)
        self.numerics = "fast"

    def fuse(self) -> None:
        self.fused_qkv = fused_weight([self.q_proj, self.k_proj, self.v_proj])

    def project_qkv(self, x):
        fused = self.fused_qkv
        if fused is not None and not torch.is_grad_enabled() and fused[0].data_ptr() == self.q_proj.weight.data_ptr():
            q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            return F.linear(x, *fused).split([q_size, kv_size, kv_size], dim=-1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(self, x, cos, sin, mask, kv_cache=None, cache_rows=None, position_ids=None,
                write_mask=None, cache_len=None, decode_kernel=False):
        if self.numerics == "exact":
            return exact_layers.attention_forward(self, x, cos, sin, mask, kv_cache, cache_rows, position_ids,
                                                  write_mask, cache_len)
        batch, length, _ = x.shape
        q, k, v = self.project_qkv(x)
        q = q.reshape(batch, length, self.num_heads, self.head_dim)
        k = k.reshape(batch, length, self.num_kv_heads, self.head_dim)
        v = v.reshape(batch, length, self.num_kv_heads, self.head_dim)
        if kv_cache is not None and cache_rows is None and write_mask is None and kernels.fused_path():
            # decode: norm, rotary and cache write as one piece (kernels.rotate_and_cache)
            has_norms = hasattr(self, "q_norm")
            norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if has_norms else (None, None, 0.0)
            cache_k, cache_v = kv_cache.k_layers[self.layer_index], kv_cache.v_layers[self.layer_index]
            q = kernels.rotate_and_cache(q, k, v, cos, sin, *norms, cache_k, cache_v, position_ids)
            if decode_kernel:  # one query per row: flash-decoding straight from the cache (kernels/decode_attention.py)
                out = decode_attention(q, cache_k, cache_v, position_ids, cache_len, self.sliding_window,
                                       prefix_rows=kv_cache.prefix_rows[:batch], prefix_lens=kv_cache.prefix_lens[:batch])
                return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))
            k, v = kv_cache.keys_values(self.layer_index, None, batch, cache_len)
        else:
            v = v.transpose(1, 2)
            if hasattr(self, "q_norm"):
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = kernels.rotate(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            if kv_cache is not None:
                kv_cache.write(self.layer_index, cache_rows, position_ids, k, v, write_mask)
                k, v = kv_cache.keys_values(self.layer_index, cache_rows, batch, cache_len)
        out = grouped_query_attention(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


def _native_gqa_is_fast(q: torch.Tensor) -> bool:
    """Whether SDPA's `enable_gqa` reaches a kernel that shares k/v heads itself: FlashAttention
    (CUDA, half precision) does; the other backends repeat k/v internally or fall back to the math
    kernel, so there an explicit repeat into the memory-efficient kernel is no worse."""
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256


def grouped_query_attention(q, k, v, mask):
    """SDPA with q [B, H, T, D] and k/v [B, H_kv, S, D], query head h using kv head h // (H / H_kv)
    (Ainslie et al. 2023).

    With a mask (padding, sliding window, or the KV cache's position mask) the `group` query heads
    of a kv head are folded into the query-length axis, q -> [B, H_kv, group*T, D], so keys and
    values (e.g. a view of the whole KV cache) are read once per kv head and never copied. A
    decode mask [B, 1, 1, S] broadcasts over the folded queries as it is. Plain causal attention
    (no mask) cannot fold (is_causal aligns T queries with T keys): it uses SDPA's native GQA where
    FlashAttention serves it, else repeats k/v."""
    if shared_prefix.is_packed(mask):  # flat shared-prompt tokens: attend in per-completion rows
        return shared_prefix.packed_attention(q, k, v, mask, grouped_query_attention)
    batch, heads, length, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    if group == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
    if mask is None:
        if _native_gqa_is_fast(q):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    folded_q = q.reshape(batch, kv_heads, group * length, dim)
    if mask.shape[-2] > 1:  # one mask row per query: repeat it for each head of the group
        mask = mask[:, :, None].expand(-1, -1, group, -1, -1).reshape(mask.shape[0], 1, group * length, -1)
    out = F.scaled_dot_product_attention(folded_q, k, v, attn_mask=mask)
    return out.reshape(batch, heads, length, dim)


class MLP(nn.Module):
    """SwiGLU: down(act(gate(x)) * up(x)) (Shazeer 2020)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)
        self.act = ACTIVATIONS[config.hidden_act]
        self.is_silu = config.hidden_act == "silu"
        self.fused_gate_up = None  # (weight, bias) view of gate/up as one matrix, see fusion.py
        self.numerics = "fast"

    def fuse(self) -> None:
        self.fused_gate_up = fused_weight([self.gate_proj, self.up_proj])

    def forward(self, x):
        if self.numerics == "exact":
            return exact_layers.mlp_forward(self, x)
        fused = self.fused_gate_up
        if fused is not None and not torch.is_grad_enabled() and fused[0].data_ptr() == self.gate_proj.weight.data_ptr():
            gate, up = F.linear(x, *fused).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        if self.is_silu:
            return self.down_proj(kernels.swiglu_gate(gate, up))
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.self_attn = Attention(config, layer_index)
        self.sparse = config.is_sparse_layer(layer_index)
        self.mlp = SparseMoeBlock(config, config.sparse_layers.index(layer_index)) if self.sparse else MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, mask, routing: LayerRouting | None = None, **cache_args):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, **cache_args)
        return x + self.feed_forward(self.post_attention_layernorm(x), routing, cache_args)

    def feed_forward(self, x, routing: LayerRouting | None, cache_args: dict):
        """The MLP; a mixture of experts also reads the routing and records its routes in the cache."""
        return self.mlp(x, routing, **cache_args) if self.sparse else self.mlp(x)

    def forward_fused(self, residual, normed, cos, sin, mask, next_norm: RMSNorm, routing: LayerRouting | None = None,
                      **cache_args):
        """`forward` regrouped for the sampling path: takes the residual stream and its input norm
        already applied, returns (residual, next_norm(residual)), each residual add computed with
        the norm after it (kernels.add_rms_norm), the last one with the next layer's input norm."""
        residual, normed = kernels.add_rms_norm(residual, self.self_attn(normed, cos, sin, mask, **cache_args),
                                                self.post_attention_layernorm.weight,
                                                self.post_attention_layernorm.eps)
        return kernels.add_rms_norm(residual, self.feed_forward(normed, routing, cache_args), next_norm.weight,
                                    next_norm.eps)


class DecoderModel(nn.Module):
    """The `model.` prefix of HF checkpoints: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


def _padding_causal_mask(length: int, attention_mask, window: int | None, device) -> torch.Tensor | None:
    """Bool mask [B or 1, 1, T, T] by token index (HF semantics); None when plain causal suffices."""
    if attention_mask is None and (window is None or length <= window):
        return None
    index = torch.arange(length, device=device)
    allowed = index[None, :] <= index[:, None]
    if window is not None:
        allowed = allowed & (index[None, :] > index[:, None] - window)
    allowed = allowed[None, None]
    if attention_mask is not None:
        allowed = allowed & attention_mask.bool()[:, None, None, :]
        # a pad query would see no key at all (NaN softmax): let it see itself; its output is ignored
        allowed = allowed | torch.eye(length, dtype=torch.bool, device=device)
    return allowed


def _cache_mask(position_ids: torch.Tensor, cache_len: int, window: int | None) -> torch.Tensor:
    """Bool mask [B, 1, T, cache_len]: a query at position p sees its row's keys at positions <= p."""
    return kernels.cache_keys_visible(position_ids, cache_len, window)[:, None]


class CausalLM(nn.Module):
    """Decoder-only LM with the Model contract of docs/architecture.md."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self._config = config
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.gradient_checkpointing = False
        self.checkpointed_layers: int | None = None  # recompute the first N layers only (None: all)
        self.training_layer_call = None  # a CompiledLayerCall after compile_for_training()
        self.activation_probe = None  # measures the first kept layer (gradient_checkpointing_layers=auto)
        self.numerics = "fast"
        self.apply(self._init_weights)
        self.tie_weights()

    def set_numerics(self, numerics: str) -> None:
        """"fast" (the default: each path its fastest kernels) or "exact": the engine's and the trainer's
        forwards compute every token with the same operations, so their log-probs are equal bit for bit
        (exact_layers.py). Set on the model and each of its layers; copies (π_ref) inherit it."""
        exact_layers.check_numerics(numerics)
        if numerics == "exact":
            exact_layers.check_model(self)
        for module in self.modules():
            if hasattr(module, "numerics"):
                module.numerics = numerics

    @staticmethod
    def _init_weights(module: nn.Module, std: float = 0.02) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def tie_weights(self) -> None:
        if self._config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def config(self) -> ModelConfig:
        return self._config

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())  # parameters() yields a tied weight once

    def fuse_projections(self) -> None:
        """Let no-grad forwards read q/k/v and gate/up as one matrix each (fusion.py); idempotent,
        and cheap when already fused. Call it outside inference mode (it may re-point parameters)."""
        for layer in self.model.layers:
            # LoRA (peft) wraps projections in its own layers: a fused matrix would skip the adapters
            if all(type(m) is nn.Linear for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)):
                layer.self_attn.fuse()
            if not layer.sparse and all(type(m) is nn.Linear for m in (layer.mlp.gate_proj, layer.mlp.up_proj)):
                layer.mlp.fuse()

    def gradient_checkpointing_enable(self, checkpointed_layers: int | None = None, activation_probe=None,
                                      **_ignored) -> None:
        """Recompute layers in the backward instead of keeping their activations: all of them, or the
        first `checkpointed_layers` (the later ones keep theirs: less recomputation, more memory).
        `activation_probe` (cohort_grpo/memory/checkpointed_layers.py) measures the first kept layer."""
        self.gradient_checkpointing = True
        self.checkpointed_layers = checkpointed_layers
        self.activation_probe = activation_probe

    def gradient_checkpointing_disable(self) -> None:
        self.gradient_checkpointing = False

    def compile_for_training(self) -> None:
        """Run each decoder layer compiled in full-sequence forwards (cohort_grpo/models/training_compile.py)."""
        from cohort_grpo.models.training_compile import CompiledLayerCall

        self.training_layer_call = CompiledLayerCall()

    def save_pretrained(self, out_dir, state: dict | None = None) -> Path:
        """Write this model as a Hugging Face folder (the module-level `save_pretrained` below)."""
        return save_pretrained(self, out_dir, state=state)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, *, kv_cache: KVCache | None = None,
                cache_rows: torch.Tensor | None = None, return_hidden: bool = False,
                cache_len: int | None = None, attention_rows: torch.Tensor | None = None,
                attention_slots: torch.Tensor | None = None, routing: Routing | None = None) -> torch.Tensor:
        """Logits [B, T, V], or final normed hidden states [B, T, H] with `return_hidden`.

        Without `kv_cache`: causal attention by token index, `attention_mask` [B, T] (1 = real,
        0 = pad) hides pad keys as in transformers; `position_ids` default to 0..T-1 and only
        place RoPE. With `kv_cache`: token t of row b is written at cache row `cache_rows[b]`
        (default b, and then the cache is read as a view, never copied), position
        `position_ids[b, t]`, and attends to that row's keys at positions <= its own (and > its
        own - window for sliding layers); `attention_mask` then only stops pad tokens from writing.
        `cache_len` (static, > every position in position_ids) limits attention to the first
        cache_len slots. `attention_rows` [b, L] and `attention_slots` [N] (no cache, one flat row
        of N tokens): attention runs over the rows of flat token indices `attention_rows`, each
        token's output read back from slot `attention_slots` of them (shared_prefix.py, the
        shared-prompt layout of cohort_grpo/update/packing.py); `position_ids` then give each token's position.
        `routing` (mixture-of-experts models): expert ids to replay, [*input_ids.shape, MoE layers, k],
        and what the MoE layers report (`moe.Routing`).
        """
        batch, length = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(length, device=input_ids.device).expand(batch, length)
        hidden = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(position_ids, hidden.dtype)
        if attention_rows is not None and (kv_cache is not None or attention_mask is not None or batch != 1
                                           or attention_slots is None):
            raise CohortError("attention_rows (shared-prompt packing) need one flat row of tokens, "
                              "attention_slots, and no kv_cache or attention_mask")
        cache_args = {}
        if kv_cache is not None:
            cache_args = self._cache_args(hidden, kv_cache, cache_rows, position_ids, attention_mask, cache_len)
        masks = self._attention_masks(input_ids, position_ids, attention_mask, hidden.dtype, kv_cache=kv_cache,
                                      cache_args=cache_args, attention_rows=attention_rows,
                                      attention_slots=attention_slots)
        if kernels.fused_path() and self.numerics != "exact":
            hidden = self._fused_layers(hidden, cos, sin, masks, cache_args, routing)
        else:
            hidden = self._unfused_layers(hidden, cos, sin, masks, cache_args, routing, cached=kv_cache is not None)
        return hidden if return_hidden else exact_layers.head_logits(self, hidden)

    def _cache_args(self, hidden: torch.Tensor, kv_cache: KVCache, cache_rows: torch.Tensor | None,
                    position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                    cache_len: int | None) -> dict:
        """The keyword arguments with which each layer reads and writes `kv_cache` (`Attention.forward`);
        `cache_len` defaults to the cache's length."""
        batch, length = hidden.shape[:2]
        if cache_rows is None and batch > kv_cache.num_rows:
            raise CohortError(f"batch of {batch} rows does not fit a KVCache of {kv_cache.num_rows} rows: "
                              "pass cache_rows or allocate more rows")
        cache_len = kv_cache.max_len if cache_len is None else cache_len
        # A decode step (one token per row, default cache rows) on the sampling path attends
        # through the Triton kernel, which masks by position itself: no mask to build.
        decode_kernel = (length == 1 and cache_rows is None and attention_mask is None and self.numerics != "exact"
                         and self._config.head_dim in DECODE_KERNEL_HEAD_DIMS and kernels.triton_kernel_on(hidden))
        return dict(kv_cache=kv_cache, cache_rows=cache_rows, position_ids=position_ids, write_mask=attention_mask,
                    cache_len=cache_len, decode_kernel=decode_kernel)

    def _attention_masks(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                         attention_mask: torch.Tensor | None, dtype: torch.dtype, *, kv_cache: KVCache | None,
                         cache_args: dict, attention_rows: torch.Tensor | None,
                         attention_slots: torch.Tensor | None) -> dict:
        """The attention mask of each sliding window the layers use (None: full attention), built once
        for all layers, in the form the forward's path reads (see `forward` for the arguments)."""
        windows = {self._config.layer_sliding_window(i) for i in range(self._config.num_hidden_layers)}
        device = input_ids.device
        # exact numerics: no mask, each layer's exact attention gets the keys each query sees (exact_layers.py)
        if self.numerics == "exact":
            return exact_layers.masks(input_ids, position_ids, attention_mask, kv_cache, attention_rows,
                                      attention_slots, windows)
        if attention_rows is not None:
            return {w: shared_prefix.PackedRows(attention_rows, attention_slots,
                                                _padding_causal_mask(attention_rows.shape[1], None, w, device))
                    for w in windows}
        if kv_cache is None:
            return {w: _padding_causal_mask(input_ids.shape[1], attention_mask, w, device) for w in windows}
        if cache_args["decode_kernel"]:
            return dict.fromkeys(windows)
        cache_len = cache_args["cache_len"]
        if kernels.fused_path():  # the additive form SDPA would rebuild in every layer, built once
            return {w: kernels.cache_attention_bias(position_ids, cache_len, w, dtype) for w in windows}
        return {w: _cache_mask(position_ids, cache_len, w) for w in windows}

    def _unfused_layers(self, hidden, cos, sin, masks, cache_args, routing: Routing | None, *,
                        cached: bool) -> torch.Tensor:
        """The decoder layers and final norm, one layer call each: every forward but the sampling path's fused
        one (`_fused_layers`). In a full-sequence forward (not `cached`) each layer runs compiled after
        `compile_for_training`, and in training the first `checkpointed_layers` are recomputed in the
        backward. Returns the final normed hidden states."""
        # MoE layers too: each gets its own slice of the routing (LayerRouting), so one graph serves them all
        compiled = self.training_layer_call if not cached and self.numerics != "exact" else None
        recomputed = 0  # layers [0, recomputed) are checkpointed
        if self.gradient_checkpointing and self.training and not cached:
            recomputed = len(self.model.layers) if self.checkpointed_layers is None else self.checkpointed_layers
        probe = self.activation_probe if self.training and torch.is_grad_enabled() else None
        for i, layer in enumerate(self.model.layers):
            mask = masks[self._config.layer_sliding_window(i)]
            layer_routing = _layer_routing(layer, routing)
            layer_args = {} if layer_routing is None else {"routing": layer_routing}
            if i < recomputed:
                hidden = checkpoint(compiled or run_layer, layer, hidden, cos, sin, mask, use_reentrant=False,
                                    **layer_args)
            elif probe is not None and i == recomputed:  # the first kept layer: what it keeps, measured
                run = compiled or run_layer
                hidden = probe.around(lambda: run(layer, hidden, cos, sin, mask, **layer_args),
                                      hidden.shape[0] * hidden.shape[1])
            elif compiled is not None:
                hidden = compiled(layer, hidden, cos, sin, mask, **layer_args)
            else:
                hidden = layer(hidden, cos, sin, mask, **layer_args, **cache_args)
            if layer_routing is not None:
                routing.add(layer_routing)
        return self.model.norm(hidden)

    def _fused_layers(self, hidden, cos, sin, masks, cache_args, routing: Routing | None) -> torch.Tensor:
        """The decoder layers and final norm on the sampling path: the residual add ending each
        layer is fused with the next layer's input norm, the last one with the final norm
        (DecoderLayer.forward_fused). Returns the final normed hidden states."""
        layers = self.model.layers
        next_norms = [layer.input_layernorm for layer in layers[1:]] + [self.model.norm]
        normed = layers[0].input_layernorm(hidden)
        for i, (layer, next_norm) in enumerate(zip(layers, next_norms)):
            mask = masks[self._config.layer_sliding_window(i)]
            layer_routing = _layer_routing(layer, routing)
            hidden, normed = layer.forward_fused(hidden, normed, cos, sin, mask, next_norm, layer_routing, **cache_args)
            if layer_routing is not None:
                routing.add(layer_routing)
        return normed


def _layer_routing(layer: DecoderLayer, routing: Routing | None) -> LayerRouting | None:
    """`routing`'s part for `layer`: None for a dense layer or without routing."""
    return routing.for_layer(layer.mlp.moe_index) if routing is not None and layer.sparse else None


def save_pretrained(model: CausalLM, out_dir, state: dict | None = None) -> Path:
    """Write config.json + model.safetensors that transformers' AutoModelForCausalLM loads
    (`state`: the tensors to write instead of the model's own, e.g. LoRA-merged weights); a tied
    lm_head is not stored twice. `loading.from_pretrained` reads the folder back."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = model.config.to_hf_dict()
    # the dtype of the tensors written (an FSDP2 model's fp32 masters are saved in the dtype it samples in)
    dtype = next(iter(state.values())).dtype if state else model.dtype
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    # copy=True: parameters may be slices of one fused buffer (fusion.py), which safetensors refuses
    state = state if state is not None else model.state_dict()
    state = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    state = split_expert_weights(state, model.config.model_type) if model.config.num_experts else state
    save_safetensors(state, out / "model.safetensors")
    return out
