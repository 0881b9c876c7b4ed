"""Images in `cohort-grpo chat`: `--image PATH` (repeatable) attaches images to the first message, `/image PATH`
inside the chat to the next one.

A message with images is a user turn whose content is the images as `{"type": "image"}` parts before its text, as
a training prompt's images open its first user turn (rollout/images.py). Once the conversation holds an image, each
turn is rendered as the trainer renders a prompt with images: the model's processor (`ImagePrompts`) over the whole
conversation with all its images, giving the token ids and one `ImageInputs` for the prefill. The KV cache keeps
what it holds across turns as for text: a turn that adds only text runs only its new tokens (the rope delta the
image prefill recorded carries on), and a turn that adds an image, or a conversation whose images changed, runs the
whole conversation again with its images (`ConversationImages.reusable`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cohort_grpo.errors import CohortError
from cohort_grpo.models.lora import base_model
from cohort_grpo.rollout.images import ImagePrompts, load_image


@dataclass(eq=False)
class ConversationImages:
    """A rendered conversation's images: the image objects in order (what the KV cache's tokens stand for, compared
    by identity) and the processor's `ImageInputs` of them all (the prefill's)."""

    images: tuple
    inputs: object

    def same_images(self, other: "ConversationImages | None") -> bool:
        return other is not None and len(other.images) == len(self.images) and all(
            mine is theirs for mine, theirs in zip(self.images, other.images))


def reusable_prefix(prompt: list[int], shared: int, images: ConversationImages | None,
                    held: ConversationImages | None, image_token_id: int | None) -> bool:
    """Whether the cache's first `shared` tokens serve `prompt`: the same images as the cache holds (none, or these
    very ones) and no image token after the shared part (an image's tokens run together with its pixels)."""
    if images is None:
        return held is None
    if not images.same_images(held):
        return False
    return all(token != image_token_id for token in prompt[shared:])


def image_parts(content) -> list:
    """The image objects of a message's content (none for a string)."""
    if not isinstance(content, list):
        return []
    return [part["image"] for part in content if isinstance(part, dict) and part.get("type") == "image"]


class ChatImages:
    """A chat's images: those waiting for the next message, and the renderer of a conversation that holds some (the
    model's processor; None for a text model)."""

    def __init__(self, model):
        self.prompts = ImagePrompts.of(base_model(model))
        config = getattr(base_model(model), "config", None)
        self.model_name = getattr(config, "model_type", None) or type(base_model(model)).__name__
        self.pending: list = []

    def attach(self, path: str, option: str, refusal: str | None = None) -> None:
        """Load the image at `path` for the next message; `option` (--image or /image) names where it came from in
        a one-line error, as `refusal` does what the session cannot do with images."""
        if self.prompts is None:
            raise CohortError(f"{option} needs a vision-language model (Qwen-VL, Gemma 3, SmolVLM, LLaVA, ...); this {self.model_name} "
                              f"model reads text only: chat with a vision-language model folder, or drop {option}")
        if refusal is not None:
            raise CohortError(f"{option}: {refusal}")
        if not path:
            raise CohortError(f"{option} needs a path: {option} PATH (an image file: PNG, JPEG, ...)")
        if not Path(path).expanduser().is_file():
            raise CohortError(f"{option} {path}: no such file; give the path of an image file (PNG, JPEG, ...)")
        self.pending.append(open_image(path, option))

    def user_content(self, text: str):
        """The next user message's content: `text`, or the pending images as image parts before it."""
        if not self.pending:
            return text
        return [*({"type": "image", "image": image} for image in self.pending), {"type": "text", "text": text}]

    def clear(self) -> None:
        self.pending = []

    def render(self, conversation: list[dict]) -> tuple[list[int], ConversationImages]:
        """A conversation that holds images as the trainer renders a prompt with images: its token ids (each image
        tag expanded by the processor) and its images."""
        images, parts_only = [], []
        for message in conversation:
            found = image_parts(message.get("content"))
            if found:
                images += found
                message = {**message, "content": [{"type": "image"} if isinstance(part, dict) and
                                                  part.get("type") == "image" else part
                                                  for part in message["content"]]}
            parts_only.append(message)
        ids, inputs = self.prompts.encode(parts_only, images)
        return ids, ConversationImages(tuple(images), inputs)


def holds_images(conversation: list[dict]) -> bool:
    return any(image_parts(message.get("content")) for message in conversation)


def open_image(path: str, option: str):
    """The image file at `path` as RGB; a file PIL cannot read is one line naming it."""
    from PIL import UnidentifiedImageError

    try:
        return load_image(str(Path(path).expanduser()))
    except (UnidentifiedImageError, OSError) as error:
        raise CohortError(f"{option} {path}: not an image file PIL can read ({type(error).__name__}); give a PNG, "
                          "JPEG or other image file") from None


def image_command_path(text: str) -> str:
    """The path of a `/image PATH` line, without the quotes a pasted path may have."""
    path = text[len("/image"):].strip()
    if len(path) >= 2 and path[0] == path[-1] and path[0] in "'\"":
        path = path[1:-1]
    return path
