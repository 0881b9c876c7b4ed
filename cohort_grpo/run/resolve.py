"""The run's configuration, settled once: every `auto` (and unset) option given the value the run uses.

A `GRPOConfig` says what the user asked for; several options only mean something once the device and the
model are known (`auto`: the fastest measured choice there). `resolve_run_config` turns the two into the
run's final configuration, in one place and in this order:

1. `GRPOConfig.validate`: the raw values checked and their spellings settled (a copy; the caller's object is
   never changed, so a TRL user may build several trainers from one config);
2. what the device alone decides: `device` (this rank's), `dtype` (the same rule `load_policy` is given,
   `cohort_grpo.optim.precision.resolve_dtype`, so the loaded weights and the config agree);
3. what the loaded model decides (after LoRA, which changes what trains): `model_impl`, the update's speed
   options (`cohort_grpo.update.fast_path`), `optimizer_state_dtype`, `offload_optimizer` (chosen before loading
   by the memory plan where it can read the model's shape, else off), the sampler correction, `partial_rollouts`
   and `max_staleness` (`cohort_grpo.rollout.partial`), and how many sampling ranks share one engine
   (`rollout_tensor_parallel_size`, `cohort_grpo.plans.sampling_plan`; with `--fsdp` and no sampling ranks, the
   training ranks' own groups, refused here where the model cannot be split), and how many sequences this
   rank's engine decodes at once (`max_concurrent_sequences`: what the weights leave, on a sampling rank or in
   a group; beside the training state on a rank that samples on its whole copy, `cohort_grpo.plans.training_slots`).

The result is frozen: setting a field raises a one-line `CohortError`, so every stage built from it (the
curriculum, the rollout link's message window, the samplers, the update, the memory manager, the reports)
reads the same values for the whole run. `GRPOTrainer.args` is this config; `cohort-grpo train --print_config`
prints it. `gradient_checkpointing_layers=auto` stays `auto` where it is the value the run uses: it measures
how many layers fit in the first update, a choice no earlier step can make.
"""

from __future__ import annotations

import dataclasses

import torch

from cohort_grpo.run.determinism import cpu_thread_count
from cohort_grpo.config.grpo_config import GRPOConfig
from cohort_grpo.config.command_line import show_value
from cohort_grpo.errors import CohortError
from cohort_grpo.optim.host_state import holds_split_masters
from cohort_grpo.optim.precision import resolve_dtype
from cohort_grpo.optim.optimizer import optimizer_state_dtype
from cohort_grpo.parallel.placement import Placement
from cohort_grpo.plans.model_shape import planned_shape, slot_state_bytes
from cohort_grpo.plans.capacity import offload_pays
from cohort_grpo.plans.sampling_plan import FILL, sampling_plan
from cohort_grpo.plans.training_plan import RankShape, StepShape
from cohort_grpo.plans.training_slots import training_rank_slots
from cohort_grpo.models.config import ModelConfig
from cohort_grpo.models.lora import has_lora
from cohort_grpo.models.tensor_parallel import check_splittable, check_tensor_parallel_size
from cohort_grpo.rollout import base_model, engine_samples
from cohort_grpo.rollout.partial import partial_rollout_settings
from cohort_grpo.update.fast_path import fast_path_settings
from cohort_grpo.update.policy_update import sampler_correction_mode


def resolve_run_config(args: GRPOConfig, *, model, device: torch.device, placement: Placement | None = None,
                       tools: bool = False, compiles: bool | None = None, sampling_rank: bool = False) -> GRPOConfig:
    """The frozen configuration of a run of `args` on `device` with the loaded `model` (`placement`: the run's, from
    the same config, its split as asked; None: one process; `tools`: completions may call tools; `compiles`: triton
    can compile here, default whether it is installed; `sampling_rank`: this rank only samples, `--rollout_gpus`).
    `args` itself is left as it is; the run's placement with its split settled is
    `placement.settled(resolved.rollout_tensor_parallel_size)`."""
    config = args.validate()
    placement = placement or Placement.from_config(config, 1)
    changes: dict = {"device": str(device), "dtype": resolve_dtype(config.dtype, device)}
    if device.type == "cpu":
        changes["cpu_threads"] = cpu_thread_count(config.cpu_threads)
    engine = engine_samples(model)
    if config.model_impl == "auto":
        changes["model_impl"] = "cohort" if engine else "hf"
    changes.update(fast_path_settings(config, model, device, compiles=compiles))
    changes["optimizer_state_dtype"] = optimizer_state_dtype(config, model)
    check_offload_optimizer(config, model, changes["dtype"], placement.trainers)
    if config.importance_sampling_correction is None:
        changes["importance_sampling_correction"] = sampler_correction_mode(config, model, device) is not None
    # our own implementation (a transformers model behind the engine's interface has no ModelConfig, records no routes)
    native = engine and isinstance(base_model(model).config, ModelConfig)
    replay = config.routing_replay and native and bool(getattr(base_model(model).config, "num_experts", 0))
    changes.update(partial_rollout_settings(config, engine=engine, tools=tools, routing_replay=replay))
    # what the plans price: a native config, or a generic-path model's probed cache and its weights (never split)
    dtype = getattr(torch, changes["dtype"])
    model_config = planned_shape(base_model(model)) if engine else None
    changes["offload_optimizer"] = offload_optimizer(dataclasses.replace(config, **changes), model, placement, device,
                                                     model_config)
    settled = dataclasses.replace(config, **changes)
    state_bytes = slot_state_bytes(base_model(model), dtype) if engine else 0
    plan = sampling_plan(settled, placement, model_config, device, dtype.itemsize,
                         splittable=native and not tools and not has_lora(model), sampling_rank=sampling_rank,
                         state_bytes=state_bytes)
    changes["rollout_tensor_parallel_size"] = plan.size
    slots = plan.slots
    if slots is None or (placement.fsdp_ranks_sample and config.max_concurrent_sequences == "auto"
                         and device.type == "cuda" and model_config is not None):
        # a rank that also trains: its engine's cache is one more term of its training plan (the KV cache stays
        # through the update unless freed, and an asynchronous engine samples during it)
        training = training_rank_slots(settled, placement, model_config, device, sampling_split=plan.size,
                                       state_bytes=state_bytes)
        slots = training if slots is None else min(slots, training)
    changes["max_concurrent_sequences"] = slots
    if placement.settled(plan.size).colocated:  # refused before anything is sharded
        check_splittable(model, plan.size, tools)
        check_tensor_parallel_size(model.config, plan.size)  # the heads, KV heads and MLP columns split T ways
    return dataclasses.replace(config, **changes).freeze()


def offload_optimizer(settled: GRPOConfig, model, placement: Placement, device: torch.device,
                      model_config) -> bool:
    """`offload_optimizer` as the run keeps it, decided once, from the run's config `settled` with every other value
    settled (its offload_optimizer as asked): true and false as asked (`check_offload_optimizer` refused true where
    it cannot be); auto — which the check before loading already settled where it could read the model's shape
    (`plans/capacity.py`) — for a model given as an object with a shape to plan (`model_config`) on a GPU: the
    same rule (`offload_pays`), on the share of the card the plans fill; else off."""
    if settled.offload_optimizer != "auto":
        return settled.offload_optimizer is True
    step = StepShape.from_config(settled, placement)
    if model_config is None or device.type != "cuda" or not holds_split_masters(step.dtype) or has_lora(model):
        return False
    budget = int(FILL * torch.cuda.get_device_properties(device).total_memory)
    return offload_pays(model_config, step, RankShape.of(placement), budget)


def check_offload_optimizer(args: GRPOConfig, model, dtype: str, trainers: int) -> None:
    """`offload_optimizer=True` refused (`dtype`: the run's, settled; `trainers`: its training processes) where the
    optimizer keeps no split fp32 masters (LoRA's float32 adapters, other dtypes) and on several processes, where
    each would take its own copy of the host memory and FSDP2 shards the state instead."""
    if args.offload_optimizer != True:  # noqa: E712  (auto or False)
        return
    if trainers > 1:
        raise CohortError(f"offload_optimizer=True keeps one process's optimizer state in host memory, and this run "
                          f"trains on {trainers} processes (each would keep a whole copy there); pass --fsdp true to "
                          "shard the state over the GPUs instead, or leave offload_optimizer auto")
    lora = has_lora(model)
    if lora or not holds_split_masters(dtype):
        raise CohortError("offload_optimizer=True keeps the split fp32 masters and moments of bf16 weights in host "
                          f"memory, and this run trains {'LoRA adapters' if lora else dtype + ' weights'}; "
                          + ("leave offload_optimizer auto" if lora else "pass --dtype bfloat16, or leave "
                             "offload_optimizer auto"))


def resolved_sources(settled: GRPOConfig, resolved: GRPOConfig, sources: dict[str, str]) -> dict[str, str]:
    """`sources` (where each value of `settled` came from: `cohort_grpo.config.command_line.resolve_config`) with each value that
    resolution settled marked `resolved from <what was asked>`."""
    out = dict(sources)
    for f in dataclasses.fields(resolved):
        asked, used = getattr(settled, f.name), getattr(resolved, f.name)
        if asked != used:
            out[f.name] = f"{sources.get(f.name, 'default')}, resolved from {show_value(asked)}"
    return out
