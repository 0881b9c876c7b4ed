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

AdamW's two moments are 8 of those bytes a parameter (11.5 GiB at 1.5B, 57 GiB at 7B). On a GPU they
are kept in bf16 by default (`optimizer_state_dtype=auto`), as DeepSeek-V3 keeps them (DeepSeek-AI
2024, §3.3.2), and stepped in fp32. On a GPU one kernel a parameter does the whole step in registers
(cohort_grpo/kernels/adamw.py: one pass over memory; its timings against torch's fused AdamW are in
docs/performance.md);
elsewhere each chunk widens its moments, steps, and narrows them again.
The narrowing rounds stochastically (`round_stochastic`), because rounding to nearest cannot follow
a slowly decaying second moment. A step moves v by a fraction 1 − β2 of itself: 1% at β2 = 0.99, near
bf16's spacing of 0.4–0.8%, and 0.1% at β2 = 0.999, under half of it. Rounded to nearest, a decaying v
would move by the wrong amount or not at all, and the step size would shrink for good. Rounded
stochastically, every moment is right on average.
"""

from __future__ import annotations

import torch

from cohort_grpo.errors import CohortError, in_front_end_words
from cohort_grpo.kernels.adamw import adamw_bf16_step, fused_adamw_available
from cohort_grpo.optim.bf16 import join_master, noise_key, round_stochastic, split_master
from cohort_grpo.optim.host_state import PIECE_ELEMENTS, HostState

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


MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")  # AdamW's per-parameter state tensors


def resolve_dtype(dtype: str, device: torch.device) -> str:
    """`auto` is bfloat16 on a GPU (with fp32 master weights) and float32 on CPU."""
    if dtype == "auto":
        return "bfloat16" if device.type == "cuda" else "float32"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise CohortError(f"dtype={dtype!r} is not one of auto, float32, bfloat16, float16")
    return dtype


def cpu_precision_line(dtype: str, device: torch.device) -> str | None:
    """One line where a 16-bit dtype was asked for on a CPU (TRL's bf16=True; cohort's auto is float32 there), which
    trains slower there than float32 as a rule; None elsewhere. The run keeps the dtype: whoever wrote it may want
    bf16's numbers, and cohort never picks bf16 on a CPU by itself."""
    if device.type != "cpu" or dtype not in ("bfloat16", "float16"):
        return None
    return in_front_end_words(f"dtype: {dtype} on a CPU, where PyTorch's {dtype} kernels are mostly slower than its "
                              "float32 ones; pass --dtype float32 (TRL's keywords: bf16=False) for speed")


class MasterWeightAdamW(torch.optim.AdamW):
    """AdamW over fp32 masters of low-precision parameters, stepped chunk by chunk.

    Behaves as `torch.optim.AdamW` for the trainer (param_groups, state_dict, LR schedulers); its
    params are the masters, and `model_params[i]` is the tensor master `i` writes back into and whose
    `.grad` the backward fills. A bf16 parameter's master is stored as its 16 missing low bits
    (`lows[i]`; `split_master`): `masters[i]` then holds data only inside the step, where the chunk
    being stepped rebuilds it. Other dtypes (fp16) keep a whole fp32 master. `master_weights()` gives
    every master in fp32; they travel in `state_dict()`, so a resumed run continues from the exact
    fp32 values, not from their bf16 rounding. With `state_dtype=torch.bfloat16` the moments are
    stored in bf16 and widened to fp32 for their chunk's step (`round_stochastic` narrows them). With
    `offload=True` the low halves and moments live in host memory (`host_state.py`) and visit the device for
    their own tensor's step.
    """

    def __init__(self, params, chunk_bytes: int = GRADIENT_CHUNK_BYTES, state_dtype: torch.dtype = torch.float32,
                 seed: int = 0, offload: bool = False, piece_elements: int = PIECE_ELEMENTS, **kwargs):
        if state_dtype not in (torch.float32, torch.bfloat16):
            raise CohortError(f"AdamW's moments can be kept in float32 or bfloat16, not {state_dtype}")
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
        self.state_dtype = state_dtype
        # bf16 moments round stochastically, with noise keyed by (seed, tensor, step) alone (`noise_seed`):
        # every rank draws the same (DDP replicas stay equal), any chunking too, and a resumed run needs only
        # the seed and the step counts to continue bit for bit.
        self.seed = seed
        self.steps = [0] * len(masters)  # each master's step count, on the host (the state's is on the device)
        self.rounding = torch.Generator(device=self.model_params[0].device)  # the torch step's, reseeded per tensor
        # One kernel a parameter (cohort_grpo/kernels/adamw.py) where every master is split and the moments are
        # bf16 on a GPU; the chunked torch step otherwise.
        self.fused_kernel = (state_dtype == torch.bfloat16 and all(low is not None for low in self.lows)
                             and fused_adamw_available(self.model_params[0])
                             and not self.defaults["amsgrad"] and not self.defaults["maximize"])
        self.chunk_bytes = chunk_bytes
        self.chunks = _chunks_by_bytes(self.model_params, chunk_bytes)
        self.chunk_shrinks = 0  # chunks halved after running out of memory (the trainer logs each)
        self.clip_coefficient: torch.Tensor | None = None  # set by clip_grad_norm, used by the next step
        self.host: HostState | None = None
        self.piece_elements = piece_elements  # with the state in host memory: the kernel's largest slice at once
        if offload:
            if any(low is None for low in self.lows):
                raise CohortError("offload_optimizer keeps split fp32 masters in host memory, so every trained "
                                  "weight must be bfloat16: pass --dtype bfloat16, or --offload_optimizer false")
            names = dict(low=torch.int16, exp_avg=state_dtype, exp_avg_sq=state_dtype)
            if self.defaults["amsgrad"]:
                names["max_exp_avg_sq"] = state_dtype
            self.host = HostState([p.shape for p in self.model_params], names, self.model_params[0].device)
            self.lows = [state["low"] for state in self.host.tensors]
        self._allocate_state()

    def master_weight(self, i: int) -> torch.Tensor:
        """Master `i` in fp32 (rebuilt from its weight and low half when split)."""
        if self.lows[i] is None:
            return self.masters[i].detach()
        param = self.model_params[i].detach()
        return join_master(param, self.lows[i].to(param.device))

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
        if self.fused_kernel:
            self._fused_step()
            return loss
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

    def _fused_step(self) -> None:
        """Every parameter with a gradient stepped by one kernel each: no fp32 copy of anything exists. With the state
        in host memory, piece by piece (a tensor, or a slice of a large one) as `HostState.one_by_one` brings it."""
        group = self.param_groups[0]
        (beta1, beta2), stepped = group["betas"], []
        hyper = dict(lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                     weight_decay=group["weight_decay"], clip=self.clip_coefficient)
        indices = self._with_grads(range(len(self.model_params)))
        if self.host is None:
            pieces = [((i, 0, self.model_params[i].numel()), dict(self.state[self.masters[i]], low=self.lows[i]))
                      for i in indices]
        else:
            pieces = self.host.one_by_one([(i, start, min(start + self.piece_elements, n)) for i in indices
                                           for n in [self.model_params[i].numel()]
                                           for start in range(0, n, self.piece_elements)])
        for (i, start, stop), state in pieces:
            param = self.model_params[i]
            if start == 0:
                self.steps[i] += 1
            # the piece of the weight and gradient; the state is the piece's already (or the whole tensor's)
            adamw_bf16_step(param.data.view(-1)[start:stop], state["low"].view(-1), param.grad.view(-1)[start:stop],
                            state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1), step=self.steps[i],
                            seed=self.noise_seed(i), start=start, **hyper)
            if stop == param.numel():
                param.grad = None  # a bf16 gradient not lent from the KV cache is freed here
                stepped.append(self.state[self.masters[i]]["step"])
        if stepped:
            torch._foreach_add_(stepped, 1.0)  # the state's count, as torch's step keeps it
        self.clip_coefficient = None

    def noise_seed(self, i: int) -> int:
        """The stochastic rounding's key for parameter `i` at its current step, from the run's seed (both
        the kernel and the chunked torch step draw from it)."""
        return noise_key(self.seed, i, self.steps[i])

    def shrink_chunks(self, failed_bytes: int) -> None:
        """Chunks of at most half the fp32 bytes of the one that could not get its memory."""
        self.chunk_bytes = max(1, min(self.chunk_bytes, failed_bytes) // 2)
        self.chunks = _chunks_by_bytes(self.model_params, self.chunk_bytes)
        self.chunk_shrinks += 1

    def _chunk_scratch(self, indices: list[int]):
        """Every tensor a chunk's step needs, made before anything changes: the fp32 gradients, the
        rebuilt masters, the fp32 moments widened from bf16 ones, the tie mask `split_master` writes
        (also the NaN mask of `round_stochastic`), the rounding's noise, and with the state in host memory
        its device copies (the chunk steps those, and they go back after it)."""
        grads = self._fp32_grads(indices)
        staged = [self.host.on_device(i) for i in indices] if self.host is not None else None
        lows = [state["low"] for state in staged] if staged else [self.lows[i] for i in indices]
        states = staged or [self.state[self.masters[i]] for i in indices]
        full = [join_master(self.model_params[i].detach(), low) if low is not None else None
                for i, low in zip(indices, lows)]
        narrow = self.state_dtype != torch.float32
        wide = [{name: state[name].float() for name in MOMENTS if name in state} if narrow else None
                for state in states]
        first = self.model_params[indices[0]]
        largest = max([self.model_params[i].numel() for i in indices if self.lows[i] is not None or narrow], default=0)
        tie = first.new_empty(largest, dtype=torch.bool)
        noise = first.new_empty(largest if narrow else 0, dtype=torch.int16)
        return grads, full, wide, tie, noise, staged

    def _step_chunk(self, indices: list[int], grads: list[torch.Tensor], full: list, wide: list,
                    tie: torch.Tensor, noise: torch.Tensor, staged: list | None) -> None:
        if staged is None:
            self._step_staged_chunk(indices, grads, full, wide, tie, noise)
            return
        # the chunk steps the device copies in the place of the host tensors, which take their new values after
        on_host = [(self.lows[i], self._swap_moments(i, {name: state[name] for name in MOMENTS if name in state}))
                   for i, state in zip(indices, staged)]
        for i, state in zip(indices, staged):
            self.lows[i] = state["low"]
        try:
            self._step_staged_chunk(indices, grads, full, wide, tie, noise)
            for i, state in zip(indices, staged):
                self.host.put_back(i, state)
        finally:
            for i, (low, moments) in zip(indices, on_host):
                self.lows[i] = low
                self._swap_moments(i, moments)

    def _step_staged_chunk(self, indices: list[int], grads: list[torch.Tensor], full: list, wide: list,
                           tie: torch.Tensor, noise: torch.Tensor) -> None:
        if self.clip_coefficient is not None:
            torch._foreach_mul_(grads, self.clip_coefficient.to(grads[0].device))
        for i, grad, master in zip(indices, grads, full):
            if master is not None:
                self.masters[i].data = master
            self.masters[i].grad = grad
            self.model_params[i].grad = None  # a bf16 gradient not lent from the KV cache is freed here
        stored = [self._swap_moments(i, moments) for i, moments in zip(indices, wide)]
        super().step()  # AdamW skips the masters without a gradient: the other chunks
        for i, moments in zip(indices, stored):
            self.steps[i] += 1
            if moments is not None:
                self.rounding.manual_seed(self.noise_seed(i))
            for name, narrow in (moments or {}).items():  # in a fixed order: the noise drawn is too
                round_stochastic(self.state[self.masters[i]][name], narrow, self.rounding, noise, tie)
            self._swap_moments(i, moments)
        for i in indices:
            master, low, param = self.masters[i], self.lows[i], self.model_params[i]
            if low is None:
                param.copy_(master)
            else:
                split_master(master, param, low, tie[: param.numel()].view(param.shape))
                master.data = master.new_empty(0)
            master.grad = None

    def _swap_moments(self, i: int, moments: dict | None) -> dict | None:
        """Put `moments` in master `i`'s AdamW state; returns the tensors they replaced."""
        if moments is None:
            return None
        state = self.state[self.masters[i]]
        replaced = {name: state[name] for name in moments}
        state.update(moments)
        return replaced

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
        moment = dict(dtype=self.state_dtype, memory_format=torch.preserve_format)
        for i, (master, param) in enumerate(zip(self.masters, self.model_params)):  # a split master is empty
            if len(self.state.get(master, {})) > 0:
                continue
            self.steps[i] = 0
            state = {}  # complete or not at all: a half-made state would pass for a made one
            if group["fused"] or group["capturable"]:
                state["step"] = torch.zeros((), dtype=torch.float32, device=master.device)
            else:
                scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
                state["step"] = torch.tensor(0.0, dtype=scalar)
            names = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if group["amsgrad"] else ("exp_avg", "exp_avg_sq")
            for name in names:
                state[name] = (self.host.tensors[i][name].zero_() if self.host is not None
                               else torch.zeros_like(param, **moment))
            self.state[master] = state

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for param in self.model_params:
            param.grad = None
        self.clip_coefficient = None  # a step skipped after clipping leaves none for the next one

    def state_dict(self):
        state = super().state_dict()
        state["master_weights"] = [self.master_weight(i).cpu() for i in range(len(self.masters))]
        state["noise_seed"] = self.seed
        return state

    def load_state_dict(self, state_dict) -> None:
        state_dict = dict(state_dict)
        masters = state_dict.pop("master_weights", None)
        self.seed = state_dict.pop("noise_seed", self.seed)
        # torch would cast every moment to its master's dtype on the device (fp32: a whole fp32 copy
        # of bf16 moments at once); they are set below one at a time, in this optimizer's dtype.
        saved = state_dict.get("state", {})
        moments = {key: {name: v for name, v in value.items() if name in MOMENTS} for key, value in saved.items()}
        state_dict["state"] = {key: {name: v for name, v in value.items() if name not in MOMENTS}
                               for key, value in saved.items()}
        super().load_state_dict(state_dict)
        for key, master in enumerate(self.masters):
            for name, value in moments.get(key, {}).items():
                if self.host is not None:  # into its place in the host buffer
                    self.state[master][name] = self.host.tensors[key][name].copy_(value)
                else:
                    self.state[master][name] = value.to(device=master.device, dtype=self.state_dtype)
            if "step" in self.state.get(master, {}):
                self.steps[key] = int(self.state[master]["step"])
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
                    here = low if low.device == param.device else torch.empty_like(low, device=param.device)
                    split_master(saved.to(device=param.device, dtype=torch.float32, copy=True), param, here)
                    if here is not low:
                        low.copy_(here)
