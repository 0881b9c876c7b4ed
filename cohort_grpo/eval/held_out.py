"""The held-out evaluation inside a run: what `trainer.evaluate()` measures on eval_dataset, every `eval_steps` and
before and after training.

With a task's verifier, greedy accuracy, format rate and mean length (`eval/*`, cohort_grpo/eval/evaluate.py);
without one, the run's own reward functions' scores of G completions per prompt sampled as in training (`eval_*`,
cohort_grpo/eval/rewarded.py), as TRL. Each rank (or sampling group) evaluates its block of the rows and the
counts are summed over the ranks (`Parallel.evaluation_rows`, `Parallel.evaluation_sums`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Callable

from cohort_grpo.eval.evaluate import evaluate
from cohort_grpo.eval.rewarded import combined_metrics, metric_names, reward_metrics, sample_and_score
from cohort_grpo.parallel.distributed import Parallel
from cohort_grpo.rollout.batch import Batch


@dataclass
class HeldOutEvaluation:
    """The run's evaluation stage. `rows`: eval_dataset's rows (all ranks'); `task`: the verifier, None to score
    with the reward functions; `sampler`, `tokenizer`, `encode_prompt`, `toolbox`: greedy decoding on this rank's
    engine; `sample(rows)`: G completions per row as in training; `score(batch)`: sets the batch's rewards;
    `unchanged()`: a block after which the run's data order and sampling seeds are as they were."""

    rows: list[dict]
    task: object | None
    parallel: Parallel
    sampler: object
    tokenizer: object
    encode_prompt: Callable | None
    toolbox: object | None
    sample: Callable[[list[dict]], Batch]
    score: Callable[[Batch], None]
    unchanged: Callable[[], AbstractContextManager]
    max_new_tokens: int
    prompts_per_call: int
    group_size: int
    pad_id: int
    images: object | None = None  # a vision-language model's prompt renderer (rollout/images.py)

    def __call__(self, step: int, reward_names: list[str]) -> tuple[dict[str, float], str]:
        """The metrics at `step` and the line that says them; the reward functions' `reward_names` name the
        metrics of a run without a verifier (every rank passes the same, in order)."""
        if self.task is not None:
            return self.verified(step)
        return self.rewarded(step, reward_names)

    def verified(self, step: int) -> tuple[dict[str, float], str]:
        result = evaluate(self.sampler, self.tokenizer, self.task, self.parallel.evaluation_rows(self.rows),
                          self.encode_prompt, max_new_tokens=self.max_new_tokens,
                          toolbox=self.toolbox, images=self.images).summed(self.parallel.evaluation_sums)
        return result.metrics(), (f"eval (step {step}): accuracy={100 * result.accuracy:.1f}% on "
                                  f"{result.num_questions} problems")

    def rewarded(self, step: int, reward_names: list[str]) -> tuple[dict[str, float], str]:
        with self.unchanged():  # the run's data order and sampling seeds stay as they were
            batch = sample_and_score(self.parallel.evaluation_rows(self.rows), self.sample, self.score,
                                     self.prompts_per_call, self.pad_id)
        metrics = combined_metrics(reward_metrics(batch, self.group_size), metric_names(reward_names),
                                   self.parallel.evaluation_sums)
        return metrics, (f"eval (step {step}): reward={metrics.get('eval_reward', float('nan')):.4f} on "
                         f"{len(self.rows)} prompts")
