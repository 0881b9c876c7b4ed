"""cohort: GRPO (DeepSeekMath Algorithm 1) for language models.

    from cohort import GRPOConfig, GRPOTrainer

With `rollout_gpus` under torchrun, the last ranks only sample: there, `SamplingRank(model, args).serve()`
runs instead of the trainer (`is_sampling_rank(args)` tells the ranks apart; `cohort train` does this itself).
"""

from .config import GRPOConfig
from .algorithm.trainer import GRPOTrainer
from .rollout.sampling_rank import SamplingRank, is_sampling_rank

__all__ = ["GRPOConfig", "GRPOTrainer", "SamplingRank", "is_sampling_rank"]
__version__ = "0.1.0"
