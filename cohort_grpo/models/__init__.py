"""Our own decoder implementations (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral) and their loading / saving.

`causal_lm.py` is the model (and writes its Hugging Face folder) over the layers of `decoder.py`;
`loading.py` reads model files (folder, hub id, GGUF via `gguf.py`) into it; `policy.py` turns whatever
the user named into a policy and its tokenizer (nothing: the built-in `tiny.py` model; a family we do not implement:
transformers' own). See docs/architecture.md, "Model", for the forward / KV-cache contract.
"""

from cohort_grpo.models.cache import KVCache
from cohort_grpo.models.config import SUPPORTED_MODEL_TYPES, ModelConfig, is_supported
from cohort_grpo.models.loading import from_pretrained, load_tokenizer
from cohort_grpo.models.causal_lm import CausalLM, save_pretrained

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
