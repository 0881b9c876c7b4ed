"""Multi-turn rollouts (cohort_grpo/rollout/turns.py): a sequence that ends a turn asks a handler what follows,
the handler's tokens are appended (tool_mask 0), and the model goes on from the exact ids so far.

Checked against independent computations: greedy multi-turn equals transformers' generate run turn by
turn; a sampled continuation equals a fresh single-turn call on the whole context under the turn's noise
key; a handler that answers late from other threads gives the same rollout as one that answers at once."""

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from cohort_grpo.models import from_pretrained
from cohort_grpo.rollout import Engine
from cohort_grpo.rollout.sampler import HFGenerateSampler, SamplingParams
from cohort_grpo.rollout.turns import TURN_NOISE_STRIDE
from helpers import ENGINE_FAMILIES, ENGINE_TINY

torch.set_num_threads(1)

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15], [42]]
TOOL_TOKENS = [30, 31, 32]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    config_class, model_class, extra = ENGINE_FAMILIES["llama"]
    torch.manual_seed(0)
    hf_model = model_class(config_class(**ENGINE_TINY, **extra)).eval()
    folder = tmp_path_factory.mktemp("llama_turns")
    hf_model.save_pretrained(folder)
    return hf_model, from_pretrained(folder)


@pytest.fixture(scope="module")
def eos(pair):
    """A token the model emits early in some rows but not others, used as the end of a turn."""
    _, model = pair
    rollout = Engine(model, max_batch_size=8).generate(PROMPTS, 1, SamplingParams(max_new_tokens=6, temperature=0.0))
    return int(rollout.completion_ids[0, 2])


@pytest.fixture(scope="module")
def sampled_eos(pair):
    """The 8 tokens the model samples most often (T = 1): as EOS ids they end many turns early."""
    _, model = pair
    rollout = Engine(model, max_batch_size=8).generate(PROMPTS, 4, SamplingParams(max_new_tokens=20, seed=1))
    return torch.bincount(rollout.completion_ids.flatten(), minlength=300).topk(8).indices.tolist()


class Appender:
    """Appends TOOL_TOKENS after each of the first `turns` turns; records what it was shown."""

    def __init__(self, turns=1, delay=None):
        self.turns, self.delay, self.seen, self.closed = turns, delay, [], False
        self.pool = ThreadPoolExecutor(4) if delay else None
        self.lock = threading.Lock()

    def answer(self, index, completion, turn_start):
        if self.delay:
            time.sleep(self.delay(index))
        with self.lock:
            self.seen.append((index, list(completion), turn_start))
        done_turns = sum(1 for i, _, _ in self.seen if i == index)
        return list(TOOL_TOKENS) if done_turns <= self.turns else None

    def end_of_turn(self, index, completion, turn_start):
        if self.pool is None:
            return self.answer(index, completion, turn_start)
        return self.pool.submit(self.answer, index, completion, turn_start)

    def close(self):
        self.closed = True


def params(eos, **kwargs):
    eos = eos if isinstance(eos, list) else [eos]
    return SamplingParams(**{"max_new_tokens": 24, "temperature": 0.0, "eos_token_ids": eos, **kwargs})


def rows_of(rollout):
    return [(ids[m.bool()].tolist(), t[m.bool()].tolist())
            for ids, m, t in zip(rollout.completion_ids, rollout.completion_mask, rollout.tool_mask)]


def test_greedy_multi_turn_equals_transformers_turn_by_turn(pair, eos):
    hf_model, model = pair
    handler = Appender(turns=2)
    rollout = Engine(model, max_batch_size=8, check_interval=3).generate(PROMPTS, 2, params(eos), turns=handler)
    assert handler.closed
    expected = HFGenerateSampler(hf_model).generate(PROMPTS, 2, params(eos), turns=Appender(turns=2))
    assert rows_of(rollout) == rows_of(expected)
    assert rollout.finish_reasons == expected.finish_reasons
    turned = 0
    for ids, sampled in rows_of(rollout):
        # every appended run sits right after an EOS the model sampled, and is masked out
        for start in [i for i in range(len(ids)) if sampled[i] == 0 and (i == 0 or sampled[i - 1] == 1)]:
            assert ids[start - 1] == eos and ids[start:start + 3] == TOOL_TOKENS[:len(ids) - start]
            turned += 1
    assert turned >= 2, "the chosen EOS must end some turns early, or nothing was tested"
    # the appended tokens have no sampling log-prob and are out of the loss mask
    assert torch.all(rollout.logprobs[rollout.tool_mask == 0] == 0)
    assert torch.equal(rollout.loss_mask, rollout.completion_mask * rollout.tool_mask)


def test_a_sampled_continuation_is_the_model_on_the_exact_ids_so_far(pair, sampled_eos):
    _, model = pair
    sampling = params(sampled_eos, temperature=1.0, seed=5, max_new_tokens=20)
    engine = Engine(model, max_batch_size=8, check_interval=4)
    rollout = engine.generate(PROMPTS, 2, sampling, turns=Appender(turns=1))
    checked = 0
    for row, (ids, sampled) in enumerate(rows_of(rollout)):
        if 0 not in sampled or sampled.index(0) + len(TOOL_TOKENS) >= len(ids):
            continue  # no second turn
        cut = sampled.index(0) + len(TOOL_TOKENS)  # the second turn starts after the appended tokens
        context = PROMPTS[row // 2] + ids[:cut]
        # the same row's turn 1: its noise key is its index + one turn stride
        alone = Engine(model, max_batch_size=1).generate(
            [context], 1, SamplingParams(max_new_tokens=20 - cut, temperature=1.0, seed=5, eos_token_ids=sampled_eos,
                                         sequence_offset=row + TURN_NOISE_STRIDE))
        second = alone.completion_ids[0][alone.completion_mask[0].bool()].tolist()
        assert ids[cut:] == second[:len(ids) - cut]
        assert torch.allclose(rollout.logprobs[row, cut:len(ids)], alone.logprobs[0, :len(ids) - cut], atol=1e-5)
        checked += 1
    assert checked >= 2


def test_late_answers_from_other_threads_change_nothing(pair, sampled_eos):
    _, model = pair
    sampling = params(sampled_eos, temperature=1.0, seed=9, max_new_tokens=20)
    at_once = Engine(model, max_batch_size=3, check_interval=2).generate(PROMPTS, 2, sampling, turns=Appender(turns=2))
    rng = random.Random(0)
    delays = {i: rng.uniform(0.0, 0.05) for i in range(8)}
    late = Engine(model, max_batch_size=3, check_interval=2).generate(
        PROMPTS, 2, sampling, turns=Appender(turns=2, delay=lambda i: delays[i]))
    assert rows_of(late) == rows_of(at_once)
    assert sum(0 in sampled for _, sampled in rows_of(late)) >= 3  # several rows had a tool turn
    assert torch.allclose(late.logprobs, at_once.logprobs, atol=1e-5)


def test_appended_tokens_count_toward_the_budget(pair, eos):
    _, model = pair
    rollout = Engine(model, max_batch_size=8).generate(PROMPTS, 1, params(eos, max_new_tokens=4),
                                                       turns=Appender(turns=5))
    assert rollout.completion_mask.sum(dim=1).max().item() <= 4
    for (ids, sampled), reason in zip(rows_of(rollout), rollout.finish_reasons):
        assert len(ids) <= 4
        if len(ids) == 4:
            assert reason == "length"


def test_handler_shown_the_turn_it_ended(pair, eos):
    _, model = pair
    handler = Appender(turns=1)
    Engine(model, max_batch_size=8).generate(PROMPTS, 1, params(eos), turns=handler)
    for index, completion, turn_start in handler.seen:
        assert completion[-1] == eos  # the turn ended with the model's EOS
        if turn_start:
            assert completion[turn_start - len(TOOL_TOKENS):turn_start] == TOOL_TOKENS
