"""`VisionLanguageModel`: a vision-language model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5, Gemma 3, Idefics3, SmolVLM,
LLaVA, LLaVA-NeXT, LLaVA-OneVision, Mistral 3) behind cohort's model interface.

The language tower is served as the generic path serves any decoder (generic.py): its own modules, cohort's
attention and KV cache. What the images add lives here, and what differs between families in vision_families.py
(the vision tower's call, the image token count, the positions, how image tokens attend):

- A prompt's images come as `ImageInputs` (the processor's `pixel_values`, Qwen-VL's `image_grid_thw`, and the
  other image tensors a family's tower takes, such as Idefics3's `pixel_attention_mask`), one object per prompt,
  shared by the rows of its completions. A forward given `images` (one per row, None for a text row) runs the
  vision tower once per distinct `ImageInputs` object and writes the image embeddings where the prompt's image
  tokens stand (the first ones of the row: a completion that samples an image token keeps it a text
  token, as transformers' `generate` does). The update's shared-prompt layout (one flat row, each prompt once before
  its completions, `attention_rows`) places each packed prompt's images once (vision_shared_prompts.py).
- Qwen-VL's multimodal rotary positions: an image's tokens take (time, height, width) positions, so the prompt's
  positions come from the model's own `get_rope_index`, and every later token's rotary position is its index plus
  the prompt's rope delta. The KV cache stores keys by index (`position_ids`, as for a text model) and keeps each
  row's delta (`KVCache.rotary_offsets`, moved and shared with the row), so decode steps need nothing else.
- Gemma 3's image tokens attend to their whole image (both directions): a cached forward with images (the prefill,
  which holds each prompt whole) tells cohort's attention each token's image block (`AttentionStep.image_blocks`),
  and so does a shared-prompt forward (each attention row's blocks); a forward of padded rows takes transformers'
  own masks of the token types.

The vision tower keeps its own attention implementation; only the language tower's becomes cohort's.
"""

from __future__ import annotations

import copy
import re

import torch
from torch import nn

from cohort_grpo.errors import CohortError
from cohort_grpo.models.cache import KVCache
from cohort_grpo.models.generic import TransformersCausalLM
from cohort_grpo.models.vision_families import (FAMILIES, SERVED, ImageInputs, ImagePlacement, image_blocks,
                                                image_token_types)
from cohort_grpo.models.vision_shared_prompts import attention_row_types, row_placements, shared_prompt_placements

# The vision-language families this wrapper serves (their model type).
VISION_LANGUAGE_TYPES = tuple(FAMILIES)


def is_vision_language(config) -> bool:
    """Whether a transformers config describes a model with a vision tower (a `vision_config`)."""
    return getattr(config, "vision_config", None) is not None


def vision_language_refusal(config) -> str | None:
    """Why cohort cannot serve this vision-language model, from its config (None when it can)."""
    model_type = getattr(config, "model_type", "")
    if model_type not in FAMILIES:
        return (f"{model_type} is a vision-language family cohort does not serve yet (it serves "
                f"{', '.join(VISION_LANGUAGE_TYPES)})")
    return None


class VisionLanguageModel(TransformersCausalLM):
    """A vision-language `...ForConditionalGeneration` of a served family: `CausalLM`'s forward plus `images` (see
    `forward`)."""

    takes_images = True

    @classmethod
    def wrap(cls, model: nn.Module) -> "VisionLanguageModel":
        reason = vision_language_refusal(model.config)
        if reason is not None:
            names = [name for family in SERVED for name in family.names]
            raise CohortError(f"{reason}: use a {', '.join(names[:-1])} or {names[-1]} model")
        return super().wrap(model)

    @staticmethod
    def language_config(causal_lm: nn.Module):
        return causal_lm.config.get_text_config()

    @property
    def config(self):
        """The language tower's config (vocabulary, layers, heads): what the engine and the update read."""
        return self.transformers_model.config.get_text_config()

    @property
    def model_type(self) -> str:
        return self.transformers_model.config.model_type

    @property
    def family(self):
        """What this model's family does its own way (vision_families.py)."""
        return FAMILIES[self.model_type]

    @property
    def vision_tower(self) -> nn.Module:
        return self.family.vision_modules(self.transformers_model)[0]

    def vision_parameters(self) -> list[nn.Parameter]:
        """The weights that turn pixels into image embeddings: the vision tower's and its projector's (and LLaVA-NeXT's
        row-end embedding)."""
        modules = self.family.vision_modules(self.transformers_model)
        return [p for module in modules for p in module.parameters()] + self.family.loose_vision_parameters(
            self.transformers_model)

    @property
    def image_token_id(self) -> int:
        return self.transformers_model.config.image_token_id

    def freeze_vision_tower(self, frozen: bool = True) -> None:
        """Keep the vision tower's weights out of training (`frozen`) or in it."""
        for parameter in self.vision_parameters():
            parameter.requires_grad_(not frozen)

    def language_lora_config(self, peft_config):
        """`peft_config` with its target modules narrowed to the language tower's (the vision tower's layers share
        their names): a list of names becomes a pattern over the language tower's layers; a pattern stays."""
        targets = peft_config.target_modules
        if not isinstance(targets, (list, tuple, set)):
            return peft_config
        narrowed = copy.copy(peft_config)
        names = "|".join(sorted(re.escape(name) for name in targets))
        narrowed.target_modules = rf".*{re.escape(self.language_tower_name)}\..*\.({names})"
        return narrowed

    @property
    def language_tower_name(self) -> str:
        """The language tower's attribute name in its parent (`language_model`; Idefics3's and SmolVLM's
        `text_model`)."""
        return next(name.rsplit(".", 1)[-1] for name, module in self.transformers_model.named_modules()
                    if module is self.decoder)

    def image_token_count(self, images: ImageInputs) -> int:
        """How many image tokens of the prompt `images` fill."""
        return self.family.image_token_count(self.transformers_model, images)

    # ---- forward -----------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, *, images: list[ImageInputs | None] | None = None,
                kv_cache: KVCache | None = None, cache_rows: torch.Tensor | None = None, return_hidden: bool = False,
                cache_len: int | None = None, attention_rows: torch.Tensor | None = None,
                attention_slots: torch.Tensor | None = None, routing=None) -> torch.Tensor:
        """`TransformersCausalLM.forward` with `images`: row b's prompt images (None for a text row), whose
        tokens start at position 0 of the row; with `attention_rows` (one flat row of shared prompts), one entry
        per attention row (`shared_prompt_forward`). A cached forward with images (a prefill) records each row's
        rope delta in the cache (Qwen-VL); one without (a decode step) reads it."""
        rows = input_ids.shape[0] if attention_rows is None else attention_rows.shape[0]
        if images is not None and len(images) != rows:
            raise CohortError(f"images has {len(images)} entries for {rows} rows: pass one per row "
                              "(None for a text row)")
        images = images if images is not None and any(i is not None for i in images) else None
        if attention_rows is not None:
            hidden = self.shared_prompt_forward(input_ids, position_ids, attention_mask, kv_cache, attention_rows,
                                                attention_slots, images, routing)
            return hidden if return_hidden else self.lm_head(hidden)
        position_ids, step = self.attention_step(input_ids, position_ids, attention_mask, kv_cache, cache_rows,
                                                 cache_len, None, None, routing)
        rows = cache_rows if cache_rows is not None else torch.arange(input_ids.shape[0], device=input_ids.device)
        placements = [] if images is None else row_placements(input_ids, images, self.image_token_id,
                                                               self.image_token_count)
        token_types = None if images is None else image_token_types(input_ids, placements)
        offsets = 0 if kv_cache is None else kv_cache.rotary_offsets[rows][:, None]
        rotary, deltas = self.family.positions(self.transformers_model, input_ids, position_ids, attention_mask,
                                               images, token_types, offsets)
        if kv_cache is not None and deltas is not None:
            kv_cache.rotary_offsets[rows] = deltas
        embeds, deepstack = self.merged_embeddings(input_ids, placements)
        if images is not None and self.family.bidirectional_images:
            if step is not None:
                step.image_blocks = image_blocks(token_types)
            else:
                attention_mask = self.family.attention_masks(self.transformers_model, embeds, attention_mask,
                                                             position_ids, token_types)
        hidden = self.decoder_hidden(input_ids, rotary, attention_mask, step, inputs_embeds=embeds, **deepstack)
        return hidden if return_hidden else self.lm_head(hidden)

    def shared_prompt_forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None,
                              attention_mask: torch.Tensor | None, kv_cache: KVCache | None,
                              attention_rows: torch.Tensor, attention_slots: torch.Tensor | None,
                              images: list[ImageInputs | None] | None, routing) -> torch.Tensor:
        """The final hidden states [1, N, H] of one flat row of shared prompts and their completions
        (vision_shared_prompts.py): each packed prompt's images through the vision tower once and merged at its
        image tokens, the positions and the image tokens' attention those of the padded layout, row for row.
        (`attention_mask` and `kv_cache` must be None: `attention_step` says so.)"""
        position_ids, step = self.attention_step(input_ids, position_ids, attention_mask, kv_cache, None, None,
                                                 attention_rows, attention_slots, routing)
        placements = [] if images is None else shared_prompt_placements(
            input_ids, attention_rows, images, self.image_token_id, self.image_token_count)
        row_types = attention_row_types(image_token_types(input_ids, placements), attention_rows)
        row_ids = input_ids[0, attention_rows]
        rotary = self.family.shared_prompt_positions(self.transformers_model, row_ids, position_ids, attention_rows,
                                                     attention_slots, images, row_types)
        embeds, deepstack = self.merged_embeddings(input_ids, placements)
        if placements and self.family.bidirectional_images:
            step.image_blocks = image_blocks(row_types)
        return self.decoder_hidden(input_ids, rotary, None, step, inputs_embeds=embeds, **deepstack)

    def image_features(self, images: list[ImageInputs | None]) -> dict[int, tuple]:
        """Each distinct `ImageInputs` of `images` through the vision tower once, by the object's id: its embeddings
        [tokens, hidden], and Qwen3-VL's deepstack features (one [tokens, hidden] per early decoder layer; else
        an empty list)."""
        features, key = {}, self.frozen_tower_key()
        for row_images in images:
            if row_images is None or id(row_images) in features:
                continue
            computed = row_images.features.get(key) if key is not None else None
            if computed is None:
                computed = self.encode_images(row_images)
                if key is not None:
                    row_images.features[key] = computed
            if not torch.is_inference_mode_enabled() and computed[0].is_inference():
                # made while sampling (inference mode): a training forward needs ordinary tensors
                computed = (computed[0].clone(), [layer.clone() for layer in computed[1]])
            features[id(row_images)] = computed
        return features

    def encode_images(self, images: ImageInputs) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One prompt's images through the vision tower: (embeddings, deepstack features by layer)."""
        outputs = self.family.image_features(self.transformers_model, images, self.device)
        deepstack = [joined(layer).to(self.dtype) for layer in getattr(outputs, "deepstack_features", None) or []]
        return joined(outputs.pooler_output).to(self.dtype), deepstack

    def frozen_tower_key(self) -> tuple | None:
        """Which weights a frozen vision tower computes with (where its first weight lives, and its dtype): the
        key its features are kept under; None while the tower trains (each forward computes them afresh)."""
        parameters = self.vision_parameters()
        if any(parameter.requires_grad for parameter in parameters):
            return None
        return parameters[0].data_ptr(), parameters[0].dtype, str(parameters[0].device)

    def merged_embeddings(self, input_ids: torch.Tensor,
                          placements: list[ImagePlacement]) -> tuple[torch.Tensor, dict]:
        """The token embeddings [B, T, H] with each placed prompt's image embeddings at its columns, and the
        decoder's deepstack inputs where the model has them (the placed columns as a mask, each layer's features
        in the same row-major order: `placements` come in that order)."""
        embeds = self.transformers_model.get_input_embeddings()(input_ids)
        if not placements:
            return embeds, {}
        features = self.image_features([placement.images for placement in placements])
        rows = torch.cat([torch.full_like(placement.columns, placement.row) for placement in placements])
        columns = torch.cat([placement.columns for placement in placements])
        parts = [features[id(placement.images)] for placement in placements]
        merged = embeds.index_put((rows, columns), torch.cat([part[0] for part in parts]).to(embeds.dtype))
        if not parts[0][1]:
            return merged, {}
        mask = torch.zeros(input_ids.shape, dtype=torch.bool, device=input_ids.device)
        mask[rows, columns] = True
        layers = [torch.cat([part[1][layer] for part in parts]) for layer in range(len(parts[0][1]))]
        return merged, {"visual_pos_masks": mask, "deepstack_visual_embeds": layers}


def joined(features) -> torch.Tensor:
    """A vision tower's features of one prompt's images as one [tokens, hidden] tensor: transformers returns them
    split by image (a tuple of [tokens, hidden]) or whole (one tensor, [tokens, hidden] or [images, tokens, hidden]:
    Qwen3-VL's deepstack features and Gemma 3's embeddings before transformers 5.25)."""
    if isinstance(features, torch.Tensor):
        return features.reshape(-1, features.shape[-1])
    return torch.cat([feature.reshape(-1, feature.shape[-1]) for feature in features], dim=0)
