"""The run's optimizer: which AdamW the trainable weights get (`make_optimizer`), how it is described in the log
(`optimizer_line`), what `optimizer_state_dtype=auto` becomes, and gradient clipping over it.

Low-precision weights get fp32 masters (`precision.MasterWeightAdamW`, its state in host memory with
`offload_optimizer`); FSDP2's fp32 shards are their own masters (`sharded_adamw.ShardedAdamW` with bf16 moments,
torch's AdamW with fp32 ones); float32 weights on one process get torch's AdamW.
"""

from __future__ import annotations

import torch

from cohort_grpo.errors import CohortError
from cohort_grpo.optim.precision import MasterWeightAdamW
from cohort_grpo.optim.sharded_adamw import ShardedAdamW


def clip_grad_norm(optimizer: torch.optim.Optimizer, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the gradients the optimizer is about to apply; returns their total norm before clipping.

    With fp32 masters the norm is taken over fp32 copies of the gradients (a bf16 sum of squares
    over 10⁸ elements would lose the small ones), made and dropped chunk by chunk."""
    if isinstance(optimizer, MasterWeightAdamW):
        return optimizer.clip_grad_norm(max_norm)
    return torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_norm)


def optimizer_line(optimizer: torch.optim.Optimizer) -> str:
    """One log line: how the optimizer keeps and steps its state."""
    if not isinstance(optimizer, (MasterWeightAdamW, ShardedAdamW)):
        return "optimizer: AdamW over the weights in their own dtype"
    moments = "bf16 moments (stochastic rounding)" if optimizer.state_dtype == torch.bfloat16 else "fp32 moments"
    if isinstance(optimizer, ShardedAdamW):
        return f"optimizer: AdamW over the fp32 shards (the masters), {moments}, chunked torch step"
    step = "one kernel a parameter" if optimizer.fused_kernel else "chunked torch step"
    where = f", state in {optimizer.host.describe()}" if optimizer.host is not None else ""
    return f"optimizer: AdamW, fp32 masters, {moments}, {step}{where}"


def optimizer_state_dtype(args, model: torch.nn.Module) -> str:
    """`optimizer_state_dtype` as `make_optimizer` uses it for `model`: auto is bfloat16 where the trainable
    weights are low precision (fp32 masters, one GPU or FSDP2's fp32 shards; bf16 moments rounded
    stochastically), else float32."""
    if args.optimizer_state_dtype != "auto":
        return args.optimizer_state_dtype
    low = any(p.dtype in (torch.bfloat16, torch.float16) for p in model.parameters() if p.requires_grad)
    return "bfloat16" if low else "float32"


def make_optimizer(model: torch.nn.Module, args) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters: masters in fp32 when the weights are low precision; under FSDP2
    the fp32 shards are the masters, and their moments follow `optimizer_state_dtype` (settled by the run's
    config from the loaded model, bf16 on a GPU)."""
    params = [p for p in model.parameters() if p.requires_grad]
    kwargs = dict(lr=args.learning_rate, weight_decay=args.weight_decay, betas=(args.adam_beta1, args.adam_beta2))
    sharded = bool(params) and all(hasattr(p, "device_mesh") for p in params)
    if sharded and args.optimizer_state_dtype == "bfloat16" and params[0].dtype == torch.float32:
        return ShardedAdamW(params, state_dtype=torch.bfloat16, seed=args.seed, **kwargs)
    if any(p.dtype in (torch.bfloat16, torch.float16) for p in params):
        state_dtype = torch.bfloat16 if args.optimizer_state_dtype in ("auto", "bfloat16") else torch.float32
        return MasterWeightAdamW(params, state_dtype=state_dtype, seed=args.seed,
                                 offload=args.offload_optimizer is True, **kwargs)
    if args.optimizer_state_dtype == "bfloat16":
        raise CohortError("optimizer_state_dtype=bfloat16 needs low-precision weights with fp32 masters (dtype "
                          "bfloat16, the default on a GPU) or --fsdp; with float32 weights on one process pass "
                          "optimizer_state_dtype=auto")
    if sharded and params[0].is_cuda:
        # fp32 moments on FSDP2's shards: fused, in registers (foreach makes a √v̂ + ε temporary the size of the shard)
        kwargs["fused"] = True
    return torch.optim.AdamW(params, **kwargs)
