"""Tiny LLaVA-NeXT and LLaVA-OneVision models' configs and processors (anyres tiling), built with no download; the
rest of a tiny plain-position model (its tokenizer, its language tower, the drawn projector) is tiny_vision.py's.

Both processors are transformers' own over cohort's character tokenizer, each with its PIL image processor: an image
resized to the best of `PINPOINTS` and cut into squares of `TILE` pixels (2 × 2 patches of `PATCH`), plus the whole
image shrunk to one; up to 4 + 4 × 4 image tokens and a newline per row of the grid. OneVision's grid shrinks past
`ONEVISION_ASPECT_RATIO` (more than 2 tiles' patches), and its processor goes without the video processor, which needs
torchvision (`onevision_processor_class`).
"""

from __future__ import annotations

import functools

ANYRES_FAMILIES = ("llava_next", "llava_onevision")
PATCH, TILE = 7, 14
PINPOINTS = [[14, 28], [28, 14], [28, 28]]
ONEVISION_ASPECT_RATIO = "anyres_max_2"


def build_anyres_processor(tokenizer, family: str):
    """`LlavaNextProcessor` (a CLIP tower: its class token dropped) or OneVision's (a SigLIP tower: every patch) over
    `tokenizer`, which holds `<image>` (and `<video>`) as single tokens and the chat template."""
    from transformers import LlavaNextImageProcessorPil, LlavaNextProcessor, LlavaOnevisionImageProcessorPil

    if family == "llava_next":
        image_processor = LlavaNextImageProcessorPil(size={"shortest_edge": TILE},
                                                     crop_size={"height": TILE, "width": TILE},
                                                     image_grid_pinpoints=PINPOINTS)
        return LlavaNextProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH,
                                  vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                  chat_template=tokenizer.chat_template)
    image_processor = LlavaOnevisionImageProcessorPil(size={"height": TILE, "width": TILE},
                                                      image_grid_pinpoints=PINPOINTS)
    return onevision_processor_class()(image_processor=image_processor, tokenizer=tokenizer,
                                       num_image_tokens=(TILE // PATCH) ** 2, vision_feature_select_strategy="full",
                                       vision_aspect_ratio=ONEVISION_ASPECT_RATIO,
                                       chat_template=tokenizer.chat_template)


@functools.cache
def onevision_processor_class():
    """`LlavaOnevisionProcessor` without its video processor (images only), one class."""
    from transformers import LlavaOnevisionProcessor

    class ImageOnlyOnevisionProcessor(LlavaOnevisionProcessor):
        def __init__(self, image_processor=None, tokenizer=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, **kwargs)

    return ImageOnlyOnevisionProcessor


def anyres_config(family: str, tokenizer, vision: dict, common: dict):
    """The config and model class of a tiny `family` model: `vision` the tower's sizes, `common` the language tower
    and the token ids (tiny_vision.build_plain_model's)."""
    import transformers

    tower = dict(vision, patch_size=PATCH, image_size=TILE)
    ids = dict(image_token_id=tokenizer.convert_tokens_to_ids("<image>"), image_grid_pinpoints=PINPOINTS)
    if family == "llava_next":
        config = transformers.LlavaNextConfig(vision_config=dict(tower, model_type="clip_vision_model"), **ids,
                                              **common)
        return config, transformers.LlavaNextForConditionalGeneration
    config = transformers.LlavaOnevisionConfig(
        vision_config=dict(tower, model_type="siglip_vision_model"), **ids,
        video_token_id=tokenizer.convert_tokens_to_ids("<video>"), vision_feature_select_strategy="full",
        vision_feature_layer=-1, vision_aspect_ratio=ONEVISION_ASPECT_RATIO, **common)
    return config, transformers.LlavaOnevisionForConditionalGeneration
