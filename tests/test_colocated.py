"""The colocated placement (`--fsdp`, no `--rollout_gpus`, `rollout_tensor_parallel_size` T > 1): FSDP2 training
ranks sample in groups of T consecutive ranks, one engine call per group (cohort_grpo/rollout/colocated.py,
cohort_grpo/parallel/colocation.py). What runs in one process: the groups, how a group's requests become engine calls and
how a rank's block is cut from a merged call, and the settings refused in one line. Real ranks training exactly
what one process trains, and resuming: tests/test_distributed.py."""

import pytest
import torch

from cohort_grpo import GRPOConfig
from cohort_grpo.errors import CohortError
from cohort_grpo.models import CausalLM, ModelConfig
from cohort_grpo.models.lora import apply_lora, lora_config_from_args
from cohort_grpo.run.resolve import resolve_run_config
from cohort_grpo.rollout.colocated import blocks_of_one_batch
from cohort_grpo.rollout.sampler import SamplingParams
from cohort_grpo.parallel.colocation import SamplingGroup
from cohort_grpo.parallel.placement import Placement

CPU = torch.device("cpu")


def small_model(heads: int = 4, kv_heads: int = 2) -> CausalLM:
    torch.manual_seed(0)
    return CausalLM(ModelConfig(model_type="llama", vocab_size=40, hidden_size=32, intermediate_size=64,
                                num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                head_dim=8))


def colocated_args(**options) -> GRPOConfig:
    return GRPOConfig(**{"fsdp": True, "rollout_tensor_parallel_size": 2, **options})


def test_groups_are_consecutive_ranks_and_a_group_evaluates_one_block_of_rows():
    six = Placement.from_config(colocated_args(rollout_tensor_parallel_size=3).validate(), 6)
    assert [six.group_ranks(g) for g in range(six.groups)] == [[0, 1, 2], [3, 4, 5]]
    assert Placement.from_config(colocated_args().validate(), 2).group_ranks(0) == [0, 1]
    second = SamplingGroup(ranks=(2, 3), index=1, count=2, process_group=None)
    assert second.leader == 2 and second.block(list(range(5))) == [3, 4]  # blocks of 3 and 2 rows


def test_requests_are_blocks_of_one_batch_only_with_the_same_settings_and_consecutive_offsets():
    params = SamplingParams(max_new_tokens=8, seed=5)
    first, second = [[1, 2], [3]], [[4], [5, 6]]

    def request(prompts, offset, **changes):
        return prompts, 4, SamplingParams(**{**params.__dict__, "sequence_offset": offset, **changes})

    assert blocks_of_one_batch([request(first, 8), request(second, 16)])  # 2 prompts × 4 completions after 8
    assert not blocks_of_one_batch([request(first, 8), request(second, 20)])  # a gap in the batch
    assert not blocks_of_one_batch([request(first, 8), request(second, 16, seed=6)])  # another seed
    assert not blocks_of_one_batch([request(first, 8), request(second, 16, temperature=0.0)])
    assert not blocks_of_one_batch([request(first, 8), request([], 16)])  # a rank with nothing to sample


def test_a_ranks_block_of_one_engine_call_is_what_its_own_call_samples():
    """The group's one call over both ranks' prompts, cut to rank 1's rows, against rank 1's own call."""
    from cohort_grpo.rollout import Engine

    engine = Engine(small_model(), max_batch_size=64)
    mine, theirs = [[3, 4, 5], [6, 7]], [[8, 9, 10, 11], [12]]
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=11, eos_token_ids=[2], pad_token_id=0)
    merged = engine.generate(theirs + mine, 3, params)
    alone = engine.generate(mine, 3, SamplingParams(**{**params.__dict__, "sequence_offset": 6}))
    part = merged.rows(6, 12)
    assert torch.equal(part.completion_ids, alone.completion_ids)
    assert torch.equal(part.completion_mask, alone.completion_mask)
    assert torch.allclose(part.logprobs, alone.logprobs, atol=1e-5)
    assert part.finish_reasons == alone.finish_reasons
    assert not torch.equal(merged.rows(0, 6).completion_ids[:, :2], part.completion_ids[:, :2])


def test_settings_the_colocated_placement_cannot_run_are_refused_in_one_line():
    with pytest.raises(CohortError, match=r"rollout_tensor_parallel_size=2 without rollout_gpus .* needs (--fsdp|fsdp=True)"):
        GRPOConfig(rollout_tensor_parallel_size=2).validate()
    with pytest.raises(CohortError, match=r"async_rollouts with rollout_tensor_parallel_size=2 on the training "
                                          r"ranks .* 1 update behind; pass (--max_staleness 1|max_staleness=1)"):
        colocated_args(async_rollouts=True, max_staleness=2).validate()
    colocated_args(async_rollouts=True, max_staleness=1).validate()
    assert colocated_args(async_rollouts=True).validate().max_staleness is None  # settled to 1 when the run resolves
    def resolve(model, args=None, world_size=2, tools=False):
        args = (args or colocated_args()).validate()
        return resolve_run_config(args, model=model, device=CPU, placement=Placement.from_config(args, world_size),
                                  tools=tools)

    assert resolve(small_model()).rollout_tensor_parallel_size == 2
    with pytest.raises(CohortError, match=r"rollout_tensor_parallel_size=2 does not divide the 3 training rank\(s\)"):
        resolve(small_model(), world_size=3)
    with pytest.raises(CohortError, match=r"rollout_tensor_parallel_size[= ]4 does not divide the model's 2 KV heads"):
        resolve(small_model(), colocated_args(rollout_tensor_parallel_size=4), world_size=4)
    with pytest.raises(CohortError, match="rollout_tensor_parallel_size=2 with tools is not supported"):
        resolve(small_model(), tools=True)
    lora = small_model()
    apply_lora(lora, lora_config_from_args(GRPOConfig(use_peft=True, lora_r=2, lora_target_modules=["q_proj"])))
    with pytest.raises(CohortError, match="rollout_tensor_parallel_size=2 with LoRA adapters is not supported"):
        resolve(lora)
    hugging_face = torch.nn.Linear(2, 2)
    with pytest.raises(CohortError, match="rollout_tensor_parallel_size=2 needs a model cohort implements itself"):
        resolve(hugging_face)
