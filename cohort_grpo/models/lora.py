"""LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") through peft.

The adapters are injected into the policy in place (`peft.inject_adapter_in_model`), so the
model stays the same object: the engine samples from it (base weight + B·A per projection), the
trainer updates only A and B, and checkpoints and the final folder are written by the same code.
With LoRA there is no second copy of the weights for π_ref: the reference log-probs come from the
same model with the adapters switched off (`adapters_disabled`), which is exactly π_θ at step 0.
Algorithm 1's π_ref ← π_θ (`--ref_reset_steps`) merges the adapters into the base weights and
zeroes B (`merge_into_base`): the base is then the current policy, and the adapters start over.

What is saved: an ordinary Hugging Face folder with the adapters merged into the weights
(W + s·B·A, computed on the side; the live model is untouched), plus an `adapter/` subfolder in
peft's own format, so `PeftModel.from_pretrained(base, folder / "adapter")` loads the adapters
alone. (Not beside the weights: transformers would see `adapter_config.json` there and apply the
adapters a second time on top of the merged weights.)
"""

from __future__ import annotations

import copy
import json
from contextlib import contextmanager
from pathlib import Path

import torch

from cohort_grpo.errors import CohortError

ADAPTER_DIR = "adapter"
ADAPTER_WEIGHTS = "adapter/adapter_model.safetensors"
DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft():
    try:
        import peft
    except ImportError:
        raise CohortError("LoRA needs peft: pip install peft") from None
    return peft


def lora_config_from_args(args):
    """A peft LoraConfig from --use_peft --lora_r --lora_alpha --lora_dropout --lora_target_modules
    (TRL's ModelConfig names), or None without --use_peft."""
    if not args.use_peft:
        return None
    peft = _peft()
    targets = args.lora_target_modules or DEFAULT_TARGETS
    return peft.LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                           target_modules=list(targets), bias="none")


def apply_lora(model: torch.nn.Module, peft_config) -> torch.nn.Module:
    """Inject the adapters into `model` in place; only they stay trainable. Adapter weights are
    fp32 (the base may be bf16): they are few, and a rank-r update is small enough to vanish in bf16."""
    peft = _peft()
    if not isinstance(peft_config, peft.LoraConfig):
        raise CohortError(f"peft_config must be a peft.LoraConfig, got {type(peft_config).__name__}; "
                          "other peft methods are not supported")
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    targets = peft_config.target_modules
    if isinstance(targets, (set, list, tuple)) and set(targets) == set(DEFAULT_TARGETS) and not set(targets) & names:
        # a family of other names (GPT-NeoX's query_key_value, dense, ...): every linear layer of its decoder layers
        layer_linears = sorted(layer_linear_names(model))
        if layer_linears:
            peft_config = copy.copy(peft_config)
            peft_config.target_modules = set(layer_linears)
            targets = peft_config.target_modules
            # transformers' Conv1D (GPT-2's) stores its weight as [in, out]: peft's name for that layout
            peft_config.fan_in_fan_out = any(type(module).__name__ == "Conv1D" for module in model.modules())
    if isinstance(targets, (set, list, tuple)) and not set(targets) & names:
        raise CohortError(f"lora_target_modules {sorted(targets)} match no module of this model; "
                          f"its linear layers are named like {sorted(n for n in names if n.endswith('proj'))[:8]}")
    for p in model.parameters():
        p.requires_grad_(False)
    peft.inject_adapter_in_model(peft_config, model)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()
            p.requires_grad_(True)
    model.peft_config = {"default": peft_config}  # peft's own layout: adapter name → config
    return model


def layer_linear_names(model: torch.nn.Module) -> set[str]:
    """The names of the linear layers inside the model's repeated layers (a numbered module on their path): the
    projections, not the embedding's or the head's. transformers' Conv1D (GPT-2's projections) is a linear layer
    with its weight transposed, and peft adapts it as one."""
    return {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
            if (isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D")
            and any(part.isdigit() for part in name.split(".")[:-1])}


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside a PEFT wrapper (its LoRA layers live inside the base modules), else `model`."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def has_lora(model: torch.nn.Module) -> bool:
    return isinstance(getattr(model, "peft_config", None), dict)


def _tuner_layers(model):
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


@contextmanager
def adapters_disabled(model: torch.nn.Module):
    """The base model, inside the block: π_ref for LoRA training."""
    layers = _tuner_layers(model)
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)


@torch.no_grad()
def merge_into_base(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """π_ref ← π_θ for LoRA: W ← W + s·B·A in every adapted layer, then B ← 0, so the policy is
    unchanged and "adapters off" is now the current policy. Returns the adapter parameters, whose
    optimizer state no longer fits them."""
    from peft.tuners.lora import LoraLayer

    touched = []
    for module in model.modules():
        if isinstance(module, LoraLayer):
            base = module.get_base_layer()
            for adapter in module.active_adapters:
                base.weight.add_(module.get_delta_weight(adapter).to(base.weight.dtype))
                module.lora_B[adapter].weight.zero_()
                touched += [module.lora_A[adapter].weight, module.lora_B[adapter].weight]
    return touched


def base_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base (non-adapter) weights under the model's plain names: π_ref, once resets changed it."""
    return {k.replace(".base_layer.", "."): v for k, v in model.state_dict().items() if "lora_" not in k}


@torch.no_grad()
def load_base_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    for key, tensor in model.state_dict().items():
        plain = key.replace(".base_layer.", ".")
        if "lora_" not in key and plain in state:
            tensor.copy_(state[plain])


def adapter_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter weights under peft's file names (`base_model.model.<path>.lora_A.weight`)."""
    from peft.utils import get_peft_model_state_dict

    state = get_peft_model_state_dict(model)
    return {f"base_model.model.{k}": v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}


def load_adapter_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor], source: Path) -> None:
    from peft.utils import set_peft_model_state_dict

    state = {k.removeprefix("base_model.model."): v for k, v in state.items()}
    result = set_peft_model_state_dict(model, state)
    unexpected = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
    if unexpected:
        raise CohortError(f"{source} holds adapters this model lacks ({unexpected[:2]}); resume with the same "
                          "--lora_r / --lora_target_modules")


def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state under its plain names, each adapted weight replaced by W + s·B·A."""
    from peft.tuners.lora import LoraLayer

    merged = base_state_dict(model)
    for module_name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            weight = module.get_base_layer().weight
            delta = sum(module.get_delta_weight(adapter).detach().float() for adapter in module.active_adapters)
            merged[f"{module_name}.weight"] = (weight.detach().float() + delta).to(weight.dtype)
    return merged


def save_adapter(model: torch.nn.Module, out_dir: Path, base_model: str | None = None) -> None:
    from cohort_grpo.models.files import save_safetensors

    out_dir = Path(out_dir) / ADAPTER_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    save_safetensors(adapter_state_dict(model), out_dir / "adapter_model.safetensors")
    config = model.peft_config["default"].to_dict()
    config["base_model_name_or_path"] = base_model
    config = {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.items()}
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
