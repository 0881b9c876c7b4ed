"""How a run samples on its GPUs: how many sampling ranks share one engine (`rollout_tensor_parallel_size=auto`)
and how many sequences an engine decodes at once (`max_concurrent_sequences=auto`).

A sampling group of T ranks holds the model split T ways (cohort_grpo/models/tensor_parallel.py): each rank keeps
1/T of the weights and 1/T of each sequence's KV cache (its share of the KV heads). An engine allocates the KV
cache of its slots only, the sequences it decodes at once: the other sequences of a call wait for a slot
(continuous batching, cohort_grpo/rollout/scheduler.py) and are sampled the same. So the memory a call needs is the
weights and its slots' KV cache, however many rows the call has. A model with linear-attention layers (Gated
DeltaNet) also keeps each slot's recurrent states beside its keys and values, a fixed size a sequence
(`state_bytes`: cohort_grpo/models/recurrent_state.py `row_bytes`), which a slot's price includes.

`auto` slots: what the weights leave of `FILL` of the card (on a rank that also trains, beside its training
state) over one slot's KV cache of prompt + completion tokens, at most `ENGINE_SLOTS`, rounded down to a decode
width a CUDA graph is kept for. `auto` T: the smallest T that divides the sampling ranks and the model's heads
and MLP columns and whose ranks keep a useful number of slots (`USEFUL_SLOTS`, or a call's rows where fewer):
one GPU per engine wherever the model and such a batch fit one, since every split adds two all-reduces per
layer to each decode step. With `--fsdp` and no sampling ranks (the colocated placement) the training ranks
sample in groups themselves, so T divides them and each rank's share is counted beside its shard of the
training state. On the CPU, for a model cohort's engine does not sample, and with tools or LoRA (which a split
refuses) T is 1.

Every rank settles T from the same loaded model and config and from its own card, so the ranks agree without
a message as long as the sampling GPUs are of one kind (the usual node). Slots need no agreement: each engine
sizes its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from cohort_grpo.errors import CohortError
from cohort_grpo.models.config import ModelConfig
from cohort_grpo.models.tensor_parallel import check_tensor_parallel_size
from cohort_grpo.parallel.placement import Placement
from cohort_grpo.plans.model_shape import ModelShape
from cohort_grpo.rollout.engine_setup import KV_LENGTH_STEP
from cohort_grpo.rollout.scheduler import ENGINE_SLOTS, batch_buckets

# The share of a card the weights and KV cache may take: the rest holds a decode step's activations and
# logits, the CUDA graphs' pools and the allocator's slack.
FILL = 0.85
# Below about this many rows a decode step's time is mostly the read of the weights, the same at any width, so
# sampling with fewer slots loses throughput about in proportion, which costs more than the two all-reduces a
# layer that a tensor-parallel split adds. `auto` therefore splits the model before it samples with fewer.
USEFUL_SLOTS = 64


@dataclass(frozen=True)
class SamplingPlan:
    """What `sampling_plan` settles: `size` (rollout_tensor_parallel_size) and `slots` (max_concurrent_sequences;
    None on a rank that also trains without sampling in a group, whose slots follow from its training plan:
    `cohort_grpo.plans.training_slots`)."""

    size: int
    slots: int | None


def layer_parameter_counts(config: ModelConfig) -> list[int]:
    """Each decoder layer's weights: attention, norms and its MLP, a mixture of experts' being every expert
    (3 matrices each) and the router."""
    hidden, heads, kv_heads, head_dim = (config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                                         config.head_dim)
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q and o, k and v
    dense = 3 * hidden * config.intermediate_size
    sparse = config.num_experts * (3 * hidden * config.moe_intermediate_size + hidden)  # experts and router
    return [attention + 2 * hidden + (sparse if config.is_sparse_layer(i) else dense)
            for i in range(config.num_hidden_layers)]


def parameter_count(config: ModelConfig | ModelShape) -> int:
    """The model's weights, counted from its config (projections, embeddings, norms; biases left out); a
    generic-path model's, as it holds them."""
    if isinstance(config, ModelShape):
        return config.parameters
    embeddings = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    return sum(layer_parameter_counts(config)) + embeddings + config.hidden_size


def active_parameter_count(config: ModelConfig) -> float:
    """The weights a token's forward passes through: `parameter_count` with each mixture-of-experts layer's
    experts counted at their routed share, k of E (the router still sees every token). What a token costs in
    FLOPs, where `parameter_count` is what the model holds."""
    if not config.num_experts:
        return parameter_count(config)
    experts = config.num_experts * 3 * config.hidden_size * config.moe_intermediate_size
    idle = experts * (1 - config.num_experts_per_tok / config.num_experts)
    return parameter_count(config) - idle * len(config.sparse_layers)


def kv_cache_bytes(config: ModelConfig | ModelShape, rows: int, max_len: int, element_bytes: int) -> int:
    """Keys and values of `rows` sequences of `max_len` tokens, every layer (a generic-path model's layers each of
    their own probed shape)."""
    if isinstance(config, ModelShape):
        return 2 * config.kv_elements_per_token * rows * max_len * element_bytes
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * rows * max_len * element_bytes


def kv_length(prompt_len: int, completion_len: int) -> int:
    """The KV length of an engine's slot for prompts and completions of these lengths, rounded up as the engine does."""
    return -(-(prompt_len + completion_len) // KV_LENGTH_STEP) * KV_LENGTH_STEP


def slot_length(args) -> int:
    """The KV length of an engine's slot in the run `args`: prompt and completion, rounded up as the engine does."""
    return kv_length(args.max_prompt_length, args.max_completion_length)


def slot_bytes(config: ModelConfig, size: int, length: int, element_bytes: int, state_bytes: int = 0) -> int:
    """One slot's cache on a rank of a group of `size`: its share of the KV heads, `length` tokens, and of the
    sequence's recurrent states (`state_bytes` whole, linear-attention layers only)."""
    return math.ceil((kv_cache_bytes(config, 1, length, element_bytes) + state_bytes) / size)


def widest_width(fits: Callable[[int], bool]) -> int:
    """The widest CUDA-graph width (a width of `batch_buckets(ENGINE_SLOTS)`, so an engine capped there keeps the
    same graphs) for which `fits(width)`; 0 if none."""
    return max((width for width in batch_buckets(ENGINE_SLOTS) if fits(width)), default=0)


def slots_within(free_bytes: float, per_slot: int) -> int:
    """The most slots whose KV cache fits `free_bytes` (`widest_width`); 0 if none."""
    return widest_width(lambda width: width * per_slot <= free_bytes)


def engine_call_rows(args, placement: Placement, size: int, sampling_rank: bool) -> int:
    """The sequences one engine call of the run `args` samples, for a group of `size` ranks: a sampling rank's
    call serves a block of `placement`'s trainers (and, with partial rollouts, a second batch of groups in
    flight); in the colocated placement a group samples its ranks' completions together; else a rank samples its
    own."""
    per_rank = args.prompts_per_step * args.num_generations
    if sampling_rank:
        in_flight = 1 if args.partial_rollouts is False else 2
        return math.ceil(placement.trainers / (placement.rollout_gpus // size)) * per_rank * in_flight
    return size * per_rank


def sampling_plan(args, placement: Placement, model_config: ModelConfig | ModelShape | None, device: torch.device,
                  element_bytes: int, splittable: bool = True, sampling_rank: bool = False,
                  state_bytes: int = 0) -> SamplingPlan:
    """`rollout_tensor_parallel_size` and `max_concurrent_sequences` of the run `args` (`auto` settled here; an
    integer kept) placed by `placement` (its split as asked), for the loaded model's `model_config` (a
    generic-path model's `ModelShape`; None: not a model cohort's engine samples) on `device`. `splittable`: no
    tools, no LoRA adapters and a model cohort implements itself. The training ranks sample in groups themselves
    under FSDP2 without sampling ranks (the colocated placement). `sampling_rank`: this rank only samples
    (`--rollout_gpus`); `state_bytes`: each sequence's recurrent states (0: the model has no
    linear-attention layers). Refused, in one line, where no group keeps a useful batch (or the
    slots asked for) beside its weights."""
    asked, slots = args.rollout_tensor_parallel_size, args.max_concurrent_sequences
    if device.type != "cuda" or model_config is None:
        return SamplingPlan(1 if asked == "auto" else asked, ENGINE_SLOTS if slots == "auto" else slots)
    sampling_ranks = placement.rollout_gpus
    if sampling_ranks:  # the sampling ranks' groups, which the trainers settle too (to form the same groups)
        sizes = [size for size in range(1, sampling_ranks + 1)
                 if not sampling_ranks % size and sampling_ranks // size <= placement.trainers]
        where, fix, resident = "sampling rank(s)", "add sampling ranks (--rollout_gpus)", 0
    elif placement.fsdp_ranks_sample and (asked == "auto" and splittable or asked != "auto" and asked > 1):
        world_size = placement.trainers
        sizes = [size for size in range(1, world_size + 1) if not world_size % size]
        where, fix = "training rank(s)", "add GPUs (--nproc_per_node)"
        # What a rank keeps of the training state between updates: its FSDP2 shard of the fp32 weights and of
        # AdamW's two moments (bf16 by default, fp32 with optimizer_state_dtype=float32), over the ranks.
        per_weight = 4 + (8 if args.optimizer_state_dtype == "float32" else 4)
        resident = math.ceil(parameter_count(model_config) * per_weight / world_size)
    else:  # a rank that trains and samples on its whole copy: its slots follow from its training plan
        return SamplingPlan(1 if asked == "auto" else asked, None if slots == "auto" else slots)
    if asked != "auto":
        sizes = [asked]
    elif not splittable:
        sizes = [1]
    rows = {size: engine_call_rows(args, placement, size, sampling_rank=bool(sampling_ranks)) for size in sizes}
    plan = fitting_plan(args, model_config, device, element_bytes, rows, resident, where, fix,
                        useful=asked == "auto" and splittable, state_bytes=state_bytes)
    if sampling_ranks and not sampling_rank:  # a trainer: its own engine only evaluates, beside its training
        return SamplingPlan(plan.size, None if slots == "auto" else slots)
    return plan


def fitting_plan(args, model_config: ModelConfig, device: torch.device, element_bytes: int, rows: dict[int, int],
                 resident: int, where: str, fix: str, useful: bool = True, state_bytes: int = 0) -> SamplingPlan:
    """The first split size of `rows` (size -> sequences its engine samples in one call) that the model's heads
    allow and whose ranks, beside their share of the weights and `resident` bytes, keep room in `FILL` of the card
    for the KV cache (and recurrent states, `state_bytes` a sequence) of the slots asked for, else of a useful
    batch (`useful`: T is auto's to choose; else one slot will do); its slots. Else one line saying what would fit."""
    card = torch.cuda.get_device_properties(device).total_memory
    length, asked = slot_length(args), args.max_concurrent_sequences
    weights = parameter_count(model_config) * element_bytes
    found = {}  # size -> (weights a rank, slots that fit)
    for size, count in rows.items():
        try:
            check_tensor_parallel_size(model_config, size)
        except CohortError:
            if len(rows) == 1:
                raise  # the size asked for
            continue  # a split the heads or MLP columns do not allow
        share = math.ceil(weights / size)
        per_slot = slot_bytes(model_config, size, length, element_bytes, state_bytes)
        free = FILL * card - share - resident
        if asked != "auto":
            if asked * per_slot <= free:
                return SamplingPlan(size, asked)
            found[size] = (share, slots_within(free, per_slot))
            continue
        found[size] = (share, slots_within(free, per_slot))
        needed = min(count, USEFUL_SLOTS) if useful else 1
        if found[size][1] >= needed:
            return SamplingPlan(size, found[size][1])
    largest = max(found)
    share, fit = found[largest]
    beside = " and the training state" if resident else ""
    if asked != "auto":
        want = f"the KV cache of max_concurrent_sequences={asked} sequences"
    elif not useful:
        want = "the KV cache of one sequence"
    else:
        want = f"the KV cache of the {min(rows[largest], USEFUL_SLOTS)} sequences a useful decode batch needs"
    room = f"leave room for {fit} sequence(s)" if fit else "leave no room for one sequence"
    fixes = [fix]
    if args.rollout_tensor_parallel_size != "auto":
        fixes.append("a larger --rollout_tensor_parallel_size (or auto)")
    fixes.append("shorter completions (--max_completion_length)")
    if fit and asked != "auto":
        fixes.append(f"--max_concurrent_sequences {fit}")
    elif fit:
        fixes.append(f"--max_concurrent_sequences {fit} to sample that few at once")
    raise CohortError(
        f"{option_spelling(args)}: the model's weights ({share / 2**30:.1f} GiB a rank split over {largest} {where})"
        f"{beside} {room} of {length} tokens in {FILL:.0%} of a {card / 2**30:.0f} GiB GPU, not {want}; "
        + ", ".join(fixes[:-1]) + ", or " + fixes[-1])


def option_spelling(args) -> str:
    """How the refusal names what was asked: `rollout_tensor_parallel_size=auto`, or the values given."""
    size, slots = args.rollout_tensor_parallel_size, args.max_concurrent_sequences
    return f"rollout_tensor_parallel_size={size}" + (f" with max_concurrent_sequences={slots}" if slots != "auto" else "")


def sampling_tensor_parallel_size(args, placement: Placement, model_config: ModelConfig | None,
                                  device: torch.device, element_bytes: int, splittable: bool = True) -> int:
    """`sampling_plan(...).size`: the split alone, which a trainer and a sampling rank settle alike."""
    return sampling_plan(args, placement, model_config, device, element_bytes, splittable,
                         sampling_rank=bool(placement.rollout_gpus)).size
