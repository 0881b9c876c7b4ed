"""Mixed precision: bf16 weights for compute, fp32 master weights and AdamW state for the update.

The model's own parameters are bf16 on a GPU, so the engine samples from them directly and every
forward/backward runs bf16 GEMMs without casting weights on the fly. The optimizer keeps an fp32
copy of each trainable parameter (the "master weight") and its AdamW moments: an update of size
lr·m/√v ≈ 1e-6 is far below bf16's resolution (8 bits of mantissa, ~0.4% relative) and would
round away if applied to the bf16 weight itself. After each step the masters are copied back,
rounded once. This is the scheme of Micikevicius et al. 2018 ("Mixed Precision Training") with
bf16 instead of fp16, so no loss scaling is needed (bf16 has fp32's exponent range).

Gradients accumulate across micro-batches in the parameters' own dtype (as in TRL with bf16, and
what DDP all-reduces). The optimizer step needs them in fp32, but never all at once: the norm for
clipping and then the step itself walk the parameters in chunks of at most `chunk_bytes` of fp32
gradients, converting, using and freeing each chunk before the next. A whole fp32 gradient copy
(4 bytes a parameter: 5.7 GiB at 1.5B, 28 GiB at 7B) would otherwise set the memory peak of the
update. Every element sees the same operations as in one unchunked step, so the result is the same.
"""

from __future__ import annotations

import torch

from .errors import CohortError

# fp32 gradient bytes alive at once in the optimizer step; a larger tensor is a chunk of its own.
GRADIENT_CHUNK_BYTES = 1 << 30


def _chunks_by_bytes(tensors: list[torch.Tensor], budget: int) -> list[range]:
    """Consecutive index ranges of `tensors` whose fp32 sizes add up to at most `budget` bytes."""
    chunks, start, size = [], 0, 0
    for i, t in enumerate(tensors):
        nbytes = t.numel() * 4
        if i > start and size + nbytes > budget:
            chunks.append(range(start, i))
            start, size = i, 0
        size += nbytes
    chunks.append(range(start, len(tensors)))
    return chunks


def resolve_dtype(dtype: str, device: torch.device) -> str:
    """`auto` is bfloat16 on a GPU (with fp32 master weights) and float32 on CPU."""
    if dtype == "auto":
        return "bfloat16" if device.type == "cuda" else "float32"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise CohortError(f"dtype={dtype!r} is not one of auto, float32, bfloat16, float16")
    return dtype


class MasterWeightAdamW(torch.optim.AdamW):
    """AdamW over fp32 copies of low-precision parameters, stepped chunk by chunk.

    Behaves as `torch.optim.AdamW` for the trainer (param_groups, state_dict, LR schedulers) but
    its params are the fp32 masters; `model_params[i]` is the bf16 tensor master `i` writes back
    into, and whose `.grad` the backward fills. The masters travel in `state_dict()` so a resumed
    run continues from the exact fp32 values, not from their bf16 rounding.
    """

    def __init__(self, params, chunk_bytes: int = GRADIENT_CHUNK_BYTES, **kwargs):
        self.model_params = [p for p in params if p.requires_grad]
        if not self.model_params:
            raise CohortError("no trainable parameters: every parameter has requires_grad=False")
        masters = [p.detach().float().clone().requires_grad_(True) for p in self.model_params]
        if masters[0].is_cuda:
            kwargs.setdefault("fused", True)  # one kernel per chunk
        super().__init__(masters, **kwargs)
        self.masters = masters
        self.chunks = _chunks_by_bytes(masters, chunk_bytes)
        self.clip_coefficient: torch.Tensor | None = None  # set by clip_grad_norm, used by the next step
        self._allocate_state()

    def _with_grads(self, chunk: range) -> list[int]:
        return [i for i in chunk if self.model_params[i].grad is not None]

    def _fp32_grads(self, indices: list[int]) -> list[torch.Tensor]:
        return [self.model_params[i].grad.float() for i in indices]

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_` over the fp32 gradients, one chunk alive at a time.

        Returns the total norm before clipping; the step applies min(max_norm / (norm + 1e-6), 1),
        torch's coefficient, to each chunk as it converts it. The per-tensor norms come from the
        same fp32 values and the same kernel as torch's (`_foreach_norm`), so the total is the same."""
        norms: list[torch.Tensor] = []
        for chunk in self.chunks:
            grads = self._fp32_grads(self._with_grads(chunk))
            if grads:
                norms.extend(torch._foreach_norm(grads, 2.0))
        if not norms:
            return torch.tensor(0.0)
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        self.clip_coefficient = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        return total

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step: per chunk, fp32 gradients (clipped), the fused update, the bf16 write-back."""
        loss = None
        if closure is not None:
            with torch.enable_grad():  # as torch's optimizers call it
                loss = closure()
        self._allocate_state()  # moments dropped since (LoRA's π_ref reset): all made before any chunk moves
        for chunk in self.chunks:
            stepped = self._with_grads(chunk)
            if not stepped:
                continue
            grads = self._fp32_grads(stepped)
            if self.clip_coefficient is not None:
                torch._foreach_mul_(grads, self.clip_coefficient.to(grads[0].device))
            for i, grad in zip(stepped, grads):
                self.masters[i].grad = grad
                self.model_params[i].grad = None  # a bf16 gradient not lent from the KV cache is freed here
            super().step()  # AdamW skips the masters without a gradient: the other chunks
            for i in stepped:
                self.model_params[i].copy_(self.masters[i])
                self.masters[i].grad = None
        self.clip_coefficient = None
        return loss

    def _allocate_state(self) -> None:
        """AdamW's state for every master that has none, as its own lazy initialisation makes it (step,
        exp_avg, exp_avg_sq), but up front: at construction, so the first update's memory peak is
        that of every later one (gradient_checkpointing_layers=auto measures it), and in `step`
        before any chunk moves. Made lazily per chunk, an out-of-memory error in a later chunk would
        come after earlier chunks had stepped, and the retried update would step them twice."""
        for group in self.param_groups:
            for master in group["params"]:
                if len(self.state.get(master, {})) > 0:
                    continue
                state = {}  # complete or not at all: a half-made state would pass for a made one
                if group["fused"] or group["capturable"]:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=master.device)
                else:
                    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
                    state["step"] = torch.tensor(0.0, dtype=scalar)
                state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
                if group["amsgrad"]:
                    state["max_exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
                self.state[master] = state

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for param in self.model_params:
            param.grad = None
        self.clip_coefficient = None  # a step skipped after clipping leaves none for the next one

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

    With fp32 masters the norm is taken over fp32 copies of the gradients (a bf16 sum of squares
    over 10⁸ elements would lose the small ones), made and dropped chunk by chunk."""
    if isinstance(optimizer, MasterWeightAdamW):
        return optimizer.clip_grad_norm(max_norm)
    return torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_norm)


def make_optimizer(model: torch.nn.Module, args) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters: masters in fp32 when the weights are low precision."""
    params = [p for p in model.parameters() if p.requires_grad]
    kwargs = dict(lr=args.learning_rate, weight_decay=args.weight_decay, betas=(args.adam_beta1, args.adam_beta2))
    if any(p.dtype in (torch.bfloat16, torch.float16) for p in params):
        return MasterWeightAdamW(params, **kwargs)
    return torch.optim.AdamW(params, **kwargs)
