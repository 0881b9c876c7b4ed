"""What differs between the vision-language families `VisionLanguageModel` serves (vision_language.py).

A prompt's images reach the language tower the same way in every family: the vision tower encodes them once per
prompt and their embeddings stand where the prompt's image tokens are. A family says the rest:

- `QwenVL` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL dense and MoE, Qwen3.5 dense and MoE): images of any size, as patches and a patch grid
  per image; multimodal rotary positions (time, height, width) from the model's own `get_rope_index`, and a rope
  delta that every later token's position carries (kept per row in the KV cache); image tokens attend causally, like
  text. Qwen3.5's vision tower is Qwen3-VL's without deepstack features, and its language tower is a hybrid whose
  Gated DeltaNet layers keep a recurrent state per row (the generic path's, recurrent_state.py): no shared-prompt
  layout for it (`takes_attention_rows`), as for its text-only models.
- `Gemma3Vision` (Gemma 3): images resized to one square, a fixed number of tokens each (`mm_tokens_per_image`);
  plain 1-D positions; each image's tokens attend to one another in both directions (transformers' mask from the
  token types), which the cached attention of the prefill and the shared-prompt attention rows repeat
  (`image_blocks`).
- `Idefics3Vision` (Idefics3, SmolVLM), `LlavaVision` (LLaVA), `Mistral3Vision` (Mistral 3): plain 1-D positions
  (`PlainPositions`) and image tokens that attend causally, like text; what differs is how many tokens an image
  fills and what the tower takes beside the pixels (`ImageInputs.extra_tensors`): Idefics3's tiles of one size,
  each a fixed number of tokens, and their pixel masks; LLaVA's one square per image (a Pixtral tower: images of
  their own size); Mistral 3's images of their own size (`image_sizes`), one token per merged patch.
- `LlavaNextVision` (LLaVA-NeXT, LLaVA-OneVision): plain positions, causal image tokens, anyres tiles; an image's
  token count is what the model's own `pack_image_features` makes of its tiles (unpadding, a newline per row).

Each family's `positions` serves the forwards of one row per prompt (the prefill, the padded layout);
`shared_prompt_positions` the shared-prompt layout's flat row (vision_shared_prompts.py), with the padded layout's
positions token for token.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

IMAGE_TOKEN_TYPE = 1  # the processors' token types: text 0, image 1 (Qwen-VL: video 2)


# The processor's image tensors beyond `pixel_values` and `image_grid_thw` that a family's vision tower reads, by the
# name the processor gives them: Idefics3's and SmolVLM's padded pixels of each tile, Mistral 3's and LLaVA-NeXT's
# image sizes, LLaVA-OneVision's count of a prompt's images.
EXTRA_IMAGE_TENSORS = ("pixel_attention_mask", "image_sizes", "batch_num_images")


@dataclass(eq=False)  # hashed by identity: the rows of one prompt share one object, so its images run once
class ImageInputs:
    """One prompt's images as the model's processor gives them: `pixel_values` (Qwen-VL: [patches, features];
    Gemma 3, LLaVA, Mistral 3: [images, channels, height, width]; Idefics3: [1, tiles, channels, height, width]),
    for Qwen-VL `image_grid_thw` [images, 3] (each image's patch grid: time, height, width), and `extra_tensors`,
    the processor's other image tensors by name (`EXTRA_IMAGE_TENSORS`). `features`: what a frozen vision tower
    made of them, by the tower's weights (`VisionLanguageModel.frozen_tower_key`), so the sampler's prefill and the
    update's passes of one step run the tower once."""

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor | None = None
    extra_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    features: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_processor(cls, encoded) -> "ImageInputs":
        """The image tensors of a processor's output for one prompt (its `input_ids` and text tensors left out)."""
        extra = {name: encoded[name] for name in EXTRA_IMAGE_TENSORS if encoded.get(name) is not None}
        return cls(encoded["pixel_values"], encoded.get("image_grid_thw"), extra)

    def to(self, device) -> "ImageInputs":
        grid = None if self.image_grid_thw is None else self.image_grid_thw.to(device)
        extra = {name: tensor.to(device) for name, tensor in self.extra_tensors.items()}
        return ImageInputs(self.pixel_values.to(device), grid, extra)


class ImagePlacement(NamedTuple):
    """Where one prompt's images go in a forward's input: row `row` of input_ids, at `columns` (its image tokens,
    as many as the images fill, in order)."""

    images: ImageInputs
    row: int
    columns: torch.Tensor


def image_token_types(input_ids: torch.Tensor, placements: list[ImagePlacement]) -> torch.Tensor:
    """Token types [B, T] as the processors write them: `IMAGE_TOKEN_TYPE` where images are placed, else 0."""
    types = torch.zeros_like(input_ids, dtype=torch.int)
    for placement in placements:
        types[placement.row, placement.columns] = IMAGE_TOKEN_TYPE
    return types


def image_blocks(token_types: torch.Tensor) -> torch.Tensor:
    """Each token's image block [B, T]: images numbered from 0 along the row (a block is one run of image tokens),
    -1 for a text token. Tokens of one block attend to one another in both directions."""
    is_image = token_types == IMAGE_TOKEN_TYPE
    starts = is_image & ~torch.nn.functional.pad(is_image, (1, 0))[:, :-1]
    return torch.where(is_image, starts.long().cumsum(1) - 1, -1)


class VisionFamily:
    """What a family has unless it says otherwise: image tokens attend causally, and no weight outside
    `vision_modules` makes image embeddings."""

    bidirectional_images = False

    def loose_vision_parameters(self, model: nn.Module) -> list[nn.Parameter]:
        """Weights that make image embeddings outside `vision_modules` (none)."""
        return []


class QwenVL(VisionFamily):
    """Qwen2-VL, Qwen2.5-VL, Qwen3-VL (its deepstack features go into the language tower's first layers; Qwen3-VL-MoE
    the same with an MoE language tower) and Qwen3.5 (the same positions and image features; a hybrid language
    tower)."""

    model_types = ("qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
    names = ("Qwen2-VL", "Qwen2.5-VL", "Qwen3-VL", "Qwen3-VL-MoE", "Qwen3.5")
    def vision_modules(self, model: nn.Module) -> list[nn.Module]:
        """The modules that turn pixels into image embeddings, the tower first (its projector is inside it)."""
        return [model.model.visual]

    def image_token_count(self, model: nn.Module, images: ImageInputs) -> int:
        """Each image's patches over the merge window."""
        merge = model.model.visual.spatial_merge_size
        return int(images.image_grid_thw.prod(-1).sum()) // merge ** 2

    def image_features(self, model: nn.Module, images: ImageInputs, device):
        return model.model.get_image_features(images.pixel_values.to(device), images.image_grid_thw.to(device))

    def positions(self, model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                  attention_mask: torch.Tensor | None, images: list[ImageInputs | None] | None,
                  token_types: torch.Tensor | None, offsets) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rotary positions [3, B, T], and each row's rope delta [B] when images are given (None without: the
        positions are the ids plus the rows' kept deltas, `offsets`). A row with images takes the model's own
        `get_rope_index` over its `token_types` (its tokens from index 0), a text row the position ids on all
        three axes (delta 0)."""
        if images is None:
            return (position_ids + offsets)[None].expand(3, *position_ids.shape), None
        rotary = position_ids[None].expand(3, *position_ids.shape).clone()
        deltas = torch.zeros(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
        for row, row_images in enumerate(images):
            if row_images is None:
                continue
            mask = None if attention_mask is None else attention_mask[row: row + 1]
            positions, delta = model.model.get_rope_index(
                input_ids[row: row + 1], token_types[row: row + 1],
                image_grid_thw=row_images.image_grid_thw.to(input_ids.device), attention_mask=mask)
            rotary[:, row] = positions[:, 0]
            deltas[row] = delta.reshape(-1)[0]
        return rotary, deltas

    def shared_prompt_positions(self, model: nn.Module, row_ids: torch.Tensor, position_ids: torch.Tensor,
                                attention_rows: torch.Tensor, attention_slots: torch.Tensor,
                                images: list[ImageInputs | None] | None, row_types: torch.Tensor) -> torch.Tensor:
        """Rotary positions [3, 1, N] of a shared-prompt forward's flat row, the padded layout's: `get_rope_index`
        over each packed prompt's first attention row (`row_ids`, `row_types` [b, L]: its prompt, that completion,
        then padding of text type) gives that row's tokens and the prompt's rope delta; every other token (the
        prompt's other completions) takes its position plus that delta, as a padded row's text after its images
        does; a text prompt's tokens take their positions on all three axes."""
        width = attention_rows.shape[1]
        source, column = attention_slots // width, attention_slots % width
        deltas = torch.zeros(attention_rows.shape[0], dtype=torch.long, device=row_ids.device)
        computed = {}  # by (images, the prompt's first flat index): (its first row, that row's positions [3, L])
        for row, row_images in enumerate(images or []):
            if row_images is None:
                continue
            key = (id(row_images), int(attention_rows[row, 0]))
            if key not in computed:
                positions, delta = model.model.get_rope_index(
                    row_ids[row: row + 1], row_types[row: row + 1],
                    image_grid_thw=row_images.image_grid_thw.to(row_ids.device))
                computed[key] = (row, positions[:, 0], delta.reshape(-1)[0])
            deltas[row] = computed[key][2]
        rotary = (position_ids[0] + deltas[source]).expand(3, -1).clone()
        for row, positions, _ in computed.values():
            own = source == row
            rotary[:, own] = positions[:, column[own]].to(rotary.dtype)
        return rotary[:, None]


class PlainPositions(VisionFamily):
    """What families with plain 1-D positions share: a token's rotary position is its index in the row, images
    or not (no rope delta)."""

    def positions(self, model, input_ids, position_ids, attention_mask, images, token_types, offsets):
        """Plain positions: the position ids (no rope delta)."""
        return position_ids, None

    def shared_prompt_positions(self, model, row_ids, position_ids, attention_rows, attention_slots, images,
                                row_types):
        """Plain positions: those the shared layout gives each token (its column in its padded row)."""
        return position_ids


class Gemma3Vision(PlainPositions):
    """Gemma 3's vision-language models (a SigLIP tower, a pooling projector, the Gemma 3 language tower)."""

    model_types = ("gemma3",)
    names = ("Gemma 3",)
    bidirectional_images = True

    def vision_modules(self, model: nn.Module) -> list[nn.Module]:
        return [model.model.vision_tower, model.model.multi_modal_projector]

    def image_token_count(self, model: nn.Module, images: ImageInputs) -> int:
        return images.pixel_values.shape[0] * model.config.mm_tokens_per_image

    def image_features(self, model: nn.Module, images: ImageInputs, device):
        return model.model.get_image_features(images.pixel_values.to(device))

    def attention_masks(self, model: nn.Module, embeds: torch.Tensor, attention_mask: torch.Tensor | None,
                        position_ids: torch.Tensor, token_types: torch.Tensor) -> dict:
        """transformers' own masks by layer type for a forward without the engine's cache: causal (within a
        sliding layer's window), each image's tokens seeing one another."""
        return type(model).create_masks_for_generate(model.config, embeds, attention_mask, None, position_ids,
                                                     token_type_ids=token_types)


class Idefics3Vision(PlainPositions):
    """Idefics3 and SmolVLM (a SigLIP tower, a pixel-shuffle connector, a Llama language tower): the processor
    splits an image into tiles of one size plus the whole image shrunk to one tile, each `image_seq_len` image
    tokens between text tags; a tile's padded pixels are masked out (`pixel_attention_mask`)."""

    model_types = ("idefics3", "smolvlm")
    names = ("Idefics3", "SmolVLM")

    def vision_modules(self, model: nn.Module) -> list[nn.Module]:
        return [model.model.vision_model, model.model.connector]

    def image_token_count(self, model: nn.Module, images: ImageInputs) -> int:
        """`image_seq_len` tokens for each tile the tower encodes: transformers drops all-zero tiles (a batch's
        padding)."""
        tiles = images.pixel_values.flatten(0, 1).flatten(1)
        return int((tiles != 0).any(-1).sum()) * model.model.image_seq_len

    def image_features(self, model: nn.Module, images: ImageInputs, device):
        mask = images.extra_tensors.get("pixel_attention_mask")
        return model.model.get_image_features(images.pixel_values.to(device),
                                              None if mask is None else mask.to(device))


class LlavaVision(PlainPositions):
    """LLaVA (a CLIP, SigLIP or Pixtral tower, an MLP projector, any language tower): each image resized to the
    tower's square, one image token per patch (the tower's class token too under the `full` feature strategy);
    a Pixtral tower takes images of their own size (`image_sizes`), one token per patch of each."""

    model_types = ("llava",)
    names = ("LLaVA",)

    def vision_modules(self, model: nn.Module) -> list[nn.Module]:
        return [model.model.vision_tower, model.model.multi_modal_projector]

    def image_token_count(self, model: nn.Module, images: ImageInputs) -> int:
        vision = model.config.vision_config
        sizes = images.extra_tensors.get("image_sizes")
        if sizes is not None:
            return int((sizes // vision.patch_size).prod(-1).sum())
        per_image = (vision.image_size // vision.patch_size) ** 2
        per_image += int(model.config.vision_feature_select_strategy == "full")
        return images.pixel_values.shape[0] * per_image

    def image_features(self, model: nn.Module, images: ImageInputs, device):
        sizes = images.extra_tensors.get("image_sizes")
        extra = {} if sizes is None else {"image_sizes": sizes.to(device)}
        return model.model.get_image_features(images.pixel_values.to(device), **extra)


class Mistral3Vision(PlainPositions):
    """Mistral 3 (a Pixtral tower over images of their own size, a patch merger, the Mistral language tower): one
    image token per merged patch, rows of them ended by text tags (`[IMG_BREAK]`, `[IMG_END]`)."""

    model_types = ("mistral3",)
    names = ("Mistral 3",)

    def vision_modules(self, model: nn.Module) -> list[nn.Module]:
        return [model.model.vision_tower, model.model.multi_modal_projector]

    def image_token_count(self, model: nn.Module, images: ImageInputs) -> int:
        merged_patch = model.model.vision_tower.patch_size * model.config.spatial_merge_size
        return int((images.extra_tensors["image_sizes"] // merged_patch).prod(-1).sum())

    def image_features(self, model: nn.Module, images: ImageInputs, device):
        return model.model.get_image_features(images.pixel_values.to(device),
                                              images.extra_tensors["image_sizes"].to(device))


class LlavaNextVision(PlainPositions):
    """LLaVA-NeXT and LLaVA-OneVision (a CLIP or SigLIP tower, an MLP projector, any language tower): anyres tiling.
    The processor resizes an image to the best of `image_grid_pinpoints`, cuts it into tiles of the tower's square
    and adds the whole image shrunk to one (`pixel_values` [images, tiles, channels, height, width], `image_sizes`);
    the model lays the tiles' patches out as one grid, cuts the rows or columns of padding away (unpadding;
    OneVision shrinks a grid over its `vision_aspect_ratio`) and ends each row with `image_newline`. A OneVision
    prompt of several images takes each image whole, untiled (`batch_num_images`)."""

    model_types = ("llava_next", "llava_onevision")
    names = ("LLaVA-NeXT", "LLaVA-OneVision")

    def vision_modules(self, model: nn.Module) -> list[nn.Module]:
        return [model.model.vision_tower, model.model.multi_modal_projector]

    def loose_vision_parameters(self, model: nn.Module) -> list[nn.Parameter]:
        """The embedding that ends each row of an image's grid (`image_newline`), a part of its image embeddings."""
        return [model.model.image_newline]

    def image_token_count(self, model: nn.Module, images: ImageInputs) -> int:
        """What the model's own `pack_image_features` makes of stand-in features (one channel of zeros per patch of
        each tile): the unpadded grid, its newlines and the whole image's patches."""
        config, inner = model.config, model.model
        side = config.vision_config.image_size // config.vision_config.patch_size
        sizes = images.extra_tensors["image_sizes"]
        stand_ins = [torch.zeros(tiles, side * side, 1) for tiles in self.tiles(model, images)]
        newline = torch.zeros(1)
        if config.model_type == "llava_onevision":
            _, lengths = inner.pack_image_features(stand_ins, sizes.cpu(), newline, config.vision_aspect_ratio)
        else:
            _, lengths = inner.pack_image_features(stand_ins, sizes.cpu(), config.vision_feature_select_strategy,
                                                   newline)
        return int(lengths.sum())

    @staticmethod
    def tiles(model: nn.Module, images: ImageInputs) -> list[int]:
        """How many tiles the tower encodes of each image, by the model's own `image_size_to_num_patches` (one, the
        image whole, for each image of a OneVision prompt of several)."""
        count = sys.modules[type(model.model).__module__].image_size_to_num_patches
        config = model.config
        several = images.extra_tensors.get("batch_num_images")
        if several is not None and int(several.sum()) > 1:
            return [1] * int(several.sum())
        return [count(size, config.image_grid_pinpoints, config.vision_config.image_size)
                for size in images.extra_tensors["image_sizes"].cpu()]

    def image_features(self, model: nn.Module, images: ImageInputs, device):
        extra = {name: tensor.to(device) for name, tensor in images.extra_tensors.items()}
        return model.model.get_image_features(images.pixel_values.to(device), **extra)


SERVED = (QwenVL(), Gemma3Vision(), Idefics3Vision(), LlavaVision(), Mistral3Vision(), LlavaNextVision())
FAMILIES = {model_type: family for family in SERVED for model_type in family.model_types}  # by config.model_type
