"""Held-out evaluation: `evaluate.py` scores a sampler on a task's rows (greedy accuracy; from n
samples per question the unbiased pass@k for k = 1, 2, 4, …, n and maj@n; format rate, mean length),
the same code inside training (`eval_steps`) and from `cohort-grpo eval` (cohort_grpo/cli/eval.py); `passk.py`
holds the unbiased pass@k estimator and the majority vote."""
