"""AdamW over fp32 weights, FSDP2 shards or whole tensors, with its two moments kept in bf16.

Under FSDP2 the trained parameters are fp32 DTensors sharded by rows over the ranks: they are the master
weights themselves, so nothing like `MasterWeightAdamW`'s split master is needed, only the moments. torch's
AdamW keeps them in the parameter's dtype, 8 bytes a parameter over N ranks (30 GiB a rank at 8B on 2 GPUs);
here they are bf16, 4 bytes, stepped in fp32 and narrowed with stochastic rounding as on one GPU (DeepSeek-AI
2024, "DeepSeek-V3 Technical Report", §3.3.2; why stochastic: cohort_grpo/optim/precision.py).

The rounding's noise is a hash of (key, element index in the WHOLE parameter) with the key made from the run's
seed, the parameter's index and its step count (`bf16.noise_key`, `bf16.element_noise`): a rank's shard draws
the very noise its elements would draw in one process over the whole model, so N ranks step the same bits as
one process, any sharding, and a resumed run needs only the seed and the step counts to continue bit for bit.

Each tensor is stepped in slices of `CHUNK_ELEMENTS` elements: the fp32 moments, the step's temporaries and the
noise exist for one slice at a time (`SCRATCH_BYTES_PER_ELEMENT` each), never for a whole shard. The arithmetic
is torch's single-tensor AdamW (Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization") operation by
operation, so with fp32 moments this optimizer is `torch.optim.AdamW(foreach=False)` exactly.

The moments are DTensors of the parameter's sharding (plain tensors for a plain parameter), so
torch.distributed.checkpoint's full state dict gathers them as bf16 tensors of the whole parameter's shape and
scatters them back on load (`Parallel.optimizer_state`); `noise_seed` travels in the parameter group.
"""

from __future__ import annotations

import math

import torch

from cohort_grpo.errors import CohortError
from cohort_grpo.optim.bf16 import element_noise, noise_key, round_with_noise

CHUNK_ELEMENTS = 1 << 22  # elements stepped at once
# per element of a slice at its busiest: the fp32 moments and denominator (12 bytes) while the noise's hash runs
# on int64 words (at most 5 alive: 40)
SCRATCH_BYTES_PER_ELEMENT = 52
MOMENTS = ("exp_avg", "exp_avg_sq")


def shard_offset(param: torch.Tensor) -> int:
    """Where this rank's local shard of `param` starts in the whole parameter, flattened (0 for a plain tensor).
    FSDP2 shards dim 0 as `torch.chunk` cuts it; a rank past the last chunk holds an empty shard."""
    if not hasattr(param, "device_mesh"):
        return 0
    from torch.distributed.tensor import Shard

    if param.device_mesh.ndim != 1 or tuple(param.placements) != (Shard(0),):
        raise CohortError(f"bf16 AdamW moments need parameters sharded by rows over one mesh dimension (FSDP2's "
                          f"fully_shard), not {tuple(param.placements)}; pass --optimizer_state_dtype float32")
    rows = param.shape[0]
    per_rank = math.ceil(rows / param.device_mesh.size())
    return min(param.device_mesh.get_local_rank() * per_rank, rows) * (param.numel() // max(rows, 1))


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of `tensor` this rank holds: a DTensor's local shard, a plain tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class ShardedAdamW(torch.optim.AdamW):
    """`torch.optim.AdamW` over fp32 parameters (FSDP2's DTensor shards, or plain tensors) whose moments are
    stored in `state_dtype` (bf16: rounded stochastically with element-keyed noise, see the module docstring).
    One parameter group; no amsgrad, no maximize."""

    def __init__(self, params, *, state_dtype: torch.dtype = torch.bfloat16, seed: int = 0, **kwargs):
        if state_dtype not in (torch.float32, torch.bfloat16):
            raise CohortError(f"AdamW's moments can be kept in float32 or bfloat16, not {state_dtype}")
        params = [p for p in params if p.requires_grad]
        if not params:
            raise CohortError("no trainable parameters: every parameter has requires_grad=False")
        wrong = sorted({str(p.dtype) for p in params if p.dtype != torch.float32})
        if wrong:
            raise CohortError(f"bf16 AdamW moments on the shard need fp32 parameters (the master weights), not "
                              f"{', '.join(wrong)}; pass --optimizer_state_dtype float32")
        if kwargs.get("amsgrad") or kwargs.get("maximize"):
            raise CohortError("bf16 AdamW moments support neither amsgrad nor maximize")
        super().__init__(params, foreach=False, **kwargs)
        self.param_groups[0]["noise_seed"] = seed
        self.state_dtype = state_dtype
        self.offsets = [shard_offset(p) for p in params]
        self.steps = [0] * len(params)  # each parameter's step count on the host (the state's is a tensor)
        self._allocate_state()

    @property
    def params(self) -> list[torch.Tensor]:
        return self.param_groups[0]["params"]

    def _allocate_state(self) -> None:
        """Every parameter's state, zero, before anything moves: the first step's memory is every later one's,
        an out-of-memory error comes before any parameter has stepped, and torch.distributed.checkpoint finds a
        made state to load into (it would otherwise make one with a step of learning rate 0)."""
        for i, param in enumerate(self.params):
            if len(self.state.get(param, {})) > 0:
                continue
            self.steps[i] = 0
            self.state[param] = {"step": torch.tensor(0.0),
                                 **{name: torch.zeros_like(param, dtype=self.state_dtype) for name in MOMENTS}}

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step of every parameter with a gradient, slice by slice. Each slice makes all it needs before
        it changes anything, so running out of memory in the first slice leaves everything as it was (the error
        propagates and the update may be retried); after that a retry would step some elements twice, and the
        run stops with a `CohortError` instead."""
        loss = None
        if closure is not None:
            with torch.enable_grad():  # as torch's optimizers call it
                loss = closure()
        self._allocate_state()  # moments dropped since (LoRA's π_ref reset) start over at zero
        group = self.param_groups[0]
        lr, (beta1, beta2), eps, decay = float(group["lr"]), group["betas"], group["eps"], group["weight_decay"]
        changed = False
        for i, param in enumerate(self.params):
            if param.grad is None:
                continue
            count = self.steps[i] + 1
            hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, decay=decay, step_size=lr / (1 - beta1 ** count),
                         bias_correction2_sqrt=math.sqrt(1 - beta2 ** count),
                         key=noise_key(group["noise_seed"], i, count))
            weights, grads = local(param), local(param.grad)
            if weights.numel() and not weights.is_contiguous():
                raise CohortError(f"parameter {i}'s local shard is not contiguous; pass --optimizer_state_dtype float32")
            flat, grads = weights.view(-1), grads.reshape(-1)
            moments = [local(self.state[param][name]).view(-1) for name in MOMENTS]
            for start in range(0, flat.numel(), CHUNK_ELEMENTS):  # an empty shard: none, its count still moves
                piece = slice(start, start + CHUNK_ELEMENTS)
                try:
                    self._step_slice(flat[piece], grads[piece], moments[0][piece], moments[1][piece],
                                     start=self.offsets[i] + start, **hyper)
                except torch.OutOfMemoryError:
                    if not changed:
                        raise
                    raise CohortError("out of GPU memory part-way through the optimizer step: retrying would "
                                      "update some weights twice, so the run stops here; resume from the newest "
                                      "checkpoint (--resume) with more free GPU memory") from None
                changed = True
            self.steps[i] = count
            self.state[param]["step"] += 1
        return loss

    def _step_slice(self, weights, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, decay, step_size,
                    bias_correction2_sqrt, key, start) -> None:
        """torch's single-tensor AdamW on one slice, its moments widened to fp32 and narrowed back."""
        narrow = self.state_dtype != torch.float32
        m = exp_avg.float() if narrow else exp_avg
        v = exp_avg_sq.float() if narrow else exp_avg_sq
        grad = grad.float()
        denominator = torch.empty_like(v)
        if narrow:  # the kernel's split of one hash: its low half rounds m, its high half v
            noise = element_noise(key, start, m.numel(), m.device)
            m_noise, v_noise = (noise & 0xFFFF).to(torch.int32), (noise >> 16).to(torch.int32)
            del noise
            nan = torch.empty(m.numel(), dtype=torch.bool, device=m.device)
        # Everything is made: from here on nothing allocates.
        weights.mul_(1 - lr * decay)
        m.lerp_(grad, 1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        torch.sqrt(v, out=denominator).div_(bias_correction2_sqrt).add_(eps)
        weights.addcdiv_(m, denominator, value=-step_size)
        if narrow:
            round_with_noise(m, exp_avg, m_noise, nan)
            round_with_noise(v, exp_avg_sq, v_noise, nan)

    def load_state_dict(self, state_dict) -> None:
        """torch would cast the moments to the parameters' dtype (fp32); they are kept in `state_dtype`."""
        state_dict = dict(state_dict)
        saved = state_dict.get("state", {})
        # The state's keys are the group's "params" entries (ints from torch, names from torch.distributed.checkpoint),
        # matched to this optimizer's parameters by position as torch matches them.
        position = {key: i for i, key in enumerate(key for group in state_dict["param_groups"] for key in group["params"])}
        moments = {position[key]: {name: v for name, v in value.items() if name in MOMENTS}
                   for key, value in saved.items()}
        state_dict["state"] = {key: {name: v for name, v in value.items() if name not in MOMENTS}
                               for key, value in saved.items()}
        seed = self.param_groups[0]["noise_seed"]
        super().load_state_dict(state_dict)
        self.param_groups[0].setdefault("noise_seed", seed)  # a checkpoint of torch's AdamW has none
        for i, param in enumerate(self.params):
            state = self.state.setdefault(param, {})
            for name, value in moments.get(i, {}).items():
                if tuple(value.shape) != tuple(param.shape):
                    raise CohortError(f"the checkpoint's {name} of parameter {i} has shape {tuple(value.shape)}, "
                                      f"the model's is {tuple(param.shape)}: it is from a different model")
                state[name] = value.to(device=param.device, dtype=self.state_dtype)
            self.steps[i] = int(state["step"]) if "step" in state else 0
        self._allocate_state()
