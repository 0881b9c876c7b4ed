"""`max_concurrent_sequences=auto` on a rank that trains and samples on its own whole copy of the model: one GPU,
DDP, FSDP2 ranks that each sample on a whole copy, and a `--rollout_gpus` trainer (its engine evaluates).

The engine's KV cache stays allocated through the step (the update borrows it for its gradients:
`lending.py`), so the cache is one more term of the rank's training plan (`training_plan.py`): the slots are
the widest CUDA-graph width whose plan fits `FILL` of the card, or, where the step needs more than that without
any cache (the update's peak, which `capacity.py` checks against the free memory), whose cache does not raise
that peak. At least one slot: an engine needs one to sample at all.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from cohort_grpo.models.config import ModelConfig
from cohort_grpo.parallel.placement import Placement
from cohort_grpo.plans.sampling_plan import FILL, widest_width
from cohort_grpo.plans.training_plan import RankShape, StepShape, training_memory_plan


def training_rank_slots(args, placement: Placement, model_config: ModelConfig, device: torch.device,
                        sampling_split: int = 1, state_bytes: int = 0) -> int:
    """The slots of the engine of a training rank of the run `args` (validated, `optimizer_state_dtype` settled)
    placed by `placement`, for the loaded model's `model_config`, on CUDA `device`; `sampling_split`: the ranks of
    its tensor-parallel sampling group (the colocated placement); `state_bytes`: each sequence's recurrent states
    (linear-attention layers; 0 without)."""
    step = replace(StepShape.from_config(args, placement), state_bytes=state_bytes)
    rank = replace(RankShape.of(placement), samples=True, sampling_split=sampling_split)

    def peak(slots: int) -> int:
        return training_memory_plan(model_config, replace(step, engine_slots=slots), rank).peak

    budget = max(FILL * torch.cuda.get_device_properties(device).total_memory, peak(0))
    return widest_width(lambda width: peak(width) <= budget) or 1
