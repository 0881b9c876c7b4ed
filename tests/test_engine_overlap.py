"""Overlapped checks in the engine (cohort_grpo/rollout/overlap.py): the next decode chunk is enqueued
before the host waits for the last one's progress. That changes when the host learns things, never
what is sampled.

Every rollout is compared with the same engine built with `overlap_checks=False` (wait, then launch:
the engine's original order). Tokens, masks, finish reasons and row order must be identical in
every case. Log-probs must be bit-identical where both runs decode the same batches: when sequences
end only at their length limit (the host's bounds are then exact, so both runs decide alike, which
is checked step by step). When rows stop early (EOS, stop string) the overlapped run retires them a
chunk later, so the other rows are decoded in steps of another width or KV length, and the CPU
kernels round differently for other shapes (a step of width < 4 or over another KV length changes
the last bits of a row's logits): there the log-probs are compared at 1e-5.
CPU, float32, the tiny random-init model of tests/test_engine.py (tests/helpers.py).
"""

import pytest
import torch

from cohort_grpo.rollout import Engine
from cohort_grpo.rollout import overlap
from cohort_grpo.rollout.overlap import HostProgress
from cohort_grpo.rollout.sequence import Sequence
from cohort_grpo.models import from_pretrained
from cohort_grpo.rollout.sampler import SamplingParams
from helpers import ENGINE_FAMILIES as FAMILIES, ENGINE_TINY as TINY, CharTokenizer

torch.set_num_threads(1)  # as tests/test_engine.py, whose models these are

PROMPTS = [[(7 * i + j) % 300 for j in range(1 + i % 5)] for i in range(9)]
GENERATIONS = 2  # 18 sequences: more than 3 or 5 slots, so sequences wait and take freed slots


class RecordingEngine(Engine):
    """Records every decode step's (width, KV length, furthest live query position) and fails if a
    live query could read past the KV length the step was given."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps_seen: list[tuple[int, int, int]] = []

    def _decode_step(self, width, cache_len, sampling):
        live = ~self.state.finished[:width]
        furthest = int(self.state.position[:width][live].max()) if live.any() else -1
        assert furthest < cache_len, f"a query at position {furthest} needs more than {cache_len} keys"
        self.steps_seen.append((width, cache_len, furthest))
        return super()._decode_step(width, cache_len, sampling)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The tiny random-init Qwen2 of tests/test_engine.py, loaded by cohort."""
    config_class, model_class, extra = FAMILIES["qwen2"]
    torch.manual_seed(1)
    folder = tmp_path_factory.mktemp("qwen2_overlap")
    model_class(config_class(**TINY, **extra)).save_pretrained(folder)
    return from_pretrained(folder)


def run(model, overlap_checks, slots, interval, params, bucketed=False, max_seq_len=None, prompts=PROMPTS,
        generations=GENERATIONS):
    engine = RecordingEngine(model, tokenizer=CharTokenizer(), max_batch_size=slots, max_seq_len=max_seq_len,
                             check_interval=interval, overlap_checks=overlap_checks)
    engine.bucketed = bucketed  # pad steps to the CUDA-graph widths / KV lengths; compacts the tail
    return engine.generate(prompts, generations, params), engine


@pytest.fixture(scope="module")
def stopping(model):
    """EOS ids and a stop string taken from a free greedy run, so rows stop at various lengths."""
    free = Engine(model, max_batch_size=64).generate(PROMPTS, GENERATIONS, SamplingParams(30, temperature=0))
    ids = free.completion_ids
    return {"length": {}, "eos": {"eos_token_ids": [ids[0, 4].item(), ids[3, 9].item()]},
            "stop": {"stop": [CharTokenizer().decode(ids[1, 6:8].tolist())[-3:]]}}


# temperature, slots, check_interval, max_new_tokens, bucketed, how rows stop, max_seq_len (a cap
# below prompt + max_new_tokens gives longer prompts lower limits: rows end at their limits at
# different steps, so the tail is compacted even without early stops)
CASES = {
    "greedy-allfit-16-length": (0.0, 64, 16, 30, False, "length", None),
    "sampled-batching-3-length": (1.0, 3, 3, 13, False, "length", 16),
    "sampled-buckets-1-length": (1.0, 5, 1, 30, True, "length", 32),
    "greedy-buckets-3-length": (0.0, 5, 3, 14, True, "length", 17),
    "greedy-batching-16-eos": (0.0, 3, 16, 30, False, "eos", None),
    "sampled-batching-1-eos": (1.0, 3, 1, 13, False, "eos", None),
    "sampled-buckets-3-eos": (1.0, 5, 3, 30, True, "eos", None),
    "greedy-allfit-3-eos": (0.0, 64, 3, 30, False, "eos", None),
    "greedy-batching-3-stop": (0.0, 3, 3, 30, False, "stop", None),
    "sampled-buckets-16-stop": (1.0, 5, 16, 30, True, "stop", None),
    "sampled-allfit-1-stop": (1.0, 64, 1, 13, False, "stop", None),
    "greedy-buckets-1-stop": (0.0, 5, 1, 13, True, "stop", None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_overlap_samples_what_sync_then_launch_samples(model, stopping, case):
    temperature, slots, interval, new_tokens, bucketed, stop_kind, max_seq_len = CASES[case]
    params = SamplingParams(max_new_tokens=new_tokens, temperature=temperature, top_p=0.9, seed=5,
                            **stopping[stop_kind])
    expected, reference = run(model, False, slots, interval, params, bucketed, max_seq_len)
    got, engine = run(model, True, slots, interval, params, bucketed, max_seq_len)
    assert torch.equal(got.completion_ids, expected.completion_ids)
    assert torch.equal(got.completion_mask, expected.completion_mask)
    assert got.finish_reasons == expected.finish_reasons
    if stop_kind == "length":
        assert torch.equal(got.logprobs, expected.logprobs)
        assert engine.steps_seen == reference.steps_seen, "exact bounds: the same steps, width and KV length"
    else:
        assert "stop" in expected.finish_reasons and len(set(expected.completion_mask.sum(1).tolist())) > 1
        torch.testing.assert_close(got.logprobs, expected.logprobs, atol=1e-5, rtol=0)
    assert (got.logprobs[got.completion_mask == 0] == 0).all(), "nothing decoded past a stop leaks out"
    stats, reference_stats = engine.stats, reference.stats
    assert stats["speculative_chunks"] > 0, "some chunk should have been launched before the last was read"
    assert reference_stats["speculative_chunks"] == reference_stats["speculative_steps"] == 0
    assert stats["checks"] <= reference_stats["checks"]
    if bucketed:
        assert stats["slot_moves"] > 0 and reference_stats["slot_moves"] > 0, "the tail should be compacted"
    else:  # the KV length is the bound, not more: some step's furthest query reads the last key
        assert any(furthest == cache_len - 1 for _, cache_len, furthest in engine.steps_seen)


@pytest.mark.parametrize("stop_kind, slots", [("length", 5), ("eos", 64)])
def test_the_next_chunk_is_enqueued_before_the_host_waits(model, stopping, monkeypatch, stop_kind, slots):
    """At each host wait, count the decode steps already enqueued: with overlap more than the
    awaited progress covers (the next chunk is queued behind it), without exactly as many. With 18
    length-limited sequences in 5 slots, launching ahead needs the finished rows retired and the
    waiting ones admitted before the wait (the host knows they end at their limit)."""
    waits: list[tuple[int, int]] = []  # (steps the awaited progress covers, steps enqueued by then)
    real_wait = overlap.Snapshot.wait

    def recording_wait(snapshot):
        waits.append((snapshot.steps, len(current.steps_seen)))
        real_wait(snapshot)

    monkeypatch.setattr(overlap.Snapshot, "wait", recording_wait)
    params = SamplingParams(max_new_tokens=14, temperature=0.0, **stopping[stop_kind])
    for overlap_checks in (True, False):
        waits.clear()
        current = RecordingEngine(model, max_batch_size=slots, check_interval=3, overlap_checks=overlap_checks)
        current.generate(PROMPTS, GENERATIONS, params)
        assert len(waits) >= 4 and waits == sorted(waits)
        assert len(waits) == current.stats["checks"]
        if overlap_checks:
            assert all(enqueued > covered for covered, enqueued in waits), waits
        else:
            assert all(enqueued == covered for covered, enqueued in waits), waits


def test_length_limited_rows_skip_the_last_sync(model):
    """4 rows of 20 tokens, check_interval 3: the first token comes from prefill, the other 19 in
    ceil(19 / 3) = 7 chunks. Sync-then-launch reads the progress after each (7 checks); with overlap
    the host knows every row ends at its limit in the last chunk and never waits for it (6)."""
    params = SamplingParams(max_new_tokens=20, temperature=0.0)
    expected, reference = run(model, False, 8, 3, params, prompts=PROMPTS[:4], generations=1)
    got, engine = run(model, True, 8, 3, params, prompts=PROMPTS[:4], generations=1)
    assert torch.equal(got.completion_ids, expected.completion_ids) and torch.equal(got.logprobs, expected.logprobs)
    assert reference.stats["decode_steps"] == engine.stats["decode_steps"] == 19
    assert (reference.stats["checks"], engine.stats["checks"]) == (7, 6)


def test_rows_that_all_stop_early_waste_one_chunk(model):
    """Every row stops by EOS within the first chunk: the chunk launched before that was known is
    the only waste, and it is counted (rows x its steps)."""
    prompts, interval = PROMPTS[:4], 16
    free = Engine(model, max_batch_size=8).generate(prompts, 1, SamplingParams(40, temperature=0))
    params = SamplingParams(40, temperature=0, eos_token_ids=sorted(set(free.completion_ids[:, 1].tolist())))
    expected, reference = run(model, False, 8, interval, params, prompts=prompts, generations=1)
    got, engine = run(model, True, 8, interval, params, prompts=prompts, generations=1)
    assert torch.equal(got.completion_ids, expected.completion_ids) and torch.equal(got.logprobs, expected.logprobs)
    assert got.completion_mask.sum(1).max() <= 2 and got.finish_reasons == ["stop"] * 4
    assert reference.stats["decode_steps"] == interval and reference.stats["speculative_steps"] == 0
    assert engine.stats["decode_steps"] == 2 * interval
    assert engine.stats["speculative_steps"] == len(prompts) * interval
    assert engine.stats["checks"] == reference.stats["checks"] == 1


def test_a_stop_string_in_a_chunk_never_read_is_still_cut(model):
    """All rows end at their limit within the one chunk, so the overlapped engine retires them without
    reading its progress; the stop string completed in that chunk must still cut row 0."""
    tokenizer, prompts = CharTokenizer(), PROMPTS[:4]
    free = Engine(model, max_batch_size=8).generate(prompts, 1, SamplingParams(12, temperature=0))
    stop = tokenizer.decode(free.completion_ids[0, 9:11].tolist())[-3:]  # completed by token 10 or 11
    params = SamplingParams(12, temperature=0, stop=[stop])
    expected, reference = run(model, False, 8, 16, params, prompts=prompts, generations=1)
    got, engine = run(model, True, 8, 16, params, prompts=prompts, generations=1)
    assert (reference.stats["checks"], engine.stats["checks"]) == (1, 0)
    for row, tokens in enumerate(free.completion_ids.tolist()):  # independent: grow the text token by token
        cut = next((n for n in range(1, 13) if stop in tokenizer.decode(tokens[:n])), None)
        length = cut or 12
        assert got.completion_mask[row].sum() == length and got.completion_ids[row, :length].tolist() == tokens[:length]
        assert got.finish_reasons[row] == ("length" if cut is None else "stop")
    assert got.completion_mask[0].sum() <= 11
    assert torch.equal(got.completion_ids, expected.completion_ids) and got.finish_reasons == expected.finish_reasons
    assert torch.equal(got.logprobs, expected.logprobs)


def test_host_progress_bounds_a_count_by_the_steps_enqueued_since_it_was_read():
    seq = Sequence(index=3, prompt=[1], limit=10)
    progress = HostProgress()
    progress.steps = 4
    progress.known(seq, 2, at_steps=4)  # 2 tokens as of step 4
    assert (seq.generated, progress.pending(seq), progress.upper(seq)) == (2, 0, 2)
    progress.steps += 5
    assert (progress.pending(seq), progress.upper(seq)) == (5, 7)
    progress.steps += 5
    assert progress.upper(seq) == 10, "never past the limit"
    progress.known(seq, 6, at_steps=progress.steps - 5)  # read the progress after the earlier chunk
    assert progress.upper(seq) == 10 and progress.pending(seq) == 5
