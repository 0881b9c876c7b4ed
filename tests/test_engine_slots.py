"""An engine with fewer slots than a call's sequences (`max_concurrent_sequences`): the others wait for a slot
and are sampled the same, since each sequence's noise is keyed by its index and token, not by its slot.

Checked against the same call with a slot for every sequence: shared prompts (the G completions of a prompt
split over several admissions), partial rollouts (a call stopped early) and multi-turn rollouts; and the run's
resolved cap reaching the engines a trainer or a sampling rank builds."""

import re

import pytest
import torch

from cohort_grpo import GRPOConfig
from cohort_grpo.errors import CohortError
from cohort_grpo.models import CausalLM, ModelConfig
from cohort_grpo.run.resolve import resolve_run_config
from cohort_grpo.rollout import Engine
from cohort_grpo.rollout.sampler import SamplingParams
from cohort_grpo.parallel.placement import Placement
from cohort_grpo.plans.placement_lines import placement_line, slots_line
from cohort_grpo.rollout.setup import capped

torch.set_num_threads(1)

# Three prompts twice over (a prompt's rows are shared within an admission) and two of their own.
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [1, 2, 3, 4, 5], [10, 11, 12, 13], [7, 8, 9], [20]]
G = 4
EOS = [3, 17, 29, 41]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return CausalLM(ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8))


def sampled(**options):
    return SamplingParams(**{"max_new_tokens": 20, "temperature": 1.0, "eos_token_ids": EOS, "seed": 5, **options})


def assert_same(capped_rollout, free):
    assert torch.equal(capped_rollout.completion_ids, free.completion_ids)
    assert torch.equal(capped_rollout.completion_mask, free.completion_mask)
    assert capped_rollout.finish_reasons == free.finish_reasons
    assert torch.allclose(capped_rollout.logprobs, free.logprobs, atol=1e-5)


@pytest.mark.parametrize("bucketed", [False, True])
def test_a_cap_samples_what_a_slot_for_every_sequence_samples(model, bucketed):
    free_engine = Engine(model, max_batch_size=64, check_interval=2)
    free = free_engine.generate(PROMPTS, G, sampled())
    lengths = free.completion_mask.sum(1)
    assert len(set(lengths.tolist())) > 3 and int(lengths.max()) == 20  # EOS frees slots at different steps
    # The free call prefills each distinct prompt once, for all its 8 or 4 rows.
    assert free_engine.stats["prefill_shared_rows"] == len(PROMPTS) * G - 4
    for cap in (1, 3, 4, 6, 10):  # 3, 6, 10: a group's G rows split over admissions
        engine = Engine(model, max_batch_size=cap, check_interval=2)
        engine.bucketed = bucketed  # widths padded to CUDA-graph buckets and rows compacted, as on a GPU
        assert_same(engine.generate(PROMPTS, G, sampled()), free)
        assert engine.cache.num_rows <= cap
        # Within an admission the rows of one prompt still share its prefill: the first admission holds the first
        # `cap` rows, of ceil(cap / G) prompts, or fewer distinct ones where prompts repeat.
        assert engine.stats["prefill_shared_rows"] >= cap - -(-cap // G)


def test_a_cap_stops_partial_rollouts_with_prefixes_of_the_full_completions(model):
    """`generate_until` under a cap: the finished sequences are whole, the running ones paused with a prefix of
    their tokens, and those never admitted come back empty, to be continued in a later call."""
    prompts = [p for p in PROMPTS for _ in range(2)]
    full = Engine(model, max_batch_size=64, check_interval=2).generate(prompts, 1, sampled())
    lengths = full.completion_mask.sum(1).tolist()
    sequences = Engine(model, max_batch_size=3, check_interval=2).generate_until(
        prompts, [20] * len(prompts), sampled(), enough=lambda done: len(done) >= 4)
    finished = [seq for seq in sequences if seq.finish_reason is not None]
    waiting = [seq for seq in sequences if seq.finish_reason is None and len(seq.tokens) == 0]
    assert len(finished) >= 4 and waiting  # 3 slots: most of the 12 never got one
    for seq in sequences:
        whole = full.completion_ids[seq.index, : lengths[seq.index]].tolist()
        assert seq.tokens.tolist() == whole[: len(seq.tokens)]
        if seq.finish_reason is not None:
            assert len(seq.tokens) == lengths[seq.index] and seq.finish_reason == full.finish_reasons[seq.index]
            assert torch.allclose(seq.logprobs, full.logprobs[seq.index, : lengths[seq.index]], atol=1e-5)


class AppendOnce:
    """A tool turn: after a sequence's first turn ends, three tokens follow; then it goes on to its end."""

    def __init__(self):
        self.turns = {}

    def end_of_turn(self, index, completion, turn_start):
        self.turns[index] = self.turns.get(index, 0) + 1
        return [50, 51, 52] if self.turns[index] == 1 else None

    def close(self):
        pass


def test_a_cap_samples_multi_turn_rollouts_the_same(model):
    free = Engine(model, max_batch_size=64, check_interval=2).generate(PROMPTS, 2, sampled(), turns=AppendOnce())
    tool_rows = ((free.tool_mask == 0) & free.completion_mask.bool()).any(1)
    assert int(tool_rows.sum()) >= 3  # several rows had a tool turn
    for cap in (1, 5):
        rollout = Engine(model, max_batch_size=cap, check_interval=2).generate(PROMPTS, 2, sampled(), turns=AppendOnce())
        assert_same(rollout, free)
        assert torch.equal(rollout.tool_mask, free.tool_mask)


def test_the_resolved_cap_reaches_the_engines_a_run_builds(model):
    made = Engine(model, max_batch_size=256)
    assert capped(lambda m, t: made, 48)(model, None) is made and made.max_batch_size == 48
    fewer = Engine(model, max_batch_size=8)
    assert capped(lambda m, t: fewer, 48)(model, None).max_batch_size == 8  # an engine made with fewer keeps its own
    other = object()
    assert capped(lambda m, t: other, 48)(model, None) is other


def test_the_cpu_run_keeps_the_engines_most_and_an_integer_asked_for():
    tiny = CausalLM(ModelConfig(model_type="llama", vocab_size=97, hidden_size=64, intermediate_size=96,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16))
    assert resolve_run_config(GRPOConfig(), model=tiny, device=torch.device("cpu")).max_concurrent_sequences == 256
    assert resolve_run_config(GRPOConfig(max_concurrent_sequences=12), model=tiny,
                              device=torch.device("cpu")).max_concurrent_sequences == 12
    with pytest.raises(CohortError, match=r"max_concurrent_sequences[= ]0: give the most sequences"):
        GRPOConfig(max_concurrent_sequences=0).validate()


def test_the_step_log_says_how_many_sequences_decode_at_once():
    gpu = dict(device="cuda:0", rollout_tensor_parallel_size=1, per_device_train_batch_size=32,
               gradient_accumulation_steps=8, num_generations=8, max_prompt_length=128, max_completion_length=4096)

    def one(args):  # the line of one process's run
        return slots_line(args, Placement.from_config(args.validate(), 1))

    line = one(GRPOConfig(**gpu, max_concurrent_sequences=48))
    assert re.fullmatch(r"rollouts: the engine decodes at most 48 of a call's 256 sequences at once, the others wait "
                        r"for a slot \(max_concurrent_sequences; auto: as many KV caches of 4224 tokens as fit beside "
                        r"the weights and the training state in 85% of the GPU, at most 256, at a CUDA-graph width\)",
                        line)
    args = GRPOConfig(**gpu, max_concurrent_sequences=48)
    assert placement_line(args, Placement.from_config(args.validate(), 1), 1, torch.device("cuda")) == line
    assert one(GRPOConfig(**gpu, max_concurrent_sequences=256)) is None  # every sequence has a slot
    assert one(GRPOConfig(**{**gpu, "device": "cpu"}, max_concurrent_sequences=48)) is None
    # A sampling rank of a --rollout_gpus run says its own: 3 trainers' 64 rows, two batches in flight
    sampling = dict(gpu, per_device_train_batch_size=8, async_rollouts=True, rollout_gpus=1, partial_rollouts=True,
                    max_concurrent_sequences=192)
    four = Placement.from_config(GRPOConfig(**sampling).validate(), 4)
    assert slots_line(GRPOConfig(**sampling), four) is None  # a trainer's log leaves it to the sampling rank
    assert slots_line(GRPOConfig(**sampling), four, sampling_rank=True).startswith(
        "rollouts: the engine decodes at most 192 of a call's 384 sequences at once")
