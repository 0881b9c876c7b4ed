"""Where a vision-language model's images go in its forwards: one row per prompt (the prefill, the padded layout of
the update), or the shared-prompt layout's one flat row (update/packing.py `pack_shared_prompts`), in which each
prompt stands once before its G completions and attention rows say what each token sees (models/shared_prefix.py).

In the flat row a prompt's images are placed once, at its own image tokens, whichever of its completions' attention
rows name them: the vision tower runs once per packed prompt and the layers compute its image tokens once. What
each token sees and where it stands are the padded layout's (vision_families.py's `shared_prompt_positions`, and
`attention_row_types`, from which Gemma 3's image blocks follow), so the log-probs are the same.
"""

from __future__ import annotations

import torch

from cohort_grpo.errors import CohortError
from cohort_grpo.models.vision_families import ImageInputs, ImagePlacement


def first_image_tokens(tokens: torch.Tensor, image_token_id: int, wanted: int, row: int) -> torch.Tensor:
    """The columns of the first `wanted` image tokens of a row's `tokens` (a completion that samples an image token
    keeps it a text token, as transformers' `generate` does); a one-line error where the prompt has fewer."""
    found = (tokens == image_token_id).nonzero()[:, 0]
    if len(found) < wanted:
        raise CohortError(f"row {row}'s prompt has {len(found)} image tokens where its images fill {wanted}: "
                          "render prompts with the model's processor (it inserts the image tokens)")
    return found[:wanted]


def row_placements(input_ids: torch.Tensor, images: list[ImageInputs | None], image_token_id: int,
                   token_count) -> list[ImagePlacement]:
    """Row by row (one row per prompt), where its images go: its first image tokens, as many as `token_count`
    says they fill; nothing for a text row (images None)."""
    return [ImagePlacement(row_images, row, first_image_tokens(input_ids[row], image_token_id,
                                                               token_count(row_images), row))
            for row, row_images in enumerate(images) if row_images is not None]


def padding_columns(attention_rows: torch.Tensor) -> torch.Tensor:
    """Bool [b, L]: the columns that pad an attention row (flat index 0 anywhere but a row's start: the first
    prompt's first token stands only there)."""
    columns = torch.arange(attention_rows.shape[1], device=attention_rows.device)
    return (attention_rows == 0) & (columns > 0)


def shared_prompt_placements(input_ids: torch.Tensor, attention_rows: torch.Tensor,
                             images: list[ImageInputs | None], image_token_id: int,
                             token_count) -> list[ImagePlacement]:
    """Each packed prompt's images once, in flat order: at the flat indices of the first image tokens of the first
    attention row that names them (the prompt's image tokens, which every row of its group shares). `images`: one
    per attention row (None for a text prompt's); a prompt is its images and its first flat index."""
    placed, padding = {}, padding_columns(attention_rows)
    for row, row_images in enumerate(images):
        if row_images is None:
            continue
        key = (id(row_images), int(attention_rows[row, 0]))
        if key in placed:
            continue
        tokens = input_ids[0, attention_rows[row]].masked_fill(padding[row], -1)
        columns = first_image_tokens(tokens, image_token_id, token_count(row_images), row)
        placed[key] = ImagePlacement(row_images, 0, attention_rows[row, columns])
    return sorted(placed.values(), key=lambda placement: int(placement.columns[0]))


def attention_row_types(token_types: torch.Tensor, attention_rows: torch.Tensor) -> torch.Tensor:
    """Token types [b, L] along each attention row, from the flat row's [1, N]: a padded row's types, its padding
    text (type 0)."""
    types = token_types[0, attention_rows]
    return types.masked_fill(padding_columns(attention_rows), 0)
