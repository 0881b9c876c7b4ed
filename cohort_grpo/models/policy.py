"""A trained policy saved back as an ordinary Hugging Face folder (`save_policy`, LoRA adapters merged), and
the frozen copy that serves as π_ref (`frozen_copy`). Loading what the user named is `cohort_grpo.run.policy`."""

from __future__ import annotations

import copy
from pathlib import Path

from cohort_grpo.models.files import give_usual_mode
from cohort_grpo.models.lora import has_lora, merged_state_dict, save_adapter
from cohort_grpo.models.causal_lm import CausalLM


def save_policy(model, tokenizer, out_dir: Path, state: dict | None = None) -> Path:
    """An ordinary Hugging Face folder (config.json, model.safetensors, tokenizer files); with
    LoRA the adapters merged into the weights, plus the adapters alone in peft's format. `state`: the
    whole tensors to write instead of the model's own (an FSDP2-sharded model's, gathered)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lora = has_lora(model)
    state = merged_state_dict(model) if lora else state
    if isinstance(model, CausalLM):
        model.save_pretrained(out_dir, state=state)
    else:
        save_transformers_model(model, out_dir, state)
    if lora:
        save_adapter(model, out_dir, base_model=getattr(model, "name_or_path", None))
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    processor = getattr(model, "processor", None)  # a vision-language model's: its image processor and template too
    if processor is not None:
        processor.save_pretrained(out_dir)
    return out_dir


def save_transformers_model(model, out_dir: Path, state: dict | None = None) -> None:
    """A transformers model's `save_pretrained`, without the "Writing model shards" bar it draws (the run's
    display is cohort's) and with its weight files in the usual mode (`files.py`)."""
    from transformers.utils import logging as transformers_logging

    bars = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        model.save_pretrained(out_dir, safe_serialization=True, **({"state_dict": state} if state else {}))
    finally:
        if bars:
            transformers_logging.enable_progress_bar()
    give_usual_mode(*Path(out_dir).glob("*.safetensors"))


def frozen_copy(model):
    """A copy of `model` in eval mode with no parameter requiring a gradient (π_ref)."""
    ref = copy.deepcopy(model)
    ref.eval()
    if getattr(ref, "numerics", "fast") == "exact":
        # π_ref enters only the KL penalty, never a ratio with the sampler's log-probs: the fast kernels
        # serve it (its KL against π_θ at θ = ref is then arithmetic noise, as under the default numerics)
        ref.set_numerics("fast")
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref
