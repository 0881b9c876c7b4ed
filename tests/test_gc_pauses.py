"""Python's garbage collector in the training loop (cohort_grpo/memory/gc_pauses.py): its pauses are measured,
the run's long-lived objects are frozen after the first step, and thawed when train() ends."""

import gc
import time

import pytest

from cohort_grpo import GRPOConfig, GRPOTrainer
from cohort_grpo.memory.gc_pauses import collector_seconds, freeze_long_lived_objects, thaw_frozen_objects

PROMPTS = [{"prompt": f"{a}+{b}="} for a in range(1, 9) for b in range(1, 4)]


def test_collector_seconds_counts_a_collection():
    before = collector_seconds()
    cycles = [[i] for i in range(100_000)]
    for c in cycles:
        c.append(c)
    del cycles
    gc.collect()
    assert collector_seconds() > before


def test_freeze_then_thaw_and_a_thaw_without_freeze_leaves_others_frozen_objects():
    if gc.get_freeze_count():  # gc.unfreeze() cannot tell whose objects it thaws
        pytest.skip(f"this interpreter had frozen {gc.get_freeze_count()} objects before the test")
    frozen = freeze_long_lived_objects()
    # at most that many: a thread of an earlier test may free a frozen object meanwhile
    assert 0 < gc.get_freeze_count() <= frozen, (gc.get_freeze_count(), frozen)
    thaw_frozen_objects()
    assert gc.get_freeze_count() == 0, gc.get_freeze_count()
    gc.freeze()  # someone else's freeze
    try:
        thaw_frozen_objects()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def _trainer(tiny_dir, tmp_path, reward, **overrides):
    options = dict(num_generations=4, per_device_train_batch_size=8, gradient_accumulation_steps=2,
                   max_completion_length=6, max_steps=3, output_dir=str(tmp_path), quiet=True, seed=0)
    options.update(overrides)
    return GRPOTrainer(tiny_dir, reward, PROMPTS, args=GRPOConfig(**options))


@pytest.fixture
def nothing_frozen():
    """Start with no frozen objects: an earlier test's run in this worker process may have left some (freezing
    only spares them from collection; thawing them is harmless)."""
    gc.unfreeze()


# torch.compile, on by default on a GPU, runs code in this process that can freeze or free frozen objects of
# its own during the run; these count the objects frozen by one run.
GC_COUNTS_ON_CPU = pytest.mark.cpu("counts of frozen objects: with torch.compile (a GPU's default) other code "
                                   "in the process changes them during the run")


@GC_COUNTS_ON_CPU
@pytest.mark.parametrize("freeze", [True, False])
@pytest.mark.slow
def test_objects_are_frozen_from_the_second_step_and_thawed_at_the_end(nothing_frozen, tiny_dir, tmp_path, freeze):
    frozen_during_step = []

    def reward(completions, **kwargs):
        frozen_during_step.append(gc.get_freeze_count())
        return [float(len(c)) for c in completions]

    # Counted from what was frozen before the run: another library of the process may freeze objects of its
    # own (torch.compile's workers do, on a GPU), and the run must leave those as it found them.
    before = gc.get_freeze_count()
    trainer = _trainer(tiny_dir, tmp_path, reward, gc_freeze=freeze)
    trainer.train()
    history = trainer.history
    assert frozen_during_step[0] == before
    assert all((n > before) == freeze for n in frozen_during_step[1:]) and len(frozen_during_step) == 3, frozen_during_step
    if before == 0:  # thawed at the end (what others froze first is left frozen: gc.unfreeze thaws all)
        assert gc.get_freeze_count() == 0, gc.get_freeze_count()


def test_each_step_logs_the_collector_pauses_inside_it(tiny_dir, tmp_path):
    """A reward function that leaves cyclic garbage and collects it at step 2: that step's `time/gc` holds
    at least that pause, timed here by a gc callback of our own, and the next step's holds none of it."""
    pauses, started = [], []

    def timer(phase, info):
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses.append(time.perf_counter() - started.pop())

    calls = []

    def reward(completions, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            cycles = [[i] for i in range(300_000)]
            for c in cycles:
                c.append(c)
            del cycles
            gc.callbacks.append(timer)
            try:
                gc.collect()
            finally:
                gc.callbacks.remove(timer)
        return [float(len(c)) for c in completions]

    trainer = _trainer(tiny_dir, tmp_path, reward, gc_freeze=True)
    trainer.train()
    history = trainer.history
    assert len(pauses) == 1 and pauses[0] > 5e-3, pauses  # a full collection of 300,000 cycles
    # the trainer's callback times the same collection (a few callbacks' worth apart from ours)
    assert history[1]["time/gc"] >= 0.9 * pauses[0]
    # each step logs its own pauses, not the run's so far: step 3, with the run's objects frozen,
    # collected only what it made itself
    assert history[2]["time/gc"] < 0.5 * pauses[0]
    assert all(r["time/gc"] <= r["step_time"] for r in history[1:])


@GC_COUNTS_ON_CPU
def test_a_run_that_raises_thaws_too(nothing_frozen, tiny_dir, tmp_path):
    trainer = _trainer(tiny_dir, tmp_path, lambda completions, **kwargs: [0.5] * len(completions))
    score = trainer.score

    def failing_score(batch):
        if trainer.step == 2:
            assert gc.get_freeze_count() > 0
            raise RuntimeError("stopped at step 2")
        return score(batch)

    trainer.score = failing_score
    with pytest.raises(RuntimeError, match="step 2"):
        trainer.train()
    assert gc.get_freeze_count() == 0
