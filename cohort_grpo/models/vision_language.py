"""`VisionLanguageModel`: a Qwen-VL model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) behind cohort's model interface.

The language tower is served as the generic path serves any decoder (generic.py): its own modules, cohort's
attention and KV cache. What the images add lives here:

- A prompt's images come as `ImageInputs` (the processor's `pixel_values` and `image_grid_thw`), one object per
  prompt, shared by the rows of its completions. A forward given `images` (one per row, None for a text row) runs
  the vision tower once per distinct `ImageInputs` object and writes the image embeddings where the prompt's image
  tokens stand (the first ones of the row: a completion that samples an image token keeps it a text token, as
  transformers' `generate` does).
- Qwen-VL's multimodal rotary positions: an image's tokens take (time, height, width) positions, so the prompt's
  positions come from the model's own `get_rope_index`, and every later token's rotary position is its index plus
  the prompt's rope delta. The KV cache stores keys by index (`position_ids`, as for a text model) and keeps each
  row's delta (`KVCache.rotary_offsets`, moved and shared with the row), so decode steps need nothing else.

The vision tower keeps its own attention implementation; only the language tower's becomes cohort's.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field

import torch
from torch import nn

from cohort_grpo.errors import CohortError
from cohort_grpo.models.cache import KVCache
from cohort_grpo.models.generic import TransformersCausalLM

# The vision-language families this wrapper serves (their model type): the multimodal rotary positions and the
# image-feature call are Qwen-VL's (Qwen3-VL's deepstack features go into the language tower's first layers).
VISION_LANGUAGE_TYPES = ("qwen2_5_vl", "qwen2_vl", "qwen3_vl")
IMAGE_TOKEN_TYPE = 1  # get_rope_index's mm_token_type_ids: text 0, image 1, video 2


@dataclass(eq=False)  # hashed by identity: the rows of one prompt share one object, so its images run once
class ImageInputs:
    """One prompt's images as the model's processor gives them: `pixel_values` [patches, features] and
    `image_grid_thw` [images, 3] (each image's patch grid: time, height, width). `features`: what a frozen vision
    tower made of them, by the tower's weights (`VisionLanguageModel.frozen_tower_key`), so the sampler's prefill
    and the update's passes of one step run the tower once."""

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    features: dict = field(default_factory=dict, repr=False)

    def to(self, device) -> "ImageInputs":
        return ImageInputs(self.pixel_values.to(device), self.image_grid_thw.to(device))


def is_vision_language(config) -> bool:
    """Whether a transformers config describes a model with a vision tower (a `vision_config`)."""
    return getattr(config, "vision_config", None) is not None


def vision_language_refusal(config) -> str | None:
    """Why cohort cannot serve this vision-language model, from its config (None when it can)."""
    model_type = getattr(config, "model_type", "")
    if model_type not in VISION_LANGUAGE_TYPES:
        return (f"{model_type} is a vision-language family cohort does not serve yet (it serves "
                f"{', '.join(VISION_LANGUAGE_TYPES)})")
    return None


class VisionLanguageModel(TransformersCausalLM):
    """A Qwen-VL `...ForConditionalGeneration`: `CausalLM`'s forward plus `images` (see `forward`)."""

    takes_images = True

    @classmethod
    def wrap(cls, model: nn.Module) -> "VisionLanguageModel":
        reason = vision_language_refusal(model.config)
        if reason is not None:
            raise CohortError(f"{reason}: use a Qwen2-VL, Qwen2.5-VL or Qwen3-VL model")
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
    def vision_tower(self) -> nn.Module:
        return self.transformers_model.model.visual

    @property
    def image_token_id(self) -> int:
        return self.transformers_model.config.image_token_id

    def freeze_vision_tower(self, frozen: bool = True) -> None:
        """Keep the vision tower's weights out of training (`frozen`) or in it."""
        for parameter in self.vision_tower.parameters():
            parameter.requires_grad_(not frozen)

    def language_lora_config(self, peft_config):
        """`peft_config` with its target modules narrowed to the language tower's (the vision tower's MLP shares
        their names): a list of names becomes a pattern over the language model's layers; a pattern stays."""
        targets = peft_config.target_modules
        if not isinstance(targets, (list, tuple, set)):
            return peft_config
        narrowed = copy.copy(peft_config)
        names = "|".join(sorted(re.escape(name) for name in targets))
        narrowed.target_modules = rf".*language_model\..*\.({names})"
        return narrowed

    def image_token_count(self, images: ImageInputs) -> int:
        """How many image tokens of the prompt `images` fill: each image's patches over the merge window."""
        merge = self.vision_tower.spatial_merge_size
        return int(images.image_grid_thw.prod(-1).sum()) // merge ** 2

    # ---- forward -----------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, *, images: list[ImageInputs | None] | None = None,
                kv_cache: KVCache | None = None, cache_rows: torch.Tensor | None = None, return_hidden: bool = False,
                cache_len: int | None = None, attention_rows: torch.Tensor | None = None,
                attention_slots: torch.Tensor | None = None, routing=None) -> torch.Tensor:
        """`TransformersCausalLM.forward` with `images`: row b's prompt images (None for a text row), whose
        tokens start at position 0 of the row. A cached forward with images (a prefill) records each row's rope
        delta in the cache; one without (a decode step) reads it."""
        if attention_rows is not None:
            raise CohortError(f"shared-prompt packing does not run {self.model_type} yet (its images and "
                              "multimodal positions): use --padding_free false")
        if images is not None and len(images) != input_ids.shape[0]:
            raise CohortError(f"images has {len(images)} entries for {input_ids.shape[0]} rows: pass one per row "
                              "(None for a text row)")
        images = images if images is not None and any(i is not None for i in images) else None
        position_ids, step = self.attention_step(input_ids, position_ids, attention_mask, kv_cache, cache_rows,
                                                 cache_len, None, None, routing)
        rows = cache_rows if cache_rows is not None else torch.arange(input_ids.shape[0], device=input_ids.device)
        image_slots = None if images is None else self.image_slots(input_ids, images)
        if images is None:
            offsets = 0 if kv_cache is None else kv_cache.rotary_offsets[rows][:, None]
            rotary = (position_ids + offsets)[None].expand(3, *position_ids.shape)
        else:
            rotary, deltas = self.multimodal_positions(input_ids, position_ids, attention_mask, images, image_slots)
            if kv_cache is not None:
                kv_cache.rotary_offsets[rows] = deltas
        embeds, deepstack = self.merged_embeddings(input_ids, images, image_slots)
        hidden = self.decoder_hidden(input_ids, rotary, attention_mask, step, inputs_embeds=embeds, **deepstack)
        return hidden if return_hidden else self.lm_head(hidden)

    def image_slots(self, input_ids: torch.Tensor, images: list[ImageInputs | None]) -> list[torch.Tensor | None]:
        """Row by row, the columns its images' embeddings go to: the first image tokens of the row, as many as its
        images fill (None for a text row). A one-line error where a prompt has fewer image tokens."""
        slots = []
        for row, row_images in enumerate(images):
            if row_images is None:
                slots.append(None)
                continue
            wanted = self.image_token_count(row_images)
            found = (input_ids[row] == self.image_token_id).nonzero()[:, 0]
            if len(found) < wanted:
                raise CohortError(f"row {row}'s prompt has {len(found)} image tokens where its images fill {wanted}: "
                                  "render prompts with the model's processor (it inserts the image tokens)")
            slots.append(found[:wanted])
        return slots

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
        pixels, grid = images.pixel_values.to(self.device), images.image_grid_thw.to(self.device)
        outputs = self.transformers_model.model.get_image_features(pixels, grid)
        deepstack = [torch.cat(list(layer), dim=0).to(self.dtype)
                     for layer in getattr(outputs, "deepstack_features", None) or []]
        return torch.cat(list(outputs.pooler_output), dim=0).to(self.dtype), deepstack

    def frozen_tower_key(self) -> tuple | None:
        """Which weights a frozen vision tower computes with (where its first weight lives, and its dtype): the
        key its features are kept under; None while the tower trains (each forward computes them afresh)."""
        parameters = list(self.vision_tower.parameters())
        if any(parameter.requires_grad for parameter in parameters):
            return None
        return parameters[0].data_ptr(), parameters[0].dtype, str(parameters[0].device)

    def merged_embeddings(self, input_ids: torch.Tensor, images: list[ImageInputs | None] | None,
                          image_slots: list[torch.Tensor | None] | None) -> tuple[torch.Tensor, dict]:
        """The token embeddings [B, T, H] with each row's image embeddings at its image slots, and the decoder's
        deepstack inputs where the model has them (the image slots as a mask, each layer's features in the same
        row-major order)."""
        embeds = self.transformers_model.get_input_embeddings()(input_ids)
        if images is None:
            return embeds, {}
        features = self.image_features(images)
        rows = torch.cat([torch.full_like(slots, row) for row, slots in enumerate(image_slots) if slots is not None])
        columns = torch.cat([slots for slots in image_slots if slots is not None])
        parts = [features[id(row_images)] for row_images in images if row_images is not None]
        merged = embeds.index_put((rows, columns), torch.cat([part[0] for part in parts]).to(embeds.dtype))
        if not parts[0][1]:
            return merged, {}
        mask = torch.zeros(input_ids.shape, dtype=torch.bool, device=input_ids.device)
        mask[rows, columns] = True
        layers = [torch.cat([part[1][layer] for part in parts]) for layer in range(len(parts[0][1]))]
        return merged, {"visual_pos_masks": mask, "deepstack_visual_embeds": layers}

    def multimodal_positions(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                             attention_mask: torch.Tensor | None, images: list[ImageInputs | None],
                             image_slots: list[torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary positions [3, B, T] and each row's rope delta [B]: the model's own `get_rope_index` for a row
        with images (its tokens from index 0), the position ids on all three axes for a text row (delta 0)."""
        rotary = position_ids[None].expand(3, *position_ids.shape).clone()
        deltas = torch.zeros(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
        for row, row_images in enumerate(images):
            if row_images is None:
                continue
            token_types = torch.zeros_like(input_ids[row: row + 1], dtype=torch.int)
            token_types[0, image_slots[row]] = IMAGE_TOKEN_TYPE
            mask = None if attention_mask is None else attention_mask[row: row + 1]
            positions, delta = self.transformers_model.model.get_rope_index(
                input_ids[row: row + 1], token_types, image_grid_thw=row_images.image_grid_thw.to(input_ids.device),
                attention_mask=mask)
            rotary[:, row] = positions[:, 0]
            deltas[row] = delta.reshape(-1)[0]
        return rotary, deltas
