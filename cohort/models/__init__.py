"""Our own decoder implementations (Llama, Mistral, Qwen2, Qwen3) and their loading / saving.

See docs/architecture.md, "Model", for the forward / KV-cache contract.
"""

from cohort.models.cache import KVCache
from cohort.models.config import SUPPORTED_MODEL_TYPES, ModelConfig, is_supported
from cohort.models.loading import from_pretrained, load_tokenizer, save_pretrained
from cohort.models.modeling import CausalLM

__all__ = [
    "CausalLM",
    "KVCache",
    "ModelConfig",
    "SUPPORTED_MODEL_TYPES",
    "from_pretrained",
    "is_supported",
    "load_tokenizer",
    "save_pretrained",
]
