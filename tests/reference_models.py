"""transformers' own models as independent references: random-init from a config, weights perturbed
so biases and norm scales matter, saved as an HF folder our loader reads."""

import torch
from transformers import AutoModelForCausalLM


def save_perturbed_reference(config, folder):
    """The transformers model of `config` (float32, eval, seed 0, every weight + 0.05·N(0, 1)),
    saved to `folder`."""
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    reference.save_pretrained(folder)
    return reference


def save_perturbed_references(families: dict, tmp_path_factory) -> dict:
    """family -> (`save_perturbed_reference` of its config, the folder it was saved to), for a dict
    family -> config factory; one temporary folder per family."""
    made = {}
    for family, make_config in families.items():
        folder = tmp_path_factory.mktemp(family)
        made[family] = (save_perturbed_reference(make_config(), folder), folder)
    return made


def padded_batch(vocab_size: int):
    """Two rows of 10 random tokens, the first left-padded by 3: (ids, attention mask, position ids)."""
    ids = torch.randint(0, vocab_size, (2, 10), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, :3] = 0
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def assert_logits_match(ours, reference, vocab_size: int, tolerance: float = 1e-5) -> None:
    """cohort's model `ours` gives transformers' `reference` logits (float32) on `padded_batch`: unpadded,
    and left-padded with the mask and position ids (compared where the mask is 1)."""
    ids, mask, positions = padded_batch(vocab_size)
    with torch.no_grad():
        assert (ours(ids) - reference(ids).logits).abs().max() <= tolerance
        expected = reference(ids, attention_mask=mask, position_ids=positions).logits
        assert (ours(ids, positions, mask) - expected)[mask.bool()].abs().max() <= tolerance
