"""The memory plans price a generic-path model (cohort_grpo/plans/model_shape.py): a slot's bytes are what the engine's
`KVCache` allocates a row for the wrapped model (each layer's own probed shape, recurrent states beside), the
weights are the model's own, and `max_concurrent_sequences=auto` on a CUDA card follows from them."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from test_generic_models import reference_model, wrapped
from test_sampling_plan import linear_attention_state_shapes

from cohort_grpo import GRPOConfig
from cohort_grpo.models.cache import KVCache
from cohort_grpo.models.recurrent_state import row_bytes
from cohort_grpo.parallel.placement import Placement
from cohort_grpo.plans.model_shape import ModelShape, planned_shape, slot_state_bytes
from cohort_grpo.plans.sampling_plan import FILL, kv_length, parameter_count, slot_bytes
from cohort_grpo.plans.training_plan import StepShape, training_memory_plan
from cohort_grpo.run.resolve import resolve_run_config

pytestmark = pytest.mark.cpu("float32 tolerances of CPU forwards (the wrap-time probe)")

TYPES = ["gemma3_text", "gemma4_text", "olmo2", "qwen3_5_text"]


@pytest.fixture(scope="module", params=TYPES)
def model(request):
    return wrapped(reference_model(request.param))


def allocated_bytes(cache: KVCache) -> int:
    """Every tensor the cache holds for its rows: keys, values and recurrent states, measured."""
    states = [] if cache.recurrent is None else list(cache.recurrent.tensors.values())
    tensors = cache.k_layers + cache.v_layers + states
    return sum(tensor.nbytes for tensor in tensors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_slot_costs_what_the_engine_allocates_a_row(model, dtype):
    shape = planned_shape(model)
    assert isinstance(shape, ModelShape)
    rows, length = 3, kv_length(20, 13)
    measured = allocated_bytes(KVCache.for_model(model, num_rows=rows, max_len=length, dtype=dtype))
    assert slot_bytes(shape, 1, length, dtype.itemsize, slot_state_bytes(model, dtype)) * rows == measured
    assert parameter_count(shape) == sum(p.numel() for p in model.parameters())


def test_each_family_is_priced_by_its_own_cache_layers():
    gemma4 = planned_shape(wrapped(reference_model("gemma4_text")))  # wider global heads, fewer of them
    assert gemma4.kv_cache_layer_shapes == ((2, 16), (1, 32), (2, 16), (1, 32))
    assert gemma4.kv_elements_per_token == 2 * 32 + 2 * 32
    hybrid = wrapped(reference_model("qwen3_5_text"))  # Gated DeltaNet layers keep states, no keys
    assert planned_shape(hybrid).kv_cache_layer_shapes == ((0, 0), (2, 16), (0, 0), (2, 16))
    # the probe's states are those the config describes: per linear layer its convolution's 4 last inputs over
    # 2 × 32 + 64 channels and a 4 × 16 × 16 float32 state matrix
    by_config = row_bytes(linear_attention_state_shapes(hybrid.config, torch.bfloat16), torch.bfloat16)
    assert slot_state_bytes(hybrid, torch.bfloat16) == by_config == 2 * (128 * 4 * 2 + 4 * 16 * 16 * 4)
    assert slot_state_bytes(wrapped(reference_model("olmo2")), torch.bfloat16) == 0


@pytest.fixture
def card(monkeypatch):
    """A GPU of `card.bytes` bytes as far as the plans can tell."""
    state = SimpleNamespace(bytes=80 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=state.bytes))
    return state


@pytest.mark.parametrize("width", [48, 80])
def test_a_sampling_rank_keeps_the_slots_its_card_leaves(model, card, width):
    """A sampling rank (--rollout_gpus) holds bf16 weights and its slots: card bytes chosen so that `width` slots
    and half another fit in FILL of it, counted here from the measured cache."""
    args = GRPOConfig(rollout_gpus=1, async_rollouts=True, partial_rollouts=False, per_device_train_batch_size=8,
                      num_generations=8, max_prompt_length=64, max_completion_length=200)
    length = kv_length(64, 200)
    per_slot = allocated_bytes(KVCache.for_model(model, num_rows=1, max_len=length, dtype=torch.bfloat16))
    weights = 2 * sum(p.numel() for p in model.parameters())
    card.bytes = int((weights + (width + 0.5) * per_slot) / FILL)
    placement = Placement.from_config(args.validate(), 2)
    resolved = resolve_run_config(args, model=model, device=torch.device("cuda", 0), placement=placement,
                                  sampling_rank=True)
    assert resolved.max_concurrent_sequences == width
    assert resolved.rollout_tensor_parallel_size == 1


@pytest.mark.parametrize(("room", "width"), [(40.5, 32), (100.5, 80)])
def test_a_training_rank_sizes_its_slots_beside_its_training_state(card, room, width):
    """One GPU that trains and samples: its slots are what its training plan leaves, the slots' cache and states
    priced as the engine allocates them. The card here holds the plan without a cache and `room` measured slots in
    FILL of it (the update's gradients, less than half a slot here, borrow the idle cache)."""
    model = wrapped(reference_model("qwen3_5_text"))
    args = GRPOConfig(per_device_train_batch_size=32, gradient_accumulation_steps=8, num_generations=8,
                      max_prompt_length=64, max_completion_length=4000)
    per_slot = allocated_bytes(KVCache.for_model(model, num_rows=1, max_len=kv_length(64, 4000), dtype=torch.bfloat16))
    assert 2 * sum(p.numel() for p in model.parameters()) < per_slot / 2
    settled = resolve_run_config(args, model=model, device=torch.device("cuda", 0))  # its step is the card's alike
    step = replace(StepShape.from_config(settled, Placement.from_config(settled, 1)), engine_slots=0)
    card.bytes = int((training_memory_plan(planned_shape(model), step).peak + room * per_slot) / FILL)
    resolved = resolve_run_config(args, model=model, device=torch.device("cuda", 0))
    assert resolved.max_concurrent_sequences == width
