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

A bf16 weight is the top half of an fp32 number, so a bf16 parameter's master need not be a second
full copy: the optimizer keeps only the 16 bits that the weight lacks (`split_master` /
`join_master`) and rebuilds the exact fp32 master, chunk by chunk, for the step. That stores 2 bytes
a parameter instead of 4 (2.9 GiB less at 1.5B, 14 GiB at 7B) with the same fp32 arithmetic. The
price is one rounding rule: a master exactly halfway between two bf16 values (its low half is
0x8000) rounds away from zero, where a plain cast rounds to the even one, because 16 bits cannot
tell those two halfway masters apart otherwise (1 element in 65,536 per step, by one bf16 unit).
"""

from __future__ import annotations

import torch

from ..errors import CohortError

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


HALF = 1 << 16  # one bf16 unit in the last place, counted in fp32 bit patterns
TIE = 1 << 15  # a low half exactly halfway between two bf16 values


@torch.no_grad()
def split_master(master: torch.Tensor, weight: torch.Tensor, low: torch.Tensor,
                 tie: torch.Tensor | None = None) -> None:
    """Write fp32 `master` as bf16 `weight` (rounded to nearest) and int16 `low`, the difference of
    their bit patterns, so that `join_master(weight, low)` gives `master` back bit for bit. `master`
    is overwritten: the step's rebuilt masters are dropped next, so its memory serves as scratch.

    Bit patterns as integers order the floats of one sign, and rounding to bf16 moves a pattern by
    at most half a bf16 unit (2^15): the difference fits 16 signed bits, except at an exact tie
    that rounds to the even value below (+2^15). Such a tie is stored rounded away from zero instead
    (−2^15). Worked example: 1 + 2^-8 is 0x3F808000, halfway between the bf16 values 1 (0x3F80) and
    1 + 2^-7 (0x3F81); torch rounds it to the even 0x3F80 with a difference of +0x8000, so it is
    stored as 0x3F81 with −0x8000.

    `tie`, a bool tensor of `master`'s shape, is the scratch for the tie mask; given, the split
    allocates nothing (the optimizer step makes it before it changes any weight)."""
    weight.copy_(master)  # round to nearest, ties to even
    bits = master.view(torch.int32)
    bits.sub_(weight.view(torch.int16), alpha=HALF)  # int32 arithmetic; the true result is small
    tie = torch.eq(bits, TIE, out=tie) if tie is not None else bits == TIE
    weight.view(torch.int16).add_(tie)  # one bf16 unit away from zero: the pattern's magnitude grows
    low.copy_(bits.masked_fill_(tie, -TIE))


@torch.no_grad()
def join_master(weight: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The fp32 master `split_master` stored as bf16 `weight` and int16 `low` (a new tensor)."""
    bits = weight.view(torch.int16).to(torch.int32).mul_(HALF)  # at most 2^31 − 2^16 in size: no overflow
    return bits.add_(low).view(torch.float32)


def resolve_dtype(dtype: str, device: torch.device) -> str:
    """`auto` is bfloat16 on a GPU (with fp32 master weights) and float32 on CPU."""
    if dtype == "auto":
        return "bfloat16" if device.type == "cuda" else "float32"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise CohortError(f"dtype={dtype!r} is not one of auto, float32, bfloat16, float16")
    return dtype


class MasterWeightAdamW(torch.optim.AdamW):
    """AdamW over fp32 masters of low-precision parameters, stepped chunk by chunk.

    Behaves as `torch.optim.AdamW` for the trainer (param_groups, state_dict, LR schedulers); its
    params are the masters, and `model_params[i]` is the tensor master `i` writes back into and whose
    `.grad` the backward fills. A bf16 parameter's master is stored as its 16 missing low bits
    (`lows[i]`; `split_master`): `masters[i]` then holds data only inside the step, where the chunk
    being stepped rebuilds it. Other dtypes (fp16) keep a whole fp32 master. `master_weights()` gives
    every master in fp32; they travel in `state_dict()`, so a resumed run continues from the exact
    fp32 values, not from their bf16 rounding.
    """

    def __init__(self, params, chunk_bytes: int = GRADIENT_CHUNK_BYTES, **kwargs):
        self.model_params = [p for p in params if p.requires_grad]
        if not self.model_params:
            raise CohortError("no trainable parameters: every parameter has requires_grad=False")
        # bf16: the weight is the master's high half and the low half starts at zero (master = weight).
        self.lows = [torch.zeros_like(p, dtype=torch.int16) if p.dtype == torch.bfloat16 else None
                     for p in self.model_params]
        masters = [p.detach().new_empty(0, dtype=torch.float32) if low is not None else p.detach().float().clone()
                   for p, low in zip(self.model_params, self.lows)]
        for master in masters:
            master.requires_grad_(True)
        if self.model_params[0].is_cuda:
            kwargs.setdefault("fused", True)  # one kernel per chunk
        super().__init__(masters, **kwargs)
        self.masters = masters
        self.chunk_bytes = chunk_bytes
        self.chunks = _chunks_by_bytes(self.model_params, chunk_bytes)
        self.chunk_shrinks = 0  # chunks halved after running out of memory (the trainer logs each)
        self.clip_coefficient: torch.Tensor | None = None  # set by clip_grad_norm, used by the next step
        self._allocate_state()

    def master_weight(self, i: int) -> torch.Tensor:
        """Master `i` in fp32 (rebuilt from its weight and low half when split)."""
        if self.lows[i] is None:
            return self.masters[i].detach()
        return join_master(self.model_params[i].detach(), self.lows[i])

    def master_weights(self) -> list[torch.Tensor]:
        return [self.master_weight(i) for i in range(len(self.masters))]

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
            indices = self._with_grads(chunk)
            if indices:  # the fp32 copies die with the expression, before the next chunk's are made
                norms.extend(torch._foreach_norm(self._fp32_grads(indices), 2.0))
        if not norms:
            return torch.tensor(0.0)
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        self.clip_coefficient = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        return total

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step: per chunk, fp32 gradients (clipped) and masters (rebuilt), the fused update,
        the write-back (split again, or rounded from a whole master).

        Out of memory part-way is safe. Each chunk first makes everything it needs (`_chunk_scratch`)
        and only then changes anything, so a chunk that cannot get its memory has changed nothing. It
        is then halved, down to one tensor at a time, and the step goes on where it was: every
        element sees the same operations in any chunking. The smaller budget stays for later steps.
        If even one tensor cannot get its memory before any chunk has stepped, the error propagates
        and the caller may retry the whole update (nothing was applied). After some chunks have
        stepped it cannot: they would be applied twice. That, and an error inside a chunk's own
        update, stop the run with a `CohortError` instead."""
        loss = None
        if closure is not None:
            with torch.enable_grad():  # as torch's optimizers call it
                loss = closure()
        self._allocate_state()  # moments dropped since (LoRA's π_ref reset): all made before any chunk moves
        pending = self._with_grads(range(len(self.model_params)))  # chunked below, by what is left
        done = 0
        while done < len(pending):
            chunk = _chunks_by_bytes([self.model_params[i] for i in pending[done:]], self.chunk_bytes)[0]
            indices = pending[done:done + len(chunk)]
            try:
                scratch = self._chunk_scratch(indices)
            except torch.OutOfMemoryError:
                if len(indices) > 1:
                    self.shrink_chunks(sum(self.model_params[i].numel() * 4 for i in indices))
                    continue
                if done == 0:
                    raise  # nothing has changed: the update may be retried whole
                raise CohortError(self._part_way(done, len(pending))) from None
            try:
                self._step_chunk(indices, *scratch)
            except torch.OutOfMemoryError:
                raise CohortError(self._part_way(done, len(pending))) from None
            del scratch  # this chunk's fp32 copies go before the next chunk makes its own
            done += len(indices)
        self.clip_coefficient = None
        return loss

    def shrink_chunks(self, failed_bytes: int) -> None:
        """Chunks of at most half the fp32 bytes of the one that could not get its memory."""
        self.chunk_bytes = max(1, min(self.chunk_bytes, failed_bytes) // 2)
        self.chunks = _chunks_by_bytes(self.model_params, self.chunk_bytes)
        self.chunk_shrinks += 1

    def _chunk_scratch(self, indices: list[int]):
        """Every tensor a chunk's step needs, made before anything changes: the fp32 gradients, the
        rebuilt masters, and the tie mask `split_master` writes."""
        grads = self._fp32_grads(indices)
        full = [self.master_weight(i) if self.lows[i] is not None else None for i in indices]
        split = [self.model_params[i].numel() for i in indices if self.lows[i] is not None]
        tie = self.model_params[indices[0]].new_empty(max(split, default=0), dtype=torch.bool)
        return grads, full, tie

    def _step_chunk(self, indices: list[int], grads: list[torch.Tensor], full: list, tie: torch.Tensor) -> None:
        if self.clip_coefficient is not None:
            torch._foreach_mul_(grads, self.clip_coefficient.to(grads[0].device))
        for i, grad, master in zip(indices, grads, full):
            if master is not None:
                self.masters[i].data = master
            self.masters[i].grad = grad
            self.model_params[i].grad = None  # a bf16 gradient not lent from the KV cache is freed here
        super().step()  # AdamW skips the masters without a gradient: the other chunks
        for i in indices:
            master, low, param = self.masters[i], self.lows[i], self.model_params[i]
            if low is None:
                param.copy_(master)
            else:
                split_master(master, param, low, tie[: param.numel()].view(param.shape))
                master.data = master.new_empty(0)
            master.grad = None

    @staticmethod
    def _part_way(done: int, total: int) -> str:
        return (f"out of GPU memory part-way through the optimizer step ({done} of {total} tensors updated): "
                "retrying would update them twice, so the run stops here; resume from the newest checkpoint "
                "(--resume) with more free GPU memory (a lower --max_memory_gib, or fewer kept layers)")

    def _allocate_state(self) -> None:
        """AdamW's state for every master that has none, as its own lazy initialisation makes it (step,
        exp_avg, exp_avg_sq), but up front: at construction, so the first update's memory peak is
        that of every later one (gradient_checkpointing_layers=auto measures it), and in `step`
        before any chunk moves. Made lazily per chunk, an out-of-memory error in a later chunk would
        come after earlier chunks had stepped, and the retried update would step them twice."""
        group = self.param_groups[0]  # the one group: the masters, in model_params' order
        moment = dict(dtype=torch.float32, memory_format=torch.preserve_format)
        for master, param in zip(self.masters, self.model_params):  # the param's shape: a split master is empty
            if len(self.state.get(master, {})) > 0:
                continue
            state = {}  # complete or not at all: a half-made state would pass for a made one
            if group["fused"] or group["capturable"]:
                state["step"] = torch.zeros((), dtype=torch.float32, device=master.device)
            else:
                scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
                state["step"] = torch.tensor(0.0, dtype=scalar)
            state["exp_avg"] = torch.zeros_like(param, **moment)
            state["exp_avg_sq"] = torch.zeros_like(param, **moment)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(param, **moment)
            self.state[master] = state

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for param in self.model_params:
            param.grad = None
        self.clip_coefficient = None  # a step skipped after clipping leaves none for the next one

    def state_dict(self):
        state = super().state_dict()
        state["master_weights"] = [self.master_weight(i).cpu() for i in range(len(self.masters))]
        return state

    def load_state_dict(self, state_dict) -> None:
        state_dict = dict(state_dict)
        masters = state_dict.pop("master_weights", None)
        super().load_state_dict(state_dict)
        if masters is None:  # a checkpoint from a plain-AdamW run: start from the model's values
            masters = [p.detach().float() for p in self.model_params]
        elif len(masters) != len(self.masters):
            raise CohortError(f"the checkpoint holds {len(masters)} master weights, this model has "
                              f"{len(self.masters)} trainable tensors: it is from a different model or LoRA setup")
        with torch.no_grad():
            for param, master, low, saved in zip(self.model_params, self.masters, self.lows, masters):
                if low is None:
                    master.copy_(saved)
                    param.copy_(saved)
                else:
                    split_master(saved.to(device=param.device, dtype=torch.float32, copy=True), param, low)


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
