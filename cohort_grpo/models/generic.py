"""`TransformersCausalLM`: any transformers decoder-only LM behind the call interface of cohort's own `CausalLM`.

cohort's engine and update call a model as `model(input_ids, position_ids, kv_cache=..., cache_rows=...,
cache_len=..., return_hidden=...)` (docs/architecture.md, "Model"). The six families of `causal_lm.py` implement it
themselves; any other decoder-only model of transformers gets it here from its own modules: its embedding,
decoder layers (rotary, QK-norm, soft-capping, sliding windows, partial rotary, whatever they do), final norm and
head run unchanged, and only attention is cohort's (generic_attention.py). The wrapper holds the transformers
model's own top-level modules under their own names, so parameter names, state dicts and saved folders are
transformers' own. On the engine's sampling forwards its RMSNorms, gated MLPs and q/k/v projections take fused
kernels and GEMMs, each checked at wrap time against the module it serves (generic_fusion.py).

`TransformersCausalLM.wrap` refuses, by name, what it cannot serve: recurrent layers that keep their state outside
transformers' cache interface, other attention it cannot serve, and encoder-decoders, from the config
(`generic_attention.refusal`); then, on a few probe tokens, a model whose attention modules do not all come through
transformers' attention interface once in each layer that attends, whose keys differ in
shape between layers (a cache row holds one shape; values narrower than keys, as in MLA, are padded to the keys'
width), whose attention through cohort's path differs from its own, whose logits are not its head (`LogitHead`) on
its decoder's output, or whose decoding over the cache differs from its full forward (positions that come from
its own cache's length rather than `position_ids`). Such a model takes transformers' generate.

Recurrent layers keep a state instead of keys and values (Gated DeltaNet linear attention, Mamba 1 and 2
state-space mixers, LFM2's short convolutions; hybrid layers, as Falcon-H1's, keep one beside their keys): during a
cached forward the model gets a `StateCache` as its transformers cache, which keeps each row's state in the
engine's `KVCache` (recurrent_state.py); the probe records each state's shape and dtype, and whether a cached
forward of several tokens carries a row's state (Mamba 1's scan does not: such rows continue token by token).
"""

from __future__ import annotations

import torch
from torch import nn

from cohort_grpo.errors import CohortError
from cohort_grpo.models.cache import KVCache
from cohort_grpo.models.generic_attention import (ATTENTION, STATELESS_LAYER_TYPES, AttentionStep, GenericPathRefused,
                                                  LogitHead, active_step, attention_implementation,
                                                  keeps_recurrent_state, recompute_in_the_same_step, refusal,
                                                  register_attention)
from cohort_grpo.models.generic_fusion import Fusions, install, relative_error
from cohort_grpo.models.generic_rotary import install_rotary
from cohort_grpo.models.generic_training import checkpoint_first_layers, decoder_layer_list
from cohort_grpo.models.recurrent_state import StateCache, StateShapes
from cohort_grpo.models.shared_prefix import PackedRows

PROBE_TOKENS = 6
# Largest relative (L2) difference between the probe's hidden states through cohort's attention and through the
# model's own, and between its logits and the head's: float rounding passes, a wrong mask or scale does not.
PROBE_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8}
HALF_PROBE_TOLERANCE = 3e-2


class TransformersCausalLM(nn.Module):
    """A transformers `PreTrainedModel` (decoder-only, causal LM) with `CausalLM`'s forward (see `forward`)."""

    numerics = "fast"

    def __init__(self, causal_lm: nn.Module):
        super().__init__()
        self.__dict__["transformers_model"] = causal_lm  # not a submodule: its children are ours, by their names
        # Straight into _modules: a child named lm_head (most heads) stays under that name in the state dict, while
        # the attribute `lm_head` is the property below (the head as the model's forward applies it).
        self._modules.update(causal_lm.named_children())
        # Each layer's (kv heads, head dim) in the engine's cache, from the probe ((0, 0) for a layer without attention)
        self.kv_cache_layer_shapes: tuple[tuple[int, int], ...] | None = None
        # The recurrent states of its recurrent layers, from the probe (None without such layers)
        self.recurrent_state_shapes: StateShapes | None = None
        # Whether a cached forward of several tokens after a row's first must run them one at a time (the probe
        # finds it: a multi-token forward that ignores the row's carried state, as Mamba 1's scan does)
        self.continues_by_token = False
        # The sampling path's fused norms, MLPs and projections (generic_fusion.py), installed by `wrap`
        self.fusions = Fusions()

    @classmethod
    def wrap(cls, causal_lm: nn.Module) -> "TransformersCausalLM":
        """`causal_lm` behind cohort's model interface, checked on a few probe tokens; `GenericPathRefused` (its
        message says why) for a model this path cannot serve."""
        config = cls.language_config(causal_lm)
        reason = refusal(config)
        if reason is not None:
            raise GenericPathRefused(reason)
        register_attention()
        own_attention = config._attn_implementation
        config._attn_implementation = ATTENTION  # every forward's attention is cache_attention from now on
        model = cls(causal_lm)
        try:
            model.kv_cache_layer_shapes, model.recurrent_state_shapes = model.probe(own_attention)
        except Exception as error:
            config._attn_implementation = own_attention  # it stays transformers' model, as it was
            if isinstance(error, GenericPathRefused):
                raise
            # A probe forward that fails (under cohort's attention: a mask the model builds for itself, ...):
            # transformers' generate serves the model, as for any refusal.
            failure = (str(error).strip().splitlines() or [""])[0][:120]
            raise GenericPathRefused(f"{model.model_type}'s probe forward fails ({type(error).__name__}: "
                                     f"{failure})") from error
        model.fusions = install(model.decoder)
        install_rotary(model.decoder, model.fusions)
        return model

    @staticmethod
    def language_config(causal_lm: nn.Module):
        """The config whose attention implementation becomes cohort's (a vision-language model keeps its vision
        tower's own: vision_language.py)."""
        return causal_lm.config

    # ---- what cohort reads of a model --------------------------------------------------------------------
    @property
    def config(self):
        return self.transformers_model.config

    @property
    def model_type(self) -> str:
        return getattr(self.config, "model_type", type(self.transformers_model).__name__)

    @property
    def decoder(self) -> nn.Module:
        """The base model: embedding, layers, final norm (transformers' `get_decoder`)."""
        return self.transformers_model.get_decoder()

    @property
    def lm_head(self) -> LogitHead:
        """The head as the model's own forward applies it; `.weight` is the output embedding."""
        return LogitHead(self.transformers_model.get_output_embeddings(), self.config)

    @property
    def keeps_recurrent_state(self) -> bool:
        """Whether some layers keep a recurrent state (linear attention, state space): a cached forward's rows must be
        unpadded, and shared-prompt attention rows (one flat row of several sequences) cannot serve it."""
        return keeps_recurrent_state(self.config)

    @property
    def plain_head(self) -> bool:
        """Whether logits are hidden @ lm_head.weightᵀ under the head's scale and soft-capping alone (no bias), so the
        update may take the chunked LM-head path."""
        return self.lm_head.plain

    @property
    def device(self) -> torch.device:
        return self.transformers_model.get_input_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.transformers_model.get_input_embeddings().weight.dtype

    @property
    def base_model_prefix(self) -> str:
        """transformers' name of the base model's attribute (peft reads it to scope weight conversions)."""
        return self.transformers_model.base_model_prefix

    @property
    def name_or_path(self) -> str:
        return self.transformers_model.name_or_path

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def train(self, mode: bool = True) -> "TransformersCausalLM":
        super().train(mode)
        self.transformers_model.training = mode
        return self

    def set_numerics(self, numerics: str) -> None:
        if numerics != "fast":
            raise CohortError(f"rollout_numerics={numerics} needs cohort's own model implementation; "
                              f"{self.model_type} runs through transformers' modules: use --rollout_numerics fast")

    def fuse_projections(self) -> None:
        """Let the sampling path read q/k/v and gate/up as one matrix each (generic_fusion.py), as
        `CausalLM.fuse_projections`; idempotent. Call it outside inference mode (it may re-point parameters)."""
        self.fusions.fuse()

    def gradient_checkpointing_enable(self, checkpointed_layers: int | None = None, activation_probe=None,
                                      **_ignored) -> None:
        """Recompute decoder layers in the backward through transformers' own checkpointing: every layer, or the
        first `checkpointed_layers` (generic_training.py); `activation_probe` measures the first kept one."""
        model = self.transformers_model
        options = {"use_reentrant": False, "context_fn": recompute_in_the_same_step}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers 5's name for it
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
        checkpoint_first_layers(self.decoder_layers(), checkpointed_layers, activation_probe)

    @property
    def checkpointed_layers(self) -> int:
        return sum(bool(getattr(layer, "gradient_checkpointing", False)) for layer in self.decoder_layers())

    def decoder_layers(self) -> nn.ModuleList:
        """The decoder's repeated layers, found without naming the family (`decoder_layer_list`)."""
        return decoder_layer_list(self.decoder)

    def gradient_checkpointing_disable(self) -> None:
        self.transformers_model.gradient_checkpointing_disable()

    def save_pretrained(self, out_dir, **options):
        """transformers' `save_pretrained` of the wrapped model (the names of our state dict are its own)."""
        return self.transformers_model.save_pretrained(out_dir, **options)

    def saved_names(self) -> dict[str, str]:
        """Each key of this model's state dict and the name `save_pretrained` writes its tensor under: transformers
        saves in a family's original checkpoint format (a Qwen2.5-VL's `model.language_model.layers.0...` is written
        `model.layers.0...`), which a resumed run reads back. Found by transformers' own reverse renaming applied to
        the state dict, each name matched to its tensor; a key whose tensor that renaming rebuilds (a split or merge
        of tensors) keeps its name."""
        state = self.transformers_model.state_dict()
        try:
            from transformers.core_model_loading import revert_weight_conversion
        except ImportError:  # a transformers without renamings: the names are written as they are
            return {key: key for key in state}
        written = revert_weight_conversion(self.transformers_model, dict(state))
        by_tensor = {(tensor.data_ptr(), tuple(tensor.shape)): name for name, tensor in written.items()}
        return {key: by_tensor.get((tensor.data_ptr(), tuple(tensor.shape)), key) for key, tensor in state.items()}

    # ---- forward -----------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, *, kv_cache: KVCache | None = None,
                cache_rows: torch.Tensor | None = None, return_hidden: bool = False, cache_len: int | None = None,
                attention_rows: torch.Tensor | None = None, attention_slots: torch.Tensor | None = None,
                routing=None) -> torch.Tensor:
        """Logits [B, T, V] (or the final normed hidden states with `return_hidden`), with the arguments of
        `CausalLM.forward`: without `kv_cache` or `attention_rows` the model's own forward (its own attention,
        `attention_mask` hiding pad keys); with `kv_cache` each token is written at row `cache_rows[b]` (default b),
        position `position_ids[b, t]` (pad tokens, `attention_mask` 0, write nothing) and attends to its row's keys
        at positions <= its own (within a sliding layer's window), over the first `cache_len` positions; with
        `attention_rows`/`attention_slots` one flat row of shared-prompt tokens (shared_prefix.py). A model with
        recurrent layers keeps each row's recurrent state in `kv_cache` (a row whose first token here is at
        position 0 starts afresh) and takes neither pad tokens in a cached forward nor attention rows."""
        if kv_cache is not None and self.continues_by_token and input_ids.shape[1] > 1 and position_ids is not None \
                and bool((position_ids[:, 0] != 0).any()):
            # its multi-token forward starts from a zero state (Mamba 1's scan): continue a row token by token
            return torch.cat([self(input_ids[:, index:index + 1], position_ids[:, index:index + 1],
                                   kv_cache=kv_cache, cache_rows=cache_rows, return_hidden=return_hidden,
                                   cache_len=cache_len) for index in range(input_ids.shape[1])], dim=1)
        position_ids, step = self.attention_step(input_ids, position_ids, attention_mask, kv_cache, cache_rows,
                                                 cache_len, attention_rows, attention_slots, routing)
        hidden = self.decoder_hidden(input_ids, position_ids, attention_mask, step)
        return hidden if return_hidden else self.lm_head(hidden)

    def attention_step(self, input_ids, position_ids, attention_mask, kv_cache, cache_rows, cache_len,
                       attention_rows, attention_slots, routing) -> tuple[torch.Tensor, AttentionStep | None]:
        """`forward`'s position ids (0..T-1 when None) and the `AttentionStep` its arguments ask for (None: the
        model's own attention under `attention_mask`), with the rows' recurrent states for recurrent layers."""
        if routing is not None:
            raise CohortError(f"routing replay needs cohort's own mixture-of-experts models; {self.model_type} runs "
                              "through transformers' modules: use --routing_replay false")
        batch, length = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(length, device=input_ids.device).expand(batch, length)
        step = None
        if self.keeps_recurrent_state and (attention_rows is not None or (kv_cache is not None
                                                                          and attention_mask is not None)):
            raise CohortError(f"{self.model_type} has layers that keep a recurrent state, which would run "
                              "through other sequences' or pad tokens: pass unpadded rows and no attention_rows")
        if attention_rows is not None:
            if kv_cache is not None or attention_mask is not None or batch != 1 or attention_slots is None:
                raise CohortError("attention_rows (shared-prompt packing) need one flat row of tokens, "
                                  "attention_slots, and no kv_cache or attention_mask")
            step = AttentionStep(position_ids, packed=PackedRows(attention_rows, attention_slots, None))
        elif kv_cache is not None:
            if cache_rows is None and batch > kv_cache.num_rows:
                raise CohortError(f"batch of {batch} rows does not fit a KVCache of {kv_cache.num_rows} rows: "
                                  "pass cache_rows or allocate more rows")
            step = AttentionStep(position_ids, kv_cache, cache_rows, attention_mask,
                                 kv_cache.max_len if cache_len is None else cache_len)
            if self.keeps_recurrent_state:
                if kv_cache.recurrent is None:
                    raise CohortError(f"{self.model_type}'s recurrent layers keep their state in the KVCache: "
                                      "build it with KVCache.for_model(model, ...)")
                step.states = StateCache(kv_cache.recurrent, cache_rows, position_ids)
        return position_ids, step

    def decoder_hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                       attention_mask: torch.Tensor | None, step: AttentionStep | None,
                       inputs_embeds: torch.Tensor | None = None, **decoder_inputs) -> torch.Tensor:
        """The decoder's final normed hidden states: attention served by `step` (cache or attention rows, and the
        recurrent layers' states), or, without one, causal by index under transformers' mask of
        `attention_mask` (the one-row-per-completion forwards of the update). `inputs_embeds`, when given, stand in
        for the embedded `input_ids` (a vision-language model's, images merged); `decoder_inputs` go to the decoder
        too (Qwen3-VL's deepstack features)."""
        tokens = dict(input_ids=input_ids) if inputs_embeds is None else dict(inputs_embeds=inputs_embeds)
        arguments = dict(tokens, position_ids=position_ids, use_cache=False, **decoder_inputs)
        if step is None:
            return self.decoder(**arguments, attention_mask=attention_mask).last_hidden_state
        if step.states is not None:
            arguments["cache"] = step.states
        with active_step(step):
            hidden = self.decoder(**arguments).last_hidden_state
        if step.states is not None:
            step.states.finish()
        return hidden

    # ---- the wrap-time check -----------------------------------------------------------------------------
    def probe(self, own_attention: str) -> tuple[tuple[tuple[int, int], ...], StateShapes | None]:
        """Run a few tokens through cohort's attention and through the model's own (`own_attention`, the
        implementation it was loaded with); refuse (GenericPathRefused) what this path would serve wrong. Returns
        each layer's (kv heads, head dim) in the KV cache, and the recurrent states of its recurrent layers
        (None without such layers)."""
        vocab = self.transformers_model.get_input_embeddings().weight.shape[0]
        input_ids = (torch.arange(1, PROBE_TOKENS + 1, device=self.device) % vocab)[None]
        positions = torch.arange(PROBE_TOKENS, device=self.device)[None]
        states = StateCache(None, None, positions) if self.keeps_recurrent_state else None
        step = AttentionStep(positions, states=states)
        was_training = self.training
        self.eval()
        try:
            with torch.no_grad():
                probed = self.decoder_hidden(input_ids, positions, None, step)
                with attention_implementation(self.config, own_attention):
                    own = self.decoder_hidden(input_ids, positions, None, None)
                    logits = self.transformers_model(input_ids=input_ids, position_ids=positions,
                                                     use_cache=False).logits
                head = self.lm_head(own)
        finally:
            self.train(was_training)
        state_shapes = None if states is None else states.recorded
        layer_shapes = self.served_layer_shapes(step.served, set() if states is None else states.state_layers())
        self.check_close(probed, own, "its hidden states through cohort's attention differ from its own")
        self.check_close(head, logits, "its logits are not its head applied to its decoder's output")
        cached = self.cached_probe(input_ids, positions, layer_shapes, state_shapes)
        if state_shapes and not relative_error(cached, probed) <= self.tolerance(probed):
            self.continues_by_token = True  # its state carries over single tokens only?
            cached = self.cached_probe(input_ids, positions, layer_shapes, state_shapes)
        self.check_close(cached, probed,
                         "decoding from cohort's cache differs from its full forward (positions not its position_ids?)")
        return layer_shapes, state_shapes

    def served_layer_shapes(self, served: list, state_layers: set[int]) -> tuple[tuple[int, int], ...]:
        """Each layer's cache shape (kv heads, head dim) from what the probe's attention calls recorded (layer, key
        shape, value shape): every layer's attention served at most once, every layer served by attention, by a
        recurrent state (`state_layers`) or by both (a hybrid layer), but for layers the config calls stateless
        (an MLP block); a layer without attention holds no keys ((0, 0)); values as many heads as their keys and no
        wider (narrower values are padded to the keys' width)."""
        layers = getattr(self.config, "num_hidden_layers", None)
        attended = sorted(layer for layer, _, _ in served)
        stateless = {index for index, kind in enumerate(getattr(self.config, "layer_types", None) or [])
                     if kind in STATELESS_LAYER_TYPES}
        count = layers or len(set(attended) | state_layers | stateless)
        if len(set(attended)) != len(attended) or (set(attended) | state_layers | stateless) != set(range(count)):
            recurrent = f", recurrent: {sorted(state_layers)}" if state_layers else ""
            raise GenericPathRefused(f"{self.model_type}'s attention does not come through transformers' attention "
                                     f"interface once per layer (layers served: {attended}{recurrent}, of {layers})")
        shapes = dict.fromkeys(range(count), (0, 0))
        for layer, (key_heads, key_width), (value_heads, value_width) in served:
            if value_heads != key_heads or value_width > key_width:
                raise GenericPathRefused(f"{self.model_type}'s layer {layer} has values of {value_heads} heads of "
                                         f"{value_width} against keys of {key_heads} heads of {key_width}; a cache "
                                         "layer holds keys and values of one shape")
            shapes[layer] = (key_heads, key_width)
        return tuple(shapes[layer] for layer in range(count))

    def cached_probe(self, input_ids: torch.Tensor, positions: torch.Tensor, layer_shapes: tuple[tuple[int, int], ...],
                     state_shapes: StateShapes | None) -> torch.Tensor:
        """The probe's hidden states as the engine computes them: the first half prefilled into a cache, the rest
        decoded over it (a model whose positions come from its own cache's length, not `position_ids`, differs). A
        model with recurrent layers decodes one token alone first (their single-token path is other code),
        and its recurrent state must carry from one forward to the next."""
        (kv_heads, head_dim), layers = layer_shapes[0], len(layer_shapes)
        cache = KVCache(layers, 1, kv_heads, PROBE_TOKENS, head_dim, dtype=self.dtype, device=self.device,
                        layer_shapes=layer_shapes, state_shapes=state_shapes)
        half = PROBE_TOKENS // 2
        cuts = (0, half, half + 1, PROBE_TOKENS) if state_shapes else (0, half, PROBE_TOKENS)
        was_training = self.training
        self.eval()
        try:
            with torch.no_grad():
                return torch.cat([self(input_ids[:, part], positions[:, part], kv_cache=cache, cache_len=PROBE_TOKENS,
                                       return_hidden=True)
                                  for part in map(slice, cuts[:-1], cuts[1:])], dim=1)
        finally:
            self.train(was_training)

    @staticmethod
    def tolerance(reference: torch.Tensor) -> float:
        return PROBE_TOLERANCE.get(reference.dtype, HALF_PROBE_TOLERANCE)

    def check_close(self, value: torch.Tensor, reference: torch.Tensor, what: str) -> None:
        tolerance, error = self.tolerance(reference), relative_error(value, reference)
        if not error <= tolerance:
            raise GenericPathRefused(f"{self.model_type}: {what} (relative error {error:.2g} > {tolerance:g})")
