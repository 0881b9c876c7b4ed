"""Partial rollouts: the engine stops a call once enough has finished and hands back the rest as they stand
(`Engine.generate_until`); the pool continues them in later calls and delivers the groups that complete,
oldest first, never staler than max_staleness (cohort_grpo/rollout/partial.py)."""

import pytest
import torch
import transformers

from cohort_grpo.errors import CohortError
from cohort_grpo.models import from_pretrained
from cohort_grpo.rollout import Engine
from cohort_grpo.rollout.sampler import SamplingParams
from helpers import ENGINE_FAMILIES, ENGINE_TINY

torch.set_num_threads(1)

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13], [42], [5, 6], [30, 31, 32]]
EOS = [3, 17, 29, 101, 150, 201, 250]  # a few ids: lengths then vary from sequence to sequence


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    config_class, model_class, extra = ENGINE_FAMILIES["qwen2"]
    torch.manual_seed(3)
    folder = tmp_path_factory.mktemp("partial_qwen2")
    model_class(config_class(**ENGINE_TINY, **extra)).eval().save_pretrained(folder)
    return from_pretrained(folder)


def params(**kwargs):
    return SamplingParams(max_new_tokens=40, temperature=1.0, eos_token_ids=EOS, seed=11, **kwargs)


def engine(model, **kwargs):
    return Engine(model, max_batch_size=4, check_interval=2, **kwargs)


def test_without_a_stop_it_samples_what_generate_samples(model):
    full = engine(model).generate(PROMPTS, 1, params())
    sequences = engine(model).generate_until(PROMPTS, [40] * len(PROMPTS), params(), enough=lambda done: False)
    for row, seq in enumerate(sequences):
        count = int(full.completion_mask[row].sum())
        assert seq.tokens.tolist() == full.completion_ids[row, :count].tolist()
        assert torch.allclose(seq.logprobs, full.logprobs[row, :count], atol=1e-6)
        assert seq.finish_reason == full.finish_reasons[row]


@pytest.mark.parametrize("overlap", [True, False])
def test_a_stop_pauses_the_rest_with_the_prefix_of_their_tokens(model, overlap):
    full = engine(model, overlap_checks=overlap).generate(PROMPTS, 1, params())
    lengths = full.completion_mask.sum(dim=1).tolist()
    assert len(set(lengths)) > 2 and max(lengths) == 40  # the lengths vary; some run to the limit
    calls = []

    def enough(done):
        calls.append(len(done))
        return len(done) >= 2

    sequences = engine(model, overlap_checks=overlap).generate_until(PROMPTS, [40] * len(PROMPTS), params(), enough)
    finished = [seq for seq in sequences if seq.finish_reason is not None]
    paused = [seq for seq in sequences if seq.finish_reason is None]
    assert len(finished) >= 2 and paused and calls[-1] >= 2 and all(n < 2 for n in calls[:-1])
    for seq in sequences:
        row = seq.index
        expected = full.completion_ids[row, : lengths[row]].tolist()
        if seq.finish_reason is None:  # a strict prefix: it would have gone on
            assert len(seq.tokens) < lengths[row] and seq.tokens.tolist() == expected[: len(seq.tokens)]
        else:
            assert seq.tokens.tolist() == expected and seq.finish_reason == full.finish_reasons[row]


def test_a_continuation_records_the_log_probs_of_the_model_given_prompt_and_earlier_tokens(model):
    earlier = [[50, 60, 70], [], [9, 9]]
    prompts = [p + e for p, e in zip(PROMPTS[:3], earlier)]
    limits = [40 - len(e) for e in earlier]
    sequences = engine(model).generate_until(prompts, limits, params(), enough=lambda done: False)
    for prompt, limit, seq in zip(prompts, limits, sequences):
        assert 0 < len(seq.tokens) <= limit
        ids = torch.tensor([prompt + seq.tokens.tolist()])
        with torch.no_grad():
            logits = model(ids, torch.arange(ids.shape[1])[None])[0, len(prompt) - 1: -1].float()
        expected = torch.log_softmax(logits, dim=-1).gather(1, seq.tokens[:, None])[:, 0]
        assert torch.allclose(seq.logprobs, expected, atol=1e-4)


def test_limits_must_match_the_prompts(model):
    for limits in ([4], [4] * 5 + [0], [4] * 5 + [41]):  # one per prompt, each within max_new_tokens (40)
        with pytest.raises(CohortError, match="one limit per prompt, from 1 to max_new_tokens=40"):
            engine(model).generate_until(PROMPTS, limits, params(), enough=lambda done: False)


# ---- the pool ------------------------------------------------------------------------------------------
from cohort_grpo.rollout.partial import GroupPool, PartialRollouts  # noqa: E402


def pool_with(*groups):
    """groups: (version, complete) pairs, added in order (serials 0, 1, ...)."""
    pool = GroupPool()
    for version, complete in groups:
        pool.add([{"prompt": "x"}], [[1]], version, 2)
        group = pool.groups[-1]
        group.tokens, group.logprobs = [[5], [6]], [[-1.0], [-1.0]]
        group.finish_reasons = ["stop", "length"] if complete else ["stop", None]
    return pool


def test_the_oldest_complete_groups_go_first_and_too_stale_ones_are_dropped():
    pool = pool_with((3, True), (1, False), (4, True), (2, True), (4, True))
    done, dropped = pool.deliver(step=4, count=2, max_staleness=2)
    assert [g.serial for g in done] == [3, 0]  # version 2 before 3; among equals, the first in
    assert dropped == 1 and [g.serial for g in pool.groups] == [2, 4]  # serial 1 (version 1) cannot wait for step 5
    assert GroupPool.from_state(pool.state_dict()) == pool


def test_a_call_may_stop_only_when_the_groups_that_cannot_wait_are_complete():
    pool = pool_with((1, False), (2, True), (2, True))
    assert not pool.ready({1, 2}, step=3, count=2, max_staleness=1)  # serial 0 is 2 versions old at step 4
    assert pool.ready({0, 1}, step=3, count=2, max_staleness=1)
    assert pool.ready({1, 2}, step=3, count=2, max_staleness=2)
    assert not pool.ready({1}, step=3, count=2, max_staleness=2)


class FakeGroupSampler:
    """What PartialRollouts needs of a GroupSampler: prompts are token lists already."""

    def encode_prompt(self, prompt):
        return list(prompt)

    def sampling_params(self, seed, sequence_offset=0):
        return SamplingParams(max_new_tokens=40, temperature=1.0, eos_token_ids=EOS, seed=seed)

    def decode(self, rows, rollout):
        return [str(ids[m.bool()].tolist()) for ids, m in zip(rollout.completion_ids, rollout.completion_mask)]


def model_logprobs(model, prompt, tokens):
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids, torch.arange(ids.shape[1])[None])[0, len(prompt) - 1: -1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def test_steps_get_complete_groups_within_max_staleness_and_carried_tokens_keep_their_log_probs(model):
    G, per_step, staleness = 3, 2, 2
    partial = PartialRollouts(engine(model), FakeGroupSampler(), G, per_step, staleness, pad_id=0)
    pools = [GroupPool(), GroupPool()]  # two trainers served by one sampling rank
    prompts = iter([[i % 250 + 1, (7 * i) % 250 + 1, 3 + i % 5] for i in range(200)])
    carried = delivered = 0
    for step in range(1, 9):
        batches = 2 if step == 1 else 1  # the first request brings a second batch (over-sampling)
        new_rows = [[{"prompt": next(prompts)} for _ in range(per_step * batches)] for _ in pools]
        version = max(0, step - 2)  # requests go out 1 update ahead
        results = partial(pools, new_rows, step, version, seed=100 + step)
        for batch, oldest, dropped in results:
            assert dropped == 0 and len(batch.rows) == per_step * G
            assert step - 1 - oldest <= staleness
            assert all(reason is not None for reason in batch.rollout.finish_reasons)
            carried += batch.rollout_metrics["async/carried_groups"] * per_step
            delivered += per_step
            for row in range(len(batch.rows)):
                count = int(batch.rollout.completion_mask[row].sum())
                tokens = batch.rollout.completion_ids[row, :count].tolist()
                expected = model_logprobs(model, batch.prompt_ids[row], tokens)  # one set of weights here
                assert torch.allclose(batch.rollout.logprobs[row, :count], expected, atol=1e-4)
        assert all(len(pool.groups) <= per_step * 2 for pool in pools)
    assert delivered == 32 and carried > 0  # some groups were continued in a later call


def test_partial_rollouts_are_on_by_default_wherever_they_can_run():
    from cohort_grpo.config.grpo_config import GRPOConfig
    from cohort_grpo.rollout.partial import partial_rollout_settings

    engine_like, hf_like = True, False

    def resolved(engine=engine_like, toolbox=None, **options):
        args = GRPOConfig(async_rollouts=True, **options).validate()
        settings = partial_rollout_settings(args, engine=engine, tools=toolbox is not None)
        return settings["partial_rollouts"], settings["max_staleness"]

    assert resolved(rollout_gpus=2) == (True, 2)  # sampling ranks, our engine: on, 2 updates
    assert resolved(rollout_gpus=2, max_staleness=3) == (True, 3)
    assert resolved(rollout_gpus=2, max_staleness=1) == (False, 1)  # a bound they cannot keep: off
    assert resolved() == (False, 1)  # one process
    assert resolved(hf_like, rollout_gpus=2) == (False, 1)  # a sampler that cannot pause a call
    assert resolved(toolbox=object(), rollout_gpus=2) == (False, 1)
    assert resolved(rollout_gpus=2, partial_rollouts=False) == (False, 1)
    with pytest.raises(CohortError, match="partial_rollouts needs cohort's engine"):  # asked for: refused
        resolved(hf_like, rollout_gpus=2, partial_rollouts=True)
    with pytest.raises(CohortError, match="partial_rollouts with tools is not supported"):
        resolved(toolbox=object(), rollout_gpus=2, partial_rollouts=True)
    with pytest.raises(CohortError, match="partial_rollouts='sometimes' is not one of its values"):
        GRPOConfig(partial_rollouts="sometimes").validate()
