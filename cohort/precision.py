"""Mixed precision: bf16 weights for compute, fp32 master weights and AdamW state for the update.

The model's own parameters are bf16 on a GPU, so the engine samples from them directly and every
forward/backward runs bf16 GEMMs without casting weights on the fly. The optimizer keeps an fp32
copy of each trainable parameter (the "master weight") and its AdamW moments: an update of size
lr·m/√v ≈ 1e-6 is far below bf16's resolution (8 bits of mantissa, ~0.4% relative) and would
round away if applied to the bf16 weight itself. After each step the masters are copied back,
rounded once. This is the scheme of Micikevicius et al. 2018 ("Mixed Precision Training") with
bf16 instead of fp16, so no loss scaling is needed (bf16 has fp32's exponent range).

Gradients accumulate across micro-batches in the parameters' own dtype (as in TRL with bf16, and
what DDP all-reduces); only after the last backward are they moved to fp32, one tensor at a time,
which keeps the fp32 gradient copy out of the memory peak of the backward passes.
"""

from __future__ import annotations

import torch

from .errors import CohortError


def resolve_dtype(dtype: str, device: torch.device) -> str:
    """`auto` is bfloat16 on a GPU (with fp32 master weights) and float32 on CPU."""
    if dtype == "auto":
        return "bfloat16" if device.type == "cuda" else "float32"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise CohortError(f"dtype={dtype!r} is not one of auto, float32, bfloat16, float16")
    return dtype


class MasterWeightAdamW(torch.optim.AdamW):
    """AdamW over fp32 copies of low-precision parameters.

    Behaves as `torch.optim.AdamW` for the trainer (param_groups, state_dict, LR schedulers) but
    its params are the fp32 masters; `model_params[i]` is the bf16 tensor master `i` writes back
    into. The masters travel in `state_dict()` so a resumed run continues from the exact fp32
    values, not from their bf16 rounding.
    """

    def __init__(self, params, **kwargs):
        self.model_params = [p for p in params if p.requires_grad]
        if not self.model_params:
            raise CohortError("no trainable parameters: every parameter has requires_grad=False")
        masters = [p.detach().float().clone().requires_grad_(True) for p in self.model_params]
        if masters[0].is_cuda:
            kwargs.setdefault("fused", True)  # one kernel for the whole update
        super().__init__(masters, **kwargs)
        self.masters = masters

    @torch.no_grad()
    def move_grads_to_masters(self) -> None:
        """fp32 copies of the accumulated gradients on the masters; each bf16 gradient is freed as
        soon as it is copied, so the two never coexist for the whole model."""
        for param, master in zip(self.model_params, self.masters):
            if param.grad is not None:
                master.grad = param.grad.float()
                param.grad = None

    @torch.no_grad()
    def step(self, closure=None):
        self.move_grads_to_masters()  # a no-op when clip_grad_norm already moved them
        loss = super().step(closure)
        for param, master in zip(self.model_params, self.masters):
            param.copy_(master)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for param in self.model_params:
            param.grad = None

    def state_dict(self):
        state = super().state_dict()
        state["master_weights"] = [m.detach().cpu() for m in self.masters]
        return state

    def load_state_dict(self, state_dict) -> None:
        state_dict = dict(state_dict)
        masters = state_dict.pop("master_weights", None)
        super().load_state_dict(state_dict)
        with torch.no_grad():
            if masters is None:  # a checkpoint from a plain-AdamW run: start from the model's values
                for param, master in zip(self.model_params, self.masters):
                    master.copy_(param.float())
                return
            if len(masters) != len(self.masters):
                raise CohortError(f"the checkpoint holds {len(masters)} master weights, this model has "
                                  f"{len(self.masters)} trainable tensors: it is from a different model or LoRA setup")
            for param, master, saved in zip(self.model_params, self.masters, masters):
                master.copy_(saved)
                param.copy_(saved)


def clip_grad_norm(optimizer: torch.optim.Optimizer, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the gradients the optimizer is about to apply; returns their total norm before clipping.

    With fp32 masters the norm is taken over the fp32 copies (a bf16 sum of squares over 10⁸
    elements would lose the small ones)."""
    if isinstance(optimizer, MasterWeightAdamW):
        optimizer.move_grads_to_masters()
        params = optimizer.masters
    else:
        params = [p for p in model.parameters() if p.requires_grad]
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


def make_optimizer(model: torch.nn.Module, args) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters: masters in fp32 when the weights are low precision."""
    params = [p for p in model.parameters() if p.requires_grad]
    kwargs = dict(lr=args.learning_rate, weight_decay=args.weight_decay, betas=(args.adam_beta1, args.adam_beta2))
    if any(p.dtype in (torch.bfloat16, torch.float16) for p in params):
        return MasterWeightAdamW(params, **kwargs)
    return torch.optim.AdamW(params, **kwargs)
