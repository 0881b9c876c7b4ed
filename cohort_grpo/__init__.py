"""cohort: GRPO (DeepSeekMath Algorithm 1) for language models.

    from cohort_grpo import GRPOConfig, GRPOTrainer

With `rollout_gpus` under torchrun, the last ranks only sample: there, `SamplingRank(model, args).serve()`
runs instead of the trainer (`is_sampling_rank(args)` tells the ranks apart; `cohort-grpo train` does this itself).
"""

from __future__ import annotations

import importlib

# The config is light (no torch) and teaches cohort_grpo.errors how a Python caller spells an option: loaded first,
# so an error message reads the same whatever module the caller imported.
import cohort_grpo.config  # noqa: F401

__all__ = ["GRPOConfig", "GRPOTrainer", "SamplingRank", "is_sampling_rank"]
__version__ = "0.1.0"

# The names load on first use (PEP 562): importing the trainer pulls in torch, transformers and peft, some
# five seconds that `cohort-grpo --version`, `--help` and a mistyped command must not wait for.
_HOMES = {"GRPOConfig": ".config", "GRPOTrainer": ".trainer.grpo_trainer", "SamplingRank": ".run.sampling_rank",
          "is_sampling_rank": ".run.sampling_rank"}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'cohort_grpo' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name], __name__), name)
    globals()[name] = value  # once loaded, an ordinary attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
