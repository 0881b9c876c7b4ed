"""A vision-language run's prompts: each row's images, rendered with the model's processor into tokens and pixels.

Data as TRL has it: a row's images are its `image` column (one) or `images` column (a list), each a PIL image, a
path, raw bytes, or a datasets `Image` value left undecoded ({"bytes": ..., "path": ...}); its prompt is chat
messages whose user turns hold `{"type": "image"}` parts where the images go (a prompt without such parts gets them
at the start of its first user turn, as TRL's `prepare_multimodal_messages` places them; a plain-text prompt becomes
that one user turn). The chat template renders the parts as the model's image tags; the processor resizes the
images and expands each image's tag to one token per merged patch. The result, per prompt, is its token ids and one
`ImageInputs` the engine's prefill and the update's forwards take (models/vision_language.py).
"""

from __future__ import annotations

import copy
import io
from pathlib import Path

import torch

from cohort_grpo.errors import CohortError
from cohort_grpo.models.vision_language import ImageInputs

IMAGE_COLUMNS = ("image", "images")


def row_images(row: dict) -> list | None:
    """The images of a dataset row, loaded as RGB PIL images; None for a row without an image column (or an
    empty one)."""
    if "image" in row and "images" in row:
        raise CohortError("a row has both an `image` and an `images` column: keep one (TRL reads either)")
    value = row.get("image", row.get("images"))
    if value is None:
        return None
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    return [load_image(item) for item in values] or None


def load_image(value):
    """One image from what a dataset may hold: a PIL image, a path, bytes, or {"bytes": ..., "path": ...}."""
    from PIL import Image

    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    if isinstance(value, Image.Image):
        image = value
    elif isinstance(value, (bytes, bytearray)):
        image = Image.open(io.BytesIO(value))
    elif isinstance(value, (str, Path)):
        if not Path(value).is_file():
            raise CohortError(f"image {str(value)!r} is not a file: give an existing path, bytes or a PIL image")
        image = Image.open(value)
    else:
        raise CohortError(f"an image column holds a {type(value).__name__}: give PIL images, paths or bytes")
    return image.convert("RGB")


def with_image_parts(prompt, count: int) -> list[dict]:
    """`prompt` as chat messages whose user turns hold `count` image parts in all: as given when they do, else
    with the parts put at the start of the first user turn (a plain-text prompt becomes that turn)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else copy.deepcopy(prompt)
    present = sum(1 for message in messages if isinstance(message.get("content"), list)
                  for part in message["content"] if isinstance(part, dict) and part.get("type") == "image")
    if present == count:
        return messages
    if present:
        raise CohortError(f"a prompt has {present} image parts for {count} images in its row: give one "
                          "{\"type\": \"image\"} part per image, or none (they then open the first user turn)")
    for message in messages:
        if message.get("role") == "user":
            content = message["content"]
            text = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
            message["content"] = [{"type": "image"} for _ in range(count)] + text
            return messages
    raise CohortError("a prompt with images has no user turn to hold them: add one")


class ImagePrompts:
    """Renders rows with images through `processor` (the model folder's, or one given as processing_class)."""

    def __init__(self, processor, template_kwargs: dict | None = None):
        if getattr(processor, "image_processor", None) is None:
            raise CohortError(f"rows with images need the model's processor, got a {type(processor).__name__}: pass "
                              "processing_class=AutoProcessor.from_pretrained(model)")
        self.processor, self.template_kwargs = processor, template_kwargs or {}

    @classmethod
    def of(cls, model, template_kwargs: dict | None = None) -> "ImagePrompts | None":
        """The renderer of a vision-language `model`'s prompts (its processor), None for a text model."""
        if not getattr(model, "takes_images", False):
            return None
        return cls(getattr(model, "processor", None), template_kwargs)

    def encode(self, prompt, images: list) -> tuple[list[int], ImageInputs]:
        """A prompt's token ids (its image tags expanded) and its images as the model takes them."""
        messages = with_image_parts(prompt, len(images))
        text = self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                  **self.template_kwargs)
        encoded = self.processor(text=[text], images=images, return_tensors="pt")
        return encoded["input_ids"][0].tolist(), ImageInputs.from_processor(encoded)


def encode_rows(rows: list[dict], encode_prompt, images: "ImagePrompts | None") -> tuple[list[list[int]], dict]:
    """Each row's prompt ids, and the `generate` keywords that carry their images (none for a text model or rows
    without images): what evaluation samples from, rendered as training renders it."""
    if images is None or all(row_images(row) is None for row in rows):
        return [encode_prompt(row["prompt"]) for row in rows], {}
    ids, inputs = [], []
    for row in rows:
        loaded = row_images(row)
        encoded = (encode_prompt(row["prompt"]), None) if loaded is None else images.encode(row["prompt"], loaded)
        ids.append(encoded[0])
        inputs.append(encoded[1])
    return ids, {"images": inputs}


# ---- in a checkpoint ---------------------------------------------------------------------------------------------
# Rollouts sampled ahead are saved with the step's checkpoint and loaded with torch.load(weights_only=True), which
# takes tensors and plain containers only: a row's PIL images travel as their PNG bytes (lossless, mode and palette
# kept), and the processor's `ImageInputs` as their tensors, each prompt's once.

def stored_rows(rows: list[dict]) -> list[dict]:
    """`rows` with each PIL image of their image columns as {"png": uint8 tensor of its PNG file}."""
    return [{key: stored_image_value(value) if key in IMAGE_COLUMNS else value for key, value in row.items()}
            if isinstance(row, dict) else row for row in rows]


def restored_rows(rows: list[dict]) -> list[dict]:
    """Inverse of `stored_rows`: the PIL images back."""
    return [{key: restored_image_value(value) if key in IMAGE_COLUMNS else value for key, value in row.items()}
            if isinstance(row, dict) else row for row in rows]


def stored_image_value(value):
    from PIL import Image

    if isinstance(value, (list, tuple)):
        return [stored_image_value(item) for item in value]
    if isinstance(value, Image.Image):
        buffer = io.BytesIO()
        value.save(buffer, format="PNG")
        return {"png": torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)}
    return value


def restored_image_value(value):
    from PIL import Image

    if isinstance(value, list):
        return [restored_image_value(item) for item in value]
    if isinstance(value, dict) and set(value) == {"png"}:
        image = Image.open(io.BytesIO(value["png"].numpy().tobytes()))
        image.load()
        return image
    return value


def stored_images(images: list) -> dict | list:
    """A batch's `ImageInputs` per row (a prompt's rows share one) as tensors: each distinct one once, and which of
    them each row has (-1: a row without images); the processor's other image tensors only where a family has
    them. Values of another kind are kept as they are."""
    if not all(inputs is None or isinstance(inputs, ImageInputs) for inputs in images):
        return images
    distinct: dict[int, int] = {}
    order = []
    for inputs in images:
        if inputs is not None and id(inputs) not in distinct:
            distinct[id(inputs)] = len(order)
            order.append(inputs)
    state = {"pixel_values": [inputs.pixel_values for inputs in order],
             "image_grid_thw": [inputs.image_grid_thw for inputs in order],
             "of_row": [-1 if inputs is None else distinct[id(inputs)] for inputs in images]}
    if any(inputs.extra_tensors for inputs in order):
        state["extra_tensors"] = [dict(inputs.extra_tensors) for inputs in order]
    return state


def restored_images(state: dict | list) -> list:
    """Inverse of `stored_images`: one `ImageInputs` per distinct entry, shared again by the rows that had it."""
    if not isinstance(state, dict):
        return state
    extra = state.get("extra_tensors") or [{}] * len(state["pixel_values"])
    made = [ImageInputs(pixels, grid, dict(tensors))
            for pixels, grid, tensors in zip(state["pixel_values"], state["image_grid_thw"], extra)]
    return [None if index < 0 else made[index] for index in state["of_row"]]
