"""rollout_tensor_parallel_size=auto (cohort/memory/sampling_plan.py): the smallest sampling group whose share
of the weights and of a step's KV cache fits the card."""

from types import SimpleNamespace

import pytest
import torch

from cohort import GRPOConfig
from cohort.errors import CohortError
from cohort.memory import sampling_plan
from cohort.memory.sampling_plan import kv_cache_bytes, parameter_count, sampling_tensor_parallel_size
from cohort.models import CausalLM, ModelConfig

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


@pytest.fixture
def card(monkeypatch):
    """A GPU of `card.gib` GiB as far as the plan can tell, and 8 ranks of which the last 4 sample."""
    state = SimpleNamespace(gib=80)
    monkeypatch.setattr(sampling_plan.torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(total_memory=state.gib * GIB))
    monkeypatch.setenv("WORLD_SIZE", "8")
    return state


def test_auto_takes_the_smallest_group_that_fits(card):
    cuda = torch.device("cuda", 0)
    args = run_args()
    assert args.prompts_per_step == 8
    # 4 trainers of 8 prompts × 8 completions of up to 4,608 tokens. T ranks a group: 4 / T groups, each
    # serving T trainers' 64 completions: 51.0 GiB a rank alone (15 GiB of weights), 43.5 in pairs, 39.7 in fours.
    per_rank = {t: sampling_plan.rank_bytes(LLAMA_8B, t, 64 * t, 4608, 2) / GIB for t in (1, 2, 4)}
    assert [round(per_rank[t], 1) for t in (1, 2, 4)] == [51.0, 43.5, 39.7]
    assert sampling_tensor_parallel_size(args, LLAMA_8B, cuda, 2) == 1  # 51.0 ≤ 85% of 80
    card.gib = 55  # 46.75 GiB usable
    assert sampling_tensor_parallel_size(args, LLAMA_8B, cuda, 2) == 2
    card.gib = 40  # 34 GiB usable: not even 4 ranks a group
    with pytest.raises(CohortError, match=r"auto: the model's weights and the KV cache of a step's batch need "
                                          r"39.7 GiB per rank even split over 4 sampling rank\(s\), more than 85% "
                                          r"of a 40 GiB GPU; add sampling ranks"):
        sampling_tensor_parallel_size(args, LLAMA_8B, cuda, 2)


def test_auto_is_one_where_a_split_cannot_apply(card):
    card.gib = 8  # far too small: only the cases below keep it from a refusal
    args = run_args()
    assert sampling_tensor_parallel_size(args, LLAMA_8B, torch.device("cpu"), 4) == 1
    assert sampling_tensor_parallel_size(args, None, torch.device("cuda", 0), 2) == 1  # Hugging Face generate
    assert sampling_tensor_parallel_size(args, LLAMA_8B, torch.device("cuda", 0), 2, splittable=False) == 1
    assert sampling_tensor_parallel_size(run_args(rollout_gpus=0, async_rollouts=False), LLAMA_8B,
                                         torch.device("cuda", 0), 2) == 1
    assert sampling_tensor_parallel_size(run_args(rollout_tensor_parallel_size=4), LLAMA_8B,
                                         torch.device("cuda", 0), 2) == 4  # asked for: kept


def test_the_cpu_run_settles_auto_to_one():
    from cohort.resolve import resolve_run_config

    config = ModelConfig(model_type="llama", vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    resolved = resolve_run_config(GRPOConfig(), model=CausalLM(config), device=torch.device("cpu"))
    assert GRPOConfig().rollout_tensor_parallel_size == "auto" and resolved.rollout_tensor_parallel_size == 1


def test_auto_on_fsdp_ranks_that_sample_themselves_counts_their_training_shard(card):
    """The colocated placement (--fsdp, no sampling ranks): T divides the 2 training ranks; a group samples its T
    ranks' 64 completions each, beside each rank's shard of the fp32 weights and AdamW moments (12 bytes a weight
    over 2 ranks: 44.9 GiB at 8B)."""
    cuda = torch.device("cuda", 0)
    args = run_args(rollout_gpus=0, async_rollouts=False, fsdp=True)
    training = parameter_count(LLAMA_8B) * 12 / 2 / GIB
    per_rank = {t: sampling_plan.rank_bytes(LLAMA_8B, t, 64 * t, 4608, 2) / GIB + training for t in (1, 2)}
    assert [round(per_rank[t], 1) for t in (1, 2)] == [95.8, 88.4]
    card.gib = 141  # 119.85 GiB usable: each rank samples its own completions on a whole copy
    assert sampling_tensor_parallel_size(args, LLAMA_8B, cuda, 2, world_size=2) == 1
    card.gib = 110  # 93.5 GiB usable: the two ranks sample as one group
    assert sampling_tensor_parallel_size(args, LLAMA_8B, cuda, 2, world_size=2) == 2
    card.gib = 80
    with pytest.raises(CohortError, match=r"need 88.4 GiB per rank even split over 2 training rank\(s\), more than "
                                          r"85% of a 80 GiB GPU; add GPUs \(--nproc_per_node\)"):
        sampling_tensor_parallel_size(args, LLAMA_8B, cuda, 2, world_size=2)
    assert sampling_tensor_parallel_size(args, LLAMA_8B, cuda, 2, world_size=1) == 1  # one process: nothing to split
    assert sampling_tensor_parallel_size(run_args(rollout_gpus=0, async_rollouts=False), LLAMA_8B, cuda, 2,
                                         world_size=2) == 1  # DDP: every rank holds the whole model anyway
