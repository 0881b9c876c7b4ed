"""Held-out evaluation: `evaluate.py` scores a sampler on a task's rows (pass@1, pass@k, maj@k, format
rate, mean length), the same code inside training (`eval_steps`) and from `cohort eval`
(cohort/cli/eval.py); `passk.py` holds the unbiased pass@k estimator and the majority vote."""
