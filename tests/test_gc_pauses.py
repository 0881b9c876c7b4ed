"""Python's garbage collector in the training loop (cohort/gc_pauses.py): its pauses are measured,
the run's long-lived objects are frozen after the first step, and thawed when train() ends."""

import gc

import pytest

from cohort import GRPOConfig, GRPOTrainer
from cohort.gc_pauses import collector_seconds, freeze_long_lived_objects, thaw_frozen_objects

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
    assert freeze_long_lived_objects() == gc.get_freeze_count() > 0
    thaw_frozen_objects()
    assert gc.get_freeze_count() == 0
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


@pytest.mark.parametrize("freeze", [True, False])
def test_objects_are_frozen_from_the_second_step_and_thawed_at_the_end(tiny_dir, tmp_path, freeze):
    frozen_during_step = []

    def reward(completions, **kwargs):
        frozen_during_step.append(gc.get_freeze_count())
        return [float(len(c)) for c in completions]

    history = _trainer(tiny_dir, tmp_path, reward, gc_freeze=freeze).train()
    assert frozen_during_step[0] == 0
    assert all((n > 0) == freeze for n in frozen_during_step[1:]) and len(frozen_during_step) == 3
    assert gc.get_freeze_count() == 0
    assert all(r["time/gc"] >= 0 for r in history)


def test_a_run_that_raises_thaws_too(tiny_dir, tmp_path):
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
