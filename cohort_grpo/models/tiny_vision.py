"""A tiny random Qwen-VL (Qwen2.5-VL by default; Qwen3-VL-MoE, Qwen3.5 too), Gemma 3, Idefics3, SmolVLM, LLaVA,
LLaVA-NeXT, LLaVA-OneVision or Mistral 3 and its processor, built with no download (tests, the vision task).

The processor is transformers' own `Qwen2_5_VLProcessor`: its image processor resizes an image to a few patches, and
its tokenizer is cohort's character tokenizer (models/tiny.py) with Qwen-VL's vision tags as single tokens and a chat
template that renders a `{"type": "image"}` part as `<|vision_start|><|image_pad|><|vision_end|>` (the processor
expands the pad to one token per merged patch). Gemma 3's is transformers' `Gemma3Processor` over the same
characters with Gemma's image tags, its images resized to one small square of a few tokens. Idefics3's and
SmolVLM's is `Idefics3Processor` (tiles of 28 pixels, 4 tokens each), LLaVA's `LlavaProcessor` over CLIP's image
processor (one square of 16 tokens), LLaVA-NeXT's and LLaVA-OneVision's their own over anyres tiles
(tiny_anyres.py); Mistral 3's, `PixtralProcessor`, needs torchvision, so its tests take the pixels from
`PixtralImageProcessorPil` and lay out the image tokens themselves (`pixtral_image_tokens`).
"""

from __future__ import annotations

import functools

import torch

from cohort_grpo.models.tiny import CHARS, build_tokenizer
from cohort_grpo.models.tiny_anyres import ANYRES_FAMILIES, anyres_config, build_anyres_processor

TINY_VISION_MODEL = "cohort:tiny-vision"  # built in memory on each use: random weights, nothing to cache
IMAGE_ONLY_PROCESSOR = "ImageOnlyProcessor"  # the processor class a saved folder of it names
VISION_TAGS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# A user turn renders its parts in order, then a newline; an assistant turn its text and EOS. The assistant turn
# needs no opening text, so add_generation_prompt adds nothing.
TINY_VISION_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- else %}{%- for part in message.content %}"
    "{%- if part.type == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part.type == 'text' %}{{- part.text }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{%- if message.role == 'assistant' %}{{- eos_token }}{%- else %}{{- '\\n' }}{%- endif %}"
    "{%- endfor %}"
)
PATCH = 14  # Qwen2(.5)-VL's patch side (Qwen3-VL's is 16); 2 × 2 patches merge into one image token
PATCHES = {"qwen2_5_vl": 14, "qwen2_vl": 14, "qwen3_vl": 16, "gemma3": 7, "idefics3": 7, "smolvlm": 7, "llava": 7,
           "qwen3_5": 16, "qwen3_5_moe": 16, "qwen3_vl_moe": 16, "llava_next": 7,
           "llava_onevision": 7}
# Families whose language tower keeps a recurrent state (Qwen3.5's Gated DeltaNet layers): transformers 5.21+.
RECURRENT_FAMILIES = ("qwen3_5", "qwen3_5_moe")
GEMMA_TAGS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
# Gemma 3's tiny image: a 6 × 6 grid of 7-pixel patches, pooled 2 × 2 into 3 × 3 = 9 image tokens; its sliding
# layers' window (4) is shorter than an image, so the window cuts into the image's two-way attention.
GEMMA_IMAGE, GEMMA_TOKENS, GEMMA_WINDOW = 42, 9, 4


def build_vision_processor(chars=CHARS, patch: int | None = None, family: str = "qwen2_5_vl"):
    """`Qwen2_5_VLProcessor` over the character tokenizer of `chars` plus the vision tags, images only, each image
    resized to between 2 × 2 and 4 × 4 merged tokens of `patch`-pixel patches (PATCHES[family] by default: a few
    tokens, on a CPU); for `family` gemma3, `Gemma3Processor` (`build_gemma3_processor`)."""
    from transformers import Qwen2VLImageProcessorPil

    if family == "gemma3":
        return build_gemma3_processor(chars)
    if family in PLAIN_FAMILIES:
        return build_plain_processor(chars, family)
    patch = patch or PATCHES[family]
    tokenizer = build_tokenizer(chars, tags=["<answer>", "</answer>", *VISION_TAGS])
    tokenizer.chat_template = TINY_VISION_TEMPLATE
    image_processor = Qwen2VLImageProcessorPil(min_pixels=(4 * patch) ** 2, max_pixels=(8 * patch) ** 2,
                                            patch_size=patch, merge_size=2, temporal_patch_size=2)
    return image_only_processor_class()(image_processor=image_processor, tokenizer=tokenizer,
                                        chat_template=TINY_VISION_TEMPLATE)


@functools.cache
def image_only_processor_class():
    """`Qwen2_5_VLProcessor` without its video processor (transformers' needs torchvision, which images do not): its
    sub-processors, which transformers reads from this signature, are the image processor and the tokenizer. One
    class (a folder saved with it names it, `IMAGE_ONLY_PROCESSOR`, and loads back through it)."""
    from transformers import Qwen2_5_VLProcessor

    class ImageOnlyProcessor(Qwen2_5_VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    assert ImageOnlyProcessor.__name__ == IMAGE_ONLY_PROCESSOR
    return ImageOnlyProcessor


def build_gemma3_processor(chars=CHARS):
    """`Gemma3Processor` over the character tokenizer of `chars` plus Gemma's image tags, images only: an image
    part renders as `<start_of_image>`, which the processor expands to the image's `GEMMA_TOKENS` soft tokens."""
    from transformers import Gemma3ImageProcessorPil, Gemma3Processor, PreTrainedTokenizerFast

    characters = build_tokenizer(chars, tags=["<answer>", "</answer>", *GEMMA_TAGS.values()])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=characters.backend_tokenizer, pad_token="<pad>",
                                        eos_token="<eos>", unk_token="<unk>", extra_special_tokens=GEMMA_TAGS)
    template = TINY_VISION_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", GEMMA_TAGS["boi_token"])
    tokenizer.chat_template = template
    image_processor = Gemma3ImageProcessorPil(size={"height": GEMMA_IMAGE, "width": GEMMA_IMAGE})
    return Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer, chat_template=template,
                           image_seq_length=GEMMA_TOKENS)


def build_gemma3_model(tokenizer, seed: int = 0, hidden_size: int = 64, layers: int = 3):
    """A random `Gemma3ForConditionalGeneration` for `build_gemma3_processor`'s tokenizer, float32: a SigLIP tower,
    the projector (its weight drawn: transformers starts it at zero, which would blank every image) and a Gemma 3
    language tower whose sliding and full layers alternate."""
    import transformers

    head_dim = hidden_size // 4  # text_tower's 4 heads
    text = text_tower(tokenizer, hidden_size, layers, head_dim=head_dim, query_pre_attn_scalar=head_dim,
                      sliding_window=GEMMA_WINDOW,
                      layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=GEMMA_IMAGE, patch_size=PATCHES["gemma3"])
    ids = {name: tokenizer.convert_tokens_to_ids(tag) for name, tag in GEMMA_TAGS.items()}
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=GEMMA_TOKENS, image_token_id=ids["image_token"],
        boi_token_id=ids["boi_token"], eoi_token_id=ids["eoi_token"], pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.2)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def build_vision_model(tokenizer, seed: int = 0, hidden_size: int = 64, layers: int = 2,
                       family: str = "qwen2_5_vl"):
    """A random Qwen-VL `...ForConditionalGeneration` of `family` (a key of PATCHES; its processor's patch side is
    PATCHES[family]) for `tokenizer` (its vision tags' ids), float32; for gemma3, `build_gemma3_model`; for the
    `RECURRENT_FAMILIES`, `build_qwen3_5_model`."""
    import transformers

    if family == "gemma3":
        return build_gemma3_model(tokenizer, seed, hidden_size)
    if family in PLAIN_FAMILIES:
        return build_plain_model(tokenizer, family, seed, hidden_size, layers)
    if family in RECURRENT_FAMILIES:
        return build_qwen3_5_model(tokenizer, seed, hidden_size, layers, family)

    ids = {tag: tokenizer.convert_tokens_to_ids(tag) for tag in VISION_TAGS}
    heads = 4  # text_tower's
    text = text_tower(tokenizer, hidden_size, layers,
                      rope_scaling={"type": "mrope", "mrope_section": mrope_sections(hidden_size // heads)})
    vision = dict(depth=2, num_heads=2, patch_size=PATCH, spatial_merge_size=2, temporal_patch_size=2)
    if family == "qwen2_5_vl":
        vision.update(hidden_size=32, intermediate_size=64, out_hidden_size=hidden_size, window_size=4 * PATCH,
                      fullatt_block_indexes=[1])
        config_class, model_class = transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration
    elif family == "qwen2_vl":
        vision.update(embed_dim=32, hidden_size=hidden_size, mlp_ratio=2)
        config_class, model_class = transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration
    elif family in ("qwen3_vl", "qwen3_vl_moe"):  # interleaved rotary sections, deepstack features into layer 0
        text.pop("rope_scaling")
        text.update(head_dim=hidden_size // heads, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "mrope_interleaved": True,
            "mrope_section": mrope_sections(hidden_size // heads)})
        vision.update(patch_size=PATCHES[family], hidden_size=32, intermediate_size=64, out_hidden_size=hidden_size,
                      num_position_embeddings=64, deepstack_visual_indexes=[0])
        config_class, model_class = transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration
        if family == "qwen3_vl_moe":  # an MoE language tower: 4 experts, 2 a token
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden_size // 2)
            config_class = transformers.Qwen3VLMoeConfig
            model_class = transformers.Qwen3VLMoeForConditionalGeneration
    else:
        raise ValueError(f"family={family!r}: one of {sorted(PATCHES)}")
    config = config_class(
        text_config=text, vision_config=vision,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = model_class(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def family_unavailable(family: str) -> str | None:
    """Why the installed transformers cannot build or serve a tiny model of `family` (a test's skip reason), or
    None."""
    from cohort_grpo.models.generic_attention import STATE_INTERFACE_SINCE, has_state_interface

    if family in RECURRENT_FAMILIES and not has_state_interface():
        import transformers

        return (f"{family}'s Gated DeltaNet layers need transformers' state interface ({STATE_INTERFACE_SINCE}+; "
                f"installed: {transformers.__version__})")
    return None


def build_qwen3_5_model(tokenizer, seed: int = 0, hidden_size: int = 64, layers: int = 2,
                        family: str = "qwen3_5"):
    """A random `Qwen3_5ForConditionalGeneration` (or, for qwen3_5_moe, `Qwen3_5MoeForConditionalGeneration`) for
    `tokenizer`, float32: Qwen3-VL's vision tower without deepstack features, and a language tower whose Gated
    DeltaNet and full-attention layers alternate (MoE: 4 experts, 2 a token); both towers' weights drawn wide (0.2)
    enough that the images, and a recurrent state run wrong, change the tokens."""
    import transformers

    ids = {tag: tokenizer.convert_tokens_to_ids(tag) for tag in VISION_TAGS}
    head_dim = hidden_size // 4  # text_tower's 4 heads; rotary over half of each, as Qwen3.5's partial rotary
    layer_types = ["linear_attention", "full_attention"] * (layers // 2) + ["linear_attention"] * (layers % 2)
    text = text_tower(tokenizer, hidden_size, layers, head_dim=head_dim, linear_num_key_heads=2,
                      linear_num_value_heads=4, linear_key_head_dim=head_dim, linear_value_head_dim=head_dim,
                      layer_types=layer_types, initializer_range=0.2,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_interleaved": True,
                                       "mrope_section": mrope_sections(head_dim // 2), "partial_rotary_factor": 0.5})
    vision = dict(depth=2, num_heads=2, patch_size=PATCHES[family], spatial_merge_size=2, temporal_patch_size=2,
                  hidden_size=32, intermediate_size=64, out_hidden_size=hidden_size, num_position_embeddings=64,
                  initializer_range=0.2)
    if family == "qwen3_5_moe":
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden_size // 2,
                    shared_expert_intermediate_size=hidden_size // 2)
        config_class, model_class = transformers.Qwen3_5MoeConfig, transformers.Qwen3_5MoeForConditionalGeneration
    else:
        config_class, model_class = transformers.Qwen3_5Config, transformers.Qwen3_5ForConditionalGeneration
    config = config_class(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = model_class(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def mrope_sections(head_dim: int) -> list[int]:
    """The rotary frequency pairs of a head split over (time, height, width), as Qwen2.5-VL's 16/24/24 of 64."""
    pairs = head_dim // 2
    time = pairs // 4
    height = (pairs - time) // 2
    return [time, height, pairs - time - height]


# ---- families of plain positions and causal image tokens: Idefics3 / SmolVLM, LLaVA, Mistral 3 -----------------
PLAIN_FAMILIES = ("idefics3", "smolvlm", "llava", "mistral3", *ANYRES_FAMILIES)
IDEFICS3_TAGS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>",
                 *(f"<row_{row}_col_{column}>" for row in range(1, 7) for column in range(1, 7))]
# Idefics3's tiny tile: 28 pixels, 4 × 4 patches of 7, shuffled 2 × 2 into 4 image tokens; an image up to 56 pixels
# on its long side splits into up to 2 × 2 tiles, plus the whole image shrunk to one.
IDEFICS3_TILE, IDEFICS3_LONGEST, IDEFICS3_TOKENS = 28, 56, 4
PIXTRAL_TAGS = {"image_token": "[IMG]", "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}
LLAVA_IMAGE = 28  # LLaVA's tiny image: one square of 4 × 4 patches of 7, one image token each
# Pixtral's tiny images (Mistral 3's): their own size, up to 42 pixels a side, patches of 7 (Mistral 3: one token per
# 2 × 2 of them)
MISTRAL3_LONGEST, PIXTRAL_PATCH = 42, 7


def plain_tokenizer(chars, tags: list[str], image_tag: str):
    """The character tokenizer with `tags` as single tokens and the tiny chat template, an image part rendered as
    `image_tag` (the processor expands it)."""
    tokenizer = build_tokenizer(chars, tags=["<answer>", "</answer>", *tags])
    tokenizer.chat_template = TINY_VISION_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", image_tag)
    return tokenizer


def build_plain_processor(chars=CHARS, family: str = "idefics3"):
    """The processor of a tiny model of `family` (one of PLAIN_FAMILIES but Mistral 3, whose `PixtralProcessor`
    needs torchvision: `pixtral_tokenizer`; LLaVA-NeXT's and LLaVA-OneVision's, tiny_anyres.py's)."""
    if family in ("idefics3", "smolvlm"):
        return build_idefics3_processor(chars)
    if family == "llava":
        return build_llava_processor(chars)
    if family in ANYRES_FAMILIES:
        return build_anyres_processor(plain_tokenizer(chars, ["<image>", "<video>"], "<image>"), family)
    raise ValueError(f"{family}'s processor (transformers' PixtralProcessor) needs torchvision: build the tokenizer "
                     "with pixtral_tokenizer, the pixels with PixtralImageProcessorPil")


def build_idefics3_processor(chars=CHARS):
    """`Idefics3Processor` over the character tokenizer with Idefics3's tags, images only, for Idefics3 and SmolVLM
    alike (SmolVLM's own processor lays out an image's tokens the same way, and needs num2words and torchvision
    for its videos)."""
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor

    tokenizer = plain_tokenizer(chars, IDEFICS3_TAGS, "<image>")
    image_processor = Idefics3ImageProcessorPil(size={"longest_edge": IDEFICS3_LONGEST},
                                                max_image_size={"longest_edge": IDEFICS3_TILE})
    return Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=IDEFICS3_TOKENS,
                             chat_template=tokenizer.chat_template)


def build_llava_processor(chars=CHARS):
    """`LlavaProcessor` over the character tokenizer with `<image>`, CLIP's image processor to one small square."""
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    tokenizer = plain_tokenizer(chars, ["<image>"], "<image>")
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": LLAVA_IMAGE},
                                            crop_size={"height": LLAVA_IMAGE, "width": LLAVA_IMAGE})
    return LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCHES["llava"],
                          vision_feature_select_strategy="default", num_additional_image_tokens=1,
                          chat_template=tokenizer.chat_template)


def pixtral_tokenizer(chars=CHARS):
    """The character tokenizer with Pixtral's image tags (Mistral 3's, and LLaVA's over a Pixtral tower).
    transformers' `PixtralProcessor` needs torchvision, which images here do without: tests lay out an image's
    tokens themselves (`pixtral_image_tokens`) and take the pixels from `PixtralImageProcessorPil`."""
    return plain_tokenizer(chars, list(PIXTRAL_TAGS.values()), PIXTRAL_TAGS["image_token"])


def pixtral_image_tokens(tokenizer, image_sizes: torch.Tensor, merged_patch: int) -> list[list[int]]:
    """Each image's tokens as Pixtral lays them out: a row of image tokens per `merged_patch` pixels of height,
    one per `merged_patch` of width, each row ended by `[IMG_BREAK]`, the last by `[IMG_END]`."""
    ids = {name: tokenizer.convert_tokens_to_ids(tag) for name, tag in PIXTRAL_TAGS.items()}
    laid_out = []
    for height, width in (image_sizes // merged_patch).tolist():
        tokens = ([ids["image_token"]] * width + [ids["image_break_token"]]) * height
        laid_out.append(tokens[:-1] + [ids["image_end_token"]])
    return laid_out


def text_tower(tokenizer, hidden_size: int, layers: int, **more) -> dict:
    """A Llama-shaped language tower's config for `tokenizer`."""
    return dict(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=1024,
                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None, **more)


def build_plain_model(tokenizer, family: str, seed: int = 0, hidden_size: int = 64, layers: int = 2,
                      pixtral_tower: bool = False):
    """A random Idefics3, SmolVLM, LLaVA, LLaVA-NeXT, LLaVA-OneVision or Mistral 3 `...ForConditionalGeneration`
    for the tokenizer of `build_vision_processor(family=family)` (Mistral 3, and LLaVA with `pixtral_tower`:
    `pixtral_tokenizer`), float32: a two-layer vision tower of width 32 (LLaVA's a CLIP one, or a Pixtral one;
    LLaVA-NeXT's CLIP, OneVision's SigLIP), its projector, a Llama (Mistral 3: Mistral) language tower."""
    import transformers

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  patch_size=PIXTRAL_PATCH if family == "mistral3" or pixtral_tower else PATCHES[family])
    common = dict(text_config=text_tower(tokenizer, hidden_size, layers), pad_token_id=tokenizer.pad_token_id,
                  eos_token_id=tokenizer.eos_token_id, bos_token_id=None, tie_word_embeddings=False)
    if family in ("idefics3", "smolvlm"):
        config_class, model_class = {"idefics3": (transformers.Idefics3Config,
                                                  transformers.Idefics3ForConditionalGeneration),
                                     "smolvlm": (transformers.SmolVLMConfig,
                                                 transformers.SmolVLMForConditionalGeneration)}[family]
        config = config_class(vision_config=dict(vision, image_size=IDEFICS3_TILE), scale_factor=2,
                              image_token_id=tokenizer.convert_tokens_to_ids("<image>"), **common)
    elif family == "llava" and pixtral_tower:
        config_class, model_class = transformers.LlavaConfig, transformers.LlavaForConditionalGeneration
        config = config_class(vision_config=dict(vision, model_type="pixtral", head_dim=16,
                                                 image_size=MISTRAL3_LONGEST),
                              image_token_id=tokenizer.convert_tokens_to_ids(PIXTRAL_TAGS["image_token"]),
                              vision_feature_layer=-1, vision_feature_select_strategy="full", **common)
    elif family == "llava":
        config_class, model_class = transformers.LlavaConfig, transformers.LlavaForConditionalGeneration
        config = config_class(vision_config=dict(vision, model_type="clip_vision_model", image_size=LLAVA_IMAGE),
                              image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                              image_seq_length=(LLAVA_IMAGE // PATCHES[family]) ** 2, **common)
    elif family in ANYRES_FAMILIES:
        config, model_class = anyres_config(family, tokenizer, vision, common)
    elif family == "mistral3":
        config_class, model_class = transformers.Mistral3Config, transformers.Mistral3ForConditionalGeneration
        common["text_config"].update(model_type="mistral", head_dim=hidden_size // 4, sliding_window=None)
        config = config_class(vision_config=dict(vision, model_type="pixtral", head_dim=16,
                                                 image_size=MISTRAL3_LONGEST),
                              image_token_id=tokenizer.convert_tokens_to_ids(PIXTRAL_TAGS["image_token"]),
                              spatial_merge_size=2, **common)
    else:
        raise ValueError(f"family={family!r}: one of {sorted(PLAIN_FAMILIES)}")
    torch.manual_seed(seed)
    model = model_class(config)
    if family in ("llava", "mistral3", *ANYRES_FAMILIES):
        with torch.no_grad():  # transformers' small start would leave the images' mark on the tokens faint
            for weight in model.model.multi_modal_projector.parameters():
                if weight.dim() == 2:
                    weight.normal_(0.0, 0.2)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model

