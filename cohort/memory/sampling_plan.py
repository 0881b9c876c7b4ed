"""How many sampling ranks share one engine: `rollout_tensor_parallel_size=auto`.

A sampling group of T ranks holds the model split T ways (cohort/models/tensor_parallel.py): each rank keeps
1/T of the weights and 1/T of the KV cache (its share of the KV heads). `auto` takes the smallest T that
divides the sampling ranks and the model's heads and MLP columns and whose per-rank share of the weights and
of the KV cache of a step's batch fits `FILL` of the card: one GPU per engine wherever the model fits one,
since every split adds two all-reduces per layer to each decode step. With `--fsdp` and no sampling ranks (the
colocated placement) the training ranks sample in groups themselves, so T divides them and each rank's share
is counted beside its shard of the training state. On the CPU, for a model cohort's engine does not sample,
and with tools or LoRA (which a split refuses) it is 1.

Every rank settles it from the same loaded model and config and from its own card, so the ranks agree without
a message as long as the sampling GPUs are of one kind (the usual node).
"""

from __future__ import annotations

import math
import os

import torch

from ..errors import CohortError
from ..models.config import ModelConfig
from ..models.tensor_parallel import check_tensor_parallel_size

# The share of a card the weights and KV cache may take: the rest holds a decode step's activations and
# logits, the CUDA graphs' pools and the allocator's slack.
FILL = 0.85


def parameter_count(config: ModelConfig) -> int:
    """The model's weights, counted from its config (projections, embeddings, norms; biases left out)."""
    hidden, heads, kv_heads, head_dim = (config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                                         config.head_dim)
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q and o, k and v
    dense = 3 * hidden * config.intermediate_size
    sparse = config.num_experts * (3 * hidden * config.moe_intermediate_size + hidden)  # experts and router
    mlps = sum(sparse if config.is_sparse_layer(i) else dense for i in range(config.num_hidden_layers))
    embeddings = config.vocab_size * hidden * (1 if config.tie_word_embeddings else 2)
    return config.num_hidden_layers * (attention + 2 * hidden) + mlps + embeddings + hidden


def kv_cache_bytes(config: ModelConfig, rows: int, max_len: int, element_bytes: int) -> int:
    """Keys and values of `rows` sequences of `max_len` tokens, every layer."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * rows * max_len * element_bytes


def rank_bytes(config: ModelConfig, size: int, rows: int, max_len: int, element_bytes: int) -> int:
    """What one rank of a group of `size` holds: its share of the weights and of the KV cache."""
    whole = parameter_count(config) * element_bytes + kv_cache_bytes(config, rows, max_len, element_bytes)
    return math.ceil(whole / size)


def sampling_tensor_parallel_size(args, model_config: ModelConfig | None, device: torch.device,
                                  element_bytes: int, splittable: bool = True, world_size: int = 1) -> int:
    """The `rollout_tensor_parallel_size` of the run `args` (`auto` settled here; an integer kept) for the
    loaded model's `model_config` (None: not a model cohort's engine samples) on `device`. `splittable`: no
    tools and no LoRA adapters. `world_size`: the training ranks, which sample in groups themselves with
    `fsdp` and no `rollout_gpus` (the colocated placement). Refused, in one line, when no group holds the
    model, and for the colocated placement when an integer asked for does not divide the ranks."""
    asked = args.rollout_tensor_parallel_size
    colocated = not args.rollout_gpus and args.fsdp
    if asked != "auto":
        if colocated and asked > 1 and world_size % asked:
            raise CohortError(f"rollout_tensor_parallel_size={asked} does not divide the {world_size} training rank(s), "
                              "which sample in groups of that many (--fsdp without --rollout_gpus); give a divisor of "
                              f"{world_size}, or start a multiple of {asked} processes")
        return asked
    if device.type != "cuda" or model_config is None or not splittable:
        return 1
    if colocated:
        return colocated_size(args, model_config, device, element_bytes, world_size)
    if not args.rollout_gpus:
        return 1
    trainers = int(os.environ.get("WORLD_SIZE", "1")) - args.rollout_gpus
    # A group serves a block of trainers; partial rollouts keep a second batch of groups in flight.
    in_flight = 1 if args.partial_rollouts is False else 2
    sizes = [size for size in range(1, args.rollout_gpus + 1)
             if not args.rollout_gpus % size and args.rollout_gpus // size <= max(trainers, 1)]
    rows = {size: math.ceil(max(trainers, 1) / (args.rollout_gpus // size)) * args.prompts_per_step
            * args.num_generations * in_flight for size in sizes}
    return smallest_fitting(args, model_config, device, element_bytes, rows, resident={}, where="sampling rank(s)",
                            fix="add sampling ranks (--rollout_gpus)")


def colocated_size(args, model_config: ModelConfig, device: torch.device, element_bytes: int, world_size: int) -> int:
    """`auto` for the colocated placement: the smallest T dividing the `world_size` training ranks whose share of
    the weights and of its group's KV cache (T ranks' completions in one engine call) fits beside what the rank
    keeps of the training state between updates (its FSDP2 shard of the fp32 weights and of AdamW's two fp32
    moments, 12 bytes a weight over the ranks)."""
    if world_size == 1:
        return 1
    sizes = [size for size in range(1, world_size + 1) if not world_size % size]
    rows = {size: size * args.prompts_per_step * args.num_generations for size in sizes}
    training = math.ceil(parameter_count(model_config) * 12 / world_size)
    return smallest_fitting(args, model_config, device, element_bytes, rows, resident={s: training for s in sizes},
                            where="training rank(s)", fix="add GPUs (--nproc_per_node)")


def smallest_fitting(args, model_config: ModelConfig, device: torch.device, element_bytes: int, rows: dict[int, int],
                     resident: dict[int, int], where: str, fix: str) -> int:
    """The first split size of `rows` (size -> completions its engine samples in one call) that the model's heads
    allow and whose per-rank weights and KV cache, plus `resident` bytes, fit `FILL` of the card; else one line."""
    max_len = args.max_prompt_length + args.max_completion_length
    card = torch.cuda.get_device_properties(device).total_memory
    needed = {}
    for size, count in rows.items():
        try:
            check_tensor_parallel_size(model_config, size)
        except CohortError:
            continue  # a split the heads or MLP columns do not allow
        needed[size] = rank_bytes(model_config, size, count, max_len, element_bytes) + resident.get(size, 0)
        if needed[size] <= FILL * card:
            return size
    largest = max(needed, default=1)
    raise CohortError(
        f"rollout_tensor_parallel_size=auto: the model's weights and the KV cache of a step's batch need "
        f"{needed.get(largest, 0) / 2**30:.1f} GiB per rank even split over {largest} {where}, more than "
        f"{FILL:.0%} of a {card / 2**30:.0f} GiB GPU; {fix}, or sample fewer or shorter completions per step "
        "(--num_generations, --max_completion_length)")
