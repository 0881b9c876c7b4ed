"""The rollout source (cohort_grpo/rollout/source.py): the one object a trainer takes each step's rollout from.

Checked in one process, without a model: `SampleNow` samples the rows the prompt stream draws, with its seed, when
the step takes them, and times no weight refresh where there is no engine copy; `SampledAhead` over a real
`AsyncRollouts` samples step t from the weights after update t − 1 − L, against the values the test set itself
(update u sets the weight to u), starts nothing beyond the last step, and its checkpoint state hands a fresh
source the very rollouts it had sampled ahead."""

from contextlib import contextmanager

import pytest
import torch

from cohort_grpo.parallel.distributed import Parallel
from cohort_grpo.rollout.async_rollouts import AsyncRollouts
from cohort_grpo.rollout.batch import Batch
from cohort_grpo.rollout.sampler import Rollout
from cohort_grpo.rollout.source import SampledAhead, SampleNow


class Phases:
    def __init__(self):
        self.entered = []

    @contextmanager
    def phase(self, name):
        self.entered.append(name)
        yield


class Memory:
    def __init__(self):
        self.calls = []

    def before_sampling(self):
        self.calls.append("before")

    def after_sampling(self):
        self.calls.append("after")


class Prompts:
    """Numbered rows and seeds, so a batch says which draw made it."""

    def __init__(self):
        self.rows_drawn = self.seeds_drawn = 0

    def next_rows(self):
        self.rows_drawn += 1
        return [{"prompt": f"rows {self.rows_drawn}"}]

    def next_seed(self):
        self.seeds_drawn += 1
        return 100 + self.seeds_drawn


def batch_of(rows, value, seed, offset):
    ids = torch.full((len(rows), 2), seed)
    return Batch(rows=rows, prompt_ids=[[1]] * len(rows), completions=["x"] * len(rows),
                 rollout=Rollout(ids, torch.ones_like(ids), torch.full((len(rows), 2), value), ["stop"] * len(rows)),
                 rollout_metrics={"offset": offset})


def source_now(prompts, sample, phases=None, memory=None):
    return SampleNow(sample, memory=memory or Memory(), phases=phases or Phases(), next_rows=prompts.next_rows,
                     next_seed=prompts.next_seed, sequence_offset=8)


def test_sample_now_draws_the_rows_then_the_seed_when_the_step_takes_them():
    prompts, phases, memory = Prompts(), Phases(), Memory()
    seen = []

    def sample(rows, seed, sequence_offset):
        seen.append((rows[0]["prompt"], seed, sequence_offset, list(memory.calls)))
        return batch_of(rows, 0.0, seed, sequence_offset)

    now = source_now(prompts, sample, phases, memory)
    now.take(1)
    now.after_update(torch.nn.Linear(1, 1))  # no engine copy: nothing to refresh, no "gather" phase
    now.take(2)
    assert seen == [("rows 1", 101, 8, ["before"]), ("rows 2", 102, 8, ["before", "after", "before"])]
    assert phases.entered == ["sampling", "sampling"] and now.state_dict() is None


def linear(value: float) -> torch.nn.Module:
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(value)
    return model


def ahead_source(policy, staleness, max_steps, prompts, past_end=True):
    producer = linear(-1.0)  # the producer's copy: each rollout loads its version's weights into it

    def sample(rows, seed, sequence_offset):
        return batch_of(rows, float(producer.weight.detach()), seed, sequence_offset)

    now = source_now(prompts, lambda rows, seed, sequence_offset: None)
    return SampledAhead(AsyncRollouts(producer, sample, staleness), now, policy=policy, parallel=Parallel(),
                        max_steps=max_steps, past_end=past_end)


@pytest.mark.parametrize("past_end", [False, True])
def test_step_t_samples_the_weights_after_update_t_minus_1_minus_l_and_past_the_last_step_only_when_asked(past_end):
    """Step t's rollout is sampled from the weights after update t − 1 − L; past the last step, with `past_end`, the
    L rollouts a longer run would start before its last update (kept by the last checkpoint), else none."""
    for staleness in (1, 2):
        policy, prompts = linear(0.0), Prompts()
        source = ahead_source(policy, staleness, max_steps=5, prompts=prompts, past_end=past_end)
        sampled, stale = {}, {}
        for step in range(1, 6):
            batch = source.take(step)
            sampled[step], stale[step] = float(batch.rollout.logprobs[0, 0]), batch.rollout_metrics["async/staleness"]
            with torch.no_grad():
                policy.weight.fill_(float(step))  # update `step`: the weights the test can tell apart
            source.after_update(policy)
        assert sampled == {t: float(max(0, t - 1 - staleness)) for t in range(1, 6)}
        assert stale == {t: float(min(t - 1, staleness)) for t in range(1, 6)}
        beyond = {t: t - 1 - staleness for t in range(6, 6 + staleness)} if past_end else {}
        assert {t: version for t, (_, version) in source.ahead.pending.items()} == beyond
        assert prompts.rows_drawn == prompts.seeds_drawn == 5 + len(beyond)
        source.close()


def test_a_checkpoint_of_the_rollouts_sampled_ahead_gives_a_fresh_source_the_same_rollouts():
    policy, prompts = linear(0.0), Prompts()
    source = ahead_source(policy, 2, max_steps=6, prompts=prompts)
    source.take(1)
    with torch.no_grad():
        policy.weight.fill_(1.0)
    source.after_update(policy)
    saved = source.state_dict()  # steps 2, 3 (version 0) and 4 (version 1), one rank
    assert [item["step"] for item in saved["async_rollouts"][0]["pending"]] == [2, 3, 4]
    resumed = ahead_source(linear(5.0), 2, max_steps=6, prompts=Prompts())
    resumed.load_state_dict(saved)
    for step, version in ((2, 0), (3, 0), (4, 1)):
        mine, theirs = source.take(step), resumed.take(step)
        assert mine.rows == theirs.rows and torch.equal(mine.rollout.completion_ids, theirs.rollout.completion_ids)
        assert float(theirs.rollout.logprobs[0, 0]) == version
        assert theirs.rollout_metrics["async/staleness"] == step - 1 - version
    source.close()
    resumed.close()
