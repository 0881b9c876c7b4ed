"""cohort: GRPO (DeepSeekMath Algorithm 1) for language models.

    from cohort import GRPOConfig, GRPOTrainer
"""

from .config import GRPOConfig
from .algorithm.trainer import GRPOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer"]
__version__ = "0.1.0"
