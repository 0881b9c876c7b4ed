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
