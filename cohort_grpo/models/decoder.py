"""Our decoder's layers, one set for Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE and Mixtral.

All four are the Llama block (Touvron et al. 2023): pre-RMSNorm (Zhang & Sennrich 2019), rotary
position embeddings (Su et al. 2021, "RoFormer"), grouped-query attention (Ainslie et al. 2023)
and a SwiGLU MLP (Shazeer 2020). The family differences are config flags (see `config.py`): Qwen2
has q/k/v biases, Qwen3 RMS-normalises each q/k head, Mistral/Qwen2 may use a sliding window.
Qwen3-MoE is Qwen3 whose MLPs are (in the layers its config names) mixtures of experts (`moe.py`);
Mixtral is Mistral whose every MLP is one. Here: `RMSNorm`, `Attention` (and `grouped_query_attention`),
`MLP`, `DecoderLayer` and `DecoderModel` (embeddings, layers, final norm); the LM over them, its forward
and its Hugging Face folder are `causal_lm.py`.

Parameter names equal transformers' (`model.layers.0.self_attn.q_proj.weight`, ...) so a state
dict moves between the two unchanged. Attention goes through `F.scaled_dot_product_attention`.
With a `KVCache` the forward has static shapes and no host sync, so a decode step is CUDA-graph
capturable: keys are written in place (`index_put_`) and the mask is built from `position_ids`
(`causal_lm.py`). Decode (default cache rows 0..B-1) reads the cache as a view and folds grouped-query
heads instead of expanding k/v, so a step reads each cached key once. With fused kernels on and autograd off
(sampling), the same math is regrouped into fewer kernels (`cohort_grpo/kernels/elementwise.py`: residual
add + RMSNorm, norm + rotary + cache write, the attention mask built once per step).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cohort_grpo.kernels import elementwise as kernels
from cohort_grpo.kernels.decode_attention import decode_attention
from cohort_grpo.models.fusion import fused_weight
from cohort_grpo.models.moe import LayerRouting, SparseMoeBlock
from cohort_grpo.models import exact_layers, shared_prefix
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
