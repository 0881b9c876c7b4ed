"""rollout_tensor_parallel_size=auto and max_concurrent_sequences=auto (cohort_grpo/plans/sampling_plan.py,
cohort_grpo/plans/training_slots.py): the smallest sampling group whose ranks keep a useful batch's KV cache beside
their share of the weights, and the widest CUDA-graph width of slots that fits, counted here by hand."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from cohort_grpo import GRPOConfig
from cohort_grpo.errors import CohortError
from cohort_grpo.plans import sampling_plan as plans
from cohort_grpo.plans.sampling_plan import (SamplingPlan, engine_call_rows, kv_cache_bytes, parameter_count, sampling_plan,
                                         sampling_tensor_parallel_size)
from cohort_grpo.models import CausalLM, ModelConfig
from cohort_grpo.models.recurrent_state import CONV, RECURRENT
from cohort_grpo.parallel.placement import Placement

GIB = 2**30
# Llama-3.1-8B's shape (config.json): 8.03 billion weights.
LLAMA_8B = ModelConfig(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128)


@pytest.mark.parametrize("tied", [True, False])
def test_the_weight_count_is_the_models(tied):
    config = ModelConfig(model_type="llama", vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=tied)
    with torch.device("meta"):
        model = CausalLM(config)
    assert parameter_count(config) == sum(p.numel() for p in model.parameters())  # tied: counted once


def test_llama_8b_counts_as_published():
    assert abs(parameter_count(LLAMA_8B) - 8.03e9) < 0.01e9
    # 32 layers × 8 KV heads × 128 × (K and V) × 2 bytes = 128 KiB a token
    assert kv_cache_bytes(LLAMA_8B, rows=1, max_len=1, element_bytes=2) == 128 * 1024


def run_args(**options):
    base = dict(rollout_gpus=4, async_rollouts=True, per_device_train_batch_size=8, gradient_accumulation_steps=8,
                num_generations=8, max_prompt_length=512, max_completion_length=4096, partial_rollouts=False)
    return GRPOConfig(**{**base, **options}).validate()


def placed(args, world_size: int = 8) -> Placement:
    """The run `args` on `world_size` processes (`run_args`: 8 ranks of which the last 4 sample)."""
    return Placement.from_config(args, world_size)


def run_placed(args, world_size: int = 8) -> tuple:
    """(`args`, its placement on `world_size` processes): a plan's first two arguments."""
    return args, placed(args, world_size)


@pytest.fixture
def card(monkeypatch):
    """A GPU of `card.gib` GiB as far as the plan can tell."""
    state = SimpleNamespace(gib=80)
    monkeypatch.setattr(plans.torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(total_memory=state.gib * GIB))
    return state


# The engine's decode widths (cohort_grpo/rollout/scheduler.py batch_buckets(256)), written out.
WIDTHS = [1, 2, 4, 8, 16, 32, 48, 80, 128, 192, 256]


def widest(free_gib: float, slot_gib: float) -> int:
    """The widest decode width whose KV cache fits `free_gib`, counted here by hand."""
    return max([w for w in WIDTHS if w * slot_gib <= free_gib], default=0)


def test_auto_takes_the_smallest_group_that_keeps_a_useful_batch(card):
    cuda = torch.device("cuda", 0)
    args = run_args()
    assert args.prompts_per_step == 8
    # 4 trainers of 8 prompts × 8 completions of up to 4,608 tokens: T ranks a group serve T trainers' 64
    # completions a call. A slot's KV cache is 4,608 × 128 KiB = 0.5625 GiB, 1/T of it a rank; the weights 14.96
    # GiB, 1/T a rank. T is the smallest whose ranks keep at least min(64 · T, 64) = 64 slots.
    weights = parameter_count(LLAMA_8B) * 2 / GIB
    assert abs(weights - 14.96) < 0.01

    def expected(gib):
        for t in (1, 2, 4):
            slots = widest(0.85 * gib - weights / t, 0.5625 / t)
            if slots >= 64:
                return t, slots

    assert expected(80) == (1, 80)  # 53.0 GiB left: 94 slots, 80 at a CUDA-graph width
    assert expected(55) == (2, 128)  # alone 31.8 GiB left: 48 slots, too few; in pairs 128
    assert expected(40) == (2, 80)  # refused before (the whole batch's KV cache); 80 slots in pairs now
    eight = placed(args)
    for gib in (80, 55, 40):
        card.gib = gib
        plan = sampling_plan(args, eight, LLAMA_8B, cuda, 2, sampling_rank=True)
        assert (plan.size, plan.slots) == expected(gib)
        assert sampling_tensor_parallel_size(args, eight, LLAMA_8B, cuda, 2) == plan.size  # the trainers' groups alike
        assert sampling_plan(args, eight, LLAMA_8B, cuda, 2).slots is None  # a trainer's engine: its training plan's
    card.gib = 16  # 13.6 GiB usable: 4 ranks a group keep 9.86 GiB, 70 slots of 0.14 GiB: 48 at a graph width
    assert widest(0.85 * 16 - weights / 4, 0.5625 / 4) == 48
    with pytest.raises(CohortError, match=r"rollout_tensor_parallel_size=auto: the model's weights \(3.7 GiB a rank "
                                          r"split over 4 sampling rank\(s\)\) leave room for 48 sequence\(s\) of 4608 "
                                          r"tokens in 85% of a 16 GiB GPU, not the KV cache of the 64 sequences a "
                                          r"useful decode batch needs; add sampling ranks \((--)?rollout_gpus\), shorter "
                                          r"completions \((--)?max_completion_length\), or (--)?max_concurrent_sequences"
                                          r"[= ]48 to sample that few at once"):
        sampling_plan(args, eight, LLAMA_8B, cuda, 2, sampling_rank=True)
    # Asked for 48 at once, the same card samples with 4 ranks a group
    assert sampling_plan(*run_placed(run_args(max_concurrent_sequences=48)), LLAMA_8B, cuda, 2, sampling_rank=True) == \
        SamplingPlan(4, 48)


def test_slots_asked_for_are_kept_and_the_split_is_the_smallest_that_holds_them(card):
    cuda = torch.device("cuda", 0)
    card.gib = 80  # alone: 53.0 GiB left, 94 slots of 0.5625 GiB; in pairs 60.5 GiB, 215 slots of 0.28 GiB
    assert sampling_plan(*run_placed(run_args(max_concurrent_sequences=90)), LLAMA_8B, cuda, 2, sampling_rank=True) == \
        SamplingPlan(1, 90)
    hundred = run_args(max_concurrent_sequences=100)
    assert sampling_plan(hundred, placed(hundred), LLAMA_8B, cuda, 2, sampling_rank=True) == SamplingPlan(2, 100)
    with pytest.raises(CohortError, match=r"max_concurrent_sequences[= ]2000"):
        sampling_plan(*run_placed(run_args(max_concurrent_sequences=2000)), LLAMA_8B, cuda, 2, sampling_rank=True)
    # A split asked for keeps what fits, whatever it is: 4 ranks of an 8 GiB card keep 21 slots, 16 at a width
    card.gib = 8
    assert widest(0.85 * 8 - parameter_count(LLAMA_8B) * 2 / GIB / 4, 0.5625 / 4) == 16
    four = run_args(rollout_tensor_parallel_size=4)
    assert sampling_plan(four, placed(four), LLAMA_8B, cuda, 2, sampling_rank=True) == SamplingPlan(4, 16)


def test_the_8b_bench_run_on_one_sampling_gpu_samples_with_fewer_slots_instead_of_being_refused(card):
    """bench/async_rollouts.py --model llama3.1-8b --processes 2 --rollout_gpus 1 --prompts 16 --median 1024
    --cap 4096 on an H200: one trainer, one sampling rank; 16 prompts × 8 completions of up to 128 + 4,096 tokens,
    two batches in flight with partial rollouts: 256 rows a call, whose KV cache (132 GiB) and the weights need
    147 GiB. The engine needs only its slots' KV cache."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from grpo_step_worker import SHAPES, config_dict

    config = ModelConfig.from_hf_dict(config_dict(SHAPES["llama3.1-8b"]))
    card.gib = 140
    args = GRPOConfig(per_device_train_batch_size=32, gradient_accumulation_steps=4, num_generations=8,
                      max_prompt_length=128, max_completion_length=4096, async_rollouts=True, rollout_gpus=1,
                      partial_rollouts=True).validate()
    two = placed(args, 2)  # one trainer, one sampling rank
    assert engine_call_rows(args, two, 1, sampling_rank=True) == 256
    weights = parameter_count(config) * 2
    slot = 32 * 8 * 128 * 2 * 2 * 4224  # layers × KV heads × head_dim × (K, V) × bf16 × 4,224 tokens (33 × 128)
    assert slot == 528 * 2**20
    assert (weights + 256 * slot) / GIB > 0.85 * 140  # the whole call's cache: refused before
    plan = sampling_plan(args, two, config, torch.device("cuda", 0), 2, sampling_rank=True)
    assert plan.size == 1 and plan.slots == widest((0.85 * 140 * GIB - weights) / GIB, slot / GIB) == 192
    assert weights + plan.slots * slot <= 0.85 * 140 * GIB
    card.gib = 40  # 34 GiB usable: 15 GiB of weights leave room for 36 slots, fewer than a useful 64: refused
    with pytest.raises(CohortError, match=r"leave room for 32 sequence\(s\) of 4224 tokens in 85% of a 40 GiB GPU, "
                                          r"not the KV cache of the 64 sequences a useful decode batch needs; add "
                                          r"sampling ranks \((--)?rollout_gpus\)"):
        sampling_plan(args, two, config, torch.device("cuda", 0), 2, sampling_rank=True)
    card.gib = 16  # the weights alone need more than 85% of it
    with pytest.raises(CohortError, match=r"leave no room for one sequence of 4224 tokens in 85% of a 16 GiB GPU"):
        sampling_plan(args, two, config, torch.device("cuda", 0), 2, sampling_rank=True)


def test_auto_is_one_where_a_split_cannot_apply(card):
    card.gib = 8  # far too small for a whole copy: only the cases below keep it from a refusal
    args = run_args()
    eight = placed(args)
    assert sampling_tensor_parallel_size(args, eight, LLAMA_8B, torch.device("cpu"), 4) == 1
    assert sampling_plan(args, eight, LLAMA_8B, torch.device("cpu"), 4) == SamplingPlan(1, 256)  # the engine's most
    assert sampling_tensor_parallel_size(args, eight, None, torch.device("cuda", 0), 2) == 1  # Hugging Face generate
    assert sampling_tensor_parallel_size(*run_placed(run_args(rollout_gpus=0, async_rollouts=False), 1), LLAMA_8B,
                                         torch.device("cuda", 0), 2) == 1
    assert sampling_tensor_parallel_size(*run_placed(run_args(rollout_tensor_parallel_size=4)), LLAMA_8B,
                                         torch.device("cuda", 0), 2) == 4  # asked for: kept
    # Tools or LoRA: one rank an engine, so the card must hold a whole copy, and it does not
    with pytest.raises(CohortError, match=r"leave no room for one sequence of 4608 tokens in 85% of a 8 GiB GPU, not "
                                          r"the KV cache of one sequence"):
        sampling_tensor_parallel_size(args, eight, LLAMA_8B, torch.device("cuda", 0), 2, splittable=False)


def test_the_cpu_run_settles_auto_to_one():
    from cohort_grpo.run.resolve import resolve_run_config

    config = ModelConfig(model_type="llama", vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    resolved = resolve_run_config(GRPOConfig(), model=CausalLM(config), device=torch.device("cpu"))
    assert GRPOConfig().rollout_tensor_parallel_size == "auto" and resolved.rollout_tensor_parallel_size == 1


def test_auto_on_fsdp_ranks_that_sample_themselves_counts_their_training_shard(card):
    """The colocated placement (--fsdp, no sampling ranks): T divides the 2 training ranks; a group samples its T
    ranks' 64 completions each, beside each rank's shard of the fp32 weights and AdamW moments (12 bytes a weight
    with fp32 moments over 2 ranks: 44.9 GiB at 8B; 8 with bf16 ones), with at least 64 slots."""
    cuda = torch.device("cuda", 0)
    args = run_args(rollout_gpus=0, async_rollouts=False, fsdp=True, optimizer_state_dtype="float32")
    weights, training = parameter_count(LLAMA_8B) * 2 / GIB, parameter_count(LLAMA_8B) * 12 / 2 / GIB
    assert round(training, 1) == 44.9
    slots = {(gib, t): widest(0.85 * gib - weights / t - training, 0.5625 / t) for gib in (141, 110, 80) for t in (1, 2)}
    assert slots == {(141, 1): 80, (141, 2): 192, (110, 1): 48, (110, 2): 128, (80, 1): 8, (80, 2): 48}
    card.gib = 141  # each rank samples its own completions on a whole copy, 80 at once
    assert sampling_plan(args, placed(args, 2), LLAMA_8B, cuda, 2) == SamplingPlan(1, 80)
    card.gib = 110  # alone, 48 slots; the two ranks sample as one group with 128
    assert sampling_plan(args, placed(args, 2), LLAMA_8B, cuda, 2) == SamplingPlan(2, 128)
    card.gib = 80
    with pytest.raises(CohortError, match=r"weights \(7.5 GiB a rank split over 2 training rank\(s\)\) and the "
                                          r"training state leave room for 48 sequence\(s\) of 4608 tokens in 85% of a "
                                          r"80 GiB GPU, not the KV cache of the 64 sequences a useful decode batch "
                                          r"needs; add GPUs \(--nproc_per_node\)"):
        sampling_tensor_parallel_size(args, placed(args, 2), LLAMA_8B, cuda, 2)
    bf16 = run_args(rollout_gpus=0, async_rollouts=False, fsdp=True)  # auto: bf16 moments, 29.9 GiB a rank
    assert sampling_plan(bf16, placed(bf16, 2), LLAMA_8B, cuda, 2) == SamplingPlan(
        2, widest(0.85 * 80 - weights / 2 - parameter_count(LLAMA_8B) * 8 / 2 / GIB, 0.5625 / 2))
    assert sampling_tensor_parallel_size(args, placed(args, 1), LLAMA_8B, cuda, 2) == 1  # one process: nothing to split
    assert sampling_tensor_parallel_size(*run_placed(run_args(rollout_gpus=0, async_rollouts=False), 2), LLAMA_8B, cuda,
                                         2) == 1  # DDP: every rank holds the whole model anyway


def test_a_rank_that_trains_keeps_the_slots_its_step_leaves_room_for(card):
    """One GPU trains and samples: the engine's cache is a term of the rank's training plan, so the slots are the
    widest width whose plan peaks within 85% of the card (the next width's would not)."""
    from dataclasses import replace

    from cohort_grpo.plans.training_plan import RankShape, StepShape, training_memory_plan
    from cohort_grpo.plans.training_slots import training_rank_slots

    cuda = torch.device("cuda", 0)
    args = GRPOConfig(per_device_train_batch_size=16, gradient_accumulation_steps=32, num_generations=8,
                      max_prompt_length=512, max_completion_length=4096).validate()  # 512 completions a step
    card.gib = 141
    one = placed(args, 1)
    slots = training_rank_slots(args, one, LLAMA_8B, cuda)
    step = StepShape.from_config(args, one)
    peak = {w: training_memory_plan(LLAMA_8B, replace(step, engine_slots=w), RankShape()).peak for w in WIDTHS}
    assert peak[slots] <= 0.85 * 141 * GIB < peak[WIDTHS[WIDTHS.index(slots) + 1]]
    # While sampling the rank holds 8 bytes a weight (bf16 weights, the masters' low halves, bf16 moments) and the
    # slots' caches, 0.5625 GiB each: within the budget too.
    sampling = parameter_count(LLAMA_8B) * 8 / GIB + slots * 0.5625
    assert sampling <= 0.85 * 141 and slots == 48
    # A model whose step is small keeps the engine's most, as before
    small = ModelConfig(model_type="llama", vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    assert training_rank_slots(args, one, small, cuda) == 256
    # A step that needs more than 85% of the card without any cache still samples, with the slots that do not
    # raise its peak: the update borrows the idle cache for its gradients (15 GiB), so a cache that size is free.
    card.gib = 60
    without = training_memory_plan(LLAMA_8B, replace(step, engine_slots=0), RankShape()).peak
    assert without > 0.85 * 60 * GIB
    lent = training_rank_slots(args, one, LLAMA_8B, cuda)
    assert lent == max(w for w in WIDTHS if peak[w] <= without) and lent * 0.5625 <= 15


def test_colocated_ranks_keep_the_slots_their_update_leaves_room_for(card):
    """FSDP2 ranks that sample on their own copies, asynchronously (the engine decodes while the update runs): the
    slots that the weights and the resident shards alone leave would overrun the card once the update's
    activations, gradients, π_ref and the producer's copy are there (on two H200s at 8B this ran out of memory);
    the training plan's slots do not. In a tensor-parallel group π_ref is sharded like the policy."""
    from dataclasses import replace

    from cohort_grpo.plans.training_plan import RankShape, StepShape, training_memory_plan
    from cohort_grpo.plans.training_slots import training_rank_slots

    cuda = torch.device("cuda", 0)
    card.gib = 140
    args = run_args(rollout_gpus=0, fsdp=True, per_device_train_batch_size=8, gradient_accumulation_steps=8,
                    num_generations=32, max_prompt_length=256, max_completion_length=4096, beta=0.04)
    two = placed(args, 2)
    weights_only = sampling_plan(args, two, LLAMA_8B, cuda, 2).slots
    training = training_rank_slots(args, two, LLAMA_8B, cuda)
    step, layout = StepShape.from_config(args, two), RankShape(ranks=2, fsdp=True)
    peak = lambda slots: training_memory_plan(LLAMA_8B, replace(step, engine_slots=slots), layout).peak  # noqa: E731
    assert peak(weights_only) > 0.85 * 140 * GIB >= peak(training) and training < weights_only
    grouped = training_memory_plan(LLAMA_8B, step, RankShape(ranks=2, fsdp=True, sampling_split=2))
    assert grouped.phases["sampling"]["π_ref"] == parameter_count(LLAMA_8B) * 2 / 2
    assert training_memory_plan(LLAMA_8B, step, layout).phases["sampling"]["π_ref"] == parameter_count(LLAMA_8B) * 2


# ---- models with linear-attention layers: each slot's recurrent states ------------------------------------------

# Qwen3.5's and Qwen3-Next's Gated DeltaNet layers, tiny: 2 key heads and 4 value heads of 16, a kernel of 4
TINY_LINEAR = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=100, linear_num_key_heads=2, linear_num_value_heads=4,
                   linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                   layer_types=["linear_attention", "full_attention"] * 2)


def linear_attention_state_shapes(config, dtype: torch.dtype) -> dict:
    """The states a transformers `config` with Gated DeltaNet layers (`layer_types` "linear_attention": Qwen3.5,
    Qwen3-Next) has them write, before any model is built: per such layer its convolution's last
    `linear_conv_kernel_dim` inputs over its query, key and value channels, and its state matrix of
    `linear_num_value_heads` × `linear_key_head_dim` × `linear_value_head_dim` in float32 (transformers' kernels
    compute it so): what the wrap-time probe should record, computed here from the config alone. Empty without such
    layers."""
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    value_dim = config.linear_num_value_heads * config.linear_value_head_dim
    channels = 2 * key_dim + value_dim  # queries and keys, then values
    shapes = {}
    for layer, kind in enumerate(getattr(config, "layer_types", None) or []):
        if kind == "linear_attention":
            shapes[(layer, CONV, 0)] = ((channels, config.linear_conv_kernel_dim), dtype)
            shapes[(layer, RECURRENT, 0)] = ((config.linear_num_value_heads, config.linear_key_head_dim,
                                              config.linear_value_head_dim), torch.float32)
    return shapes


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_next"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_a_sequence_s_planned_states_are_what_the_engine_allocates(family, cache_dtype):
    """The bytes a plan counts for one sequence's recurrent states, from the config alone, are the bytes of one row
    of the states the engine's cache allocates for the wrapped model (the shapes its probe recorded from the
    layers' own writes), and the count by hand."""
    import transformers

    from cohort_grpo.models.cache import KVCache
    from cohort_grpo.models.generic import TransformersCausalLM
    from cohort_grpo.models.recurrent_state import row_bytes

    extra = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                 shared_expert_intermediate_size=32) if family == "qwen3_next" else {}
    config_class, model_class = {
        "qwen3_5_text": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM),
        "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM)}[family]
    config = config_class(**TINY_LINEAR, **extra)
    torch.manual_seed(0)
    model = TransformersCausalLM.wrap(model_class(config).eval())
    shapes = linear_attention_state_shapes(config, model.dtype)
    assert shapes == model.recurrent_state_shapes
    rows = 3
    cache = KVCache.for_model(model, rows, 16, dtype=cache_dtype)
    allocated = sum(tensor.nbytes for tensor in cache.recurrent.tensors.values())
    assert allocated == rows * row_bytes(shapes, cache_dtype)
    # by hand, per linear layer: the convolution's 2 × 32 + 64 channels × 4 inputs in the cache's dtype, and a
    # 4 × 16 × 16 state matrix in float32; two such layers
    assert row_bytes(shapes, cache_dtype) == 2 * (128 * 4 * cache_dtype.itemsize + 4 * 16 * 16 * 4)


# Qwen3-Next-80B-A3B's attention and Gated DeltaNet geometry (config.json; 3 linear layers to 1 full), its
# weights counted as a dense model of that width: what matters here is one shape counted with and without states
QWEN3_NEXT = ModelConfig(model_type="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=5120,
                         num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2, head_dim=256)


def qwen3_next_state_bytes(element_bytes: int) -> int:
    import transformers

    from cohort_grpo.models.recurrent_state import row_bytes

    dtype = {2: torch.bfloat16, 4: torch.float32}[element_bytes]
    config = transformers.Qwen3NextConfig(
        hidden_size=2048, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, layer_types=["linear_attention"] * 3 * 12 + ["full_attention"] * 12)
    return row_bytes(linear_attention_state_shapes(config, dtype), dtype)


def test_a_model_with_recurrent_states_gets_fewer_slots_than_counted_without(card):
    """Each slot of a hybrid model holds its sequence's recurrent states too (36 Gated DeltaNet layers: 72 MiB a
    sequence), so the same card keeps fewer slots: on a sampling rank exactly the widest width whose keys, values
    and states fit beside the weights, and on a rank that also trains fewer than its plan allowed without them."""
    from cohort_grpo.plans.training_slots import training_rank_slots

    states = qwen3_next_state_bytes(2)
    # per layer: 2 × 16 × 128 + 32 × 128 = 8,192 channels × 4 inputs × 2 bytes, and 32 × 128 × 128 × 4 bytes
    assert states == 36 * (8192 * 4 * 2 + 32 * 128 * 128 * 4)
    cuda = torch.device("cuda", 0)
    card.gib = 100
    args = GRPOConfig(per_device_train_batch_size=32, gradient_accumulation_steps=4, num_generations=8,
                      max_prompt_length=128, max_completion_length=4096, async_rollouts=True, rollout_gpus=1,
                      partial_rollouts=True).validate()
    two = placed(args, 2)  # one trainer, one sampling rank
    weights = parameter_count(QWEN3_NEXT) * 2
    slot = kv_cache_bytes(QWEN3_NEXT, rows=1, max_len=4224, element_bytes=2)
    free = 0.85 * 100 * GIB - weights
    without = sampling_plan(args, two, QWEN3_NEXT, cuda, 2, sampling_rank=True)
    hybrid = sampling_plan(args, two, QWEN3_NEXT, cuda, 2, sampling_rank=True, state_bytes=states)
    assert without.slots == widest(free / GIB, slot / GIB) == 192
    assert hybrid.slots == widest(free / GIB, (slot + states) / GIB) == 128
    assert weights + hybrid.slots * (slot + states) <= 0.85 * 100 * GIB
    one_gpu = GRPOConfig(per_device_train_batch_size=16, gradient_accumulation_steps=16, num_generations=8,
                         max_prompt_length=512, max_completion_length=4096).validate()
    card.gib = 141
    trained_without = training_rank_slots(one_gpu, placed(one_gpu, 1), QWEN3_NEXT, cuda)
    trained_hybrid = training_rank_slots(one_gpu, placed(one_gpu, 1), QWEN3_NEXT, cuda, state_bytes=states)
    assert trained_hybrid < trained_without
