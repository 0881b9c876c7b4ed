"""`CausalLM`: our decoder (`decoder.py`) as a causal language model, and its Hugging Face folder.

The model is embeddings, the decoder layers, a final norm and the LM head, under transformers'
parameter names. Its forward (the Model contract of docs/architecture.md) builds the attention masks
once for all layers (padding and sliding windows by token index, the KV cache's by position, the
shared-prompt layout's attention rows) and runs the layers on one of two paths: one layer call each
(training, with gradient checkpointing and the compiled training layer), or, with fused kernels on and
autograd off (sampling), each residual add fused with the norm after it. `set_numerics("exact")` routes
every layer through `exact_layers.py`.

`save_pretrained` writes the model as a Hugging Face folder; `loading.from_pretrained` reads one.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from cohort_grpo.errors import CohortError
from cohort_grpo.kernels import elementwise as kernels
from cohort_grpo.models.cache import KVCache
from cohort_grpo.kernels.decode_attention import SUPPORTED_HEAD_DIMS as DECODE_KERNEL_HEAD_DIMS
from cohort_grpo.models.decoder import DecoderLayer, DecoderModel
from cohort_grpo.models.files import save_safetensors
from cohort_grpo.models.moe import LayerRouting, Routing, split_expert_weights
from cohort_grpo.models import exact_layers, shared_prefix
from cohort_grpo.models.training_compile import run_layer
from cohort_grpo.models.config import ModelConfig


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
